//! The grad scaler with the shards on a device ([`Fsdp::new_on`] without `offload_params`):
//! its state lives in device memory, so a step never waits on the host for `found_inf`, as
//! PyTorch's fused optimizers take `found_inf` and `grad_scale` as tensors and skip on the
//! GPU.
//!
//! The backward scales by the device's scale, the unscaling multiplies by its reciprocal there
//! and sums the squares of the unscaled gradient shards (the sharded part all-reduced over the
//! shard group on the device), and [`Fsdp::optimizer_step`] issues the decision (overflow,
//! skip or step, the scale's update: [`ComputeDevice::scaler_decide`]) and an optimizer step
//! that applies as it says ([`StepPlan::Decided`]). The host does not know whether the step
//! applied, so it offers the optimizer the scalars of two step numbers and learning rates: the
//! device counts the steps taken, and the host reads each decision's outcome (a copy of the
//! state) one step late — at most one outcome is unread when a decision is issued — and folds
//! it into its step counts. Readers of those counts and of the scaler's numbers
//! ([`Fsdp::optimizer_steps`], [`Fsdp::lr`], [`GradScaler::scale`], checkpoints) wait for the
//! outcomes not read yet, as PyTorch's `.item()` does.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use fsdp_collectives::Work;
use fsdp_device::{host_task, Buffer, DType, Event, Stream};

use super::device::{ComputeDevice, Kind};
use super::device_kernels::{read, write};
use super::device_optim::StepPlan;
use super::device_scalar::DeviceScalar;
use super::fsdp::Fsdp;
use super::grad_scaler::{next_scale, GradScaler, GradScalerConfig, GradScalerState};
use crate::FsdpError;

/// The slots of the scaler's `f64` state buffer: `fsdp-kernels`' step scalars (its `STEP_*`
/// constants, checked equal at compile time with the feature `cuda`).
pub(crate) mod slot {
    /// 1 when the gradients are clipped by the decision (always 0 here).
    pub(crate) const CLIPPED: usize = 2;
    /// 1 when the optimizer step applies.
    pub(crate) const APPLIED: usize = 4;
    /// Which of the two choices applies: the steps counted before it minus the host's base.
    pub(crate) const CHOICE: usize = 5;
    /// Optimizer steps taken.
    pub(crate) const COUNT: usize = 6;
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
        slot::CLIPPED == k::STEP_CLIPPED
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

/// The scaler's numbers and the optimizer steps counted, as a decision left them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Outcome {
    pub(crate) scaler: GradScalerState,
    pub(crate) count: u64,
}

impl Outcome {
    /// The state buffer's initial elements for these numbers.
    fn to_state(self) -> Vec<f64> {
        let mut s = vec![0.0; slot::LEN];
        s[slot::SCALE] = f64::from(self.scaler.scale);
        s[slot::GROWTH_TRACKER] = f64::from(self.scaler.growth_tracker);
        s[slot::SCALER_SKIPPED] = self.scaler.skipped_steps as f64;
        s[slot::COUNT] = self.count as f64;
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
        })
    }
}

/// A decision's outcome on its way to host memory.
#[derive(Debug)]
struct Readback {
    host: Buffer,
    copied: Event,
    /// The all-reduce of the squares the decision read.
    work: Option<Work>,
}

/// The outcomes not read yet, the last one read, and a failure to read one.
#[derive(Debug)]
struct Readbacks {
    pending: VecDeque<Readback>,
    latest: Outcome,
    failed: Option<FsdpError>,
}

