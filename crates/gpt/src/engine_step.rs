//! A training step of the GPT on the engine whose end the engine decides
//! ([`Fsdp::optimizer_step_if_finite`]): the passes add this rank's share of the step's loss
//! into a buffer of the engine's device ([`StepLoss`], by the kernels' `loss_accumulate`), the
//! gradients are clipped there, and the optimizer step applies there only if the loss and the
//! norm are finite. On a device nothing is waited for: [`EngineGpt::train_step`] returns the
//! outcome of the step before (one step late), as `fsdp train --device` reads its outcomes.

use std::collections::VecDeque;

use fsdp::engine::StepOutcome;
#[cfg(doc)]
use fsdp::Fsdp;
use fsdp::FsdpError;
use fsdp_device::{Buffer, DType};
use fsdp_kernels::host::step_scalars_len;

use crate::data::Batch;
use crate::device_config::DeviceTrainError;
use crate::device_trace::StepMarks;
use crate::engine_gpt::EngineGpt;
use crate::engine_views::EngineViews;

/// This rank's share of a step's loss, in the engine's memory (on its device, or on the host):
/// each pass of the step adds its share ([`EngineGpt::forward_backward_into`]); hand
/// [`buffer`](Self::buffer) to [`Fsdp::optimizer_step_if_finite`].
pub struct StepLoss<M> {
    /// `f64` step scalars, the first the loss (an `f32` value).
    buf: Buffer,
    passes: usize,
    /// The traced passes' marks.
    marks: Vec<StepMarks<M>>,
}

impl<M> StepLoss<M> {
    /// The loss: one `f64` element.
    ///
    /// # Errors
    /// None in practice (a slice of the buffer's first element).
    pub fn buffer(&self) -> Result<Buffer, DeviceTrainError> {
        Ok(self.buf.slice(0..1).map_err(FsdpError::from)?)
    }

    /// Passes added so far.
    pub fn passes(&self) -> usize {
        self.passes
    }
}

/// The traced steps' marks whose outcomes are not read yet, oldest first.
pub(crate) type LateMarks<M> = VecDeque<Vec<StepMarks<M>>>;

impl<O: EngineViews> EngineGpt<O> {
    /// A step's loss of 0, in the engine's memory.
    ///
    /// # Errors
    /// A failing allocation.
    pub fn step_loss(&self) -> Result<StepLoss<O::Mark>, DeviceTrainError> {
        let len = step_scalars_len(0);
        let buf = match self.fsdp.compute_device() {
            Some(dev) => {
                let c = dev.compute_stream();
                let b = dev.alloc(DType::F64, len, c)?;
                dev.zero(&b, c)?;
                b
            }
            None => Buffer::zeros(DType::F64, len).map_err(FsdpError::from)?,
        };
        Ok(StepLoss {
            buf,
            passes: 0,
            marks: Vec::new(),
        })
    }

