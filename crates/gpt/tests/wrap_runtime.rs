//! Wrap policies driving the runtime: `wrap::plan_units` over `wrap::gpt_module_tree` produces
//! the `UnitPlan` that [`FsdpGpt`] consumes.
//!
//! - The module-type policy `["Block"]` gives exactly `gpt_block_plan`, and trains bit for bit
//!   like it.
//! - Finer and coarser plans, where one model stage (embedding, block, head) reads parameters of
//!   several units, or one unit spans several stages, or some parameters are ignored: attention
//!   and MLP as units (block layer norms in the root), PyTorch's size rule at 3073 (one unit per
//!   large `Linear`, three per block) and 4225 (nested units: a block unit around an MLP unit),
//!   layer norms and blocks (`ln_f` its own unit, read by the head stage with the root's `wte`),
//!   the whole `ModuleList` as one unit (spanning both block stages), and blocks with `wte` and
//!   `lm_head` ignored (replicated, all-reduced over the world). Each trains like single-process
//!   training (losses within 1e-5 relative, parameters within 1e-4 of each tensor's largest
//!   magnitude, the key-bias rule of `golden.rs`) under every strategy, and reproduces PyTorch's
//!   golden numbers; under FULL_SHARD every unit is gathered, freed and reduce-scattered once
//!   per pass as it should be.
//!
//! The data, initial weights and optimizer are the golden fixture's (`tests/common`): tiny GPT,
//! global batch 8 × 16, AdamW lr 1e-3, ten steps.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use fsdp::optim::AdamWState;
use fsdp::units::UnitPlan;
use fsdp::wrap::{plan_units, WrapOptions, WrapPolicy};
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::get_batch;
use fsdp_gpt::model::{
    block_param_specs, embed_param_specs, forward_backward, head_param_specs, zeros_like_params,
};
use fsdp_gpt::runtime::{
    BackwardPrefetch, FsdpConfig, FsdpGpt, Phase, ScheduleEvent, ScheduleKind, ShardingStrategy,
};
use fsdp_gpt::tree::gpt_block_plan;
use fsdp_gpt::tree::gpt_module_tree;

const STEPS: u64 = 10;

fn plan(options: WrapOptions) -> UnitPlan {
    plan_units(&gpt_module_tree(&cfg()), &options).unwrap()
}

/// One rank's losses, final full parameters and recorded schedule.
struct RankRun {
    losses: Vec<f32>,
    params: HashMap<String, Vec<f32>>,
    schedule: Vec<ScheduleEvent>,
    units: usize,
}

fn run(plan: &UnitPlan, world: usize, config: FsdpConfig) -> Vec<RankRun> {
    let cfg = cfg();
    let toks = tokens();
    let init = init();
    let opts = ring::RingOptions::default().with_timeout(Duration::from_secs(60));
    ring::run_ranks(world, opts, |comm| {
        let rank = comm.rank();
        let mut fsdp = FsdpGpt::new(Box::new(comm), cfg, plan, &init, config, adamw()).unwrap();
        let losses = (0..STEPS)
            .map(|k| {
                let batch = get_batch(&toks, k, B, T, rank, world).unwrap();
                fsdp.step(&batch, B * T).unwrap()
            })
            .collect();
        RankRun {
            losses,
            params: fsdp.full_params().unwrap(),
            schedule: fsdp.schedule().to_vec(),
            units: fsdp.num_units(),
        }
    })
    .unwrap()
}

/// Single-process training on whole tensors (as `golden.rs`).
fn reference() -> (Vec<f32>, HashMap<String, Vec<f32>>) {
    let cfg = cfg();
    let toks = tokens();
    let mut params = init();
    let opt = adamw();
    let mut states: HashMap<String, AdamWState> = params
        .iter()
        .map(|(k, v)| (k.clone(), AdamWState::new(v.len())))
        .collect();
    let mut losses = Vec::new();
    for k in 0..STEPS {
        let mut grads = zeros_like_params(&cfg);
        let batch = get_batch(&toks, k, B, T, 0, 1).unwrap();
        losses.push(forward_backward(&cfg, &params, &mut grads, &batch, B * T).unwrap());
        for (name, p) in params.iter_mut() {
            states
                .get_mut(name)
                .unwrap()
                .step(&opt, p, &grads[name])
                .unwrap();
        }
    }
    (losses, params)
}

