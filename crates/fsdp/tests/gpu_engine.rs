//! The engine on CUDA (cargo feature `cuda`): `Fsdp::new_on` with `ComputeDevice::cuda(0)` over
//! the CUDA ring, ranks as threads on one GPU. The unsharded parameters and gradients live in
//! the GPU's caching allocator; the shards, gradient shards and AdamW state too (the fused
//! AdamW kernel and the accumulation kernel of `fsdp-kernels` on them), or with
//! `offload_params` in host memory, copied there through pinned staging buffers. The
//! all-gathers and reduce-scatters run on the GPU (bitwise the host ring's arithmetic), the
//! gradients are cast there by the `fsdp-kernels` cast kernels (round to nearest even, as the
//! host). So the tied-weight MLP on the GPU's buffers is expected to give the host engine's
//! losses, parameters and schedule bit for bit, in both placements: `FULL_SHARD`,
//! `SHARD_GRAD_OP` and `NO_SHARD` at worlds 1, 2 and 4, in f32 and with bf16 parameters (f32
//! and bf16 reductions); AnyPrecisionAdamW on bf16 shards too, and clipping there within
//! stated bounds. Every test prints
//! `skipped: <reason>` and passes where the CUDA driver or a GPU is missing.
#![cfg(feature = "cuda")]

mod common;
#[allow(dead_code)]
#[path = "common/on_device.rs"]
mod on_device;
#[allow(dead_code)]
#[path = "../examples/tied_mlp.rs"]
mod tied_mlp;

use std::time::Duration;

use fsdp::engine::{
    ComputeDevice, FsdpConfig, GradientDivide, MixedPrecisionPolicy, ShardingStrategy,
};
use fsdp_collectives::cuda_ring::{self, CudaRingOptions};
use fsdp_device::DType;

use common::adamw;
use fsdp::optim::{AnyPrecisionAdamWConfig, OptimizerConfig};
use on_device::{host_run, train_rank_with, Outcome};

/// Why the GPU tests cannot run here, if they cannot.
fn skip_reason() -> Option<String> {
    match fsdp_device::cuda::device_count() {
        Err(e) => Some(e.to_string()),
        Ok(0) => Some("no CUDA device".into()),
        Ok(_) => ComputeDevice::cuda(0, Default::default())
            .err()
            .map(|e| format!("no CUDA device 0: {e}")),
    }
}

/// Rank 0's outcome on the host engine (the thread ring) or on GPU 0 (the CUDA ring).
fn run(world: usize, config: FsdpConfig, on_gpu: bool) -> Outcome {
    run_with(world, config, on_gpu, adamw().into(), None)
}

/// [`run`] with the optimizer `optim`, clipping to `max_norm` when set.
fn run_with(
    world: usize,
    config: FsdpConfig,
    on_gpu: bool,
    optim: OptimizerConfig,
    max_norm: Option<f64>,
) -> Outcome {
    if !on_gpu {
        return host_run(world, config, optim, max_norm);
    }
    let opts = CudaRingOptions::default().with_timeout(Duration::from_secs(120));
    cuda_ring::run_ranks(0, world, opts, |comm| {
        let dev = ComputeDevice::cuda(0, Default::default()).unwrap();
        let dev = Some(dev);
        train_rank_with(Box::new(comm), dev, None, world, config, 1, optim, max_norm)
    })
    .unwrap()
    .swap_remove(0)
}

