//! Mixed precision, bit for bit: the engine's runs of the tied-weight MLP example (which casts
//! its input and output under a policy) against a simulation of `W` ranks written here.
//!
//! The simulation follows the definition in `fsdp::engine`'s mixed-precision documentation:
//! every rank computes its gradient in `f32` from the master weights rounded to `param_dtype`;
//! per unit, each rank's flat gradient (padding zero) is rounded to `param_dtype`, cast to
//! `reduce_dtype`, pre-divided; shard `j` of the shard group is summed in the ring's order
//! (starting at the group's rank `j + 1`, rounding to `reduce_dtype` after every addition),
//! then across replicas chunk by chunk (chunk `c` starting at replica `c + 1`); the result is
//! post-divided, widened to `f32` and AdamW steps the `f32` master weights. Every strategy at
//! worlds 1–4 (every hybrid mesh), `bf16` and `f16`, `reduce_dtype` `f32` and equal to
//! `param_dtype`, both gradient-divide modes.

use std::collections::HashMap;

use fsdp::engine::{
    divide_factors, round_slice, round_to, Fsdp, FsdpConfig, FsdpModel, GradientDivide,
    MixedPrecisionPolicy, ParamInit, ScheduleKind, ShardingStrategy,
};
use fsdp::optim::{AdamWState, AnyPrecisionAdamWConfig, AnyPrecisionAdamWState, OptimizerConfig};
use fsdp::units::UnitPlan;
use fsdp::wrap::plan_units;
use fsdp::{FsdpError, Params};
use fsdp_collectives::{ring, Communicator};
use fsdp_device::DType;
use fsdp_flatparam::FlatParamLayout;
use half::bf16;

mod common;
#[allow(dead_code)]
#[path = "../examples/tied_mlp.rs"]
mod tied_mlp;

use common::{adamw, bits, configs, ring_options, Map, GLOBAL};

use tied_mlp::TiedMlp;

const STEPS: usize = 3;

/// Plain maps that report a mixed-precision policy, as the engine's views do.
struct MpParams<'a> {
    map: &'a Map,
    policy: MixedPrecisionPolicy,
}

impl Params for MpParams<'_> {
    fn param(&self, name: &str) -> Result<&[f32], FsdpError> {
        self.map.param(name)
    }
    fn mixed_precision(&self) -> Option<MixedPrecisionPolicy> {
        Some(self.policy)
    }
}

/// One rank's loss and `f32` gradients from the master weights rounded to `param_dtype`.
fn local_grads<M: FsdpModel>(
    model: &M,
    master: &Map,
    policy: MixedPrecisionPolicy,
    batch: &M::Batch,
) -> (f32, Map) {
    let mut rounded = master.clone();
    for v in rounded.values_mut() {
        round_slice(policy.param_dtype, v);
    }
    let p = MpParams {
        map: &rounded,
        policy,
    };
    common::loss_and_grads(model, &p, master, batch).unwrap()
}

/// Sum `values` in the ring's order starting at `first`, rounding to `r` after every addition.
fn ring_sum(values: &[f32], first: usize, r: DType) -> f32 {
    let n = values.len();
    let mut acc = values[first % n];
    for i in 1..n {
        acc = round_to(r, acc + values[(first + i) % n]);
    }
    acc
}

/// The all-reduce of per-rank vectors (equal lengths) as the ring computes it: chunk `c`
/// (elements `c·len/n .. (c+1)·len/n`) accumulates from rank `c + 1`.
fn ring_all_reduce(inputs: &[Vec<f32>], r: DType) -> Vec<f32> {
    let (n, len) = (inputs.len(), inputs[0].len());
    (0..len)
        .map(|i| {
            let c = (0..n).find(|&c| i < (c + 1) * len / n).unwrap();
            let v: Vec<f32> = inputs.iter().map(|x| x[i]).collect();
            ring_sum(&v, c + 1, r)
        })
        .collect()
}

/// The shard and replicate group sizes of `config` at `world`.
fn mesh(world: usize, config: &FsdpConfig) -> (usize, usize) {
    match config.strategy {
        ShardingStrategy::FullShard | ShardingStrategy::ShardGradOp => (world, 1),
        ShardingStrategy::NoShard => (1, world),
        _ => {
            let s = config.ranks_per_node.unwrap_or(world);
            (s, world / s)
        }
    }
}

