//! The state of steps decided on the device ([`Fsdp::new_on`](crate::Fsdp::new_on) without `offload_params`): with a
//! grad scaler, or with the non-finite rule of [`Fsdp::optimizer_step_if_finite`](crate::Fsdp::optimizer_step_if_finite), the end of a
//! step is decided in device memory, so a step never waits on the host for `found_inf` or for
//! the loss and the norm, as PyTorch's fused optimizers take `found_inf` and `grad_scale` as
//! tensors and skip on the GPU.
//!
//! The backward scales by the device's scale, the unscaling multiplies by its reciprocal there
//! and sums the squares of the unscaled gradient shards (the sharded part all-reduced over the
//! shard group on the device), and the optimizer step issues the decision (overflow,
//! non-finite loss or norm, skip or step, the scale's update:
//! [`ComputeDevice::engine_decide`]) and an optimizer step that applies as it says
//! (`StepPlan::Decided`, `decided_step.rs`). The host does not know whether the step applied,
//! so it offers the optimizer the scalars of two step numbers and learning rates: the device
//! counts the steps taken, and the host reads each decision's outcome (a copy of the state)
//! one step late — at most one outcome is unread when a decision is issued — and folds it into
//! its step counts. Readers of those counts and of the scaler's numbers
//! ([`Fsdp::optimizer_steps`](crate::Fsdp::optimizer_steps), [`Fsdp::lr`](crate::Fsdp::lr), [`GradScaler::scale`], checkpoints) wait for the
//! outcomes not read yet, as PyTorch's `.item()` does.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use fsdp_collectives::Work;
use fsdp_device::{host_task, Buffer, DType, Event, Stream};

use super::decided_step::StepOutcome;
use super::device::{ComputeDevice, Kind};
use super::device_kernels::{read, write};
use super::device_scalar::DeviceScalar;
use super::grad_scaler::{next_scale, GradScaler, GradScalerConfig, GradScalerState};
use crate::FsdpError;

/// The slots of the scaler's `f64` state buffer: `fsdp-kernels`' step scalars (its `STEP_*`
/// constants, checked equal at compile time with the feature `cuda`).
pub(crate) mod slot {
    /// The step's loss summed over the world (an `f32` value; with the non-finite rule).
    pub(crate) const LOSS: usize = 0;
    /// The gradients' global norm.
    pub(crate) const GRAD_NORM: usize = 1;
    /// 1 when the gradients are clipped by the decision (always 0 here).
    pub(crate) const CLIPPED: usize = 2;
    /// 1 when the optimizer step applies.
    pub(crate) const APPLIED: usize = 4;
    /// Which of the two choices applies: the steps counted before it minus the host's base.
    pub(crate) const CHOICE: usize = 5;
    /// Optimizer steps taken.
    pub(crate) const COUNT: usize = 6;
    /// Non-finite steps seen by the non-finite rule.
    pub(crate) const NONFINITE: usize = 7;
    /// 1 once the non-finite rule's limit was passed: no later step applies.
    pub(crate) const HALTED: usize = 8;
    /// 1 when the steps counted were not among the host's choices (nothing applied).
    pub(crate) const FAULT: usize = 9;
    /// The scale (an `f32` value).
    pub(crate) const SCALE: usize = 10;
    /// The factor the decided optimizers unscale by (always 0 here: none).
    pub(crate) const UNSCALE: usize = 11;
    /// 1 when the step's gradients overflowed.
    pub(crate) const FOUND_INF: usize = 12;
    /// The growth tracker.
    pub(crate) const GROWTH_TRACKER: usize = 13;
    /// Steps skipped for an overflow.
    pub(crate) const SCALER_SKIPPED: usize = 14;
    /// The buffer's length.
    pub(crate) const LEN: usize = 15;
}

#[cfg(feature = "cuda")]
const _: () = {
    use fsdp_kernels::host as k;
    assert!(
        slot::LOSS == k::STEP_LOSS
            && slot::GRAD_NORM == k::STEP_GRAD_NORM
            && slot::NONFINITE == k::STEP_NONFINITE
            && slot::HALTED == k::STEP_HALTED
            && slot::CLIPPED == k::STEP_CLIPPED
            && slot::APPLIED == k::STEP_APPLIED
            && slot::CHOICE == k::STEP_CHOICE
            && slot::COUNT == k::STEP_COUNT
            && slot::FAULT == k::STEP_FAULT
            && slot::SCALE == k::STEP_SCALE
            && slot::UNSCALE == k::STEP_UNSCALE
            && slot::FOUND_INF == k::STEP_FOUND_INF
            && slot::GROWTH_TRACKER == k::STEP_GROWTH_TRACKER
            && slot::SCALER_SKIPPED == k::STEP_SCALER_SKIPPED
            && slot::LEN == k::STEP_SQUARES
            && k::STEP_CHOICES == 2
    );
};

