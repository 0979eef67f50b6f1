//! One rank of FSDP training of the reference GPT.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut, Range};

use fsdp_allocator::{AllocatorConfig, HostAllocator, HostSource, MemoryStats};
use fsdp_collectives::{mesh_2d, Communicator, HybridMesh, ReduceOp, Work};
use fsdp_device::{Buffer, DType, Stream};
use fsdp_flatparam::FlatParamLayout;

use super::{BackwardPrefetch, FsdpConfig, Phase, ScheduleEvent, ScheduleKind, ShardingStrategy};
use crate::data::Batch;
use crate::model::{
    self, block_param_specs, embed_param_specs, head_param_specs, param_specs, BlockCache,
    GptConfig, Grads, HeadCache, Params,
};
use crate::optim::{AdamWConfig, AdamWState};
use crate::units::UnitPlan;
use crate::FsdpError;

const WTE: &str = "transformer.wte.weight";

/// The process groups of a rank.
struct Groups {
    strategy: ShardingStrategy,
    world: Box<dyn Communicator>,
    mesh: Option<HybridMesh>,
}

impl Groups {
    /// The group parameters are sharded over, when it has more than one rank.
    fn shard(&self) -> Option<&dyn Communicator> {
        let g: &dyn Communicator = match self.strategy {
            ShardingStrategy::FullShard | ShardingStrategy::ShardGradOp => self.world.as_ref(),
            ShardingStrategy::NoShard => return None,
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2 => {
                self.mesh.as_ref()?.shard.as_ref()
            }
        };
        (g.world_size() > 1).then_some(g)
    }

    /// The group a shard is replicated over (gradients all-reduced), when it has more than one
    /// rank.
    fn replicate(&self) -> Option<&dyn Communicator> {
        let g: &dyn Communicator = match self.strategy {
            ShardingStrategy::FullShard | ShardingStrategy::ShardGradOp => return None,
            ShardingStrategy::NoShard => self.world.as_ref(),
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2 => {
                self.mesh.as_ref()?.replicate.as_ref()
            }
        };
        (g.world_size() > 1).then_some(g)
    }

    fn world_multi(&self) -> Option<&dyn Communicator> {
        (self.world.world_size() > 1).then_some(self.world.as_ref())
    }
}

/// One flat parameter on this rank.
struct Unit {
    layout: FlatParamLayout,
    /// Parameter name → element range in the unsharded flat buffer.
    index: HashMap<String, Range<usize>>,
    /// The sharding factor of the unit (1: never gathered, the shard is the whole parameter).
    factor: usize,
    /// Ignored parameters: replicated on every rank, gradients all-reduced over the world.
    replicated_all: bool,
    /// The rank's `f32` shard (padding included).
    shard: Buffer,
    /// The rank's reduced gradient shard (for `factor == 1`: the accumulation buffer itself).
    grad_shard: Buffer,
    adam: AdamWState,
    /// The unsharded parameters while gathered (for `factor == 1`: always the shard).
    full: Option<Buffer>,
    /// The all-gather filling `full`, until waited for.
    gather: Option<Work>,
    /// Whether the limiter counts `full`.
    counted: bool,
    /// The unsharded gradient during backward (`factor > 1`).
    full_grad: Option<Buffer>,
}

impl Unit {
    fn grad_target(&self) -> Option<&Buffer> {
        if self.factor == 1 {
            Some(&self.grad_shard)
        } else {
            self.full_grad.as_ref()
        }
    }
}

/// A model stage (what one forward/backward call of the model computes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Embed,
    Block(usize),
    Head,
}

/// Parameter or gradient views of several units' flat buffers, looked up by name.
struct Views<'a, G> {
    parts: Vec<(&'a HashMap<String, Range<usize>>, G)>,
}

impl<G: Deref<Target = [f32]>> Params for Views<'_, G> {
    fn param(&self, name: &str) -> Result<&[f32], FsdpError> {
        for (index, guard) in &self.parts {
            if let Some(r) = index.get(name) {
                return Ok(&guard[r.clone()]);
            }
        }
        Err(FsdpError::UnknownParameter { name: name.into() })
    }
}

