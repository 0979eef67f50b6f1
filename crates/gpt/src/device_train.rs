//! Training the reference GPT on one device, without the sharded engine: [`DeviceTrainer`],
//! generic over [`GptOps`] (`fsdp-kernels`' [`HostOps`], the
//! kernels' host twins, or [`CudaOps`](fsdp_kernels::gpt::CudaOps), NVRTC kernels and cuBLAS on
//! one CUDA stream). It is what `fsdp train --device cuda` runs, and it follows `fsdp train
//! --ranks 1` (the engine, [`FsdpGpt`](crate::runtime::FsdpGpt)) step for step:
//!
//! - the same initial weights: [`seeded_params`] materialises every tensor whole with the
//!   engine's seeded rule ([`gpt2_init`](crate::init::gpt2_init), [`fsdp::init::materialize`], which every sharded fill
//!   reproduces bitwise), uploaded once;
//! - the same batches: [`get_batch`] of the same token stream, micro-batch `step·accum + m`;
//! - gradient accumulation into buffers of its own: [`DeviceGpt::step`] overwrites its
//!   gradients, so each micro-batch's (of its mean loss) is added as `acc += g / accum` by
//!   [`GptOps::axpby`] (the engine sums the micro-batches' gradients of `sum / global_tokens`:
//!   the same value up to rounding); with one micro-batch a step the optimizer reads the
//!   model's gradients themselves (`0 + 1·g` is `g`), and no accumulators are allocated on the
//!   device;
//! - the global gradient norm from the sum of squares of every tensor
//!   ([`GptOps::sum_of_squares_at`]), and with clipping every gradient scaled by
//!   `max_norm / (norm + 1e-6)` when that is below 1, as
//!   [`Fsdp::clip_grad_norm`](fsdp::engine::Fsdp::clip_grad_norm) (AdamW scales each gradient
//!   as it reads it);
//! - AdamW with one state (two f32 moments) per parameter tensor on the device, the fused
//!   kernel (bitwise the engine's host AdamW), the learning rate of the schedule computed on
//!   the host as the engine does ([`LrSchedule::lr_at`](fsdp::optim::LrSchedule::lr_at) at the number of optimizer steps
//!   taken), and nanoGPT's weight-decay groups with `decay_2d_only`;
//! - a step whose loss or gradient norm is not finite takes no optimizer step (the caller
//!   stops or counts it skipped, as `fsdp train` does with the engine); with
//!   [`set_skip_nonfinite`](DeviceTrainer::set_skip_nonfinite) the trainer halts (takes no
//!   further optimizer step) at the first non-finite step past the limit;
//! - no step waits for the device: the loss is summed, the norm taken, the clipping, the
//!   skip and the step count decided on the device ([`GptOps::step_decide`]), and AdamW reads
//!   that decision, its scalars chosen on the device among those the host computed for each
//!   step count it may have reached. [`enqueue_step`](DeviceTrainer::enqueue_step) returns the
//!   outcome of the step before (read one step late, while the device runs this one);
//!   [`step`](DeviceTrainer::step) waits for its own;
//! - with [`DeviceTrainConfig::grad_scaler`], dynamic loss scaling as the engine's
//!   [`GradScaler`](fsdp::engine::GradScaler): the scale kept on the device multiplies each
//!   micro-batch's gradient seed, the decision unscales the norm and AdamW the gradients, and
//!   a step whose gradients overflowed is the scaler's skip (not a non-finite step) and
//!   backs the scale off;
//! - with [`DeviceTrainConfig::offload`] (CPU offload, PyTorch's
//!   `CPUOffload(offload_params=True)`) the master parameters, the accumulators and AdamW's
//!   moments live on the host and the norm, clipping and AdamW run there on the kernels' host
//!   twins (bitwise the kernels'): each micro-batch's gradients are copied out after its
//!   backward and the updated parameters copied into the device's after the optimizer step,
//!   so the device holds parameters, one micro-batch's gradients and activations only. The
//!   copies go through staging memory ([`GptOps::Staging`], page-locked on a GPU) without the
//!   host waiting for the stream: the host adds one micro-batch's gradients to its
//!   accumulators while the device runs the next, and the updated parameters are copied in
//!   ahead of the next step's work.
//!
//! Its device memory is counted ([`DeviceTrainer::memory`]) and predicted
//! ([`plan_memory`](crate::device_plan::plan_memory), exactly: `tests/device_plan.rs`).
//!
//! The losses differ from the engine's only by rounding (the kernels' order of sums, the
//! micro-batch scaling): `tests/device_train.rs` holds them within 1e-4 relative.

