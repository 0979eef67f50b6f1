//! The engine on two models that are not the GPT, both examples of this crate included here as
//! modules (so the model code exists once):
//!
//! - `tied_mlp`: a weight read by two submodules in different units, owned by the unit of their
//!   common ancestor (custom wrap policy);
//! - `out_of_order`: units defined `a, b, c, d` but run `c, a, d, b`, with a skip connection
//!   from `a` to `b`.
//!
//! Each model is trained with every sharding strategy at worlds 1 to 4 (hybrid strategies on
//! every mesh: 1×1, 1×2, 2×1, 1×3, 3×1, 1×4, 2×2, 4×1), forward prefetch on and off, every
//! backward prefetch, and compared with a
//! single-process reference: the same spans run in a plain loop over a `HashMap` of parameters
//! on the whole batch, AdamW applied per parameter. Each rank of a run gets its slice of the
//! same 12 examples. Also: the unit plans, the schedule of the out-of-order model, finite
//! differences of both models' gradients, and errors (unknown span parameter, a model failing
//! in the middle of forward or backward) that must leave the engine usable.

use std::collections::HashMap;

use fsdp::engine::{
    BackwardPrefetch, Fsdp, FsdpConfig, FsdpModel, ParamInit, Phase, ScheduleEvent, ScheduleKind,
    ShardingStrategy,
};
use fsdp::optim::AdamWState;
use fsdp::wrap::{plan_units, Module, WrapOptions, WrapPolicy};
use fsdp::FsdpError;
use fsdp_collectives::{ring, Communicator};

mod common;
#[allow(dead_code)]
#[path = "../examples/tied_mlp.rs"]
mod tied_mlp;

// Each example includes `examples/common/mod.rs` as its own module: loaded a second time here
// (`out_of_order::common` next to `tied_mlp::common`), on purpose.
#[allow(dead_code, clippy::duplicate_mod)]
#[path = "../examples/out_of_order.rs"]
mod out_of_order;

#[path = "common/faulty.rs"]
mod faulty;

use common::{adamw, loss_and_grads, ring_options, Map, GLOBAL};
use faulty::{is_missing, Fault, Faulty};

/// Optimizer steps per run.
const STEPS: usize = 4;

/// A model with its module tree, wrap policy, initial values and batch slicer.
struct Setup<M: FsdpModel> {
    model: M,
    tree: Module,
    wrap: WrapOptions,
    init: Map,
    batch: fn(usize, usize, usize) -> M::Batch,
}

fn tied() -> Setup<tied_mlp::TiedMlp> {
    let tree = tied_mlp::tree();
    Setup {
        model: tied_mlp::TiedMlp { global: GLOBAL },
        init: tied_mlp::init_params(&tree),
        wrap: tied_mlp::wrap(),
        tree,
        batch: tied_mlp::batch,
    }
}

fn skip() -> Setup<out_of_order::SkipNet> {
    let tree = out_of_order::tree();
    Setup {
        model: out_of_order::SkipNet { global: GLOBAL },
        init: out_of_order::init_params(&tree),
        wrap: out_of_order::wrap(),
        tree,
        batch: out_of_order::batch,
    }
}

/// The single-process reference: `steps` steps on the whole batch, AdamW per parameter.
fn reference<M: FsdpModel>(s: &Setup<M>, steps: usize) -> (Vec<f32>, Map)
where
    M::Batch: Sized,
{
    let batch = (s.batch)(GLOBAL, 0, 1);
    let mut params = s.init.clone();
    let mut states: HashMap<String, AdamWState> = params
        .iter()
        .map(|(k, v)| (k.clone(), AdamWState::new(v.len())))
        .collect();
    let mut losses = Vec::new();
    for _ in 0..steps {
        let (loss, grads) = loss_and_grads(&s.model, &params, &params, &batch).unwrap();
        for (name, p) in params.iter_mut() {
            let state = states.get_mut(name).unwrap();
            state.step(&adamw(), p, &grads[name]).unwrap();
        }
        losses.push(loss);
    }
    (losses, params)
}

/// What one rank of an engine run ends with.
#[derive(Debug, Clone, PartialEq)]
struct Run {
    losses: Vec<f32>,
    state: Map,
    schedule: Vec<ScheduleEvent>,
}

