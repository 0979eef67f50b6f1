//! Dynamic loss scaling for fp16 training: PyTorch's `ShardedGradScaler`
//! (`torch.distributed.fsdp.sharded_grad_scaler`), i.e. `torch.amp.GradScaler` with the
//! found-inf flag agreed over all ranks.
//!
//! The scaler, its settings and its state, and the state's file in a sharded checkpoint. The
//! engine's use of it is described on [`GradScaler`] (`loss_scaling.rs` on the host,
//! `scaler_device.rs` with the shards on a device).

use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};

use fsdp_collectives::Work;
use fsdp_device::Buffer;

#[cfg(doc)]
use super::fsdp::Fsdp;
use super::scaler_device::DeviceScaler;
use crate::FsdpError;

/// The name of the file, in a sharded checkpoint's directory, that holds the grad scaler's
/// state (JSON, written by rank 0 when a scaler is set).
pub const GRAD_SCALER_FILE: &str = "grad_scaler.json";

/// The settings of dynamic loss scaling, with `torch.amp.GradScaler`'s defaults
/// ([`Default`]): initial scale `2^16`, growth factor 2, backoff factor ½, growth interval 2000.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// The scale of the first step (`init_scale`).
    pub init_scale: f32,
    /// The scale is multiplied by this after `growth_interval` consecutive steps without
    /// overflow (`growth_factor`, > 1). The product is taken in `f64` and rounded to `f32`, as
    /// torch's `_amp_update_scale_` does, and a product that would be infinite is not applied.
    pub growth_factor: f64,
    /// The scale is multiplied by this on an overflow (`backoff_factor`, in (0, 1)).
    pub backoff_factor: f64,
    /// Consecutive steps without overflow before the scale grows (`growth_interval`, ≥ 1).
    pub growth_interval: u32,
    /// Off: [`Fsdp::set_grad_scaler`] with a disabled configuration removes the scaler (without
    /// checking the other settings), as a disabled `GradScaler` is a no-op in PyTorch.
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

impl GradScalerConfig {
    /// Check the settings.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] for an `init_scale` that is not finite and positive,
    /// a `growth_factor` that is not finite and above 1, a `backoff_factor` not strictly between
    /// 0 and 1, or a `growth_interval` of 0.
    pub fn validate(&self) -> Result<(), FsdpError> {
        let bad = |name, value, reason| {
            Err(FsdpError::InvalidHyperparameter {
                name,
                value,
                reason,
            })
        };
        let init = f64::from(self.init_scale);
        if !(init.is_finite() && init > 0.0) {
            return bad("init_scale", init, "must be finite and positive");
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad(
                "growth_factor",
                self.growth_factor,
                "must be finite and greater than 1",
            );
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(
                "backoff_factor",
                self.backoff_factor,
                "must lie strictly between 0 and 1",
            );
        }
        if self.growth_interval == 0 {
            return bad("growth_interval", 0.0, "must be at least 1");
        }
        Ok(())
    }
}

/// The state of a grad scaler as a checkpoint holds it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerState {
    /// The current scale.
    pub scale: f32,
    /// Consecutive steps without overflow since the last growth or backoff.
    pub growth_tracker: u32,
    /// Optimizer steps skipped for an overflow so far.
    pub skipped_steps: u64,
}

