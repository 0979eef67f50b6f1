//! [`EngineGpt`]: the GPT's pass over device operations ([`GptPass`], the kernels or their
//! twins) sharded by the [`fsdp`] engine. The engine's hooks run around each of the GPT's units
//! ([`Units`](fsdp_kernels::gpt::Units): the root and each block), as PyTorch FSDP's hooks run around each wrapped
//! module; the pass reads each unit's unsharded parameters and adds its gradients through
//! [`EngineViews`] (copies for the host twins, the buffers themselves on CUDA).
//!
//! ```
//! use fsdp::engine::{Fsdp, FsdpConfig, ParamInit, ShardingStrategy};
//! use fsdp::optim::AdamWConfig;
//! use fsdp_collectives::{ring, Communicator};
//! use fsdp_gpt::engine_gpt::EngineGpt;
//! use fsdp_gpt::model::{init_params, named_params, GptConfig};
//! use fsdp_gpt::tree::gpt_block_plan;
//! use fsdp_kernels::gpt::{GptPass, HostOps};
//!
//! let cfg = GptConfig::new(2, 2, 16, 8, 32).unwrap();
//! let params = named_params(&cfg, init_params(&cfg, 0)).unwrap();
//! let opt = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
//! let losses = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
//!     let config = FsdpConfig::new(ShardingStrategy::FullShard);
//!     let plan = gpt_block_plan(&cfg);
//!     let fsdp = Fsdp::new(Box::new(comm), &plan, ParamInit::Full(&params), config, opt).unwrap();
//!     let mut gpt = EngineGpt::new(fsdp, GptPass::new(HostOps::new(), cfg.dims()).unwrap()).unwrap();
//!     // This rank's 2 sequences of 8 tokens out of a global batch of 4.
//!     let ids: Vec<u32> = (0..16).map(|i| (i * 7 % 32) as u32).collect();
//!     gpt.step(&ids, &ids, 2, 8, 4 * 8).unwrap()
//! })
//! .unwrap();
//! assert_eq!(losses[0], losses[1]); // the global batch's mean loss, on every rank
//! ```

use std::ops::{Deref, DerefMut};

use fsdp::engine::{GradScaler, StepOutcome};
use fsdp::trace::TraceEvent;
use fsdp::{Fsdp, FsdpError};
use fsdp_kernels::gpt::{GptOps, GptPass};
use fsdp_kernels::host::{step_scalars_len, STEP_LOSS, STEP_SCALE};

use crate::data::Batch;
use crate::device_config::DeviceTrainError;
use crate::device_trace::{StepMarks, Tracing};
use crate::engine_step::LateMarks;
use crate::engine_units::{EngineUnits, UnitMap};
use crate::engine_views::EngineViews;
use crate::runtime::FsdpGpt;

/// What a training loop needs of a GPT on the engine, whichever computes it: the reference GPT
/// on the host ([`FsdpGpt`]) or the kernels' pass ([`EngineGpt`]). Everything else is the
/// engine's ([`Fsdp`], through `Deref`).
pub trait GptOnEngine: DerefMut<Target = Fsdp> {
    /// Forward and backward of this rank's part `batch` of a (micro-)batch of
    /// `global_tokens` tokens (the loss normaliser); returns this pass's share of the global
    /// loss, summed over ranks. Every rank must call it.
    ///
    /// # Errors
    /// An invalid batch, a failing collective, allocation or operation.
    fn forward_backward_batch(
        &mut self,
        batch: &Batch,
        global_tokens: usize,
    ) -> Result<f32, DeviceTrainError>;

    /// One training step of this rank's micro-batches `batches` (gradients accumulated under
    /// `no_sync` but for the last), each part of a global batch of `global_tokens` tokens,
    /// clipped to `clip`, whose optimizer step applies only if the step's loss and gradient
    /// norm are finite (the rule of [`Fsdp::optimizer_step_if_finite`]; an overflow of the
    /// grad scaler is its own skip). Returns the outcomes known now, oldest first. The
    /// default, the host's: the passes' losses summed on the host, the norm read, and this
    /// step's outcome at once ([`StepOutcome::decide`]); [`EngineGpt::train_step`] decides on
    /// the device and returns the step before's. Every rank must call it.
    ///
    /// # Errors
    /// As [`forward_backward_batch`](Self::forward_backward_batch), the norm and the step;
    /// no batch.
    fn train_step(
        &mut self,
        batches: &[Batch],
        global_tokens: usize,
        clip: Option<f64>,
    ) -> Result<Vec<StepOutcome>, DeviceTrainError> {
        let mut loss = 0.0f32;
        for (m, b) in batches.iter().enumerate() {
            let before = self.set_no_sync(m + 1 < batches.len());
            let l = self.forward_backward_batch(b, global_tokens);
            self.set_no_sync(before);
            loss += l?;
        }
        if batches.is_empty() {
            return Err(DeviceTrainError::Fsdp(FsdpError::InvalidShape {
                reason: "a training step needs at least one micro-batch".into(),
            }));
        }
        let norm = match clip {
            Some(c) => self.clip_grad_norm(c)?,
            None => self.grad_norm()?,
        };
        // Gradients that overflowed under the grad scaler (on any rank: the flag is agreed
        // over the world) are the scaler's to skip: `optimizer_step` skips the step and backs
        // the scale off. The global loss and norm are bitwise the same on every rank, so every
        // rank takes the same branch without further communication.
        let found_inf = self.grad_scaler().and_then(GradScaler::found_inf) == Some(true);
        let outcome = StepOutcome::decide(loss, norm, found_inf);
        if outcome.nonfinite() {
            self.skip_step()?;
        } else {
            self.optimizer_step()?;
        }
        Ok(vec![outcome])
    }

