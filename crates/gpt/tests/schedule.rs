//! The order in which the runtime issues collectives and frees (its recorded schedule):
//! BACKWARD_PRE issues the next unit's all-gather before the current unit's reduce-scatter,
//! BACKWARD_POST after the current unit is freed (and before its reduce-scatter), no prefetch
//! after the reduce-scatter; forward prefetch issues the next unit's all-gather before the
//! current unit is freed; the limiter bounds the buffers in flight; each strategy issues the
//! collectives it should.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::{get_batch, synthetic_corpus};
use fsdp_gpt::model::{init_params, named_params, GptConfig};
use fsdp_gpt::runtime::{
    BackwardPrefetch, FsdpConfig, FsdpGpt, Phase, ScheduleEvent, ScheduleKind, ShardingStrategy,
};
use fsdp_gpt::tree::gpt_block_plan;

const LAYERS: usize = 4;
const BATCH: usize = 4;
const SEQ: usize = 8;

/// Rank 0's schedule of three steps.
fn schedule(world: usize, config: FsdpConfig) -> Vec<ScheduleEvent> {
    let cfg = GptConfig::new(LAYERS, 2, 16, 8, 64).unwrap();
    let init: HashMap<String, Vec<f32>> = named_params(&cfg, init_params(&cfg, 1)).unwrap();
    let tokens = synthetic_corpus(4_000, 64, 3);
    let opt = common::adamw();
    let plan = gpt_block_plan(&cfg);
    let opts = ring::RingOptions::default().with_timeout(Duration::from_secs(60));
    let mut all = ring::run_ranks(world, opts, |comm| {
        let rank = comm.rank();
        let mut fsdp = FsdpGpt::new(Box::new(comm), cfg, &plan, &init, config, opt).unwrap();
        for k in 0..3 {
            let batch = get_batch(&tokens, k, BATCH, SEQ, rank, world).unwrap();
            fsdp.step(&batch, BATCH * SEQ).unwrap();
        }
        fsdp.schedule().to_vec()
    })
    .unwrap();
    // Every rank issues the same schedule.
    for s in &all[1..] {
        assert_eq!(s, &all[0]);
    }
    all.swap_remove(0)
}

/// Position of the first event of `step`/`phase` on `unit` of `kind`.
fn pos(
    events: &[ScheduleEvent],
    step: u64,
    phase: Phase,
    unit: usize,
    kind: ScheduleKind,
) -> Option<usize> {
    events
        .iter()
        .position(|e| e.step == step && e.phase == phase && e.unit == unit && e.kind == kind)
}

fn config(
    strategy: ShardingStrategy,
    prefetch: BackwardPrefetch,
    forward_prefetch: bool,
) -> FsdpConfig {
    FsdpConfig {
        backward_prefetch: prefetch,
        forward_prefetch,
        ..FsdpConfig::new(strategy)
    }
}

// Units: 0 is the root (wte, wpe, ln_f), unit 1 + i is block i. Backward visits block
// LAYERS-1 first, down to block 0.

#[test]
fn backward_pre_gathers_the_next_unit_before_the_current_reduce_scatter() {
    let ev = schedule(
        2,
        config(ShardingStrategy::FullShard, BackwardPrefetch::Pre, false),
    );
    for step in 1..=3 {
        for block in 1..LAYERS {
            let (cur, next) = (1 + block, block);
            let ag = pos(&ev, step, Phase::Backward, next, ScheduleKind::AllGather).unwrap();
            let rs = pos(&ev, step, Phase::Backward, cur, ScheduleKind::ReduceScatter).unwrap();
            let free = pos(&ev, step, Phase::Backward, cur, ScheduleKind::Free).unwrap();
            assert!(ag < free && free < rs, "step {step} block {block}: {ev:?}");
            assert!(ev[ag].prefetch);
        }
    }
}

#[test]
fn backward_post_gathers_the_next_unit_after_freeing_the_current_one() {
    let ev = schedule(
        2,
        config(ShardingStrategy::FullShard, BackwardPrefetch::Post, false),
    );
    for step in 1..=3 {
        for block in 1..LAYERS {
            let (cur, next) = (1 + block, block);
            let ag = pos(&ev, step, Phase::Backward, next, ScheduleKind::AllGather).unwrap();
            let rs = pos(&ev, step, Phase::Backward, cur, ScheduleKind::ReduceScatter).unwrap();
            let free = pos(&ev, step, Phase::Backward, cur, ScheduleKind::Free).unwrap();
            assert!(free < ag && ag < rs, "step {step} block {block}: {ev:?}");
        }
    }
}

#[test]
fn no_backward_prefetch_gathers_after_the_reduce_scatter() {
    let ev = schedule(
        2,
        config(ShardingStrategy::FullShard, BackwardPrefetch::None, false),
    );
    for block in 1..LAYERS {
        let (cur, next) = (1 + block, block);
        let ag = pos(&ev, 1, Phase::Backward, next, ScheduleKind::AllGather).unwrap();
        let rs = pos(&ev, 1, Phase::Backward, cur, ScheduleKind::ReduceScatter).unwrap();
        assert!(rs < ag && !ev[ag].prefetch, "block {block}: {ev:?}");
    }
}