/// Dynamic loss scaling: the scale, the growth tracker, the count of skipped steps, and
/// whether this step's gradients were unscaled. Set on an engine with
/// [`Fsdp::set_grad_scaler`].
///
/// # What the engine does
///
/// - **Scaling.** Instead of scaling the loss before backward, the engine multiplies each unit's
///   unsharded gradient by the current [`scale`](GradScaler::scale) right before its reduction
///   (in [`Fsdp::post_backward`]). Every backward operation is linear in its upstream
///   gradient, so for a power-of-two scale (the default: `2^16`, grown by 2 and backed off by
///   ½) the product equals, bitwise, the gradient a backward of `scale · loss`
///   would produce in `f32`: multiplying by a power of two is exact, and each rounded operation
///   of the scaled backward is the unscaled one times the scale — unless a value overflows (which
///   is what the scaler detects) or lies in the subnormal range of one of the two computations
///   (where the scaled one is the more accurate: that is the purpose of loss scaling). What is
///   reduced over the ranks (and, with `f16` gradients, rounded to `f16`) is therefore the
///   scaled gradient, as in PyTorch.
/// - **Unscaling** ([`Fsdp::unscale_grads`], PyTorch's `scaler.unscale_(optimizer)`): every
///   gradient shard is multiplied by `inv_scale = 1 / scale` (computed in `f64` and rounded to
///   `f32`, as torch's `_scale.double().reciprocal().float()`), each rank notes whether any
///   element of its shards is NaN or infinite (`_amp_foreach_non_finite_check_and_unscale_`;
///   checked after the multiplication, which also catches an unscaling that overflows — possible
///   only once the scale fell below 1 — where torch checks before), and the flags are all-reduced over the world as a sum (as `ShardedGradScaler` does: any
///   non-zero means skip), so every rank decides alike although an overflow may lie in one
///   rank's shard only. Idempotent within a step. [`Fsdp::grad_norm`] and
///   [`Fsdp::clip_grad_norm`] unscale first, so the norm and the clipping see the true
///   gradients; the order unscale → clip → step of PyTorch's recipe is thus automatic.
/// - **Step** ([`Fsdp::optimizer_step`], PyTorch's `scaler.step(optimizer)` then
///   `scaler.update()`): unscale if not done yet; on an overflow the optimizer step is skipped
///   on every rank (parameters, optimizer state and learning-rate schedule unchanged, gradients
///   zeroed, [`skipped_steps`](GradScaler::skipped_steps) counted), otherwise the optimizer
///   steps; then the scale is updated identically everywhere ([`GradScaler::update`]).
///   [`Fsdp::skip_step`] after an overflow seen by the unscaling (e.g. a trainer that skips on a
///   non-finite [`grad_norm`](Fsdp::grad_norm)) is the same skip: it backs the scale off too.
///
/// The scaler's state (scale, growth tracker, skipped steps) is saved with a sharded checkpoint
/// ([`Fsdp::save_sharded`] writes [`GRAD_SCALER_FILE`]) and restored with
/// [`load_grad_scaler_state`] and [`Fsdp::set_grad_scaler_state`].
///
/// With the shards on a device ([`Fsdp::new_on`] without `offload_params`) the scaler's state
/// lives there and no step waits on the host for `found_inf` (`scaler_device.rs`): the
/// scaler's numbers and the engine's step counts then reach the host one step late, and this
/// type's readers wait for what the device decided so far.
#[derive(Debug)]
pub struct GradScaler {
    config: GradScalerConfig,
    /// The host's numbers; with a device scaler, as of the last outcome the engine folded in.
    scale: f32,
    growth_tracker: u32,
    skipped_steps: u64,
    /// Whether this step's gradients are unscaled, and what tells their overflow (behind a
    /// lock, because [`Fsdp::grad_norm`] unscales through a shared reference).
    unscaled: Mutex<Unscaled>,
    /// The state on the device, when the shards are there.
    pub(crate) device: Option<DeviceScaler>,
}

/// The unscaling of a step's gradients.
#[derive(Debug, Clone)]
pub(crate) enum Unscaled {
    /// Not yet (or no gradient this step).
    No,
    /// Done, the overflow known on the host.
    Host(bool),
    /// Done on the device: the unscaled gradient shards' sums of squares, the sharded one
    /// all-reduced over the shard group by `work`. Not finite when they overflowed.
    Device {
        sharded: Buffer,
        replicated: Buffer,
        work: Option<Work>,
    },
}

impl Clone for GradScaler {
    /// A copy of the scaler's settings and numbers (with a device scaler, as the device
    /// decided them), held on the host.
    fn clone(&self) -> Self {
        let numbers = self.state();
        GradScaler {
            config: self.config,
            scale: numbers.scale,
            growth_tracker: numbers.growth_tracker,
            skipped_steps: numbers.skipped_steps,
            unscaled: Mutex::new(match self.found_inf() {
                Some(f) => Unscaled::Host(f),
                None => Unscaled::No,
            }),
            device: None,
        }
    }
}

