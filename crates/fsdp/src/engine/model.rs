//! The [`FsdpModel`] trait, for models that let the engine drive forward and backward, and the
//! driver [`Fsdp::forward_backward`].
//!
//! A model is a sequence of compute [`Span`]s in forward execution order; each span reads some
//! parameters (hence some units). The driver calls `pre_forward(u)` before the first span
//! that reads unit `u` and `post_forward(u)` after its last; in backward, which runs the spans
//! in reverse, `pre_backward(u)` before the first (the forward's last) and `post_backward(u)`
//! after the last (the forward's first). Activations pass between spans in the model's own
//! [`FsdpModel::Tape`]. Checkpointed spans keep only their input and are recomputed right
//! before their backward, and the tape's bytes are counted: see
//! [`checkpointing`](super::checkpointing).

use fsdp_device::{Buffer, DType};

use super::checkpointing::SpanRun;
use super::device::ComputeDevice;
use super::device_scalar::DeviceScalar;
use super::fsdp::Fsdp;
use crate::trace::SpanKind;
use crate::FsdpError;

/// This rank's loss of a pass: read on the host, or a buffer the model keeps on the device.
enum LocalLoss {
    Host(f32),
    Device(Buffer),
}

use super::views::{Grads, Params};

/// One compute span of a model: a name (for traces) and the parameters it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    /// A display name, e.g. `block 2`.
    pub name: String,
    /// The parameters the span reads (storage names: a tied alias by its target's name).
    pub params: Vec<String>,
}

impl Span {
    /// A span named `name` reading `params`.
    pub fn new<I, S>(name: impl Into<String>, params: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Span {
            name: name.into(),
            params: params.into_iter().map(Into::into).collect(),
        }
    }
}

/// A model the engine can drive (forward, loss, backward), span by span. Parameters are read
/// through [`Params`] and gradients written through [`Grads`], so the same model runs on the
/// engine's views of unsharded flat buffers and on plain maps (a single-process reference).
pub trait FsdpModel {
    /// What one forward/backward pass consumes (this rank's part of a batch).
    type Batch: ?Sized;
    /// The activations of one pass, handed between spans (a fresh `Default` per pass).
    type Tape: Default;

    /// The compute spans in forward execution order.
    fn spans(&self) -> Vec<Span>;

    /// Forward of span `span`.
    ///
    /// # Errors
    /// The model's errors.
    fn forward(
        &self,
        span: usize,
        params: &dyn Params,
        batch: &Self::Batch,
        tape: &mut Self::Tape,
    ) -> Result<(), FsdpError>;

    /// This rank's share of the loss, after the last span's forward. The driver returns the
    /// sum over ranks: normalise by the global batch (e.g. divide a sum of per-example losses
    /// by the global number of examples) so that the sum is the global mean.
    ///
    /// # Errors
    /// The model's errors.
    fn loss(&self, tape: &Self::Tape) -> Result<f32, FsdpError>;

    /// A model that computes on a device and keeps its loss there: this rank's share of the
    /// loss (as [`loss`](Self::loss)) as a one-element `f32` buffer on the device, written by
    /// the work issued in the last span's forward. [`Fsdp::forward_backward_async`] then sums it
    /// over the ranks on the device and hands it back without the host reading it. Default
    /// `None`: the engine reads [`loss`](Self::loss).
    ///
    /// # Errors
    /// The model's errors.
    fn loss_buffer(&self, tape: &Self::Tape) -> Result<Option<Buffer>, FsdpError> {
        let _ = tape;
        Ok(None)
    }

    /// Backward of span `span`: **add** the gradients of its parameters into `grads`, and hand
    /// the gradients of its inputs to the spans before it through the tape.
    ///
    /// # Errors
    /// The model's errors.
    fn backward(
        &self,
        span: usize,
        params: &dyn Params,
        grads: &mut dyn Grads,
        batch: &Self::Batch,
        tape: &mut Self::Tape,
    ) -> Result<(), FsdpError>;

    /// Whether span `span` can be checkpointed: [`discard_saved`](Self::discard_saved) and
    /// [`recompute`](Self::recompute) are implemented for it. Default: no span can (the
    /// engine then never checkpoints this model; see [`checkpointing`](super::checkpointing)).
    fn checkpointable(&self, span: usize) -> bool {
        let _ = span;
        false
    }

    /// Right after the [`forward`](Self::forward) of a checkpointed span: drop what it saved in
    /// the tape for its backward, keeping only what [`recompute`](Self::recompute) needs (its
    /// input). What it handed on to later spans stays.
    ///
    /// # Errors
    /// The model's errors; by default, that the span cannot be checkpointed.
    fn discard_saved(&self, span: usize, tape: &mut Self::Tape) -> Result<(), FsdpError> {
        let _ = tape;
        Err(not_checkpointable(span))
    }

