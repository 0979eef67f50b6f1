//! One rank of FSDP training of the reference GPT.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut, Range};

use fsdp_allocator::{AllocatorConfig, HostAllocator, HostSource, MemoryStats};
use fsdp_collectives::{mesh_2d, Communicator, HybridMesh, ReduceOp, Work};
use fsdp_device::{Buffer, DType, Stream};
use fsdp_flatparam::FlatParamLayout;

use super::{
    BackwardPrefetch, CrossStreamSafety, FsdpConfig, Phase, ScheduleEvent, ScheduleKind,
    ShardingStrategy,
};
use crate::data::Batch;
use crate::model::{
    self, block_param_specs, embed_param_specs, head_param_specs, param_specs, BlockCache,
    GptConfig, Grads, HeadCache, Params,
};
use crate::optim::{OptimizerConfig, OptimizerState};
use crate::trace::{now_us, SpanKind, TraceEvent, Tracer};
use crate::units::UnitPlan;
use crate::FsdpError;

const WTE: &str = "transformer.wte.weight";

#[path = "shards.rs"]
mod shards;

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
    /// The rank's reduced gradient shard, accumulated over micro-batches until the optimizer
    /// step.
    grad_shard: Buffer,
    /// Whether `grad_shard` holds zeros (then a reduction writes it directly).
    grad_shard_zero: bool,
    /// The pending reduction of this unsharded unit replaces `grad_shard` (which held zeros).
    replace_shard: bool,
    optim_state: OptimizerState,
    /// The unsharded parameters while gathered (for `factor == 1`: always the shard).
    full: Option<Buffer>,
    /// The all-gather filling `full`, until waited for.
    gather: Option<Work>,
    /// Whether the limiter counts `full`.
    counted: bool,
    /// The unsharded gradient during backward (kept across micro-batches under `no_sync`).
    full_grad: Option<Buffer>,
}

