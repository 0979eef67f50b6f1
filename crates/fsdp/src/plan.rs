//! Memory and communication plan of an FSDP configuration, predicted without training.
//!
//! [`plan`] lists per unit the parameter count, the per-rank payload of each collective
//! (`unit params × 4 bytes / F`, padding included) and the number of collectives per training
//! step (one forward and backward of a batch), and predicts per rank the peak of the bytes the
//! runtime's caching allocator holds. The prediction replays the runtime's schedule
//! ([`FsdpGpt`](crate::runtime::FsdpGpt)) for two steps (the second with forward prefetch, when
//! on): every all-gather output and unsharded gradient is allocated where the runtime
//! allocates it, each buffer rounded up to 512 bytes as the allocator does; a reduce-scatter
//! keeps its unsharded gradient until the host waits for an all-gather issued after it (the
//! communication stream runs in issue order) or the step's reductions are waited for. The
//! allocator holds the parameter and gradient shards and the unsharded buffers; the optimizer
//! state (AdamW: two `f32` per shard element) and the activations (the model's caches, an
//! estimate) live in plain host memory and are reported separately.

use std::fmt;

use crate::model::{block_param_specs, embed_param_specs, head_param_specs, GptConfig};
use crate::runtime::{BackwardPrefetch, FsdpConfig, ShardingStrategy};
use crate::units::UnitPlan;
use crate::FsdpError;

/// The allocator's rounding of one buffer (its `MIN_BLOCK_SIZE`).
const ROUND: usize = 512;

fn buf(numel: usize) -> u64 {
    (numel * 4).max(1).next_multiple_of(ROUND) as u64
}

/// One unit of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitPlanRow {
    /// The unit's index (the ignored parameters, if any, form a last, unsharded unit).
    pub unit: usize,
    /// The unit's name.
    pub name: String,
    /// Parameter count (unpadded).
    pub params: usize,
    /// The sharding factor `F` of the unit.
    pub factor: usize,
    /// Elements of the rank's shard (padded numel / `F`).
    pub shard_numel: usize,
    /// Per-rank payload in bytes of an all-gather or reduce-scatter (`shard_numel × 4`; 0 when
    /// the unit is not sharded).
    pub shard_bytes: u64,
    /// Per-rank payload in bytes of the gradient all-reduce (0 when there is none).
    pub all_reduce_bytes: u64,
    /// All-gathers in forward per step.
    pub forward_all_gathers: usize,
    /// All-gathers in backward per step.
    pub backward_all_gathers: usize,
    /// Reduce-scatters per step.
    pub reduce_scatters: usize,
    /// Gradient all-reduces per step.
    pub all_reduces: usize,
}

/// The predicted memory of one rank (the same on every rank: shards are equal-sized).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankMemory {
    /// Parameter and gradient shards (allocator).
    pub sharded_state: u64,
    /// Unsharded (all-gathered) parameters alive at the peak (allocator).
    pub unsharded_params: u64,
    /// Unsharded gradients alive at the peak, including those held by in-flight
    /// reduce-scatters (allocator).
    pub unsharded_grads: u64,
    /// Predicted peak of allocated bytes: the sum of the three above.
    pub peak_allocated: u64,
    /// Optimizer state in host memory (AdamW: `exp_avg` and `exp_avg_sq` of the shards).
    pub optimizer_state: u64,
    /// Activations kept for backward in host memory (estimate of the model's caches at the end
    /// of forward).
    pub activations: u64,
}

/// The plan: per-unit communication and per-rank memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The strategy.
    pub strategy: ShardingStrategy,
    /// World size.
    pub world: usize,
    /// The sharding factor of the (sharded) units.
    pub factor: usize,
    /// The replicate group size (gradient all-reduce across it; 1 = none).
    pub replicas: usize,
    /// Per-unit rows.
    pub units: Vec<UnitPlanRow>,
    /// Loss all-reduces per step (4 bytes each, over the world).
    pub loss_all_reduces: usize,
    /// The predicted memory of each rank.
    pub per_rank: Vec<RankMemory>,
}

impl MemoryPlan {
    /// Total collectives per step of each kind: (forward all-gathers, backward all-gathers,
    /// reduce-scatters, gradient all-reduces).
    pub fn collective_counts(&self) -> (usize, usize, usize, usize) {
        self.units.iter().fold((0, 0, 0, 0), |a, u| {
            (
                a.0 + u.forward_all_gathers,
                a.1 + u.backward_all_gathers,
                a.2 + u.reduce_scatters,
                a.3 + u.all_reduces,
            )
        })
    }
}

