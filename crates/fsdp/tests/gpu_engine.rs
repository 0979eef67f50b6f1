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
//! stated bounds; the grad scaler with its state on the GPU, bit for bit; and the non-finite rule
//! decided there (`optimizer_step_if_finite`), bit for bit. Every test prints
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
    ComputeDevice, FsdpConfig, GradScalerConfig, GradScalerState, GradientDivide, HostCompute,
    MixedPrecisionPolicy, ParamInit, ShardingStrategy,
};
use fsdp::units::UnitPlan;
use fsdp::wrap::plan_units;
use fsdp::Fsdp;
use fsdp_collectives::cuda_ring::{self, CudaRingOptions};
use fsdp_collectives::{ring, Communicator};
use fsdp_device::DType;

use common::{adamw, bits, ring_options, Bits, GLOBAL};
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
        assert_params_close(&gpu.params, &host.params, &format!("world {world}"));
    }
}

/// Rank 0's `body` at `world`: on GPU 0 over the CUDA ring (its `ComputeDevice` given), or on
/// the host engine over the thread ring.
fn rank0<R: Send>(
    world: usize,
    on_gpu: bool,
    body: impl Fn(Box<dyn Communicator>, Option<ComputeDevice>) -> R + Sync,
) -> R {
    let mut out = if on_gpu {
        let opts = CudaRingOptions::default().with_timeout(Duration::from_secs(120));
        cuda_ring::run_ranks(0, world, opts, |comm| {
            let dev = ComputeDevice::cuda(0, Default::default()).unwrap();
            body(Box::new(comm), Some(dev))
        })
        .unwrap()
    } else {
        ring::run_ranks(world, ring_options(), |comm| body(Box::new(comm), None)).unwrap()
    };
    out.swap_remove(0)
}

/// Each parameter of `gpu` within 1e-5 relative of `host`'s (clipped by norms that differ in
/// their last bits).
fn assert_params_close(gpu: &Bits, host: &Bits, what: &str) {
    assert_eq!(gpu.len(), host.len(), "{what}");
    for ((name, g), (_, h)) in gpu.iter().zip(host) {
        for (a, b) in g.iter().zip(h) {
            let (a, b) = (f32::from_bits(*a), f32::from_bits(*b));
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1e-3),
                "{what}: {name}: {a} vs {b}"
            );
        }
    }
}

/// The engine with AdamW on `dev` (the host engine without one).
fn engine_on(
    comm: Box<dyn Communicator>,
    dev: &Option<ComputeDevice>,
    plan: &UnitPlan,
    init: ParamInit<'_>,
    config: FsdpConfig,
) -> Fsdp {
    let optim: OptimizerConfig = adamw().into();
    match dev {
        Some(d) => Fsdp::new_on(comm, d.clone(), plan, init, config, optim),
        None => Fsdp::new(comm, plan, init, config, optim),
    }
    .unwrap()
}

/// Rank 0's 8 steps at `world` with fp16 parameters and reductions and a grad scaler whose
/// first scale overflows fp16, on the host engine or on GPU 0 (the shards there, so the
/// scaler's state too): losses, parameters, the scaler's state and the optimizer steps taken.
fn scaled_run(world: usize, on_gpu: bool) -> (Vec<u32>, Bits, GradScalerState, u64) {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    let body = |comm: Box<dyn Communicator>, dev: Option<ComputeDevice>| {
        let config = FsdpConfig {
            mixed_precision: MixedPrecisionPolicy::new(DType::F16, Some(DType::F16)),
            ..FsdpConfig::new(ShardingStrategy::FullShard)
        };
        let (rank, init) = (comm.rank(), ParamInit::Full(&init));
        let mut fsdp = engine_on(comm, &dev, &plan, init, config);
        fsdp.set_grad_scaler(Some(GradScalerConfig {
            init_scale: 2f32.powi(18),
            growth_interval: 2,
            ..GradScalerConfig::default()
        }))
        .unwrap();
        let model = tied_mlp::TiedMlp { global: GLOBAL };
        let batch = tied_mlp::batch(GLOBAL, rank, world);
        let mut losses = Vec::new();
        for _ in 0..8 {
            let loss = match &dev {
                Some(_) => fsdp.forward_backward(&HostCompute::new(&model), &batch),
                None => fsdp.forward_backward(&model, &batch),
            };
            losses.push(loss.unwrap().to_bits());
            fsdp.optimizer_step().unwrap();
        }
        let state = fsdp.grad_scaler().unwrap().state();
        let params = bits(&fsdp.full_state_dict().unwrap());
        (losses, params, state, fsdp.optimizer_steps())
    };
    rank0(world, on_gpu, body)
}

/// The grad scaler with its state on the GPU (the backward scaled by the device's scale, the
/// gradient shards unscaled there, the overflow decided there and AdamW applied as decided:
/// `fsdp-kernels`' `unscale_by_f32`, `engine_decide` and `adamw_decided_f32`) gives the host
/// engine's losses, parameters, skips, scale and step count bit for bit, at worlds 1, 2 and 4.
#[test]
fn the_grad_scaler_on_cuda_gives_the_host_engines_bits() {
    if let Some(why) = skip_reason() {
        println!("the_grad_scaler_on_cuda_gives_the_host_engines_bits: skipped: no GPU ({why})");
        return;
    }
    for world in [1, 2, 4] {
        let host = scaled_run(world, false);
        let gpu = scaled_run(world, true);
        println!("grad scaler, world {world}: {:?}, {} steps", gpu.2, gpu.3);
        assert!(
            host.2.skipped_steps > 0 && host.3 > 0,
            "world {world}: {host:?}"
        );
        assert_eq!(gpu.0, host.0, "grad scaler, world {world}: losses");
        assert_eq!(gpu.1, host.1, "grad scaler, world {world}: parameters");
        assert_eq!(
            (gpu.2, gpu.3),
            (host.2, host.3),
            "grad scaler, world {world}"
        );
    }
}

