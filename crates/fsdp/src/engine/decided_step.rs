//! Steps decided on the device, and the non-finite rule: [`Fsdp::optimizer_step_if_finite`]
//! steps only when the step's loss and gradient norm are finite (the check `fsdp train` makes
//! before each optimizer step) and, past [`Fsdp::set_skip_nonfinite`]'s limit, halts. With the
//! shards on a device the decision is made there (`fsdp-kernels`' `engine_decide`, with the
//! grad scaler's when there is one) and the host reads each step's [`StepOutcome`] one step
//! late ([`Fsdp::step_outcomes`]): a training loop that clips, checks and steps never waits
//! for the device. On the host (and under CPU offload) it decides at once, the same way.
//!
//! The state of the decisions lives in one device buffer (`scaler_device.rs`): the grad
//! scaler's when it is on the device, else one of the non-finite rule's own, made at its
//! first step with the host's step count and counts.

use std::sync::PoisonError;

use fsdp_collectives::Work;
use fsdp_device::{Buffer, DType};

use super::device::ComputeDevice;
use super::device_optim::StepPlan;
use super::fsdp::Fsdp;
use super::grad_scaler::{GradScaler, GradScalerState};
use super::scaler_device::{Decision, DeviceScaler, Outcome};
use crate::FsdpError;

/// What the end of a step decided ([`Fsdp::optimizer_step_if_finite`]), as the host reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct StepOutcome {
    /// The step's loss: the ranks' losses summed over the world.
    pub loss: f32,
    /// The gradients' global norm before clipping (unscaled under a grad scaler: infinite or
    /// NaN after an overflow).
    pub grad_norm: f64,
    /// The optimizer step applied.
    pub applied: bool,
    /// The grad scaler found the gradients overflowed (the scaler's skip; not non-finite).
    pub found_inf: bool,
    /// The non-finite rule's limit was passed, at this step or before: no step applies any
    /// more.
    pub halted: bool,
}

impl StepOutcome {
    /// The outcome of a step decided on the host by the rule, without a limit: its `loss`
    /// (summed over the world), `grad_norm` and the grad scaler's `found_inf`; it applies when
    /// it is finite and did not overflow.
    pub fn decide(loss: f32, grad_norm: f64, found_inf: bool) -> Self {
        let mut o = StepOutcome {
            loss,
            grad_norm,
            applied: false,
            found_inf,
            halted: false,
        };
        o.applied = !o.nonfinite() && !found_inf;
        o
    }

    /// The step was non-finite by the rule: its loss is not finite, or its norm is not and the
    /// grad scaler found no overflow (that is the scaler's to skip).
    pub fn nonfinite(&self) -> bool {
        !(self.loss.is_finite() && (self.found_inf || self.grad_norm.is_finite()))
    }
}

/// The numbers of a decisions' state without a grad scaler.
const NO_SCALER: GradScalerState = GradScalerState {
    scale: 0.0,
    growth_tracker: 0,
    skipped_steps: 0,
};

/// The non-finite rule's settings and what the host knows of it.
#[derive(Debug, Default)]
pub(crate) struct Guard {
    /// Non-finite steps skipped before the next one halts (`None`: no limit).
    limit: Option<u64>,
    /// Non-finite steps seen, as far as the outcomes read say.
    nonfinite: u64,
    /// The limit was passed.
    halted: bool,
    /// The decisions' state on the device without a device grad scaler.
    pub(crate) state: Option<DeviceScaler>,
    /// Outcomes decided on the host, not taken yet.
    outcomes: Vec<StepOutcome>,
}

/// The squares of the gradients a norm was computed from, kept for the step's decision: the
/// norm on the host, or the sums (sharded, all-reduced by the work, and replicated) on the
/// device.
#[derive(Clone, Debug)]
pub(crate) enum StepSquares {
    Host(f64),
    Device(Buffer, Buffer, Option<Work>),
}

impl Fsdp {
    /// Skip at most `limit` non-finite steps in
    /// [`optimizer_step_if_finite`](Self::optimizer_step_if_finite): the next one halts the
    /// engine — on the device, so that no step issued after it applies either (its outcome and
    /// theirs say [`halted`](StepOutcome::halted)). `None` (the default): skip every
    /// non-finite step and go on. The non-finite steps seen so far count towards the limit.
    pub fn set_skip_nonfinite(&mut self, limit: Option<u64>) {
        self.guard.limit = limit;
    }

