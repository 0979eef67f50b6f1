//! All-gather base through NCCL on GPU 0: criterion timings per size (1 MiB .. 1 GiB of gathered
//! output), and algbw / busbw per size as nccl-tests reports them (algbw = output bytes / time,
//! busbw = algbw · (n − 1) / n). World 1, and world 2 as two threads on the same GPU where NCCL ≥
//! 2.30 allows it (`NCCL_MULTI_RANK_GPU_ENABLE=1` is set by this program). The cross-rank call
//! check is off (raw NCCL plus the proxy's completion polling); one extra line measures it on.
//!
//! `cargo bench -p fsdp-collectives --features nccl --bench nccl_all_gather`; prints `skipped`
//! and exits 0 without a GPU or NCCL.

use std::sync::mpsc;
use std::time::{Duration, Instant};

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

    fn run(&self, size_idx: usize, iters: u64) -> Duration {
        let (input, output) = &self.bufs[size_idx];
        let t0 = Instant::now();
        for _ in 0..iters {
            self.comm.all_gather_base(input, output).unwrap();
        }
        self.comm.barrier().unwrap().wait().unwrap();
        t0.elapsed()
    }
}

fn report(world: usize, label: &str, bytes: usize, per_op: Duration) {
    let algbw = bytes as f64 / per_op.as_secs_f64() / 1e9;
    let busbw = algbw * (world as f64 - 1.0) / world as f64;
    println!(
        "nccl all_gather_base {label} world {world} size {:>5} MiB: {:>9.1} us  algbw {algbw:7.2} GB/s  busbw {busbw:7.2} GB/s",
        bytes / MIB,
        per_op.as_secs_f64() * 1e6
    );
}

/// Rank 0 runs criterion; the other ranks mirror each measured batch (same size, same count).
fn bench_world(c: &mut Criterion, world: usize, verify: bool, sizes: &[usize]) {
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
            }
        }
        group.finish();
        for p in &peers {
            let _ = p.send(None);
        }
    });
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
    bench_world(&mut c, 1, false, &SIZES);
    match nccl::version() {
        Ok(v) if v >= (2, 30, 0) => {
            bench_world(&mut c, 2, false, &SIZES);
            bench_world(&mut c, 2, true, &[MIB, 64 * MIB]);
        }
        Ok(v) => println!(
            "world 2 skipped: NCCL {}.{}.{} cannot put two ranks on one GPU (needs 2.30)",
            v.0, v.1, v.2
        ),
        Err(e) => println!("world 2 skipped: {e}"),
    }
    c.final_summary();
}
