//! Sharded training of the reference GPT on devices, one rank each: [`ShardedDeviceTrainer`],
//! generic over the operations ([`GptOps`]) and the collectives on their buffers
//! ([`DeviceComm`]). It is what `fsdp train --device … --ranks N` runs, and follows `fsdp
//! train --ranks N --strategy S` (the engine) step for step:
//!
//! - the same initial weights ([`seeded_params`](crate::device_train::seeded_params) or a
//!   checkpoint's, whole on every rank, each keeping its shards) and the same batches (rank
//!   `r` takes its rows of each micro-batch, [`get_batch`]);
//! - FSDP's units (the root and each block, or those of a size policy:
//!   [`DeviceTrainConfig::wrap`]) unsharded by one all-gather before their forward
//!   and backward, blocks resharded after forward under `FULL_SHARD` (and `HYBRID_SHARD`),
//!   gradients reduced to shards by one reduce-scatter per unit with the ranks' mean after each
//!   unit's backward (an all-reduce under `NO_SHARD`; under the hybrid strategies inside each
//!   node, then an all-reduce of the shards over the nodes: [`new_hybrid`](ShardedDeviceTrainer::new_hybrid)),
//!   each tensor sharded alone and flat, `⌈numel / ranks⌉` elements a rank, zero-padded;
//! - the loss averaged over ranks and the squares of the gradient shards summed over ranks
//!   (one all-reduce of the step's scalars each) before the step is decided on the device,
//!   then AdamW on this rank's shards as [`DeviceTrainer`](crate::device_train::DeviceTrainer)
//!   does on whole tensors; outcomes are read one step late.
//!
//! At one rank it is the [`DeviceTrainer`](crate::device_train::DeviceTrainer) bit for bit;
//! at more, on the host twins, its losses stay within 1e-5 relative of one rank's and of
//! the engine's (`tests/device_sharded.rs`).

use std::collections::HashMap;

use fsdp::optim::{decay_2d_only_group, DECAY_GROUP};
use fsdp::trace::SpanKind;
use fsdp::FsdpError;
use fsdp::ShardingStrategy;
use fsdp_kernels::gpt::{param_shapes, GptOps, GptPass, HostOps, Weights};
use fsdp_kernels::host::{StepRule, STEP_APPLIED, STEP_LOSS, STEP_SCALE, STEP_SQUARES};
use fsdp_kernels::KernelError;

use crate::data::get_batch;
use crate::device_comm::{CommVolume, DeviceComm};
use crate::device_config::{DeviceTrainConfig, DeviceTrainError};
use crate::device_optim::{
    accumulate_staged, decide_and_apply, squares, HostSide, OffloadStaging, Optim,
};
pub use crate::device_shard::Prefetch;
use crate::device_shard::{shard_of, GradSink, ShardSource, ShardedUnits};
use crate::device_snapshot::MemoryHistory;
use crate::device_trace::{StepMarks, Tracing};
use crate::device_train::{
    accum_u32, micro_batch_index, read_outcome, step_choices, Reported, StepOutcome, Values,
};
use crate::device_units::UnitLayout;

/// A step enqueued whose outcome is unread: its number, the optimizer steps known when it
/// was enqueued, its scalars on the way, and with tracing its marks.
pub(crate) type Pending<O> = (
    usize,
    u64,
    Values<O>,
    Option<StepMarks<<O as GptOps>::Mark>>,
);

/// Where a rank keeps its gradient accumulators, AdamW's moments and (under CPU offload) its
/// parameter shards.
pub(crate) enum ShardSide<O: GptOps> {
    /// On the device, beside the shards.
    Device(Optim<O::Buf>),
    /// CPU offload: on the host (the host twins), with the staging memory the reduced
    /// gradient shards are copied out into and each unit's shards copied in from, without a
    /// wait; the device holds a unit's shards only while the unit is gathered.
    Host(Box<HostSide>, Box<OffloadStaging<O::Staging>>),
}