    /// Right before the [`backward`](Self::backward) of a checkpointed span, with the same
    /// parameter views the backward gets (already unsharded for it: no collective): re-run the
    /// span's forward from the input [`discard_saved`](Self::discard_saved) kept, so that the
    /// tape holds exactly what the forward saved (bitwise, for bitwise equal results). What the
    /// forward handed on to later spans is not produced again (or is dropped).
    ///
    /// # Errors
    /// The model's errors; by default, that the span cannot be checkpointed.
    fn recompute(
        &self,
        span: usize,
        params: &dyn Params,
        batch: &Self::Batch,
        tape: &mut Self::Tape,
    ) -> Result<(), FsdpError> {
        let _ = (params, batch, tape);
        Err(not_checkpointable(span))
    }

    /// The bytes of activations `tape` holds now, measured from its buffers' lengths: what the
    /// spans saved for backward (or kept for recomputation) and what passes between spans.
    /// The engine counts it in its activation statistics
    /// ([`Fsdp::activation_stats`]). Default 0 (not counted).
    fn tape_bytes(&self, tape: &Self::Tape) -> u64 {
        let _ = tape;
        0
    }
}

fn not_checkpointable(span: usize) -> FsdpError {
    FsdpError::InvalidFsdpConfig {
        reason: format!("span {span} of the model cannot be checkpointed"),
    }
}

/// The units each span reads, and the first and last span of each unit.
pub(crate) struct SpanUnits {
    pub(crate) units: Vec<Vec<usize>>,
    first: Vec<usize>,
    last: Vec<usize>,
}

impl SpanUnits {
    pub(crate) fn opens(&self, s: usize) -> impl Iterator<Item = usize> + '_ {
        self.units[s]
            .iter()
            .copied()
            .filter(move |&u| self.first[u] == s)
    }

    pub(crate) fn closes(&self, s: usize) -> impl Iterator<Item = usize> + '_ {
        self.units[s]
            .iter()
            .copied()
            .filter(move |&u| self.last[u] == s)
    }
}

impl Fsdp {
    pub(crate) fn span_units(&self, spans: &[Span]) -> Result<SpanUnits, FsdpError> {
        let n = self.num_units();
        let mut units = Vec::with_capacity(spans.len());
        let (mut first, mut last) = (vec![usize::MAX; n], vec![0; n]);
        for (s, span) in spans.iter().enumerate() {
            let mut us = span
                .params
                .iter()
                .map(|p| self.unit_of(p))
                .collect::<Result<Vec<_>, _>>()?;
            us.sort_unstable();
            us.dedup();
            for &u in &us {
                first[u] = first[u].min(s);
                last[u] = s;
            }
            units.push(us);
        }
        Ok(SpanUnits { units, first, last })
    }

    /// One forward and backward pass of `model` on this rank's `batch`, driving the hooks
    /// around its spans. Outside [`no_sync`](Self::no_sync) the gradients are reduced and
    /// **added** into the gradient shards; inside, the unsharded gradients are kept and
    /// accumulate. Returns the sum over ranks of the model's [`loss`](FsdpModel::loss) (the same
    /// on every rank). Every rank must call it.
    ///
    /// # Errors
    /// The model's errors, a failing collective or allocation. After an error the unsharded
    /// buffers are dropped and the gradient shards may hold a partial accumulation: call
    /// [`zero_grad`](Self::zero_grad) before training on.
    pub fn forward_backward<M: FsdpModel>(
        &mut self,
        model: &M,
        batch: &M::Batch,
    ) -> Result<f32, FsdpError> {
        let local = self.forward_backward_local(model, batch)?;
        self.all_reduce_loss(local)
    }

    /// [`forward_backward`](Self::forward_backward) without the sum of the loss over the
    /// ranks: returns this rank's [`loss`](FsdpModel::loss). The sum is an all-reduce the host
    /// waits for, after the reductions issued before it; without it, a step with the shards on
    /// a device ([`Fsdp::new_on`]) never blocks the host, and the model may leave its loss on
    /// the device and read it later (one step late). Every rank must call it.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward).
    pub fn forward_backward_local<M: FsdpModel>(
        &mut self,
        model: &M,
        batch: &M::Batch,
    ) -> Result<f32, FsdpError> {
        match self.forward_backward_checked(model, batch, false)? {
            LocalLoss::Host(l) => Ok(l),
            LocalLoss::Device(_) => Err(super::comm_context::internal("a loss left on the device")),
        }
    }

    /// [`forward_backward`](Self::forward_backward) without the host waiting for the loss:
    /// with a model that keeps its loss on the device ([`FsdpModel::loss_buffer`]) and an
    /// engine on that device ([`Fsdp::new_on`]), the loss is summed over the ranks on the
    /// device and copied to host memory while the host goes on; read it with
    /// [`DeviceScalar::value`] when needed — one step late, the only read-back of a steady-state
    /// step. Otherwise the loss is summed on the host at once, as
    /// [`forward_backward`](Self::forward_backward) does. Every rank must call it.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward); a loss buffer that is not one `f32`
    /// on the device.
    pub fn forward_backward_async<M: FsdpModel>(
        &mut self,
        model: &M,
        batch: &M::Batch,
    ) -> Result<DeviceScalar, FsdpError> {
        let dev = self.ctx.device.clone();
        match (
            self.forward_backward_checked(model, batch, dev.is_some())?,
            dev,
        ) {
            (LocalLoss::Device(b), Some(dev)) => self.sum_loss_on_device(&dev, &b),
            (LocalLoss::Host(l), _) => Ok(DeviceScalar::from(f64::from(self.all_reduce_loss(l)?))),
            (LocalLoss::Device(_), None) => Err(super::comm_context::internal(
                "a device loss without a device",
            )),
        }
    }