/// The scaler's numbers, the optimizer steps counted and the non-finite rule's count, as a
/// decision left them, and what it decided.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Outcome {
    pub(crate) scaler: GradScalerState,
    pub(crate) count: u64,
    /// Non-finite steps the rule saw so far.
    pub(crate) nonfinite: u64,
    /// The rule's limit was passed.
    pub(crate) halted: bool,
    /// The decision's step.
    pub(crate) step: StepOutcome,
}

impl Outcome {
    /// The outcome before any decision, with these numbers carried over.
    pub(crate) fn start(scaler: GradScalerState, count: u64, nonfinite: u64, halted: bool) -> Self {
        Outcome {
            scaler,
            count,
            nonfinite,
            halted,
            step: StepOutcome::default(),
        }
    }

    /// The state buffer's initial elements for these numbers.
    fn to_state(self) -> Vec<f64> {
        let mut s = vec![0.0; slot::LEN];
        s[slot::SCALE] = f64::from(self.scaler.scale);
        s[slot::GROWTH_TRACKER] = f64::from(self.scaler.growth_tracker);
        s[slot::SCALER_SKIPPED] = self.scaler.skipped_steps as f64;
        s[slot::COUNT] = self.count as f64;
        s[slot::NONFINITE] = self.nonfinite as f64;
        s[slot::HALTED] = f64::from(u8::from(self.halted));
        s
    }

    /// The numbers a state read back holds.
    ///
    /// # Errors
    /// A decision that marked a fault (the host's step count was off: a bug).
    fn of_state(s: &[f64]) -> Result<Self, FsdpError> {
        if s[slot::FAULT] != 0.0 {
            return Err(super::comm_context::internal(
                "the device counted optimizer steps beyond the two the host offered",
            ));
        }
        Ok(Outcome {
            scaler: GradScalerState {
                scale: s[slot::SCALE] as f32,
                growth_tracker: s[slot::GROWTH_TRACKER] as u32,
                skipped_steps: s[slot::SCALER_SKIPPED] as u64,
            },
            count: s[slot::COUNT] as u64,
            nonfinite: s[slot::NONFINITE] as u64,
            halted: s[slot::HALTED] != 0.0,
            step: StepOutcome {
                loss: s[slot::LOSS] as f32,
                grad_norm: s[slot::GRAD_NORM],
                applied: s[slot::APPLIED] != 0.0,
                found_inf: s[slot::FOUND_INF] != 0.0,
                halted: s[slot::HALTED] != 0.0,
            },
        })
    }
}

/// A decision's outcome on its way to host memory.
#[derive(Debug)]
struct Readback {
    host: Buffer,
    copied: Event,
    /// The all-reduces the decision read (the squares', the loss's).
    work: Vec<Work>,
    /// A decision of [`Fsdp::optimizer_step_if_finite`](crate::Fsdp::optimizer_step_if_finite), whose outcome is reported.
    report: bool,
}

/// The outcomes not read yet, the last one read, and a failure to read one.
#[derive(Debug)]
struct Readbacks {
    pending: VecDeque<Readback>,
    latest: Outcome,
    failed: Option<FsdpError>,
    /// The outcomes of reported decisions read and not taken yet, oldest first.
    reported: Vec<StepOutcome>,
}

/// The state of decided steps on a device: a grad scaler's (its numbers in it), or the
/// non-finite rule's without one.
#[derive(Debug)]
pub(crate) struct DeviceScaler {
    /// `slot::LEN` `f64` elements on the device.
    pub(crate) state: Buffer,
    pub(crate) device: ComputeDevice,
    readbacks: Mutex<Readbacks>,
}