    /// [`forward_backward`](Self::forward_backward) whose loss stays in the engine's memory:
    /// this pass's share of the global loss is added into `loss` (on the device: nothing is
    /// waited for). `global_tokens` must be a multiple of the pass's `rows · t` tokens (the
    /// share is the pass's mean divided by their quotient, as the kernels' `loss_accumulate`
    /// divides by the micro-batches).
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward); `global_tokens` not a multiple of the
    /// pass's tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward_into(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        global_tokens: usize,
        loss: &mut StepLoss<O::Mark>,
    ) -> Result<(), DeviceTrainError> {
        let tokens = rows * t;
        let parts = match global_tokens.checked_rem(tokens) {
            Some(0) => u32::try_from(global_tokens / tokens).ok(),
            _ => None,
        };
        let Some(parts) = parts else {
            return Err(DeviceTrainError::Fsdp(FsdpError::InvalidShape {
                reason: format!(
                    "global_tokens {global_tokens} is not a multiple of the pass's {rows} × {t} \
                     tokens (the loss's share is the pass's mean over their quotient)"
                ),
            }));
        };
        let r = self
            .pass_losses(inputs, targets, rows, t, global_tokens)
            .and_then(|(losses, marks)| {
                let stream = self
                    .fsdp
                    .compute_device()
                    .map(|d| d.compute_stream().clone());
                let ops = self.pass.ops();
                ops.loss_into(&losses, parts, loss.passes == 0, &loss.buf, stream.as_ref())?;
                loss.passes += 1;
                loss.marks.extend(marks);
                Ok(())
            });
        self.aborted_on_error(r)
    }

    /// One training step of this rank's micro-batches `batches` (gradients accumulated under
    /// `no_sync` but for the last), each part of a global batch of `global_tokens` tokens:
    /// the passes ([`forward_backward_into`](Self::forward_backward_into)), clipping to `clip`
    /// ([`Fsdp::clip_grad_norm_async`]) and [`Fsdp::optimizer_step_if_finite`] — on a device
    /// nothing waited for. Returns the outcomes read now ([`Fsdp::step_outcomes`]): on a device
    /// the step before's (one step late), on the host (or offloaded) this one's. Every rank
    /// must call it.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward), [`Fsdp::clip_grad_norm_async`] and
    /// [`Fsdp::optimizer_step_if_finite`]; no batch.
    pub fn train_step(
        &mut self,
        batches: &[Batch],
        global_tokens: usize,
        clip: Option<f64>,
    ) -> Result<Vec<StepOutcome>, DeviceTrainError> {
        if batches.is_empty() {
            return Err(DeviceTrainError::Fsdp(FsdpError::InvalidShape {
                reason: "a training step needs at least one micro-batch".into(),
            }));
        }
        let mut loss = self.step_loss()?;
        for (m, b) in batches.iter().enumerate() {
            let before = self.fsdp.set_no_sync(m + 1 < batches.len());
            let (rows, t) = (b.shape.rows, b.shape.seq_len);
            let r = self.forward_backward_into(
                &b.inputs,
                &b.targets,
                rows,
                t,
                global_tokens,
                &mut loss,
            );
            self.fsdp.set_no_sync(before);
            r?;
        }
        if let Some(c) = clip {
            // The norm reaches the host in the step's outcome.
            drop(self.fsdp.clip_grad_norm_async(c)?);
        }
        self.fsdp.optimizer_step_if_finite(&loss.buffer()?)?;
        self.late_marks.push_back(std::mem::take(&mut loss.marks));
        let outcomes = self.fsdp.step_outcomes()?;
        self.record_late_marks(self.unread_outcomes())?;
        Ok(outcomes)
    }

    /// The outcomes of [`train_step`](Self::train_step)'s steps not returned yet, the last
    /// one's too (a wait for the device).
    ///
    /// # Errors
    /// As [`Fsdp::flush_step_outcomes`].
    pub fn flush_steps(&mut self) -> Result<Vec<StepOutcome>, DeviceTrainError> {
        let outcomes = self.fsdp.flush_step_outcomes()?;
        self.record_late_marks(0)?;
        Ok(outcomes)
    }

    /// Steps whose outcomes are not read: one on a device after a step, none on the host.
    fn unread_outcomes(&self) -> usize {
        usize::from(self.fsdp.compute_device().is_some() && !self.fsdp.config().offload_params)
    }

    /// Record the traced marks of the steps whose outcomes were read (all but `unread`).
    fn record_late_marks(&mut self, unread: usize) -> Result<(), DeviceTrainError> {
        while self.late_marks.len() > unread {
            if let Some(marks) = self.late_marks.pop_front() {
                for m in marks {
                    self.trace_record(Some(m))?;
                }
            }
        }
        Ok(())
    }
}

impl<M> std::fmt::Debug for StepLoss<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepLoss")
            .field("passes", &self.passes)
            .finish()
    }
}
