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
//!
//! This file holds the simulation and the engine's runs that the tests share; the tests are in
//! [`policies`] (every policy against the simulation, and the policy's effects) and
//! [`pure_bf16`] (AnyPrecisionAdamW on bf16 shards).

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

#[path = "../common/mod.rs"]
mod common;
mod policies;
mod pure_bf16;
#[allow(dead_code)]
#[path = "../../examples/tied_mlp.rs"]
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