use std::collections::HashMap;

use fsdp::engine::GradScalerState;
use fsdp::optim::{decay_2d_only_group, DECAY_GROUP};
use fsdp::trace::SpanKind;
use fsdp_kernels::gpt::{param_shapes, DeviceGpt, GptOps, HostOps, MemoryUse, Weights};
use fsdp_kernels::host::{StepRule, STEP_APPLIED, STEP_LOSS, STEP_SCALE};
use fsdp_kernels::KernelError;

use crate::data::get_batch;
pub use crate::device_config::{seeded_params, DeviceTrainConfig, DeviceTrainError};
use crate::device_optim::{
    accumulate_staged, end_step, HostSide, OffloadStaging, Optim, Placement,
};
use crate::device_snapshot::MemoryHistory;
use crate::device_trace::{StepMarks, Tracing};

/// What one training step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// The step's loss: the mean cross-entropy over all its tokens (every micro-batch).
    pub loss: f32,
    /// The global L2 norm of the accumulated gradients, before clipping.
    pub grad_norm: f64,
    /// The learning rate of the optimizer step (the schedule's at the steps taken before).
    pub lr: f64,
    /// Whether the optimizer stepped: `false` when the loss or the norm is not finite, or the
    /// trainer is halted.
    pub applied: bool,
    /// Whether the trainer is halted: more non-finite steps than
    /// [`set_skip_nonfinite`](DeviceTrainer::set_skip_nonfinite) allows were seen, this one
    /// or an earlier one; no later step applies.
    pub halted: bool,
    /// Whether the grad scaler found the step's gradients overflowed (a NaN or an infinity):
    /// the scaler skipped the step and backed its scale off. Such a step does not count as
    /// non-finite unless its loss is.
    pub overflow: bool,
    /// The grad scaler's state after the step (`None` without one).
    pub scaler: Option<GradScalerState>,
}

/// The outcome of step [`step`](Reported::step), read after it ran.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reported {
    /// The step (0 for the first).
    pub step: usize,
    /// What it did.
    pub outcome: StepOutcome,
}

/// The reference GPT, its gradient accumulators and its AdamW state on one device (see the
/// [module](self) documentation).
pub struct DeviceTrainer<O: GptOps> {
    pub(crate) model: DeviceGpt<O>,
    pub(crate) config: DeviceTrainConfig,
    /// Where the optimizer's side lives: on the device, or offloaded to the host.
    pub(crate) state: Placement<O>,
    /// Per parameter, in [`param_shapes`] order: whether weight decay applies.
    pub(crate) decays: Vec<bool>,
    /// The step's scalars on the device (under CPU offload, its loss only).
    pub(crate) scalars: O::Scalars,
    skip_nonfinite: Option<u64>,
    /// Optimizer steps taken, as far as the outcomes read say.
    pub(crate) known_steps: u64,
    /// The grad scaler's state, as far as the outcomes read say (`None` without one).
    pub(crate) scaler_state: Option<GradScalerState>,
    /// The step enqueued whose outcome is unread.
    pub(crate) pending: Option<Pending<O>>,
    /// `--trace`: the trace so far ([`set_tracing`](DeviceTrainer::set_tracing)).
    pub(crate) tracing: Option<Tracing<O::Mark>>,
    /// `--memory-snapshot`: the device memory's history
    /// ([`record_memory_history`](DeviceTrainer::record_memory_history)).
    pub(crate) memory_history: Option<MemoryHistory>,
}

/// An enqueued step's outcome, on its way.
pub(crate) struct Pending<O: GptOps> {
    pub(crate) step: usize,
    /// The optimizer steps the host knew of when it enqueued the step.
    known: u64,
    values: Values<O>,
    /// With tracing, the step's marks.
    marks: Option<StepMarks<O::Mark>>,
}

pub(crate) enum Values<O: GptOps> {
    /// The scalars copied from the device.
    Device(O::ScalarsCopy),
    /// Under CPU offload: read already (the host side decided).
    Host(Vec<f64>),
}