/// The simulated run: the losses of every step and the final master weights.
fn simulate(plan: &UnitPlan, world: usize, config: &FsdpConfig, init: &Map) -> (Vec<f32>, Map) {
    let policy = config.mixed_precision;
    let (p_dt, r_dt) = (policy.param_dtype, policy.reduce_dtype());
    let (s, reps) = mesh(world, config);
    let model = model(world, config);
    let batches: Vec<_> = (0..world)
        .map(|r| tied_mlp::batch(GLOBAL, r, world))
        .collect();
    let mut master = init.clone();
    let mut states: HashMap<String, AdamWState> = master
        .iter()
        .map(|(k, v)| (k.clone(), AdamWState::new(v.len())))
        .collect();
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        let local: Vec<(f32, Map)> = batches
            .iter()
            .map(|b| local_grads(&model, &master, policy, b))
            .collect();
        let l: Vec<f32> = local.iter().map(|x| x.0).collect();
        losses.push(if world == 1 {
            l[0]
        } else {
            ring_sum(&l, 0, DType::F32)
        });
        let mut grads = Map::new();
        for unit in plan.units.iter().filter(|u| !u.params.is_empty()) {
            let factor = if s > 1 { s } else { 1 };
            let mut b = FlatParamLayout::builder(factor);
            if config.use_orig_params {
                b = b.align_bytes(16, p_dt);
            }
            for p in &unit.params {
                b = b.param(p.name.clone(), &p.shape);
            }
            let layout = b.build().unwrap();
            let n = if factor > 1 { s * reps } else { reps };
            let f = divide_factors(config.gradient_divide, r_dt, n);
            // Each rank's reduce input.
            let inputs: Vec<Vec<f32>> = local
                .iter()
                .map(|(_, g)| {
                    let mut flat = vec![0.0f32; layout.padded_numel()];
                    for p in layout.params() {
                        flat[p.range()].copy_from_slice(&g[p.name()]);
                    }
                    flat.iter()
                        .map(|&x| {
                            let mut v = round_to(r_dt, round_to(p_dt, x));
                            if let Some(m) = f.premul {
                                v = round_to(r_dt, v * m);
                            }
                            if let Some(d) = f.pre_divide {
                                v = round_to(r_dt, v / d);
                            }
                            v
                        })
                        .collect()
                })
                .collect();
            // Rank 0's replica: its reduce-scatter over the shard group, then every shard's
            // all-reduce over the replicas (the same on every replica).
            let reduced: Vec<f32> = if factor > 1 {
                let sn = layout.shard_numel();
                let mut out = Vec::new();
                for j in 0..s {
                    // Shard j on replica k: the in-order sum over the group's ranks.
                    let per_replica: Vec<Vec<f32>> = (0..reps)
                        .map(|k| {
                            (0..sn)
                                .map(|e| {
                                    let v: Vec<f32> =
                                        (0..s).map(|q| inputs[k * s + q][j * sn + e]).collect();
                                    ring_sum(&v, j + 1, r_dt)
                                })
                                .collect()
                        })
                        .collect();
                    let shard = if reps > 1 {
                        ring_all_reduce(&per_replica, r_dt)
                    } else {
                        per_replica[0].clone()
                    };
                    out.extend(shard);
                }
                out
            } else if reps > 1 {
                ring_all_reduce(&inputs, r_dt)
            } else {
                inputs[0].clone()
            };
            for p in layout.params() {
                let g: Vec<f32> = reduced[p.range()]
                    .iter()
                    .map(|&v| match f.post_divide {
                        Some(d) => round_to(r_dt, v / d),
                        None => v,
                    })
                    .collect();
                grads.insert(p.name().to_string(), g);
            }
        }
        for (name, p) in master.iter_mut() {
            states
                .get_mut(name)
                .unwrap()
                .step(&adamw(), p, &grads[name])
                .unwrap();
        }
    }
    (losses, master)
}

/// The model's loss normaliser: the global batch ([`GradientDivide::Model`]) or the rank's
/// examples (FSDP2's default, the engine dividing by the data-parallel size).
fn model(world: usize, config: &FsdpConfig) -> TiedMlp {
    TiedMlp {
        global: match config.gradient_divide {
            GradientDivide::Model => GLOBAL,
            GradientDivide::DataParallelSize => GLOBAL / world,
        },
    }
}

