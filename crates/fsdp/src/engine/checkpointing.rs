//! Activation checkpointing and the activation memory of an engine-driven model.
//!
//! # Checkpointing (FSDP2 with `checkpoint` applied per block)
//!
//! A model driven by [`Fsdp::forward_backward`] keeps what its spans' forwards save for their
//! backwards in its [`FsdpModel::Tape`]. With activation checkpointing on for a unit, each span
//! that reads only checkpointed units — and that the model can recompute
//! ([`FsdpModel::checkpointable`]) — is run so that only its input is kept:
//!
//! 1. forward: [`FsdpModel::forward`], then [`FsdpModel::discard_saved`], which drops what the
//!    span saved for its backward except what its recomputation needs (its input);
//! 2. backward: after the unit's pre-backward hook (its parameters unsharded for backward),
//!    [`FsdpModel::recompute`] re-runs the span's forward from the kept input with those same
//!    parameter views, restoring exactly what the forward saved, and then
//!    [`FsdpModel::backward`] runs as without checkpointing.
//!
//! Recomputation issues no collective: it reads the parameters the backward all-gather already
//! brought (FSDP2's behaviour, where the recomputed forward of a checkpointed block runs inside
//! the block's backward, after its pre-backward unshard). The schedule — every all-gather,
//! free, reduce-scatter and all-reduce, their order and prefetch flags — is therefore the same
//! with and without checkpointing, and so are the results, bitwise: the recomputed activations
//! are the forward's own (same inputs, same parameters, same code). Only the memory changes.
//!
//! Turn it on for every unit with [`FsdpConfig::activation_checkpointing`](super::FsdpConfig)
//! (`fsdp train
//! --activation-checkpointing`) or per unit with [`Fsdp::set_activation_checkpointing`]. A span
//! is checkpointed when it reads at least one unit, every unit it reads is checkpointed and the
//! model says it can be ([`FsdpModel::checkpointable`], default: no span): other spans (for the
//! GPT, the embedding and the head) run as before. Checkpointing is per span, so a unit of
//! several spans (two blocks in one unit) keeps each span's input and recomputes one span at a
//! time, right before that span's backward.
//!
//! # Activation memory
//!
//! **What is counted**: the bytes the model's tape holds, as the model measures them from its
//! buffers' lengths ([`FsdpModel::tape_bytes`]; default 0): for the GPT, every block's saved
//! activations (or its kept input when checkpointed), the head's saved activations (its input,
//! `ln_f` output and statistics, the softmax of the logits, the targets) and the activation or
//! gradient handed between spans. Scratch buffers that live only inside one span call (the
//! logits before the softmax, the gradient of the logits, the output of a recomputation) are not
//! counted. The engine reads the tape's size after every model call of a pass (each
//! `forward`, `discard_saved`, `recompute` and `backward`) and sets it to 0 when the pass drops
//! the tape.
//!
//! The engine keeps the current and peak tape bytes, and the peak of the rank's **allocated
//! bytes including activations**: the caching allocator's allocated bytes plus the tape's
//! bytes at the same moment, taken after every allocation (the engine's pool is wrapped by a
//! counting layer) and after every tape change ([`Fsdp::activation_stats`]). The allocator's
//! own statistics ([`Fsdp::memory_stats`]) are unchanged: the tape lives in host vectors, not in
//! allocator blocks.
//!
//! **Prediction**: the plan's dry run ([`crate::plan::plan_with_activations`],
//! [`Fsdp::dry_run_pass_with`]) has no tape; the model declares per span what its forward and
//! backward add to the tape and what a checkpointed span drops and recomputes
//! ([`SpanActivations`], computed from shapes), and the dry run applies these at the same
//! points of the same hook sequence. When the declaration matches the model's measurement (the
//! GPT's is tested to), the predicted activation peak and allocated-with-activations peak equal
//! the measured ones byte for byte.

use std::sync::{Arc, Mutex, PoisonError};

use fsdp_allocator::MemoryStats;
use fsdp_device::{Buffer, DType, Device, Stream};

use super::fsdp::Fsdp;
use super::model::{FsdpModel, SpanUnits};
use super::pool::MemoryPool;
use crate::FsdpError;

/// What one span does to the tape, in bytes, declared by the model from shapes (for dry runs:
/// [`Fsdp::dry_run_pass_with`], [`crate::plan::plan_with_activations`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpanActivations {
    /// The change of the tape's bytes by the span's forward: what it saves for backward and
    /// hands on, less what it takes from the tape (for example the input it moves into its
    /// saved activations).
    pub forward: i64,
    /// The change of the tape's bytes by the span's backward (usually negative: it drops what
    /// the forward saved).
    pub backward: i64,
    /// When the span can be checkpointed: the bytes [`FsdpModel::discard_saved`] drops after
    /// its forward and [`FsdpModel::recompute`] restores before its backward; `None` when it
    /// cannot (it then runs normally even in a checkpointed unit).
    pub recomputable: Option<u64>,
}