impl<O: GptOps> DeviceTrainer<O> {
    /// The model of `config` on `ops`' device with `params` uploaded (every parameter by
    /// nanoGPT's name: [`seeded_params`] or a checkpoint's), zero moments and no step taken.
    ///
    /// # Errors
    /// Invalid settings; a missing or mis-sized parameter; allocation and copy failures.
    pub fn new(
        ops: O,
        config: DeviceTrainConfig,
        params: &HashMap<String, Vec<f32>>,
    ) -> Result<DeviceTrainer<O>, DeviceTrainError> {
        config.validate()?;
        let dims = config.dims();
        let params = &*config.rounded_params(params);
        let mut model = DeviceGpt::new(ops, dims, params)?;
        model.set_activation_checkpointing(config.activation_checkpointing);
        model.set_attention(config.attention);
        model.set_logits(config.logits);
        let tensors = param_shapes(&dims).len();
        let state = if config.offload {
            let host = HostOps::new();
            let master = Weights::try_build(&dims, |name, len| {
                // `DeviceGpt::new` checked every parameter; checked again, never a panic.
                match params.get(name) {
                    Some(p) if p.len() == len => host.upload(p),
                    _ => Err(KernelError::InvalidArgument {
                        kernel: "offload",
                        reason: format!("parameter {name} missing or not of {len} elements"),
                    }),
                }
            })?;
            let optim = Optim::zeros(&host, &dims, true, config.any_precision)?;
            let scalars = host.scalars(&config.start_scalars(tensors, 0, 0, None))?;
            let staging = OffloadStaging::new(model.ops(), &dims, config.grad_accum, 1)?;
            Placement::Host(
                Box::new(HostSide {
                    ops: host,
                    params: master,
                    optim,
                    scalars,
                }),
                Box::new(staging),
            )
        } else {
            Placement::Device(Optim::zeros(
                model.ops(),
                &dims,
                config.grad_accum > 1,
                config.any_precision,
            )?)
        };
        let scalars = model
            .ops()
            .scalars(&config.start_scalars(tensors, 0, 0, None))?;
        let decays = param_shapes(&dims)
            .iter()
            .map(|(_, shape)| !config.decay_2d_only || decay_2d_only_group(shape) == DECAY_GROUP)
            .collect();
        Ok(DeviceTrainer {
            model,
            config,
            state,
            decays,
            scalars,
            skip_nonfinite: None,
            known_steps: 0,
            scaler_state: config.initial_scaler_state(),
            pending: None,
            tracing: None,
            memory_history: None,
        })
    }

    /// The settings.
    pub fn config(&self) -> &DeviceTrainConfig {
        &self.config
    }

    /// Skip at most `limit` non-finite steps (`fsdp train --skip-nonfinite`): the next one
    /// halts the trainer, on the device, so that no step enqueued after it applies either
    /// (its outcome says [`halted`](StepOutcome::halted)). `None` (the default): skip every
    /// non-finite step and go on.
    pub fn set_skip_nonfinite(&mut self, limit: Option<u64>) {
        self.skip_nonfinite = limit;
    }

    /// Optimizer steps taken (steps whose loss and norm were finite), as far as the outcomes
    /// read so far say.
    pub fn optimizer_steps(&self) -> u64 {
        self.known_steps
    }

    /// The grad scaler's state (scale, growth tracker, skipped steps) as far as the outcomes
    /// read say: `None` without a scaler.
    pub fn grad_scaler_state(&self) -> Option<GradScalerState> {
        self.scaler_state
    }

    /// The operations.
    pub fn ops(&self) -> &O {
        self.model.ops()
    }

    /// The device memory the trainer's operations hold now and their peak since they were
    /// made ([`GptOps::memory`]): what [`plan_memory`](crate::device_plan::plan_memory)
    /// predicts.
    pub fn memory(&self) -> MemoryUse {
        self.ops().memory()
    }

    /// The peak of [`memory`](Self::memory), in bytes.
    pub fn peak_bytes(&self) -> u64 {
        self.memory().peak
    }