/// Train on `world` ranks (threads) with `config`: `body` drives one rank's engine.
fn run_ranks<M, F>(s: &Setup<M>, world: usize, config: FsdpConfig, body: F) -> Vec<Run>
where
    M: FsdpModel + Sync,
    M::Batch: Sized,
    F: Fn(&mut Fsdp, &M::Batch) -> Vec<f32> + Sync,
{
    ring::run_ranks(world, ring_options(), |comm| {
        let batch = (s.batch)(GLOBAL, comm.rank(), world);
        let init = ParamInit::Full(&s.init);
        let mut fsdp =
            Fsdp::from_module(Box::new(comm), &s.tree, &s.wrap, init, config, adamw()).unwrap();
        let losses = body(&mut fsdp, &batch);
        Run {
            losses,
            state: fsdp.full_state_dict().unwrap(),
            schedule: fsdp.schedule().to_vec(),
        }
    })
    .unwrap()
}

/// `STEPS` plain training steps.
fn train<M: FsdpModel + Sync>(s: &Setup<M>, world: usize, config: FsdpConfig) -> Vec<Run>
where
    M::Batch: Sized,
{
    run_ranks(s, world, config, |fsdp, batch| {
        (0..STEPS)
            .map(|_| fsdp.step(&s.model, batch).unwrap())
            .collect()
    })
}

/// Every configuration: (world, config): [`common::configs`] with every forward and backward
/// prefetch.
fn configs() -> Vec<(usize, FsdpConfig)> {
    let mut out = Vec::new();
    for (world, base) in common::configs() {
        for forward_prefetch in [false, true] {
            for backward_prefetch in [
                BackwardPrefetch::Pre,
                BackwardPrefetch::Post,
                BackwardPrefetch::None,
            ] {
                let mut config = base;
                config.forward_prefetch = forward_prefetch;
                config.backward_prefetch = backward_prefetch;
                out.push((world, config));
            }
        }
    }
    out
}

fn label(world: usize, c: &FsdpConfig) -> String {
    format!(
        "world {world} {:?} ranks_per_node {:?} forward_prefetch {} backward {:?}",
        c.strategy, c.ranks_per_node, c.forward_prefetch, c.backward_prefetch
    )
}

/// The largest relative loss and absolute parameter differences of `runs` from the reference;
/// panics beyond 1e-5 and 1e-4, or when ranks disagree.
fn compare(what: &str, runs: &[Run], reference: &(Vec<f32>, Map)) -> (f32, f32) {
    let (losses, params) = reference;
    for (r, run) in runs.iter().enumerate() {
        assert_eq!(run.losses, runs[0].losses, "{what}: rank {r}'s losses");
        assert!(run.state == runs[0].state, "{what}: rank {r}'s parameters");
    }
    let run = &runs[0];
    assert_eq!(run.losses.len(), losses.len(), "{what}");
    let mut loss_rel = 0.0f32;
    for (step, (got, want)) in run.losses.iter().zip(losses).enumerate() {
        let rel = (got - want).abs() / want.abs();
        assert!(
            rel <= 1e-5,
            "{what}: step {step} loss {got} vs reference {want}"
        );
        loss_rel = loss_rel.max(rel);
    }
    assert_eq!(run.state.len(), params.len(), "{what}: parameter names");
    let mut param_abs = 0.0f32;
    for (name, want) in params {
        let got = &run.state[name];
        assert_eq!(got.len(), want.len(), "{what}: {name}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let d = (g - w).abs();
            assert!(d <= 1e-4, "{what}: {name}[{i}] = {g}, reference {w}");
            param_abs = param_abs.max(d);
        }
    }
    (loss_rel, param_abs)
}

fn check_every_config<M: FsdpModel + Sync>(name: &str, s: &Setup<M>)
where
    M::Batch: Sized,
{
    let reference = reference(s, STEPS);
    let first = reference.0[0];
    assert!(
        reference.0[STEPS - 1] < 0.9 * first,
        "{name} learns: {:?}",
        reference.0
    );
    let (mut loss_rel, mut param_abs, mut n) = (0.0f32, 0.0f32, 0);
    for (world, config) in configs() {
        let runs = train(s, world, config);
        let (l, p) = compare(
            &format!("{name}, {}", label(world, &config)),
            &runs,
            &reference,
        );
        (loss_rel, param_abs, n) = (loss_rel.max(l), param_abs.max(p), n + 1);
    }
    println!(
        "{name}: {n} configurations, max loss rel diff {loss_rel:e}, max param diff {param_abs:e}"
    );
}