/// Each step's outcome (loss and norm bits, applied, overflow, halted), the parameters and the
/// optimizer steps taken.
type Guarded = (Vec<(u32, u64, bool, bool, bool)>, Bits, u64);

/// Rank 0's 8 steps of `optimizer_step_if_finite` at `world` (clipped to 0.5, with or without
/// the grad scaler, a limit of 1 non-finite step): rank 0's loss share is NaN at steps 2 and
/// 5, so step 5 halts the engine. Each outcome (loss and norm bits, applied, overflow, halted),
/// the parameters and the steps taken.
fn guarded_run(world: usize, on_gpu: bool, scaler: bool) -> Guarded {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    let body = |comm: Box<dyn Communicator>, dev: Option<ComputeDevice>| {
        let config = FsdpConfig::new(ShardingStrategy::FullShard);
        let (rank, init) = (comm.rank(), ParamInit::Full(&init));
        let mut fsdp = engine_on(comm, &dev, &plan, init, config);
        if scaler {
            fsdp.set_grad_scaler(Some(GradScalerConfig::default()))
                .unwrap();
        }
        fsdp.set_skip_nonfinite(Some(1));
        let model = tied_mlp::TiedMlp { global: GLOBAL };
        let batch = tied_mlp::batch(GLOBAL, rank, world);
        let mut outcomes = Vec::new();
        for step in 0..8 {
            match &dev {
                Some(_) => fsdp.forward_backward(&HostCompute::new(&model), &batch),
                None => fsdp.forward_backward(&model, &batch),
            }
            .unwrap();
            let share = if rank == 0 && (step == 2 || step == 5) {
                f64::NAN
            } else {
                0.25 * (step + rank) as f64
            };
            let host = fsdp_device::Buffer::from_slice(&[share]).unwrap();
            let loss = match &dev {
                Some(d) => d.copy_from_host(&host, d.compute_stream()).unwrap(),
                None => host,
            };
            drop(fsdp.clip_grad_norm_async(0.5).unwrap());
            fsdp.optimizer_step_if_finite(&loss).unwrap();
            outcomes.extend(fsdp.step_outcomes().unwrap());
        }
        outcomes.extend(fsdp.flush_step_outcomes().unwrap());
        let outcomes = outcomes
            .iter()
            .map(|o| {
                let n = o.grad_norm.to_bits();
                (o.loss.to_bits(), n, o.applied, o.found_inf, o.halted)
            })
            .collect();
        let params = bits(&fsdp.full_state_dict().unwrap());
        (outcomes, params, fsdp.optimizer_steps())
    };
    rank0(world, on_gpu, body)
}

/// The non-finite rule on the GPU (`engine_decide` with and without the grad scaler, AdamW as
/// decided) gives the host engine's outcomes at worlds 1 and 2 — steps 0, 1, 3 and 4 applied,
/// step 2 skipped, step 5 halts and nothing after applies: every loss, flag and step count bit
/// for bit, every norm within 1e-12 relative (the GPU sums each shard's squares in blocks, the
/// host in order; the non-finite ones alike) — and its parameters within 1e-5 relative (clipped
/// by those norms).
#[test]
fn the_nonfinite_rule_on_cuda_gives_the_host_engines_bits() {
    let want = [true, true, false, true, true, false, false, false];
    let host: Vec<Guarded> = [(1, false), (1, true), (2, false), (2, true)]
        .into_iter()
        .map(|(world, scaler)| {
            let run = guarded_run(world, false, scaler);
            let applied: Vec<bool> = run.0.iter().map(|o| o.2).collect();
            assert_eq!(applied, want, "host, world {world}, scaler {scaler}");
            run
        })
        .collect();
    if let Some(why) = skip_reason() {
        println!("the_nonfinite_rule_on_cuda_gives_the_host_engines_bits: skipped: no GPU ({why})");
        return;
    }
    for (i, (world, scaler)) in [(1, false), (1, true), (2, false), (2, true)]
        .into_iter()
        .enumerate()
    {
        let gpu = guarded_run(world, true, scaler);
        let what = format!("world {world}, scaler {scaler}");
        let (g, h) = (&gpu, &host[i]);
        assert_eq!(g.0.len(), h.0.len(), "{what}");
        for (a, b) in g.0.iter().zip(&h.0) {
            assert_eq!(
                (a.0, a.2, a.3, a.4),
                (b.0, b.2, b.3, b.4),
                "{what}: {a:?} vs {b:?}"
            );
            let (na, nb) = (f64::from_bits(a.1), f64::from_bits(b.1));
            let close = if nb.is_finite() {
                (na - nb).abs() <= 1e-12 * nb
            } else {
                na.is_nan() == nb.is_nan() && na.is_infinite() == nb.is_infinite()
            };
            assert!(close, "{what}: norm {na} vs {nb}");
        }
        assert_params_close(&g.1, &h.1, &what);
        assert_eq!(g.2, h.2, "{what}: optimizer steps");
    }
}