    /// Training step `step` (0 for the first) on the token stream `tokens`, waiting for its
    /// outcome: forward and backward of micro-batches `step·accum … step·accum + accum − 1`
    /// ([`get_batch`], world 1), their gradients accumulated, the global norm (clipped if
    /// set), then AdamW, unless the loss or the norm is not finite.
    ///
    /// # Errors
    /// [`DeviceTrainError::Unread`] while a step of [`enqueue_step`](Self::enqueue_step) is
    /// unread; a token stream too short or holding ids outside the vocabulary; device failures.
    pub fn step(&mut self, tokens: &[u16], step: usize) -> Result<StepOutcome, DeviceTrainError> {
        if let Some(p) = &self.pending {
            return Err(DeviceTrainError::Unread { step: p.step });
        }
        self.enqueue_step(tokens, step)?;
        match self.flush()? {
            Some(r) => Ok(r.outcome),
            None => Err(DeviceTrainError::Unread { step }),
        }
    }

    /// Enqueues training step `step` as [`step`](Self::step) describes, without waiting for
    /// it, and returns the outcome of the step enqueued before, if any (waiting for that one:
    /// the device runs this step meanwhile). [`flush`](Self::flush) reads the last.
    ///
    /// # Errors
    /// A token stream too short or holding ids outside the vocabulary; device failures; a
    /// failure of the step before.
    pub fn enqueue_step(
        &mut self,
        tokens: &[u16],
        step: usize,
    ) -> Result<Option<Reported>, DeviceTrainError> {
        let known = self.known_steps;
        let values = self.run_step(tokens, step, known)?;
        let marks = self.trace_take();
        let before = self.pending.replace(Pending {
            step,
            known,
            values,
            marks,
        });
        before.map(|p| self.read(p)).transpose()
    }

    /// Waits for the outcome of the step enqueued last, if unread.
    ///
    /// # Errors
    /// Device failures (of that step, or earlier asynchronous ones).
    pub fn flush(&mut self) -> Result<Option<Reported>, DeviceTrainError> {
        self.pending.take().map(|p| self.read(p)).transpose()
    }

