//! Saving and restoring a [`DeviceTrainer`]'s state: the optimizer's buffers (AdamW's
//! moments, or `AnyPrecisionAdamW`'s widened to f32) and the step counts as
//! the engine's checkpoints hold them ([`FullOptimizerState`]), and a checkpoint of the whole
//! trainer written in the engine's sharded format ([`write_full_checkpoint`]: world 1, one
//! unit), which the engine resumes from at any world size and which
//! [`load_sharded_gpt`](crate::checkpoint::load_sharded_gpt) reads back.

use std::collections::HashMap;
use std::path::Path;

use fsdp::checkpoint::{
    write_full_checkpoint, FullAdamW, FullAnyPrecision, FullOptimizerState, FullParam, FullState,
};
use fsdp::engine::{save_grad_scaler_state, GradScalerState, OptimizerSetup};
use fsdp::optim::{decay_2d_only, decay_2d_only_group};
use fsdp::FsdpError;
use fsdp_device::DType;
use fsdp_kernels::gpt::{param_shapes, GptOps, Weights};
use fsdp_kernels::host::{
    pack_state, unpack_state, STEP_GROWTH_TRACKER, STEP_SCALE, STEP_SCALER_SKIPPED,
};
use fsdp_kernels::KernelError;

use crate::device_optim::{Moments, Placement};
use crate::device_train::{DeviceTrainConfig, DeviceTrainError, DeviceTrainer};

fn bad(reason: String) -> DeviceTrainError {
    DeviceTrainError::Fsdp(FsdpError::Checkpoint {
        path: "<optimizer state>".into(),
        reason,
    })
}

impl<O: GptOps> DeviceTrainer<O> {
    /// The optimizer groups and the learning-rate schedule as the engine records them for the
    /// same run (nanoGPT's two groups with `decay_2d_only`, else the one default group).
    pub fn optimizer_setup(&self) -> OptimizerSetup {
        optimizer_setup(&self.config)
    }

    /// AdamW's state after every step enqueued so far: both moments by parameter name, the
    /// optimizer steps taken (AdamW's step count and the schedule's position alike) and the
    /// setup.
    ///
    /// # Errors
    /// [`DeviceTrainError::Unread`] while an enqueued step's outcome is unread (the count is
    /// not known yet); copy failures.
    pub fn optimizer_state(&self) -> Result<FullOptimizerState, DeviceTrainError> {
        if let Some(p) = &self.pending {
            return Err(DeviceTrainError::Unread { step: p.step });
        }
        let (d, lens) = (self.config.state_dtype(), tensor_lens(&self.config));
        let buffers = match &self.state {
            Placement::Device(o) => {
                moments_by_name(&o.moments, d, &lens, |b| self.model.ops().download(b))?
            }
            Placement::Host(h, _) => {
                moments_by_name(&h.optim.moments, d, &lens, |b| Ok(b.to_vec()))?
            }
        };
        Ok(adamw_state(&self.config, self.known_steps, buffers))
    }

    /// Continues from a saved optimizer state (a checkpoint's, the engine's or this
    /// trainer's): both moments of every parameter, the optimizer steps taken, and the
    /// non-finite steps `skipped` so far (they count against
    /// [`set_skip_nonfinite`](Self::set_skip_nonfinite)). The groups and schedule are the
    /// trainer's own settings.
    ///
    /// # Errors
    /// [`DeviceTrainError::Unread`] while an enqueued step is unread; a state of another
    /// optimizer, with AdamW's step count unequal to the optimizer steps taken, or missing or
    /// mis-sizing a moment (naming it); copy failures.
    pub fn load_optimizer_state(
        &mut self,
        state: &FullOptimizerState,
        skipped: u64,
    ) -> Result<(), DeviceTrainError> {
        if let Some(p) = &self.pending {
            return Err(DeviceTrainError::Unread { step: p.step });
        }
        let values = checked_moments(state, &self.config)?;
        let d = self.config.state_dtype();
        match &mut self.state {
            Placement::Device(o) => upload_moments(self.model.ops(), &mut o.moments, &values, d)?,
            Placement::Host(h, _) => {
                let h = &mut **h;
                upload_moments(&h.ops, &mut h.optim.moments, &values, d)?;
            }
        }
        let tensors = self.decays.len();
        let scalars = self
            .config
            .start_scalars(tensors, state.optimizer_steps, skipped, None);
        self.scalars = self.model.ops().scalars(&scalars)?;
        self.scaler_state = self.config.initial_scaler_state();
        if let Placement::Host(h, _) = &mut self.state {
            h.scalars.copy_from_slice(&scalars);
        }
        self.known_steps = state.optimizer_steps;
        Ok(())
    }

