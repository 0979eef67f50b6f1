//! `--trace` of the [`DeviceTrainer`]: each step's parts on the device's timeline (the model's
//! marks — embeddings, each block's forward and backward, the head — then the gradients'
//! accumulation and the optimizer step), turned into the engine's [`TraceEvent`]s once the
//! step's outcome is read, so that tracing adds no wait. Times are the device's
//! ([`GptOps::elapsed_us`] from a mark recorded when tracing began, the device idle), placed
//! on the trace's clock ([`now_us`]) at that moment.

use fsdp::trace::{now_us, SpanKind, TraceEvent};
use fsdp_kernels::gpt::GptOps;
use fsdp_kernels::KernelError;

use crate::device_train::{DeviceTrainError, DeviceTrainer};

/// The trainer's trace: where the device's timeline meets the trace's clock, and the events.
pub(crate) struct Tracing<M> {
    anchor: M,
    anchor_us: f64,
    events: Vec<TraceEvent>,
    /// The marks of the step being enqueued.
    step: Option<StepMarks<M>>,
}

/// The marks of one step: where it began, and each part's kind, name, micro-batch (from 1)
/// and end.
pub(crate) struct StepMarks<M> {
    begin: M,
    spans: Vec<(SpanKind, String, u64, M)>,
}

impl<O: GptOps> DeviceTrainer<O> {
    /// Trace every step from now on (`true`) or none (`false`, the default): see
    /// [`trace_events`](Self::trace_events). Turning it on waits once for the device to be
    /// idle, to place its timeline on the trace's clock.
    ///
    /// # Errors
    /// [`DeviceTrainError::Unread`] while an enqueued step is unread; device failures.
    pub fn set_tracing(&mut self, on: bool) -> Result<(), DeviceTrainError> {
        if let Some(p) = &self.pending {
            return Err(DeviceTrainError::Unread { step: p.step });
        }
        self.model.set_tracing(on);
        self.tracing = if on {
            let ops = self.model.ops();
            ops.wait_scalars(ops.copy_scalars(&self.scalars)?)?;
            Some(Tracing {
                anchor: ops.mark()?,
                anchor_us: now_us(),
                events: Vec::new(),
                step: None,
            })
        } else {
            None
        };
        Ok(())
    }

    /// The spans of the traced steps whose outcomes were read, in order, on the compute track
    /// of rank 0 (write them with [`fsdp::trace::write_chrome_trace`]): each micro-batch's
    /// embeddings, block forwards, head and block backwards (`step`: the micro-batch, from 1),
    /// the accumulation of its gradients, and each step's optimizer step (kind `optimizer`).
    pub fn trace_events(&self) -> Vec<TraceEvent> {
        self.tracing
            .as_ref()
            .map(|t| t.events.clone())
            .unwrap_or_default()
    }

    /// When tracing, marks the beginning of a step.
    pub(crate) fn trace_begin(&mut self) -> Result<(), KernelError> {
        if let Some(t) = &mut self.tracing {
            t.step = Some(StepMarks {
                begin: self.model.ops().mark()?,
                spans: Vec::new(),
            });
        }
        Ok(())
    }

    /// When tracing, takes the model's marks of micro-batch `micro` (from 1).
    pub(crate) fn trace_model(&mut self, micro: u64) {
        if let Some(StepMarks { spans, .. }) = self.tracing.as_mut().and_then(|t| t.step.as_mut()) {
            for s in self.model.take_marks() {
                let kind = if s.backward {
                    SpanKind::Backward
                } else {
                    SpanKind::Forward
                };
                spans.push((kind, s.name, micro, s.mark));
            }
        }
    }

    /// When tracing, marks the end of the part `name` of micro-batch `micro`.
    pub(crate) fn trace_span(
        &mut self,
        kind: SpanKind,
        name: &str,
        micro: u64,
    ) -> Result<(), KernelError> {
        if let Some(StepMarks { spans, .. }) = self.tracing.as_mut().and_then(|t| t.step.as_mut()) {
            spans.push((kind, name.to_string(), micro, self.model.ops().mark()?));
        }
        Ok(())
    }

    /// The marks of the step just enqueued.
    pub(crate) fn trace_take(&mut self) -> Option<StepMarks<O::Mark>> {
        self.tracing.as_mut().and_then(|t| t.step.take())
    }

    /// The spans of a step whose outcome was read (its marks are reached).
    pub(crate) fn trace_record(&mut self, marks: StepMarks<O::Mark>) -> Result<(), KernelError> {
        let ops = self.model.ops();
        let Some(t) = &mut self.tracing else {
            return Ok(());
        };
        let at = |m: &O::Mark| -> Result<f64, KernelError> {
            Ok(t.anchor_us + ops.elapsed_us(&t.anchor, m)?)
        };
        let mut begin_us = at(&marks.begin)?;
        let mut events = Vec::with_capacity(marks.spans.len());
        for (kind, name, step, m) in &marks.spans {
            let end_us = at(m)?;
            events.push(TraceEvent::Span {
                kind: *kind,
                name: name.clone(),
                step: *step,
                units: Vec::new(),
                begin_us,
                end_us,
                bytes: None,
            });
            begin_us = end_us;
        }
        t.events.extend(events);
        Ok(())
    }
}
