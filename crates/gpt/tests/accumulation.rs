//! Gradient accumulation over 4 micro-batches equals one batch four times larger, with
//! communication every micro-batch and with `no_sync` (reducing on the last micro-batch);
//! `clip_grad_norm` over shards equals unsharded clipping (global norm without double counting
//! for NO_SHARD and hybrid groups).
//!
//! Subset, to keep the run short: accumulation on FULL_SHARD at world 3 (padding),
//! SHARD_GRAD_OP at world 2, NO_SHARD at world 2 and both hybrid strategies over 2×2; clipping on
//! FULL_SHARD at world 3, SHARD_GRAD_OP at world 4, NO_SHARD at world 2, HYBRID_SHARD over 2×2,
//! and once combined with `no_sync` accumulation.

mod common;

use std::collections::HashMap;

use fsdp::optim::{AdamWConfig, AdamWState};
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::get_batch;
use fsdp_gpt::model::{forward_backward, zeros_like_params};
use fsdp_gpt::runtime::{FsdpConfig, ShardingStrategy};
use fsdp_gpt::tree::gpt_block_plan;

use common::training::{self, assert_params_close, ring_options, step_each};

const STEPS: u64 = 3;
const MICRO: u64 = 4;
const ROWS: usize = 12; // rows of one micro-batch (divisible by 1, 2, 3, 4)
const SEQ: usize = 16;
const MAX_NORM: f64 = 0.05;

type Setup = training::Setup<AdamWConfig>;

fn setup() -> Setup {
    Setup::new(2, 11, 3, common::adamw())
}

/// (losses, norms before clipping, final parameters)
type Outcome = (Vec<f32>, Vec<f64>, HashMap<String, Vec<f32>>);

/// Single process: `micro` micro-batches as one batch of `micro · ROWS` rows (global batch `k`
/// of that size holds exactly the rows of micro-batches `k·micro .. (k+1)·micro` of `ROWS`).
fn reference(s: &Setup, micro: u64, clip: bool) -> Outcome {
    let rows = micro as usize * ROWS;
    let mut params = s.init.clone();
    let mut states: HashMap<String, AdamWState> = params
        .iter()
        .map(|(k, v)| (k.clone(), AdamWState::new(v.len())))
        .collect();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for k in 0..STEPS {
        let mut grads = zeros_like_params(&s.cfg);
        let batch = get_batch(&s.tokens, k, rows, SEQ, 0, 1).unwrap();
        losses.push(forward_backward(&s.cfg, &params, &mut grads, &batch, rows * SEQ).unwrap());
        let norm = grads
            .values()
            .flatten()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum::<f64>()
            .sqrt();
        norms.push(norm);
        if clip {
            let coef = MAX_NORM / (norm + 1e-6);
            assert!(coef < 1.0, "clipping must be active: norm {norm}");
            for g in grads.values_mut().flatten() {
                *g *= coef as f32;
            }
        }
        step_each(&mut params, &mut states, &grads, |state, p, g| {
            state.step(&s.opt, p, g).unwrap()
        });
    }
    (losses, norms, params)
}

fn run(
    s: &Setup,
    world: usize,
    config: FsdpConfig,
    micro: u64,
    no_sync: bool,
    clip: bool,
) -> Vec<Outcome> {
    let plan = gpt_block_plan(&s.cfg);
    let tokens_per_step = micro as usize * ROWS * SEQ;
    ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let mut fsdp = s.engine(comm, &plan, config);
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for k in 0..STEPS {
            let mut loss = 0.0;
            for m in 0..micro {
                let batch = get_batch(&s.tokens, k * micro + m, ROWS, SEQ, rank, world).unwrap();
                loss += if no_sync && m + 1 < micro {
                    fsdp.no_sync(|f| f.forward_backward(&batch, tokens_per_step))
                } else {
                    fsdp.forward_backward(&batch, tokens_per_step)
                }
                .unwrap();
            }
            losses.push(loss);
            if clip {
                norms.push(fsdp.clip_grad_norm(MAX_NORM).unwrap());
            }
            fsdp.optimizer_step().unwrap();
        }
        (losses, norms, fsdp.full_params().unwrap())
    })
    .unwrap()
}

