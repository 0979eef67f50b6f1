//! The engine's dynamic loss scaling ([`GradScaler`]): setting the scaler and its state,
//! scaling each unsharded gradient before its reduction, unscaling the gradient shards and
//! agreeing on their overflow, and the scaler's part of a step or a skip. With the shards on a
//! device the unscaling and the decision run there (`scaler_device.rs`).

use std::path::Path;

use fsdp_collectives::ReduceOp;
use fsdp_device::{Buffer, DType, Element};

use super::comm_context::CommContext;
use super::fsdp::Fsdp;
#[cfg(doc)]
use super::grad_scaler::{load_grad_scaler_state, GRAD_SCALER_FILE};
use super::grad_scaler::{
    save_grad_scaler_state, GradScaler, GradScalerConfig, GradScalerState, Unscaled,
};
use crate::trace::SpanKind;
use crate::FsdpError;

/// Multiply the unsharded gradient `buffer` by `scale` in place, before its reduction: the loss
/// scaling described on [`GradScaler`]. Nothing for a scale of 1 or on the meta device.
/// Each element's product is rounded once to the buffer's element type (exact for a
/// power-of-two scale unless it overflows).
///
/// # Errors
/// A failing buffer access.
pub(crate) fn apply_loss_scale(
    ctx: &CommContext,
    buffer: &Buffer,
    scale: f32,
) -> Result<(), FsdpError> {
    if scale == 1.0 || ctx.is_meta() {
        return Ok(());
    }
    if let Some(dev) = &ctx.device {
        // The unsharded gradient is f32 on a device: x·s rounded once to f32, which is the
        // f64 product rounded once below.
        return dev.scale(buffer, scale, dev.compute_stream());
    }
    fn mul<T: Element>(b: &Buffer, s: f64) -> Result<(), FsdpError> {
        for x in b.write::<T>()?.iter_mut() {
            // Exact in f64 for every element type, then rounded once.
            *x = T::from_f64(x.to_f64() * s);
        }
        Ok(())
    }
    let s = f64::from(scale);
    match buffer.dtype() {
        DType::F32 => mul::<f32>(buffer, s),
        DType::F64 => mul::<f64>(buffer, s),
        DType::BF16 => mul::<fsdp_device::half::bf16>(buffer, s),
        DType::F16 => mul::<fsdp_device::half::f16>(buffer, s),
    }
}