/// The tied-MLP example's engine on one rank.
fn tied_engine_result(
    comm: ring::RingCommunicator,
    init: &Map,
    config: FsdpConfig,
    optim: OptimizerConfig,
) -> Result<Fsdp, FsdpError> {
    let tree = tied_mlp::tree();
    let wrap = tied_mlp::wrap();
    Fsdp::from_module(
        Box::new(comm),
        &tree,
        &wrap,
        ParamInit::Full(init),
        config,
        optim,
    )
}

fn tied_engine(
    comm: ring::RingCommunicator,
    init: &Map,
    config: FsdpConfig,
    optim: impl Into<OptimizerConfig>,
) -> Fsdp {
    tied_engine_result(comm, init, config, optim.into()).unwrap()
}

/// The engine's run: every rank's losses and final full state (which must agree), and the
/// bytes all-gathered and reduce-scattered by rank 0.
fn engine(
    world: usize,
    config: FsdpConfig,
    init: &Map,
) -> (Vec<f32>, Map, Vec<(ScheduleKind, usize)>) {
    let runs = ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let batch = tied_mlp::batch(GLOBAL, rank, world);
        let mut fsdp = tied_engine(comm, init, config, adamw());
        let m = model(world, &config);
        let losses: Vec<f32> = (0..STEPS).map(|_| fsdp.step(&m, &batch).unwrap()).collect();
        let kinds = fsdp
            .schedule()
            .iter()
            .map(|e| (e.kind, e.unit))
            .collect::<Vec<_>>();
        (losses, fsdp.full_state_dict().unwrap(), kinds)
    })
    .unwrap();
    for r in &runs[1..] {
        assert_eq!(r.0, runs[0].0, "ranks' losses");
        assert!(r.1 == runs[0].1, "ranks' parameters");
    }
    runs.into_iter().next().unwrap()
}

fn policies() -> Vec<MixedPrecisionPolicy> {
    let mut out = Vec::new();
    for p in [DType::BF16, DType::F16] {
        for r in [Some(DType::F32), None] {
            out.push(MixedPrecisionPolicy::new(p, r));
        }
    }
    out
}

#[test]
fn every_strategy_world_and_policy_equals_the_simulation_bitwise() {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    let mut checked = 0;
    for (world, base) in configs() {
        for policy in policies() {
            for divide in [GradientDivide::Model, GradientDivide::DataParallelSize] {
                let mut config = base;
                config.mixed_precision = policy;
                config.gradient_divide = divide;
                let what = format!(
                    "world {world} {:?} ranks_per_node {:?} {:?} {divide:?}",
                    config.strategy, config.ranks_per_node, policy
                );
                let (want_losses, want) = simulate(&plan, world, &config, &init);
                let (losses, got, _) = engine(world, config, &init);
                assert_eq!(bits(&got), bits(&want), "{what}: parameters");
                let lb = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(lb(&losses), lb(&want_losses), "{what}: losses");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 28 * 4 * 2);
}

/// `use_orig_params`: the flat parameters are aligned to 16 bytes of `param_dtype` (4 `f32`
/// or 8 `bf16` elements) and padded to the shard group size, as PyTorch lays them out, and
/// training equals the simulation over that layout bit for bit.
#[test]
fn use_orig_params_aligns_to_the_param_dtype_and_equals_the_simulation() {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    for world in [1, 3, 4] {
        for (policy, align) in [
            (MixedPrecisionPolicy::default(), 4),
            (MixedPrecisionPolicy::new(DType::BF16, None), 8),
        ] {
            let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
            config.mixed_precision = policy;
            config.use_orig_params = true;
            let layouts: Vec<(usize, usize, usize)> =
                ring::run_ranks(world, ring_options(), |comm| {
                    let fsdp = tied_engine(comm, &init, config, adamw());
                    (0..fsdp.num_units())
                        .filter_map(|u| fsdp.layout(u))
                        .map(|l| (l.align_numel(), l.unpadded_numel(), l.end_padding_numel()))
                        .collect::<Vec<_>>()
                })
                .unwrap()
                .remove(0);
            assert!(!layouts.is_empty());
            for (a, unpadded, end) in layouts {
                assert_eq!(a, align, "world {world} {policy:?}");
                assert_eq!((unpadded % world, end), (0, 0), "world {world} {policy:?}");
            }
            let (want_losses, want) = simulate(&plan, world, &config, &init);
            let (losses, got, _) = engine(world, config, &init);
            assert_eq!(
                bits(&got),
                bits(&want),
                "world {world} {policy:?}: parameters"
            );
            let lb = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                lb(&losses),
                lb(&want_losses),
                "world {world} {policy:?}: losses"
            );
        }
    }
}

/// At world 1 with `reduce_dtype` f32: a single-process f32 run whose parameters are rounded
/// to `param_dtype` before every forward and whose gradients are rounded to `param_dtype`.
#[test]
fn world_one_is_the_rounded_single_process_run() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    for p in [DType::BF16, DType::F16] {
        let policy = MixedPrecisionPolicy::new(p, Some(DType::F32));
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = policy;
        let (_, got, _) = engine(1, config, &init);
        let batch = tied_mlp::batch(GLOBAL, 0, 1);
        let m = TiedMlp { global: GLOBAL };
        let mut master = init.clone();
        let mut states: HashMap<String, AdamWState> = master
            .iter()
            .map(|(k, v)| (k.clone(), AdamWState::new(v.len())))
            .collect();
        for _ in 0..STEPS {
            let (_, mut grads) = local_grads(&m, &master, policy, &batch);
            for (name, w) in master.iter_mut() {
                let g = grads.get_mut(name).unwrap();
                round_slice(p, g);
                states.get_mut(name).unwrap().step(&adamw(), w, g).unwrap();
            }
        }
        assert_eq!(bits(&got), bits(&master), "{p}");
        // And it is not the f32 run.
        let (_, f32_run, _) = engine(1, FsdpConfig::new(ShardingStrategy::FullShard), &init);
        assert_ne!(bits(&got), bits(&f32_run), "{p} changes the result");
    }
}