fn unit_sizes_are_not_multiples_of_worlds(tree: &Module, wrap: &WrapOptions) {
    for u in plan_units(tree, wrap).unwrap().units {
        for w in 2..=4 {
            assert_ne!(
                u.numel() % w,
                0,
                "unit {:?} ({} elements)",
                u.name,
                u.numel()
            );
        }
    }
}

#[test]
fn tied_mlp_shared_weight_lives_in_the_common_ancestors_unit() {
    let s = tied();
    let plan = plan_units(&s.tree, &s.wrap).unwrap();
    let names: Vec<&str> = plan.units.iter().map(|u| u.name.as_str()).collect();
    assert_eq!(names, ["", "body", "body.enc", "body.dec"]);
    let unit = |p: &str| plan.unit_of(p).unwrap_or_else(|| panic!("{p} has no unit"));
    assert_eq!(unit(tied_mlp::SHARED), 1);
    assert_eq!(
        plan.units[1].params.len(),
        1,
        "body owns the shared weight alone"
    );
    let (enc, dec) = (unit("body.enc.weight"), unit("body.dec.weight"));
    assert_eq!((enc, dec), (2, 3));
    assert_eq!(unit("body.enc.bias"), enc);
    assert_eq!(unit("body.dec.bias"), dec);
    assert_eq!(unit("inp.weight"), 0);
    assert_eq!(unit("head.weight"), 0);
    // The enc and dec spans read their own unit and the shared weight's.
    let spans = s.model.spans();
    for (span, own) in [(&spans[1], enc), (&spans[2], dec)] {
        let mut units: Vec<usize> = span.params.iter().map(|p| unit(p)).collect();
        units.dedup();
        assert_eq!(units, [own, 1], "{}", span.name);
    }
    unit_sizes_are_not_multiples_of_worlds(&s.tree, &s.wrap);
}

/// The planner wants a tied alias in the unit of its target: declaring the uses of the shared
/// weight as aliases inside `body.enc` (a unit of its own) is an error, which is why the
/// example's tree declares no alias and its spans name the storage.
#[test]
fn tied_mlp_aliases_nested_in_the_storage_unit_are_accepted_siblings_are_not() {
    // The example's tree: both aliases lie in units nested in `body`, which owns the storage.
    let plan = plan_units(&tied_mlp::tree(), &tied_mlp::wrap()).unwrap();
    let body = plan.units.iter().position(|u| u.name == "body").unwrap();
    assert_eq!(plan.unit_of(tied_mlp::SHARED), Some(body));
    assert!(plan
        .units
        .iter()
        .all(|u| u.params.iter().all(|p| !p.name.ends_with(".proj"))));
    // Wrapping `body.shared` too puts the storage in a sibling of its users' units: rejected.
    let siblings = WrapOptions::new(WrapPolicy::custom(|m, _| {
        matches!(
            m.name.as_str(),
            "body" | "body.shared" | "body.enc" | "body.dec"
        )
    }));
    match plan_units(&tied_mlp::tree(), &siblings) {
        Err(FsdpError::TiedParametersSplit { param, tied_to, .. }) => {
            assert_eq!(param, "body.enc.proj");
            assert_eq!(tied_to, tied_mlp::SHARED);
        }
        other => panic!("expected TiedParametersSplit, got {other:?}"),
    }
}

#[test]
fn tied_mlp_matches_the_reference_with_every_strategy_and_world() {
    check_every_config("tied_mlp", &tied());
}

/// The shared weight's unit is gathered once per pass and stays gathered from `enc` to `dec`.
#[test]
fn tied_mlp_keeps_the_shared_unit_gathered_across_both_uses() {
    let s = tied();
    let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
    config.forward_prefetch = true;
    let runs = train(&s, 2, config);
    let step2: Vec<&ScheduleEvent> = runs[0].schedule.iter().filter(|e| e.step == 2).collect();
    let (body, dec) = (1, 3);
    for phase in [Phase::Forward, Phase::Backward] {
        let events: Vec<(usize, ScheduleKind)> = step2
            .iter()
            .filter(|e| e.phase == phase)
            .map(|e| (e.unit, e.kind))
            .collect();
        let pos = |unit, kind| events.iter().position(|&e| e == (unit, kind));
        let count = |unit, kind| events.iter().filter(|&&e| e == (unit, kind)).count();
        assert_eq!(
            count(body, ScheduleKind::AllGather),
            1,
            "{phase:?}: {events:?}"
        );
        assert_eq!(count(body, ScheduleKind::Free), 1, "{phase:?}: {events:?}");
        // Freed only once dec (the second use in forward, the first in backward) is gathered.
        let freed = pos(body, ScheduleKind::Free).unwrap();
        assert!(
            pos(dec, ScheduleKind::AllGather).unwrap() < freed,
            "{phase:?}: {events:?}"
        );
    }
    let backward: Vec<usize> = step2
        .iter()
        .filter(|e| e.kind == ScheduleKind::ReduceScatter)
        .map(|e| e.unit)
        .collect();
    // Reduced after dec's and enc's backward, i.e. after both uses added their gradients.
    assert_eq!(backward, [3, 1, 2, 0]);
}