    /// The outcomes of [`train_step`](Self::train_step)'s steps not returned yet (default:
    /// none; [`EngineGpt::flush_steps`] waits for the device's last).
    ///
    /// # Errors
    /// A failure to read an outcome.
    fn flush_steps(&mut self) -> Result<Vec<StepOutcome>, DeviceTrainError> {
        Ok(Vec::new())
    }

    /// Trace the model's own parts from now on (`true`) or not: [`EngineGpt::set_tracing`].
    /// Default: nothing to trace beyond the engine's spans (the reference GPT's spans are the
    /// engine's).
    ///
    /// # Errors
    /// Device failures.
    fn set_model_tracing(&mut self, on: bool) -> Result<(), DeviceTrainError> {
        let _ = on;
        Ok(())
    }

    /// The peak of the bytes the model's kernels held (their operations' count:
    /// [`GptOps::memory`]); default `None` (the reference GPT's activations are the engine's
    /// tape, [`Fsdp::activation_stats`]).
    fn kernel_memory_peak(&self) -> Option<u64> {
        None
    }

    /// The model's own traced parts ([`EngineGpt::model_trace_events`]); default none.
    fn model_trace_events(&self) -> Vec<TraceEvent> {
        Vec::new()
    }
}

impl GptOnEngine for FsdpGpt {
    fn forward_backward_batch(
        &mut self,
        batch: &Batch,
        global_tokens: usize,
    ) -> Result<f32, DeviceTrainError> {
        Ok(self.forward_backward(batch, global_tokens)?)
    }
}

impl<O: EngineViews> GptOnEngine for EngineGpt<O> {
    fn forward_backward_batch(
        &mut self,
        batch: &Batch,
        global_tokens: usize,
    ) -> Result<f32, DeviceTrainError> {
        let (rows, t) = (batch.shape.rows, batch.shape.seq_len);
        self.forward_backward(&batch.inputs, &batch.targets, rows, t, global_tokens)
    }

    fn train_step(
        &mut self,
        batches: &[Batch],
        global_tokens: usize,
        clip: Option<f64>,
    ) -> Result<Vec<StepOutcome>, DeviceTrainError> {
        EngineGpt::train_step(self, batches, global_tokens, clip)
    }

    fn flush_steps(&mut self) -> Result<Vec<StepOutcome>, DeviceTrainError> {
        EngineGpt::flush_steps(self)
    }

    fn kernel_memory_peak(&self) -> Option<u64> {
        Some(self.pass.ops().memory().peak)
    }

    fn set_model_tracing(&mut self, on: bool) -> Result<(), DeviceTrainError> {
        EngineGpt::set_tracing(self, on)
    }

    fn model_trace_events(&self) -> Vec<TraceEvent> {
        EngineGpt::model_trace_events(self)
    }
}

impl<O: EngineViews> Deref for EngineGpt<O> {
    type Target = Fsdp;
    fn deref(&self) -> &Fsdp {
        &self.fsdp
    }
}

impl<O: EngineViews> DerefMut for EngineGpt<O> {
    fn deref_mut(&mut self) -> &mut Fsdp {
        &mut self.fsdp
    }
}

/// The GPT's pass over device operations `O`, its parameters sharded by an [`Fsdp`] engine
/// whose plan wraps the root (`wte`, `wpe`, `ln_f`) and each block as units of their own (as
/// [`gpt_block_plan`](crate::tree::gpt_block_plan) does). See the [module](self) documentation.
/// Dereferences to the engine for everything else (`optimizer_step`, `clip_grad_norm`,
/// `save_sharded`, ...).
pub struct EngineGpt<O: EngineViews> {
    pub(crate) fsdp: Fsdp,
    pub(crate) pass: GptPass<O>,
    units: UnitMap,
    /// The kernels' parts on the device's timeline ([`set_tracing`](Self::set_tracing)).
    tracing: Option<Tracing<O::Mark>>,
    /// Passes run (the micro-batch numbers of the trace, from 1).
    passes: u64,
    /// The traced marks of [`train_step`](Self::train_step)'s steps not read yet.
    pub(crate) late_marks: LateMarks<O::Mark>,
}

