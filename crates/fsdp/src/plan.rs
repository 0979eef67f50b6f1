//! Memory and communication plan of an FSDP configuration, from a dry run of the engine
//! itself.
//!
//! [`plan`] builds the real [`Fsdp`] engine of a rank over a dry-run communicator
//! ([`fsdp_collectives::dryrun`]: argument checks, no data, completes at once) and a caching
//! allocator over the meta device ([`fsdp_allocator::MetaSource`]: sizes and addresses, no
//! bytes), and runs two training steps of hooks over the model's [`Span`]s (the second with the
//! execution order recorded in the first) with an optimizer step after each. The allocator's
//! peak is therefore exactly the peak a real run reaches: same allocations, same frees, same
//! order, same rounding and caching (the reserved peak too, when the allocator's capacity is
//! the real run's). The plan lists per unit the parameter count, the per-rank
//! payload of each collective and the number of collectives of the second step (read from the
//! engine's schedule), and per rank the peaks of the allocator's bytes with their breakdown.
//! [`plan_accumulated`] plans steps of several micro-batches accumulated under `no_sync`. The
//! optimizer state (AdamW: two `f32` per shard element) lives in plain host memory and is
//! reported separately; so are the activations (host vectors of the model's tape), which the
//! dry run counts when the model declares per span what its forward and backward hold
//! ([`plan_with_activations`], [`SpanActivations`]; activation checkpointing included, see
//! [`crate::engine::checkpointing`]): their peak, and the peak of the allocator's bytes plus the
//! activations held at the same moment, are then a real run's
//! ([`Fsdp::activation_stats`]), byte for byte.
//!
//! The dry run is of **rank 0 only**, and its figures are every rank's: the plan is exact for
//! all ranks because every rank holds equal-sized shards (a flat parameter is padded to a
//! multiple of the sharding factor; unsharded units are whole on every rank) and runs the same
//! schedule (the same hooks in the same order, the same collectives with the same sizes, the
//! same allocator decisions, which never depend on addresses). A plan therefore costs the same
//! at 4 ranks as at 100 000, and holds nothing per rank but the [`MemoryPlan::per_rank`] vector.
//!
//! [`available_memory`] tells how much memory this process may still take (the smaller of
//! `/proc/meminfo`'s `MemAvailable` and the cgroup limits), to compare with a plan's
//! [`RankMemory::total`].

mod available;

use std::fmt;
use std::sync::Arc;

use fsdp_allocator::{MetaAllocator, MetaSource};
use fsdp_collectives::dryrun::{dry_run_mesh, DryRunCommunicator};

use crate::engine::{
    ComputeDevice, Fsdp, FsdpConfig, ParamInit, Phase, ProcessGroups, ScheduleKind,
    ShardingStrategy, Span, SpanActivations,
};
use crate::optim::{AdamWConfig, OptimizerConfig};
use crate::units::UnitPlan;
use crate::{human_bytes, try_filled_vec, FsdpError};

pub use available::{
    available_memory, available_memory_from, cgroup_headroom, parse_cgroup_paths,
    parse_meminfo_available, AvailableMemory, CgroupPaths, CgroupVersion,
};

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
    /// Per-rank payload in bytes of an all-gather (`shard_numel` × the size of `param_dtype`;
    /// 0 when the unit is not sharded).
    pub shard_bytes: u64,
    /// Per-rank payload in bytes of a reduce-scatter (`shard_numel` × the size of
    /// `reduce_dtype`; 0 when the unit is not sharded).
    pub reduce_scatter_bytes: u64,
    /// Per-rank payload in bytes of the gradient all-reduce, in `reduce_dtype` (0 when there is
    /// none).
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
    /// Predicted peak of the allocator's reserved bytes (its segments: what it takes from the
    /// system, at least `peak_allocated`).
    pub peak_reserved: u64,
    /// Optimizer state in host memory (AdamW: `exp_avg` and `exp_avg_sq` of the shards).
    pub optimizer_state: u64,
    /// The peak of the activations kept for backward in host memory (the model's tape: the
    /// dry run's count from the spans' declarations, [`plan_with_activations`], which a run
    /// measures as [`ActivationStats::peak`](crate::engine::ActivationStats::peak); or an
    /// estimate given to [`MemoryPlan::with_activations`]; 0 when none was given).
    pub activations: u64,
    /// Predicted peak of the allocator's allocated bytes plus the activations held at the same
    /// moment ([`ActivationStats::peak_allocated`](crate::engine::ActivationStats)): the
    /// rank's peak allocated memory including activations (`peak_allocated` when no
    /// activations were declared).
    pub peak_allocated_with_activations: u64,
}

