//! FSDP training equals single-process training: every strategy, world sizes 1–4 (3 forces
//! padding), hybrid over 2×2 (and 2 nodes of 1 rank), backward prefetch PRE / POST / none, with
//! and without forward prefetch.
//!
//! Five AdamW steps of a 2-block tiny GPT on a global batch of 12 rows (divisible by every
//! world size tested) give per-step losses within 1e-5 (relative) and final parameters within
//! 1e-4 (relative to each tensor's max magnitude) of `model::forward_backward` + AdamW on whole
//! tensors. The key third of each `attn.c_attn.bias` is the exception (as in the golden test):
//! its gradient is zero in exact arithmetic (the softmax ignores a constant added to a row of
//! scores), so the computed gradient is rounding noise that AdamW amplifies by `1/eps` and no
//! other summation order reproduces; it is held to a noise bound (`|b_k| < 1e-5`) instead.
//!
//! The full product strategy × world size × BACKWARD_PRE/POST × forward prefetch off/on runs
//! (80 trainings); BACKWARD_PREFETCH none, record-stream protection and the limiter settings
//! run on FULL_SHARD at world 3, SHARD_GRAD_OP at world 2 and HYBRID_SHARD over 2×2 — the
//! configurations where the all-gathers actually move data and the order differs.

mod common;

use std::collections::HashMap;

use fsdp::optim::{OptimizerConfig, OptimizerState, SgdConfig};
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::get_batch;
use fsdp_gpt::model::{forward_backward, zeros_like_params};
use fsdp_gpt::runtime::{BackwardPrefetch, CrossStreamSafety, FsdpConfig, ShardingStrategy};
use fsdp_gpt::tree::gpt_block_plan;

use common::training::{self, assert_params_close, ring_options, step_each};

const STEPS: u64 = 5;
const BATCH: usize = 12;
const SEQ: usize = 16;

type Setup = training::Setup<OptimizerConfig>;

fn setup() -> Setup {
    Setup::new(2, 7, 42, common::adamw().into())
}

/// Single-process training on whole tensors.
fn reference(s: &Setup) -> (Vec<f32>, HashMap<String, Vec<f32>>) {
    let mut params = s.init.clone();
    let mut states: HashMap<String, OptimizerState> = params
        .iter()
        .map(|(k, v)| (k.clone(), OptimizerState::new(&s.opt, v.len())))
        .collect();
    let mut losses = Vec::new();
    for k in 0..STEPS {
        let mut grads = zeros_like_params(&s.cfg);
        let batch = get_batch(&s.tokens, k, BATCH, SEQ, 0, 1).unwrap();
        losses.push(forward_backward(&s.cfg, &params, &mut grads, &batch, BATCH * SEQ).unwrap());
        step_each(&mut params, &mut states, &grads, |state, p, g| {
            state.step(&s.opt, p, g).unwrap()
        });
    }
    (losses, params)
}

type RankResult = (Vec<f32>, HashMap<String, Vec<f32>>);

fn run_fsdp(s: &Setup, world: usize, config: FsdpConfig) -> Vec<RankResult> {
    let plan = gpt_block_plan(&s.cfg);
    ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let mut fsdp = s.engine(comm, &plan, config);
        let mut losses = Vec::new();
        for k in 0..STEPS {
            let batch = get_batch(&s.tokens, k, BATCH, SEQ, rank, world).unwrap();
            losses.push(fsdp.step(&batch, BATCH * SEQ).unwrap());
        }
        (losses, fsdp.full_params().unwrap())
    })
    .unwrap()
}

fn check(s: &Setup, reference: &RankResult, world: usize, config: FsdpConfig) {
    let what = format!("{config:?} at world {world}");
    let results = run_fsdp(s, world, config);
    let (ref_losses, ref_params) = reference;
    for (rank, (losses, params)) in results.iter().enumerate() {
        for (k, (a, b)) in losses.iter().zip(ref_losses).enumerate() {
            let rel = (a - b).abs() / b.abs();
            assert!(
                rel <= 1e-5,
                "{what}, rank {rank}, step {k}: loss {a} vs {b} (rel {rel:e})"
            );
        }
        assert_params_close(
            &format!("{what}, rank {rank}"),
            s.cfg.n_embd,
            params,
            ref_params,
        );
    }
}