    /// Continues with the grad scaler's saved state (scale, growth tracker, skipped steps), as
    /// [`Fsdp::set_grad_scaler_state`](fsdp::engine::Fsdp::set_grad_scaler_state): after
    /// [`load_optimizer_state`](Self::load_optimizer_state), which starts the scaler anew.
    ///
    /// # Errors
    /// [`DeviceTrainError::Unread`] while an enqueued step is unread; no grad scaler
    /// configured, or a scale that is not finite and positive; copy failures.
    pub fn set_grad_scaler_state(
        &mut self,
        state: GradScalerState,
    ) -> Result<(), DeviceTrainError> {
        if let Some(p) = &self.pending {
            return Err(DeviceTrainError::Unread { step: p.step });
        }
        let slots = scaler_slots(&self.config, state)?;
        self.model
            .ops()
            .write_scalars(&mut self.scalars, STEP_SCALE, &slots)?;
        if let Placement::Host(h, _) = &mut self.state {
            h.ops.write_scalars(&mut h.scalars, STEP_SCALE, &slots)?;
        }
        self.scaler_state = Some(state);
        Ok(())
    }

    /// Writes the trainer's parameters and optimizer state into `dir` as a checkpoint in the
    /// engine's sharded format (world 1).
    ///
    /// # Errors
    /// As [`optimizer_state`](Self::optimizer_state); a failed write.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<(), DeviceTrainError> {
        let o = self.optimizer_state()?;
        let params = self.full_params()?;
        write_state(dir, &self.config, &params, &o)?;
        save_scaler(dir, &self.config, self.scaler_state)
    }
}

/// Writes the grad scaler's settings and `state` into the checkpoint `dir` as the engine does
/// ([`save_grad_scaler_state`]), or removes a stale file without a scaler.
///
/// # Errors
/// A failed write.
pub(crate) fn save_scaler(
    dir: &Path,
    c: &DeviceTrainConfig,
    state: Option<GradScalerState>,
) -> Result<(), DeviceTrainError> {
    let config = c.grad_scaler.filter(|g| g.enabled);
    Ok(save_grad_scaler_state(dir, config.as_ref().zip(state))?)
}

/// The scalar slots from [`STEP_SCALE`] on that hold a grad scaler's `state` (this step's
/// unscaling and overflow cleared).
///
/// # Errors
/// No grad scaler configured; a scale that is not finite and positive.
pub(crate) fn scaler_slots(
    c: &DeviceTrainConfig,
    state: GradScalerState,
) -> Result<[f64; 5], DeviceTrainError> {
    let bad = |reason: String| DeviceTrainError::from(FsdpError::InvalidFsdpConfig { reason });
    if c.scaler_rule().is_none() {
        return Err(bad("a grad scaler's state for a trainer without one".into()));
    }
    if !(state.scale.is_finite() && state.scale > 0.0) {
        return Err(bad(format!(
            "a grad scaler's scale must be finite and positive, not {}",
            state.scale
        )));
    }
    // From STEP_SCALE on: the scale, this step's unscaling and overflow (cleared), the
    // tracker, the skips.
    let mut slots = [f64::from(state.scale), 0.0, 0.0, 0.0, 0.0];
    slots[STEP_GROWTH_TRACKER - STEP_SCALE] = f64::from(state.growth_tracker);
    slots[STEP_SCALER_SKIPPED - STEP_SCALE] = state.skipped_steps as f64;
    Ok(slots)
}