/// `output_dtype` and `cast_forward_inputs` reach the model: each changes the result, and the
/// simulation (which applies them through the same policy) still matches.
#[test]
fn output_dtype_and_cast_forward_inputs_are_applied() {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    let base = MixedPrecisionPolicy::new(DType::BF16, Some(DType::F32));
    let mut results = Vec::new();
    for (cast_inputs, output) in [(false, None), (true, None), (true, Some(DType::F16))] {
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = MixedPrecisionPolicy {
            cast_forward_inputs: cast_inputs,
            output_dtype: output,
            ..base
        };
        let (_, want) = simulate(&plan, 2, &config, &init);
        let (_, got, _) = engine(2, config, &init);
        assert_eq!(bits(&got), bits(&want));
        results.push(bits(&got));
    }
    assert_ne!(
        results[0], results[1],
        "cast_forward_inputs changes the run"
    );
    assert_ne!(results[1], results[2], "output_dtype changes the run");
}

/// bf16 parameters halve the bytes all-gathered; the schedule is the same.
#[test]
fn bf16_halves_the_bytes_all_gathered() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let run = |policy| {
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = policy;
        config.trace = true;
        ring::run_ranks(2, ring_options(), |comm| {
            let batch = tied_mlp::batch(GLOBAL, comm.rank(), 2);
            let mut fsdp = tied_engine(comm, &init, config, adamw());
            fsdp.step(&TiedMlp { global: GLOBAL }, &batch).unwrap();
            let bytes = |k: fsdp::trace::SpanKind| -> u64 {
                fsdp.trace_events()
                    .iter()
                    .filter_map(|e| match e {
                        fsdp::trace::TraceEvent::Span { kind, bytes, .. } if *kind == k => *bytes,
                        _ => None,
                    })
                    .sum()
            };
            (
                bytes(fsdp::trace::SpanKind::AllGather),
                bytes(fsdp::trace::SpanKind::ReduceScatter),
                fsdp.schedule().to_vec(),
            )
        })
        .unwrap()
        .remove(0)
    };
    let f32_run = run(MixedPrecisionPolicy::default());
    let bf16 = run(MixedPrecisionPolicy::new(DType::BF16, Some(DType::F32)));
    let bf16_bf16 = run(MixedPrecisionPolicy::new(DType::BF16, None));
    assert!(f32_run.0 > 0);
    assert_eq!(bf16.0 * 2, f32_run.0);
    assert_eq!(
        bf16.1, f32_run.1,
        "f32 reduce: the same reduce-scatter bytes"
    );
    assert_eq!(bf16_bf16.1 * 2, f32_run.1);
    assert_eq!(bf16.2, f32_run.2, "the same schedule");
}