fn with(
    strategy: ShardingStrategy,
    prefetch: BackwardPrefetch,
    forward: bool,
    ranks_per_node: Option<usize>,
) -> FsdpConfig {
    FsdpConfig {
        backward_prefetch: prefetch,
        forward_prefetch: forward,
        ranks_per_node,
        ..FsdpConfig::new(strategy)
    }
}

#[test]
fn every_strategy_and_world_size_matches_single_process() {
    let s = setup();
    let reference = reference(&s);
    // The model learns: the loss falls over the five steps.
    assert!(reference.0[4] < reference.0[0], "{:?}", reference.0);
    // The full product: strategy x world size x BACKWARD_PRE/POST x forward prefetch off/on.
    let variants = [
        (BackwardPrefetch::Pre, false),
        (BackwardPrefetch::Pre, true),
        (BackwardPrefetch::Post, false),
        (BackwardPrefetch::Post, true),
    ];
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
    ] {
        for world in 1..=4 {
            for (prefetch, forward) in variants {
                check(
                    &s,
                    &reference,
                    world,
                    with(strategy, prefetch, forward, None),
                );
            }
        }
    }
    for strategy in [
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ] {
        // 2 nodes of 2 ranks; 2 nodes of 1 rank (pure replication); one node of 2; world 1.
        for (world, per_node) in [(4, 2), (2, 1), (2, 2), (1, 1)] {
            for (prefetch, forward) in variants {
                check(
                    &s,
                    &reference,
                    world,
                    with(strategy, prefetch, forward, Some(per_node)),
                );
            }
        }
    }
}

#[test]
fn prefetch_variants_match_single_process() {
    let s = setup();
    let reference = reference(&s);
    for (strategy, world, per_node) in [
        (ShardingStrategy::FullShard, 3, None),
        (ShardingStrategy::ShardGradOp, 2, None),
        (ShardingStrategy::HybridShard, 4, Some(2)),
    ] {
        for prefetch in [
            BackwardPrefetch::Pre,
            BackwardPrefetch::Post,
            BackwardPrefetch::None,
        ] {
            for forward in [false, true] {
                check(
                    &s,
                    &reference,
                    world,
                    with(strategy, prefetch, forward, per_node),
                );
            }
        }
    }
    // Record-stream protection instead of held references only.
    for (strategy, world, per_node) in [
        (ShardingStrategy::FullShard, 4, None),
        (ShardingStrategy::HybridShardZero2, 4, Some(2)),
    ] {
        let config = FsdpConfig {
            cross_stream: CrossStreamSafety::RecordStream,
            ..with(strategy, BackwardPrefetch::Pre, true, per_node)
        };
        check(&s, &reference, world, config);
    }
    // No limiter, and a limiter of one buffer.
    for limit in [None, Some(1)] {
        let config = FsdpConfig {
            limit_all_gathers: limit,
            ..with(
                ShardingStrategy::FullShard,
                BackwardPrefetch::Pre,
                true,
                None,
            )
        };
        check(&s, &reference, 4, config);
    }
}

#[test]
fn sgd_with_momentum_matches_single_process() {
    // torch.optim.SGD(lr=0.05, momentum=0.9, weight_decay=0.01) on the shards: element-wise, so
    // every strategy equals single-process SGD.
    let mut s = setup();
    s.opt = SgdConfig {
        weight_decay: 0.01,
        ..SgdConfig::with_momentum(0.05, 0.9)
    }
    .into();
    let reference = reference(&s);
    assert!(reference.0[4] < reference.0[0], "{:?}", reference.0);
    for (strategy, world, per_node) in [
        (ShardingStrategy::FullShard, 3, None),
        (ShardingStrategy::ShardGradOp, 4, None),
        (ShardingStrategy::NoShard, 2, None),
        (ShardingStrategy::HybridShard, 4, Some(2)),
    ] {
        check(
            &s,
            &reference,
            world,
            with(strategy, BackwardPrefetch::Pre, false, per_node),
        );
    }
}
