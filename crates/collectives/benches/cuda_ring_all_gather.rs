//! All-gather base of the CUDA ring at 2 and 4 ranks on GPU 0: the bytes that all ranks copy
//! per second (each rank writes `world × input` bytes of output) as a fraction of the
//! device-to-device copy bandwidth measured in the same run (goal ≥ 0.7). Prints the medians and
//! the ratio; prints `skipped` without a GPU.
//!
//! `cargo bench -p fsdp-collectives --features cuda --bench cuda_ring_all_gather`

use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::result;
use fsdp_allocator::cuda::{CudaAllocator, CudaSource};
use fsdp_allocator::AllocatorConfig;
use fsdp_collectives::cuda_ring::{self, CudaRingOptions};
use fsdp_collectives::Communicator;
use fsdp_device::{AccessMode, DType, Stream};

/// Input bytes per rank.
const BYTES: usize = 64 << 20;
const WARMUP: usize = 3;
const ITERS: usize = 15;
const TIMEOUT: Duration = Duration::from_secs(120);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn allocator() -> CudaAllocator {
    CudaAllocator::new(
        CudaSource::new(0).expect("device 0"),
        AllocatorConfig::default(),
    )
    .expect("allocator")
}

/// Median seconds of one `bytes`-long device-to-device copy on one stream.
fn copy_seconds(bytes: usize) -> f64 {
    let stream = Stream::cuda(0, "copy").expect("stream");
    let cu = stream.cuda_stream().expect("CUDA stream").clone();
    let alloc = allocator();
    let src = alloc
        .allocate_buffer(DType::F32, bytes / 4, &cu)
        .expect("src");
    let dst = alloc
        .allocate_buffer(DType::F32, bytes / 4, &cu)
        .expect("dst");
    let s = src
        .access(AccessMode::Shared)
        .acquire(TIMEOUT)
        .expect("src guard");
    let d = dst
        .access(AccessMode::Exclusive)
        .acquire(TIMEOUT)
        .expect("dst guard");
    cu.context().bind_to_thread().expect("bind");
    let mut times = Vec::new();
    for i in 0..WARMUP + ITERS {
        let t0 = Instant::now();
        // SAFETY: both buffers are device memory of `bytes` bytes of this context, held under
        // their guards until the stream is synchronised below.
        unsafe {
            result::memcpy_dtod_async(d.as_ptr() as u64, s.as_ptr() as u64, bytes, cu.cu_stream())
        }
        .expect("copy");
        stream.synchronize().expect("synchronize");
        if i >= WARMUP {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    median(times)
}

/// Median seconds of one all-gather base of `bytes` per rank over `world` ranks.
fn all_gather_seconds(world: usize, bytes: usize) -> f64 {
    let start = Barrier::new(world);
    let end = Barrier::new(world);
    let times = Mutex::new(Vec::new());
    let opts = CudaRingOptions::default().with_timeout(TIMEOUT);
    cuda_ring::run_ranks(0, world, opts, |c| {
        let cu = c.cuda_stream().cuda_stream().expect("CUDA stream").clone();
        let alloc = allocator();
        let n = bytes / 4;
        let input = alloc.allocate_buffer(DType::F32, n, &cu).expect("input");
        let output = alloc
            .allocate_buffer(DType::F32, world * n, &cu)
            .expect("output");
        for i in 0..WARMUP + ITERS {
            start.wait();
            let t0 = Instant::now();
            c.all_gather_base(&input, &output)
                .and_then(|w| w.wait())
                .expect("all_gather_base");
            end.wait();
            if c.rank() == 0 && i >= WARMUP {
                times.lock().unwrap().push(t0.elapsed().as_secs_f64());
            }
        }
    })
    .expect("group");
    median(times.into_inner().unwrap())
}

fn main() {
    match fsdp_device::cuda::device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => return println!("cuda_ring_all_gather: skipped: no GPU (no CUDA device)"),
        Err(e) => return println!("cuda_ring_all_gather: skipped: no GPU ({e})"),
    }
    let copy = copy_seconds(BYTES);
    // A copy of BYTES moves BYTES (as the ring's copies are counted below).
    let copy_bw = BYTES as f64 / copy;
    println!(
        "device-to-device copy: {} MiB in {:.3} ms (median), {:.1} GB/s",
        BYTES >> 20,
        copy * 1e3,
        copy_bw / 1e9
    );
    for world in [2, 4] {
        let t = all_gather_seconds(world, BYTES);
        let copied = (world * world * BYTES) as f64;
        let bw = copied / t;
        println!(
            "cuda ring all_gather_base world {world}: {} MiB per rank in {:.3} ms (median), \
             {:.1} GB/s copied by all ranks, ratio to copy bandwidth {:.2} (goal >= 0.7)",
            BYTES >> 20,
            t * 1e3,
            bw / 1e9,
            bw / copy_bw
        );
    }
}
