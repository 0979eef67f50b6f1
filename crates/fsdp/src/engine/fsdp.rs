//! [`Fsdp`]: one rank's engine — construction of the param groups from a unit plan, and the
//! hooks a training loop calls around each unit.

use std::sync::Arc;

use fsdp_collectives::Communicator;
use fsdp_device::DType;
use fsdp_flatparam::FlatParamLayout;

use super::checkpointing::Activations;
use super::comm_context::{internal, CommContext, ProcessGroups};
use super::config::{BackwardPrefetch, FsdpConfig, Phase};
use super::grad_scaler::GradScaler;
use super::materialize::{init_shard, ParamInit};
use super::mixed_precision::MixedPrecisionPolicy;
use super::optim_groups::OptimizerSetup;
use super::order::ExecOrder;
use super::param_group::{cast_buffer, GroupDtypes, ParamGroup};
use super::pool::{host_pool, MemoryPool};
use super::reduce::{finish_reductions, foreach_reduce, PendingGrads};
use super::views::{GradViews, ParamEntry, ParamTable, ParamViews};
use crate::optim::{OptimizerConfig, OptimizerState, ShardGroups};
use crate::units::UnitPlan;
use crate::wrap::{plan_units, Module, WrapOptions};
use crate::FsdpError;

#[path = "fsdp_accessors.rs"]
mod accessors;
#[path = "fsdp_device.rs"]
mod on_device;

/// One rank of a fully sharded data-parallel job (see the [module](super) documentation).
pub struct Fsdp {
    pub(crate) ctx: CommContext,
    pub(crate) groups: Vec<ParamGroup>,
    pub(crate) table: ParamTable,
    pub(crate) optim: OptimizerConfig,
    pending_grads: PendingGrads,
    /// Inside a [`no_sync`](Fsdp::no_sync) scope.
    pub(crate) no_sync: bool,
    /// Optimizer steps taken.
    pub(crate) optimizer_steps: u64,
    /// A forward/backward pass is under way.
    pass_open: bool,
    /// Optimizer groups and learning-rate schedule.
    pub(crate) setup: OptimizerSetup,
    /// Dynamic loss scaling ([`Fsdp::set_grad_scaler`]).
    pub(crate) grad_scaler: Option<GradScaler>,
    /// Activation checkpointing and the activation meter (checkpointing.rs).
    pub(crate) activations: Activations,
    /// The non-finite rule of [`Fsdp::optimizer_step_if_finite`] (decided_step.rs).
    pub(crate) guard: super::decided_step::Guard,
    /// The squares this step's gradient norm was computed from, for its decision.
    pub(crate) step_squares: std::sync::Mutex<Option<super::decided_step::StepSquares>>,
}

impl std::fmt::Debug for Fsdp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fsdp")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("config", &self.ctx.config)
            .field("units", &self.groups.len())
            .field("step", &self.ctx.step)
            .finish()
    }
}

impl Fsdp {
    /// Build this rank's engine over `comm` with the units of `plan`, the parameters' initial
    /// values from `init`, and the rank's host caching allocator of
    /// [`FsdpConfig::memory_capacity`] bytes with the options [`FsdpConfig::allocator`]. Every rank of `comm` must call it with the same
    /// plan and configuration (the hybrid strategies split `comm` into a mesh).
    ///
    /// # Errors
    /// [`FsdpError::InvalidPlan`] for a plan without units, with an empty unit or a parameter
    /// in two places; [`FsdpError::InvalidFsdpConfig`] for a limit of 0 or a `ranks_per_node`
    /// that does not divide the world size; an invalid optimizer setting; missing or mis-sized
    /// initial values; a failing collective or allocation.
    pub fn new(
        comm: Box<dyn Communicator>,
        plan: &UnitPlan,
        init: ParamInit<'_>,
        config: FsdpConfig,
        optim: impl Into<OptimizerConfig>,
    ) -> Result<Self, FsdpError> {
        check_config(&config)?;
        config.mixed_precision.validate()?;
        let pool = host_pool(comm.as_ref(), &config)?;
        let groups = ProcessGroups::new(comm, config.strategy, config.ranks_per_node)?;
        Fsdp::with_parts(groups, pool, plan, init, config, optim.into())
    }