/// Simulated unit state.
#[derive(Clone, Default)]
struct SimUnit {
    full: bool,
    /// Issue index of the pending all-gather.
    gather: Option<u64>,
    counted: bool,
    grad: bool,
}

struct Sim<'a> {
    padded: &'a [usize],
    factor: &'a [usize],
    config: &'a FsdpConfig,
    units: Vec<SimUnit>,
    in_flight: usize,
    forward: bool,
    issued: u64,
    /// Reduce-scatters holding an unsharded gradient: (bytes, issue index).
    pending: Vec<(u64, u64)>,
    params: u64,
    grads: u64,
    peak: (u64, u64, u64),
    base: u64,
}

impl Sim<'_> {
    fn note(&mut self) {
        let total = self.params + self.grads;
        if total > self.peak.0 {
            self.peak = (total, self.params, self.grads);
        }
    }

    fn counts(&self, u: usize) -> bool {
        !self.forward || (u != 0 && self.config.strategy.reshard_after_forward())
    }

    fn gather(&mut self, u: usize) {
        if self.units[u].full || self.factor[u] == 1 {
            return;
        }
        self.params += buf(self.padded[u]);
        let counted = self.counts(u);
        let s = &mut self.units[u];
        s.full = true;
        s.gather = Some(self.issued);
        s.counted = counted;
        self.issued += 1;
        if counted {
            self.in_flight += 1;
        }
        self.note();
    }

    fn prefetch(&mut self, u: usize) {
        if self.units[u].full || self.factor[u] == 1 {
            return;
        }
        if let Some(limit) = self.config.limit_all_gathers {
            if self.counts(u) && self.in_flight >= limit {
                return;
            }
        }
        self.gather(u);
    }

    fn free(&mut self, u: usize) {
        if self.factor[u] == 1 || !self.units[u].full {
            return;
        }
        self.params -= buf(self.padded[u]);
        let s = &mut self.units[u];
        s.full = false;
        s.gather = None;
        if std::mem::take(&mut s.counted) {
            self.in_flight -= 1;
        }
    }

    fn wait(&mut self, us: &[usize]) {
        for &u in us {
            if let Some(k) = self.units[u].gather.take() {
                let before: u64 = self.pending.iter().map(|p| p.0).sum();
                self.pending.retain(|&(_, i)| i > k);
                let after: u64 = self.pending.iter().map(|p| p.0).sum();
                self.grads -= before - after;
            }
        }
    }

    fn reduce(&mut self, u: usize) {
        if !std::mem::take(&mut self.units[u].grad) || self.factor[u] == 1 {
            // An unsharded unit's gradient is its gradient shard (reduced in place).
            return;
        }
        self.pending.push((buf(self.padded[u]), self.issued));
        self.issued += 1;
    }
}