#[test]
fn the_engine_on_cuda_gives_the_host_engines_bits() {
    if let Some(why) = skip_reason() {
        println!("the_engine_on_cuda_gives_the_host_engines_bits: skipped: no GPU ({why})");
        return;
    }
    let policies = [
        (DType::F32, None),
        (DType::BF16, None),
        (DType::BF16, Some(DType::BF16)),
    ];
    for (param, reduce) in policies {
        for (world, strategy) in [
            (1, ShardingStrategy::FullShard),
            (2, ShardingStrategy::FullShard),
            (2, ShardingStrategy::ShardGradOp),
            (2, ShardingStrategy::NoShard),
            (4, ShardingStrategy::FullShard),
        ] {
            let mut config = FsdpConfig::new(strategy);
            config.mixed_precision = MixedPrecisionPolicy::new(param, reduce);
            let host = run(world, config, false);
            for offload_params in [false, true] {
                config.offload_params = offload_params;
                let what = format!(
                    "world {world}, {strategy:?}, {param} / {reduce:?}, offload {offload_params}"
                );
                let gpu = run(world, config, true);
                assert_eq!(gpu.losses, host.losses, "{what}: losses");
                assert_eq!(gpu.params, host.params, "{what}: parameters");
                assert_eq!(gpu.schedule, host.schedule, "{what}: schedule");
                let peak = gpu.device_peak.expect("a device");
                println!("{what}: GPU peak {peak} B, host peak {} B", gpu.host_peak);
                assert!(peak > 0, "{what}");
            }
        }
    }
    // The division by the data-parallel size: f16 reductions pre- and post-divide by 2 at
    // world 4 (`div_scalar` on the GPU), bf16 ones pre-multiply by 1/4 (`axpby`).
    for reduce in [DType::F16, DType::BF16] {
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = MixedPrecisionPolicy::new(reduce, Some(reduce));
        config.gradient_divide = GradientDivide::DataParallelSize;
        let host = run(4, config, false);
        let gpu = run(4, config, true);
        assert_eq!(gpu.losses, host.losses, "divide, {reduce}: losses");
        assert_eq!(gpu.params, host.params, "divide, {reduce}: parameters");
    }
}

/// AnyPrecisionAdamW with its bf16 shards and bf16 state (Kahan summation) on the GPU (the
/// fused `anyprecision_decided` kernel on an exact f32 copy of each shard) gives the host
/// engine's bits; and clipping on the GPU (`clip_grad_norm_async`: the norm, its coefficient and
/// the scaling there) gives the host engine's norms within 1e-12 relative (the GPU sums each
/// shard's squares in blocks, the host in order) and parameters within 1e-5 relative.
#[test]
fn any_precision_and_clipping_on_cuda_track_the_host_engine() {
    if let Some(why) = skip_reason() {
        println!(
            "any_precision_and_clipping_on_cuda_track_the_host_engine: skipped: no GPU ({why})"
        );
        return;
    }
    let any: OptimizerConfig = AnyPrecisionAdamWConfig {
        lr: 1e-2,
        ..AnyPrecisionAdamWConfig::default()
    }
    .into();
    for world in [1, 2, 4] {
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = MixedPrecisionPolicy::new(DType::BF16, Some(DType::F32));
        let host = run_with(world, config, false, any, None);
        let gpu = run_with(world, config, true, any, None);
        assert_eq!(
            gpu.losses, host.losses,
            "AnyPrecisionAdamW, world {world}: losses"
        );
        assert_eq!(
            gpu.params, host.params,
            "AnyPrecisionAdamW, world {world}: parameters"
        );
        let config = FsdpConfig::new(ShardingStrategy::FullShard);
        let host = run_with(world, config, false, adamw().into(), Some(0.05));
        let gpu = run_with(world, config, true, adamw().into(), Some(0.05));
        println!(
            "clipping, world {world}: norms {:?} (host {:?})",
            gpu.norms, host.norms
        );
        for (g, h) in gpu.norms.iter().zip(&host.norms) {
            assert!(*h > 0.05, "world {world}: the clipping does not bite");
            assert!((g - h).abs() <= 1e-12 * h, "world {world}: norm {g} vs {h}");
        }
        for ((name, g), (_, h)) in gpu.params.iter().zip(&host.params) {
            for (a, b) in g.iter().zip(h) {
                let (a, b) = (f32::from_bits(*a), f32::from_bits(*b));
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1e-3),
                    "world {world}: {name}: {a} vs {b}"
                );
            }
        }
    }
}