/// One rank of sharded training on a device (see the [module](self) documentation).
pub struct ShardedDeviceTrainer<O: GptOps, C> {
    pub(crate) pass: GptPass<O>,
    /// The FSDP units (`config.wrap`'s) on the pass's hooks.
    pub(crate) layout: UnitLayout,
    /// The ranks that shard each tensor (every rank, but under the hybrid strategies those
    /// of this rank's node).
    pub(crate) comm: C,
    /// Under the hybrid strategies: this rank's peers in the other nodes, which hold the same
    /// shards (the reduced gradient shards are averaged over them).
    pub(crate) replicas: Option<C>,
    pub(crate) config: DeviceTrainConfig,
    pub(crate) strategy: ShardingStrategy,
    /// Ranks sharding each tensor: the world, or 1 under `NO_SHARD`.
    pub(crate) factor: usize,
    /// This rank's parameter shards on the device; under CPU offload none (they live on the
    /// host, copied in unit by unit when used).
    pub(crate) shards: Option<Weights<O::Buf>>,
    /// The step's gradient accumulators and AdamW's moments, of the shards: on the device, or
    /// under CPU offload on the host.
    pub(crate) optim: ShardSide<O>,
    pub(crate) decays: Vec<bool>,
    pub(crate) scalars: O::Scalars,
    pub(crate) skip_nonfinite: Option<u64>,
    pub(crate) known_steps: u64,
    /// The grad scaler's state, as far as the outcomes read say (`None` without one).
    pub(crate) scaler_state: Option<fsdp::engine::GradScalerState>,
    /// The step enqueued whose outcome is unread: its number, the optimizer steps known
    /// when it was enqueued, and its scalars on the way.
    pub(crate) pending: Option<Pending<O>>,
    /// `--trace`: the trace so far ([`set_tracing`](ShardedDeviceTrainer::set_tracing)).
    pub(crate) tracing: Option<Tracing<O::Mark>>,
    /// `--memory-snapshot`: this rank's device memory history
    /// ([`record_memory_history`](ShardedDeviceTrainer::record_memory_history)).
    pub(crate) memory_history: Option<MemoryHistory>,
    /// The all-gathers issued ahead of their use ([`set_prefetch`](Self::set_prefetch)).
    pub(crate) prefetch: Prefetch,
    /// The bytes the training passes' collectives moved ([`comm_volume`](Self::comm_volume)).
    pub(crate) volume: CommVolume,
}

impl<O: GptOps, C: DeviceComm<O>> ShardedDeviceTrainer<O, C> {
    /// This rank of the model of `config` sharded by `strategy` over `comm`'s ranks, from
    /// the full parameters `params` (the same on every rank; nanoGPT's names), zero moments
    /// and no step taken. Every rank calls it.
    ///
    /// # Errors
    /// Invalid settings; a hybrid strategy (one group of ranks here: no mesh), CPU offload
    /// (not built for sharded training); a batch whose micro-batches do not split evenly
    /// over the ranks; a missing or mis-sized parameter; allocation and copy failures.
    pub fn new(
        ops: O,
        comm: C,
        config: DeviceTrainConfig,
        strategy: ShardingStrategy,
        params: &HashMap<String, Vec<f32>>,
    ) -> Result<Self, DeviceTrainError> {
        let params = &*config.rounded_params(params);
        Self::with_shards(ops, comm, None, config, strategy, upload_shard(params))
    }

    /// This rank of a hybrid strategy (`HybridShard`, `HybridShardZero2`): sharded over
    /// `shard`'s ranks (its node), replicated over `replicas`' (the same position in every
    /// node; rank `replicas.rank() · shard.world_size() + shard.rank()` of the whole), as
    /// [`new`](Self::new) otherwise. Every rank calls it.
    ///
    /// # Errors
    /// As [`new`](Self::new); a strategy that is not hybrid.
    pub fn new_hybrid(
        ops: O,
        shard: C,
        replicas: C,
        config: DeviceTrainConfig,
        strategy: ShardingStrategy,
        params: &HashMap<String, Vec<f32>>,
    ) -> Result<Self, DeviceTrainError> {
        let params = &*config.rounded_params(params);
        Self::with_shards(
            ops,
            shard,
            Some(replicas),
            config,
            strategy,
            upload_shard(params),
        )
    }