impl RankMemory {
    /// The rank's predicted memory: the allocator's reserved peak, the optimizer state and the
    /// activations; `None` if the sum overflows `u64`.
    pub fn total(&self) -> Option<u64> {
        self.peak_reserved
            .checked_add(self.optimizer_state)?
            .checked_add(self.activations)
    }
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
    /// Spans recomputed per pass (activation checkpointing; 0 when off).
    pub recomputed_spans: usize,
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
    /// what its forward keeps for backward), and the peak allocated with activations bounded
    /// by `peak_allocated + bytes` (an estimate does not say when it is held; prefer
    /// [`plan_with_activations`], which counts both exactly).
    pub fn with_activations(mut self, bytes: u64) -> Self {
        for m in &mut self.per_rank {
            m.activations = bytes;
            m.peak_allocated_with_activations = m.peak_allocated.saturating_add(bytes);
        }
        self
    }
}

/// Plan `config` for a model whose units are `units` and whose compute spans are `spans`, at
/// `world` ranks (see the [module](self) documentation): one micro-batch per step.
///
/// # Errors
/// [`FsdpError::InvalidPlan`] for a plan without units or a span reading an unknown
/// parameter; [`FsdpError::InvalidFsdpConfig`] for a world of 0, a `ranks_per_node` that does
/// not divide the world, a limit of 0, sizes that overflow `u64`; the engine's errors (an
/// allocation beyond [`FsdpConfig::memory_capacity`] is an out-of-memory error, as it would be
/// in training); [`FsdpError::HostOutOfMemory`] when even the per-rank vector of an absurd
/// world size cannot be allocated.
pub fn plan(
    units: &UnitPlan,
    spans: &[Span],
    world: usize,
    config: &FsdpConfig,
) -> Result<MemoryPlan, FsdpError> {
    plan_accumulated(units, spans, world, config, 1)
}

/// [`plan`] with `micro_batches` micro-batches per optimizer step, gradients accumulated under
/// [`no_sync`](Fsdp::no_sync) as a training loop does (all but the last micro-batch): each
/// unit then holds an unsharded gradient between the passes, which the plan includes. Three
/// passes per step are enough to reach the peak of any number of micro-batches (the first
/// under `no_sync`, a later one under `no_sync` that starts with the gradients held, and the
/// reducing one); further ones repeat the second.
///
/// # Errors
/// As [`plan`]; [`FsdpError::InvalidFsdpConfig`] for 0 micro-batches.
pub fn plan_accumulated(
    units: &UnitPlan,
    spans: &[Span],
    world: usize,
    config: &FsdpConfig,
    micro_batches: usize,
) -> Result<MemoryPlan, FsdpError> {
    plan_with_activations(units, spans, &[], world, config, micro_batches)
}

/// [`plan_accumulated`] of a model that declares its activations: `activations` holds one
/// [`SpanActivations`] per span (what its forward and backward add to the tape, and what a
/// checkpointed span drops and recomputes), or is empty (no activations counted). The dry run
/// applies them where a real pass measures its tape, with the spans of the units that
/// [`FsdpConfig::activation_checkpointing`] checkpoints run as checkpointed (a span whose
/// `recomputable` is `None` never is, so declaring `None` leaves a span out): the plan's
/// [`RankMemory::activations`] and [`RankMemory::peak_allocated_with_activations`] are then a
/// real run's figures.
///
/// # Errors
/// As [`plan_accumulated`]; [`FsdpError::InvalidFsdpConfig`] when `activations` is neither
/// empty nor one per span, or when the declared bytes go below 0 or above `u64::MAX`.
pub fn plan_with_activations(
    units: &UnitPlan,
    spans: &[Span],
    activations: &[SpanActivations],
    world: usize,
    config: &FsdpConfig,
    micro_batches: usize,
) -> Result<MemoryPlan, FsdpError> {
    let adamw = AdamWConfig::default().into();
    plan_with_optimizer(
        units,
        spans,
        activations,
        world,
        config,
        micro_batches,
        &adamw,
    )
}

