//! The non-finite rule (`Fsdp::optimizer_step_if_finite`, `Fsdp::set_skip_nonfinite`): a step
//! whose loss (summed over the world) or gradient norm is not finite is skipped and counted,
//! and past the limit the engine halts — no later step applies. With the shards on a device
//! the decision is made there (`engine_decide`) and read one step late
//! (`Fsdp::step_outcomes`); on the host at once. On the host twin of a device (10 ms per
//! operation), with clipping, with and without the grad scaler (whose overflow is its own skip,
//! not a non-finite step), a NaN loss on one rank at two steps and a NaN input on another rank
//! at a third (its gradients, and so the norm, are NaN):
//!
//! - every step's outcome (loss and norm bit for bit, applied, overflow, halted) and the final
//!   parameters and step counts equal the host engine's, and what was applied is the closed
//!   form of the rule;
//! - a step issued while the previous one's outcome is unread waits for nothing on the host,
//!   and returns while the device still works; each outcome arrives one step late.

#[path = "common/chain.rs"]
mod chain;
mod common;

use std::time::Duration;

use fsdp::engine::{
    ComputeDevice, FsdpConfig, GradScalerConfig, ParamInit, ShardingStrategy, StepOutcome,
};
use fsdp::Fsdp;
use fsdp_collectives::{ring, Communicator};
use fsdp_device::Buffer;

use chain::{batch, init, plan};
use common::{adamw, bits, ring_options, Bits};

/// Steps of a run.
const STEPS: usize = 10;
/// Steps whose loss is NaN (on rank 0).
const NAN_LOSS: [usize; 2] = [2, 7];
/// The step whose input is NaN (on the last rank): its gradients are.
const NAN_GRAD: usize = 5;

/// What a rank's run gives.
#[derive(Debug, PartialEq)]
struct Run {
    /// Each step's outcome, as (loss bits, norm bits, applied, found_inf, halted).
    outcomes: Vec<(u32, u64, bool, bool, bool)>,
    params: Bits,
    optimizer_steps: u64,
    /// Host waits counted while issuing the steps after the first.
    steady_waits: u64,
    /// The device was busy whenever such a step returned.
    ran_ahead: bool,
    /// How many outcomes each step's `step_outcomes` returned.
    arrivals: Vec<usize>,
}

fn as_tuple(o: &StepOutcome) -> (u32, u64, bool, bool, bool) {
    (
        o.loss.to_bits(),
        o.grad_norm.to_bits(),
        o.applied,
        o.found_inf,
        o.halted,
    )
}

/// This rank's loss at `step`: exact values, NaN on rank 0 at [`NAN_LOSS`].
fn local_loss(rank: usize, step: usize) -> f64 {
    if rank == 0 && NAN_LOSS.contains(&step) {
        f64::NAN
    } else {
        (step + 1) as f64 * 0.25 + rank as f64 * 0.125
    }
}

/// `v` as the engine's loss buffer: on its device, or in host memory.
fn loss_buffer(fsdp: &Fsdp, v: f64) -> Buffer {
    let host = Buffer::from_slice(&[v]).unwrap();
    match fsdp.compute_device() {
        Some(dev) => dev.copy_from_host(&host, dev.compute_stream()).unwrap(),
        None => host,
    }
}

fn run(world: usize, on_device: bool, scaler: Option<GradScalerConfig>, limit: Option<u64>) -> Run {
    let init = init();
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let config = FsdpConfig {
            // The limiter waits on the host for freed memory by design: off here.
            limit_all_gathers: None,
            ..FsdpConfig::new(ShardingStrategy::FullShard)
        };
        let (plan, init) = (plan(), ParamInit::Full(&init));
        let comm: Box<dyn Communicator> = Box::new(comm);
        let mut fsdp = if on_device {
            let latency = Duration::from_millis(10);
            let dev = ComputeDevice::host_twin_with_latency(1 << 24, Default::default(), latency)
                .unwrap();
            Fsdp::new_on(comm, dev, &plan, init, config, adamw()).unwrap()
        } else {
            Fsdp::new(comm, &plan, init, config, adamw()).unwrap()
        };
        fsdp.set_grad_scaler(scaler).unwrap();
        fsdp.set_skip_nonfinite(limit);
        let ((x, t), model) = batch(rank, world);
        let mut outcomes = Vec::new();
        let (mut steady_waits, mut ran_ahead, mut arrivals) = (0, true, Vec::new());
        for step in 0..STEPS {
            let before = fsdp.host_waits();
            let mut x = x.clone();
            if step == NAN_GRAD && rank + 1 == world {
                x[0] = f32::NAN;
            }
            drop(
                fsdp.forward_backward_async(&model, &(x, t.clone()))
                    .unwrap(),
            );
            let loss = loss_buffer(&fsdp, local_loss(rank, step));
            drop(fsdp.clip_grad_norm_async(0.5).unwrap());
            fsdp.optimizer_step_if_finite(&loss).unwrap();
            if step > 0 {
                steady_waits += fsdp.host_waits() - before;
                if let Some(dev) = fsdp.compute_device() {
                    ran_ahead &= !dev.compute_stream().query();
                }
            }
            let arrived = fsdp.step_outcomes().unwrap();
            arrivals.push(arrived.len());
            outcomes.extend(arrived.iter().map(as_tuple));
        }
        let last = fsdp.flush_step_outcomes().unwrap();
        arrivals.push(last.len());
        outcomes.extend(last.iter().map(as_tuple));
        Run {
            outcomes,
            params: bits(&fsdp.full_state_dict().unwrap()),
            optimizer_steps: fsdp.optimizer_steps(),
            steady_waits,
            ran_ahead,
            arrivals,
        }
    })
    .unwrap();
    out.swap_remove(0)
}

