//! The shards on a device ([`Fsdp::new_on`] without
//! [`FsdpConfig::offload_params`](super::FsdpConfig::offload_params)): placing the shards,
//! gradient shards and optimizer state there, the optimizer side of a step there (the step,
//! zeroing, the norm and clipping), and the host copies that state dicts and checkpoints read.

use std::borrow::Cow;

use fsdp_device::{Buffer, DType};

use super::device::ComputeDevice;
use super::device_optim::StepPlan;
use super::fsdp::Fsdp;
use super::param_group::ParamGroup;
use crate::optim::{OptimizerConfig, OptimizerState, PrecisionVec};
use crate::FsdpError;

/// One state buffer of a unit's optimizer state in host memory.
enum HostMoment<'a> {
    /// AdamW's or SGD's.
    F32(&'a mut Vec<f32>),
    /// AnyPrecisionAdamW's, of its dtype.
    Typed(&'a mut PrecisionVec),
}

impl HostMoment<'_> {
    /// The elements, as a host buffer of their dtype.
    fn to_buffer(&self) -> Result<Buffer, FsdpError> {
        Ok(match self {
            HostMoment::F32(v) => Buffer::from_slice(v)?,
            HostMoment::Typed(PrecisionVec::F32(v)) => Buffer::from_slice(v)?,
            HostMoment::Typed(PrecisionVec::BF16(v)) => Buffer::from_slice(v)?,
            HostMoment::Typed(PrecisionVec::F16(v)) => Buffer::from_slice(v)?,
        })
    }

    /// Replace the elements by those of the host buffer `b` (of the same dtype).
    fn set(&mut self, b: &Buffer) -> Result<(), FsdpError> {
        match self {
            HostMoment::F32(v) => **v = b.to_vec()?,
            HostMoment::Typed(PrecisionVec::F32(v)) => *v = b.to_vec()?,
            HostMoment::Typed(PrecisionVec::BF16(v)) => *v = b.to_vec()?,
            HostMoment::Typed(PrecisionVec::F16(v)) => *v = b.to_vec()?,
        }
        Ok(())
    }

    /// Free the elements (the dtype stays).
    fn clear(&mut self) {
        match self {
            HostMoment::F32(v) => **v = Vec::new(),
            HostMoment::Typed(PrecisionVec::F32(v)) => *v = Vec::new(),
            HostMoment::Typed(PrecisionVec::BF16(v)) => *v = Vec::new(),
            HostMoment::Typed(PrecisionVec::F16(v)) => *v = Vec::new(),
        }
    }
}

/// The state buffers of an optimizer state in host memory, in the order of
/// `ParamGroup::device_moments`: AdamW's moments, SGD's momentum buffer (when `momentum`),
/// AnyPrecisionAdamW's moments and compensation.
fn host_moments(state: &mut OptimizerState, momentum: bool) -> Vec<HostMoment<'_>> {
    match state {
        OptimizerState::AdamW(s) => vec![
            HostMoment::F32(&mut s.exp_avg),
            HostMoment::F32(&mut s.exp_avg_sq),
        ],
        OptimizerState::Sgd {
            momentum_buffer, ..
        } if momentum => vec![HostMoment::F32(momentum_buffer)],
        OptimizerState::AnyPrecisionAdamW(s) => {
            let mut out = vec![
                HostMoment::Typed(&mut s.exp_avg),
                HostMoment::Typed(&mut s.exp_avg_sq),
            ];
            out.extend(s.compensation.as_mut().map(HostMoment::Typed));
            out
        }
        _ => Vec::new(),
    }
}

/// Whether `cfg` keeps a momentum buffer (SGD with momentum).
fn has_momentum(cfg: &OptimizerConfig) -> bool {
    matches!(cfg, OptimizerConfig::Sgd(c) if c.momentum != 0.0)
}

/// Move `g`'s optimizer state to `dev`: its moments uploaded into `g.device_moments`, the host
/// state keeping only the step count (and its dtypes).
fn place_moments(
    g: &mut ParamGroup,
    dev: &ComputeDevice,
    cfg: &OptimizerConfig,
) -> Result<(), FsdpError> {
    let mut moments = Vec::new();
    let numel = g.layout.shard_numel();
    for mut m in host_moments(&mut g.optim_state, has_momentum(cfg)) {
        let host = m.to_buffer()?;
        moments.push(if dev.is_dry_run() {
            // A dry run's state is empty (no bytes anywhere): its moments take their size.
            dev.alloc(host.dtype(), numel, dev.transfer_stream())?
        } else {
            dev.copy_from_host(&host, dev.transfer_stream())?
        });
        m.clear();
    }
    g.device_moments = moments;
    Ok(())
}