/// [`plan_with_activations`] with the run's optimizer: its state's bytes per shard element
/// ([`OptimizerConfig::state_bytes_per_element`]) give [`RankMemory::optimizer_state`], and
/// under AnyPrecisionAdamW the shards are held in `param_dtype` (see
/// [`Fsdp`]), which the allocator figures show.
///
/// # Errors
/// As [`plan_with_activations`]; an invalid optimizer configuration.
#[allow(clippy::too_many_arguments)]
pub fn plan_with_optimizer(
    units: &UnitPlan,
    spans: &[Span],
    activations: &[SpanActivations],
    world: usize,
    config: &FsdpConfig,
    micro_batches: usize,
    optim: &OptimizerConfig,
) -> Result<MemoryPlan, FsdpError> {
    let bad = |reason: String| FsdpError::InvalidFsdpConfig { reason };
    if micro_batches == 0 {
        return Err(bad("a step needs at least one micro-batch".into()));
    }
    let strategy = config.strategy;
    let (mut fsdp, _) = dry_run_engine(units, world, config, optim)?;
    let sharded_state = fsdp.memory_stats().allocated_bytes.all.current;
    let passes = micro_batches.min(3);
    for _ in 0..2 {
        for m in 0..passes {
            if m + 1 < passes {
                fsdp.no_sync(|f| f.dry_run_pass_with(spans, activations))?;
            } else {
                fsdp.dry_run_pass_with(spans, activations)?;
            }
        }
        fsdp.optimizer_step()?;
    }
    let stats = fsdp.memory_stats();
    let act = fsdp.activation_stats();
    let passes_run = 2 * passes as u64;
    let recomputed_spans = usize::try_from(act.recomputations / passes_run).unwrap_or(usize::MAX);
    let peak = stats.allocated_bytes.all.peak;
    let (sampled, params) = fsdp.ctx.peak_sample;
    let unsharded_params = if sampled == peak { params } else { 0 };
    let overflow = |what: &str| bad(format!("the {what} overflows u64"));
    // The optimizer's state per shard element (AdamW: exp_avg and exp_avg_sq, 4 bytes each).
    let per_element = optim.state_bytes_per_element() as u64;
    let optimizer_state = fsdp
        .param_groups()
        .iter()
        .try_fold(0u64, |acc, g| {
            (g.layout().shard_numel() as u64)
                .checked_mul(per_element)
                .and_then(|b| acc.checked_add(b))
        })
        .ok_or_else(|| overflow("optimizer state's size"))?;
    let unsharded_grads = sharded_state
        .checked_add(unsharded_params)
        .map(|held| peak.saturating_sub(held))
        .ok_or_else(|| overflow("memory breakdown"))?;
    let memory = RankMemory {
        sharded_state,
        unsharded_params,
        unsharded_grads,
        peak_allocated: peak,
        peak_reserved: stats.reserved_bytes.all.peak,
        optimizer_state,
        activations: act.peak,
        peak_allocated_with_activations: act.peak_allocated,
    };
    let factor = fsdp.sharding_factor();
    let replicas = fsdp
        .process_groups()
        .replicate()
        .map_or(1, |g| g.world_size());
    let rows = unit_rows(&fsdp);
    drop(fsdp);
    Ok(MemoryPlan {
        strategy,
        world,
        factor,
        replicas,
        units: rows,
        loss_all_reduces: usize::from(world > 1),
        per_rank: try_filled_vec(world, memory, "the plan's per-rank memory")?,
        recomputed_spans,
    })
}