#[test]
fn fsdp2_divide_factors() {
    let f = |n| divide_factors(GradientDivide::DataParallelSize, DType::F16, n);
    assert_eq!((f(1).pre_divide, f(1).post_divide), (None, None));
    assert_eq!((f(2).pre_divide, f(2).post_divide), (Some(2.0), None));
    assert_eq!((f(3).pre_divide, f(3).post_divide), (Some(2.0), Some(1.5)));
    assert_eq!((f(4).pre_divide, f(4).post_divide), (Some(2.0), Some(2.0)));
    assert_eq!(
        (f(16).pre_divide, f(16).post_divide),
        (Some(4.0), Some(4.0))
    );
    assert_eq!(
        (f(32).pre_divide, f(32).post_divide),
        (Some(8.0), Some(4.0))
    );
    let a = divide_factors(GradientDivide::DataParallelSize, DType::BF16, 3);
    assert_eq!(a.premul, Some(round_to(DType::BF16, 1.0 / 3.0)));
    let m = divide_factors(GradientDivide::Model, DType::F16, 8);
    assert_eq!(m, fsdp::engine::DivideFactors::NONE);
}

#[test]
fn a_float64_policy_is_refused_by_name() {
    let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
    config.mixed_precision = MixedPrecisionPolicy::new(DType::BF16, Some(DType::F64));
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let err = ring::run_ranks(1, ring_options(), |comm| {
        tied_engine_result(comm, &init, config, adamw().into())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    assert!(err[0].contains("reduce_dtype float64"), "{}", err[0]);
}

fn any_precision() -> AnyPrecisionAdamWConfig {
    AnyPrecisionAdamWConfig {
        lr: 1e-2,
        ..AnyPrecisionAdamWConfig::default()
    }
}

/// Pure bf16 (AnyPrecisionAdamW): the shards themselves are bf16 (no f32 master), the optimizer
/// states bf16 with Kahan compensation. At worlds 1 and 2 (where the f32 sum of the two ranks'
/// rounded gradients has one order) the run equals a reference: gradients computed from the
/// bf16 parameters, rounded to bf16, summed in f32, then torchdistx's update on the bf16
/// parameters.
#[test]
fn any_precision_adamw_trains_pure_bf16_shards() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let policy = MixedPrecisionPolicy::new(DType::BF16, Some(DType::F32));
    for world in [1, 2] {
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = policy;
        let runs = ring::run_ranks(world, ring_options(), |comm| {
            let batch = tied_mlp::batch(GLOBAL, comm.rank(), world);
            let mut fsdp = tied_engine(comm, &init, config, OptimizerConfig::from(any_precision()));
            assert!(fsdp
                .param_groups()
                .iter()
                .all(|g| g.dtypes().shard == DType::BF16));
            let m = TiedMlp { global: GLOBAL };
            let losses: Vec<f32> = (0..STEPS).map(|_| fsdp.step(&m, &batch).unwrap()).collect();
            (losses, fsdp.full_state_dict().unwrap())
        })
        .unwrap();
        assert!(runs.iter().all(|r| r.1 == runs[0].1), "ranks agree");
        // The reference.
        let m = TiedMlp { global: GLOBAL };
        let mut params: HashMap<String, Vec<bf16>> = init
            .iter()
            .map(|(k, v)| (k.clone(), v.iter().map(|&x| bf16::from_f32(x)).collect()))
            .collect();
        let mut states: HashMap<String, AnyPrecisionAdamWState> = init
            .iter()
            .map(|(k, v)| {
                let s = AnyPrecisionAdamWState::try_new(&any_precision(), v.len()).unwrap();
                (k.clone(), s)
            })
            .collect();
        for _ in 0..STEPS {
            let wide: Map = params
                .iter()
                .map(|(k, v)| (k.clone(), v.iter().map(|x| x.to_f32()).collect()))
                .collect();
            let local: Vec<Map> = (0..world)
                .map(|r| local_grads(&m, &wide, policy, &tied_mlp::batch(GLOBAL, r, world)).1)
                .collect();
            for (name, p) in params.iter_mut() {
                let g: Vec<f32> = (0..p.len())
                    .map(|i| {
                        local
                            .iter()
                            .map(|l| round_to(DType::BF16, l[name][i]))
                            .fold(0.0f32, |a, b| if a == 0.0 { b } else { a + b })
                    })
                    .collect();
                states
                    .get_mut(name)
                    .unwrap()
                    .step(&any_precision(), p, &g)
                    .unwrap();
            }
        }
        let want: Map = params
            .iter()
            .map(|(k, v)| (k.clone(), v.iter().map(|x| x.to_f32()).collect()))
            .collect();
        assert_eq!(bits(&runs[0].1), bits(&want), "world {world}");
        let l = &runs[0].0;
        assert!(l[STEPS - 1] < l[0], "learns: {l:?}");
    }
}

/// Sharded state per parameter element: 8 bytes under AnyPrecisionAdamW (bf16 parameter,
/// exp_avg, exp_avg_sq, compensation) against 12 under AdamW with f32 master weights — in the
/// engine (allocator-held shard + optimizer state) and in the plan.
#[test]
fn any_precision_sharded_state_is_8_bytes_per_parameter() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let spans = TiedMlp { global: GLOBAL }.spans();
    for (optim, policy, per_element) in [
        (
            any_precision().into(),
            MixedPrecisionPolicy::new(DType::BF16, Some(DType::F32)),
            8,
        ),
        (adamw().into(), MixedPrecisionPolicy::default(), 12),
    ] {
        let optim: OptimizerConfig = optim;
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = policy;
        let (numel, bytes) = ring::run_ranks(2, ring_options(), |comm| {
            let batch = tied_mlp::batch(GLOBAL, comm.rank(), 2);
            let mut fsdp = tied_engine(comm, &init, config, optim);
            fsdp.step(&TiedMlp { global: GLOBAL }, &batch).unwrap();
            fsdp.param_groups().iter().fold((0, 0), |(n, b), g| {
                let s = g.layout().shard_numel();
                let shard = s * g.dtypes().shard.size_in_bytes();
                (n + s, b + shard + g.optimizer_state_bytes())
            })
        })
        .unwrap()[0];
        assert_eq!(bytes, per_element * numel, "{optim:?}");
        assert_eq!(
            optim.sharded_bytes_per_param(policy.param_dtype),
            per_element
        );
        let p = fsdp::plan::plan_with_optimizer(&plan, &spans, &[], 2, &config, 1, &optim).unwrap();
        let state = (per_element - policy.param_dtype.size_in_bytes()) * numel;
        assert_eq!(p.per_rank[0].optimizer_state, state as u64, "{optim:?}");
    }
}