#[test]
fn forward_prefetch_follows_the_definition_order_then_the_recorded_order() {
    let ev = schedule(
        2,
        config(ShardingStrategy::FullShard, BackwardPrefetch::Pre, true),
    );
    // The GPT runs its blocks in definition order, so the first step (no order recorded yet:
    // definition order) and the later ones (the recorded order) prefetch alike.
    for block in 0..LAYERS - 1 {
        let (cur, next) = (1 + block, 2 + block);
        for step in 1..=3 {
            let ag = pos(&ev, step, Phase::Forward, next, ScheduleKind::AllGather).unwrap();
            let free = pos(&ev, step, Phase::Forward, cur, ScheduleKind::Free).unwrap();
            assert!(ag < free && ev[ag].prefetch, "step {step}: {ev:?}");
        }
    }
}

#[test]
fn the_limiter_bounds_the_buffers_in_flight() {
    for limit in [1, 2, 3] {
        for prefetch in [BackwardPrefetch::Pre, BackwardPrefetch::Post] {
            let cfg = FsdpConfig {
                limit_all_gathers: Some(limit),
                ..config(ShardingStrategy::FullShard, prefetch, true)
            };
            let ev = schedule(2, cfg);
            let max = ev.iter().map(|e| e.in_flight).max().unwrap();
            assert!(max <= limit, "limit {limit}, {prefetch:?}: {max} in flight");
            // With room for two, the runtime does prefetch up to the limit; with room for one
            // it still prefetches when nothing else is in flight (the first block in forward,
            // the last block from the head in backward).
            assert_eq!(max, limit.min(2), "limit {limit}, {prefetch:?}");
            assert!(ev.iter().any(|e| e.prefetch));
        }
    }
}

#[test]
fn each_strategy_issues_its_collectives() {
    let count = |ev: &[ScheduleEvent], phase: Phase, kind: ScheduleKind| {
        ev.iter()
            .filter(|e| e.step == 2 && e.phase == phase && e.kind == kind)
            .count()
    };
    let units = LAYERS + 1;
    // FULL_SHARD: every unit gathered in forward, every block again in backward (the root
    // stays unsharded after forward); one reduce-scatter per unit.
    let ev = schedule(
        4,
        config(ShardingStrategy::FullShard, BackwardPrefetch::Pre, false),
    );
    assert_eq!(count(&ev, Phase::Forward, ScheduleKind::AllGather), units);
    assert_eq!(count(&ev, Phase::Forward, ScheduleKind::Free), LAYERS);
    assert_eq!(count(&ev, Phase::Backward, ScheduleKind::AllGather), LAYERS);
    assert_eq!(
        count(&ev, Phase::Backward, ScheduleKind::ReduceScatter),
        units
    );
    assert_eq!(count(&ev, Phase::Backward, ScheduleKind::AllReduce), 0);
    // SHARD_GRAD_OP: nothing freed after forward, so nothing gathered in backward.
    let ev = schedule(
        4,
        config(ShardingStrategy::ShardGradOp, BackwardPrefetch::Pre, false),
    );
    assert_eq!(count(&ev, Phase::Forward, ScheduleKind::AllGather), units);
    assert_eq!(count(&ev, Phase::Forward, ScheduleKind::Free), 0);
    assert_eq!(count(&ev, Phase::Backward, ScheduleKind::AllGather), 0);
    assert_eq!(count(&ev, Phase::Backward, ScheduleKind::Free), units);
    assert_eq!(
        count(&ev, Phase::Backward, ScheduleKind::ReduceScatter),
        units
    );
    // NO_SHARD: no gathers, one all-reduce per unit.
    let ev = schedule(
        4,
        config(ShardingStrategy::NoShard, BackwardPrefetch::Pre, false),
    );
    assert_eq!(count(&ev, Phase::Forward, ScheduleKind::AllGather), 0);
    assert_eq!(count(&ev, Phase::Backward, ScheduleKind::ReduceScatter), 0);
    assert_eq!(count(&ev, Phase::Backward, ScheduleKind::AllReduce), units);
    // HYBRID_SHARD over 2x2: reduce-scatter in the node, then all-reduce across nodes, per
    // unit, in that order.
    let cfg = FsdpConfig {
        ranks_per_node: Some(2),
        ..config(ShardingStrategy::HybridShard, BackwardPrefetch::Pre, false)
    };
    let ev = schedule(4, cfg);
    assert_eq!(count(&ev, Phase::Forward, ScheduleKind::AllGather), units);
    for u in 0..units {
        let rs = pos(&ev, 2, Phase::Backward, u, ScheduleKind::ReduceScatter).unwrap();
        let ar = pos(&ev, 2, Phase::Backward, u, ScheduleKind::AllReduce).unwrap();
        assert!(rs < ar);
    }
}
