//! The engine with its shards on a device (`Fsdp::new_on` with `offload_params` off), on the
//! host twin of a device with a millisecond of latency per operation: the optimizer side of a
//! step runs on the device — SGD with momentum and AdamW over parameter groups with a
//! learning-rate schedule, the gradient norm and clipping by it, skipped steps — and sharded
//! checkpoints are written from the device's shards and resumed on a device or on the host.
//! AnyPrecisionAdamW (pure-bf16 training) steps there too, with its state in its dtypes.
//! Every norm, loss and parameter is the host engine's, bit for bit.

mod common;
#[allow(dead_code)]
#[path = "../examples/tied_mlp.rs"]
mod tied_mlp;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use fsdp::checkpoint::load_sharded_checkpoint;
use fsdp::engine::{
    ComputeDevice, FsdpConfig, GradScalerConfig, HostCompute, MixedPrecisionPolicy, ParamInit,
    ShardingStrategy,
};
use fsdp::optim::{
    decay_2d_only_group, AnyPrecisionAdamWConfig, LrSchedule, OptimizerConfig, ParamGroupOptions,
    SgdConfig,
};
use fsdp::units::{ParamSpec, UnitPlan};
use fsdp::wrap::plan_units;
use fsdp::Fsdp;
use fsdp_collectives::{ring, Communicator};
use fsdp_device::DType;

use common::{adamw, bits, ring_options, temp_dir, Bits, GLOBAL};
use tied_mlp::TiedMlp;

/// Steps of a run; step 1 is skipped (its gradients discarded).
const STEPS: usize = 4;
/// Clipping that bites: the gradients' norm is above it.
const MAX_NORM: f64 = 0.05;

/// What a rank's steps give: each step's gradient norm (bits), loss (bits), and the final
/// parameters.
#[derive(Debug, PartialEq)]
struct Run {
    norms: Vec<u64>,
    losses: Vec<u32>,
    params: Bits,
}

fn plan() -> UnitPlan {
    plan_units(&tied_mlp::tree(), &tied_mlp::wrap()).unwrap()
}

fn specs() -> Vec<ParamSpec> {
    plan().units.into_iter().flat_map(|u| u.params).collect()
}

/// The twin of a device, each operation a millisecond late.
fn twin() -> ComputeDevice {
    ComputeDevice::host_twin_with_latency(1 << 26, Default::default(), Duration::from_millis(1))
        .unwrap()
}

/// Build a rank's engine on the host (`on_device` false) or with its shards on the twin,
/// with two parameter groups (decay on matrices, half the learning rate and no decay on the
/// rest) and a cosine schedule.
fn engine(
    comm: Box<dyn Communicator>,
    on_device: bool,
    config: FsdpConfig,
    optim: OptimizerConfig,
    init: &HashMap<String, Vec<f32>>,
) -> Fsdp {
    let (plan, init) = (plan(), ParamInit::Full(init));
    let mut fsdp = if on_device {
        Fsdp::new_on(comm, twin(), &plan, init, config, optim).unwrap()
    } else {
        Fsdp::new(comm, &plan, init, config, optim).unwrap()
    };
    let groups = vec![
        ParamGroupOptions::with_weight_decay(0.1),
        ParamGroupOptions {
            weight_decay: Some(0.0),
            lr_scale: 0.5,
        },
    ];
    fsdp.set_param_groups(groups, |_, shape| decay_2d_only_group(shape))
        .unwrap();
    fsdp.set_lr_schedule(LrSchedule::Cosine {
        warmup_iters: 1,
        lr_decay_iters: 6,
        min_lr: 1e-3,
    })
    .unwrap();
    fsdp
}