impl Fsdp {
    /// Turn dynamic loss scaling on with `config` (a fresh scaler at its initial scale), or off
    /// (`None`, or a configuration with `enabled: false`). See [`GradScaler`] for what the engine
    /// then does at each step. Call it between steps (no gradient held).
    /// Every rank must set the same configuration.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] for an invalid configuration
    /// ([`GradScalerConfig::validate`]); [`FsdpError::InvalidFsdpConfig`] when gradients of the
    /// current step are held (they were produced with the previous scale). Nothing changes on
    /// an error.
    ///
    /// # Example
    ///
    /// `loss = w · x` on one rank, so `w`'s gradient is `x`; the scale grows after every step
    /// without overflow (`growth_interval: 1`), and an infinite gradient skips its step:
    ///
    /// ```
    /// use std::collections::HashMap;
    /// use fsdp::engine::{Fsdp, FsdpConfig, FsdpModel, GradScalerConfig, ParamInit, ShardingStrategy, Span};
    /// use fsdp::optim::SgdConfig;
    /// use fsdp::units::{ParamSpec, UnitPlan, UnitSpec};
    /// use fsdp::{FsdpError, Grads, Params};
    /// use fsdp_collectives::ring;
    ///
    /// struct Linear;
    /// impl FsdpModel for Linear {
    ///     type Batch = f32; // x
    ///     type Tape = ();
    ///     fn spans(&self) -> Vec<Span> { vec![Span::new("w", ["w"])] }
    ///     fn forward(&self, _: usize, _: &dyn Params, _: &f32, _: &mut ()) -> Result<(), FsdpError> { Ok(()) }
    ///     fn loss(&self, _: &()) -> Result<f32, FsdpError> { Ok(0.0) }
    ///     fn backward(&self, _: usize, _: &dyn Params, g: &mut dyn Grads, x: &f32, _: &mut ()) -> Result<(), FsdpError> {
    ///         g.grad_mut("w")?[0] += *x;
    ///         Ok(())
    ///     }
    /// }
    ///
    /// let unit = UnitSpec { name: "w".into(), params: vec![ParamSpec::new("w", vec![1])] };
    /// let plan = UnitPlan { units: vec![unit], ignored: vec![] };
    /// let init = HashMap::from([("w".to_string(), vec![1.0f32])]);
    /// let out = ring::run_ranks(1, ring::RingOptions::default(), |comm| {
    ///     let config = FsdpConfig::new(ShardingStrategy::FullShard);
    ///     let sgd = SgdConfig::with_momentum(0.5, 0.0);
    ///     let mut fsdp = Fsdp::new(Box::new(comm), &plan, ParamInit::Full(&init), config, sgd).unwrap();
    ///     let scaler = GradScalerConfig { growth_interval: 1, ..GradScalerConfig::default() };
    ///     fsdp.set_grad_scaler(Some(scaler)).unwrap();
    ///     fsdp.step(&Linear, &1.0).unwrap(); // w = 1 − 0.5 · 1; the scale grows to 2^17
    ///     fsdp.step(&Linear, &f32::INFINITY).unwrap(); // skipped; the scale backs off to 2^16
    ///     let s = fsdp.grad_scaler().unwrap();
    ///     (fsdp.full_state_dict().unwrap()["w"][0], s.scale(), s.skipped_steps(), fsdp.optimizer_steps())
    /// })
    /// .unwrap();
    /// assert_eq!(out[0], (0.5, 65536.0, 1, 1));
    /// ```
    pub fn set_grad_scaler(&mut self, config: Option<GradScalerConfig>) -> Result<(), FsdpError> {
        // A disabled configuration is not checked, as torch checks only an enabled one.
        let scaler = match config {
            Some(c) if c.enabled => Some(GradScaler::new(c)?),
            _ => None,
        };
        if self
            .groups
            .iter()
            .any(|g| !g.grad_shard_zero || g.full_grad.is_some())
        {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: "set the grad scaler between steps: gradients of this step are held \
                         (step, skip_step or zero_grad first)"
                    .into(),
            });
        }
        // The steps a device scaler counted are the engine's, whatever replaces it.
        self.absorb_scaler(0)?;
        self.grad_scaler = scaler;
        self.place_scaler()
    }

    /// The grad scaler, when one is on ([`set_grad_scaler`](Self::set_grad_scaler)).
    pub fn grad_scaler(&self) -> Option<&GradScaler> {
        self.grad_scaler.as_ref()
    }

    /// Restore a grad scaler's state (from [`load_grad_scaler_state`]) into the scaler set by
    /// [`set_grad_scaler`](Self::set_grad_scaler). Local: every rank loads the same state.
    ///
    /// # Errors
    /// [`FsdpError::InvalidFsdpConfig`] without a scaler; [`FsdpError::InvalidHyperparameter`]
    /// for a scale that is not finite and positive; with the scaler on a device, a failure
    /// of its steps so far.
    pub fn set_grad_scaler_state(&mut self, state: GradScalerState) -> Result<(), FsdpError> {
        if self.grad_scaler.is_none() {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: "no grad scaler to restore: set_grad_scaler first".into(),
            });
        }
        if !(state.scale.is_finite() && state.scale > 0.0) {
            return Err(FsdpError::InvalidHyperparameter {
                name: "scale",
                value: f64::from(state.scale),
                reason: "must be finite and positive",
            });
        }
        self.absorb_scaler(0)?;
        let Some(s) = self.grad_scaler.as_mut() else {
            return Err(super::comm_context::internal("no grad scaler"));
        };
        s.set_numbers(state);
        s.reset_step();
        self.place_scaler()
    }

    /// Unscale the gradient shards of this step (PyTorch's `scaler.unscale_(optimizer)`):
    /// multiply them by [`inv_scale`](GradScaler::inv_scale) and agree over the world whether
    /// any rank's shards hold a NaN or an infinity; returns that flag (the same on every rank).
    /// Idempotent until the step ([`optimizer_step`](Self::optimizer_step),
    /// [`skip_step`](Self::skip_step) or [`zero_grad`](Self::zero_grad)); called by
    /// [`grad_norm`](Self::grad_norm), [`clip_grad_norm`](Self::clip_grad_norm) and
    /// [`optimizer_step`](Self::optimizer_step) when the caller did not. Without a scaler:
    /// nothing, `false`. Call it after the last backward of a step: a backward after it is an
    /// error. Every rank must call it (one all-reduce of 4 bytes over the world, none when no
    /// gradient was produced).
    ///
    /// # Errors
    /// Unreduced `no_sync` gradients ([`FsdpError::InvalidFsdpConfig`]); a failing collective.
    pub fn unscale_grads(&mut self) -> Result<bool, FsdpError> {
        self.check_reduced()?;
        self.unscale_shared()
    }

    /// [`unscale_grads`](Self::unscale_grads) through a shared reference (the gradient shards
    /// are written through their buffers' access tickets).
    /// With the scaler on a device, reading the overflow is a wait on the host (counted in
    /// [`host_waits`](Self::host_waits)).
    pub(crate) fn unscale_shared(&self) -> Result<bool, FsdpError> {
        self.unscale_issue()?;
        let Some(scaler) = &self.grad_scaler else {
            return Ok(false);
        };
        let sums = scaler.device_sums();
        match (sums, &scaler.device) {
            (Some((sharded, replicated, work)), Some(d)) => {
                self.ctx.count_host_wait();
                d.found_inf(&sharded, &replicated, work)
            }
            _ => Ok(scaler.found_inf().unwrap_or(false)),
        }
    }

    /// Unscale this step's gradient shards unless done: on the host, with the overflow agreed
    /// over the world; with the scaler on a device, there, the overflow left on the device
    /// (the unscaled shards' sums of squares), nothing waited for.
    pub(crate) fn unscale_issue(&self) -> Result<(), FsdpError> {
        let Some(scaler) = &self.grad_scaler else {
            return Ok(());
        };
        let mut unscaled = scaler.lock();
        if !matches!(*unscaled, Unscaled::No) {
            return Ok(());
        }
        // No gradient since the last step (every rank alike): nothing to unscale or agree on,
        // and a backward may still follow.
        if self.groups.iter().all(|g| g.grad_shard_zero) {
            return Ok(());
        }
        if let Some(d) = &scaler.device {
            let (dev, scale) = (&d.device, d.scale_view()?);
            for g in &self.groups {
                dev.unscale_by(&g.grad_shard, &scale, dev.compute_stream())?;
            }
            let (sharded, replicated, work) = self.squares_on_device(dev)?;
            *unscaled = Unscaled::Device {
                sharded,
                replicated,
                work,
            };
            return Ok(());
        }
        let mut local = false;
        if !self.ctx.is_meta() {
            let inv = scaler.inv_scale();
            for g in &self.groups {
                for x in g.grad_shard.write::<f32>()?.iter_mut() {
                    *x *= inv;
                    // Checked after unscaling: a non-finite scaled value stays non-finite, and
                    // an unscaling that overflows (possible once the scale fell below 1, which
                    // torch lets through) is caught too.
                    local |= !x.is_finite();
                }
            }
        }
        let mut found = local;
        if let Some(world) = self.ctx.groups.world_multi() {
            let b = Buffer::from_slice(&[if local { 1f32 } else { 0.0 }])?;
            let sum = self.ctx.collective_to_host(world, &b, 1, true, |_, b| {
                self.ctx
                    .traced(world.stream(), SpanKind::AllReduce, Vec::new(), 4, || {
                        Ok(world.all_reduce(b, ReduceOp::Sum)?)
                    })
            })?;
            found = sum.to_vec::<f32>()?[0] != 0.0;
        }
        *unscaled = Unscaled::Host(found);
        Ok(())
    }

    /// Multiply a unit's unsharded gradient `grad` (if any) by the scale before its reduction
    /// (nothing without a scaler): the host's scale, or on a device the device's.
    ///
    /// # Errors
    /// [`FsdpError::InvalidFsdpConfig`] when this step's gradients were already unscaled; a
    /// failing buffer access.
    pub(crate) fn apply_backward_scale(&self, grad: Option<&Buffer>) -> Result<(), FsdpError> {
        let Some(s) = &self.grad_scaler else {
            return Ok(());
        };
        if s.is_unscaled() {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: "a backward after the gradients were unscaled (by unscale_grads, \
                         grad_norm or clip_grad_norm): step, skip_step or zero_grad first"
                    .into(),
            });
        }
        let Some(grad) = grad else {
            return Ok(());
        };
        match &s.device {
            Some(d) => d
                .device
                .scale_by(grad, &d.scale_view()?, d.device.compute_stream()),
            None => apply_loss_scale(&self.ctx, grad, s.scale()),
        }
    }

    /// In [`optimizer_step`](Self::optimizer_step), after the reduction check: with a scaler,
    /// unscale, and on an overflow skip the step (gradients zeroed, skip counted, scale backed
    /// off) and return `true`.
    pub(crate) fn grad_scaler_skips(&mut self) -> Result<bool, FsdpError> {
        if self.grad_scaler.is_none() || !self.unscale_shared()? {
            return Ok(false);
        }
        if let Some(s) = &mut self.grad_scaler {
            s.skip_overflow();
        }
        self.zero_grad()?;
        Ok(true)
    }

    /// After an optimizer step that was taken: the scale's update without overflow.
    pub(crate) fn grad_scaler_stepped(&mut self) {
        if let Some(s) = &mut self.grad_scaler {
            s.update(false);
        }
    }

    /// In [`skip_step`](Self::skip_step), before the gradients are zeroed: a step whose
    /// unscaled gradients overflowed is the scaler's skip (counted, scale backed off); any
    /// other skip leaves the scaler as it is.
    pub(crate) fn grad_scaler_on_skip(&mut self) -> Result<(), FsdpError> {
        if self.device_scaler().is_some() {
            return self.skip_with_device_scaler();
        }
        if let Some(s) = &mut self.grad_scaler {
            if s.found_inf() == Some(true) {
                s.skip_overflow();
            }
        }
        Ok(())
    }

    /// Rank 0 writes the scaler's state into the sharded checkpoint `dir`
    /// ([`GRAD_SCALER_FILE`]), or removes a stale one when no scaler is set.
    pub(crate) fn write_grad_scaler_state(&self, dir: &Path) -> Result<(), FsdpError> {
        if self.rank() != 0 {
            return Ok(());
        }
        self.unread_steps()?; // a failure of the device scaler's steps, if any
        let scaler = self.grad_scaler.as_ref().map(|s| (s.config(), s.state()));
        save_grad_scaler_state(dir, scaler)
    }
}
