//! Memory and communication plan of an FSDP configuration, from a dry run of the engine
//! itself.
//!
//! [`plan`] builds the real [`Fsdp`] engine for every rank over a dry-run communicator
//! ([`fsdp_collectives::dryrun`]: argument checks, no data, completes at once) and a caching
//! allocator over the meta device ([`fsdp_allocator::MetaSource`]: sizes and addresses, no
//! bytes), and runs two training steps of hooks over the model's [`Span`]s (the second with the
//! execution order recorded in the first) with an optimizer step after each. The allocator's
//! peak is therefore exactly the peak a real run reaches: same allocations, same frees, same
//! order, same rounding and caching. The plan lists per unit the parameter count, the per-rank
//! payload of each collective and the number of collectives of the second step (read from the
//! engine's schedule), and per rank the peak of the allocator's bytes with its breakdown. The
//! optimizer state (AdamW: two `f32` per shard element) lives in plain host memory and is
//! reported separately; so are the activations, which only the model can estimate
//! ([`MemoryPlan::with_activations`]).

use std::fmt;
use std::sync::Arc;

use fsdp_allocator::{AllocatorConfig, MetaAllocator, MetaSource};
use fsdp_collectives::dryrun::{dry_run_mesh, DryRunCommunicator};

use crate::engine::{
    Fsdp, FsdpConfig, ParamInit, Phase, ProcessGroups, ScheduleKind, ShardingStrategy, Span,
};
use crate::optim::AdamWConfig;
use crate::units::UnitPlan;
use crate::FsdpError;

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
    /// Activations kept for backward in host memory (the model's estimate, see
    /// [`MemoryPlan::with_activations`]; 0 when none was given).
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

    /// The plan with every rank's activation estimate set to `bytes` (the model's estimate of
    /// what its forward keeps for backward).
    pub fn with_activations(mut self, bytes: u64) -> Self {
        for m in &mut self.per_rank {
            m.activations = bytes;
        }
        self
    }
}

/// Plan `config` for a model whose units are `units` and whose compute spans are `spans`, at
/// `world` ranks (see the [module](self) documentation).
///
/// # Errors
/// [`FsdpError::InvalidPlan`] for a plan without units or a span reading an unknown
/// parameter; [`FsdpError::InvalidFsdpConfig`] for a world of 0, a `ranks_per_node` that does
/// not divide the world, a limit of 0; the engine's errors (an allocation beyond
/// [`FsdpConfig::memory_capacity`] is an out-of-memory error, as it would be in training).
pub fn plan(
    units: &UnitPlan,
    spans: &[Span],
    world: usize,
    config: &FsdpConfig,
) -> Result<MemoryPlan, FsdpError> {
    let bad = |reason: String| FsdpError::InvalidFsdpConfig { reason };
    if world == 0 {
        return Err(bad("the world size must be at least 1".into()));
    }
    let strategy = config.strategy;
    let per_node = match strategy {
        ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2 => {
            let per_node = config.ranks_per_node.unwrap_or(world);
            if per_node == 0 || world % per_node != 0 {
                return Err(bad(format!(
                    "ranks_per_node {per_node} does not divide the world size {world}"
                )));
            }
            Some(per_node)
        }
        _ => None,
    };
    let mut per_rank = Vec::with_capacity(world);
    let mut rows = Vec::new();
    let mut factor = 1;
    let mut replicas = 1;
    for rank in 0..world {
        let comm = DryRunCommunicator::new(rank, world)?;
        let mesh = match per_node {
            Some(n) => Some(dry_run_mesh(rank, world / n, n)?),
            None => None,
        };
        let groups = ProcessGroups::with_mesh(Box::new(comm), strategy, mesh);
        let pool = MetaAllocator::new(
            MetaSource::new(config.memory_capacity),
            AllocatorConfig::default(),
        )?;
        let mut fsdp = Fsdp::with_parts(
            groups,
            Arc::new(pool),
            units,
            ParamInit::Meta,
            *config,
            AdamWConfig::default().into(),
        )?;
        let sharded_state = fsdp.memory_stats().allocated_bytes.all.current;
        for _ in 0..2 {
            fsdp.dry_run_pass(spans)?;
            fsdp.optimizer_step()?;
        }
        let peak = fsdp.memory_stats().allocated_bytes.all.peak;
        let (sampled, params) = fsdp.ctx.peak_sample;
        let unsharded_params = if sampled == peak { params } else { 0 };
        per_rank.push(RankMemory {
            sharded_state,
            unsharded_params,
            unsharded_grads: peak.saturating_sub(sharded_state + unsharded_params),
            peak_allocated: peak,
            optimizer_state: fsdp
                .param_groups()
                .iter()
                .map(|g| 8 * g.layout().shard_numel() as u64)
                .sum(),
            activations: 0,
        });
        if rank == 0 {
            factor = fsdp.sharding_factor();
            replicas = fsdp
                .process_groups()
                .replicate()
                .map_or(1, |g| g.world_size());
            rows = unit_rows(&fsdp);
        }
    }
    Ok(MemoryPlan {
        strategy,
        world,
        factor,
        replicas,
        units: rows,
        loss_all_reduces: usize::from(world > 1),
        per_rank,
    })
}

/// Per-unit rows from the engine's layouts and the schedule of its last step.
fn unit_rows(fsdp: &Fsdp) -> Vec<UnitPlanRow> {
    let step = fsdp.steps();
    let count = |u: usize, phase: Option<Phase>, kind: ScheduleKind| {
        fsdp.schedule()
            .iter()
            .filter(|e| e.step == step && e.unit == u && e.kind == kind)
            .filter(|e| phase.is_none_or(|p| e.phase == p))
            .count()
    };
    fsdp.param_groups()
        .iter()
        .enumerate()
        .map(|(u, g)| {
            let l = g.layout();
            let shard_bytes = l.shard_numel() as u64 * 4;
            let all_reduces = count(u, None, ScheduleKind::AllReduce);
            UnitPlanRow {
                unit: u,
                name: if g.name().is_empty() {
                    "(root)".to_string()
                } else {
                    g.name().to_string()
                },
                params: l.unpadded_numel(),
                factor: g.factor(),
                shard_numel: l.shard_numel(),
                shard_bytes: if g.factor() > 1 { shard_bytes } else { 0 },
                all_reduce_bytes: if all_reduces > 0 { shard_bytes } else { 0 },
                forward_all_gathers: count(u, Some(Phase::Forward), ScheduleKind::AllGather),
                backward_all_gathers: count(u, Some(Phase::Backward), ScheduleKind::AllGather),
                reduce_scatters: count(u, None, ScheduleKind::ReduceScatter),
                all_reduces,
            }
        })
        .collect()
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
             (AdamW) and activations (the model's estimate) are host memory outside the allocator)"
        )
    }
}