    /// The optimizer step if the step is finite: `loss`, a one-element `f64` buffer holding
    /// this rank's share of the step's loss (an `f32` value; on the engine's device, or in host
    /// memory for an engine on the host), is summed over the world, and the optimizer step
    /// ([`optimizer_step`](Self::optimizer_step)) applies when that loss is finite and the
    /// gradients' global norm is too (with a grad scaler an overflow is the scaler's skip, as
    /// in `optimizer_step`); else the step is skipped as [`skip_step`](Self::skip_step) skips
    /// it, counted as non-finite, and past [`set_skip_nonfinite`](Self::set_skip_nonfinite)'s
    /// limit the engine halts: no later step applies. Gradients are zeroed either way. The
    /// norm is the one [`grad_norm`](Self::grad_norm) or [`clip_grad_norm`](Self::clip_grad_norm)
    /// (or their `_async` forms) computed this step, before clipping, or computed now.
    ///
    /// With the shards on a device everything is issued there and nothing is waited for: the
    /// host learns what was decided one step late, from [`step_outcomes`](Self::step_outcomes).
    /// On the host (or offloaded) it decides at once. Every rank must call it.
    ///
    /// # Errors
    /// [`FsdpError::InvalidShape`] for a `loss` of other than one `f64` element;
    /// those of [`optimizer_step`](Self::optimizer_step).
    pub fn optimizer_step_if_finite(&mut self, loss: &Buffer) -> Result<(), FsdpError> {
        if loss.len() != 1 || loss.dtype() != DType::F64 {
            return Err(FsdpError::InvalidShape {
                reason: format!(
                    "rank {}: the step's loss must be one f64 element, not {} {} element(s)",
                    self.rank(),
                    loss.len(),
                    loss.dtype()
                ),
            });
        }
        self.check_reduced()?;
        match self.ctx.shards_on_device().cloned() {
            Some(dev) => self.step_decided(&dev, Some(loss)),
            None => self.step_if_finite_on_host(loss),
        }
    }

    /// The outcomes of [`optimizer_step_if_finite`](Self::optimizer_step_if_finite)'s steps
    /// read and not returned before, oldest first: on a device every step's but the last
    /// one's (waiting for them, which is rarely a wait: they are a step old), on the host
    /// every step's.
    ///
    /// # Errors
    /// A failure to read an outcome: the collective's or the device's, a timeout.
    pub fn step_outcomes(&mut self) -> Result<Vec<StepOutcome>, FsdpError> {
        self.outcomes_keeping(1)
    }

    /// [`step_outcomes`](Self::step_outcomes) of every step, the last one's too (a wait for
    /// the device).
    ///
    /// # Errors
    /// As [`step_outcomes`](Self::step_outcomes).
    pub fn flush_step_outcomes(&mut self) -> Result<Vec<StepOutcome>, FsdpError> {
        self.outcomes_keeping(0)
    }

    fn outcomes_keeping(&mut self, keep: usize) -> Result<Vec<StepOutcome>, FsdpError> {
        self.absorb_scaler(keep)?;
        let mut out = std::mem::take(&mut self.guard.outcomes);
        if let Some(d) = self.decisions() {
            out.extend(d.take_reported());
        }
        Ok(out)
    }

    /// Keep (or forget) the squares of this step's gradient norm for its decision.
    pub(crate) fn keep_step_squares(&self, squares: Option<StepSquares>) {
        *self
            .step_squares
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = squares;
    }