/// AnyPrecisionAdamW's state goes through a sharded checkpoint exactly: 2 steps at world 2,
/// save, reload at world 3 (resharded) and at world 2, train 2 more steps; at world 2 the result
/// is bitwise the uninterrupted 4-step run.
#[test]
fn any_precision_state_survives_a_sharded_checkpoint() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let specs: Vec<_> = plan
        .units
        .iter()
        .flat_map(|u| u.params.iter().cloned())
        .chain(plan.ignored.iter().cloned())
        .collect();
    let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
    config.mixed_precision = MixedPrecisionPolicy::new(DType::BF16, Some(DType::F32));
    let dir = std::env::temp_dir().join(format!("fsdp-anyprec-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = |world: usize, init: &Map, steps: usize, save: bool, state| {
        ring::run_ranks(world, ring_options(), |comm| {
            let batch = tied_mlp::batch(GLOBAL, comm.rank(), world);
            let mut fsdp = tied_engine(comm, init, config, OptimizerConfig::from(any_precision()));
            if let Some(s) = &state {
                fsdp.load_optimizer_state(s).unwrap();
            }
            let m = TiedMlp { global: GLOBAL };
            for _ in 0..steps {
                fsdp.step(&m, &batch).unwrap();
            }
            if save {
                fsdp.save_sharded(&dir).unwrap();
            }
            fsdp.full_state_dict().unwrap()
        })
        .unwrap()
        .remove(0)
    };
    let whole = run(2, &init, 4, false, None);
    run(2, &init, 2, true, None);
    let ckpt = fsdp::checkpoint::load_sharded_checkpoint(&dir, &specs).unwrap();
    assert_eq!(
        ckpt.optimizer.as_ref().unwrap().optimizer,
        "anyprecision_adamw"
    );
    let resumed = run(2, &ckpt.params, 2, false, ckpt.optimizer.clone());
    assert_eq!(bits(&resumed), bits(&whole), "resumed at world 2");
    let resharded = run(3, &ckpt.params, 2, false, ckpt.optimizer.clone());
    assert_eq!(resharded.len(), whole.len(), "resumed at world 3");
    std::fs::remove_dir_all(&dir).unwrap();
}