/// The engine of rank 0 of `world` ranks over a dry-run communicator, its buffers from a
/// caching allocator over the meta device (sizes and addresses, no bytes) — the engine
/// [`plan_with_optimizer`] runs — and a handle to that allocator: a model that drives the
/// engine's hooks itself (`pre_forward`, `param_views`, …) runs its passes on it at no cost
/// and, by taking its own buffers from the same allocator (e.g. on a stream of its own), gets
/// the peak of the engine's buffers and its own together. The parameters are
/// [`ParamInit::Meta`]: views of them hold no values.
///
/// # Errors
/// As [`plan_with_optimizer`].
pub fn dry_run_engine(
    units: &UnitPlan,
    world: usize,
    config: &FsdpConfig,
    optim: &OptimizerConfig,
) -> Result<(Fsdp, MetaAllocator), FsdpError> {
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
    // Rank 0 stands for every rank (see the module documentation).
    let rank = 0;
    let comm = DryRunCommunicator::new(rank, world)?;
    let mesh = match per_node {
        Some(n) => Some(dry_run_mesh(rank, world / n, n)?),
        None => None,
    };
    let groups = ProcessGroups::with_mesh(Box::new(comm), strategy, mesh);
    let pool = MetaAllocator::new(MetaSource::new(config.memory_capacity), config.allocator)?;
    let fsdp = Fsdp::with_parts(
        groups,
        Arc::new(pool.clone()),
        units,
        ParamInit::Meta,
        *config,
        *optim,
    )?;
    Ok((fsdp, pool))
}

/// What [`dry_run_engine_on_device`] builds: the engine on a dry-run device and its two
/// caching allocators over the meta device.
pub struct DeviceDryRun {
    /// The engine, placed on the dry-run device.
    pub fsdp: Fsdp,
    /// The device's allocator: the engine's working set, and its shards, gradient shards and
    /// optimizer state unless offloaded.
    pub device: MetaAllocator,
    /// The host's allocator ([`dry_run_engine`]'s): the shards and gradient shards as the
    /// engine builds them before it places them (freed to its cache then), and offloaded ones
    /// throughout. The optimizer state of offloaded shards is plain host memory, outside it
    /// (and empty in a dry run: [`ParamGroup::optimizer_state_bytes`] of a real run).
    ///
    /// [`ParamGroup::optimizer_state_bytes`]: crate::engine::ParamGroup::optimizer_state_bytes
    pub host: MetaAllocator,
}

impl fmt::Debug for DeviceDryRun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceDryRun")
            .field("units", &self.fsdp.num_units())
            .finish_non_exhaustive()
    }
}

/// [`dry_run_engine`] on a device ([`Fsdp::new_on`]): the engine's device path run dry — its
/// buffers on the device from a caching allocator over the meta device, its host buffers
/// (shards before they are placed, offloaded shards, host copies) from [`dry_run_engine`]'s —
/// as on a GPU whose work keeps up with the host. What the device path copies to the host
/// reads as zeros (a norm of 0, finite losses), and its operations allocate the temporaries
/// the CUDA device's allocate. With the shards on the device the optimizer's moments are
/// placed there at their sizes (the host state of a dry run stays empty).
///
/// # Errors
/// As [`dry_run_engine`].
pub fn dry_run_engine_on_device(
    units: &UnitPlan,
    world: usize,
    config: &FsdpConfig,
    optim: &OptimizerConfig,
) -> Result<DeviceDryRun, FsdpError> {
    let (fsdp, host) = dry_run_engine(units, world, config, optim)?;
    let device = MetaAllocator::new(MetaSource::new(config.memory_capacity), config.allocator)?;
    let fsdp = fsdp.placed_on(ComputeDevice::dry_run(Arc::new(device.clone())))?;
    Ok(DeviceDryRun { fsdp, device, host })
}