    /// Build the engine from a module tree and a wrap policy: the units are
    /// [`plan_units`]`(model, wrap)`; otherwise as [`Fsdp::new`].
    ///
    /// # Errors
    /// The wrap policy's errors ([`plan_units`]) and those of [`Fsdp::new`].
    pub fn from_module(
        comm: Box<dyn Communicator>,
        model: &Module,
        wrap: &WrapOptions,
        init: ParamInit<'_>,
        config: FsdpConfig,
        optim: impl Into<OptimizerConfig>,
    ) -> Result<Self, FsdpError> {
        let plan = plan_units(model, wrap)?;
        Fsdp::new(comm, &plan, init, config, optim)
    }

    /// Build the engine from process groups and a memory pool made by the caller (a dry run's
    /// groups and meta allocator, a CUDA allocator, an allocator with other options).
    ///
    /// # Errors
    /// As [`Fsdp::new`].
    pub fn with_parts(
        groups: ProcessGroups,
        pool: Arc<dyn MemoryPool>,
        plan: &UnitPlan,
        init: ParamInit<'_>,
        config: FsdpConfig,
        optim: OptimizerConfig,
    ) -> Result<Self, FsdpError> {
        check_config(&config)?;
        optim.validate()?;
        plan.validate()?;
        if plan.units.iter().all(|u| u.params.is_empty()) && plan.ignored.is_empty() {
            return Err(FsdpError::InvalidPlan {
                reason: "the plan has no parameter".into(),
            });
        }
        // The pool reports its allocations to the activation meter (checkpointing.rs).
        let (pool, activations) = Activations::wrap(pool);
        let shard_dtype = shard_dtype(&optim, &config)?;
        let ctx = CommContext::new(config, groups, pool);
        let (factor, shard_rank) = ctx.groups.factor_and_index();

        // One flat parameter per unit that owns parameters (a unit without any, such as a root
        // whose parameters all went to nested units, has nothing to shard, as in PyTorch); the
        // ignored parameters form a last, unsharded unit.
        let mut specs: Vec<(String, Vec<&crate::units::ParamSpec>, usize, bool)> = plan
            .units
            .iter()
            .filter(|u| !u.params.is_empty())
            .map(|u| (u.name.clone(), u.params.iter().collect(), factor, false))
            .collect();
        if !plan.ignored.is_empty() {
            specs.push(("(ignored)".into(), plan.ignored.iter().collect(), 1, true));
        }
        let mut groups = Vec::with_capacity(specs.len());
        let mut table = ParamTable::default();
        for (i, (name, ps, f, replicated_all)) in specs.into_iter().enumerate() {
            let mut b = FlatParamLayout::builder(f);
            if config.use_orig_params {
                // PyTorch's `_get_aligned_numel`: 16 bytes of the unsharded dtype.
                b = b.align_bytes(16, config.mixed_precision.param_dtype);
            }
            for p in &ps {
                b = b.param(p.name.clone(), &p.shape);
            }
            let layout = b.build()?;
            let shard_index = if f == 1 { 0 } else { shard_rank };
            // Shards, gradient shards and unsharded buffers all come from the rank's caching
            // allocator, so that its statistics show the strategy's memory (the optimizer
            // state and the activations are plain vectors).
            let shard = if shard_dtype == DType::F32 {
                let shard = ctx.alloc_local(layout.shard_numel())?;
                init_shard(&init, &ctx, &layout, shard_index, &shard)?;
                shard
            } else {
                // Low-precision shards (AnyPrecisionAdamW): initialised in f32, then rounded.
                let wide = ctx.alloc_local(layout.shard_numel())?;
                init_shard(&init, &ctx, &layout, shard_index, &wide)?;
                let shard = ctx.alloc_typed(
                    shard_dtype,
                    layout.shard_numel(),
                    &ctx.compute,
                    &ctx.compute,
                )?;
                if !ctx.is_meta() {
                    cast_buffer(&wide, &shard)?;
                }
                shard
            };
            let grad_shard = ctx.alloc_local(layout.shard_numel())?;
            ctx.fill(&grad_shard, 0.0)?;
            for p in layout.params() {
                table.push(ParamEntry {
                    name: p.name().to_string(),
                    shape: p.shape().to_vec(),
                    group: i,
                    range: p.range(),
                });
            }
            // A dry run (meta device) moves no data and never steps the optimizer: its state
            // stays empty, so a plan of a model larger than this machine's memory allocates
            // nothing in proportion to it (the plan reports the state's size from the layout).
            let state_numel = if ctx.is_meta() {
                0
            } else {
                layout.shard_numel()
            };
            let optim_state =
                OptimizerState::try_new(&optim, state_numel).map_err(|e| match e {
                    FsdpError::HostOutOfMemory { what, bytes } => FsdpError::HostOutOfMemory {
                        what: format!(
                            "{what} of unit {}",
                            if name.is_empty() { "(root)" } else { &name },
                        ),
                        bytes,
                    },
                    e => e,
                })?;
            groups.push(ParamGroup {
                index: i,
                name,
                optim_state,
                segments: ShardGroups::single(layout.shard_numel()),
                full: (f == 1).then(|| shard.clone()),
                dtypes: GroupDtypes {
                    shard: shard_dtype,
                    param: config.mixed_precision.param_dtype,
                    reduce: config.mixed_precision.reduce_dtype(),
                },
                policy: config.mixed_precision,
                rounded: None,
                uploaded: None,
                device_moments: Vec::new(),
                layout,
                factor: f,
                shard_index,
                replicated_all,
                shard,
                grad_shard,
                grad_shard_zero: true,
                replace_shard: false,
                gather: None,
                gather_input: None,
                counted: false,
                full_grad: None,
            });
        }
        let mut ctx = ctx;
        ctx.order = ExecOrder::new(groups.len());
        Ok(Fsdp {
            ctx,
            groups,
            table,
            optim,
            pending_grads: Vec::new(),
            no_sync: false,
            optimizer_steps: 0,
            pass_open: false,
            setup: OptimizerSetup::default(),
            grad_scaler: None,
            activations,
            guard: Default::default(),
            step_squares: Default::default(),
        })
    }