#[test]
fn out_of_order_units_are_defined_a_b_c_d() {
    let s = skip();
    let plan = plan_units(&s.tree, &s.wrap).unwrap();
    let names: Vec<&str> = plan.units.iter().map(|u| u.name.as_str()).collect();
    assert_eq!(names, ["", "a", "b", "c", "d"]);
    let spans: Vec<String> = s.model.spans().into_iter().map(|s| s.name).collect();
    assert_eq!(spans, ["c", "a", "d", "b", "head"]);
    unit_sizes_are_not_multiples_of_worlds(&s.tree, &s.wrap);
}

#[test]
fn out_of_order_matches_the_reference_with_every_strategy_and_world() {
    check_every_config("out_of_order", &skip());
}

/// Step 2's all-gathers follow the execution order recorded in step 1 (`c, a, d, b`, then the
/// root for the head) in forward and its reverse in backward; prefetches too.
#[test]
fn out_of_order_schedule_follows_the_execution_order() {
    let s = skip();
    let plan = plan_units(&s.tree, &s.wrap).unwrap();
    let name = |u: usize| plan.units[u].name.as_str();
    let gathers = |run: &Run, step: u64, phase: Phase| -> Vec<(&str, bool)> {
        let events = run
            .schedule
            .iter()
            .filter(|e| e.step == step && e.phase == phase);
        let events = events.filter(|e| e.kind == ScheduleKind::AllGather);
        events.map(|e| (name(e.unit), e.prefetch)).collect()
    };
    for forward_prefetch in [true, false] {
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.forward_prefetch = forward_prefetch;
        let runs = train(&s, 2, config);
        assert_eq!(runs[0].schedule, runs[1].schedule);
        let p = forward_prefetch;
        assert_eq!(
            gathers(&runs[0], 2, Phase::Forward),
            [("c", false), ("a", p), ("d", p), ("b", p), ("", p)],
            "forward_prefetch {p}"
        );
        assert_eq!(
            gathers(&runs[0], 2, Phase::Backward),
            [("b", true), ("d", true), ("a", true), ("c", true)],
            "forward_prefetch {p}"
        );
        let reductions: Vec<&str> = runs[0]
            .schedule
            .iter()
            .filter(|e| e.step == 2 && e.kind == ScheduleKind::ReduceScatter)
            .map(|e| name(e.unit))
            .collect();
        assert_eq!(reductions, ["", "b", "d", "a", "c"]);
        if forward_prefetch {
            // Step 1 has no recorded order yet: it prefetches by definition order, so after
            // `c` comes `d`, not `a`.
            let step1 = gathers(&runs[0], 1, Phase::Forward);
            assert_eq!(step1[..2], [("c", false), ("d", true)], "{step1:?}");
        }
    }
}

/// `STEPS` steps on `world` ranks with `config`, the steps in `failing` preceded by a pass of
/// the model with `fault`, which must fail with `UnknownParameter` on every rank (a fault read
/// in a pass is followed by `zero_grad`); the runs must match `reference`, as if the failed
/// passes had not happened.
fn train_past_failures<M: FsdpModel + Sync>(
    what: &str,
    s: &Setup<M>,
    reference: &(Vec<f32>, Map),
    world: usize,
    config: FsdpConfig,
    fault: Fault,
    failing: [usize; 2],
) where
    M::Batch: Sized,
{
    let bad = Faulty {
        inner: &s.model,
        fault,
    };
    let runs = run_ranks(s, world, config, |fsdp, batch| {
        let mut losses = Vec::new();
        for step in 0..STEPS {
            if failing.contains(&step) {
                let r = fsdp.forward_backward(&bad, batch);
                assert!(is_missing(r), "{what} step {step}");
                if let Fault::Read(..) = fault {
                    fsdp.zero_grad().unwrap();
                }
            }
            losses.push(fsdp.step(&s.model, batch).unwrap());
        }
        losses
    });
    compare(what, &runs, reference);
}