/// Steps `steps` of a rank: forward and backward (through `HostCompute` on a device), the
/// norm clipped to [`MAX_NORM`], and the optimizer step (skipped at step 1).
fn steps(fsdp: &mut Fsdp, world: usize, steps: std::ops::Range<usize>) -> Run {
    let model = TiedMlp { global: GLOBAL };
    let batch = tied_mlp::batch(GLOBAL, fsdp.rank(), world);
    let mut run = Run {
        norms: Vec::new(),
        losses: Vec::new(),
        params: Vec::new(),
    };
    for step in steps {
        let loss = if fsdp.compute_device().is_some() {
            fsdp.forward_backward(&HostCompute::new(&model), &batch)
        } else {
            fsdp.forward_backward(&model, &batch)
        };
        run.losses.push(loss.unwrap().to_bits());
        let norm = fsdp.clip_grad_norm(MAX_NORM).unwrap();
        assert!(norm > MAX_NORM, "step {step}: the clipping does not bite");
        run.norms.push(norm.to_bits());
        // Clipping changed the gradients: the norm now is the clipped one.
        assert!((fsdp.grad_norm().unwrap() - MAX_NORM).abs() < 1e-6);
        if step == 1 {
            fsdp.skip_step().unwrap();
        } else {
            fsdp.optimizer_step().unwrap();
        }
    }
    run.params = bits(&fsdp.full_state_dict().unwrap());
    run
}

/// Rank 0's run of `world` ranks, all `STEPS` at once.
fn run(world: usize, config: FsdpConfig, optim: OptimizerConfig, on_device: bool) -> Run {
    let init = tied_mlp::init_params(&tied_mlp::tree());
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let mut fsdp = engine(Box::new(comm), on_device, config, optim, &init);
        steps(&mut fsdp, world, 0..STEPS)
    })
    .unwrap();
    out.swap_remove(0)
}

fn configs() -> Vec<(usize, FsdpConfig)> {
    let mut hybrid = FsdpConfig::new(ShardingStrategy::HybridShard);
    hybrid.ranks_per_node = Some(2);
    vec![
        (1, FsdpConfig::new(ShardingStrategy::FullShard)),
        (2, FsdpConfig::new(ShardingStrategy::FullShard)),
        (3, FsdpConfig::new(ShardingStrategy::ShardGradOp)),
        (2, FsdpConfig::new(ShardingStrategy::NoShard)),
        (4, hybrid),
    ]
}

fn optimizers() -> [OptimizerConfig; 3] {
    [
        adamw().into(),
        SgdConfig::with_momentum(0.05, 0.9).into(),
        SgdConfig::with_momentum(0.05, 0.0).into(),
    ]
}

#[test]
fn the_optimizer_side_on_the_device_gives_the_host_engines_bits() {
    for (world, config) in configs() {
        for optim in optimizers() {
            let what = format!("world {world}, {:?}, {optim:?}", config.strategy);
            same_on_device(world, config, optim, &what);
        }
    }
}

/// Rank 0's run on the host engine, checked equal bit for bit (norms, losses, parameters) to
/// the run with the shards on the twin, and learning.
fn same_on_device(world: usize, config: FsdpConfig, optim: OptimizerConfig, what: &str) -> Run {
    let host = run(world, config, optim, false);
    let dev = run(world, config, optim, true);
    assert_eq!(dev.norms, host.norms, "{what}: gradient norms");
    assert_eq!(dev.losses, host.losses, "{what}: losses");
    assert_eq!(dev.params, host.params, "{what}: parameters");
    let l = |b: u32| f32::from_bits(b);
    assert!(l(host.losses[STEPS - 1]) < l(host.losses[0]), "{what}");
    host
}

/// Rank 0's final run after resuming at step 2 from the checkpoint in `dir`, on the host or
/// with the shards on the twin.
fn resume(
    world: usize,
    config: FsdpConfig,
    optim: OptimizerConfig,
    dir: &Path,
    on_device: bool,
) -> Run {
    let ckpt = load_sharded_checkpoint(dir, &specs()).unwrap();
    let state = ckpt.optimizer.expect("an optimizer state");
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let mut fsdp = engine(Box::new(comm), on_device, config, optim, &ckpt.params);
        fsdp.load_optimizer_state(&state).unwrap();
        steps(&mut fsdp, world, 2..STEPS)
    })
    .unwrap();
    out.swap_remove(0)
}