fn compare(s: &Setup, what: &str, got: &Outcome, want: &Outcome) {
    for (k, (a, b)) in got.0.iter().zip(&want.0).enumerate() {
        let rel = (a - b).abs() / b.abs();
        assert!(rel <= 1e-5, "{what}, step {k}: loss {a} vs {b}");
    }
    for (k, (a, b)) in got.1.iter().zip(&want.1).enumerate() {
        let rel = (a - b).abs() / b.abs();
        assert!(rel <= 1e-5, "{what}, step {k}: norm {a} vs {b}");
    }
    assert_params_close(what, s.cfg.n_embd, &got.2, &want.2);
}

fn config(strategy: ShardingStrategy, ranks_per_node: Option<usize>) -> FsdpConfig {
    FsdpConfig {
        ranks_per_node,
        ..FsdpConfig::new(strategy)
    }
}

#[test]
fn accumulation_over_micro_batches_equals_one_large_batch() {
    let s = setup();
    let want = reference(&s, MICRO, false);
    assert_eq!(want.0.len(), STEPS as usize);
    for (strategy, world, per_node) in [
        (ShardingStrategy::FullShard, 3, None),
        (ShardingStrategy::ShardGradOp, 2, None),
        (ShardingStrategy::NoShard, 2, None),
        (ShardingStrategy::HybridShard, 4, Some(2)),
        (ShardingStrategy::HybridShardZero2, 4, Some(2)),
    ] {
        for no_sync in [false, true] {
            let out = run(&s, world, config(strategy, per_node), MICRO, no_sync, false);
            for (rank, o) in out.iter().enumerate() {
                let what = format!("{strategy:?} world {world} no_sync {no_sync} rank {rank}");
                compare(&s, &what, o, &want);
            }
        }
    }
}

#[test]
fn clip_grad_norm_over_shards_equals_unsharded_clipping() {
    let s = setup();
    let want = reference(&s, 1, true);
    for (strategy, world, per_node) in [
        (ShardingStrategy::FullShard, 3, None),
        (ShardingStrategy::ShardGradOp, 4, None),
        (ShardingStrategy::NoShard, 2, None),
        (ShardingStrategy::HybridShard, 4, Some(2)),
    ] {
        let out = run(&s, world, config(strategy, per_node), 1, false, true);
        for (rank, o) in out.iter().enumerate() {
            compare(
                &s,
                &format!("{strategy:?} world {world} rank {rank}"),
                o,
                &want,
            );
        }
    }
    // Clipping after no_sync accumulation.
    let want = reference(&s, MICRO, true);
    let out = run(
        &s,
        4,
        config(ShardingStrategy::HybridShard, Some(2)),
        MICRO,
        true,
        true,
    );
    for (rank, o) in out.iter().enumerate() {
        compare(&s, &format!("hybrid no_sync + clip rank {rank}"), o, &want);
    }
}

#[test]
fn optimizer_step_refuses_unreduced_gradients() {
    let s = setup();
    let plan = gpt_block_plan(&s.cfg);
    let out = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
        let rank = comm.rank();
        let config = FsdpConfig::new(ShardingStrategy::FullShard);
        let mut fsdp = s.engine(comm, &plan, config);
        let batch = get_batch(&s.tokens, 0, ROWS, SEQ, rank, 2).unwrap();
        fsdp.no_sync(|f| f.forward_backward(&batch, ROWS * SEQ))
            .unwrap();
        let refused = fsdp.optimizer_step().is_err() && fsdp.clip_grad_norm(1.0).is_err();
        fsdp.zero_grad().unwrap();
        (refused, fsdp.optimizer_step().is_ok())
    })
    .unwrap();
    assert!(out.iter().all(|&(refused, ok)| refused && ok));
}
