//! Gradients reduced in bf16 or f16 (FSDP's `MixedPrecisionPolicy.reduce_dtype`,
//! `--reduce-dtype bf16|f16`) by every `DeviceComm`: `PeerComm` (ranks as threads reading each
//! other's 16-bit roundings), `StagedComm` (NCCL's path, 16-bit staging) and `HostComm` over
//! the ring.
//!
//! The reference is computed here with the `half` crate alone: each rank's value rounded to
//! the 16-bit type, the ranks' values added in rank order in f32 with a rounding after each
//! addition, the sum divided by the ranks in f32 and rounded (one rank: the rounding
//! alone). `PeerComm` folds in rank order, so it gives those bits at every world size; the
//! ring folds each chunk from a rank of its own, so it gives them at 2 ranks (a sum of two is
//! the same either way) and, beyond, values of bf16 within the rounding bound of the exact
//! mean — and `StagedComm` over the same ring gives the ring's bits. Then the sharded trainer
//! with bf16 and with f16 reductions: the same bits over the three at 2 ranks, for every
//! strategy that reduces (reduce-scatter, all-reduce, and a hybrid mesh's both).

use std::collections::HashMap;

use fsdp::optim::LrSchedule;
use fsdp_collectives::ring;
use fsdp_device::half::{bf16, f16};
use fsdp_device::DType;
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_comm::{CommVolume, DeviceComm, HostComm};
use fsdp_gpt::device_peer::PeerComm;
use fsdp_gpt::device_plan_sharded::{plan_process_memory, plan_sharded_memory};
use fsdp_gpt::device_sharded::{Prefetch, ShardedDeviceTrainer};
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig};
use fsdp_gpt::runtime::ShardingStrategy;
use fsdp_kernels::gpt::{GptOps, HostOps, Products};

mod common;
use common::device::{
    device_config, exercise_bf16, exercise_f16, grad_value, on_peer_trainers, over_peers,
    over_ring, over_staged, param_bits, staged_trainer, UNIT_LENS,
};

fn round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// `x` rounded to `d` (bf16 or f16).
fn round_to(d: DType, x: f32) -> f32 {
    match d {
        DType::F16 => f16::from_f32(x).to_f32(),
        _ => round(x),
    }
}

/// The reference mean in `d` of element `i` of tensor `t` over `world` ranks (module docs).
fn reference_mean(d: DType, world: usize, t: usize, i: usize) -> f32 {
    let round = |x| round_to(d, x);
    let mut acc = round(grad_value(0, t, i));
    if world == 1 {
        return acc;
    }
    for p in 1..world {
        acc = round(acc + round(grad_value(p, t, i)));
    }
    round(acc / world as f32)
}

/// What [`exercise_bf16`] (`d` bf16) or [`exercise_f16`] gives rank `r` of `world` when the
/// ranks are folded in rank order.
fn expected(d: DType, world: usize, r: usize) -> Vec<Vec<f32>> {
    let reference_mean = |world, t, i| reference_mean(d, world, t, i);
    let mut v: Vec<Vec<f32>> = Vec::new();
    for (t, &n) in UNIT_LENS.iter().enumerate() {
        let s = n.div_ceil(world);
        v.push(
            (r * s..(r + 1) * s)
                .map(|i| {
                    if i < n {
                        reference_mean(world, t, i)
                    } else {
                        0.0
                    }
                })
                .collect(),
        );
    }
    for (t, &n) in UNIT_LENS.iter().enumerate() {
        v.push((0..n).map(|i| reference_mean(world, t, i)).collect());
    }
    // Rank 0's values gathered in bf16: each rounded.
    for (t, &n) in UNIT_LENS.iter().enumerate() {
        v.push((0..n).map(|i| round(grad_value(0, t, i))).collect());
    }
    v
}

/// The exact mean of element `i` of tensor `t` over `world` ranks, and the largest magnitude
/// of the ranks' values.
fn exact_mean(world: usize, t: usize, i: usize) -> (f64, f64) {
    let v: Vec<f64> = (0..world).map(|p| f64::from(grad_value(p, t, i))).collect();
    let max = v.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    (v.iter().sum::<f64>() / world as f64, max)
}