/// Plan `config` for the model `cfg` with `units` at `world` ranks, each with a batch of
/// `batch_per_rank` sequences of `seq` tokens (one micro-batch per step).
///
/// # Errors
/// The model configuration's validation errors, [`FsdpError::InvalidPlan`]
/// for a plan that does not cover the model, [`FsdpError::InvalidFsdpConfig`] for a world of 0,
/// a `ranks_per_node` that does not divide the world, a limit of 0, or a batch of 0 rows or a
/// `seq` of 0 or above the block size.
pub fn plan(
    cfg: &GptConfig,
    world: usize,
    config: &FsdpConfig,
    units: &UnitPlan,
    batch_per_rank: usize,
    seq: usize,
) -> Result<MemoryPlan, FsdpError> {
    cfg.validate()?;
    units.validate()?;
    let bad = |reason: String| FsdpError::InvalidFsdpConfig { reason };
    if world == 0 {
        return Err(bad("the world size must be at least 1".into()));
    }
    if config.limit_all_gathers == Some(0) {
        return Err(bad("limit_all_gathers must be at least 1 (or None)".into()));
    }
    if batch_per_rank == 0 || seq == 0 || seq > cfg.block_size {
        return Err(bad(format!(
            "a batch of {batch_per_rank} rows of {seq} tokens (block size {})",
            cfg.block_size
        )));
    }
    if units.units.is_empty() {
        return Err(FsdpError::InvalidPlan {
            reason: "the plan has no unit".into(),
        });
    }
    let strategy = config.strategy;
    let (factor, replicas) = match strategy {
        ShardingStrategy::FullShard | ShardingStrategy::ShardGradOp => (world, 1),
        ShardingStrategy::NoShard => (1, world),
        ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2 => {
            let per_node = config.ranks_per_node.unwrap_or(world);
            if per_node == 0 || world % per_node != 0 {
                return Err(bad(format!(
                    "ranks_per_node {per_node} does not divide the world size {world}"
                )));
            }
            (per_node, world / per_node)
        }
    };

    // Units (ignored parameters: a last unsharded unit, all-reduced over the world).
    let mut names: Vec<String> = units
        .units
        .iter()
        .map(|u| {
            if u.name.is_empty() {
                "(root)".to_string()
            } else {
                u.name.clone()
            }
        })
        .collect();
    let mut numel: Vec<usize> = units.units.iter().map(|u| u.numel()).collect();
    let mut factors = vec![factor; numel.len()];
    let mut replicated_all = vec![false; numel.len()];
    if !units.ignored.is_empty() {
        names.push("(ignored)".into());
        numel.push(units.ignored.iter().map(|p| p.numel()).sum());
        factors.push(1);
        replicated_all.push(true);
    }
    let n = numel.len();
    let padded: Vec<usize> = (0..n)
        .map(|u| numel[u].next_multiple_of(factors[u]))
        .collect();
    let owner = |name: &str| -> Result<usize, FsdpError> {
        if let Some(u) = units.unit_of(name) {
            return Ok(u);
        }
        if units.ignored.iter().any(|p| p.name == name) {
            return Ok(units.units.len());
        }
        Err(FsdpError::InvalidPlan {
            reason: format!("parameter `{name}` is in no unit"),
        })
    };

    // Stages (embed, blocks, head + tied wte) and the units they read.
    let mut stage_names: Vec<Vec<String>> =
        vec![embed_param_specs(cfg).into_iter().map(|p| p.name).collect()];
    for l in 0..cfg.n_layer {
        stage_names.push(
            block_param_specs(cfg, l)
                .into_iter()
                .map(|p| p.name)
                .collect(),
        );
    }
    let mut head: Vec<String> = head_param_specs(cfg).into_iter().map(|p| p.name).collect();
    head.push("transformer.wte.weight".into());
    stage_names.push(head);
    let mut stage_units = Vec::with_capacity(stage_names.len());
    for ns in &stage_names {
        let mut us = ns.iter().map(|s| owner(s)).collect::<Result<Vec<_>, _>>()?;
        us.sort_unstable();
        us.dedup();
        stage_units.push(us);
    }
    let n_stages = stage_units.len();
    let mut first_stage = vec![usize::MAX; n];
    let mut last_stage = vec![0; n];
    for (s, us) in stage_units.iter().enumerate() {
        for &u in us {
            first_stage[u] = first_stage[u].min(s);
            last_stage[u] = s;
        }
    }

    // Collective counts per step, as the runtime issues them.
    let shard_group = factor > 1;
    let rows: Vec<UnitPlanRow> = (0..n)
        .map(|u| {
            let sharded = factors[u] > 1 && shard_group;
            let ar_group = if replicated_all[u] { world } else { replicas };
            let shard_numel = padded[u] / factors[u];
            UnitPlanRow {
                unit: u,
                name: names[u].clone(),
                params: numel[u],
                factor: factors[u],
                shard_numel,
                shard_bytes: if sharded { shard_numel as u64 * 4 } else { 0 },
                all_reduce_bytes: if ar_group > 1 {
                    shard_numel as u64 * 4
                } else {
                    0
                },
                forward_all_gathers: usize::from(sharded),
                backward_all_gathers: usize::from(
                    sharded && u != 0 && strategy.reshard_after_forward(),
                ),
                reduce_scatters: usize::from(sharded),
                all_reduces: usize::from(ar_group > 1),
            }
        })
        .collect();

    // Replay two steps of the runtime's allocations.
    let sharded_state: u64 = (0..n).map(|u| 2 * buf(padded[u] / factors[u])).sum();
    let mut sim = Sim {
        padded: &padded,
        factor: &factors,
        config,
        units: vec![SimUnit::default(); n],
        in_flight: 0,
        forward: true,
        issued: 0,
        pending: Vec::new(),
        params: 0,
        grads: 0,
        peak: (0, 0, 0),
        base: sharded_state,
    };
    for step in 0..2 {
        sim.forward = true;
        for s in 0..n_stages {
            for &u in &stage_units[s] {
                sim.gather(u);
            }
            if config.forward_prefetch && step > 0 {
                if let Some(next) = stage_units.get(s + 1) {
                    for &u in next {
                        sim.prefetch(u);
                    }
                }
            }
            sim.wait(&stage_units[s]);
            if strategy.reshard_after_forward() {
                for &u in &stage_units[s] {
                    if u != 0 && last_stage[u] == s {
                        sim.free(u);
                    }
                }
            }
        }
        sim.forward = false;
        for s in (0..n_stages).rev() {
            for &u in &stage_units[s] {
                sim.gather(u);
            }
            if config.backward_prefetch == BackwardPrefetch::Pre && s > 0 {
                for &u in &stage_units[s - 1] {
                    sim.prefetch(u);
                }
            }
            sim.wait(&stage_units[s]);
            for &u in &stage_units[s] {
                if !sim.units[u].grad {
                    sim.units[u].grad = true;
                    if factors[u] > 1 {
                        sim.grads += buf(padded[u]);
                    }
                }
            }
            sim.note();
            let done: Vec<usize> = stage_units[s]
                .iter()
                .copied()
                .filter(|&u| first_stage[u] == s)
                .collect();
            for &u in &done {
                sim.free(u);
            }
            if config.backward_prefetch == BackwardPrefetch::Post && s > 0 {
                for &u in &stage_units[s - 1] {
                    sim.prefetch(u);
                }
            }
            for &u in &done {
                sim.reduce(u);
            }
        }
        sim.grads -= sim.pending.iter().map(|p| p.0).sum::<u64>();
        sim.pending.clear();
    }
    let (peak, params_peak, grads_peak) = sim.peak;

    // Host memory: AdamW state of the shards, and the activations at the end of forward.
    let optimizer_state: u64 = (0..n).map(|u| 8 * (padded[u] / factors[u]) as u64).sum();
    let (b, t, e, h, v) = (
        batch_per_rank as u64,
        seq as u64,
        cfg.n_embd as u64,
        cfg.n_head as u64,
        cfg.vocab_size as u64,
    );
    let tokens = b * t;
    let per_block = 16 * tokens * e + 4 * tokens + b * h * t * t;
    let head_cache = 2 * tokens * e + 2 * tokens + tokens * v + tokens;
    let activations = 4 * (cfg.n_layer as u64 * per_block + head_cache + tokens * e);

    let mem = RankMemory {
        sharded_state: sim.base,
        unsharded_params: params_peak,
        unsharded_grads: grads_peak,
        peak_allocated: sim.base + peak,
        optimizer_state,
        activations,
    };
    Ok(MemoryPlan {
        strategy,
        world,
        factor,
        replicas,
        units: rows,
        loss_all_reduces: usize::from(world > 1),
        per_rank: vec![mem; world],
    })
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "strategy {:?}, world {}, sharding factor F = {}, replicas {}",
            self.strategy, self.world, self.factor, self.replicas
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "{:>4}  {:<24} {:>12} {:>3} {:>14} {:>14}  {:>6} {:>6} {:>3} {:>3}",
            "unit",
            "name",
            "params",
            "F",
            "AG/RS bytes",
            "AR bytes",
            "fwd AG",
            "bwd AG",
            "RS",
            "AR"
        )?;
        for u in &self.units {
            writeln!(
                f,
                "{:>4}  {:<24} {:>12} {:>3} {:>14} {:>14}  {:>6} {:>6} {:>3} {:>3}",
                u.unit,
                u.name,
                u.params,
                u.factor,
                u.shard_bytes,
                u.all_reduce_bytes,
                u.forward_all_gathers,
                u.backward_all_gathers,
                u.reduce_scatters,
                u.all_reduces
            )?;
        }
        let (fa, ba, rs, ar) = self.collective_counts();
        writeln!(
            f,
            "{:>4}  {:<24} {:>12} {:>3} {:>14} {:>14}  {fa:>6} {ba:>6} {rs:>3} {ar:>3}",
            "",
            "total per step",
            self.units.iter().map(|u| u.params).sum::<usize>(),
            "",
            "",
            ""
        )?;
        writeln!(
            f,
            "plus {} loss all-reduce(s) of 4 bytes per step",
            self.loss_all_reduces
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "{:>4}  {:>14} {:>14} {:>14} {:>16} | {:>14} {:>14}",
            "rank",
            "sharded state",
            "unsharded",
            "gradients",
            "peak allocated",
            "optimizer",
            "activations"
        )?;
        for (r, m) in self.per_rank.iter().enumerate() {
            writeln!(
                f,
                "{r:>4}  {:>14} {:>14} {:>14} {:>16} | {:>14} {:>14}",
                human(m.sharded_state),
                human(m.unsharded_params),
                human(m.unsharded_grads),
                human(m.peak_allocated),
                human(m.optimizer_state),
                human(m.activations)
            )?;
        }
        writeln!(
            f,
            "(peak allocated: the caching allocator's bytes: parameter and gradient shards, \
             unsharded parameters and gradients at the peak, 512-byte rounding; optimizer state \
             (AdamW) and activations (estimate) are host memory outside the allocator)"
        )
    }
}
