//! GPU tests of the NCCL backend (cargo feature `nccl`). Each prints `skipped: <reason>` and
//! returns where the CUDA driver, NCCL or a GPU is missing (or NCCL is older than 2.30 for the
//! tests that put two ranks on one GPU).
//!
//! - world 1: every collective, every element type, against a naive host reference; argument
//!   validation;
//! - worlds 2, 3 and 4 as threads on one GPU (`NCCL_MULTI_RANK_GPU_ENABLE=1`, in a child
//!   process so that the variable is set before NCCL reads it; NCCL >= 2.30): every collective,
//!   cross-rank mismatch and invalid-argument detection, split, and (world 2) a peer that never
//!   arrives (timeout, then aborted);
//! - two processes on one GPU started through `fsdp_collectives::launch`, rendezvous through the
//!   store.
#![cfg(feature = "nccl")]

mod nccl_common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fsdp_allocator::cuda::CudaAllocator;
use fsdp_collectives::nccl::{NcclCommunicator, NcclOptions, UniqueId};
use fsdp_collectives::{CollectiveError, Communicator, ReduceOp};
use fsdp_device::half::{bf16, f16};
use fsdp_device::{Buffer, DType, Element};
use nccl_common::*;

/// Compare a reduction's result: exactly where the test values make it exact in every type
/// (sums, minima, maxima; products and averages over two ranks), else within a relative bound
/// (NCCL rounds averages and longer products in its own order).
fn assert_reduced<T: Element>(what: &str, op: ReduceOp, w: usize, got: &[f64], want: &[f64]) {
    let inexact = w > 2 && matches!(op, ReduceOp::Avg | ReduceOp::Product);
    if inexact {
        let rel = if T::DTYPE.size_in_bytes() == 2 {
            2e-2
        } else {
            1e-6
        };
        assert_close(what, got, want, rel);
    } else {
        assert_vals(what, got, want);
    }
}

/// Every collective on `comm` (rank `r` of `w`) with elements of `T`, against the host
/// reference; every rank of the group runs this at the same time.
fn every_collective<T: Element>(comm: &NcclCommunicator, alloc: &CudaAllocator) {
    let (r, w) = (comm.rank(), comm.world_size());
    let t = T::DTYPE;
    for n in [1usize, 5, 4099] {
        // all_gather_base, out of place and in place.
        let input = upload::<T>(comm, alloc, &(0..n).map(|i| val(r, i)).collect::<Vec<_>>());
        let output = upload::<T>(comm, alloc, &vec![-1.0; w * n]);
        comm.all_gather_base(&input, &output)
            .unwrap()
            .wait()
            .unwrap();
        let want: Vec<f64> = (0..w)
            .flat_map(|j| (0..n).map(move |i| val(j, i)))
            .collect();
        assert_vals(
            &format!("{t} all_gather_base n={n}"),
            &download::<T>(comm, &output),
            &want,
        );

        let mut pre = vec![-1.0; w * n];
        for i in 0..n {
            pre[r * n + i] = val(r, i);
        }
        let output = upload::<T>(comm, alloc, &pre);
        let own = output.slice(r * n..(r + 1) * n).unwrap();
        comm.all_gather_base(&own, &output).unwrap().wait().unwrap();
        assert_vals(
            &format!("{t} in-place all_gather_base n={n}"),
            &download::<T>(comm, &output),
            &want,
        );

        for op in ReduceOp::ALL {
            // reduce_scatter_base, out of place and in place.
            let data: Vec<f64> = (0..w * n).map(|i| val(r, i)).collect();
            let input = upload::<T>(comm, alloc, &data);
            let output = upload::<T>(comm, alloc, &vec![-1.0; n]);
            comm.reduce_scatter_base(&input, &output, op)
                .unwrap()
                .wait()
                .unwrap();
            let want: Vec<f64> = (0..n)
                .map(|i| reference(op, (0..w).map(|j| val(j, r * n + i)), w))
                .collect();
            let what = format!("{t} reduce_scatter_base {op} n={n}");
            assert_reduced::<T>(&what, op, w, &download::<T>(comm, &output), &want);
            let input = upload::<T>(comm, alloc, &data);
            let own = input.slice(r * n..(r + 1) * n).unwrap();
            comm.reduce_scatter_base(&input, &own, op)
                .unwrap()
                .wait()
                .unwrap();
            assert_reduced::<T>(
                &format!("in-place {what}"),
                op,
                w,
                &download::<T>(comm, &own),
                &want,
            );

            // all_reduce.
            let buf = upload::<T>(comm, alloc, &(0..n).map(|i| val(r, i)).collect::<Vec<_>>());
            comm.all_reduce(&buf, op).unwrap().wait().unwrap();
            let want: Vec<f64> = (0..n)
                .map(|i| reference(op, (0..w).map(|j| val(j, i)), w))
                .collect();
            assert_reduced::<T>(
                &format!("{t} all_reduce {op} n={n}"),
                op,
                w,
                &download::<T>(comm, &buf),
                &want,
            );
        }

        // broadcast from the last rank, reduce (sum and max) to rank 0.
        let root = w - 1;
        let buf = upload::<T>(comm, alloc, &(0..n).map(|i| val(r, i)).collect::<Vec<_>>());
        comm.broadcast(&buf, root).unwrap().wait().unwrap();
        let want: Vec<f64> = (0..n).map(|i| val(root, i)).collect();
        assert_vals(
            &format!("{t} broadcast n={n}"),
            &download::<T>(comm, &buf),
            &want,
        );
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let mine: Vec<f64> = (0..n).map(|i| val(r, i)).collect();
            let buf = upload::<T>(comm, alloc, &mine);
            comm.reduce(&buf, op, 0).unwrap().wait().unwrap();
            let want: Vec<f64> = if r == 0 {
                (0..n)
                    .map(|i| reference(op, (0..w).map(|j| val(j, i)), w))
                    .collect()
            } else {
                mine
            };
            assert_vals(
                &format!("{t} reduce {op} n={n}"),
                &download::<T>(comm, &buf),
                &want,
            );
        }
    }

    // Unequal all-gather: rank j contributes j + 2 elements.
    let input = upload::<T>(
        comm,
        alloc,
        &(0..r + 2).map(|i| val(r, i)).collect::<Vec<_>>(),
    );
    let outputs: Vec<Buffer> = (0..w)
        .map(|j| upload::<T>(comm, alloc, &vec![-1.0; j + 2]))
        .collect();
    comm.all_gather(&input, &outputs).unwrap().wait().unwrap();
    for (j, o) in outputs.iter().enumerate() {
        let want: Vec<f64> = (0..j + 2).map(|i| val(j, i)).collect();
        assert_vals(
            &format!("{t} all_gather outputs[{j}]"),
            &download::<T>(comm, o),
            &want,
        );
    }
    comm.barrier().unwrap().wait().unwrap();
}

