//! CUDA streams and events (cargo feature `cuda`). Without a GPU each test prints
//! `skipped: no GPU (<reason>)` and passes.
#![cfg(feature = "cuda")]

mod common;

use std::time::{Duration, Instant};

use common::gpu;
use fsdp_device::cuda::{self, pooled_events};
use fsdp_device::{DeviceError, Event, Stream};

/// Bytes of the buffers the ordering test copies: large enough that a chain of copies takes
/// milliseconds.
const LEN: usize = 64 << 20;

#[test]
fn one_context_per_device() {
    let Some(_serial) = gpu("one_context_per_device") else {
        return;
    };
    let a = cuda::context(0).unwrap();
    let b = cuda::context(0).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    assert!(!a.is_event_tracking());
    let n = cuda::device_count().unwrap();
    assert!(matches!(
        cuda::context(n),
        Err(DeviceError::InvalidArgument(_))
    ));
}

#[test]
fn gpu_side_wait_orders_two_streams() {
    let Some(_serial) = gpu("gpu_side_wait_orders_two_streams") else {
        return;
    };
    let a = Stream::cuda(0, "a").unwrap();
    let b = Stream::cuda(0, "b").unwrap();
    let (sa, sb) = (a.cuda_stream().unwrap(), b.cuda_stream().unwrap());
    let host: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    let mut src = sa.clone_htod(&host).unwrap();
    let mut mid = sa.alloc_zeros::<u8>(LEN).unwrap();
    let mut out = sb.alloc_zeros::<u8>(LEN).unwrap();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    // A chain of copies on `a` that ends in `mid`; `b` copies `mid` after a GPU-side wait.
    for _ in 0..8 {
        sa.memcpy_dtod(&src, &mut mid).unwrap();
        sa.memcpy_dtod(&mid, &mut src).unwrap();
    }
    let done = a.record_event();
    // 16 copies of 64 MiB take far longer than no time at all: a zero timeout expires.
    assert!(matches!(
        done.synchronize_timeout(Duration::ZERO),
        Err(DeviceError::Timeout { .. })
    ));
    let t0 = Instant::now();
    b.wait_event(&done).unwrap();
    sb.memcpy_dtod(&mid, &mut out).unwrap();
    let issued = t0.elapsed();
    b.record_event().synchronize().unwrap();
    assert!(done.query(), "b finished before the event it waited for");
    assert_eq!(sb.clone_dtoh(&out).unwrap(), host);
    println!("wait_event + copy issued in {issued:?} (the host did not wait)");
    a.synchronize().unwrap();
}

#[test]
fn events_come_from_a_pool() {
    let Some(_serial) = gpu("events_come_from_a_pool") else {
        return;
    };
    let s = Stream::cuda(0, "pool").unwrap();
    let e = s.record_event();
    e.synchronize().unwrap();
    drop(e);
    let free = pooled_events(0);
    assert!(free >= 1);
    for _ in 0..100 {
        let e = s.record_event();
        assert!(e.synchronize().is_ok());
    }
    // Recording one event at a time reuses a pooled event: the pool does not grow.
    assert!(
        pooled_events(0) <= free + 1,
        "{} > {free} + 1",
        pooled_events(0)
    );
}

#[test]
fn cuda_stream_waits_for_cpu_events_with_a_timeout() {
    let Some(_serial) = gpu("cuda_stream_waits_for_cpu_events_with_a_timeout") else {
        return;
    };
    let cpu = Stream::cpu("cpu");
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    cpu.enqueue(move || {
        let _ = rx.recv_timeout(Duration::from_secs(10));
    })
    .unwrap();
    let ev = cpu.record_event();
    let g = Stream::cuda_with_timeout(0, "g", Duration::from_millis(100)).unwrap();
    let t0 = Instant::now();
    assert!(matches!(
        g.wait_event(&ev),
        Err(DeviceError::Timeout { .. })
    ));
    assert!(t0.elapsed() < Duration::from_secs(5));
    drop(tx);
    cpu.synchronize().unwrap();
    g.wait_event(&ev).unwrap();
    // A CPU stream waits for a CUDA event too, and host closures are refused on CUDA streams.
    let cuda_ev = g.record_event();
    cpu.wait_event(&cuda_ev).unwrap();
    cpu.synchronize().unwrap();
    assert!(matches!(
        g.enqueue(|| {}),
        Err(DeviceError::Unsupported { .. })
    ));
    assert!(Event::new().query());
}