impl Fsdp {
    /// Place every unit's shard, gradient shard and optimizer state on the compute device
    /// (from the host values [`Fsdp::new`] built).
    pub(super) fn place_shards(&mut self) -> Result<(), FsdpError> {
        let Some(dev) = self.ctx.shards_on_device().cloned() else {
            return Ok(());
        };
        let shards = self.groups.first().map_or(DType::F32, |g| g.shard.dtype());
        dev.check_optimizer(&self.optim, shards)
            .map_err(|e| match e {
                FsdpError::InvalidFsdpConfig { reason } => FsdpError::InvalidFsdpConfig {
                    reason: format!("rank {}: {reason}", self.rank()),
                },
                e => e,
            })?;
        let c = dev.compute_stream();
        for g in &mut self.groups {
            g.shard = dev.copy_from_host(&g.shard, dev.transfer_stream())?;
            if g.factor == 1 {
                g.full = Some(g.shard.clone());
            }
            let grad = dev.alloc(DType::F32, g.grad_shard.len(), c)?;
            dev.zero(&grad, c)?;
            g.grad_shard = grad;
            g.grad_shard_zero = true;
            place_moments(g, &dev, &self.optim)?;
        }
        dev.synchronize()
    }

    /// The optimizer step on the device: each unit's AdamW or SGD on its shard, issued on the
    /// compute stream after the gradients' accumulation, the step count kept on the host.
    pub(super) fn step_on_device(&mut self, dev: &ComputeDevice, lr: f64) -> Result<(), FsdpError> {
        // A collective of this step known to have failed stops the step (never blocks).
        self.ctx.check_deferred()?;
        self.step_units(dev, |steps| StepPlan::Known {
            lr,
            step: steps + 1,
        })?;
        for g in &mut self.groups {
            let step = g.optim_state.steps() + 1;
            g.optim_state.set_steps(step);
        }
        Ok(())
    }

    /// Issue each unit's optimizer step on the device's compute stream as `plan` (of the
    /// unit's steps taken so far) says, after the gradients' accumulation.
    pub(super) fn step_units<'a>(
        &'a self,
        dev: &ComputeDevice,
        plan: impl Fn(u64) -> StepPlan<'a>,
    ) -> Result<(), FsdpError> {
        for g in &self.groups {
            dev.optimizer_step(
                &self.optim,
                &plan(g.optim_state.steps()),
                &self.setup.groups,
                &g.segments,
                &g.shard,
                &g.grad_shard,
                &g.device_moments,
                dev.compute_stream(),
            )?;
        }
        Ok(())
    }

    /// Unit `g`'s optimizer state in host memory: its own, or with the shards on a device, a
    /// copy of the device's moments with the step count.
    pub(super) fn host_optim_state<'a>(
        &self,
        g: &'a ParamGroup,
    ) -> Result<Cow<'a, OptimizerState>, FsdpError> {
        // The steps a device scaler counted that the host has not folded in yet.
        let unread = self.unread_steps()?;
        if g.device_moments.is_empty() && unread == 0 {
            return Ok(Cow::Borrowed(&g.optim_state));
        }
        let mut state = g.optim_state.clone();
        state.set_steps(state.steps() + unread);
        let momentum = has_momentum(&self.optim);
        let moments: Vec<&Buffer> = g.device_moments.iter().collect();
        let copies = self.ctx.host_copies(&moments)?;
        for (mut m, b) in host_moments(&mut state, momentum).into_iter().zip(copies) {
            m.set(&b)?;
        }
        Ok(Cow::Owned(state))
    }

    /// With the shards on a device, move the optimizer states just loaded into host memory
    /// there.
    pub(super) fn place_loaded_moments(&mut self) -> Result<(), FsdpError> {
        let Some(dev) = self.ctx.shards_on_device().cloned() else {
            return Ok(());
        };
        for g in &mut self.groups {
            place_moments(g, &dev, &self.optim)?;
        }
        dev.synchronize()
    }
}