impl<G: DerefMut<Target = [f32]>> Grads for Views<'_, G> {
    fn grad_mut(&mut self, name: &str) -> Result<&mut [f32], FsdpError> {
        for (index, guard) in &mut self.parts {
            if let Some(r) = index.get(name) {
                return Ok(&mut guard[r.clone()]);
            }
        }
        Err(FsdpError::UnknownParameter { name: name.into() })
    }
}

fn internal(reason: &str) -> FsdpError {
    FsdpError::InvalidFsdpConfig {
        reason: format!("internal runtime state: {reason}"),
    }
}

/// One rank of FSDP training of the reference GPT (see the [module](super) documentation).
///
/// Unsharded parameter and gradient buffers come from the rank's caching allocator
/// ([`HostAllocator`]): all-gather outputs are allocated on the communication stream that
/// fills them, gradient buffers on the compute stream that writes them. Cross-stream lifetimes
/// are safe by held references: a collective keeps clones of its buffers (access tickets) until
/// it has run, so a freed unit's block returns to the allocator only once the last stream work
/// on it is done.
pub struct FsdpGpt {
    cfg: GptConfig,
    config: FsdpConfig,
    optim: AdamWConfig,
    groups: Groups,
    compute: Stream,
    alloc: HostAllocator,
    units: Vec<Unit>,
    stages: Vec<Stage>,
    /// Units each stage reads, in unit order.
    stage_units: Vec<Vec<usize>>,
    /// First and last forward stage that reads each unit.
    first_stage: Vec<usize>,
    last_stage: Vec<usize>,
    /// The units of each stage in the order the first forward pass ran them (for forward
    /// prefetch).
    forward_order: Option<Vec<Vec<usize>>>,
    in_flight: usize,
    phase: Phase,
    step: u64,
    schedule: Vec<ScheduleEvent>,
    pending: Vec<Work>,
}

impl std::fmt::Debug for FsdpGpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpGpt")
            .field("rank", &self.groups.world.rank())
            .field("world_size", &self.groups.world.world_size())
            .field("config", &self.config)
            .field("units", &self.units.len())
            .field("step", &self.step)
            .finish()
    }
}