    /// The squares kept for this step's decision.
    fn kept_step_squares(&self) -> Option<StepSquares> {
        self.step_squares
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The decisions' state on the device: the grad scaler's, else the non-finite rule's.
    pub(crate) fn decisions(&self) -> Option<&DeviceScaler> {
        self.device_scaler().or(self.guard.state.as_ref())
    }

    /// The grad scaler's state on the device, when it lives there.
    pub(crate) fn device_scaler(&self) -> Option<&DeviceScaler> {
        self.grad_scaler.as_ref().and_then(|s| s.device.as_ref())
    }

    /// The optimizer steps the device counted beyond the host's count, waiting for every
    /// outcome not read yet.
    ///
    /// # Errors
    /// As [`DeviceScaler::settle`].
    pub(crate) fn unread_steps(&self) -> Result<u64, FsdpError> {
        match self.decisions() {
            None => Ok(0),
            Some(d) => Ok(d.settle(0)?.0.count.saturating_sub(self.optimizer_steps)),
        }
    }

    /// [`unread_steps`](Self::unread_steps) for infallible readers (a failure is kept for the
    /// next fallible call).
    pub(crate) fn unread_steps_lossy(&self) -> u64 {
        self.decisions().map_or(0, |d| {
            d.settled().count.saturating_sub(self.optimizer_steps)
        })
    }

    /// Read the decisions' outcomes until at most `keep` are unread, and fold the optimizer
    /// steps they counted into the host's counts (the engine's and every unit's), their
    /// numbers into the scaler's and the non-finite rule's counts into the host's. A wait on
    /// the host is counted.
    ///
    /// # Errors
    /// As [`DeviceScaler::settle`].
    pub(crate) fn absorb_scaler(&mut self, keep: usize) -> Result<(), FsdpError> {
        let Some(d) = self.decisions() else {
            return Ok(());
        };
        let (outcome, waited) = d.settle(keep)?;
        if waited {
            self.ctx.count_host_wait();
        }
        if let Some(s) = self.grad_scaler.as_mut().filter(|s| s.device.is_some()) {
            s.set_numbers(outcome.scaler);
        }
        self.guard.nonfinite = outcome.nonfinite;
        self.guard.halted = outcome.halted;
        let delta = outcome.count.saturating_sub(self.optimizer_steps);
        self.optimizer_steps += delta;
        for g in &mut self.groups {
            let steps = g.optim_state.steps();
            g.optim_state.set_steps(steps + delta);
        }
        Ok(())
    }

    /// With the shards on a device, put the scaler's state there (from the host's numbers and
    /// counts, after [`absorb_scaler`](Self::absorb_scaler)); else none. The non-finite rule's
    /// own state is dropped: its next step makes it anew from the host's counts.
    pub(crate) fn place_scaler(&mut self) -> Result<(), FsdpError> {
        let dev = self.ctx.shards_on_device().cloned();
        let at = self.outcome_now(NO_SCALER);
        self.guard.state = None;
        if let Some(s) = self.grad_scaler.as_mut() {
            s.device = match dev {
                Some(dev) => Some(DeviceScaler::new(
                    &dev,
                    Outcome {
                        scaler: s.host_state(),
                        ..at
                    },
                )?),
                None => None,
            };
        }
        Ok(())
    }

    /// The host's counts as a decision's starting point, with the scaler's numbers `scaler`.
    fn outcome_now(&self, scaler: GradScalerState) -> Outcome {
        Outcome::start(
            scaler,
            self.optimizer_steps,
            self.guard.nonfinite,
            self.guard.halted,
        )
    }

    /// An optimizer step decided on the device `dev` (with the scaler's state there, or with
    /// the non-finite rule's when `loss` is given): unscale (unless done), decide, the
    /// optimizer step as decided with the choices of the two step numbers the device may have
    /// counted, the outcome's copy to host memory, and [`zero_grad`](Self::zero_grad) —
    /// nothing waited for on the host but an outcome two decisions old.
    pub(crate) fn step_decided(
        &mut self,
        dev: &ComputeDevice,
        loss: Option<&Buffer>,
    ) -> Result<(), FsdpError> {
        self.ctx.check_deferred()?;
        if self.decisions().is_none() {
            let at = self.outcome_now(NO_SCALER);
            self.guard.state = Some(DeviceScaler::new(dev, at)?);
        }
        self.absorb_scaler(1)?;
        let base = self.optimizer_steps;
        let lrs = [self.lr_at(base), self.lr_at(base + 1)];
        let work = self.decide_on_device(true, loss)?;
        let d = self.decisions_or_internal()?;
        self.step_units(&d.device, |steps| StepPlan::Decided {
            state: &d.state,
            lrs,
            steps: [steps + 1, steps + 2],
        })?;
        d.push_readback(work, loss.is_some())?;
        self.zero_grad()
    }

    fn decisions_or_internal(&self) -> Result<&DeviceScaler, FsdpError> {
        self.decisions()
            .ok_or_else(|| super::comm_context::internal("no decisions on the device"))
    }

    /// [`skip_step`](Self::skip_step)'s part with decisions on the device: when this step's
    /// gradients were unscaled by a device scaler, a decision not to take the step (an
    /// overflow is then the scaler's skip: counted, the scale backed off), its outcome copied
    /// to host memory; with the non-finite rule's state alone, nothing.
    pub(crate) fn skip_with_device_scaler(&mut self) -> Result<(), FsdpError> {
        if !self
            .grad_scaler
            .as_ref()
            .is_some_and(GradScaler::is_unscaled)
        {
            return Ok(());
        }
        self.absorb_scaler(1)?;
        let work = self.decide_on_device(false, None)?;
        if let Some(d) = self.decisions() {
            d.push_readback(work, false)?;
        }
        Ok(())
    }

    /// Unscale (unless done) and issue the decision (`take`: an optimizer step, or a skip;
    /// with the non-finite rule when `loss` is given), with the host's step count as the base;
    /// returns the all-reduces the decision reads.
    fn decide_on_device(&self, take: bool, loss: Option<&Buffer>) -> Result<Vec<Work>, FsdpError> {
        self.unscale_issue()?;
        let d = self.decisions_or_internal()?;
        let (dev, c) = (&d.device, d.device.compute_stream());
        let scaler = self.grad_scaler.as_ref().filter(|s| s.device.is_some());
        let mut works = Vec::new();
        // The squares: the norm's of this step, the unscaled gradients' under the scaler, or
        // now (for the rule); zeros when nothing reads them or there is no gradient.
        let kept = self.kept_step_squares();
        let (sharded, replicated, work) = match (kept, scaler.and_then(GradScaler::device_sums)) {
            (Some(StepSquares::Device(sh, re, w)), _) => (sh, re, w),
            (_, Some(sums)) => sums,
            _ if loss.is_some() && !self.groups.iter().all(|g| g.grad_shard_zero) => {
                self.squares_on_device(dev)?
            }
            _ => {
                let zeros = dev.alloc(DType::F64, 2, c)?;
                dev.zero(&zeros, c)?;
                (zeros.slice(0..1)?, zeros.slice(1..2)?, None)
            }
        };
        works.extend(work);
        // The step's loss summed over the world, in a buffer of its own.
        let loss = match loss {
            Some(l) => {
                let sum = dev.alloc(DType::F64, 1, c)?;
                dev.zero(&sum, c)?;
                dev.add_scalar(&sum, l, c)?;
                works.extend(
                    self.ctx
                        .sum_on_device(self.ctx.groups.world_multi(), &sum)?,
                );
                Some(sum)
            }
            None => None,
        };
        let decision = Decision {
            scaler: scaler.map(|s| *s.config()),
            nonfinite: loss.as_ref().map(|_| self.guard.limit),
            base: self.optimizer_steps,
            take,
        };
        dev.engine_decide(
            &decision,
            &d.state,
            [&sharded, &replicated],
            loss.as_ref(),
            c,
        )?;
        Ok(works)
    }

    /// [`optimizer_step_if_finite`](Self::optimizer_step_if_finite) on the host: the loss
    /// summed over the world and the norm read, the rule applied, and the optimizer step taken
    /// or skipped at once.
    fn step_if_finite_on_host(&mut self, loss: &Buffer) -> Result<(), FsdpError> {
        let local = self.ctx.host_copies(&[loss])?[0].to_vec::<f64>()?[0];
        let loss = self.all_reduce_sum(self.ctx.groups.world_multi(), local)?;
        let kept = self.kept_step_squares();
        let grad_norm = match kept {
            Some(StepSquares::Host(norm)) => norm,
            _ => self.grad_norm()?,
        };
        let found_inf = self.grad_scaler().and_then(GradScaler::found_inf) == Some(true);
        let mut outcome = StepOutcome::decide(loss as f32, grad_norm, found_inf);
        let g = &mut self.guard;
        if outcome.nonfinite() {
            g.nonfinite += 1;
            g.halted |= g.limit.is_some_and(|k| g.nonfinite > k);
        }
        outcome.halted = g.halted;
        outcome.applied &= !g.halted;
        self.guard.outcomes.push(outcome);
        if outcome.applied {
            self.optimizer_step()
        } else {
            self.skip_step()
        }
    }
}
