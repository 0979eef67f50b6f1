//! All-gather base through NCCL on GPU 0: criterion timings per size (1 MiB .. 1 GiB of gathered
//! output), and algbw / busbw per size as nccl-tests reports them (algbw = output bytes / time,
//! busbw = algbw · (n − 1) / n; at world 1 busbw is meaningless and printed as n/a). World 1, and
//! world 2 as two threads on the same GPU where NCCL ≥ 2.30 allows it
//! (`NCCL_MULTI_RANK_GPU_ENABLE=1` is set by this program). A batch times only its collectives
//! and a host wait for the last one's end event (no barrier, no check). The cross-rank call check
//! is off; extra lines measure it on (its cost per collective).
//!
//! Gaps: 32 back-to-back 16 MiB all-gathers through this backend against 32 calls of raw NCCL
//! (cudarc's `nccl::result`, a communicator of its own on its own stream) in the same process at
//! world 1; prints the ratio and the latency this backend adds per collective (goal: within 10%,
//! at most 10 µs).
//!
//! `cargo bench -p fsdp-collectives --features nccl --bench nccl_all_gather`; prints `skipped`
//! and exits 0 without a GPU or NCCL.

use std::ffi::c_void;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cudarc::driver::result as cu;
use cudarc::nccl::{result as nccl_raw, sys as nccl_sys};

use criterion::{BenchmarkId, Criterion, Throughput};
use fsdp_allocator::cuda::{CudaAllocator, CudaSource};
use fsdp_allocator::AllocatorConfig;
use fsdp_collectives::nccl::{self, NcclCommunicator, NcclOptions, UniqueId};
use fsdp_collectives::Communicator;
use fsdp_device::{Buffer, DType};

const MIB: usize = 1 << 20;
const SIZES: [usize; 6] = [MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB];

struct Rank {
    comm: NcclCommunicator,
    bufs: Vec<(Buffer, Buffer)>,
}

impl Rank {
    fn new(id: &UniqueId, rank: usize, world: usize, verify: bool) -> Rank {
        let opts = NcclOptions::default()
            .with_timeout(Duration::from_secs(120))
            .with_verify(verify);
        let comm = NcclCommunicator::from_unique_id(id, rank, world, 0, opts).unwrap();
        let alloc =
            CudaAllocator::new(CudaSource::new(0).unwrap(), AllocatorConfig::default()).unwrap();
        let bufs = SIZES
            .iter()
            .map(|&bytes| {
                let out_elems = bytes / 2;
                let input = alloc
                    .allocate_buffer(DType::BF16, out_elems / world, comm.cuda_stream())
                    .unwrap();
                let output = alloc
                    .allocate_buffer(DType::BF16, out_elems, comm.cuda_stream())
                    .unwrap();
                (input, output)
            })
            .collect();
        Rank { comm, bufs }
    }

    /// `iters` all-gathers back to back, then a host wait for the last one (the NCCL stream
    /// runs them in order).
    fn run(&self, size_idx: usize, iters: u64) -> Duration {
        let (input, output) = &self.bufs[size_idx];
        let t0 = Instant::now();
        let mut last = None;
        for _ in 0..iters {
            last = Some(self.comm.all_gather_base(input, output).unwrap());
        }
        if let Some(w) = last {
            w.synchronize().unwrap();
        }
        t0.elapsed()
    }
}

fn report(world: usize, label: &str, bytes: usize, per_op: Duration) {
    let algbw = bytes as f64 / per_op.as_secs_f64() / 1e9;
    let busbw = if world > 1 {
        format!("{:7.2} GB/s", algbw * (world as f64 - 1.0) / world as f64)
    } else {
        "n/a (world 1)".into()
    };
    println!(
        "nccl all_gather_base {label} world {world} size {:>5} MiB: {:>9.1} us  algbw {algbw:7.2} GB/s  busbw {busbw}",
        bytes / MIB,
        per_op.as_secs_f64() * 1e6
    );
}