/// The activation memory of one rank (see the [module](self) documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ActivationStats {
    /// Bytes the model's tape holds now (0 between passes).
    pub current: u64,
    /// The most the tape held, since the engine was built or the peaks were last reset
    /// ([`Fsdp::reset_peak_memory_stats`]).
    pub peak: u64,
    /// The most of the allocator's allocated bytes plus the tape's bytes at the same moment,
    /// over the same period: the rank's peak allocated memory including activations (at least
    /// the allocator's `allocated_bytes.all.peak`).
    pub peak_allocated: u64,
    /// Checkpointed spans recomputed so far (one per checkpointed span per pass).
    pub recomputations: u64,
}

/// The shared counter of tape bytes (the counting arena), updated by the driver and by every
/// allocation of the wrapped pool.
#[derive(Debug, Default)]
pub(crate) struct ActivationMeter {
    stats: Mutex<ActivationStats>,
}

impl ActivationMeter {
    fn with<R>(&self, f: impl FnOnce(&mut ActivationStats) -> R) -> R {
        f(&mut self.stats.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The tape now holds `bytes`; the allocator holds `allocated`.
    fn set(&self, bytes: u64, allocated: u64) {
        self.with(|s| {
            s.current = bytes;
            s.peak = s.peak.max(bytes);
            s.peak_allocated = s.peak_allocated.max(allocated.saturating_add(bytes));
        });
    }

    /// An allocation left the allocator holding `allocated`.
    fn on_allocation(&self, allocated: u64) {
        self.with(|s| s.peak_allocated = s.peak_allocated.max(allocated.saturating_add(s.current)));
    }

    fn reset_peaks(&self, allocated: u64) {
        self.with(|s| {
            s.peak = s.current;
            s.peak_allocated = allocated.saturating_add(s.current);
        });
    }

    pub(crate) fn stats(&self) -> ActivationStats {
        self.with(|s| *s)
    }
}

/// The engine's pool: the caller's pool with every allocation reported to the meter, so that
/// the allocated-with-activations peak sees every allocation.
struct MeteredPool {
    inner: Arc<dyn MemoryPool>,
    meter: Arc<ActivationMeter>,
}

impl MeteredPool {
    fn allocated_now(&self) -> u64 {
        self.inner.memory_stats().allocated_bytes.all.current
    }
}

impl MemoryPool for MeteredPool {
    fn device(&self) -> Device {
        self.inner.device()
    }

    fn allocate(
        &self,
        dtype: DType,
        numel: usize,
        stream: &Stream,
        also_on: Option<&Stream>,
    ) -> Result<Buffer, FsdpError> {
        let b = self.inner.allocate(dtype, numel, stream, also_on)?;
        self.meter.on_allocation(self.allocated_now());
        Ok(b)
    }

    fn memory_stats(&self) -> MemoryStats {
        self.inner.memory_stats()
    }

    fn reset_peak_stats(&self) {
        self.inner.reset_peak_stats();
        self.meter.reset_peaks(self.allocated_now());
    }

    fn record_memory_history(&self, config: Option<fsdp_allocator::HistoryConfig>) {
        self.inner.record_memory_history(config);
    }

    fn snapshot(&self) -> Option<fsdp_allocator::Snapshot> {
        self.inner.snapshot()
    }
}

/// The engine's checkpointing choices and activation meter.
#[derive(Debug, Default)]
pub(crate) struct Activations {
    /// Per unit, when set by [`Fsdp::set_activation_checkpointing`] (else the configuration's
    /// [`activation_checkpointing`](super::FsdpConfig::activation_checkpointing) for every unit).
    units: Option<Vec<bool>>,
    meter: Arc<ActivationMeter>,
}

impl Activations {
    /// The meter and `pool` wrapped to report its allocations to it.
    pub(crate) fn wrap(pool: Arc<dyn MemoryPool>) -> (Arc<dyn MemoryPool>, Self) {
        let meter = Arc::new(ActivationMeter::default());
        let wrapped = MeteredPool {
            inner: pool,
            meter: Arc::clone(&meter),
        };
        (Arc::new(wrapped), Activations { units: None, meter })
    }
}

/// How one span runs in a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpanRun {
    Normal,
    Checkpointed,
}

impl Fsdp {
    /// Turn activation checkpointing on for exactly the units `units` (off for the others),
    /// replacing [`FsdpConfig::activation_checkpointing`](super::FsdpConfig) for this engine:
    /// from the next pass, [`forward_backward`](Self::forward_backward) keeps only the input of
    /// every span that reads only checkpointed units (and that the model can recompute) and
    /// recomputes its forward right before its backward, with no extra collective (see
    /// [`checkpointing`](crate::engine::checkpointing)). An empty list turns it off.
    ///
    /// # Errors
    /// [`FsdpError::InvalidFsdpConfig`] for a unit that does not exist.
    pub fn set_activation_checkpointing(
        &mut self,
        units: impl IntoIterator<Item = usize>,
    ) -> Result<(), FsdpError> {
        let n = self.num_units();
        let mut on = vec![false; n];
        for u in units {
            *on.get_mut(u).ok_or_else(|| FsdpError::InvalidFsdpConfig {
                reason: format!("activation checkpointing of unit {u}: the engine has {n} units"),
            })? = true;
        }
        self.activations.units = Some(on);
        Ok(())
    }