/// Per-unit rows from the engine's layouts and the schedule of its last step.
fn unit_rows(fsdp: &Fsdp) -> Vec<UnitPlanRow> {
    let step = fsdp.steps();
    // One pass over the schedule: per unit (forward all-gathers, backward all-gathers,
    // reduce-scatters, all-reduces) of the last step.
    let mut counts = vec![[0usize; 4]; fsdp.param_groups().len()];
    for e in fsdp.schedule().iter().filter(|e| e.step == step) {
        let Some(c) = counts.get_mut(e.unit) else {
            continue;
        };
        match (e.kind, e.phase) {
            (ScheduleKind::AllGather, Phase::Forward) => c[0] += 1,
            (ScheduleKind::AllGather, Phase::Backward) => c[1] += 1,
            (ScheduleKind::ReduceScatter, _) => c[2] += 1,
            (ScheduleKind::AllReduce, _) => c[3] += 1,
            (ScheduleKind::Free, _) => {}
        }
    }
    fsdp.param_groups()
        .iter()
        .zip(counts)
        .enumerate()
        .map(|(u, (g, [fwd, bwd, rs, ar]))| {
            let l = g.layout();
            let n = l.shard_numel() as u64;
            let shard_bytes = n.saturating_mul(g.dtypes().param.size_in_bytes() as u64);
            let reduce_bytes = n.saturating_mul(g.dtypes().reduce.size_in_bytes() as u64);
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
                reduce_scatter_bytes: if g.factor() > 1 { reduce_bytes } else { 0 },
                all_reduce_bytes: if ar > 0 { reduce_bytes } else { 0 },
                forward_all_gathers: fwd,
                backward_all_gathers: bwd,
                reduce_scatters: rs,
                all_reduces: ar,
            }
        })
        .collect()
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
            "{:>4}  {:<24} {:>12} {:>3} {:>11} {:>11} {:>11}  {:>6} {:>6} {:>3} {:>3}",
            "unit",
            "name",
            "params",
            "F",
            "AG bytes",
            "RS bytes",
            "AR bytes",
            "fwd AG",
            "bwd AG",
            "RS",
            "AR"
        )?;
        for u in &self.units {
            writeln!(
                f,
                "{:>4}  {:<24} {:>12} {:>3} {:>11} {:>11} {:>11}  {:>6} {:>6} {:>3} {:>3}",
                u.unit,
                u.name,
                u.params,
                u.factor,
                u.shard_bytes,
                u.reduce_scatter_bytes,
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
            "{:>4}  {:<24} {:>12} {:>3} {:>11} {:>11} {:>11}  {fa:>6} {ba:>6} {rs:>3} {ar:>3}",
            "",
            "total per step",
            self.units
                .iter()
                .fold(0usize, |a, u| a.saturating_add(u.params)),
            "",
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
            "{:>11}  {:>13} {:>10} {:>10} {:>14} {:>13} | {:>10} {:>11} | {:>10}",
            "ranks",
            "sharded state",
            "unsharded",
            "gradients",
            "peak allocated",
            "peak reserved",
            "optimizer",
            "activations",
            "total"
        )?;
        // Consecutive ranks with equal figures share a row (all of them, as planned).
        let mut first = 0;
        while first < self.per_rank.len() {
            let m = &self.per_rank[first];
            let last = first
                + self.per_rank[first..]
                    .iter()
                    .take_while(|n| *n == m)
                    .count()
                - 1;
            let ranks = if last == first {
                first.to_string()
            } else {
                format!("{first}-{last}")
            };
            writeln!(
                f,
                "{ranks:>11}  {:>13} {:>10} {:>10} {:>14} {:>13} | {:>10} {:>11} | {:>10}",
                human_bytes(m.sharded_state),
                human_bytes(m.unsharded_params),
                human_bytes(m.unsharded_grads),
                human_bytes(m.peak_allocated),
                human_bytes(m.peak_reserved),
                human_bytes(m.optimizer_state),
                human_bytes(m.activations),
                m.total()
                    .map_or_else(|| "overflow".to_string(), human_bytes)
            )?;
            first = last + 1;
        }
        writeln!(
            f,
            "(per rank; peak allocated: the caching allocator's bytes: parameter and gradient \
             shards, unsharded parameters and gradients at the peak, 512-byte rounding; peak \
             reserved: its segments; the optimizer's state and activations (the peak of \
             the model's saved activations, its tape) are host memory outside the allocator; \
             total: reserved + optimizer + activations)"
        )?;
        if let Some(m) = self.per_rank.first().filter(|m| m.activations > 0) {
            writeln!(
                f,
                "activations: peak {} per rank{}; peak allocated with activations {} (the \
                 allocator's bytes plus the activations held at the same moment)",
                human_bytes(m.activations),
                if self.recomputed_spans > 0 {
                    format!(
                        " with activation checkpointing ({} spans recomputed per pass, no \
                         extra collective)",
                        self.recomputed_spans
                    )
                } else {
                    String::new()
                },
                human_bytes(m.peak_allocated_with_activations)
            )?;
        }
        Ok(())
    }
}
