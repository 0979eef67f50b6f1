//! The grad scaler with the shards on a device (`Fsdp::new_on`, `Fsdp::set_grad_scaler`): its
//! state lives there, the step's overflow is decided there and the optimizer steps as decided,
//! so no step waits on the host for `found_inf`; the host reads each decision two decisions
//! later. On the host twin of a device (10 ms per operation), with fp16 reductions that the
//! first scales overflow, AdamW and a warmup-cosine schedule (so the two step-number and
//! learning-rate choices differ), and a trainer's skips after unscaling every fourth step
//! (the first overflows, later ones need not):
//!
//! - the losses, parameters, skips, scale, growth tracker, optimizer steps and learning rate
//!   equal the host engine's bit for bit, read after every step (each read waits for the
//!   device) or only at the end, and so do the overflows `unscale_grads` returns;
//! - a loop that reads its loss one step late (as a trainer logging it) never makes the
//!   engine wait on the host, and returns from each step while the device still works;
//! - a sharded checkpoint saved right after a step whose outcome is unread holds the host
//!   engine's optimizer steps and scaler state, and resumes (on the device) to the host
//!   engine's parameters;
//! - turning the scaler off (or on again) right after a step whose outcome is unread keeps
//!   the steps the device counted;
//! - a failed all-reduce of the overflow's sums is reported on every rank within the
//!   timeouts, never a hang and never a silent success.

#[path = "common/chain.rs"]
mod chain;
mod common;
#[path = "common/hooked.rs"]
mod hooked;

use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use fsdp::checkpoint::load_sharded_checkpoint;
use fsdp::engine::{
    load_grad_scaler_state, ComputeDevice, DeviceScalar, FsdpConfig, GradScalerConfig,
    GradScalerState, MixedPrecisionPolicy, ParamInit, ShardingStrategy,
};
use fsdp::optim::LrSchedule;
use fsdp::Fsdp;
use fsdp_collectives::{ring, Communicator};
use fsdp_device::DType;

use chain::{batch, init, plan, specs};
use common::{adamw, bits, mesh, ring_options, temp_dir, Bits};

/// Steps of a run.
const STEPS: usize = 12;
/// The checkpoint is saved after this many steps.
const SAVE_AT: usize = 6;

/// The grad scaler's settings: a first scale that overflows the fp16 reductions, grown every
/// second step without overflow.
fn scaler() -> GradScalerConfig {
    GradScalerConfig {
        init_scale: 2f32.powi(22),
        growth_interval: 2,
        ..GradScalerConfig::default()
    }
}

/// What the host reads of a scaler and an engine after a step.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Numbers {
    optimizer_steps: u64,
    lr: u64,
    scaler: GradScalerState,
    scale_bits: u32,
}

fn numbers(f: &Fsdp) -> Numbers {
    let scaler = f.grad_scaler().expect("a grad scaler").state();
    Numbers {
        optimizer_steps: f.optimizer_steps(),
        lr: f.lr().to_bits(),
        scaler,
        scale_bits: scaler.scale.to_bits(),
    }
}

/// What a rank's steps give.
#[derive(Debug, Default)]
struct Run {
    losses: Vec<u32>,
    params: Bits,
    /// [`Numbers`] after each step, when read after each.
    per_step: Vec<Numbers>,
    /// Each trainer's skip's overflow, as `unscale_grads` and `found_inf` read it, when read
    /// after each step.
    found: Vec<(bool, Option<bool>)>,
    last: Option<Numbers>,
    /// Host waits counted in the steps after the first.
    steady_waits: u64,
    /// The device was busy whenever a step after the first returned.
    ran_ahead: bool,
}

/// A rank's engine over `comm`: on the host, or its shards on the host twin of a device with
/// 10 ms per operation; fp32 parameters, fp16 reductions, AdamW with a warmup-cosine schedule,
/// the grad scaler on; from `init`.
fn engine(
    comm: Box<dyn Communicator>,
    mesh: FsdpConfig,
    on_device: bool,
    init: &std::collections::HashMap<String, Vec<f32>>,
) -> Fsdp {
    let config = FsdpConfig {
        mixed_precision: MixedPrecisionPolicy::new(DType::F32, Some(DType::F16)),
        // The limiter waits on the host for freed memory by design: off here.
        limit_all_gathers: None,
        forward_prefetch: true,
        ..mesh
    };
    let (plan, init) = (plan(), ParamInit::Full(init));
    let mut fsdp = if on_device {
        let dev =
            ComputeDevice::host_twin_with_latency(1 << 24, Default::default(), latency()).unwrap();
        Fsdp::new_on(comm, dev, &plan, init, config, adamw()).unwrap()
    } else {
        Fsdp::new(comm, &plan, init, config, adamw()).unwrap()
    };
    fsdp.set_lr_schedule(LrSchedule::Cosine {
        warmup_iters: 3,
        lr_decay_iters: 10,
        min_lr: 1e-3,
    })
    .unwrap();
    fsdp.set_grad_scaler(Some(scaler())).unwrap();
    fsdp
}

fn latency() -> Duration {
    Duration::from_millis(10)
}

