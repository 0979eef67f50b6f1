//! GPU tests of the NCCL backend's stream ordering and failure handling (cargo feature `nccl`).
//! Each prints `skipped: <reason>` and returns where the CUDA driver, NCCL or a GPU is missing
//! (or NCCL is older than 2.30 for the tests that put several ranks on one GPU).
//!
//! - the upload race of issue 15: 200 rounds of "upload 256 MiB, all-gather at once" on blocks
//!   the caching allocator recycles; the gathered data is never stale;
//! - the current stream: a collective waits (on the GPU) for work enqueued on the caller's
//!   stream before it, and `Work::wait` orders the caller's stream after the collective;
//! - abort of every rank: in a world of 3 ranks (threads on one GPU), ranks 0 and 1 start an
//!   all-reduce that rank 2 never joins; their watchdogs time it out and publish the abort, and
//!   every rank — rank 2 included — fails its next call with `Aborted` within a bound.
#![cfg(feature = "nccl")]

mod nccl_common;

use std::time::{Duration, Instant};

use fsdp_collectives::nccl::{NcclCommunicator, NcclOptions, UniqueId};
use fsdp_collectives::{CollectiveError, Communicator, ReduceOp};
use fsdp_device::{DType, Stream};
use nccl_common::*;

#[test]
fn upload_then_all_gather_at_once_is_never_stale() {
    if let Some(why) = skip_reason() {
        println!("skipped: {why}");
        return;
    }
    let id = UniqueId::new().unwrap();
    let comm = NcclCommunicator::from_unique_id(&id, 0, 1, 0, opts()).unwrap();
    let alloc = allocator();
    let n = (256 << 20) / 4; // 256 MiB of f32
    let mut host = vec![0f32; n];
    for round in 0..200u32 {
        let v = round as f32 + 1.0;
        host.iter_mut().enumerate().for_each(|(i, x)| {
            *x = if i % 4099 == 0 { -v } else { v };
        });
        // Fresh buffers each round: the allocator hands out the blocks of the previous round.
        let input = alloc
            .allocate_buffer(DType::F32, n, comm.cuda_stream())
            .unwrap();
        let output = alloc
            .allocate_buffer(DType::F32, n, comm.cuda_stream())
            .unwrap();
        comm.copy_from_host(&input, &host).unwrap();
        comm.all_gather_base(&input, &output)
            .unwrap()
            .wait()
            .unwrap();
        drop(input);
        let got = comm.copy_to_host::<f32>(&output).unwrap();
        if let Some(i) = got.iter().zip(&host).position(|(g, h)| g != h) {
            panic!(
                "round {round}: element {i} is {} (expected {}): stale data",
                got[i], host[i]
            );
        }
    }
}

#[test]
fn collectives_are_ordered_after_the_current_stream() {
    if let Some(why) = skip_reason() {
        println!("skipped: {why}");
        return;
    }
    let id = UniqueId::new().unwrap();
    let comm = NcclCommunicator::from_unique_id(&id, 0, 1, 0, opts()).unwrap();
    let alloc = allocator();
    let compute = Stream::cuda(0, "compute").unwrap();
    comm.set_current_stream(&compute).unwrap();
    let cs = compute.cuda_stream().unwrap();
    let n = 16 << 20;
    for round in 0..20u8 {
        // The producer runs on the compute stream (a device memset, enqueued without any host
        // wait); the all-gather must see its result.
        let input = alloc.allocate_buffer(DType::F32, n, cs).unwrap();
        let output = alloc.allocate_buffer(DType::F32, n, cs).unwrap();
        let word = f32::from(round + 1).to_bits();
        {
            let g = input
                .access(fsdp_device::AccessMode::Exclusive)
                .acquire(TIMEOUT)
                .unwrap();
            // SAFETY: `n` 32-bit words of device memory of this context, written on `cs`
            // (cudarc's result layer has no 32-bit memset).
            unsafe {
                cudarc::driver::sys::cuMemsetD32Async(g.as_ptr() as u64, word, n, cs.cu_stream())
            }
            .result()
            .unwrap();
        }
        comm.all_gather_base(&input, &output)
            .unwrap()
            .wait()
            .unwrap();
        let got = comm.copy_to_host::<f32>(&output).unwrap();
        assert!(
            got.iter().all(|&x| x == f32::from(round + 1)),
            "round {round}: the all-gather ran before the producer on the current stream"
        );
    }
    let bad = Stream::cpu("host");
    assert!(comm.set_current_stream(&bad).is_err());
}

#[test]
fn one_rank_timing_out_aborts_every_rank() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    if let Some(why) = skip_reason_shared_gpu() {
        println!("skipped: {why}");
        return;
    }
    let (ok, out) = spawn_self("abort_all_child", "abort-all").wait(Duration::from_secs(300));
    println!("{out}");
    assert!(ok, "child failed:\n{out}");
    assert!(out.contains("abort-all ok"), "{out}");
}

/// The body of `one_rank_timing_out_aborts_every_rank`, in a child process with
/// `NCCL_MULTI_RANK_GPU_ENABLE=1`; does nothing when run directly.
#[test]
fn abort_all_child() {
    if std::env::var(ROLE).as_deref() != Ok("abort-all") {
        return;
    }
    let timeout = Duration::from_secs(3);
    // The check off: the collective reaches the GPU and the watchdog times it out.
    let short = NcclOptions::default()
        .with_timeout(timeout)
        .with_init_timeout(TIMEOUT)
        .with_verify(false);
    let id = UniqueId::new().unwrap();
    let bound = timeout + Duration::from_secs(5);
    std::thread::scope(|s| {
        for r in 0..3 {
            let short = short.clone();
            s.spawn(move || {
                let comm = NcclCommunicator::from_unique_id(&id, r, 3, 0, short).unwrap();
                let alloc = allocator();
                let buf = upload::<f32>(&comm, &alloc, &[1.0; 1024]);
                let t0 = Instant::now();
                if r < 2 {
                    let res = comm
                        .all_reduce(&buf, ReduceOp::Sum)
                        .and_then(|w| w.synchronize());
                    assert!(
                        matches!(
                            res,
                            Err(CollectiveError::Timeout { .. } | CollectiveError::Aborted { .. })
                        ),
                        "rank {r}: {res:?}"
                    );
                } else {
                    // Rank 2 never joins; it learns of the abort through the flag.
                    while comm.abort_reason().is_none() && t0.elapsed() < bound {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                let took = t0.elapsed();
                assert!(took < bound, "rank {r}: aborted after {took:?}");
                let next = comm.all_reduce(&buf, ReduceOp::Sum);
                assert!(
                    matches!(next, Err(CollectiveError::Aborted { rank, .. }) if rank == r),
                    "rank {r}: next call gave {next:?}"
                );
                let t1 = Instant::now();
                drop(comm);
                assert!(
                    t1.elapsed() < Duration::from_secs(15),
                    "rank {r}: dropping an aborted communicator took {:?}",
                    t1.elapsed()
                );
            });
        }
    });
    println!("abort-all ok");
}