    /// The units whose spans are checkpointed, in order.
    pub fn activation_checkpointed_units(&self) -> Vec<usize> {
        (0..self.num_units())
            .filter(|&u| self.unit_checkpointed(u))
            .collect()
    }

    fn unit_checkpointed(&self, u: usize) -> bool {
        match &self.activations.units {
            Some(on) => on.get(u).copied().unwrap_or(false),
            None => self.ctx.config.activation_checkpointing,
        }
    }

    /// The activation memory of this rank: the model's tape now and at its peak, and the peak
    /// of the allocator's allocated bytes plus the tape's (see [`checkpointing`](crate::engine::checkpointing)).
    pub fn activation_stats(&self) -> ActivationStats {
        self.activations.meter.stats()
    }

    /// How each span runs: checkpointed when the model can recompute it (`recomputable`), it
    /// reads a unit and every unit it reads is checkpointed.
    pub(crate) fn span_runs(
        &self,
        su: &SpanUnits,
        recomputable: impl Fn(usize) -> bool,
    ) -> Vec<SpanRun> {
        su.units
            .iter()
            .enumerate()
            .map(|(s, us)| {
                let on = !us.is_empty()
                    && us.iter().all(|&u| self.unit_checkpointed(u))
                    && recomputable(s);
                if on {
                    SpanRun::Checkpointed
                } else {
                    SpanRun::Normal
                }
            })
            .collect()
    }

    /// The tape holds `bytes` now.
    pub(crate) fn note_tape(&self, bytes: u64) {
        let allocated = self.ctx.pool.memory_stats().allocated_bytes.all.current;
        self.activations.meter.set(bytes, allocated);
    }

    /// The tape of `model` holds what it measures now.
    pub(crate) fn note_model_tape<M: FsdpModel>(&self, model: &M, tape: &M::Tape) {
        self.note_tape(model.tape_bytes(tape));
    }

    /// A dry run's tape changes by `delta` bytes.
    fn change_tape(&self, tape: &mut u64, delta: i64) -> Result<(), FsdpError> {
        *tape = tape
            .checked_add_signed(delta)
            .ok_or_else(|| FsdpError::InvalidFsdpConfig {
                reason: format!(
                    "the declared activations go out of range ({} {delta:+} bytes)",
                    *tape
                ),
            })?;
        self.note_tape(*tape);
        Ok(())
    }

    /// One more recomputation.
    pub(crate) fn note_recompute(&self) {
        self.activations.meter.with(|s| s.recomputations += 1);
    }

    /// One pass of the hooks over `spans` with no computation (a dry run on the meta device,
    /// as [`dry_run_pass`](Self::dry_run_pass)), with the tape's bytes declared per span by
    /// `activations` (one per span; empty: no tape) applied where a real pass measures them,
    /// checkpointed spans included: the activation statistics
    /// ([`activation_stats`](Self::activation_stats)) then predict a real pass's.
    ///
    /// # Errors
    /// As [`dry_run_pass`](Self::dry_run_pass); [`FsdpError::InvalidFsdpConfig`] when
    /// `activations` is neither empty nor one per span, or when the declared bytes go below 0
    /// or above `u64::MAX`.
    pub fn dry_run_pass_with(
        &mut self,
        spans: &[super::Span],
        activations: &[SpanActivations],
    ) -> Result<(), FsdpError> {
        if !activations.is_empty() && activations.len() != spans.len() {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: format!(
                    "{} span activations declared for {} spans",
                    activations.len(),
                    spans.len()
                ),
            });
        }
        let su = self.span_units(spans)?;
        let runs = self.span_runs(&su, |s| {
            activations.get(s).is_some_and(|a| a.recomputable.is_some())
        });
        let declared = |s: usize| activations.get(s).copied().unwrap_or_default();
        let mut tape = 0u64;
        let recomputed = |s: usize| -> Result<i64, FsdpError> {
            let b = declared(s).recomputable.unwrap_or(0);
            i64::try_from(b).map_err(|_| FsdpError::InvalidFsdpConfig {
                reason: format!("span {s} declares {b} recomputable bytes, above i64::MAX"),
            })
        };
        for (s, &run) in runs.iter().enumerate() {
            for u in su.opens(s) {
                self.pre_forward(u)?;
            }
            self.change_tape(&mut tape, declared(s).forward)?;
            if run == SpanRun::Checkpointed {
                self.change_tape(&mut tape, -recomputed(s)?)?;
            }
            for u in su.closes(s) {
                self.post_forward(u)?;
            }
        }
        for (s, &run) in runs.iter().enumerate().rev() {
            for u in su.closes(s) {
                self.pre_backward(u)?;
            }
            if run == SpanRun::Checkpointed {
                self.change_tape(&mut tape, recomputed(s)?)?;
                self.note_recompute();
            }
            self.change_tape(&mut tape, declared(s).backward)?;
            for u in su.opens(s) {
                self.post_backward(u)?;
            }
        }
        self.note_tape(0);
        self.finalize_backward()
    }
}