fn every_type(comm: &NcclCommunicator, alloc: &CudaAllocator) {
    every_collective::<f32>(comm, alloc);
    every_collective::<f64>(comm, alloc);
    every_collective::<bf16>(comm, alloc);
    every_collective::<f16>(comm, alloc);
}

fn world1() -> NcclCommunicator {
    let id = UniqueId::new().unwrap();
    NcclCommunicator::from_unique_id(&id, 0, 1, 0, opts()).unwrap()
}

#[test]
fn world1_every_collective_matches_the_host_reference() {
    if let Some(why) = skip_reason() {
        println!("skipped: {why}");
        return;
    }
    let comm = world1();
    let alloc = allocator();
    every_type(&comm, &alloc);
}

#[test]
fn world1_invalid_arguments_are_rejected_before_nccl() {
    if let Some(why) = skip_reason() {
        println!("skipped: {why}");
        return;
    }
    let comm = world1();
    let alloc = allocator();
    let dev = |dtype: DType, n: usize| alloc.allocate_buffer(dtype, n, comm.cuda_stream()).unwrap();
    let expect_invalid = |r: fsdp_collectives::Result<fsdp_collectives::Work>, needle: &str| match r
    {
        Err(e @ CollectiveError::InvalidArgument { rank: 0, .. }) => {
            assert!(e.to_string().contains(needle), "{e} (wanted {needle:?})")
        }
        other => panic!("expected InvalidArgument containing {needle:?}, got {other:?}"),
    };
    let host = Buffer::zeros(DType::F32, 4).unwrap();
    expect_invalid(comm.all_reduce(&host, ReduceOp::Sum), "got a buffer on cpu");
    expect_invalid(
        comm.all_gather_base(&dev(DType::F32, 4), &dev(DType::F32, 5)),
        "output has 5 elements",
    );
    expect_invalid(
        comm.reduce_scatter_base(&dev(DType::F32, 3), &dev(DType::F32, 4), ReduceOp::Sum),
        "input has 3 elements",
    );
    expect_invalid(
        comm.all_gather_base(&dev(DType::F32, 4), &dev(DType::BF16, 4)),
        "different element types",
    );
    expect_invalid(
        comm.broadcast(&dev(DType::F16, 4), 1),
        "root 1 >= world size 1",
    );
    expect_invalid(
        comm.reduce(&dev(DType::F16, 4), ReduceOp::Sum, 3),
        "root 3 >= world size 1",
    );
    let big = dev(DType::F32, 8);
    expect_invalid(
        comm.all_gather_base(&big.slice(2..6).unwrap(), &big.slice(0..4).unwrap()),
        "other than as this rank's block",
    );
    expect_invalid(
        comm.all_gather(&dev(DType::F32, 2), &[dev(DType::F32, 3)]),
        "outputs[0] has 3 elements",
    );
    expect_invalid(
        comm.all_gather(&dev(DType::F32, 2), &[]),
        "0 output buffers",
    );
    let err = comm
        .copy_from_host(&dev(DType::F32, 2), &[1.0f32])
        .unwrap_err();
    assert!(err.to_string().contains("host data of 1"), "{err}");
    // The communicator still works.
    let buf = upload::<f32>(&comm, &alloc, &[1.0, 2.0]);
    comm.all_reduce(&buf, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(download::<f32>(&comm, &buf), vec![1.0, 2.0]);
}

#[test]
fn worlds_2_to_4_threads_on_one_gpu() {
    if std::env::var(ROLE).is_ok() {
        return; // inside a child of another test
    }
    if let Some(why) = skip_reason_shared_gpu() {
        println!("skipped: {why}");
        return;
    }
    for w in 2..=4 {
        let (ok, out) = spawn_self("world_threads_child", &format!("threads:{w}"))
            .wait(Duration::from_secs(600));
        println!("{out}");
        assert!(ok, "world {w}: child failed:\n{out}");
        assert!(out.contains(&format!("world{w}-threads ok")), "{out}");
    }
}

/// The body of `worlds_2_to_4_threads_on_one_gpu` for the world in `FSDP_NCCL_TEST_ROLE`
/// (`threads:<w>`), run in a child process with `NCCL_MULTI_RANK_GPU_ENABLE=1`; does nothing
/// when run directly.
#[test]
fn world_threads_child() {
    let Some(w) = std::env::var(ROLE).ok().and_then(|r| {
        r.strip_prefix("threads:")
            .and_then(|w| w.parse::<usize>().ok())
    }) else {
        return;
    };
    let id = UniqueId::new().unwrap();
    let results: Vec<()> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..w)
            .map(|r| {
                s.spawn(move || {
                    let comm = NcclCommunicator::from_unique_id(&id, r, w, 0, opts()).unwrap();
                    let alloc = allocator();
                    every_type(&comm, &alloc);
                    cross_rank_checks(&comm, &alloc);
                    if w == 2 {
                        split_checks(&comm, &alloc);
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results.len(), w);
    if w == 2 {
        peer_never_arrives();
    }
    println!("world{w}-threads ok");
}

/// Mismatched and invalid calls fail on every rank before data moves; the group stays usable.
fn cross_rank_checks(comm: &NcclCommunicator, alloc: &CudaAllocator) {
    let r = comm.rank();
    let w = comm.world_size();
    let buf = upload::<f32>(comm, alloc, &vec![1.0; 4 + r]);
    // The check fails the call when it is issued, on every rank.
    match comm.all_reduce(&buf, ReduceOp::Sum).and_then(|w| w.wait()) {
        Err(CollectiveError::Mismatch { details, .. }) => {
            assert!(
                details.contains("count=4") && details.contains("count=5"),
                "{details}"
            )
        }
        other => panic!("rank {r}: expected Mismatch, got {other:?}"),
    }
    let host = Buffer::zeros(DType::F32, 4).unwrap();
    let dev = upload::<f32>(comm, alloc, &[1.0; 4]);
    if r == 0 {
        assert!(matches!(
            comm.all_reduce(&host, ReduceOp::Sum),
            Err(CollectiveError::InvalidArgument { rank: 0, .. })
        ));
    } else {
        match comm.all_reduce(&dev, ReduceOp::Sum).and_then(|w| w.wait()) {
            Err(CollectiveError::Mismatch { details, .. }) => {
                assert!(
                    details.contains("rank 0 issued all_reduce with invalid"),
                    "{details}"
                )
            }
            other => panic!("rank {r}: expected Mismatch, got {other:?}"),
        }
    }
    let buf = upload::<f32>(comm, alloc, &[r as f64 + 1.0; 3]);
    comm.all_reduce(&buf, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    let want = (1..=w).sum::<usize>() as f32;
    assert_eq!(download::<f32>(comm, &buf), vec![want as f64; 3]);
}

fn split_checks(comm: &NcclCommunicator, alloc: &CudaAllocator) {
    let r = comm.rank();
    // Same color, reversed keys: the new ranks are reversed.
    let rev = comm.split_nccl(Some(0), 1 - r).unwrap().unwrap();
    assert_eq!((rev.rank(), rev.world_size()), (1 - r, 2));
    let input = upload::<f32>(&rev, alloc, &[r as f64; 2]);
    let output = upload::<f32>(&rev, alloc, &[-1.0; 4]);
    rev.all_gather_base(&input, &output)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(download::<f32>(&rev, &output), vec![1.0, 1.0, 0.0, 0.0]);
    // One color per rank, and rank 1 joining no group.
    let own = comm.split(if r == 0 { Some(7) } else { None }, 0).unwrap();
    assert_eq!(
        own.as_ref().map(|c| (c.rank(), c.world_size())),
        (r == 0).then_some((0, 1))
    );
    // The parent still works after the splits.
    let buf = upload::<f32>(comm, alloc, &[2.0; 2]);
    comm.all_reduce(&buf, ReduceOp::Product)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(download::<f32>(comm, &buf), vec![4.0; 2]);
}

/// Rank 1 never reaches the collective: rank 0 fails with Timeout within the timeout, and its
/// communicator is aborted.
fn peer_never_arrives() {
    let id = UniqueId::new().unwrap();
    let short = NcclOptions::default().with_timeout(Duration::from_secs(3));
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let short1 = short.clone();
        let h1 = s.spawn(move || {
            let comm = NcclCommunicator::from_unique_id(&id, 1, 2, 0, short1).unwrap();
            // Stay alive (doing nothing) until rank 0 has failed.
            rx.recv_timeout(Duration::from_secs(60)).unwrap();
            drop(comm);
        });
        let comm = NcclCommunicator::from_unique_id(&id, 0, 2, 0, short.clone()).unwrap();
        let alloc = allocator();
        let buf = upload::<f32>(&comm, &alloc, &[1.0; 4]);
        let t0 = Instant::now();
        // With the check on, the description exchange times out; without it, the watchdog
        // times the collective out: either way a Timeout, then Aborted.
        let r = comm
            .all_reduce(&buf, ReduceOp::Sum)
            .and_then(|w| w.synchronize());
        let took = t0.elapsed();
        tx.send(()).unwrap();
        assert!(
            matches!(r, Err(CollectiveError::Timeout { rank: 0, .. })),
            "{r:?}"
        );
        assert!(took < Duration::from_secs(20), "took {took:?}");
        assert!(matches!(
            comm.barrier(),
            Err(CollectiveError::Aborted { rank: 0, .. })
        ));
        h1.join().unwrap();
    });
}

/// A `Write` into a shared buffer, for the launcher's forwarded output.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn two_processes_through_launch() {
    use fsdp_collectives::launch::{run_with_output, LaunchOptions};
    if std::env::var(ROLE).is_ok() {
        return;
    }
    if let Some(why) = skip_reason_shared_gpu() {
        println!("skipped: {why}");
        return;
    }
    let opts = LaunchOptions::new(2, std::env::current_exe().unwrap())
        .with_args(["--exact", "launch_child", "--nocapture", "--test-threads=1"])
        .with_master("127.0.0.1", 0)
        .with_env(ROLE, "launch")
        .with_env("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        .with_max_duration(Duration::from_secs(300));
    let (out, err) = (Captured::default(), Captured::default());
    let report = run_with_output(&opts, out.clone(), err.clone()).unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.0.lock().unwrap()),
        String::from_utf8_lossy(&err.0.lock().unwrap())
    );
    println!("{text}");
    assert!(report.success(), "{report:?}\n{text}");
    for r in 0..2 {
        assert!(
            text.contains(&format!("[rank {r}] nccl-launch-child {r} ok")),
            "{text}"
        );
    }
}

/// One rank of `two_processes_through_launch`; does nothing when not started by it.
#[test]
fn launch_child() {
    if std::env::var(ROLE).as_deref() != Ok("launch") {
        return;
    }
    let env = fsdp_collectives::LaunchEnv::from_env().unwrap().unwrap();
    let store = env.rendezvous(TIMEOUT).unwrap();
    let comm = NcclCommunicator::new(&store, 0, opts()).unwrap();
    let (r, w) = (comm.rank(), comm.world_size());
    assert_eq!((r, w), (env.rank, 2));
    let alloc = allocator();
    every_collective::<f32>(&comm, &alloc);
    every_collective::<bf16>(&comm, &alloc);
    // A second communicator on the same store gets its own unique id.
    let again = NcclCommunicator::new(&store, 0, opts()).unwrap();
    let buf = upload::<f32>(&again, &alloc, &[r as f64 + 1.0; 8]);
    again
        .all_reduce(&buf, ReduceOp::Max)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(download::<f32>(&again, &buf), vec![2.0; 8]);
    comm.barrier().unwrap().wait().unwrap();
    store.barrier("nccl-test-end", TIMEOUT).unwrap();
    println!("nccl-launch-child {r} ok");
}
