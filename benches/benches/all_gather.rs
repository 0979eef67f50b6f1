//! Criterion benchmark of the ring backend's all-gather flavours: sizes from 4 KiB to 256 MiB of
//! total output, world sizes 2, 4 and 8, base vs list vs unequal, with a one-thread memcpy of the
//! same (n-1)·S bytes in the same run as the ideal. Throughput is reported as algbw (S / t).
//!
//! `FSDP_BENCH_MAX_MIB` caps the largest size (default 256).

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fsdp_benches::{human, Bench, Flavor, Job};

fn sizes() -> Vec<usize> {
    let max_mib: usize = std::env::var("FSDP_BENCH_MAX_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    (0..)
        .map(|i| (4usize << 10) << (2 * i))
        .take_while(|&s| s <= max_mib << 20)
        .collect()
}

fn all_gather(c: &mut Criterion) {
    for world in [2usize, 4, 8] {
        let bench = Bench::new(world);
        let mut group = c.benchmark_group(format!("all_gather/world{world}"));
        group.sample_size(10);
        group.warm_up_time(Duration::from_millis(500));
        group.measurement_time(Duration::from_secs(2));
        for s in sizes() {
            group.throughput(Throughput::Bytes(s as u64));
            for flavor in Flavor::ALL {
                bench.prepare(Job {
                    flavor,
                    out_bytes: s,
                    count: 1,
                });
                group.bench_function(BenchmarkId::new(flavor.name(), human(s)), |b| {
                    b.iter_custom(|iters| bench.run(iters))
                });
            }
            let src = vec![1u8; s];
            let mut dst = vec![0u8; s];
            group.bench_function(BenchmarkId::new("memcpy_ideal", human(s)), |b| {
                b.iter(|| {
                    for _ in 0..world - 1 {
                        dst.copy_from_slice(std::hint::black_box(&src));
                    }
                    std::hint::black_box(&mut dst);
                })
            });
        }
        group.finish();
    }
}

fn fixed_total(c: &mut Criterion) {
    let world = 4;
    let total = 256usize << 20;
    let bench = Bench::new(world);
    let mut group = c.benchmark_group("fixed_total_256MiB/world4");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Bytes(total as u64));
    for k in [1usize, 4, 16, 64, 256, 1024] {
        let each = (total / k) / (4 * world) * (4 * world);
        bench.prepare(Job {
            flavor: Flavor::Base,
            out_bytes: each,
            count: k,
        });
        group.bench_function(BenchmarkId::from_parameter(k), |b| {
            b.iter_custom(|iters| bench.run(iters))
        });
    }
    group.finish();
}

criterion_group!(benches, all_gather, fixed_total);
criterion_main!(benches);