    fn check_unit(&self, u: usize) -> Result<(), FsdpError> {
        if u >= self.groups.len() {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: format!(
                    "unit {u} does not exist (the engine has {})",
                    self.groups.len()
                ),
            });
        }
        Ok(())
    }

    fn begin_pass(&mut self) {
        if !self.pass_open {
            self.pass_open = true;
            self.ctx.step += 1;
            self.ctx.phase = Phase::Forward;
            self.ctx.order.begin_pass();
            // Shards may have changed since the last pass: round (or copy) them again.
            for g in &mut self.groups {
                g.rounded = None;
                g.uploaded = None;
            }
        }
    }

    /// Whether a forward/backward pass is open.
    pub(crate) fn pass_is_open(&self) -> bool {
        self.pass_open
    }

    /// Set unit `u`'s policy (checked by the caller).
    pub(crate) fn set_group_policy(
        &mut self,
        u: usize,
        policy: MixedPrecisionPolicy,
    ) -> Result<(), FsdpError> {
        let g = &mut self.groups[u];
        if g.dtypes.shard != DType::F32 && g.dtypes.shard != policy.param_dtype {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: format!(
                    "unit {u} stores its parameters in {} (the optimizer's dtype): its \
                     param_dtype must be {} too, not {}",
                    g.dtypes.shard, g.dtypes.shard, policy.param_dtype
                ),
            });
        }
        g.policy = policy;
        g.dtypes.param = policy.param_dtype;
        g.dtypes.reduce = policy.reduce_dtype();
        g.rounded = None;
        Ok(())
    }

    /// Before unit `u`'s first forward computation of a pass: all-gather its parameters
    /// (unless gathered), prefetch the next unit of the recorded forward order when forward
    /// prefetch is on (in the first pass, before an order is recorded: the next unit in
    /// definition order), and wait for `u`'s gather. The first pre-forward of a pass begins it.
    ///
    /// # Errors
    /// An unknown unit, a failing allocation or collective.
    pub fn pre_forward(&mut self, u: usize) -> Result<(), FsdpError> {
        self.check_unit(u)?;
        self.begin_pass();
        self.ctx.order.on_pre_forward(u);
        self.groups[u].unshard(&mut self.ctx, false)?;
        if self.ctx.config.forward_prefetch {
            if let Some(next) = self.ctx.order.next_forward(u) {
                self.groups[next].prefetch(&mut self.ctx)?;
            }
        }
        self.groups[u].wait_for_unshard(&mut self.ctx)?;
        self.groups[u].ensure_rounded(&mut self.ctx)
    }

    /// After unit `u`'s last forward computation of a pass: reshard it when the strategy frees
    /// parameters after forward (the root unit — the plan's unit named `""` — stays unsharded
    /// for backward, which starts with it).
    ///
    /// # Errors
    /// An unknown unit.
    pub fn post_forward(&mut self, u: usize) -> Result<(), FsdpError> {
        self.check_unit(u)?;
        self.ctx.order.on_post_forward(u);
        if self.ctx.config.strategy.reshard_after_forward() && !self.groups[u].is_root() {
            self.groups[u].reshard(&mut self.ctx);
        }
        Ok(())
    }

    /// Before unit `u`'s first backward computation: all-gather it again if it was resharded,
    /// prefetch the next unit of the backward order (the reverse of the recorded post-forward
    /// order) with [`BackwardPrefetch::Pre`], wait, and allocate its unsharded gradient.
    ///
    /// # Errors
    /// An unknown unit, a failing allocation or collective.
    pub fn pre_backward(&mut self, u: usize) -> Result<(), FsdpError> {
        self.check_unit(u)?;
        if !self.pass_open {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: format!("pre_backward({u}) outside a pass: run the forward hooks first"),
            });
        }
        if self.ctx.phase == Phase::Forward {
            self.ctx.phase = Phase::Backward;
            self.ctx.order.end_forward();
        }
        self.ctx.order.on_pre_backward(u);
        self.groups[u].unshard(&mut self.ctx, false)?;
        if self.ctx.config.backward_prefetch == BackwardPrefetch::Pre {
            if let Some(next) = self.ctx.order.next_backward(u) {
                self.groups[next].prefetch(&mut self.ctx)?;
            }
        }
        self.groups[u].wait_for_unshard(&mut self.ctx)?;
        self.groups[u].ensure_rounded(&mut self.ctx)?;
        // Gradient buffers only after the wait: the communication stream runs in issue order,
        // so the reduce-scatters issued before that gather have completed and released their
        // unsharded gradients.
        self.groups[u].ensure_grad(&mut self.ctx)
    }

    /// After unit `u`'s last backward computation: reshard it, prefetch the next unit with
    /// [`BackwardPrefetch::Post`], and issue its gradient reduction (none inside
    /// [`no_sync`](Self::no_sync): the unsharded gradient is kept and accumulates). With a grad
    /// scaler ([`set_grad_scaler`](Self::set_grad_scaler)) the unsharded gradient is first
    /// multiplied by the scale.
    ///
    /// # Errors
    /// An unknown unit, a failing allocation or collective.
    pub fn post_backward(&mut self, u: usize) -> Result<(), FsdpError> {
        self.check_unit(u)?;
        self.groups[u].reshard(&mut self.ctx);
        if self.ctx.config.backward_prefetch == BackwardPrefetch::Post {
            if let Some(next) = self.ctx.order.next_backward(u) {
                self.groups[next].prefetch(&mut self.ctx)?;
            }
        }
        if self.no_sync {
            return Ok(());
        }
        // Loss scaling (grad_scaler.rs): the gradient times the scale, right before reduction.
        self.apply_backward_scale(self.groups[u].full_grad.as_ref())?;
        foreach_reduce(&mut self.groups[u], &mut self.ctx, &mut self.pending_grads)
    }

    /// After the last post-backward hook: wait for the issued reductions, add them into the
    /// gradient shards, and end the pass.
    ///
    /// # Errors
    /// A failed collective.
    pub fn finalize_backward(&mut self) -> Result<(), FsdpError> {
        self.pass_open = false;
        // The gradients change: a norm computed before is not theirs.
        self.keep_step_squares(None);
        finish_reductions(&mut self.groups, &mut self.ctx, &mut self.pending_grads)
    }

    /// Drop every unsharded buffer and pending work, and end the pass (after a failed step;
    /// the gradient shards may hold a partial accumulation: [`zero_grad`](Self::zero_grad)).
    pub fn abort_pass(&mut self) {
        for g in &mut self.groups {
            g.reset_transient(&mut self.ctx);
        }
        self.ctx.in_flight = 0;
        self.ctx.freeing.clear();
        self.ctx.pending.clear();
        self.pending_grads.clear();
        self.pass_open = false;
    }

    /// Read views of the unsharded parameters of `units` (each must be unsharded: between its
    /// pre-forward and post-forward, or pre-backward and post-backward hooks; or unsharded for
    /// good: `F = 1`).
    ///
    /// # Errors
    /// A unit that is sharded, an unknown unit, a failing buffer access.
    pub fn param_views(&self, units: &[usize]) -> Result<ParamViews<'_>, FsdpError> {
        let mut guards: Vec<_> = (0..self.groups.len()).map(|_| None).collect();
        let mut buffers: Vec<_> = (0..self.groups.len()).map(|_| None).collect();
        for &u in units {
            self.check_unit(u)?;
            let full =
                self.groups[u]
                    .compute_params()
                    .ok_or_else(|| FsdpError::InvalidFsdpConfig {
                        reason: format!(
                            "unit {u} is sharded: its pre-forward/pre-backward hook did not run"
                        ),
                    })?;
            // On a device the model reads the buffers on its stream; on the host, slices (a
            // dry run's meta buffers have none: its model reads lengths only).
            if self.ctx.device.is_none() && !self.ctx.is_meta() {
                guards[u] = Some(full.read::<f32>()?);
            }
            buffers[u] = Some(full.clone());
        }
        let policy = units.first().map(|&u| self.groups[u].policy);
        let stream = self.ctx.device.as_ref().map(|d| d.compute_stream().clone());
        Ok(ParamViews::new(
            &self.table,
            guards,
            buffers,
            policy,
            stream,
        ))
    }

    /// Write views of the unsharded gradients of `units` (between their pre-backward and
    /// post-backward hooks).
    ///
    /// # Errors
    /// A unit without gradient buffer, an unknown unit, a failing buffer access.
    pub fn grad_views(&self, units: &[usize]) -> Result<GradViews<'_>, FsdpError> {
        let mut guards: Vec<_> = (0..self.groups.len()).map(|_| None).collect();
        let mut buffers: Vec<_> = (0..self.groups.len()).map(|_| None).collect();
        for &u in units {
            self.check_unit(u)?;
            let g = self.groups[u].full_grad.as_ref().ok_or_else(|| {
                internal("a unit's gradients are not allocated: run pre_backward")
            })?;
            // On a device the model adds into the buffers on its stream; on the host, into
            // slices under a write guard (a buffer would wait for that guard); a dry run's
            // meta buffers are handed as buffers (its model writes nothing).
            if self.ctx.device.is_none() && !self.ctx.is_meta() {
                guards[u] = Some(g.write::<f32>()?);
            } else {
                buffers[u] = Some(g.clone());
            }
        }
        Ok(GradViews::new(&self.table, guards, buffers))
    }
}

/// The dtype of the shards: `f32` master weights, except under AnyPrecisionAdamW, which keeps
/// none: its shards are stored in `param_dtype` (bf16: pure-bf16 training).
fn shard_dtype(optim: &OptimizerConfig, config: &FsdpConfig) -> Result<DType, FsdpError> {
    let p = config.mixed_precision.param_dtype;
    match optim {
        OptimizerConfig::AnyPrecisionAdamW(_) if p == DType::F16 => {
            Err(FsdpError::InvalidFsdpConfig {
                reason: "AnyPrecisionAdamW stores the shards in param_dtype: float16 is not \
                         supported (use bfloat16 or float32)"
                    .into(),
            })
        }
        OptimizerConfig::AnyPrecisionAdamW(_) => Ok(p),
        _ => Ok(DType::F32),
    }
}

fn check_config(config: &FsdpConfig) -> Result<(), FsdpError> {
    if config.limit_all_gathers == Some(0) {
        return Err(FsdpError::InvalidFsdpConfig {
            reason: "limit_all_gathers must be at least 1 (or None)".into(),
        });
    }
    Ok(())
}
