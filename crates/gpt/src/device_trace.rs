//! `--trace` of the [`DeviceTrainer`] (and of each rank of the
//! [`ShardedDeviceTrainer`](crate::device_sharded::ShardedDeviceTrainer)): each step's parts on the device's timeline (the model's
//! marks — embeddings, each block's forward and backward, the head — then the gradients'
//! accumulation and the optimizer step), turned into the engine's [`TraceEvent`]s once the
//! step's outcome is read, so that tracing adds no wait. Times are the device's
//! ([`GptOps::elapsed_us`] from a mark recorded when tracing began, the device idle), placed
//! on the trace's clock ([`now_us`]) at that moment.

use fsdp::trace::{now_us, SpanKind, TraceEvent};
use fsdp_kernels::gpt::{GptOps, SpanEnd};
use fsdp_kernels::KernelError;

use crate::device_comm::DeviceComm;
use crate::device_sharded::ShardedDeviceTrainer;
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

impl<M> Tracing<M> {
    /// A trace of `ops`' device whose timeline starts once the work issued there so far has
    /// run: the host waits for a copy of `scalars` issued now, so that the mark recorded then
    /// is reached at once and placed on the trace's clock.
    pub(crate) fn start_when_idle<O: GptOps<Mark = M>>(
        ops: &O,
        scalars: &O::Scalars,
    ) -> Result<Tracing<M>, KernelError> {
        ops.wait_scalars(ops.copy_scalars(scalars)?)?;
        Ok(Tracing {
            anchor: ops.mark()?,
            anchor_us: now_us(),
            events: Vec::new(),
            step: None,
        })
    }

    /// The spans recorded so far.
    pub(crate) fn events(&self) -> Vec<TraceEvent> {
        self.events.clone()
    }

    /// Marks the beginning of a step.
    pub(crate) fn begin<O: GptOps<Mark = M>>(&mut self, ops: &O) -> Result<(), KernelError> {
        self.step = Some(StepMarks {
            begin: ops.mark()?,
            spans: Vec::new(),
        });
        Ok(())
    }

    /// Takes a model's marks of micro-batch `micro` (from 1).
    pub(crate) fn model(&mut self, marks: Vec<SpanEnd<M>>, micro: u64) {
        if let Some(StepMarks { spans, .. }) = self.step.as_mut() {
            for s in marks {
                let kind = if s.backward {
                    SpanKind::Backward
                } else {
                    SpanKind::Forward
                };
                spans.push((kind, s.name, micro, s.mark));
            }
        }
    }

    /// Marks the end of the part `name` of micro-batch `micro`.
    pub(crate) fn span<O: GptOps<Mark = M>>(
        &mut self,
        ops: &O,
        kind: SpanKind,
        name: &str,
        micro: u64,
    ) -> Result<(), KernelError> {
        if let Some(StepMarks { spans, .. }) = self.step.as_mut() {
            spans.push((kind, name.to_string(), micro, ops.mark()?));
        }
        Ok(())
    }

    /// The marks of the step just enqueued.
    pub(crate) fn take(&mut self) -> Option<StepMarks<M>> {
        self.step.take()
    }

    /// The spans of a step whose outcome was read (its marks are reached).
    pub(crate) fn record<O: GptOps<Mark = M>>(
        &mut self,
        ops: &O,
        marks: StepMarks<M>,
    ) -> Result<(), KernelError> {
        let at = |m: &M| -> Result<f64, KernelError> {
            Ok(self.anchor_us + ops.elapsed_us(&self.anchor, m)?)
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
        self.events.extend(events);
        Ok(())
    }
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
            Some(Tracing::start_when_idle(self.model.ops(), &self.scalars)?)
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
            .map(Tracing::events)
            .unwrap_or_default()
    }

    /// When tracing, marks the beginning of a step.
    pub(crate) fn trace_begin(&mut self) -> Result<(), KernelError> {
        match &mut self.tracing {
            Some(t) => t.begin(self.model.ops()),
            None => Ok(()),
        }
    }

    /// When tracing, takes the model's marks of micro-batch `micro` (from 1).
    pub(crate) fn trace_model(&mut self, micro: u64) {
        if let Some(t) = &mut self.tracing {
            t.model(self.model.take_marks(), micro);
        }
    }

    /// When tracing, marks the end of the part `name` of micro-batch `micro`.
    pub(crate) fn trace_span(
        &mut self,
        kind: SpanKind,
        name: &str,
        micro: u64,
    ) -> Result<(), KernelError> {
        match &mut self.tracing {
            Some(t) => t.span(self.model.ops(), kind, name, micro),
            None => Ok(()),
        }
    }

    /// The marks of the step just enqueued.
    pub(crate) fn trace_take(&mut self) -> Option<StepMarks<O::Mark>> {
        self.tracing.as_mut().and_then(Tracing::take)
    }

    /// The spans of a step whose outcome was read (its marks are reached).
    pub(crate) fn trace_record(&mut self, marks: StepMarks<O::Mark>) -> Result<(), KernelError> {
        match &mut self.tracing {
            Some(t) => t.record(self.model.ops(), marks),
            None => Ok(()),
        }
    }
}

impl<O: GptOps, C: DeviceComm<O>> ShardedDeviceTrainer<O, C> {
    /// Trace this rank's steps from now on (`true`) or none (`false`, the default), as
    /// [`DeviceTrainer::set_tracing`]; the units' collectives are parts of their own
    /// (`unshard block 3`, `reduce block 3's gradients`, …).
    ///
    /// # Errors
    /// [`DeviceTrainError::Unread`] while an enqueued step is unread; device failures.
    pub fn set_tracing(&mut self, on: bool) -> Result<(), DeviceTrainError> {
        if let Some((step, ..)) = &self.pending {
            return Err(DeviceTrainError::Unread { step: *step });
        }
        self.pass.set_tracing(on);
        self.tracing = if on {
            Some(Tracing::start_when_idle(self.pass.ops(), &self.scalars)?)
        } else {
            None
        };
        Ok(())
    }

    /// This rank's spans of the traced steps whose outcomes were read, in order (see
    /// [`DeviceTrainer::trace_events`]).
    pub fn trace_events(&self) -> Vec<TraceEvent> {
        self.tracing
            .as_ref()
            .map(Tracing::events)
            .unwrap_or_default()
    }
}