fn config(
    strategy: ShardingStrategy,
    ranks_per_node: Option<usize>,
    prefetch: BackwardPrefetch,
    forward_prefetch: bool,
    limit: Option<usize>,
) -> FsdpConfig {
    FsdpConfig {
        ranks_per_node,
        backward_prefetch: prefetch,
        forward_prefetch,
        limit_all_gathers: limit,
        ..FsdpConfig::new(strategy)
    }
}

/// The configurations every plan is trained under, with their world sizes.
fn configurations() -> Vec<(usize, FsdpConfig)> {
    use BackwardPrefetch::{None as NoPrefetch, Post, Pre};
    use ShardingStrategy::*;
    vec![
        (1, config(FullShard, None, Pre, false, Some(2))),
        (2, config(FullShard, None, Pre, false, Some(2))),
        (4, config(FullShard, None, Pre, false, Some(2))),
        (4, config(FullShard, None, Post, true, Some(2))),
        (4, config(FullShard, None, NoPrefetch, true, Some(1))),
        (4, config(FullShard, None, Pre, true, None)),
        (2, config(ShardGradOp, None, Pre, true, Some(2))),
        (4, config(ShardGradOp, None, Post, false, Some(2))),
        (2, config(NoShard, None, Pre, false, Some(2))),
        (4, config(NoShard, None, Pre, false, Some(2))),
        (4, config(HybridShard, Some(2), Pre, true, Some(2))),
        (4, config(HybridShardZero2, Some(2), Post, false, Some(2))),
        (2, config(HybridShard, Some(1), Pre, false, Some(2))),
    ]
}

/// Worst errors against single-process training: losses (relative) and parameters (relative
/// to each tensor's largest magnitude, key bias left out).
fn check_against_reference(
    what: &str,
    runs: &[RankRun],
    reference: &(Vec<f32>, HashMap<String, Vec<f32>>),
) -> (f64, f64) {
    let (ref_losses, ref_params) = reference;
    let (mut worst_loss, mut worst_param) = (0.0f64, 0.0f64);
    for (rank, r) in runs.iter().enumerate() {
        for (k, (&a, &b)) in r.losses.iter().zip(ref_losses).enumerate() {
            let rel = f64::from((a - b).abs() / b.abs());
            assert!(
                rel <= LOSS_TOL,
                "{what}, rank {rank}, step {k}: loss {a} vs single-process {b} (rel {rel:e})"
            );
            worst_loss = worst_loss.max(rel);
        }
        assert_eq!(r.params.len(), ref_params.len(), "{what}: parameter count");
        for (name, want) in ref_params {
            let got = &r.params[name];
            let (got, want) = if name.ends_with("attn.c_attn.bias") {
                for v in [got, want] {
                    let noise = max_abs(key_bias(v));
                    assert!(noise < 1e-5, "{what}: `{name}` key bias {noise:e}");
                }
                (without_key_bias(got), without_key_bias(want))
            } else {
                (got.clone(), want.clone())
            };
            let e = rel_err(&got, &want);
            assert!(
                e <= WEIGHT_TOL,
                "{what}, rank {rank}: `{name}` relative error {e:e}"
            );
            worst_param = worst_param.max(e);
        }
        // And PyTorch's numbers.
        for (k, (&loss, want)) in r.losses.iter().zip(expected_losses()).enumerate() {
            let rel = ((f64::from(loss) - want) / want).abs();
            assert!(
                rel < LOSS_TOL,
                "{what}, step {k}: loss {loss} vs PyTorch {want}"
            );
        }
        check_final_weights(&r.params);
    }
    (worst_loss, worst_param)
}