    /// The loss `local` (this rank's, on the device) summed over the ranks there, into a new
    /// buffer (the model's is left alone), and copied to host memory without a wait.
    fn sum_loss_on_device(
        &self,
        dev: &ComputeDevice,
        local: &Buffer,
    ) -> Result<DeviceScalar, FsdpError> {
        if local.dtype() != DType::F32 || local.len() != 1 || local.stream_order().is_none() {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: format!(
                    "rank {}: the model's loss buffer is {} elements of {} on {}, not one f32 \
                     on the device",
                    self.rank(),
                    local.len(),
                    local.dtype(),
                    local.device()
                ),
            });
        }
        let c = dev.compute_stream();
        let sum = dev.alloc(DType::F32, 1, c)?;
        sum.copy_from_device_async(local, c)?;
        let work = self
            .ctx
            .sum_on_device(self.ctx.groups.world_multi(), &sum)?;
        DeviceScalar::pending(dev, &sum, work)
    }

    /// The pass, its loss read as `device_loss` asks (a model's loss buffer when it has one),
    /// the unsharded buffers dropped after a failure.
    fn forward_backward_checked<M: FsdpModel>(
        &mut self,
        model: &M,
        batch: &M::Batch,
        device_loss: bool,
    ) -> Result<LocalLoss, FsdpError> {
        let r = self.forward_backward_inner(model, batch, device_loss);
        if r.is_err() {
            self.abort_pass();
            // The pass's tape is gone.
            self.note_tape(0);
        }
        r
    }

    /// [`forward_backward`](Self::forward_backward) then the
    /// [`optimizer_step`](Self::optimizer_step).
    ///
    /// # Errors
    /// As those two.
    pub fn step<M: FsdpModel>(&mut self, model: &M, batch: &M::Batch) -> Result<f32, FsdpError> {
        let loss = self.forward_backward(model, batch)?;
        self.optimizer_step()?;
        Ok(loss)
    }

    fn forward_backward_inner<M: FsdpModel>(
        &mut self,
        model: &M,
        batch: &M::Batch,
        device_loss: bool,
    ) -> Result<LocalLoss, FsdpError> {
        let spans = model.spans();
        let su = self.span_units(&spans)?;
        let runs = self.span_runs(&su, |s| model.checkpointable(s));
        let mut tape = M::Tape::default();
        for (s, span) in spans.iter().enumerate() {
            for u in su.opens(s) {
                self.pre_forward(u)?;
            }
            let t0 = self.ctx.trace_begin();
            model.forward(s, &self.param_views(&su.units[s])?, batch, &mut tape)?;
            self.note_model_tape(model, &tape);
            if runs[s] == SpanRun::Checkpointed {
                model.discard_saved(s, &mut tape)?;
                self.note_model_tape(model, &tape);
            }
            self.ctx
                .trace_end(SpanKind::Forward, &span.name, &su.units[s], t0);
            for u in su.closes(s) {
                self.post_forward(u)?;
            }
        }
        let local = match device_loss.then(|| model.loss_buffer(&tape)).transpose()? {
            Some(Some(b)) => LocalLoss::Device(b),
            _ => LocalLoss::Host(model.loss(&tape)?),
        };
        for (s, span) in spans.iter().enumerate().rev() {
            for u in su.closes(s) {
                self.pre_backward(u)?;
            }
            {
                let p = self.param_views(&su.units[s])?;
                if runs[s] == SpanRun::Checkpointed {
                    // The units' parameters are unsharded for backward: recomputation reads
                    // them and issues no collective.
                    let t0 = self.ctx.trace_begin();
                    model.recompute(s, &p, batch, &mut tape)?;
                    self.note_recompute();
                    self.note_model_tape(model, &tape);
                    let name = format!("{} (recompute)", span.name);
                    self.ctx
                        .trace_end(SpanKind::Forward, &name, &su.units[s], t0);
                }
                let t0 = self.ctx.trace_begin();
                let mut g = self.grad_views(&su.units[s])?;
                model.backward(s, &p, &mut g, batch, &mut tape)?;
                drop(g);
                self.note_model_tape(model, &tape);
                self.ctx
                    .trace_end(SpanKind::Backward, &span.name, &su.units[s], t0);
            }
            for u in su.opens(s) {
                self.post_backward(u)?;
            }
        }
        drop(tape);
        self.note_tape(0);
        self.finalize_backward()?;
        Ok(local)
    }

    /// One pass of the hooks over `spans` with no computation (a dry run on the meta device:
    /// the allocations, collectives and frees of a real pass, in the same order).
    ///
    /// # Errors
    /// An unknown parameter, a failing allocation or collective.
    pub fn dry_run_pass(&mut self, spans: &[Span]) -> Result<(), FsdpError> {
        self.dry_run_pass_with(spans, &[])
    }
}