    /// Enqueues the step's work; under CPU offload runs it to its end.
    fn run_step(
        &mut self,
        tokens: &[u16],
        step: usize,
        known: u64,
    ) -> Result<Values<O>, DeviceTrainError> {
        let c = self.config;
        let (accum, t) = (c.grad_accum, c.cfg.block_size);
        let micro = c.batch_size / accum;
        let alpha = (1.0 / accum as f64) as f32;
        let accum32 = accum_u32(accum)?;
        self.trace_begin()?;
        match &mut self.state {
            Placement::Device(optim) => optim.zero_accumulators(self.model.ops())?,
            Placement::Host(h, _) => h.optim.zero_accumulators(&h.ops)?,
        }
        for m in 0..accum {
            let k = micro_batch_index(step, accum, m)?;
            let b = get_batch(tokens, k, micro, t, 0, 1)?;
            // With a grad scaler, the backward of the loss times the scale on the device.
            let scale = c.scaler_rule().map(|_| &self.scalars);
            let losses = self.model.forward_backward_scaled(
                &b.inputs,
                &b.targets,
                b.shape.rows,
                t,
                scale,
            )?;
            self.trace_model(k + 1);
            let (ops, _, grads) = self.model.parts_mut();
            // The engine's loss of a micro-batch: its token sum over the step's tokens.
            ops.loss_accumulate(&losses, accum32, m == 0, &mut self.scalars)?;
            drop(losses);
            match &mut self.state {
                // Without accumulators (one micro-batch) the model's gradients are the step's.
                Placement::Device(Optim { acc: None, .. }) => {}
                Placement::Device(Optim { acc: Some(acc), .. }) => {
                    for (a, (_, g)) in acc.all_mut().into_iter().zip(grads.named()) {
                        ops.axpby(alpha, g, 1.0, a)?;
                    }
                }
                Placement::Host(h, staging) => {
                    // Offload: the gradients copied out into staging memory; the host adds
                    // the previous micro-batch's to its accumulators while the device runs
                    // this one, the last ones after the loop.
                    let slot = staging.slot(m);
                    let set = &mut staging.grads[slot];
                    for (s, (_, g)) in set.all_mut().into_iter().zip(grads.named()) {
                        ops.copy_out(g, s)?;
                    }
                    if m > 0 {
                        let before = &staging.grads[staging.slot(m - 1)];
                        accumulate_staged(ops, h, before, alpha)?;
                    }
                }
            }
            match &self.state {
                Placement::Device(Optim { acc: None, .. }) => {}
                Placement::Device(_) => {
                    self.trace_span(SpanKind::Backward, "gradient accumulation", k + 1)?
                }
                Placement::Host(..) => {
                    self.trace_span(SpanKind::Backward, "gradients copied out", k + 1)?
                }
            }
        }
        if let Placement::Host(h, staging) = &mut self.state {
            let last = &staging.grads[staging.slot(accum - 1)];
            accumulate_staged(self.model.ops(), h, last, alpha)?;
        }
        let rule = StepRule {
            tensors: self.decays.len(),
            max_norm: c.grad_clip,
            skip_nonfinite: self.skip_nonfinite,
            base_steps: known,
            scaler: c.scaler_rule(),
        };
        let choices = step_choices(&self.config, known)?;
        let on_host = match &mut self.state {
            Placement::Device(optim) => {
                let (ops, params, model_grads) = self.model.parts_mut();
                let grads = optim.acc.as_ref().unwrap_or(model_grads);
                let moments = &mut optim.moments;
                let s = &mut self.scalars;
                end_step(
                    ops,
                    params,
                    grads,
                    moments,
                    s,
                    &rule,
                    &choices,
                    &self.decays,
                )?;
                None
            }
            Placement::Host(h, staging) => {
                // Offload: the loss from the device, the rest of the step on the host.
                let ops = self.model.ops();
                let device = ops.wait_scalars(ops.copy_scalars(&self.scalars)?)?;
                let HostSide {
                    ops: host,
                    params: master,
                    optim,
                    scalars,
                } = &mut **h;
                scalars[STEP_LOSS] = device[STEP_LOSS];
                let grads = optim
                    .acc
                    .as_ref()
                    .ok_or_else(|| KernelError::InvalidArgument {
                        kernel: "offload",
                        reason: "the host side has no accumulators".into(),
                    })?;
                let moments = &mut optim.moments;
                end_step(
                    host,
                    master,
                    grads,
                    moments,
                    scalars,
                    &rule,
                    &choices,
                    &self.decays,
                )?;
                let values = scalars.to_vec();
                if c.scaler_rule().is_some() {
                    // The next step's backward reads the scale the host decided.
                    let ops = self.model.ops();
                    ops.write_scalars(&mut self.scalars, STEP_SCALE, &[values[STEP_SCALE]])?;
                }
                if values[STEP_APPLIED] == 1.0 {
                    // The updated parameters copied into the device's working ones through
                    // the staging memory: the next step's work follows the copies on the
                    // stream, and nothing waits for them here.
                    let (ops, params, _) = self.model.parts_mut();
                    let stage = staging.params.all_mut();
                    for ((p, (_, h)), s) in
                        params.all_mut().into_iter().zip(master.named()).zip(stage)
                    {
                        ops.staged_mut(s)?.copy_from_slice(h);
                        ops.copy_in(s, p)?;
                    }
                }
                Some(values)
            }
        };
        let last = (step * accum + accum) as u64;
        match on_host {
            None => {
                self.trace_span(SpanKind::Optimizer, "optimizer step", last)?;
                let ops = self.model.ops();
                Ok(Values::Device(ops.copy_scalars(&self.scalars)?))
            }
            Some(values) => {
                let name = "optimizer step on the host, parameters copied in";
                self.trace_span(SpanKind::Optimizer, name, last)?;
                if self.tracing.is_some() {
                    // The step's marks reached before its outcome is read.
                    let ops = self.model.ops();
                    ops.wait_scalars(ops.copy_scalars(&self.scalars)?)?;
                }
                Ok(Values::Host(values))
            }
        }
    }

    /// Waits for a pending step's scalars and reads its outcome.
    fn read(&mut self, p: Pending<O>) -> Result<Reported, DeviceTrainError> {
        let v = match p.values {
            Values::Device(copy) => self.model.ops().wait_scalars(copy)?,
            Values::Host(v) => v,
        };
        if let Some(marks) = p.marks {
            self.trace_record(marks)?;
        }
        let (reported, count) = read_outcome(&self.config, p.step, p.known, &v)?;
        self.known_steps = count;
        self.scaler_state = reported.outcome.scaler;
        Ok(reported)
    }

    /// Every parameter on the host, by name (after every step enqueued).
    ///
    /// # Errors
    /// Copy failures.
    pub fn full_params(&self) -> Result<HashMap<String, Vec<f32>>, DeviceTrainError> {
        Ok(self.model.download_params()?.into_iter().collect())
    }
}

pub(crate) use crate::device_step::{accum_u32, micro_batch_index, read_outcome, step_choices};