    /// This rank and the number of ranks of the whole run.
    pub(crate) fn global_rank(&self) -> (usize, usize) {
        global(&self.comm, self.replicas.as_ref())
    }

    /// [`new`](Self::new) with each parameter's shard made by `make(ops, name, elements,
    /// shard, factor)`: shard `shard` of `factor` of the parameter `name` of `elements`
    /// elements ([`shard_of`] of its values; zeros for a memory plan).
    pub(crate) fn with_shards(
        ops: O,
        comm: C,
        replicas: Option<C>,
        config: DeviceTrainConfig,
        strategy: ShardingStrategy,
        make: impl Fn(&O, &str, usize, usize, usize) -> Result<O::Buf, KernelError>,
    ) -> Result<Self, DeviceTrainError> {
        config.validate()?;
        let (rank, world) = global(&comm, replicas.as_ref());
        let refuse = |what: &str| -> DeviceTrainError {
            FsdpError::InvalidShape {
                reason: format!("rank {rank}: sharded training on a device: {what}"),
            }
            .into()
        };
        match (strategy.is_hybrid(), &replicas) {
            (true, None) => {
                return Err(refuse(&format!(
                    "{strategy:?} needs a mesh of nodes (ShardedDeviceTrainer::new_hybrid)"
                )))
            }
            (false, Some(_)) => {
                return Err(refuse(&format!(
                    "{strategy:?} is not hybrid: it takes one group of ranks"
                )))
            }
            _ => {}
        }
        let micro = config.batch_size / config.grad_accum;
        if micro % world != 0 {
            return Err(FsdpError::BatchNotDivisible {
                batch_size: micro,
                world_size: world,
            }
            .into());
        }
        let factor = if strategy == ShardingStrategy::NoShard {
            1
        } else {
            comm.world_size()
        };
        // This rank's shard among the `factor` that shard each tensor (replicated: the whole).
        let shard = comm.rank() % factor;
        let dims = config.dims();
        let layout = UnitLayout::new(&config.cfg, config.wrap)?;
        let mut pass = GptPass::new(ops, dims)?;
        pass.set_activation_checkpointing(config.activation_checkpointing);
        pass.set_attention(config.attention);
        pass.set_logits(config.logits);
        let ops = pass.ops();
        let tensors = param_shapes(&dims).len();
        let scalars = ops.scalars(&config.start_scalars(tensors, 0, 0, None))?;
        let (shards, optim) = if config.offload {
            // The master shards on the host, each made on the device and copied out (one at a
            // time), and their staging copy that the units are copied in from.
            let host = HostOps::new();
            let params = Weights::try_build(&dims, |name, len| {
                let b = make(ops, name, len, shard, factor)?;
                host.upload(&ops.download(&b)?)
            })?;
            let mut staging = OffloadStaging::new(ops, &dims, config.grad_accum, factor)?;
            for (s, (_, m)) in staging.params.all_mut().into_iter().zip(params.named()) {
                ops.staged_mut(s)?.copy_from_slice(m);
            }
            let side = HostSide {
                optim: Optim::sharded_zeros(&host, &dims, true, factor, config.any_precision)?,
                scalars: host.scalars(&config.start_scalars(tensors, 0, 0, None))?,
                params,
                ops: host,
            };
            (None, ShardSide::Host(Box::new(side), Box::new(staging)))
        } else {
            let shards =
                Weights::try_build(&dims, |name, len| make(ops, name, len, shard, factor))?;
            let optim = ShardSide::Device(Optim::sharded_zeros(
                ops,
                &dims,
                true,
                factor,
                config.any_precision,
            )?);
            (Some(shards), optim)
        };
        let decays = param_shapes(&dims)
            .iter()
            .map(|(_, shape)| !config.decay_2d_only || decay_2d_only_group(shape) == DECAY_GROUP)
            .collect();
        Ok(ShardedDeviceTrainer {
            pass,
            layout,
            comm,
            replicas,
            config,
            strategy,
            factor,
            shards,
            optim,
            decays,
            scalars,
            skip_nonfinite: None,
            known_steps: 0,
            scaler_state: config.initial_scaler_state(),
            pending: None,
            tracing: None,
            memory_history: None,
            prefetch: Prefetch::default(),
            volume: CommVolume::default(),
        })
    }
}