/// A grad scaler's state on a device.
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

    /// Copy the state to host memory after the decision just issued (which read the squares
    /// of `work`), without waiting.
    fn push_readback(&self, work: Option<Work>) -> Result<(), FsdpError> {
        let dev = &self.device;
        let (host, copied) = dev.copy_to_host_event(&self.state, dev.transfer_stream())?;
        self.lock()
            .pending
            .push_back(Readback { host, copied, work });
        Ok(())
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
            waited |= !(b.copied.query() && b.work.as_ref().is_none_or(Work::is_completed));
            r.latest = self.read(&b)?;
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
        if let Some(w) = &b.work {
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

    /// The grad scaler's decision into its `state` on `stream`: the step's unscaled
    /// gradients overflowed when `sharded + replicated` (one-element `f64` buffers, their
    /// squares' sums) is not finite; the optimizer step applies when it is `take`n, did not
    /// overflow and the steps counted are `base` or `base + 1` (the choice; else a fault),
    /// and is counted; an overflow is counted as a skip and backs the scale off, an applied
    /// step counts towards growth ([`GradScaler::update`]'s arithmetic).
    ///
    /// # Errors
    /// Buffers that are not on this device; the stream's errors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn scaler_decide(
        &self,
        config: &GradScalerConfig,
        base: u64,
        take: bool,
        state: &Buffer,
        sharded: &Buffer,
        replicated: &Buffer,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        match self.kind {
            Kind::HostTwin => {
                self.delay(stream)?;
                let config = *config;
                host_task(stream, &[sharded, replicated], &[state], move |r, w| {
                    let (sh, re) = (read::<f64>(&r[0])?[0], read::<f64>(&r[1])?[0]);
                    decide(
                        &config,
                        base,
                        take,
                        !(sh + re).is_finite(),
                        write(&mut w[0])?,
                    );
                    Ok(())
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => {
                use fsdp_kernels::host::{ScalerDecision, ScalerRule};
                let decision = ScalerDecision {
                    rule: ScalerRule {
                        growth_factor: config.growth_factor,
                        backoff_factor: config.backoff_factor,
                        growth_interval: config.growth_interval,
                    },
                    base_steps: base,
                    take,
                };
                fsdp_kernels::launch::scaler_decide_buffers(
                    &decision, state, sharded, replicated, stream,
                )
                .map_err(super::device_kernels::cuda::kernel(
                    "grad scaler decision kernel",
                ))?;
                Ok(())
            }
        }
    }
}

/// The decision on the host twin, on the state `s`: what `scaler_decide` computes, with the
/// engine's own scale update ([`next_scale`]).
fn decide(config: &GradScalerConfig, base: u64, take: bool, found_inf: bool, s: &mut [f64]) {
    let choice = s[slot::COUNT] - base as f64;
    let in_range = choice == 0.0 || choice == 1.0;
    s[slot::FAULT] = if in_range { 0.0 } else { 1.0 };
    s[slot::CHOICE] = if in_range { choice } else { 0.0 };
    let applied = take && !found_inf && in_range;
    s[slot::APPLIED] = if applied { 1.0 } else { 0.0 };
    if applied {
        s[slot::COUNT] += 1.0;
    }
    s[slot::FOUND_INF] = if found_inf { 1.0 } else { 0.0 };
    s[slot::UNSCALE] = 0.0;
    s[slot::CLIPPED] = 0.0;
    if found_inf || applied {
        if found_inf {
            s[slot::SCALER_SKIPPED] += 1.0;
        }
        let (scale, tracker) = next_scale(
            config,
            s[slot::SCALE] as f32,
            s[slot::GROWTH_TRACKER] as u32,
            found_inf,
        );
        s[slot::SCALE] = f64::from(scale);
        s[slot::GROWTH_TRACKER] = f64::from(tracker);
    }
}

impl Fsdp {
    /// The grad scaler's state on the device, when it lives there.
    pub(crate) fn device_scaler(&self) -> Option<&DeviceScaler> {
        self.grad_scaler.as_ref().and_then(|s| s.device.as_ref())
    }

    /// The grad scaler and its state on the device.
    ///
    /// # Errors
    /// An internal error when the scaler is not on the device.
    fn scaler_parts(&self) -> Result<(&GradScaler, &DeviceScaler), FsdpError> {
        self.grad_scaler
            .as_ref()
            .and_then(|s| Some((s, s.device.as_ref()?)))
            .ok_or_else(|| super::comm_context::internal("no device scaler"))
    }

    /// The optimizer steps the device counted beyond the host's count, waiting for every
    /// outcome not read yet.
    ///
    /// # Errors
    /// As [`DeviceScaler::settle`].
    pub(crate) fn unread_steps(&self) -> Result<u64, FsdpError> {
        match self.device_scaler() {
            None => Ok(0),
            Some(d) => Ok(d.settle(0)?.0.count.saturating_sub(self.optimizer_steps)),
        }
    }

    /// [`unread_steps`](Self::unread_steps) for infallible readers (a failure is kept for the
    /// next fallible call).
    pub(crate) fn unread_steps_lossy(&self) -> u64 {
        self.device_scaler().map_or(0, |d| {
            d.settled().count.saturating_sub(self.optimizer_steps)
        })
    }

    /// Read the device scaler's outcomes until at most `keep` are unread, and fold the
    /// optimizer steps they counted into the host's counts (the engine's and every unit's)
    /// and their numbers into the scaler's. A wait on the host is counted.
    ///
    /// # Errors
    /// As [`DeviceScaler::settle`].
    pub(crate) fn absorb_scaler(&mut self, keep: usize) -> Result<(), FsdpError> {
        let Some(s) = self.grad_scaler.as_mut() else {
            return Ok(());
        };
        let Some(d) = &s.device else {
            return Ok(());
        };
        let (outcome, waited) = d.settle(keep)?;
        if waited {
            self.ctx.count_host_wait();
        }
        s.set_numbers(outcome.scaler);
        let delta = outcome.count.saturating_sub(self.optimizer_steps);
        self.optimizer_steps += delta;
        for g in &mut self.groups {
            let steps = g.optim_state.steps();
            g.optim_state.set_steps(steps + delta);
        }
        Ok(())
    }

    /// With the shards on a device, put the scaler's state there (from the host's numbers and
    /// step count, after [`absorb_scaler`](Self::absorb_scaler)); else none.
    pub(crate) fn place_scaler(&mut self) -> Result<(), FsdpError> {
        let dev = self.ctx.shards_on_device().cloned();
        let count = self.optimizer_steps;
        if let Some(s) = self.grad_scaler.as_mut() {
            s.device = match dev {
                Some(dev) => Some(DeviceScaler::new(
                    &dev,
                    Outcome {
                        scaler: s.host_state(),
                        count,
                    },
                )?),
                None => None,
            };
        }
        Ok(())
    }

    /// [`optimizer_step`](Self::optimizer_step) with the scaler on the device: unscale (unless
    /// done), decide, the optimizer step as decided with the choices of the two step numbers
    /// the device may have counted, the outcome's copy to host memory, and
    /// [`zero_grad`](Self::zero_grad) — nothing waited for on the host but an outcome two
    /// decisions old.
    pub(crate) fn step_with_device_scaler(&mut self) -> Result<(), FsdpError> {
        self.ctx.check_deferred()?;
        self.absorb_scaler(1)?;
        let base = self.optimizer_steps;
        let lrs = [self.lr_at(base), self.lr_at(base + 1)];
        let work = self.decide_on_device(true)?;
        let (_, d) = self.scaler_parts()?;
        self.step_units(&d.device, |steps| StepPlan::Decided {
            state: &d.state,
            lrs,
            steps: [steps + 1, steps + 2],
        })?;
        d.push_readback(work)?;
        self.zero_grad()
    }

    /// [`skip_step`](Self::skip_step)'s part with the scaler on the device: when this step's
    /// gradients were unscaled, a decision not to take the step (an overflow is then the
    /// scaler's skip: counted, the scale backed off), its outcome copied to host memory.
    pub(crate) fn skip_with_device_scaler(&mut self) -> Result<(), FsdpError> {
        if !self
            .grad_scaler
            .as_ref()
            .is_some_and(GradScaler::is_unscaled)
        {
            return Ok(());
        }
        self.absorb_scaler(1)?;
        let work = self.decide_on_device(false)?;
        if let Some(d) = self.device_scaler() {
            d.push_readback(work)?;
        }
        Ok(())
    }

    /// Unscale (unless done) and issue the decision (`take`: an optimizer step, or a skip),
    /// with the host's step count as the base; returns the all-reduce the decision reads.
    fn decide_on_device(&self, take: bool) -> Result<Option<Work>, FsdpError> {
        self.unscale_issue()?;
        let (s, d) = self.scaler_parts()?;
        let (dev, c) = (&d.device, d.device.compute_stream());
        let (sharded, replicated, work) = match s.device_sums() {
            Some(sums) => sums,
            None => {
                // No gradient this step: nothing overflowed.
                let zeros = dev.alloc(DType::F64, 2, c)?;
                dev.zero(&zeros, c)?;
                (zeros.slice(0..1)?, zeros.slice(1..2)?, None)
            }
        };
        let base = self.optimizer_steps;
        dev.scaler_decide(s.config(), base, take, &d.state, &sharded, &replicated, c)?;
        Ok(work)
    }
}