impl<O: EngineViews> EngineGpt<O> {
    /// The GPT `pass` on the engine `fsdp`, whose parameters must be the GPT's (names and
    /// shapes of [`param_shapes`](fsdp_kernels::gpt::param_shapes)) in units that each hold
    /// the root or one block.
    ///
    /// # Errors
    /// [`FsdpError::InvalidPlan`] (in [`DeviceTrainError::Fsdp`]) naming a parameter missing
    /// or of another shape, or units that split or merge the GPT's units.
    pub fn new(fsdp: Fsdp, pass: GptPass<O>) -> Result<Self, DeviceTrainError> {
        let units = UnitMap::new(&fsdp, &pass.dims())?;
        Ok(EngineGpt {
            fsdp,
            pass,
            units,
            tracing: None,
            passes: 0,
            late_marks: LateMarks::new(),
        })
    }

    /// Trace the kernels' parts of every pass from now on (`true`) or none (`false`, the
    /// default): the embeddings, each block's forward and backward, the head, and the hooks'
    /// work (unsharding a unit, reducing its gradients), each timed on the device's timeline
    /// and placed on the trace's clock once the pass's loss is read
    /// ([`model_trace_events`](Self::model_trace_events); the engine's own collectives are in
    /// [`Fsdp::trace_events`]). Turning it on waits once for the device to be idle.
    ///
    /// # Errors
    /// Device failures.
    pub fn set_tracing(&mut self, on: bool) -> Result<(), DeviceTrainError> {
        self.pass.set_tracing(on);
        self.tracing = if on {
            let ops = self.pass.ops();
            let scalars = ops.scalars(&[0.0; step_scalars_len(0)])?;
            Some(Tracing::start_when_idle(ops, &scalars)?)
        } else {
            None
        };
        Ok(())
    }

    /// The kernels' parts of the traced passes whose losses were read, in order (`step`: the
    /// pass, from 1): write them with the engine's [`Fsdp::trace_events`] through
    /// [`fsdp::trace::write_chrome_trace`].
    pub fn model_trace_events(&self) -> Vec<TraceEvent> {
        self.tracing
            .as_ref()
            .map(Tracing::events)
            .unwrap_or_default()
    }

    /// The engine.
    pub fn engine(&self) -> &Fsdp {
        &self.fsdp
    }

    /// The engine, to step, clip, checkpoint or configure it.
    pub fn engine_mut(&mut self) -> &mut Fsdp {
        &mut self.fsdp
    }

    /// The GPT's pass (its operations, activation checkpointing, attention and logits).
    pub fn pass(&self) -> &GptPass<O> {
        &self.pass
    }

    /// The GPT's pass, to configure it.
    pub fn pass_mut(&mut self) -> &mut GptPass<O> {
        &mut self.pass
    }