impl GradScaler {
    /// A scaler at `config.init_scale`, growth tracker 0.
    ///
    /// # Errors
    /// Those of [`GradScalerConfig::validate`].
    pub fn new(config: GradScalerConfig) -> Result<Self, FsdpError> {
        config.validate()?;
        Ok(GradScaler {
            config,
            scale: config.init_scale,
            growth_tracker: 0,
            skipped_steps: 0,
            unscaled: Mutex::new(Unscaled::No),
            device: None,
        })
    }

    /// This step's unscaling.
    pub(super) fn lock(&self) -> MutexGuard<'_, Unscaled> {
        self.unscaled.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The settings.
    pub fn config(&self) -> &GradScalerConfig {
        &self.config
    }

    /// The current scale (PyTorch's `get_scale()`): the factor of the gradients of the next
    /// backward passes.
    pub fn scale(&self) -> f32 {
        self.state().scale
    }

    /// `1 / scale`, computed in `f64` and rounded to `f32` as torch does.
    pub fn inv_scale(&self) -> f32 {
        Self::inv_of(self.scale())
    }

    /// `1 / scale` in `f64`, rounded to `f32`.
    pub(crate) fn inv_of(scale: f32) -> f32 {
        (1.0 / f64::from(scale)) as f32
    }

    /// Consecutive steps without overflow since the last growth or backoff (PyTorch's
    /// `_growth_tracker`).
    pub fn growth_tracker(&self) -> u32 {
        self.state().growth_tracker
    }

    /// Optimizer steps skipped because of an overflow.
    pub fn skipped_steps(&self) -> u64 {
        self.state().skipped_steps
    }

    /// Whether this step's gradients, once unscaled, held a NaN or an infinity on some rank:
    /// `None` while they are still scaled (before [`Fsdp::unscale_grads`], [`Fsdp::grad_norm`]
    /// or [`Fsdp::clip_grad_norm`] of this step, and after the step). With the scaler on a
    /// device this waits for the device (and is `None` if reading it failed: the engine's next
    /// call reports the failure).
    pub fn found_inf(&self) -> Option<bool> {
        match &*self.lock() {
            Unscaled::No => None,
            Unscaled::Host(f) => Some(*f),
            Unscaled::Device {
                sharded,
                replicated,
                work,
            } => self
                .device
                .as_ref()?
                .found_inf(sharded, replicated, work.clone())
                .ok(),
        }
    }

    /// Whether this step's gradients are unscaled.
    pub(crate) fn is_unscaled(&self) -> bool {
        !matches!(*self.lock(), Unscaled::No)
    }

    /// The sums of squares of this step's gradients unscaled on the device, if they are.
    pub(crate) fn device_sums(&self) -> Option<(Buffer, Buffer, Option<Work>)> {
        match &*self.lock() {
            Unscaled::Device {
                sharded,
                replicated,
                work,
            } => Some((sharded.clone(), replicated.clone(), work.clone())),
            _ => None,
        }
    }

    /// The state a checkpoint holds. With the scaler on a device, as the device decided it so
    /// far (waiting for it).
    pub fn state(&self) -> GradScalerState {
        match &self.device {
            Some(d) => d.settled().scaler,
            None => self.host_state(),
        }
    }

    /// The host's numbers.
    pub(crate) fn host_state(&self) -> GradScalerState {
        GradScalerState {
            scale: self.scale,
            growth_tracker: self.growth_tracker,
            skipped_steps: self.skipped_steps,
        }
    }

    /// Set the host's numbers.
    pub(crate) fn set_numbers(&mut self, s: GradScalerState) {
        self.scale = s.scale;
        self.growth_tracker = s.growth_tracker;
        self.skipped_steps = s.skipped_steps;
    }

    /// Update the scale after a step, exactly as torch's `_amp_update_scale_`: on an overflow
    /// (`found_inf`) the scale is multiplied by the backoff factor and the tracker reset to 0;
    /// otherwise the tracker counts the step, and when it reaches the growth interval the scale
    /// is multiplied by the growth factor (only if the result is finite) and the tracker reset.
    /// Both products are taken in `f64` and rounded to `f32`. (The tracker is compared with `≥`
    /// where torch has `==`: the same, except for a restored tracker above the interval.)
    /// Counts nothing else: the engine counts [`skipped_steps`](Self::skipped_steps).
    /// Acts on the host's numbers.
    pub fn update(&mut self, found_inf: bool) {
        (self.scale, self.growth_tracker) =
            next_scale(&self.config, self.scale, self.growth_tracker, found_inf);
        self.reset_step();
    }

