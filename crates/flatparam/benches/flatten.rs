//! Flatten and views against a plain memcpy of the same bytes, 1 KiB – 256 MiB.
//!
//! The parameters are those of a transformer block (four weight matrices in the proportions
//! 3 : 1 : 4 : 4 and eight small vectors), f32, laid out for 8 ranks. Per size:
//! - `memcpy`: one `copy_from_slice` of all the parameter bytes (from one contiguous source);
//! - `memcpy_pieces`: the same bytes copied parameter by parameter from the parameters
//!   themselves (the inherent work of flattening);
//! - `flatten_into`: [`FlatParamLayout::flatten_into`] (checks, copies, zeroed padding);
//! - `views` / `views_mut`: building every parameter's view of the unsharded buffer.
//!
//! The three copies write into the same preallocated, already touched flat buffer.
//!
//! Sizes default to 1 KiB, 64 KiB, 1 MiB, 16 MiB and 256 MiB; set `FLATPARAM_BENCH_SIZES` to a
//! comma-separated list of sizes in KiB to choose others.

use std::hint::black_box;

use criterion::{criterion_main, BenchmarkId, Criterion, Throughput};
use fsdp_flatparam::FlatParamLayout;

const WORLD_SIZE: usize = 8;

/// A block's parameters with `numel` elements in all, in order, as (name, numel).
fn block_params(numel: usize) -> Vec<(String, usize)> {
    let d = ((numel / 12) as f64).sqrt().max(1.0) as usize;
    let small = [
        ("ln_1.weight", d),
        ("ln_1.bias", d),
        ("attn.c_attn.bias", 3 * d),
        ("attn.c_proj.bias", d),
        ("ln_2.weight", d),
        ("ln_2.bias", d),
        ("mlp.c_fc.bias", 4 * d),
        ("mlp.c_proj.bias", d),
    ];
    let small_total: usize = small.iter().map(|(_, n)| n).sum();
    let big = numel.saturating_sub(small_total);
    let weights = [
        ("attn.c_attn.weight", big * 3 / 12),
        ("attn.c_proj.weight", big / 12),
        ("mlp.c_fc.weight", big * 4 / 12),
    ];
    let last = big - weights.iter().map(|(_, n)| n).sum::<usize>();
    [
        small[0],
        small[1],
        weights[0],
        small[2],
        weights[1],
        small[3],
        small[4],
        small[5],
        weights[2],
        small[6],
        ("mlp.c_proj.weight", last),
        small[7],
    ]
    .iter()
    .map(|&(name, n)| (name.to_string(), n))
    .collect()
}

fn sizes_kib() -> Vec<usize> {
    match std::env::var("FLATPARAM_BENCH_SIZES") {
        Ok(s) => s.split(',').filter_map(|x| x.trim().parse().ok()).collect(),
        Err(_) => vec![1, 64, 1024, 16 * 1024, 256 * 1024],
    }
}

fn label(kib: usize) -> String {
    if kib >= 1024 && kib % 1024 == 0 {
        format!("{}MiB", kib / 1024)
    } else {
        format!("{kib}KiB")
    }
}

fn bench(c: &mut Criterion) {
    for kib in sizes_kib() {
        let bytes = kib * 1024;
        let numel = bytes / 4;
        let specs = block_params(numel);
        assert_eq!(specs.iter().map(|(_, n)| n).sum::<usize>(), numel);
        let mut builder = FlatParamLayout::builder(WORLD_SIZE);
        for (name, n) in &specs {
            builder = builder.param(name.clone(), &[*n]);
        }
        let layout = builder.build().unwrap();
        let params: Vec<Vec<f32>> = specs
            .iter()
            .enumerate()
            .map(|(i, (_, n))| vec![i as f32 + 0.5; *n])
            .collect();
        let src: Vec<f32> = params.concat();
        // One destination for every copy, every page touched before timing.
        let mut flat = vec![1.0f32; layout.padded_numel()];

        let mut group = c.benchmark_group(format!("flatparam/{}", label(kib)));
        group.throughput(Throughput::Bytes(bytes as u64));
        if bytes >= 16 << 20 {
            group.sample_size(10);
        }
        group.bench_function(BenchmarkId::new("memcpy", label(kib)), |b| {
            b.iter(|| flat[..numel].copy_from_slice(black_box(&src)))
        });
        group.bench_function(BenchmarkId::new("memcpy_pieces", label(kib)), |b| {
            b.iter(|| {
                let mut pos = 0;
                for p in black_box(&params) {
                    flat[pos..pos + p.len()].copy_from_slice(p);
                    pos += p.len();
                }
            })
        });
        group.bench_function(BenchmarkId::new("flatten_into", label(kib)), |b| {
            b.iter(|| layout.flatten_into(black_box(&params), &mut flat).unwrap())
        });
        group.bench_function(BenchmarkId::new("views", label(kib)), |b| {
            b.iter(|| black_box(layout.views(black_box(&flat)).unwrap()))
        });
        group.bench_function(BenchmarkId::new("views_mut", label(kib)), |b| {
            b.iter(|| {
                let views = layout.views_mut(black_box(&mut flat)).unwrap();
                black_box(views.len())
            })
        });
        group.finish();
        assert_eq!(&flat[..numel], &src[..]);
    }
}

mod harness {
    //! The entry points criterion generates.
    #![allow(missing_docs)]
    criterion::criterion_group!(benches, super::bench);
}
criterion_main!(harness::benches);