#[test]
fn bf16_reductions_round_as_the_collectives_do() {
    // bf16 keeps 8 significant bits: each rounding is within 2⁻⁸ of its value's magnitude.
    reductions_round_as_the_collectives_do(DType::BF16, 2f64.powi(-8), exercise_bf16);
}

#[test]
fn f16_reductions_round_as_the_collectives_do() {
    // f16 keeps 11 (the values here, below 5 and above 2⁻¹⁴, are normal).
    reductions_round_as_the_collectives_do(DType::F16, 2f64.powi(-11), exercise_f16);
}

type Exercise = fn(&dyn DeviceComm<HostOps>, &HostOps) -> Vec<Vec<f32>>;

fn reductions_round_as_the_collectives_do(d: DType, u: f64, exercise: Exercise) {
    for world in [1, 2, 3, 4] {
        let peers = over_peers(world, exercise);
        let ring = over_ring(world, exercise);
        let staged = over_staged(world, exercise);
        for r in 0..world {
            let want = expected(d, world, r);
            assert_eq!(peers[r], want, "peers, {world} ranks, rank {r}");
            assert_eq!(staged[r], ring[r], "staged against the ring, {world} ranks");
            if world <= 2 {
                assert_eq!(ring[r], want, "ring, {world} ranks, rank {r}");
            }
            // The gathers round alone, in any order: the reference's bits everywhere.
            let n = UNIT_LENS.len();
            assert_eq!(
                ring[r][2 * n..],
                want[2 * n..],
                "ring's bf16 gathers, {world} ranks"
            );
            // The all-reduced tensors (the last of each run) against the exact means: values
            // of bf16, within the roundings of the inputs, the partial sums and the division.
            let all_reduced = &ring[r][UNIT_LENS.len()..2 * UNIT_LENS.len()];
            for (t, got) in all_reduced.iter().enumerate() {
                for (i, &g) in got.iter().enumerate() {
                    let (mean, max) = exact_mean(world, t, i);
                    assert_eq!(round_to(d, g), g, "{world} ranks: {g} is not a {d} value");
                    let bound = (world as f64 + 2.0) * u * max;
                    assert!(
                        (f64::from(g) - mean).abs() <= bound,
                        "{world} ranks, tensor {t}[{i}]: {g} against {mean} (bound {bound})"
                    );
                }
            }
        }
    }
}

/// A reduction in a dtype the device's collectives do not reduce in is refused by name, before
/// anything is sent (a rank alone: no peer to wait for).
#[test]
fn a_reduction_in_f64_is_refused() {
    for errs in [
        over_peers(1, f64_error),
        over_ring(1, f64_error),
        over_staged(1, f64_error),
    ] {
        let e = &errs[0];
        assert!(e.contains("f32, bf16 or f16"), "{e}");
        assert!(
            e.contains("reduce-scatter") && e.contains("all-reduce"),
            "{e}"
        );
    }
}

fn f64_error(comm: &dyn DeviceComm<HostOps>, ops: &HostOps) -> String {
    let full = ops.upload(&[1.0, 2.0]).unwrap();
    let mut shard = ops.upload(&[0.0, 0.0]).unwrap();
    let a = comm
        .reduce_scatter_avg(ops, &[&full], &mut [&mut shard], DType::F64)
        .unwrap_err();
    let mut buf = ops.upload(&[1.0]).unwrap();
    let b = comm
        .all_reduce_avg(ops, &mut [&mut buf], DType::F64)
        .unwrap_err();
    format!("{a}; {b}")
}

/// How a sharded run is set up: the settings, the strategy, the ranks, and the ranks of a
/// node (a hybrid mesh).
type Setup = (DeviceTrainConfig, ShardingStrategy, usize, Option<usize>);

/// Every rank's `f(trainer, losses)` after `steps` steps of `how` from `params` on `tokens`,
/// the ranks threads over `PeerComm` on the host twins.
fn on_peers<R: Send>(
    how: Setup,
    params: &HashMap<String, Vec<f32>>,
    tokens: &[u16],
    steps: usize,
    f: impl Fn(&ShardedDeviceTrainer<HostOps, PeerComm<HostOps>>, Vec<f32>) -> R + Sync,
) -> Vec<R> {
    let (c, s, world, rpn) = how;
    on_peer_trainers((world, rpn), c, s, params, HostOps::new, |mut t| {
        let losses = (0..steps).map(|k| t.step(tokens, k).unwrap().loss);
        let losses = losses.collect();
        f(&t, losses)
    })
}