impl Unit {
    fn grad_target(&self) -> Option<&Buffer> {
        self.full_grad.as_ref()
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

/// An `f32` buffer of `len` elements from `alloc` on `stream`, used also on `other` (with
/// [`CrossStreamSafety::RecordStream`]: recorded on it).
fn alloc_f32(
    alloc: &HostAllocator,
    len: usize,
    stream: &Stream,
    other: &Stream,
    safety: CrossStreamSafety,
) -> Result<Buffer, FsdpError> {
    let bytes = len
        .checked_mul(4)
        .ok_or_else(|| internal("buffer size overflows"))?;
    let block = alloc.allocate(bytes, stream)?;
    if safety == CrossStreamSafety::RecordStream {
        block.record_stream(other)?;
    }
    Ok(block.into_buffer(DType::F32)?)
}

/// Issue a collective through `f`, with a communication span on `stream` when tracing.
fn traced<T>(
    tracer: Option<&Tracer>,
    stream: &Stream,
    kind: SpanKind,
    step: u64,
    units: Vec<usize>,
    bytes: usize,
    f: impl FnOnce() -> Result<T, FsdpError>,
) -> Result<T, FsdpError> {
    match tracer {
        Some(t) => t.comm(stream, kind, step, units, bytes as u64, f),
        None => f(),
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
    optim: OptimizerConfig,
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
    /// Reduced gradients to add into the units' gradient shards once `pending` completed.
    pending_grads: Vec<(usize, Buffer)>,
    /// Inside a [`no_sync`](FsdpGpt::no_sync) scope.
    no_sync: bool,
    /// Optimizer steps taken.
    optimizer_steps: u64,
    /// The timeline trace sink, when [`FsdpConfig::trace`] is on.
    tracer: Option<Tracer>,
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
        optim: impl Into<OptimizerConfig>,
    ) -> Result<Self, FsdpError> {
        let optim: OptimizerConfig = optim.into();
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
                optim_state: OptimizerState::new(&optim, layout.shard_numel()),
                full: (f == 1).then(|| shard.clone()),
                layout,
                index,
                factor: f,
                replicated_all,
                shard,
                grad_shard,
                grad_shard_zero: true,
                replace_shard: false,
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
            pending_grads: Vec::new(),
            no_sync: false,
            optimizer_steps: 0,
            tracer: config.trace.then(Tracer::default),
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

    /// Forward/backward passes run so far (micro-batches; the `step` of [`ScheduleEvent`]s).
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The collectives and frees issued so far, in issue order.
    pub fn schedule(&self) -> &[ScheduleEvent] {
        &self.schedule
    }

    /// The timeline trace recorded so far (empty unless [`FsdpConfig::trace`] is on): compute
    /// spans per stage, communication spans per collective (those run so far by the
    /// communication streams) and allocator counters. Write it with
    /// [`crate::trace::write_chrome_trace`].
    pub fn trace_events(&self) -> Vec<TraceEvent> {
        self.tracer.as_ref().map_or_else(Vec::new, Tracer::events)
    }

    /// Forget the recorded trace.
    pub fn clear_trace(&self) {
        if let Some(t) = &self.tracer {
            t.clear();
        }
    }

    /// When tracing: sample the allocator counters and return the time (a compute span's
    /// begin).
    fn trace_begin(&self) -> f64 {
        match &self.tracer {
            Some(t) => {
                let now = now_us();
                self.trace_counter(t, now);
                now
            }
            None => 0.0,
        }
    }

    fn trace_counter(&self, t: &Tracer, time_us: f64) {
        let st = self.alloc.memory_stats();
        t.push(TraceEvent::Counter {
            time_us,
            allocated: st.allocated_bytes.all.current,
            reserved: st.reserved_bytes.all.current,
        });
    }

    /// When tracing: record the compute span of stage `s` begun at `begin_us`.
    fn trace_end(&self, kind: SpanKind, s: usize, begin_us: f64) {
        if let Some(t) = &self.tracer {
            let end_us = now_us();
            let stage = match self.stages[s] {
                Stage::Embed => "embed".to_string(),
                Stage::Block(l) => format!("block {l}"),
                Stage::Head => "head".to_string(),
            };
            t.push(TraceEvent::Span {
                kind,
                name: format!("{} {stage}", kind.as_str()),
                step: self.step,
                units: self.stage_units[s].clone(),
                begin_us,
                end_us,
                bytes: None,
            });
            self.trace_counter(t, end_us);
        }
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
        let out = alloc_f32(
            &self.alloc,
            unit.layout.padded_numel(),
            group.stream(),
            &self.compute,
            self.config.cross_stream,
        )?;
        let work = traced(
            self.tracer.as_ref(),
            group.stream(),
            SpanKind::AllGather,
            self.step,
            vec![u],
            unit.layout.shard_numel() * 4,
            || Ok(group.all_gather_base(&unit.shard, &out)?),
        )?;
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
            if unit.full_grad.is_none() && unit.factor == 1 && unit.grad_shard_zero {
                // An unsharded unit whose gradient shard is still zero accumulates in it
                // directly (reduced in place).
                unit.full_grad = Some(unit.grad_shard.clone());
            } else if unit.full_grad.is_none() {
                let comm = self
                    .groups
                    .shard()
                    .map_or_else(|| self.groups.world.stream(), |g| g.stream());
                let g = alloc_f32(
                    &self.alloc,
                    unit.layout.padded_numel(),
                    &self.compute,
                    comm,
                    self.config.cross_stream,
                )?;
                g.write::<f32>()?.fill(0.0);
                unit.full_grad = Some(g);
            }
        }
        Ok(())
    }

    /// Issue the gradient reduction of unit `u` (nothing under `no_sync`: the unsharded
    /// gradient is kept and accumulates).
    fn reduce(&mut self, u: usize) -> Result<(), FsdpError> {
        if self.no_sync {
            return Ok(());
        }
        let unit = &mut self.units[u];
        let g = unit
            .full_grad
            .take()
            .ok_or_else(|| internal("reduce of a unit without gradients"))?;
        // Where the reduced shard lands: straight in the gradient shard when it holds zeros,
        // otherwise in a new buffer added into it once the reduction completed.
        let direct = unit.grad_shard_zero;
        let target = if unit.factor > 1 {
            let group = self
                .groups
                .shard()
                .ok_or_else(|| internal("a sharded unit without a shard group"))?;
            let out = if direct {
                unit.grad_shard.clone()
            } else {
                alloc_f32(
                    &self.alloc,
                    unit.layout.shard_numel(),
                    group.stream(),
                    &self.compute,
                    self.config.cross_stream,
                )?
            };
            let w = traced(
                self.tracer.as_ref(),
                group.stream(),
                SpanKind::ReduceScatter,
                self.step,
                vec![u],
                unit.layout.shard_numel() * 4,
                || Ok(group.reduce_scatter_base(&g, &out, ReduceOp::Sum)?),
            )?;
            self.pending.push(w);
            self.record(u, ScheduleKind::ReduceScatter, false);
            out
        } else {
            g
        };
        let unit = &self.units[u];
        let group = if unit.replicated_all {
            self.groups.world_multi()
        } else {
            self.groups.replicate()
        };
        if let Some(group) = group {
            let w = traced(
                self.tracer.as_ref(),
                group.stream(),
                SpanKind::AllReduce,
                self.step,
                vec![u],
                target.len() * 4,
                || Ok(group.all_reduce(&target, ReduceOp::Sum)?),
            )?;
            self.pending.push(w);
            self.record(u, ScheduleKind::AllReduce, false);
        }
        if !(direct && self.units[u].factor > 1) {
            self.pending_grads.push((u, target));
        }
        let unit = &mut self.units[u];
        unit.grad_shard_zero = false;
        unit.replace_shard = direct && unit.factor == 1;
        Ok(())
    }

    /// Wait for the issued reductions and accumulate their results into the gradient shards.
    fn finish_reductions(&mut self) -> Result<(), FsdpError> {
        for w in std::mem::take(&mut self.pending) {
            w.wait()?;
        }
        for (u, g) in std::mem::take(&mut self.pending_grads) {
            let unit = &mut self.units[u];
            if std::mem::take(&mut unit.replace_shard) {
                // The first reduction of an unsharded unit: its buffer becomes the shard.
                unit.grad_shard = g;
                continue;
            }
            let add = g.read::<f32>()?;
            let mut acc = unit.grad_shard.write::<f32>()?;
            for (a, b) in acc.iter_mut().zip(add.iter()) {
                *a += *b;
            }
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
            unit.replace_shard = false;
        }
        self.in_flight = 0;
        self.pending.clear();
        self.pending_grads.clear();
    }

    /// One training step on this rank's part `batch` of a global batch of `global_tokens`
    /// tokens: [`forward_backward`](Self::forward_backward) then
    /// [`optimizer_step`](Self::optimizer_step). Returns the loss of the global batch (the mean
    /// cross-entropy over all its tokens), the same on every rank. Every rank must call it.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward) and
    /// [`optimizer_step`](Self::optimizer_step).
    pub fn step(&mut self, batch: &Batch, global_tokens: usize) -> Result<f32, FsdpError> {
        let loss = self.forward_backward(batch, global_tokens)?;
        self.optimizer_step()?;
        Ok(loss)
    }

    /// Forward and backward of this rank's part `batch` of a (micro-)batch; `global_tokens` is
    /// the loss normaliser: the token count of everything the next optimizer step averages
    /// over (all ranks, all micro-batches). Outside [`no_sync`](Self::no_sync) the gradients
    /// are reduced and **added** into the gradient shards (communication every micro-batch);
    /// inside, the unsharded gradients are kept and accumulate until a call outside the scope
    /// reduces them. Returns this micro-batch's share of the global loss, summed over ranks
    /// (the same on every rank). Every rank must call it.
    ///
    /// # Errors
    /// An invalid batch, a failing collective or allocation. After an error the unsharded
    /// buffers are dropped and the gradient shards may hold a partial accumulation: call
    /// [`zero_grad`](Self::zero_grad) before training on.
    pub fn forward_backward(
        &mut self,
        batch: &Batch,
        global_tokens: usize,
    ) -> Result<f32, FsdpError> {
        self.step += 1;
        let r = self.step_inner(batch, global_tokens);
        if r.is_err() {
            self.reset_transient();
        }
        r
    }

    /// Run `f` with gradient synchronisation off (PyTorch's `no_sync()`): backward passes
    /// inside keep the unsharded gradients and accumulate into them; the first
    /// [`forward_backward`](Self::forward_backward) after the scope reduces the accumulated
    /// gradients. Costs one unsharded gradient buffer per unit meanwhile.
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let before = std::mem::replace(&mut self.no_sync, true);
        let r = f(self);
        self.no_sync = before;
        r
    }

    /// The optimizer (AdamW or SGD) on every shard with the accumulated gradient shards, then
    /// [`zero_grad`](Self::zero_grad).
    ///
    /// # Errors
    /// [`FsdpError::InvalidFsdpConfig`] when unsharded gradients are still unreduced (the last
    /// backward ran under `no_sync`); an optimizer error.
    pub fn optimizer_step(&mut self) -> Result<(), FsdpError> {
        self.check_reduced()?;
        for unit in &mut self.units {
            let g = unit.grad_shard.read::<f32>()?;
            let mut p = unit.shard.write::<f32>()?;
            unit.optim_state.step(&self.optim, &mut p, &g)?;
        }
        self.optimizer_steps += 1;
        self.zero_grad()
    }

    /// Number of optimizer steps taken.
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps
    }