/// A span naming an unknown parameter fails `forward_backward` with `UnknownParameter` on
/// every rank, before anything is gathered; training then goes on as if it had not happened.
fn unknown_span_parameter<M: FsdpModel + Sync>(s: &Setup<M>, span: usize)
where
    M::Batch: Sized,
{
    let reference = reference(s, STEPS);
    for (world, strategy) in [
        (2, ShardingStrategy::FullShard),
        (3, ShardingStrategy::NoShard),
    ] {
        let mut config = FsdpConfig::new(strategy);
        config.forward_prefetch = true;
        let what = label(world, &config);
        // Before the first pass (no order recorded) and after it.
        let fault = Fault::Listed(span);
        train_past_failures(&what, s, &reference, world, config, fault, [0, 1]);
    }
}

#[test]
fn tied_mlp_unknown_span_parameter_is_an_error() {
    unknown_span_parameter(&tied(), 1);
}

#[test]
fn out_of_order_unknown_span_parameter_is_an_error() {
    unknown_span_parameter(&skip(), 3);
}

/// A model failing in the middle of forward (at span `spans.0`: after gathers and prefetches
/// were issued) or backward (at span `spans.1`: after reductions were issued too): the error
/// comes back on every rank, and after `zero_grad` training goes on as if the failed pass had
/// not happened.
fn failure_mid_pass<M: FsdpModel + Sync>(name: &str, s: &Setup<M>, spans: (usize, usize))
where
    M::Batch: Sized,
{
    let reference = reference(s, STEPS);
    let worlds = [
        (2, ShardingStrategy::FullShard, None),
        (2, ShardingStrategy::ShardGradOp, None),
        (3, ShardingStrategy::NoShard, None),
        (4, ShardingStrategy::HybridShard, Some(2)),
    ];
    for (world, strategy, ranks_per_node) in worlds {
        for (phase, span) in [(Phase::Forward, spans.0), (Phase::Backward, spans.1)] {
            let mut config = FsdpConfig::new(strategy);
            config.forward_prefetch = true;
            config.ranks_per_node = ranks_per_node;
            let what = format!("{name} failing in {phase:?}, {}", label(world, &config));
            // Before any order is recorded, and after.
            let fault = Fault::Read(phase, span);
            train_past_failures(&what, s, &reference, world, config, fault, [0, 2]);
        }
    }
}

#[test]
fn errors_in_the_middle_of_a_pass_leave_the_engine_usable() {
    // tied_mlp: forward fails in `dec`, backward in `inp` (after dec, body, enc were reduced);
    // out_of_order: forward fails in `d`, backward in `a` (after head, b, d were reduced).
    failure_mid_pass("tied_mlp", &tied(), (2, 0));
    failure_mid_pass("out_of_order", &skip(), (2, 1));
}

/// Both models' backward against central differences of their loss (on plain maps), so that
/// the reference the engine is compared with is itself right: the shared weight's gradient
/// sums both uses, the skip connection's gradient reaches `a`.
#[test]
fn model_gradients_match_finite_differences() {
    fn check<M: FsdpModel>(name: &str, s: &Setup<M>)
    where
        M::Batch: Sized,
    {
        let batch = (s.batch)(GLOBAL, 0, 1);
        let (_, grads) = loss_and_grads(&s.model, &s.init, &s.init, &batch).unwrap();
        let eps = 1e-2f32;
        let mut worst = 0.0f32;
        for (pname, values) in &s.init {
            for i in 0..values.len() {
                let mut p = s.init.clone();
                p.get_mut(pname).unwrap()[i] = values[i] + eps;
                let (up, _) = loss_and_grads(&s.model, &p, &p, &batch).unwrap();
                p.get_mut(pname).unwrap()[i] = values[i] - eps;
                let (down, _) = loss_and_grads(&s.model, &p, &p, &batch).unwrap();
                let fd = (up - down) / (2.0 * eps);
                let g = grads[pname][i];
                let err = (fd - g).abs() / (1e-2 + g.abs());
                assert!(
                    err < 2e-2,
                    "{name}: {pname}[{i}]: backward {g}, finite difference {fd}"
                );
                worst = worst.max(err);
            }
        }
        println!("{name}: worst relative finite-difference error {worst:e}");
    }
    check("tied_mlp", &tied());
    check("out_of_order", &skip());
}