/// Rank 0 runs criterion; the other ranks mirror each measured batch (same size, same count).
fn bench_world(
    c: &mut Criterion,
    world: usize,
    verify: bool,
    sizes: &[usize],
) -> Vec<(usize, Duration)> {
    let mut measured = Vec::new();
    let label = if verify { "verify-on" } else { "verify-off" };
    let id = UniqueId::new().unwrap();
    std::thread::scope(|s| {
        let mut peers = Vec::new();
        for r in 1..world {
            let (tx, rx) = mpsc::channel::<Option<(usize, u64)>>();
            let id = &id;
            s.spawn(move || {
                let rank = Rank::new(id, r, world, verify);
                while let Ok(Some((i, iters))) = rx.recv() {
                    rank.run(i, iters);
                }
            });
            peers.push(tx);
        }
        let rank = Rank::new(&id, 0, world, verify);
        let mut group = c.benchmark_group(format!("nccl_all_gather_base_world{world}_{label}"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for &bytes in sizes {
            let i = SIZES.iter().position(|&b| b == bytes).unwrap();
            group.throughput(Throughput::Bytes(bytes as u64));
            let mut best: Option<Duration> = None;
            group.bench_with_input(
                BenchmarkId::from_parameter(format!("{}MiB", bytes / MIB)),
                &i,
                |b, &i| {
                    b.iter_custom(|iters| {
                        for p in &peers {
                            p.send(Some((i, iters))).unwrap();
                        }
                        let t = rank.run(i, iters);
                        let per = t.div_f64(iters.max(1) as f64);
                        best = Some(best.map_or(per, |b| b.min(per)));
                        t
                    })
                },
            );
            if let Some(per) = best {
                report(world, label, bytes, per);
                measured.push((bytes, per));
            }
        }
        group.finish();
        for p in &peers {
            let _ = p.send(None);
        }
    });
    measured
}

/// 32 back-to-back all-gathers of `bytes` (bf16) on raw NCCL: a communicator of world 1 of its
/// own, on a stream of its own; the best of `trials` batches, per call.
fn raw_nccl(bytes: usize, trials: usize) -> Duration {
    let ctx = fsdp_device::cuda::context(0).unwrap();
    ctx.bind_to_thread().unwrap();
    let stream = ctx.new_stream().unwrap();
    let id = nccl_raw::get_uniqueid().unwrap();
    let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: world 1, rank 0, a fresh id; the context is current; the pointer is to a local.
    unsafe { nccl_raw::comm_init_rank(&mut comm, 1, id, 0) }.unwrap();
    let s = stream.cu_stream();
    // SAFETY: stream-ordered allocations on `s`, freed below after the calls completed.
    let (inp, out) = unsafe { (cu::malloc_async(s, bytes), cu::malloc_async(s, bytes)) };
    let (inp, out) = (inp.unwrap(), out.unwrap());
    let mut best = Duration::MAX;
    for _ in 0..trials {
        stream.synchronize().unwrap();
        let t0 = Instant::now();
        for _ in 0..GAP_CALLS {
            // SAFETY: device buffers of `bytes` bytes on this context, alive until freed below.
            unsafe {
                nccl_raw::all_gather(
                    inp as *const c_void,
                    out as *mut c_void,
                    bytes / 2,
                    nccl_sys::ncclDataType_t::ncclBfloat16,
                    comm,
                    s as nccl_sys::cudaStream_t,
                )
            }
            .unwrap();
        }
        stream.synchronize().unwrap();
        best = best.min(t0.elapsed());
    }
    // SAFETY: the calls completed (synchronised); allocated above on `s`; destroyed once.
    unsafe {
        cu::free_async(inp, s).unwrap();
        cu::free_async(out, s).unwrap();
        nccl_raw::comm_destroy(comm).unwrap();
    }
    stream.synchronize().unwrap();
    best / GAP_CALLS as u32
}

const GAP_CALLS: u64 = 32;

/// The gaps comparison at world 1 (the check does no exchange at world 1).
fn gaps() {
    let bytes = 16 * MIB;
    let i = SIZES.iter().position(|&b| b == bytes).unwrap();
    let trials = 20;
    let raw = raw_nccl(bytes, trials);
    let id = UniqueId::new().unwrap();
    let ours = Rank::new(&id, 0, 1, false);
    let best = |rank: &Rank, calls: u64| {
        (0..trials)
            .map(|_| rank.run(i, calls))
            .min()
            .unwrap()
            .div_f64(calls as f64)
    };
    let per = best(&ours, GAP_CALLS);
    println!(
        "gaps: {GAP_CALLS} x 16 MiB all-gather: ours {:.1} us/call, raw NCCL {:.1} us/call, ratio {:.3}, added {:.2} us/call (check off)",
        per.as_secs_f64() * 1e6,
        raw.as_secs_f64() * 1e6,
        per.as_secs_f64() / raw.as_secs_f64(),
        (per.as_secs_f64() - raw.as_secs_f64()) * 1e6
    );
}

fn main() {
    // Must be set before NCCL reads its environment; harmless for world 1 and older NCCL.
    std::env::set_var("NCCL_MULTI_RANK_GPU_ENABLE", "1");
    if let Err(e) = nccl::available() {
        println!("skipped: {e}");
        return;
    }
    if let Err(e) = CudaSource::new(0) {
        println!("skipped: no CUDA device 0: {e}");
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    let _ = bench_world(&mut c, 1, false, &SIZES);
    gaps();
    match nccl::version() {
        Ok(v) if v >= (2, 30, 0) => {
            let off = bench_world(&mut c, 2, false, &SIZES);
            let on = bench_world(&mut c, 2, true, &[MIB, 16 * MIB, 64 * MIB]);
            for (bytes, t_on) in on {
                if let Some((_, t_off)) = off.iter().find(|(b, _)| *b == bytes) {
                    println!(
                        "check cost world 2 size {:>4} MiB: on {:.1} us, off {:.1} us, +{:.1} us/call",
                        bytes / MIB,
                        t_on.as_secs_f64() * 1e6,
                        t_off.as_secs_f64() * 1e6,
                        (t_on.as_secs_f64() - t_off.as_secs_f64()) * 1e6
                    );
                }
            }
        }
        Ok(v) => println!(
            "world 2 skipped: NCCL {}.{}.{} cannot put two ranks on one GPU (needs 2.30)",
            v.0, v.1, v.2
        ),
        Err(e) => println!("world 2 skipped: {e}"),
    }
    c.final_summary();
}