/// The sharded trainer with bf16 reductions: the same losses and parameters over `PeerComm`,
/// `StagedComm` and (unmeshed) `HostComm` on the ring, for `FULL_SHARD` at 2 ranks
/// (reduce-scatter), `NO_SHARD` at 2 (all-reduce) and `HYBRID_SHARD` in two nodes of two
/// (both, each over 2 ranks); the same first loss as the f32 reductions' run (no update yet)
/// and then different parameters, the losses within 1%.
#[test]
fn sharded_training_reduces_in_bf16() {
    sharded_training_reduces_in(DType::BF16);
}

/// [`sharded_training_reduces_in_bf16`] with f16 reductions.
#[test]
fn sharded_training_reduces_in_f16() {
    sharded_training_reduces_in(DType::F16);
}

fn sharded_training_reduces_in(half: DType) {
    let tokens = synthetic_corpus(20_000, 64, 7);
    let base = device_config(LrSchedule::Constant, true, Some(0.5), 2);
    let params = seeded_params(&base.cfg, 7).unwrap();
    let steps = 4;
    for (s, world, rpn) in [
        (ShardingStrategy::FullShard, 2, None),
        (ShardingStrategy::NoShard, 2, None),
        (ShardingStrategy::HybridShard, 4, Some(2)),
    ] {
        let run = |reduce: DType| {
            let c = DeviceTrainConfig {
                reduce_dtype: reduce,
                ..base
            };
            on_peers((c, s, world, rpn), &params, &tokens, steps, |t, losses| {
                (losses, param_bits(t.full_params().unwrap()))
            })
        };
        let peers = run(half);
        let f32_run = run(DType::F32);
        let c = DeviceTrainConfig {
            reduce_dtype: half,
            ..base
        };
        let staged = ring::run_ranks(world, ring::RingOptions::default(), |comm| {
            let mut t = staged_trainer(HostOps::new(), comm, world, rpn, c, s, &params);
            let losses: Vec<f32> = (0..steps)
                .map(|k| t.step(&tokens, k).unwrap().loss)
                .collect();
            (losses, param_bits(t.full_params().unwrap()))
        })
        .unwrap();
        assert_eq!(staged, peers, "{s:?}: staged against peers");
        if rpn.is_none() {
            let host = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
                let comm: Box<dyn DeviceComm<HostOps>> = Box::new(HostComm::new(Box::new(comm)));
                let mut t = ShardedDeviceTrainer::new(HostOps::new(), comm, c, s, &params).unwrap();
                let losses: Vec<f32> = (0..steps)
                    .map(|k| t.step(&tokens, k).unwrap().loss)
                    .collect();
                (losses, param_bits(t.full_params().unwrap()))
            })
            .unwrap();
            assert_eq!(host, peers, "{s:?}: host staging against peers");
        }
        let (bf, f) = (&peers[0], &f32_run[0]);
        assert_eq!(bf.0[0], f.0[0], "{s:?}: the first loss precedes any update");
        assert!(bf.1 != f.1, "{s:?}: the {half} reductions changed nothing");
        for (a, b) in bf.0.iter().zip(&f.0) {
            assert!(((a - b) / b).abs() < 1e-2, "{s:?}: {a} against {b}");
        }
        println!(
            "{s:?}: {half} reductions' losses {:?}, f32's {:?}",
            bf.0, f.0
        );
    }
}

/// Ranks that reduce the same unit in different dtypes: over `PeerComm` every rank fails with
/// a mismatch naming both calls (the dtype is part of the call's description), within the
/// timeout, never a hang or a read of the other rank's memory as the wrong type.
#[test]
fn peers_refuse_ranks_reducing_in_different_dtypes() {
    let errors = over_peers(2, |comm, ops| {
        let full = ops.upload(&[1.0, 2.0, 3.0, 4.0]).unwrap();
        let mut shard = ops.upload(&[0.0, 0.0]).unwrap();
        let dtype = if comm.rank() == 0 {
            DType::BF16
        } else {
            DType::F32
        };
        comm.reduce_scatter_avg(ops, &[&full], &mut [&mut shard], dtype)
            .unwrap_err()
            .to_string()
    });
    for e in errors {
        assert!(e.contains("bfloat16") && e.contains("float32"), "{e}");
        assert!(e.contains("rank 0") && e.contains("rank 1"), "{e}");
    }
}

