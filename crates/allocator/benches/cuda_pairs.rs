//! Cached allocate/free pairs of the caching allocator on CUDA (feature `cuda`, GPU): the
//! median latency of a pair without `record_stream` (goal < 1 µs), with `record_stream` on a
//! second stream (goal ≤ 3 µs: one pooled event recorded per free, queried by the next
//! allocation), and the same pair on expandable segments where the driver offers virtual
//! memory management. Without a GPU it prints why it skipped.
//!
//! `cargo bench -p fsdp-allocator --features cuda --bench cuda_pairs`

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaStream;
use fsdp_allocator::cuda::{CudaAllocator, CudaSource};
use fsdp_allocator::{AllocatorConfig, MemorySource};

const PAIRS: usize = 20_000;
const WARMUP: usize = 1_000;
const SIZE: usize = 1 << 20;

/// The median of `PAIRS` timed pairs, in nanoseconds.
fn median_ns(mut pair: impl FnMut()) -> f64 {
    for _ in 0..WARMUP {
        pair();
    }
    let mut times: Vec<u64> = (0..PAIRS)
        .map(|_| {
            let t = Instant::now();
            pair();
            t.elapsed().as_nanos() as u64
        })
        .collect();
    times.sort_unstable();
    times[times.len() / 2] as f64
}

fn run(name: &str, alloc: &CudaAllocator, a: &Arc<CudaStream>, b: &Arc<CudaStream>, goal: f64) {
    let plain = median_ns(|| {
        let blk = alloc.allocate(SIZE, a).unwrap();
        black_box(blk.addr());
    });
    let recorded = median_ns(|| {
        let blk = alloc.allocate(SIZE, a).unwrap();
        blk.record_stream(b).unwrap();
        black_box(blk.addr());
    });
    let st = alloc.memory_stats();
    println!(
        "{name}: cached pair median {:.3} µs (goal < {goal} µs); with record_stream {:.3} µs \
         (goal ≤ 3 µs); segments allocated {} (all served from the cache after the first)",
        plain / 1e3,
        recorded / 1e3,
        st.num_device_alloc,
    );
}

fn main() {
    let source = match CudaSource::new(0) {
        Ok(s) => s,
        Err(e) => {
            println!("cuda_pairs: skipped: no usable GPU ({e})");
            return;
        }
    };
    let ctx = source.context().clone();
    let (a, b) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let expandable = source.supports_expandable_segments();
    let alloc = CudaAllocator::new(source, AllocatorConfig::default()).unwrap();
    run("cuda:0", &alloc, &a, &b, 1.0);
    if expandable {
        let source = CudaSource::new(0).unwrap();
        let config = AllocatorConfig::default().with_expandable_segments(true);
        let alloc = CudaAllocator::new(source, config).unwrap();
        run("cuda:0 expandable segments", &alloc, &a, &b, 1.0);
    } else {
        println!("cuda:0 expandable segments: skipped: no virtual memory management");
    }
}