/// Under FULL_SHARD at world > 1, in every pass after the first: each unit of the plan is
/// all-gathered once in forward, non-root units once more in backward; non-root units are
/// freed after forward, every unit after backward; every unit is reduce-scattered once. The
/// ignored parameters' unit (if any) is only all-reduced, once.
fn check_full_shard_schedule(what: &str, plan: &UnitPlan, r: &RankRun) {
    let count = |step: u64, phase: Phase, unit: usize, kind: ScheduleKind| {
        r.schedule
            .iter()
            .filter(|e| e.step == step && e.phase == phase && e.unit == unit && e.kind == kind)
            .count()
    };
    use Phase::{Backward, Forward};
    use ScheduleKind::{AllGather, AllReduce, Free, ReduceScatter};
    for step in 2..=STEPS {
        for u in 0..plan.units.len() {
            let non_root = usize::from(u != 0);
            let got = [
                count(step, Forward, u, AllGather),
                count(step, Forward, u, Free),
                count(step, Backward, u, AllGather),
                count(step, Backward, u, Free),
                count(step, Backward, u, ReduceScatter),
                count(step, Backward, u, AllReduce),
            ];
            assert_eq!(
                got,
                [1, non_root, non_root, 1, 1, 0],
                "{what}: step {step}, unit {u} `{}`: [forward AG, forward free, backward AG, \
                 backward free, RS, AR]",
                plan.units[u].name
            );
        }
        if !plan.ignored.is_empty() {
            let u = plan.units.len();
            let events: Vec<_> = r
                .schedule
                .iter()
                .filter(|e| e.step == step && e.unit == u)
                .map(|e| (e.phase, e.kind))
                .collect();
            assert_eq!(events, [(Backward, AllReduce)], "{what}: ignored unit");
        }
    }
}

/// The most non-root units one stage (embedding, a block, the head) reads.
fn max_non_root_units_per_stage(plan: &UnitPlan) -> usize {
    let cfg = cfg();
    let mut stages = vec![embed_param_specs(&cfg)];
    stages.extend((0..cfg.n_layer).map(|l| block_param_specs(&cfg, l)));
    let mut head = head_param_specs(&cfg);
    // The head also reads the tied `wte`.
    head.extend(
        embed_param_specs(&cfg)
            .into_iter()
            .filter(|p| p.name == "transformer.wte.weight"),
    );
    stages.push(head);
    stages
        .iter()
        .map(|specs| {
            let mut units: Vec<usize> = specs
                .iter()
                .filter_map(|p| plan.unit_of(&p.name))
                .filter(|&u| u != 0)
                .collect();
            units.sort_unstable();
            units.dedup();
            units.len()
        })
        .max()
        .unwrap_or(0)
}

#[test]
fn block_policy_is_the_block_plan_and_trains_bitwise_like_it() {
    let cfg = cfg();
    let from_policy = plan(WrapOptions::new(WrapPolicy::module_type(["Block"])));
    assert_eq!(from_policy, gpt_block_plan(&cfg));
    for (world, config) in [
        (2, FsdpConfig::new(ShardingStrategy::FullShard)),
        (4, FsdpConfig::new(ShardingStrategy::ShardGradOp)),
        (2, FsdpConfig::new(ShardingStrategy::NoShard)),
        (
            4,
            FsdpConfig {
                ranks_per_node: Some(2),
                ..FsdpConfig::new(ShardingStrategy::HybridShard)
            },
        ),
    ] {
        let a = run(&from_policy, world, config);
        let b = run(&gpt_block_plan(&cfg), world, config);
        for (ra, rb) in a.iter().zip(&b) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ra.losses), bits(&rb.losses), "{config:?}: losses");
            for (name, v) in &rb.params {
                assert_eq!(bits(&ra.params[name]), bits(v), "{config:?}: `{name}`");
            }
            assert_eq!(ra.schedule, rb.schedule, "{config:?}: schedule");
        }
    }
}