/// The buffers of every tensor (`values`, in [`param_shapes`] order: both moments and, if
/// `m` has one, the compensation), each `shard` of `factor` as
/// [`shard_of`](crate::device_shard::shard_of) cuts it (1: whole), stored in `dtype` into `m`.
pub(crate) fn upload_state<P: GptOps>(
    ops: &P,
    m: &mut Moments<P::Buf>,
    values: &[MomentSet<'_>],
    dtype: DType,
    shard: usize,
    factor: usize,
) -> Result<(), KernelError> {
    let put = |v: &Vec<f32>, b: &mut P::Buf| {
        let part = crate::device_shard::shard_of(v, shard, factor);
        ops.upload_into(&pack_state(&part, dtype), b)
    };
    let mut comps = m.compensation.as_mut().map(|c| c.all_mut().into_iter());
    let targets = m.exp_avg.all_mut().into_iter().zip(m.exp_avg_sq.all_mut());
    for ((dm, dv), (wm, wv, wc)) in targets.zip(values) {
        put(wm, dm)?;
        put(wv, dv)?;
        if let (Some(dc), Some(wc)) = (comps.as_mut().and_then(Iterator::next), wc) {
            put(wc, dc)?;
        }
    }
    Ok(())
}

/// [`upload_state`] of whole tensors.
fn upload_moments<P: GptOps>(
    ops: &P,
    m: &mut Moments<P::Buf>,
    values: &[MomentSet<'_>],
    dtype: DType,
) -> Result<(), KernelError> {
    upload_state(ops, m, values, dtype, 0, 1)
}

/// The optimizer's buffers by kind (`exp_avg`, `exp_avg_sq` and, if any, `compensation`),
/// each by parameter name.
pub(crate) type StateBuffers = Vec<(&'static str, HashMap<String, Vec<f32>>)>;

/// The buffers of `m` (whole tensors stored in `dtype`) by kind and parameter name, each read
/// by `read` and widened to f32.
fn moments_by_name<B>(
    m: &Moments<B>,
    dtype: DType,
    lens: &[usize],
    read: impl Fn(&B) -> Result<Vec<f32>, KernelError>,
) -> Result<StateBuffers, KernelError> {
    let by_name = |w: &Weights<B>| -> Result<HashMap<String, Vec<f32>>, KernelError> {
        w.named()
            .into_iter()
            .zip(lens)
            .map(|((name, b), &n)| Ok((name, unpack_state(&read(b)?, n, dtype)?)))
            .collect()
    };
    m.kinds()
        .into_iter()
        .map(|(kind, w)| Ok((kind, by_name(w)?)))
        .collect()
}

/// The number of elements of each tensor of `c`'s model, in [`param_shapes`] order.
pub(crate) fn tensor_lens(c: &DeviceTrainConfig) -> Vec<usize> {
    param_shapes(&c.dims())
        .into_iter()
        .map(|(_, s)| s.iter().product())
        .collect()
}

/// The optimizer groups and the learning-rate schedule of `c` as the engine records them for
/// the same run (nanoGPT's two groups with `decay_2d_only`, else the one default group).
pub(crate) fn optimizer_setup(c: &DeviceTrainConfig) -> OptimizerSetup {
    let mut setup = OptimizerSetup {
        lr_schedule: c.schedule,
        ..OptimizerSetup::default()
    };
    if c.decay_2d_only {
        setup.groups = decay_2d_only(c.adamw.weight_decay);
        setup.group_of = param_shapes(&c.dims())
            .into_iter()
            .map(|(name, shape)| {
                let g = decay_2d_only_group(&shape);
                (name, g)
            })
            .collect();
    }
    setup
}

/// The name the engine's checkpoints give `c`'s optimizer.
fn optimizer_name(c: &DeviceTrainConfig) -> &'static str {
    match c.any_precision {
        Some(_) => "anyprecision_adamw",
        None => "adamw",
    }
}

/// The optimizer state of `c`'s run after `steps` optimizer steps, with its buffers by kind
/// and name (widened to f32): as the engine saves it.
pub(crate) fn adamw_state(
    c: &DeviceTrainConfig,
    steps: u64,
    buffers: StateBuffers,
) -> FullOptimizerState {
    FullOptimizerState {
        optimizer: optimizer_name(c).into(),
        step: steps,
        optimizer_steps: steps,
        setup: optimizer_setup(c),
        buffers: buffers
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
    }
}

/// One parameter's two moments and (under `AnyPrecisionAdamW` with Kahan summation) its
/// compensation, borrowed from a saved state.
pub(crate) type MomentSet<'a> = (&'a Vec<f32>, &'a Vec<f32>, Option<&'a Vec<f32>>);

/// A saved optimizer state checked for `c`'s model (the trainer's optimizer, one step count,
/// every buffer of every parameter at its size): the buffers in [`param_shapes`] order.
///
/// # Errors
/// A state of another optimizer, with the step count unequal to the optimizer steps taken,
/// or missing or mis-sizing a buffer (naming it).
pub(crate) fn checked_moments<'a>(
    state: &'a FullOptimizerState,
    c: &DeviceTrainConfig,
) -> Result<Vec<MomentSet<'a>>, DeviceTrainError> {
    let name = optimizer_name(c);
    if state.optimizer != name {
        return Err(bad(format!(
            "the state is of `{}`, the device trainer runs `{name}`",
            state.optimizer
        )));
    }
    if state.step != state.optimizer_steps {
        return Err(bad(format!(
            "AdamW's step count {} differs from the {} optimizer steps taken (the device \
             trainer keeps one count)",
            state.step, state.optimizer_steps
        )));
    }
    let moment = |kind: &str, name: &str, len: usize| -> Result<&Vec<f32>, DeviceTrainError> {
        state
            .buffers
            .get(kind)
            .and_then(|m| m.get(name))
            .filter(|v| v.len() == len)
            .ok_or_else(|| bad(format!("`{kind}` of `{name}` is missing or mis-sized")))
    };
    let mut values = Vec::new();
    for (name, shape) in param_shapes(&c.dims()) {
        let len = shape.iter().product();
        let kahan = c.any_precision.is_some_and(|a| a.kahan);
        values.push((
            moment("exp_avg", &name, len)?,
            moment("exp_avg_sq", &name, len)?,
            if kahan {
                Some(moment("compensation", &name, len)?)
            } else {
                None
            },
        ));
    }
    Ok(values)
}