impl DeviceScaler {
    /// The state `at` uploaded to `dev`.
    pub(crate) fn new(dev: &ComputeDevice, at: Outcome) -> Result<Self, FsdpError> {
        let state =
            dev.copy_from_host(&Buffer::from_slice(&at.to_state())?, dev.compute_stream())?;
        Ok(DeviceScaler {
            state,
            device: dev.clone(),
            readbacks: Mutex::new(Readbacks {
                pending: VecDeque::new(),
                latest: at,
                failed: None,
                reported: Vec::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Readbacks> {
        self.readbacks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The scale of the next backward: a one-element view of the state.
    pub(crate) fn scale_view(&self) -> Result<Buffer, FsdpError> {
        Ok(self.state.slice(slot::SCALE..slot::SCALE + 1)?)
    }

    /// Copy the state to host memory after the decision just issued (which read what `work`
    /// all-reduced), without waiting; its outcome is `report`ed when read.
    pub(crate) fn push_readback(&self, work: Vec<Work>, report: bool) -> Result<(), FsdpError> {
        let dev = &self.device;
        let (host, copied) = dev.copy_to_host_event(&self.state, dev.transfer_stream())?;
        self.lock().pending.push_back(Readback {
            host,
            copied,
            work,
            report,
        });
        Ok(())
    }

    /// The reported outcomes read so far and not taken yet, oldest first.
    pub(crate) fn take_reported(&self) -> Vec<StepOutcome> {
        std::mem::take(&mut self.lock().reported)
    }

    /// Read the outcomes not read yet until at most `keep` remain; returns the latest read
    /// and whether the host had to wait for one.
    ///
    /// # Errors
    /// A failure to read an outcome (now or by an earlier reader): the collective's or the
    /// device's, a timeout, a fault of the count.
    pub(crate) fn settle(&self, keep: usize) -> Result<(Outcome, bool), FsdpError> {
        let mut r = self.lock();
        if let Some(e) = r.failed.take() {
            return Err(e);
        }
        let mut waited = false;
        while r.pending.len() > keep {
            let Some(b) = r.pending.pop_front() else {
                break;
            };
            waited |= !(b.copied.query() && b.work.iter().all(Work::is_completed));
            r.latest = self.read(&b)?;
            if b.report {
                let step = r.latest.step;
                r.reported.push(step);
            }
        }
        Ok((r.latest, waited))
    }

    /// [`settle`](Self::settle) with nothing left unread, for infallible readers: on a failure
    /// the last outcome read, the failure kept for the engine's next fallible call.
    pub(crate) fn settled(&self) -> Outcome {
        match self.settle(0) {
            Ok((o, _)) => o,
            Err(e) => {
                let mut r = self.lock();
                r.pending.clear();
                r.failed = Some(e);
                r.latest
            }
        }
    }

    /// Whether a step's unscaled gradients overflowed: their sums of squares (`sharded`,
    /// all-reduced by `work`, and `replicated`) are not finite. Read with a wait on the host.
    ///
    /// # Errors
    /// The failure of the collective or of the device's work; a timeout.
    pub(crate) fn found_inf(
        &self,
        sharded: &Buffer,
        replicated: &Buffer,
        work: Option<Work>,
    ) -> Result<bool, FsdpError> {
        let dev = &self.device;
        let c = dev.compute_stream();
        let out = dev.alloc(DType::F64, 2, c)?;
        dev.clip_coefficient(sharded, replicated, f64::INFINITY, &out, c)?;
        let norm = DeviceScalar::pending(dev, &out.slice(0..1)?, work)?.value()?;
        Ok(!norm.is_finite())
    }

    /// One outcome, waited for.
    fn read(&self, b: &Readback) -> Result<Outcome, FsdpError> {
        for w in &b.work {
            w.synchronize()?;
        }
        let dev = &self.device;
        let timeout: Duration = dev
            .transfer_stream()
            .timeout()
            .max(dev.compute_stream().timeout());
        b.copied.synchronize_timeout(timeout)?;
        dev.check()?;
        Outcome::of_state(&b.host.to_vec::<f64>()?)
    }
}

impl ComputeDevice {
    /// `x *= 1 / scale[0]` on `stream`, `x` an `f32` gradient shard and `scale` a one-element
    /// `f64` buffer (the state's scale): the reciprocal in `f64` rounded to `f32`
    /// ([`GradScaler::inv_scale`]), each product rounded once.
    ///
    /// # Errors
    /// Buffers that are not on this device; the stream's errors.
    pub(crate) fn unscale_by(
        &self,
        x: &Buffer,
        scale: &Buffer,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        match self.kind {
            Kind::Meta => Ok(()),
            Kind::HostTwin => {
                self.delay(stream)?;
                host_task(stream, &[scale], &[x], |r, w| {
                    let inv = GradScaler::inv_of(read::<f64>(&r[0])?[0] as f32);
                    write::<f32>(&mut w[0])?.iter_mut().for_each(|v| *v *= inv);
                    Ok(())
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => {
                fsdp_kernels::launch::unscale_by_buffer(x, scale, stream)
                    .map_err(super::device_kernels::cuda::kernel("unscale kernel"))?;
                Ok(())
            }
        }
    }

    /// The end of a step decided on the device, into the decisions' `state` on `stream`
    /// (`fsdp-kernels`' `engine_decide`): the gradients' norm from `sharded + replicated`
    /// (one-element `f64` buffers, their squares' sums); with a grad scaler they overflowed
    /// when that sum is not finite; with the non-finite rule the step's `loss` (one `f64`
    /// element, summed over the world) and norm are checked, a non-finite step counted and
    /// not applied, and past the rule's limit no step applies any more; the optimizer step
    /// applies when it is `take`n, finite, did not overflow and the steps counted are `base`
    /// or `base + 1` (the choice; else a fault), and is counted; an overflow is counted as a
    /// skip and backs the scale off, an applied step counts towards growth
    /// ([`GradScaler::update`]'s arithmetic).
    ///
    /// # Errors
    /// Buffers that are not on this device; the stream's errors.
    pub(crate) fn engine_decide(
        &self,
        d: &Decision,
        state: &Buffer,
        sums: [&Buffer; 2],
        loss: Option<&Buffer>,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        match self.kind {
            Kind::Meta => Ok(()),
            Kind::HostTwin => {
                self.delay(stream)?;
                let d = *d;
                let mut reads = vec![sums[0], sums[1]];
                reads.extend(loss);
                host_task(stream, &reads, &[state], move |r, w| {
                    let (sh, re) = (read::<f64>(&r[0])?[0], read::<f64>(&r[1])?[0]);
                    let loss = match r.get(2) {
                        Some(l) => read::<f64>(l)?[0],
                        None => 0.0,
                    };
                    decide(&d, sh, re, loss, write(&mut w[0])?);
                    Ok(())
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => {
                use fsdp_kernels::host::{EngineDecision, NonfiniteRule, ScalerRule};
                let decision = EngineDecision {
                    scaler: d.scaler.map(|c| ScalerRule {
                        growth_factor: c.growth_factor,
                        backoff_factor: c.backoff_factor,
                        growth_interval: c.growth_interval,
                    }),
                    nonfinite: d.nonfinite.map(|skip_limit| NonfiniteRule { skip_limit }),
                    base_steps: d.base,
                    take: d.take,
                };
                fsdp_kernels::launch::engine_decide_buffers(
                    &decision, state, sums[0], sums[1], loss, stream,
                )
                .map_err(super::device_kernels::cuda::kernel(
                    "the engine's decision kernel",
                ))?;
                Ok(())
            }
        }
    }
}

/// What a decision on the device decides by (`fsdp-kernels`' `EngineDecision`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Decision {
    /// The grad scaler's settings, with one.
    pub(crate) scaler: Option<GradScalerConfig>,
    /// The non-finite rule, with its limit (`Some(None)`: none).
    pub(crate) nonfinite: Option<Option<u64>>,
    /// The optimizer steps the host knows were taken.
    pub(crate) base: u64,
    /// An optimizer step, or a skip.
    pub(crate) take: bool,
}

/// The decision on the host twin, on the state `s`: what `engine_decide` computes, with the
/// engine's own scale update ([`next_scale`]).
fn decide(d: &Decision, sharded: f64, replicated: f64, loss: f64, s: &mut [f64]) {
    let sum = sharded + replicated;
    let norm = sum.sqrt();
    s[slot::GRAD_NORM] = norm;
    let found_inf = d.scaler.is_some() && !sum.is_finite();
    let mut finite = true;
    if let Some(limit) = d.nonfinite {
        s[slot::LOSS] = loss;
        finite = (loss as f32).is_finite() && (found_inf || norm.is_finite());
        if !finite {
            s[slot::NONFINITE] += 1.0;
            if limit.is_some_and(|k| s[slot::NONFINITE] > k as f64) {
                s[slot::HALTED] = 1.0;
            }
        }
    }
    let choice = s[slot::COUNT] - d.base as f64;
    let in_range = choice == 0.0 || choice == 1.0;
    s[slot::FAULT] = if in_range { 0.0 } else { 1.0 };
    s[slot::CHOICE] = if in_range { choice } else { 0.0 };
    let applied = d.take && finite && !found_inf && s[slot::HALTED] == 0.0 && in_range;
    s[slot::APPLIED] = if applied { 1.0 } else { 0.0 };
    if applied {
        s[slot::COUNT] += 1.0;
    }
    s[slot::FOUND_INF] = if found_inf { 1.0 } else { 0.0 };
    s[slot::UNSCALE] = 0.0;
    s[slot::CLIPPED] = 0.0;
    if let Some(config) = d.scaler.filter(|_| found_inf || applied) {
        if found_inf {
            s[slot::SCALER_SKIPPED] += 1.0;
        }
        let (scale, tracker) = next_scale(
            &config,
            s[slot::SCALE] as f32,
            s[slot::GROWTH_TRACKER] as u32,
            found_inf,
        );
        s[slot::SCALE] = f64::from(scale);
        s[slot::GROWTH_TRACKER] = f64::from(tracker);
    }
}