#[test]
fn multi_unit_stages_train_like_single_process() {
    let reference = reference();
    let block = || WrapPolicy::module_type(["Block"]);
    let plans = [
        (
            "attention + MLP",
            WrapOptions::new(WrapPolicy::module_type(["CausalSelfAttention", "MLP"])),
            5,
        ),
        ("size 3073", WrapOptions::new(WrapPolicy::size(3073)), 7),
        ("size 4225", WrapOptions::new(WrapPolicy::size(4225)), 5),
        (
            "layer norms + blocks",
            WrapOptions::new(WrapPolicy::module_type(["LayerNorm", "Block"])),
            8,
        ),
        (
            "ModuleList",
            WrapOptions::new(WrapPolicy::module_type(["ModuleList"])),
            2,
        ),
        (
            // `lm_head`'s unit holds only the tied alias and is dropped: the storage stays in
            // the root, the lowest common ancestor of the embedding and the head.
            "blocks and lm_head",
            WrapOptions::new(WrapPolicy::custom(|m, _| {
                m.type_name == "Block" || m.name == "lm_head"
            })),
            3,
        ),
        (
            "blocks, wte and lm_head ignored",
            WrapOptions::new(block())
                .with_ignored_module("transformer.wte")
                .with_ignored_module("lm_head"),
            3,
        ),
    ];
    for (name, options, n_units) in plans {
        let plan = plan(options);
        assert_eq!(plan.units.len(), n_units, "{name}: {plan:#?}");
        let (mut worst_loss, mut worst_param) = (0.0f64, 0.0f64);
        for (world, config) in configurations() {
            let what = format!("plan `{name}`, {config:?} at world {world}");
            let runs = run(&plan, world, config);
            let expected_units = plan.units.len() + usize::from(!plan.ignored.is_empty());
            assert_eq!(runs[0].units, expected_units, "{what}");
            let (l, p) = check_against_reference(&what, &runs, &reference);
            worst_loss = worst_loss.max(l);
            worst_param = worst_param.max(p);
            if config.strategy == ShardingStrategy::FullShard && world > 1 {
                for r in &runs {
                    check_full_shard_schedule(&what, &plan, r);
                }
                // The limiter only skips prefetches: the gathers a stage needs are always
                // issued, so a stage reading more non-root units than the limit goes past it,
                // but never further.
                if let Some(limit) = config.limit_all_gathers {
                    let bound = limit.max(max_non_root_units_per_stage(&plan));
                    for r in &runs {
                        let peak = r.schedule.iter().map(|e| e.in_flight).max().unwrap();
                        assert!(peak <= bound, "{what}: {peak} gathered buffers in flight");
                    }
                }
            }
        }
        println!(
            "plan `{name}` ({n_units} units): max loss error {worst_loss:.2e}, max parameter \
             error {worst_param:.2e} against single-process training"
        );
    }
}

#[test]
fn a_plan_with_an_empty_root_trains_like_single_process() {
    // Everything the root module owns directly ignored: the root unit owns no parameter, and
    // has nothing to shard (as PyTorch's root FSDP instance without a flat parameter). The
    // engine skips it: the blocks are the units, the ignored parameters (the tied `wte`
    // included) are replicated and all-reduced.
    let options = WrapOptions::new(WrapPolicy::module_type(["Block"]))
        .with_ignored_module("transformer.wte")
        .with_ignored_module("transformer.wpe")
        .with_ignored_module("transformer.ln_f")
        .with_ignored_module("lm_head");
    let plan = plan(options);
    assert!(plan.units[0].params.is_empty());
    let reference = reference();
    for (world, config) in [
        (
            2,
            config(
                ShardingStrategy::FullShard,
                None,
                BackwardPrefetch::Pre,
                true,
                Some(2),
            ),
        ),
        (
            4,
            config(
                ShardingStrategy::HybridShard,
                Some(2),
                BackwardPrefetch::Post,
                false,
                Some(2),
            ),
        ),
    ] {
        let runs = run(&plan, world, config);
        assert_eq!(runs[0].units, plan.units.len()); // the blocks and the ignored unit
        check_against_reference(&format!("empty root, world {world}"), &runs, &reference);
    }
}