/// Steps `steps` of training on `fsdp`: every fourth one, from the first, a trainer's skip after unscaling
/// (clipping by a limit that never bites, then `skip_step`), the others `optimizer_step`.
/// With `each_step` the host reads [`Numbers`] after every step; else it reads each loss one
/// step late, before the next optimizer step. Saves a sharded checkpoint into `save` after
/// [`SAVE_AT`] steps.
fn train(fsdp: &mut Fsdp, steps: Range<usize>, each_step: bool, save: Option<&Path>) -> Run {
    let (batch, model) = batch(fsdp.rank(), fsdp.world_size());
    let mut run = Run {
        ran_ahead: true,
        ..Run::default()
    };
    let mut losses: Vec<DeviceScalar> = Vec::new();
    let first = steps.start;
    for step in steps {
        let before = fsdp.host_waits();
        let loss = fsdp.forward_backward_async(&model, &batch).unwrap();
        if !each_step {
            if let Some(prev) = losses.last() {
                prev.value().unwrap();
            }
        }
        losses.push(loss);
        if step % 4 == 0 {
            fsdp.clip_grad_norm_async(1e30).unwrap();
            if each_step {
                // A wait on the host: the overflow, read as a trainer that skips on it would.
                let found = fsdp.unscale_grads().unwrap();
                run.found
                    .push((found, fsdp.grad_scaler().and_then(|s| s.found_inf())));
            }
            fsdp.skip_step().unwrap();
        } else {
            fsdp.optimizer_step().unwrap();
        }
        if step > first {
            run.steady_waits += fsdp.host_waits() - before;
            if let Some(dev) = fsdp.compute_device() {
                run.ran_ahead &= !dev.compute_stream().query();
            }
        }
        if each_step {
            run.per_step.push(numbers(fsdp));
        }
        if step + 1 == SAVE_AT {
            if let Some(dir) = save {
                fsdp.save_sharded(dir).unwrap();
            }
        }
    }
    run.losses = losses
        .iter()
        .map(|l| (l.value().unwrap() as f32).to_bits())
        .collect();
    run.last = Some(numbers(fsdp));
    run.params = bits(&fsdp.full_state_dict().unwrap());
    run
}

/// Rank 0's whole run.
fn run(
    world: usize,
    mesh: FsdpConfig,
    on_device: bool,
    each_step: bool,
    save: Option<&Path>,
) -> Run {
    let init = init();
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let mut fsdp = engine(Box::new(comm), mesh, on_device, &init);
        train(&mut fsdp, 0..STEPS, each_step, save)
    })
    .unwrap();
    out.swap_remove(0)
}

/// Rank 0's run resumed on the device from the checkpoint in `dir`.
fn resume(world: usize, mesh: FsdpConfig, dir: &Path) -> Run {
    let ckpt = load_sharded_checkpoint(dir, &specs()).unwrap();
    let state = ckpt.optimizer.expect("an optimizer state");
    let scaler_state = load_grad_scaler_state(dir)
        .unwrap()
        .expect("a scaler state");
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let mut fsdp = engine(Box::new(comm), mesh, true, &ckpt.params);
        fsdp.load_optimizer_state(&state).unwrap();
        fsdp.set_grad_scaler_state(scaler_state).unwrap();
        train(&mut fsdp, SAVE_AT..STEPS, false, None)
    })
    .unwrap();
    out.swap_remove(0)
}

#[test]
fn the_grad_scaler_on_the_device_gives_the_host_engines_bits_without_blocking_the_host() {
    for (world, strategy, ranks_per_node) in [
        (1, ShardingStrategy::FullShard, None),
        (2, ShardingStrategy::FullShard, None),
        (2, ShardingStrategy::ShardGradOp, None),
        (2, ShardingStrategy::NoShard, None),
        (4, ShardingStrategy::HybridShard, Some(2)),
    ] {
        let what = format!("world {world}, {strategy:?}, {ranks_per_node:?} ranks per node");
        let config = mesh(strategy, ranks_per_node);
        let host = run(world, config, false, true, None);
        let last = host.last.unwrap();
        let taken = last.optimizer_steps;
        let skipped = last.scaler.skipped_steps;
        println!(
            "{what}: {taken} steps taken, {skipped} skipped for an overflow, {} by the trainer; \
             final scale {}",
            STEPS as u64 - taken - skipped,
            last.scaler.scale
        );
        // Both of the scaler's branches run, and the trainer's skips with and without an
        // overflow.
        assert!(skipped > 0 && taken > 2, "{what}: {last:?}");
        assert!(
            host.found.iter().any(|f| f.0) && host.found.iter().any(|f| !f.0),
            "{what}: {:?}",
            host.found
        );

        let each = run(world, config, true, true, None);
        assert_eq!(
            each.per_step, host.per_step,
            "{what}: numbers after each step"
        );
        assert_eq!(
            each.found, host.found,
            "{what}: overflows read by unscale_grads"
        );
        assert_eq!(each.losses, host.losses, "{what}: losses");
        assert_eq!(each.params, host.params, "{what}: parameters");

        let late = run(world, config, true, false, None);
        assert_eq!(late.losses, host.losses, "{what}: losses");
        assert_eq!(late.params, host.params, "{what}: parameters");
        assert_eq!(late.last, host.last, "{what}: numbers at the end");
        println!(
            "{what}: host waits in {} steady-state steps: {}",
            STEPS - 1,
            late.steady_waits
        );
        assert_eq!(late.steady_waits, 0, "{what}: host waits");
        assert!(
            late.ran_ahead,
            "{what}: the device was idle when a step returned"
        );
    }
}