/// Writes `params` and the optimizer state `o` of `c`'s model into `dir` as a checkpoint in
/// the engine's sharded format (world 1).
///
/// # Errors
/// A parameter or moment missing; a failed write.
pub(crate) fn write_state(
    dir: &Path,
    c: &DeviceTrainConfig,
    params: &HashMap<String, Vec<f32>>,
    o: &FullOptimizerState,
) -> Result<(), DeviceTrainError> {
    let shapes = param_shapes(&c.dims());
    let missing = |kind: &str| bad(format!("no `{kind}` buffers"));
    let state = FullState {
        params: shapes
            .iter()
            .map(|(name, shape)| {
                let values = params
                    .get(name)
                    .ok_or_else(|| bad(format!("no parameter `{name}`")))?;
                Ok(FullParam {
                    name,
                    shape,
                    values,
                })
            })
            .collect::<Result<_, DeviceTrainError>>()?,
        adamw: Some(FullAdamW {
            step: o.step,
            optimizer_steps: o.optimizer_steps,
            exp_avg: o.buffers.get("exp_avg").ok_or_else(|| missing("exp_avg"))?,
            exp_avg_sq: o
                .buffers
                .get("exp_avg_sq")
                .ok_or_else(|| missing("exp_avg_sq"))?,
            any_precision: c.any_precision.map(|_| FullAnyPrecision {
                compensation: o.buffers.get("compensation"),
            }),
        }),
        setup: o.setup.clone(),
    };
    Ok(write_full_checkpoint(dir, &state)?)
}