#[test]
fn checkpoints_written_from_the_device_resume_on_the_device_and_on_the_host() {
    for (world, config) in [
        (2, FsdpConfig::new(ShardingStrategy::FullShard)),
        (3, FsdpConfig::new(ShardingStrategy::NoShard)),
    ] {
        for optim in [adamw().into(), SgdConfig::with_momentum(0.05, 0.9).into()] {
            let what = format!("world {world}, {:?}, {optim:?}", config.strategy);
            let whole = run(world, config, optim, false);
            let dir = temp_dir(
                "device-shards",
                &format!("{world}-{}", matches!(optim, OptimizerConfig::Sgd(_))),
            );
            let init = tied_mlp::init_params(&tied_mlp::tree());
            ring::run_ranks(world, ring_options(), |comm| {
                let mut fsdp = engine(Box::new(comm), true, config, optim, &init);
                steps(&mut fsdp, world, 0..2);
                fsdp.save_sharded(&dir).unwrap();
            })
            .unwrap();
            for on_device in [true, false] {
                let resumed = resume(world, config, optim, &dir, on_device);
                assert_eq!(
                    resumed.params, whole.params,
                    "{what}, resumed on device {on_device}"
                );
                assert_eq!(resumed.losses, whole.losses[2..], "{what}");
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}

/// AnyPrecisionAdamW's settings on a device: torchdistx's pure-bf16 recipe (bf16 shards, bf16
/// moments and Kahan compensation), f32 shards and state without compensation, and one state
/// dtype each (momentum f32, variance bf16, compensation f16; the host twin steps any mix).
fn any_precision() -> [(OptimizerConfig, DType); 3] {
    let base = AnyPrecisionAdamWConfig {
        lr: 1e-2,
        ..AnyPrecisionAdamWConfig::default()
    };
    let f32_state = AnyPrecisionAdamWConfig {
        use_kahan_summation: false,
        momentum_dtype: DType::F32,
        variance_dtype: DType::F32,
        ..base
    };
    let mixed = AnyPrecisionAdamWConfig {
        momentum_dtype: DType::F32,
        variance_dtype: DType::BF16,
        compensation_buffer_dtype: DType::F16,
        ..base
    };
    [
        (base.into(), DType::BF16),
        (f32_state.into(), DType::F32),
        (mixed.into(), DType::BF16),
    ]
}

/// AnyPrecisionAdamW with its shards and state on the device (bf16 shards: pure-bf16
/// training) steps there, over the parameter groups, schedule, clipping and skipped step of
/// the other optimizers: every norm, loss and parameter the host engine's; and with the shards
/// offloaded it steps in host memory, the same again.
#[test]
fn any_precision_adamw_on_the_device_gives_the_host_engines_bits() {
    for (world, config) in configs() {
        for (optim, param_dtype) in any_precision() {
            let config = FsdpConfig {
                mixed_precision: MixedPrecisionPolicy::new(param_dtype, Some(DType::F32)),
                ..config
            };
            let what = format!("world {world}, {:?}, {optim:?}", config.strategy);
            let host = same_on_device(world, config, optim, &what);
            if world == 2 {
                let offloaded = FsdpConfig {
                    offload_params: true,
                    ..config
                };
                let off = run(world, offloaded, optim, true);
                assert_eq!(off.params, host.params, "{what}: offloaded");
            }
        }
    }
}

/// A sharded checkpoint of AnyPrecisionAdamW's state (its moments and compensation in their
/// dtypes on the device) written at step 2 and resumed on the device and on the host gives an
/// uninterrupted run's bits.
#[test]
fn any_precision_adamw_checkpoints_resume_from_the_device() {
    let (optim, param_dtype) = any_precision()[0];
    let config = FsdpConfig {
        mixed_precision: MixedPrecisionPolicy::new(param_dtype, Some(DType::F32)),
        ..FsdpConfig::new(ShardingStrategy::FullShard)
    };
    let world = 2;
    let whole = run(world, config, optim, false);
    let dir = temp_dir("device-shards", "any-precision");
    let init = tied_mlp::init_params(&tied_mlp::tree());
    ring::run_ranks(world, ring_options(), |comm| {
        let mut fsdp = engine(Box::new(comm), true, config, optim, &init);
        steps(&mut fsdp, world, 0..2);
        fsdp.save_sharded(&dir).unwrap();
    })
    .unwrap();
    for on_device in [true, false] {
        let resumed = resume(world, config, optim, &dir, on_device);
        assert_eq!(
            resumed.params, whole.params,
            "resumed on device {on_device}"
        );
        assert_eq!(resumed.losses, whole.losses[2..]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Rank 0's run of `world` ranks with fp16 parameters and reductions and a grad scaler whose
/// first scale overflows fp16: losses, parameters, skipped steps and the final scale.
fn scaled_run(
    world: usize,
    strategy: ShardingStrategy,
    place: Option<bool>,
) -> (Vec<u32>, Bits, u64, u32) {
    let init = tied_mlp::init_params(&tied_mlp::tree());
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let config = FsdpConfig {
            mixed_precision: MixedPrecisionPolicy::new(DType::F16, Some(DType::F16)),
            offload_params: place == Some(true),
            ..FsdpConfig::new(strategy)
        };
        let mut fsdp = engine(
            Box::new(comm),
            place.is_some(),
            config,
            adamw().into(),
            &init,
        );
        fsdp.set_grad_scaler(Some(GradScalerConfig {
            init_scale: 2f32.powi(18),
            growth_interval: 2,
            ..GradScalerConfig::default()
        }))
        .unwrap();
        let model = TiedMlp { global: GLOBAL };
        let batch = tied_mlp::batch(GLOBAL, fsdp.rank(), world);
        let mut losses = Vec::new();
        for _ in 0..8 {
            let loss = match place {
                Some(_) => fsdp.forward_backward(&HostCompute::new(&model), &batch),
                None => fsdp.forward_backward(&model, &batch),
            };
            losses.push(loss.unwrap().to_bits());
            fsdp.optimizer_step().unwrap();
        }
        let s = fsdp.grad_scaler().unwrap();
        let (skipped, scale) = (s.skipped_steps(), s.scale().to_bits());
        (
            losses,
            bits(&fsdp.full_state_dict().unwrap()),
            skipped,
            scale,
        )
    })
    .unwrap();
    out.swap_remove(0)
}

#[test]
fn the_grad_scaler_on_the_device_gives_the_host_engines_bits() {
    for (world, strategy) in [
        (1, ShardingStrategy::FullShard),
        (2, ShardingStrategy::FullShard),
        (3, ShardingStrategy::NoShard),
    ] {
        let host = scaled_run(world, strategy, None);
        assert!(host.2 > 0, "world {world}: no step overflowed");
        assert!(host.2 < 8, "world {world}: every step overflowed");
        for offload in [false, true] {
            let dev = scaled_run(world, strategy, Some(offload));
            let what = format!("world {world}, {strategy:?}, offload {offload}");
            assert_eq!(dev.0, host.0, "{what}: losses");
            assert_eq!(dev.1, host.1, "{what}: parameters");
            assert_eq!((dev.2, dev.3), (host.2, host.3), "{what}: skips and scale");
        }
        println!(
            "world {world} {strategy:?}: {} of 8 steps skipped, final scale {}",
            host.2,
            f32::from_bits(host.3)
        );
    }
}