/// This rank and the run's number of ranks, from the shard group and the replicas.
fn global<O: GptOps, C: DeviceComm<O>>(comm: &C, replicas: Option<&C>) -> (usize, usize) {
    match replicas {
        Some(r) => (
            r.rank() * comm.world_size() + comm.rank(),
            r.world_size() * comm.world_size(),
        ),
        None => (comm.rank(), comm.world_size()),
    }
}

/// A shard maker that uploads shard `shard` of `factor` of each of `params`' values.
fn upload_shard<'a, O: GptOps>(
    params: &'a HashMap<String, Vec<f32>>,
) -> impl Fn(&O, &str, usize, usize, usize) -> Result<O::Buf, KernelError> + 'a {
    move |ops, name, len, shard, factor| match params.get(name) {
        Some(p) if p.len() == len => ops.upload(&shard_of(p, shard, factor)),
        Some(p) => Err(KernelError::InvalidArgument {
            kernel: "shard",
            reason: format!(
                "parameter `{name}` has {} elements, expected {len}",
                p.len()
            ),
        }),
        None => Err(KernelError::InvalidArgument {
            kernel: "shard",
            reason: format!("parameter `{name}` is missing"),
        }),
    }
}

impl<O: GptOps, C: DeviceComm<O>> ShardedDeviceTrainer<O, C> {
    /// Training step `step` on the token stream `tokens`, waiting for its outcome (see
    /// [`enqueue_step`](Self::enqueue_step)). Every rank calls it.
    ///
    /// # Errors
    /// [`DeviceTrainError::Unread`] while a step of `enqueue_step` is unread; as
    /// `enqueue_step`.
    pub fn step(&mut self, tokens: &[u16], step: usize) -> Result<StepOutcome, DeviceTrainError> {
        if let Some((s, ..)) = &self.pending {
            return Err(DeviceTrainError::Unread { step: *s });
        }
        self.enqueue_step(tokens, step)?;
        match self.flush()? {
            Some(r) => Ok(r.outcome),
            None => Err(DeviceTrainError::Unread { step }),
        }
    }

    /// Enqueues training step `step` (this rank's rows of micro-batches `step·accum …`,
    /// their passes with the units' collectives, the ranks' loss and norm, AdamW on the
    /// shards) and returns the outcome of the step enqueued before, if any. Every rank
    /// calls it.
    ///
    /// # Errors
    /// A token stream too short or holding ids outside the vocabulary; device and
    /// collective failures; a failure of the step before.
    pub fn enqueue_step(
        &mut self,
        tokens: &[u16],
        step: usize,
    ) -> Result<Option<Reported>, DeviceTrainError> {
        let known = self.known_steps;
        let values = match self.run_step(tokens, step, known)? {
            Some(host) => Values::Host(host),
            None => Values::Device(self.ops().copy_scalars(&self.scalars)?),
        };
        let marks = self.tracing.as_mut().and_then(Tracing::take);
        let before = self.pending.replace((step, known, values, marks));
        before.map(|p| self.read(p)).transpose()
    }