    /// The scaler's skip of a step whose gradients overflowed (on the host's numbers): counted,
    /// and the scale backed off.
    pub(crate) fn skip_overflow(&mut self) {
        self.skipped_steps += 1;
        self.update(true);
    }

    /// Forget this step's unscaling (the gradients were zeroed).
    pub(crate) fn reset_step(&mut self) {
        *self
            .unscaled
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner) = Unscaled::No;
    }
}

/// The scale and growth tracker after a step ([`GradScaler::update`]'s arithmetic, also the
/// device scaler's on the host twin).
pub(crate) fn next_scale(
    config: &GradScalerConfig,
    scale: f32,
    tracker: u32,
    found_inf: bool,
) -> (f32, u32) {
    if found_inf {
        return ((f64::from(scale) * config.backoff_factor) as f32, 0);
    }
    let successful = tracker.saturating_add(1);
    if successful < config.growth_interval {
        return (scale, successful);
    }
    let grown = (f64::from(scale) * config.growth_factor) as f32;
    (if grown.is_finite() { grown } else { scale }, 0)
}

/// Read the grad scaler's state saved with the sharded checkpoint in `dir`
/// ([`GRAD_SCALER_FILE`]): `None` when the checkpoint was saved without a scaler.
///
/// # Errors
/// [`FsdpError::Checkpoint`] for an unreadable or malformed file.
pub fn load_grad_scaler_state(dir: &Path) -> Result<Option<GradScalerState>, FsdpError> {
    let path = dir.join(GRAD_SCALER_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(crate::checkpoint::err(&path, format!("cannot read: {e}"))),
    };
    let bad = |what: &str| crate::checkpoint::err(&path, format!("grad scaler state: {what}"));
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(&format!("not valid JSON: {e}")))?;
    let scale = v
        .get("scale")
        .and_then(serde_json::Value::as_f64)
        .map(|s| s as f32)
        .filter(|s| s.is_finite() && *s > 0.0)
        .ok_or_else(|| bad("missing or invalid `scale`"))?;
    let growth_tracker = v
        .get("growth_tracker")
        .and_then(serde_json::Value::as_u64)
        .and_then(|t| u32::try_from(t).ok())
        .ok_or_else(|| bad("missing or invalid `growth_tracker`"))?;
    let skipped_steps = v
        .get("skipped_steps")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| bad("missing or invalid `skipped_steps`"))?;
    Ok(Some(GradScalerState {
        scale,
        growth_tracker,
        skipped_steps,
    }))
}

/// Writes a grad scaler's settings and state into the sharded checkpoint `dir`
/// ([`GRAD_SCALER_FILE`], atomically, read back by [`load_grad_scaler_state`]), or removes a
/// stale file when there is no scaler (`None`). For trainers that keep a scaler of their own
/// (the device's) and write the engine's checkpoints.
///
/// # Errors
/// [`FsdpError::Checkpoint`] for a failed write or removal.
pub fn save_grad_scaler_state(
    dir: &Path,
    scaler: Option<(&GradScalerConfig, GradScalerState)>,
) -> Result<(), FsdpError> {
    let path = dir.join(GRAD_SCALER_FILE);
    let Some((c, s)) = scaler else {
        return match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(crate::checkpoint::err(
                &path,
                format!("cannot remove a stale file: {e}"),
            )),
            _ => Ok(()),
        };
    };
    let text = serde_json::json!({
        "format": "fsdp-grad-scaler",
        "scale": f64::from(s.scale),
        "growth_tracker": s.growth_tracker,
        "skipped_steps": s.skipped_steps,
        "config": {
            "init_scale": f64::from(c.init_scale),
            "growth_factor": c.growth_factor,
            "backoff_factor": c.backoff_factor,
            "growth_interval": c.growth_interval,
        },
    })
    .to_string();
    crate::checkpoint::write_atomic(&path, |w| w.write_all(text.as_bytes()))
}