impl FsdpGpt {
    /// Build this rank's runtime. Every rank of `comm` must call it with the same arguments
    /// (hybrid strategies split `comm` into a `replicate × shard` mesh).
    ///
    /// # Errors
    /// [`FsdpError::InvalidPlan`] if the plan does not cover every model parameter exactly once
    /// with its shape, [`FsdpError::UnknownParameter`]/[`FsdpError::ParameterLength`] for
    /// missing or mis-sized initial parameters, [`FsdpError::InvalidFsdpConfig`] for a limit of
    /// 0 or a `ranks_per_node` that does not divide the world size, an invalid optimizer
    /// setting, or a failing collective or allocation.
    pub fn new(
        comm: Box<dyn Communicator>,
        cfg: GptConfig,
        plan: &UnitPlan,
        params: &HashMap<String, Vec<f32>>,
        config: FsdpConfig,
        optim: AdamWConfig,
    ) -> Result<Self, FsdpError> {
        cfg.validate()?;
        optim.validate()?;
        plan.validate()?;
        if config.limit_all_gathers == Some(0) {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: "limit_all_gathers must be at least 1 (or None)".into(),
            });
        }
        // The plan must hold every model parameter with its shape.
        let specs = param_specs(&cfg);
        let planned: HashMap<&str, &[usize]> = plan
            .units
            .iter()
            .flat_map(|u| u.params.iter())
            .chain(plan.ignored.iter())
            .map(|p| (p.name.as_str(), p.shape.as_slice()))
            .collect();
        if planned.len() != specs.len() {
            return Err(FsdpError::InvalidPlan {
                reason: format!(
                    "the plan holds {} parameters, the model has {}",
                    planned.len(),
                    specs.len()
                ),
            });
        }
        for s in &specs {
            match planned.get(s.name.as_str()) {
                Some(shape) if *shape == s.shape.as_slice() => {}
                Some(shape) => {
                    return Err(FsdpError::InvalidPlan {
                        reason: format!(
                            "parameter `{}` has shape {:?} in the plan, {:?} in the model",
                            s.name, shape, s.shape
                        ),
                    })
                }
                None => {
                    return Err(FsdpError::InvalidPlan {
                        reason: format!("parameter `{}` is in no unit", s.name),
                    })
                }
            }
        }
        if plan.units.is_empty() {
            return Err(FsdpError::InvalidPlan {
                reason: "the plan has no unit".into(),
            });
        }

        // Process groups.
        let world = comm.world_size();
        let mesh = if config.strategy.is_hybrid() {
            let per_node = config.ranks_per_node.unwrap_or(world);
            if per_node == 0 || world % per_node != 0 {
                return Err(FsdpError::InvalidFsdpConfig {
                    reason: format!(
                        "ranks_per_node {per_node} does not divide the world size {world}"
                    ),
                });
            }
            Some(mesh_2d(comm.as_ref(), world / per_node, per_node)?)
        } else {
            None
        };
        let groups = Groups {
            strategy: config.strategy,
            world: comm,
            mesh,
        };
        let (factor, shard_rank) = match groups.shard() {
            Some(g) => (g.world_size(), g.rank()),
            None => (1, 0),
        };

        // Flat parameters.
        let mut unit_specs: Vec<(Vec<&model::ParamSpec>, usize, bool)> = plan
            .units
            .iter()
            .map(|u| (u.params.iter().collect(), factor, false))
            .collect();
        if !plan.ignored.is_empty() {
            unit_specs.push((plan.ignored.iter().collect(), 1, true));
        }
        // Shards, gradient shards and unsharded buffers all come from the rank's caching
        // allocator, so that its statistics show the strategy's memory (the AdamW state and
        // the activations are plain vectors).
        let compute = Stream::inline("compute");
        let alloc = HostAllocator::new(
            HostSource::new(config.memory_capacity),
            AllocatorConfig::default(),
        )?;
        let mut units = Vec::with_capacity(unit_specs.len());
        for (i, (ps, f, replicated_all)) in unit_specs.into_iter().enumerate() {
            if ps.is_empty() {
                return Err(FsdpError::InvalidPlan {
                    reason: format!("unit {i} owns no parameter"),
                });
            }
            let mut b = FlatParamLayout::builder(f);
            for p in &ps {
                b = b.param(p.name.clone(), &p.shape);
            }
            let layout = b.build()?;
            let mut values = Vec::with_capacity(ps.len());
            for p in &ps {
                let v = params
                    .get(&p.name)
                    .ok_or_else(|| FsdpError::UnknownParameter {
                        name: p.name.clone(),
                    })?;
                if v.len() != p.numel() {
                    return Err(FsdpError::ParameterLength {
                        name: p.name.clone(),
                        expected: p.numel(),
                        actual: v.len(),
                    });
                }
                values.push(v.as_slice());
            }
            let flat = layout.flatten(&values)?;
            let rank = if f == 1 { 0 } else { shard_rank };
            let shard = alloc.allocate_buffer(DType::F32, layout.shard_numel(), &compute)?;
            shard.copy_from_slice(layout.shard(&flat, rank)?)?;
            drop(flat);
            let grad_shard = alloc.allocate_buffer(DType::F32, layout.shard_numel(), &compute)?;
            grad_shard.write::<f32>()?.fill(0.0);
            let index = layout
                .params()
                .iter()
                .map(|p| (p.name().to_string(), p.range()))
                .collect();
            units.push(Unit {
                adam: AdamWState::new(layout.shard_numel()),
                full: (f == 1).then(|| shard.clone()),
                layout,
                index,
                factor: f,
                replicated_all,
                shard,
                grad_shard,
                gather: None,
                counted: false,
                full_grad: None,
            });
        }

        // Stages and the units they read.
        let owner: HashMap<&str, usize> = units
            .iter()
            .enumerate()
            .flat_map(|(u, unit)| unit.index.keys().map(move |k| (k.as_str(), u)))
            .collect();
        let mut stages = vec![Stage::Embed];
        stages.extend((0..cfg.n_layer).map(Stage::Block));
        stages.push(Stage::Head);
        let mut stage_units = Vec::with_capacity(stages.len());
        for stage in &stages {
            let names: Vec<String> = match stage {
                Stage::Embed => embed_param_specs(&cfg)
                    .into_iter()
                    .map(|p| p.name)
                    .collect(),
                Stage::Block(l) => block_param_specs(&cfg, *l)
                    .into_iter()
                    .map(|p| p.name)
                    .collect(),
                Stage::Head => head_param_specs(&cfg)
                    .into_iter()
                    .map(|p| p.name)
                    .chain([WTE.to_string()])
                    .collect(),
            };
            let mut us: Vec<usize> = names
                .iter()
                .map(|n| {
                    owner
                        .get(n.as_str())
                        .copied()
                        .ok_or_else(|| FsdpError::UnknownParameter { name: n.clone() })
                })
                .collect::<Result<_, _>>()?;
            us.sort_unstable();
            us.dedup();
            stage_units.push(us);
        }
        let mut first_stage = vec![usize::MAX; units.len()];
        let mut last_stage = vec![0; units.len()];
        for (s, us) in stage_units.iter().enumerate() {
            for &u in us {
                first_stage[u] = first_stage[u].min(s);
                last_stage[u] = s;
            }
        }
        Ok(FsdpGpt {
            cfg,
            config,
            optim,
            groups,
            compute,
            alloc,
            units,
            stages,
            stage_units,
            first_stage,
            last_stage,
            forward_order: None,
            in_flight: 0,
            phase: Phase::Forward,
            step: 0,
            schedule: Vec::new(),
            pending: Vec::new(),
        })
    }

    /// This rank's index in the world.
    pub fn rank(&self) -> usize {
        self.groups.world.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.groups.world.world_size()
    }

    /// The sharding factor `F` of the units (1 for `NO_SHARD` or a shard group of one rank).
    pub fn sharding_factor(&self) -> usize {
        self.groups.shard().map_or(1, |g| g.world_size())
    }

    /// The configuration.
    pub fn config(&self) -> &FsdpConfig {
        &self.config
    }

    /// The flat-parameter layout of unit `unit` (ignored parameters form a last, unsharded
    /// unit).
    pub fn layout(&self, unit: usize) -> Option<&FlatParamLayout> {
        self.units.get(unit).map(|u| &u.layout)
    }

    /// Number of flat parameters (the plan's units, plus one for ignored parameters if any).
    pub fn num_units(&self) -> usize {
        self.units.len()
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The collectives and frees issued so far, in issue order.
    pub fn schedule(&self) -> &[ScheduleEvent] {
        &self.schedule
    }

    /// Forget the recorded schedule.
    pub fn clear_schedule(&mut self) {
        self.schedule.clear();
    }

    /// The statistics of the rank's caching allocator (unsharded parameters and gradients).
    pub fn memory_stats(&self) -> MemoryStats {
        self.alloc.memory_stats()
    }

    /// Reset the allocator's peak statistics.
    pub fn reset_peak_memory_stats(&self) {
        self.alloc.reset_peak_stats();
    }

    fn record(&mut self, unit: usize, kind: ScheduleKind, prefetch: bool) {
        self.schedule.push(ScheduleEvent {
            step: self.step,
            phase: self.phase,
            unit,
            kind,
            prefetch,
            in_flight: self.in_flight,
        });
    }

    /// Whether the limiter counts unit `u`'s gathered buffer in the current pass (it will be
    /// freed before the pass ends).
    fn counts(&self, u: usize) -> bool {
        match self.phase {
            Phase::Forward => u != 0 && self.config.strategy.reshard_after_forward(),
            Phase::Backward => true,
        }
    }

    /// Issue the all-gather of unit `u` unless it is unsharded already.
    fn gather(&mut self, u: usize, prefetch: bool) -> Result<(), FsdpError> {
        let unit = &self.units[u];
        if unit.full.is_some() || unit.factor == 1 {
            return Ok(());
        }
        let group = self
            .groups
            .shard()
            .ok_or_else(|| internal("a sharded unit without a shard group"))?;
        let out =
            self.alloc
                .allocate_buffer(DType::F32, unit.layout.padded_numel(), group.stream())?;
        let work = group.all_gather_base(&unit.shard, &out)?;
        let counted = self.counts(u);
        let unit = &mut self.units[u];
        unit.full = Some(out);
        unit.gather = Some(work);
        unit.counted = counted;
        if counted {
            self.in_flight += 1;
        }
        self.record(u, ScheduleKind::AllGather, prefetch);
        Ok(())
    }

    /// Prefetch unit `u` if it is not unsharded and the limiter allows it.
    fn prefetch(&mut self, u: usize) -> Result<(), FsdpError> {
        let unit = &self.units[u];
        if unit.full.is_some() || unit.factor == 1 {
            return Ok(());
        }
        if let Some(limit) = self.config.limit_all_gathers {
            if self.counts(u) && self.in_flight >= limit {
                return Ok(());
            }
        }
        self.gather(u, true)
    }

    /// Free (reshard) unit `u`'s unsharded parameters.
    fn free(&mut self, u: usize) {
        let unit = &mut self.units[u];
        if unit.factor == 1 || unit.full.is_none() {
            return;
        }
        unit.full = None;
        unit.gather = None;
        if std::mem::take(&mut unit.counted) {
            self.in_flight -= 1;
        }
        self.record(u, ScheduleKind::Free, false);
    }

    /// Wait for the all-gathers of the units of stage `s`.
    fn wait_gathers(&mut self, s: usize) -> Result<(), FsdpError> {
        for &u in &self.stage_units[s] {
            if let Some(w) = self.units[u].gather.take() {
                w.wait()?;
            }
        }
        Ok(())
    }

    /// Allocate and zero the unsharded gradients of stage `s`'s units.
    fn ensure_grads(&mut self, s: usize) -> Result<(), FsdpError> {
        for &u in &self.stage_units[s] {
            let unit = &mut self.units[u];
            if unit.factor > 1 && unit.full_grad.is_none() {
                let g = self.alloc.allocate_buffer(
                    DType::F32,
                    unit.layout.padded_numel(),
                    &self.compute,
                )?;
                g.write::<f32>()?.fill(0.0);
                unit.full_grad = Some(g);
            }
        }
        Ok(())
    }

    /// Issue the gradient reduction of unit `u`.
    fn reduce(&mut self, u: usize) -> Result<(), FsdpError> {
        let unit = &mut self.units[u];
        if unit.factor > 1 {
            let g = unit
                .full_grad
                .take()
                .ok_or_else(|| internal("reduce of a unit without gradients"))?;
            let group = self
                .groups
                .shard()
                .ok_or_else(|| internal("a sharded unit without a shard group"))?;
            let w = group.reduce_scatter_base(&g, &unit.grad_shard, ReduceOp::Sum)?;
            self.pending.push(w);
            self.record(u, ScheduleKind::ReduceScatter, false);
        }
        let unit = &self.units[u];
        let group = if unit.replicated_all {
            self.groups.world_multi()
        } else {
            self.groups.replicate()
        };
        if let Some(group) = group {
            let w = group.all_reduce(&unit.grad_shard, ReduceOp::Sum)?;
            self.pending.push(w);
            self.record(u, ScheduleKind::AllReduce, false);
        }
        Ok(())
    }

    /// Read guards of the unsharded parameters of stage `s`.
    fn param_views(&self, s: usize) -> Result<Views<'_, fsdp_device::ReadGuard<f32>>, FsdpError> {
        let mut parts = Vec::new();
        for &u in &self.stage_units[s] {
            let unit = &self.units[u];
            let full = unit
                .full
                .as_ref()
                .ok_or_else(|| internal("a stage computes with a sharded unit"))?;
            parts.push((&unit.index, full.read::<f32>()?));
        }
        Ok(Views { parts })
    }

    /// Write guards of the unsharded gradients of stage `s`.
    fn grad_views(&self, s: usize) -> Result<Views<'_, fsdp_device::WriteGuard<f32>>, FsdpError> {
        let mut parts = Vec::new();
        for &u in &self.stage_units[s] {
            let unit = &self.units[u];
            let g = unit
                .grad_target()
                .ok_or_else(|| internal("a stage's gradients are not allocated"))?;
            parts.push((&unit.index, g.write::<f32>()?));
        }
        Ok(Views { parts })
    }

    /// The units to prefetch in forward while the `s`-th stage computes: those of the next
    /// stage of the order recorded in the first step that are not unsharded.
    fn next_forward_units(&self, s: usize) -> Vec<usize> {
        let Some(next) = self.forward_order.as_ref().and_then(|o| o.get(s + 1)) else {
            return Vec::new();
        };
        next.iter()
            .copied()
            .filter(|&u| self.units[u].full.is_none() && self.units[u].factor > 1)
            .collect()
    }

    /// Drop every unsharded buffer and pending work (after a failed step).
    fn reset_transient(&mut self) {
        for unit in &mut self.units {
            if unit.factor > 1 {
                unit.full = None;
            }
            unit.gather = None;
            unit.counted = false;
            unit.full_grad = None;
        }
        self.in_flight = 0;
        self.pending.clear();
    }

    /// One training step on this rank's part `batch` of a global batch of `global_tokens`
    /// tokens: forward, backward, gradient reduction and AdamW on the shards. Returns the loss
    /// of the global batch (the mean cross-entropy over all its tokens), the same on every
    /// rank. Every rank must call it.
    ///
    /// # Errors
    /// An invalid batch, a failing collective or allocation. After an error the unsharded
    /// buffers are dropped; the shards keep the values of the last completed step unless the
    /// error came from the optimizer.
    pub fn step(&mut self, batch: &Batch, global_tokens: usize) -> Result<f32, FsdpError> {
        self.step += 1;
        let r = self.step_inner(batch, global_tokens);
        if r.is_err() {
            self.reset_transient();
        }
        r
    }

    fn step_inner(&mut self, batch: &Batch, global_tokens: usize) -> Result<f32, FsdpError> {
        let cfg = self.cfg;
        let shape = batch.shape;
        let n_stages = self.stages.len();
        for unit in &self.units {
            if unit.factor == 1 {
                unit.grad_shard.write::<f32>()?.fill(0.0);
            }
        }

        // Forward.
        self.phase = Phase::Forward;
        let recording = self.forward_order.is_none();
        let mut order = Vec::new();
        let mut x = Vec::new();
        let mut caches: Vec<BlockCache> = Vec::with_capacity(cfg.n_layer);
        let mut head: Option<(f32, HeadCache)> = None;
        for s in 0..n_stages {
            for i in 0..self.stage_units[s].len() {
                self.gather(self.stage_units[s][i], false)?;
            }
            if recording {
                order.push(self.stage_units[s].clone());
            }
            if self.config.forward_prefetch {
                for u in self.next_forward_units(s) {
                    self.prefetch(u)?;
                }
            }
            self.wait_gathers(s)?;
            {
                let p = self.param_views(s)?;
                match self.stages[s] {
                    Stage::Embed => x = model::embed_forward(&cfg, &p, &batch.inputs, shape)?,
                    Stage::Block(l) => {
                        let (y, c) =
                            model::block_forward(&cfg, &p, l, std::mem::take(&mut x), shape)?;
                        caches.push(c);
                        x = y;
                    }
                    Stage::Head => {
                        head = Some(model::head_forward(
                            &cfg,
                            &p,
                            std::mem::take(&mut x),
                            &batch.targets,
                            shape,
                            global_tokens,
                        )?);
                    }
                }
            }
            if self.config.strategy.reshard_after_forward() {
                for i in 0..self.stage_units[s].len() {
                    let u = self.stage_units[s][i];
                    if u != 0 && self.last_stage[u] == s {
                        self.free(u);
                    }
                }
            }
        }
        if recording {
            self.forward_order = Some(order);
        }
        let (local_loss, head) = head.ok_or_else(|| internal("the model has no head stage"))?;

        // Backward.
        self.phase = Phase::Backward;
        let mut dx = Vec::new();
        for s in (0..n_stages).rev() {
            for i in 0..self.stage_units[s].len() {
                let u = self.stage_units[s][i];
                self.gather(u, false)?;
            }
            self.ensure_grads(s)?;
            if self.config.backward_prefetch == BackwardPrefetch::Pre && s > 0 {
                for i in 0..self.stage_units[s - 1].len() {
                    self.prefetch(self.stage_units[s - 1][i])?;
                }
            }
            self.wait_gathers(s)?;
            {
                let p = self.param_views(s)?;
                let mut g = self.grad_views(s)?;
                match self.stages[s] {
                    Stage::Head => dx = model::head_backward(&cfg, &p, &mut g, &head, 1.0)?,
                    Stage::Block(l) => {
                        let c = caches
                            .pop()
                            .ok_or_else(|| internal("a block without its cache"))?;
                        dx = model::block_backward(&cfg, &p, &mut g, l, &c, &dx)?;
                    }
                    Stage::Embed => model::embed_backward(&cfg, &mut g, &batch.inputs, shape, &dx)?,
                }
            }
            let done: Vec<usize> = self.stage_units[s]
                .iter()
                .copied()
                .filter(|&u| self.first_stage[u] == s)
                .collect();
            for &u in &done {
                self.free(u);
            }
            if self.config.backward_prefetch == BackwardPrefetch::Post && s > 0 {
                for i in 0..self.stage_units[s - 1].len() {
                    self.prefetch(self.stage_units[s - 1][i])?;
                }
            }
            for &u in &done {
                self.reduce(u)?;
            }
        }
        drop(head);

        // Global loss, reductions, optimizer.
        let loss = match self.groups.world_multi() {
            Some(world) => {
                let b = Buffer::from_slice(&[local_loss])?;
                world.all_reduce(&b, ReduceOp::Sum)?.wait()?;
                b.to_vec::<f32>()?[0]
            }
            None => local_loss,
        };
        for w in std::mem::take(&mut self.pending) {
            w.wait()?;
        }
        for unit in &mut self.units {
            let g = unit.grad_shard.read::<f32>()?;
            let mut p = unit.shard.write::<f32>()?;
            unit.adam.step(&self.optim, &mut p, &g)?;
        }
        Ok(loss)
    }

    /// The full parameters, by name, gathered from the shards (a collective: every rank must
    /// call it). For tests and full checkpoints.
    ///
    /// # Errors
    /// A failing collective.
    pub fn full_params(&self) -> Result<HashMap<String, Vec<f32>>, FsdpError> {
        let mut out = HashMap::new();
        for unit in &self.units {
            let flat = if unit.factor == 1 {
                unit.shard.to_vec::<f32>()?
            } else {
                let group = self
                    .groups
                    .shard()
                    .ok_or_else(|| internal("a sharded unit without a shard group"))?;
                let full = Buffer::zeros(DType::F32, unit.layout.padded_numel())?;
                group.all_gather_base(&unit.shard, &full)?.wait()?;
                full.to_vec::<f32>()?
            };
            for (name, r) in &unit.index {
                out.insert(name.clone(), flat[r.clone()].to_vec());
            }
        }
        Ok(out)
    }
}