    /// Forward and backward of this rank's `rows` sequences of `t` tokens (`inputs` and
    /// `targets` row after row), part of a (micro-)batch of `global_tokens` tokens over all
    /// ranks and micro-batches: the gradients of the mean loss over those tokens are reduced
    /// and **added** into the gradient shards (kept unsharded inside
    /// [`Fsdp::no_sync`]). Returns this pass's share of the global loss, summed over ranks
    /// (the host reads this rank's losses: one wait). Every rank must call it.
    ///
    /// # Errors
    /// An invalid batch or `global_tokens` of 0; a failing collective, copy or operation.
    /// After an error the engine's pass is aborted ([`Fsdp::abort_pass`]).
    pub fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        global_tokens: usize,
    ) -> Result<f32, DeviceTrainError> {
        let r = self
            .pass_losses(inputs, targets, rows, t, global_tokens)
            .and_then(|(losses, marks)| {
                let ops = self.pass.ops();
                let sum: f64 = ops.download(&losses)?.iter().map(|&l| f64::from(l)).sum();
                self.trace_record(marks)?;
                Ok(self
                    .fsdp
                    .all_reduce_loss((sum / global_tokens as f64) as f32)?)
            });
        self.aborted_on_error(r)
    }

    /// [`forward_backward`](Self::forward_backward) without the host waiting for the loss:
    /// this rank's share of the global loss is computed on the device and copied to host
    /// memory while the host goes on; read it with [`wait_loss`](Self::wait_loss) (one step
    /// late, as `fsdp train --device` reads its outcomes). It is this rank's share only: sum
    /// the ranks' shares ([`Fsdp::all_reduce_loss`]) for the global loss.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward).
    pub fn forward_backward_pending(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        global_tokens: usize,
    ) -> Result<PendingLoss<O>, DeviceTrainError> {
        let r = self
            .pass_losses(inputs, targets, rows, t, global_tokens)
            .and_then(|(losses, marks)| {
                let ops = self.pass.ops();
                let mut scalars = ops.scalars(&[0.0; step_scalars_len(0)])?;
                ops.loss_accumulate(&losses, 1, true, &mut scalars)?;
                Ok(PendingLoss {
                    copy: ops.copy_scalars(&scalars)?,
                    share: (rows * t) as f64 / global_tokens as f64,
                    marks,
                })
            });
        self.aborted_on_error(r)
    }

    /// `r`, the engine's pass aborted first when it is an error.
    pub(crate) fn aborted_on_error<R>(
        &mut self,
        r: Result<R, DeviceTrainError>,
    ) -> Result<R, DeviceTrainError> {
        if r.is_err() {
            self.fsdp.abort_pass();
        }
        r
    }

    /// This rank's share of the loss of a
    /// [`forward_backward_pending`](Self::forward_backward_pending), once it has arrived (the
    /// host waits for the pass's work on the device, not for work issued after it).
    ///
    /// # Errors
    /// A failed copy or an earlier failure on the device; a wait past its timeout.
    pub fn wait_loss(&mut self, pending: PendingLoss<O>) -> Result<f32, DeviceTrainError> {
        let v = self.pass.ops().wait_scalars(pending.copy)?;
        self.trace_record(pending.marks)?;
        Ok((v[STEP_LOSS] * pending.share) as f32)
    }

    /// The spans of a traced pass whose loss was read (its marks are reached).
    pub(crate) fn trace_record(
        &mut self,
        marks: Option<StepMarks<O::Mark>>,
    ) -> Result<(), DeviceTrainError> {
        if let (Some(t), Some(m)) = (&mut self.tracing, marks) {
            t.record(self.pass.ops(), m)?;
        }
        Ok(())
    }

    /// One pass, the engine's reductions finished: the per-token losses on the device, and
    /// the pass's marks when tracing.
    #[allow(clippy::type_complexity)]
    pub(crate) fn pass_losses(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        global_tokens: usize,
    ) -> Result<(O::Buf, Option<StepMarks<O::Mark>>), DeviceTrainError> {
        if global_tokens == 0 {
            return Err(DeviceTrainError::Fsdp(FsdpError::InvalidShape {
                reason: "global_tokens of 0: the loss is a mean over them".into(),
            }));
        }
        let ops = self.pass.ops();
        // The pass's gradient is of this rank's mean loss over its rows·t tokens; scaled by
        // rows·t / global_tokens it is of its share of the global mean (1: unscaled).
        let scale = (rows * t) as f64 / global_tokens as f64;
        let scalars = if scale == 1.0 {
            None
        } else {
            let mut v = vec![0.0; step_scalars_len(0)];
            v[STEP_SCALE] = scale;
            Some(ops.scalars(&v)?)
        };
        let stream = self
            .fsdp
            .compute_device()
            .map(|d| d.compute_stream().clone());
        if let Some(t) = &mut self.tracing {
            t.begin(ops)?;
        }
        let traced = self.tracing.is_some();
        let dims = self.pass.dims();
        let mut units = EngineUnits::new(&mut self.fsdp, &self.units, dims, stream, traced);
        let losses = self.pass.forward_backward_scaled(
            &mut units,
            inputs,
            targets,
            rows,
            t,
            scalars.as_ref(),
        )?;
        drop(units);
        self.fsdp.finalize_backward()?;
        self.passes += 1;
        let marks = match &mut self.tracing {
            Some(t) => {
                t.model(self.pass.take_marks(), self.passes);
                t.take()
            }
            None => None,
        };
        Ok((losses, marks))
    }

    /// One training step: [`forward_backward`](Self::forward_backward) of this rank's part of
    /// a global batch of `global_tokens` tokens, then [`Fsdp::optimizer_step`]. Returns the
    /// global batch's mean loss, the same on every rank. Every rank must call it.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward) and [`Fsdp::optimizer_step`].
    pub fn step(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        global_tokens: usize,
    ) -> Result<f32, DeviceTrainError> {
        let loss = self.forward_backward(inputs, targets, rows, t, global_tokens)?;
        self.fsdp.optimizer_step()?;
        Ok(loss)
    }
}

/// This rank's share of a pass's loss on its way to the host
/// ([`EngineGpt::forward_backward_pending`]).
pub struct PendingLoss<O: GptOps> {
    copy: O::ScalarsCopy,
    /// The pass's tokens over the global batch's.
    share: f64,
    /// The pass's marks when tracing.
    marks: Option<StepMarks<O::Mark>>,
}