    /// Waits for the outcome of the step enqueued last, if unread.
    ///
    /// # Errors
    /// Device failures.
    pub fn flush(&mut self) -> Result<Option<Reported>, DeviceTrainError> {
        self.pending.take().map(|p| self.read(p)).transpose()
    }

    fn read(
        &mut self,
        (step, known, values, marks): Pending<O>,
    ) -> Result<Reported, DeviceTrainError> {
        let v = match values {
            Values::Device(copy) => self.ops().wait_scalars(copy)?,
            Values::Host(v) => v,
        };
        if let (Some(t), Some(m)) = (&mut self.tracing, marks) {
            t.record(self.pass.ops(), m)?;
        }
        let (reported, count) = read_outcome(&self.config, step, known, &v)?;
        self.known_steps = count;
        self.scaler_state = reported.outcome.scaler;
        Ok(reported)
    }

    /// Enqueues the step's work; under CPU offload runs its end on the host and returns the
    /// step's scalars.
    fn run_step(
        &mut self,
        tokens: &[u16],
        step: usize,
        known: u64,
    ) -> Result<Option<Vec<f64>>, DeviceTrainError> {
        let c = self.config;
        let (accum, t) = (c.grad_accum, c.cfg.block_size);
        let micro = c.batch_size / accum;
        let alpha = (1.0 / accum as f64) as f32;
        let accum32 = accum_u32(accum)?;
        let (rank, world) = self.global_rank();
        let ops = self.pass.ops();
        if let Some(t) = &mut self.tracing {
            t.begin(ops)?;
        }
        match &mut self.optim {
            ShardSide::Device(o) => o.zero_accumulators(ops)?,
            ShardSide::Host(h, _) => h.optim.zero_accumulators(&h.ops)?,
        }
        let no_acc = || KernelError::InvalidArgument {
            kernel: "sharded step",
            reason: "no gradient accumulators".into(),
        };
        let no_shards = || KernelError::InvalidArgument {
            kernel: "sharded step",
            reason: "no parameter shards on the device".into(),
        };
        for m in 0..accum {
            let k = micro_batch_index(step, accum, m)?;
            let b = get_batch(tokens, k, micro, t, rank, world)?;
            let (sink, source) = match &mut self.optim {
                ShardSide::Device(o) => (
                    GradSink::Device(o.acc.as_mut().ok_or_else(no_acc)?),
                    ShardSource::Device(self.shards.as_ref().ok_or_else(no_shards)?),
                ),
                ShardSide::Host(_, st) => {
                    let slot = st.slot(m);
                    let OffloadStaging { grads, params } = &mut **st;
                    (
                        GradSink::Staged(&mut grads[slot]),
                        ShardSource::Host(params),
                    )
                }
            };
            let mut units = ShardedUnits::new(
                &self.comm,
                self.replicas.as_ref(),
                &self.layout,
                c.dims(),
                self.factor,
                self.strategy.reshard_after_forward(),
                source,
                sink,
                alpha,
            )
            .with_prefetch(self.prefetch)
            .with_reduce_dtype(c.reduce_dtype)
            .with_gather_dtype(c.gather_dtype(), ops.bf16_products());
            // With a grad scaler, the backward of the loss times the scale on the device.
            let scale = c.scaler_rule().map(|_| &self.scalars);
            let (inputs, targets, rows) = (&b.inputs, &b.targets, b.shape.rows);
            let losses = self
                .pass
                .forward_backward_scaled(&mut units, inputs, targets, rows, t, scale)?;
            self.volume += units.volume();
            drop(units);
            ops.loss_accumulate(&losses, accum32, m == 0, &mut self.scalars)?;
            // Offload: the micro-batch before's reduced shards are added on the host while
            // this one runs.
            if m > 0 {
                accumulate_offloaded(ops, &mut self.optim, m - 1, alpha)?;
            }
            if let Some(t) = &mut self.tracing {
                t.model(self.pass.take_marks(), k + 1);
            }
        }
        accumulate_offloaded(ops, &mut self.optim, accum - 1, alpha)?;
        let tensors = self.decays.len();
        let rule = StepRule {
            tensors,
            max_norm: c.grad_clip,
            skip_nonfinite: self.skip_nonfinite,
            base_steps: known,
            scaler: c.scaler_rule(),
        };
        let choices = step_choices(&c, known)?;
        let (comm, replicas, factor) = (&self.comm, self.replicas.as_ref(), self.factor);
        let host_values = match &mut self.optim {
            ShardSide::Device(o) => {
                let grads = o.acc.as_ref().ok_or_else(no_acc)?;
                squares(ops, grads, &mut self.scalars)?;
                crate::device_comm::reduce_step_scalars(
                    comm,
                    replicas,
                    factor,
                    tensors,
                    ops,
                    &mut self.scalars,
                )?;
                decide_and_apply(
                    ops,
                    self.shards.as_mut().ok_or_else(no_shards)?,
                    grads,
                    &mut o.moments,
                    &mut self.scalars,
                    &rule,
                    &choices,
                    &self.decays,
                )?;
                None
            }
            ShardSide::Host(h, staging) => {
                // CPU offload: the step's loss from the device (a wait), the squares on the
                // host, both reduced over the ranks through the device, then AdamW on the host
                // and the updated shards copied in.
                let HostSide {
                    ops: host,
                    params: masters,
                    optim,
                    scalars,
                } = &mut **h;
                let grads = optim.acc.as_ref().ok_or_else(no_acc)?;
                let device = ops.wait_scalars(ops.copy_scalars(&self.scalars)?)?;
                scalars[STEP_LOSS] = device[STEP_LOSS];
                squares(host, grads, scalars)?;
                let mut all = ops.scalars(scalars)?;
                crate::device_comm::reduce_step_scalars(
                    comm, replicas, factor, tensors, ops, &mut all,
                )?;
                let all = ops.wait_scalars(ops.copy_scalars(&all)?)?;
                scalars[STEP_LOSS] = all[STEP_LOSS];
                let sq = STEP_SQUARES..STEP_SQUARES + tensors;
                scalars[sq.clone()].copy_from_slice(&all[sq]);
                let moments = &mut optim.moments;
                let decays = &self.decays;
                decide_and_apply(
                    host, masters, grads, moments, scalars, &rule, &choices, decays,
                )?;
                let values = scalars.to_vec();
                if c.scaler_rule().is_some() {
                    // The next step's backward reads the scale the host decided.
                    let at = (&mut self.scalars, STEP_SCALE);
                    ops.write_scalars(at.0, at.1, &[values[STEP_SCALE]])?;
                }
                if values[STEP_APPLIED] == 1.0 {
                    // The units copy the updated shards in from here when they are used.
                    let staged = staging.params.all_mut().into_iter();
                    for (s, (_, m)) in staged.zip(masters.named()) {
                        ops.staged_mut(s)?.copy_from_slice(m);
                    }
                }
                Some(values)
            }
        };
        if let Some(t) = &mut self.tracing {
            let last = micro_batch_index(step, accum, accum)?;
            let what = if host_values.is_some() {
                "the ranks' loss and norm, the optimizer step on the host, shards copied in"
            } else {
                "the ranks' loss and norm, the optimizer step on the shards"
            };
            t.span(ops, SpanKind::Optimizer, what, last)?;
        }
        Ok(host_values)
    }
}

/// Under CPU offload: adds micro-batch `m`'s reduced gradient shards, copied out into staging
/// memory, to the host's accumulators (waiting for those copies only).
fn accumulate_offloaded<O: GptOps>(
    ops: &O,
    side: &mut ShardSide<O>,
    m: usize,
    alpha: f32,
) -> Result<(), DeviceTrainError> {
    if let ShardSide::Host(h, staging) = side {
        accumulate_staged(ops, h, &staging.grads[staging.slot(m)], alpha)?;
    }
    Ok(())
}