    /// Zero the gradient shards and drop unreduced unsharded gradients.
    ///
    /// # Errors
    /// A failing buffer access.
    pub fn zero_grad(&mut self) -> Result<(), FsdpError> {
        for unit in &mut self.units {
            unit.grad_shard.write::<f32>()?.fill(0.0);
            unit.grad_shard_zero = true;
            unit.full_grad = None;
        }
        Ok(())
    }

    fn check_reduced(&self) -> Result<(), FsdpError> {
        if self.units.iter().any(|u| u.full_grad.is_some()) {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: "gradients accumulated under no_sync are not reduced yet: run the last \
                         micro-batch outside no_sync before the optimizer step"
                    .into(),
            });
        }
        Ok(())
    }

    /// Clip the gradients by their global L2 norm (PyTorch's `FSDP.clip_grad_norm_`): the
    /// squared norms of the rank's gradient shards are summed over the ranks that hold
    /// distinct shards (the shard group; nothing for `NO_SHARD` and ignored parameters, whose
    /// gradients are replicated), and every gradient is scaled by
    /// `max_norm / (total_norm + 1e-6)` when that is below 1. Returns the total norm before
    /// clipping. Call it after the last [`forward_backward`](Self::forward_backward) of a step.
    /// Every rank must call it.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] for a negative or non-finite `max_norm`; unreduced
    /// gradients as in [`optimizer_step`](Self::optimizer_step); a failing collective.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, FsdpError> {
        if !(max_norm.is_finite() && max_norm >= 0.0) {
            return Err(FsdpError::InvalidHyperparameter {
                name: "max_norm",
                value: max_norm,
                reason: "must be finite and non-negative",
            });
        }
        self.check_reduced()?;
        let sq = |b: &Buffer| -> Result<f64, FsdpError> {
            Ok(b.read::<f32>()?
                .iter()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum())
        };
        let (mut sharded, mut replicated) = (0.0, 0.0);
        for unit in &self.units {
            if unit.factor > 1 {
                sharded += sq(&unit.grad_shard)?;
            } else {
                replicated += sq(&unit.grad_shard)?;
            }
        }
        if let Some(group) = self.groups.shard() {
            let b = Buffer::from_slice(&[sharded])?;
            traced(
                self.tracer.as_ref(),
                group.stream(),
                SpanKind::AllReduce,
                self.step,
                Vec::new(),
                8,
                || Ok(group.all_reduce(&b, ReduceOp::Sum)?),
            )?
            .wait()?;
            sharded = b.to_vec::<f64>()?[0];
        }
        let total = (sharded + replicated).sqrt();
        let coef = max_norm / (total + 1e-6);
        if coef < 1.0 {
            let c = coef as f32;
            for unit in &self.units {
                for g in unit.grad_shard.write::<f32>()?.iter_mut() {
                    *g *= c;
                }
            }
        }
        Ok(total)
    }

    fn step_inner(&mut self, batch: &Batch, global_tokens: usize) -> Result<f32, FsdpError> {
        let cfg = self.cfg;
        let shape = batch.shape;
        let n_stages = self.stages.len();
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
            let t0 = self.trace_begin();
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
            self.trace_end(SpanKind::Forward, s, t0);
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
            if self.config.backward_prefetch == BackwardPrefetch::Pre && s > 0 {
                for i in 0..self.stage_units[s - 1].len() {
                    self.prefetch(self.stage_units[s - 1][i])?;
                }
            }
            self.wait_gathers(s)?;
            // Gradient buffers only after the wait: the communication stream runs in issue
            // order, so every reduce-scatter issued before the all-gathers just waited for has
            // completed and released its unsharded gradient — at most one earlier gradient is
            // still in flight (the seeds' bound of two units' gradients).
            self.ensure_grads(s)?;
            let t0 = self.trace_begin();
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
            self.trace_end(SpanKind::Backward, s, t0);
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
                traced(
                    self.tracer.as_ref(),
                    world.stream(),
                    SpanKind::AllReduce,
                    self.step,
                    Vec::new(),
                    4,
                    || Ok(world.all_reduce(&b, ReduceOp::Sum)?),
                )?
                .wait()?;
                b.to_vec::<f32>()?[0]
            }
            None => local_loss,
        };
        self.finish_reductions()?;
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