#[test]
fn a_checkpoint_saved_with_an_unread_decision_resumes_to_the_host_engines_bits() {
    let (world, config) = (2, FsdpConfig::new(ShardingStrategy::FullShard));
    let dir = |name| temp_dir("device-grad-scaler", name);
    let (host_dir, dev_dir) = (dir("host"), dir("device"));
    let host = run(world, config, false, false, Some(&host_dir));
    run(world, config, true, false, Some(&dev_dir));
    let steps = |dir: &Path| {
        let c = load_sharded_checkpoint(dir, &specs()).unwrap();
        (c.optimizer.unwrap().optimizer_steps, bits(&c.params))
    };
    let (host_steps, host_params) = steps(&host_dir);
    let (dev_steps, dev_params) = steps(&dev_dir);
    assert_eq!(dev_steps, host_steps, "optimizer steps saved");
    assert_eq!(dev_params, host_params, "parameters saved");
    let scaler = |dir: &Path| load_grad_scaler_state(dir).unwrap().unwrap();
    assert_eq!(scaler(&dev_dir), scaler(&host_dir), "scaler state saved");
    println!(
        "saved after {SAVE_AT} steps: {host_steps} taken, scaler {:?}",
        scaler(&host_dir)
    );
    let resumed = resume(world, config, &dev_dir);
    assert_eq!(resumed.params, host.params, "resumed parameters");
    assert_eq!(resumed.losses, host.losses[SAVE_AT..], "resumed losses");
    assert_eq!(resumed.last, host.last, "resumed numbers");
    for dir in [host_dir, dev_dir] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn a_failed_all_reduce_of_the_overflow_is_reported_without_a_hang() {
    // Each step all-reduces the loss (in `forward_backward_async`) then the unscaled
    // gradients' squares (in `optimizer_step`): rank 1 fails its fourth all-reduce, step 1's
    // squares, without taking part. Rank 1 gets the error at once; rank 0's host does not wait
    // for that all-reduce (the device's decision does), so it gets it when it reads that
    // decision's outcome (two decisions later), at a check of the deferred collectives, or at
    // `synchronize` — within the timeouts.
    chain::assert_fault_reported(
        STEPS,
        |rank, comm| {
            let mut hooked = hooked::Hooked::new(comm);
            if rank == 1 {
                hooked.fail_all_reduce = Some(3);
            }
            Box::new(hooked)
        },
        |comm| {
            let rank = comm.rank();
            let config = FsdpConfig::new(ShardingStrategy::FullShard);
            let fsdp = engine(comm, config, true, &init());
            let (batch, model) = batch(rank, 2);
            (fsdp, batch, model)
        },
    );
}

/// Turning the scaler off right after a step whose outcome is unread keeps the steps the
/// device counted (the engine's step count and schedule go on from them), and a scaler set
/// again starts afresh on the device: the host engine's losses, parameters and numbers.
#[test]
fn turning_the_scaler_off_and_on_between_unread_steps_keeps_the_devices_count() {
    let init = init();
    let outcome = |on_device: bool| {
        let mut out = ring::run_ranks(2, ring_options(), |comm| {
            let config = FsdpConfig::new(ShardingStrategy::FullShard);
            let mut fsdp = engine(Box::new(comm), config, on_device, &init);
            let (batch, model) = batch(fsdp.rank(), 2);
            let mut losses = Vec::new();
            let mut steps = Vec::new();
            for phase in 0..3 {
                for _ in 0..3 {
                    let loss = fsdp.forward_backward_async(&model, &batch).unwrap();
                    fsdp.optimizer_step().unwrap();
                    losses.push((loss.value().unwrap() as f32).to_bits());
                }
                // Off after the first phase, on again (a fresh scaler) after the second.
                fsdp.set_grad_scaler((phase == 1).then(scaler)).unwrap();
                steps.push((fsdp.optimizer_steps(), fsdp.lr().to_bits()));
            }
            let state = fsdp.grad_scaler().map(|s| s.state());
            (losses, steps, state, bits(&fsdp.full_state_dict().unwrap()))
        })
        .unwrap();
        out.swap_remove(0)
    };
    let host = outcome(false);
    let dev = outcome(true);
    println!("steps and lr after each phase: {:?}", host.1);
    assert!(
        host.1[0].0 < 3,
        "no step skipped for an overflow: {:?}",
        host.1
    );
    assert_eq!(dev.1, host.1, "steps and learning rates");
    assert_eq!(dev.0, host.0, "losses");
    assert_eq!(dev.2, host.2, "scaler state");
    assert_eq!(dev.3, host.3, "parameters");
}
