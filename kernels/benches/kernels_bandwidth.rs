//! Bandwidth of the memory-bound kernels as a fraction of the device-to-device copy bandwidth
//! measured in the same run (the goal for fused AdamW: at least 0.7). Times come from
//! CUDA events around `REPS` launches after a warm-up. Without a GPU it prints why it skipped.

use std::sync::Arc;

use cudarc::driver::{sys::CUevent_flags, CudaStream};
use fsdp_device::Stream;
use fsdp_kernels::host::{AdamW, AdamWScalars, ReduceKind};
use fsdp_kernels::launch;
use half::bf16;

const N: usize = 64 << 20; // elements per buffer (256 MiB of f32)
const REPS: usize = 20;

/// Seconds per call of `f`, timed with CUDA events.
fn time(s: &Arc<CudaStream>, mut f: impl FnMut()) -> f64 {
    f();
    let start = s
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    for _ in 0..REPS {
        f();
    }
    let end = s
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    f64::from(start.elapsed_ms(&end).unwrap()) / 1e3 / REPS as f64
}

fn main() {
    if let Err(e) = fsdp_device::cuda::device_count() {
        println!("kernels_bandwidth: skipped: no GPU ({e})");
        return;
    }
    let stream = Stream::cuda(0, "bench").unwrap();
    let s = stream.cuda_stream().unwrap().clone();
    let mut a = s.alloc_zeros::<f32>(N).unwrap();
    let mut b = s.alloc_zeros::<f32>(N).unwrap();
    let mut c = s.alloc_zeros::<f32>(N).unwrap();
    let mut d = s.alloc_zeros::<f32>(N).unwrap();
    let g = s.alloc_zeros::<f32>(N).unwrap();
    let mut mb = s.alloc_zeros::<bf16>(N).unwrap();
    let mut vb = s.alloc_zeros::<bf16>(N).unwrap();
    let bytes = (N * 4) as f64;

    let copy = time(&s, || s.memcpy_dtod(&a, &mut b).unwrap());
    let copy_bw = 2.0 * bytes / copy;
    println!("device-to-device copy: {:.1} GB/s", copy_bw / 1e9);
    let report = |name: &str, secs: f64, moved: f64| {
        let bw = moved / secs;
        println!(
            "{name}: {:.1} GB/s = {:.2} of the copy bandwidth",
            bw / 1e9,
            bw / copy_bw
        );
    };

    let cfg = AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let sc = AdamWScalars::new(&cfg, 1).unwrap();
    let t = time(&s, || {
        launch::adamw::<f32>(&s, &sc, &mut a, &g, &mut c, &mut d).unwrap()
    });
    report("fused AdamW (f32 state)", t, 7.0 * bytes); // reads p g m v, writes p m v
    let t = time(&s, || {
        launch::adamw::<bf16>(&s, &sc, &mut a, &g, &mut mb, &mut vb).unwrap()
    });
    report("fused AdamW (bf16 state)", t, 5.0 * bytes);
    let t = time(&s, || {
        launch::reduce(&s, ReduceKind::Sum, &mut b, &c, &d, None).unwrap()
    });
    report("reduce sum f32", t, 3.0 * bytes);
    let t = time(&s, || launch::cast(&s, &a, &mut mb).unwrap());
    report("cast f32 -> bf16", t, 1.5 * bytes);
    let mut out = s.alloc_zeros::<f64>(1).unwrap();
    let t = time(&s, || launch::sum_of_squares(&s, &g, &mut out).unwrap());
    report("sum of squares f32", t, bytes);
    s.synchronize().unwrap();
}
