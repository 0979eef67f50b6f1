//! Allocate+free pairs served from the cache, against the system allocator in the same run.
//!
//! Groups: `one_stream` (caching allocator and `std::alloc` malloc/free, sizes 512 B to 64 MiB),
//! `three_streams` (requests rotate over three streams' pools), `threads` (two threads at once,
//! each on its own stream, against malloc/free on two threads; the time is per round of one pair
//! on every thread).
//!
//! Reduced run: `cargo bench -p fsdp-allocator --bench cached_pairs -- --warm-up-time 0.3
//! --measurement-time 1 --sample-size 20`.
#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::alloc::{alloc, dealloc, Layout};
use std::hint::black_box;
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fsdp_allocator::{AllocatorConfig, HostAllocator, HostSource};
use fsdp_device::Stream;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const SIZES: [usize; 7] = [512, 4 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB];
const THREADS: usize = 2;

fn label(size: usize) -> String {
    if size >= MIB {
        format!("{}MiB", size / MIB)
    } else if size >= KIB {
        format!("{}KiB", size / KIB)
    } else {
        format!("{size}B")
    }
}

fn allocator() -> HostAllocator {
    HostAllocator::new(HostSource::new(1 << 34), AllocatorConfig::default()).unwrap()
}

fn cached_pair(a: &HostAllocator, size: usize, s: &Stream) {
    let b = a.allocate(size, s).unwrap();
    black_box(b.addr());
    drop(b);
}

fn malloc_pair(layout: Layout) {
    // SAFETY: the layout has a non-zero size; the pointer is freed once with the same layout.
    unsafe {
        let p = alloc(layout);
        black_box(p);
        dealloc(p, layout);
    }
}

fn layout(size: usize) -> Layout {
    Layout::from_size_align(size, 16).unwrap()
}

fn one_stream(c: &mut Criterion) {
    let mut g = c.benchmark_group("one_stream");
    for size in SIZES {
        let a = allocator();
        let s = Stream::inline("s");
        cached_pair(&a, size, &s); // the segment is now cached
        g.bench_with_input(BenchmarkId::new("caching", label(size)), &size, |b, &n| {
            b.iter(|| cached_pair(&a, n, &s))
        });
        assert_eq!(
            a.memory_stats().num_device_alloc,
            1,
            "every pair was cached"
        );
        g.bench_with_input(BenchmarkId::new("malloc", label(size)), &size, |b, &n| {
            let l = layout(n);
            b.iter(|| malloc_pair(l))
        });
    }
    g.finish();
}

fn three_streams(c: &mut Criterion) {
    let mut g = c.benchmark_group("three_streams");
    for size in SIZES {
        let a = allocator();
        let streams = [
            Stream::inline("s0"),
            Stream::inline("s1"),
            Stream::inline("s2"),
        ];
        for s in &streams {
            cached_pair(&a, size, s);
        }
        g.bench_with_input(BenchmarkId::new("caching", label(size)), &size, |b, &n| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % 3;
                cached_pair(&a, n, &streams[i])
            })
        });
        assert_eq!(a.memory_stats().num_device_alloc, 3);
    }
    g.finish();
}

/// `THREADS` threads each run `iters` pairs at once; the slowest thread's time.
fn concurrently(iters: u64, pair: impl Fn(usize) + Sync) -> Duration {
    let start = Barrier::new(THREADS);
    thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (start, pair) = (&start, &pair);
                scope.spawn(move || {
                    start.wait();
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        pair(t);
                    }
                    t0.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .max()
            .unwrap_or_default()
    })
}

fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("threads");
    g.throughput(Throughput::Elements(THREADS as u64));
    for size in SIZES {
        let a = allocator();
        let streams: Vec<Stream> = (0..THREADS)
            .map(|t| Stream::inline(format!("t{t}")))
            .collect();
        for s in &streams {
            cached_pair(&a, size, s);
        }
        g.bench_with_input(BenchmarkId::new("caching", label(size)), &size, |b, &n| {
            b.iter_custom(|iters| concurrently(iters, |t| cached_pair(&a, n, &streams[t])))
        });
        g.bench_with_input(BenchmarkId::new("malloc", label(size)), &size, |b, &n| {
            let l = layout(n);
            b.iter_custom(|iters| concurrently(iters, |_| malloc_pair(l)))
        });
    }
    g.finish();
}

criterion_group!(benches, one_stream, three_streams, threads);
criterion_main!(benches);