/// Which steps the rule applies, in closed form: the loss and the norm checked (the norm not
/// on an overflow of the scaler, which skips on its own), past `limit` non-finite steps none.
fn applied_by_rule(scaler: bool, limit: Option<u64>) -> Vec<bool> {
    let (mut nonfinite, mut halted) = (0u64, false);
    (0..STEPS)
        .map(|step| {
            let bad_loss = NAN_LOSS.contains(&step);
            let bad_grads = step == NAN_GRAD;
            let overflow = scaler && bad_grads;
            if bad_loss || (bad_grads && !overflow) {
                nonfinite += 1;
                halted |= limit.is_some_and(|k| nonfinite > k);
            }
            !(bad_loss || bad_grads || halted)
        })
        .collect()
}

#[test]
fn nonfinite_steps_are_decided_on_the_device_as_on_the_host_one_step_late() {
    let scaler = GradScalerConfig {
        init_scale: 1024.0,
        ..GradScalerConfig::default()
    };
    for world in [1, 2] {
        for (with_scaler, limit) in [(false, None), (false, Some(1)), (true, Some(1))] {
            let what = format!("world {world}, scaler {with_scaler}, limit {limit:?}");
            let scaler = with_scaler.then_some(scaler);
            let host = run(world, false, scaler, limit);
            let dev = run(world, true, scaler, limit);
            assert_eq!(dev.outcomes, host.outcomes, "{what}: outcomes");
            assert_eq!(dev.params, host.params, "{what}: parameters");
            assert_eq!(dev.optimizer_steps, host.optimizer_steps, "{what}: steps");
            let applied: Vec<bool> = host.outcomes.iter().map(|o| o.2).collect();
            let want = applied_by_rule(with_scaler, limit);
            assert_eq!(applied, want, "{what}: the rule");
            let taken = want.iter().filter(|&&a| a).count() as u64;
            assert_eq!(host.optimizer_steps, taken, "{what}: steps taken");
            // The losses are the ranks' sums; the norms are finite but at the NaN gradients.
            for (step, o) in host.outcomes.iter().enumerate() {
                let sum: f64 = (0..world).map(|r| local_loss(r, step)).sum();
                assert_eq!(o.0, (sum as f32).to_bits(), "{what}: step {step}'s loss");
                let norm = f64::from_bits(o.1);
                assert_eq!(
                    norm.is_finite(),
                    step != NAN_GRAD,
                    "{what}: step {step}'s norm"
                );
            }
            // Two non-finite steps pass a limit of 1 with or without the scaler.
            let halted = host.outcomes.iter().any(|o| o.4);
            assert_eq!(halted, limit.is_some(), "{what}: halted");
            // On the device: the steps wait for nothing, each outcome one step late.
            assert_eq!(dev.steady_waits, 0, "{what}: host waits");
            assert!(dev.ran_ahead, "{what}: the host waited for the device");
            let mut late = vec![0];
            late.extend(std::iter::repeat_n(1, STEPS));
            assert_eq!(dev.arrivals, late, "{what}: arrivals");
            let mut at_once = vec![1; STEPS];
            at_once.push(0);
            assert_eq!(host.arrivals, at_once, "{what}: arrivals on the host");
        }
    }
}

/// A loss of another shape is refused by name, and the engine steps on after.
#[test]
fn a_loss_of_another_shape_is_refused() {
    let init = init();
    ring::run_ranks(1, ring_options(), |comm| {
        let config = FsdpConfig::new(ShardingStrategy::FullShard);
        let (plan, init) = (plan(), ParamInit::Full(&init));
        let mut fsdp = Fsdp::new(Box::new(comm), &plan, init, config, adamw()).unwrap();
        let ((x, t), model) = batch(0, 1);
        fsdp.forward_backward(&model, &(x, t)).unwrap();
        for bad in [
            Buffer::from_slice(&[1.0f64, 2.0]).unwrap(),
            Buffer::from_slice(&[1.0f32]).unwrap(),
        ] {
            let e = fsdp.optimizer_step_if_finite(&bad).unwrap_err().to_string();
            assert!(e.contains("rank 0") && e.contains("one f64 element"), "{e}");
        }
        fsdp.optimizer_step_if_finite(&Buffer::from_slice(&[0.5f64]).unwrap())
            .unwrap();
        let o = fsdp.step_outcomes().unwrap();
        assert_eq!(o.len(), 1);
        assert!(o[0].applied && !o[0].nonfinite());
        assert_eq!(fsdp.optimizer_steps(), 1);
    })
    .unwrap();
}