/// The bytes a rank's collectives move (`comm_volume`, printed by `fsdp train --device …
/// --ranks N`) against a closed form from the parameters' sizes: each tensor sharded alone
/// over `factor` ranks and padded to `factor` shards; per micro-batch the root gathered once
/// and each block twice where blocks are resharded after forward (`FULL_SHARD`, `HYBRID_SHARD`),
/// once otherwise; every
/// unit reduced once, in the reduction's dtype (4 or 2 bytes) — so bf16 halves the reductions
/// and leaves the all-gathers; `NO_SHARD` all-reduces the whole tensors and gathers nothing;
/// a hybrid mesh reduce-scatters in its node and all-reduces the shards across nodes. The
/// plans (`fsdp plan --device … --ranks N`, threads and processes) give a step's share.
#[test]
fn the_collectives_move_the_units_padded_sizes() {
    let tokens = synthetic_corpus(20_000, 64, 7);
    let base = device_config(LrSchedule::Constant, true, Some(0.5), 2);
    let params = seeded_params(&base.cfg, 7).unwrap();
    let (steps, micro) = (2u64, base.grad_accum as u64);
    // (root elements, blocks' elements), each tensor padded to `factor` shards.
    let padded = |factor: usize| {
        let pad = |n: usize| (n.div_ceil(factor) * factor) as u64;
        params.iter().fold((0, 0), |(r, b), (name, v)| {
            if name.starts_with("transformer.h.") {
                (r, b + pad(v.len()))
            } else {
                (r + pad(v.len()), b)
            }
        })
    };
    for (s, world, rpn) in [
        (ShardingStrategy::FullShard, 2, None),
        (ShardingStrategy::ShardGradOp, 2, None),
        (ShardingStrategy::NoShard, 2, None),
        (ShardingStrategy::HybridShard, 4, Some(2)),
    ] {
        for (reduce, width) in [(DType::F32, 4u64), (DType::BF16, 2)] {
            let c = DeviceTrainConfig {
                reduce_dtype: reduce,
                ..base
            };
            let how = (c, s, world, rpn);
            let volumes = on_peers(how, &params, &tokens, steps as usize, |t, _| {
                t.comm_volume()
            });
            let passes = steps * micro;
            let factor = match (s, rpn) {
                (ShardingStrategy::NoShard, _) => 1,
                (_, Some(n)) => n,
                _ => world,
            };
            let (root, blocks) = padded(factor);
            let gathers = if s.reshard_after_forward() { 2 } else { 1 };
            let (ag, rs, ar) = match (s, rpn) {
                (ShardingStrategy::NoShard, _) => (0, 0, (root + blocks) * width),
                (_, Some(_)) => (
                    (root + gathers * blocks) * 4,
                    (root + blocks) * width,
                    (root + blocks) / factor as u64 * width,
                ),
                _ => ((root + gathers * blocks) * 4, (root + blocks) * width, 0),
            };
            let want = CommVolume {
                all_gathered: ag * passes,
                reduce_scattered: rs * passes,
                all_reduced: ar * passes,
            };
            for v in &volumes {
                assert_eq!(*v, want, "{s:?}, {world} ranks, reduced in {reduce}");
            }
            // The plans (threads and processes) give a step's share.
            let step = CommVolume {
                all_gathered: ag * micro,
                reduce_scattered: rs * micro,
                all_reduced: ar * micro,
            };
            let plan = plan_sharded_memory(&c, Products::F32, world, s, rpn).unwrap();
            assert_eq!(plan.comm_per_step, step, "{s:?}: the threads' plan\n{plan}");
            let plan =
                plan_process_memory(&c, Products::F32, world, s, rpn, Prefetch::default()).unwrap();
            assert_eq!(
                plan.comm_per_step, step,
                "{s:?}: the processes' plan\n{plan}"
            );
            println!("{s:?}, {world} ranks, reduced in {reduce}: {want:?}");
        }
    }
}
