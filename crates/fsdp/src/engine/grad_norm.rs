//! The global gradient norm without the host waiting ([`Fsdp::grad_norm_async`]) and clipping
//! by it on the device ([`Fsdp::clip_grad_norm_async`]): PyTorch's `clip_grad_norm_`, which
//! returns the norm as a tensor and scales the gradients on the GPU by a coefficient computed
//! there, so that only `.item()` synchronises.

use fsdp_collectives::Work;
use fsdp_device::{Buffer, DType};

use super::decided_step::StepSquares;
use super::device::ComputeDevice;
use super::device_scalar::DeviceScalar;
use super::fsdp::Fsdp;
use crate::FsdpError;

impl Fsdp {
    /// [`grad_norm`](Self::grad_norm) without waiting on the host: with the shards on a
    /// device, the units' squared norms are summed there, all-reduced over the shard group
    /// and copied to host memory while the host goes on; read the result with
    /// [`DeviceScalar::value`]. The host engine computes it at once. Every rank must call it.
    ///
    /// # Errors
    /// Unreduced gradients as in [`optimizer_step`](Self::optimizer_step); a failing
    /// collective or device operation known when it is issued.
    pub fn grad_norm_async(&self) -> Result<DeviceScalar, FsdpError> {
        match self.ctx.shards_on_device().cloned() {
            Some(dev) => self.norm_on_device(&dev, None),
            None => Ok(DeviceScalar::from(self.grad_norm()?)),
        }
    }

    /// [`clip_grad_norm`](Self::clip_grad_norm) without waiting on the host: with the shards
    /// on a device, the norm and the clip coefficient are computed there and the gradient
    /// shards scaled by it there (PyTorch's `clip_grad_norm_` on CUDA tensors), so a training
    /// step that clips never blocks the host; the returned norm is read with
    /// [`DeviceScalar::value`], when the host needs it. The same gradients and norm as
    /// [`clip_grad_norm`](Self::clip_grad_norm). Every rank must call it.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] for a negative or non-finite `max_norm`; those of
    /// [`grad_norm_async`](Self::grad_norm_async).
    pub fn clip_grad_norm_async(&mut self, max_norm: f64) -> Result<DeviceScalar, FsdpError> {
        match self.ctx.shards_on_device().cloned() {
            Some(dev) => {
                crate::optim::check_max_norm(max_norm)?;
                self.norm_on_device(&dev, Some(max_norm))
            }
            None => Ok(DeviceScalar::from(self.clip_grad_norm(max_norm)?)),
        }
    }

    /// The norm on the device, and clipping by `max_norm` there: the units' squared norms
    /// summed in their order (sharded units and replicated ones apart, as on the host), the
    /// sharded sum all-reduced over the shard group, then the norm and the coefficient, every
    /// gradient shard scaled by it, and the norm copied to host memory — all issued, none
    /// waited for.
    fn norm_on_device(
        &self,
        dev: &ComputeDevice,
        max_norm: Option<f64>,
    ) -> Result<DeviceScalar, FsdpError> {
        self.check_reduced()?;
        self.unscale_issue()?;
        let c = dev.compute_stream();
        let (sharded, replicated, work) = self.squares_on_device(dev)?;
        self.keep_step_squares(Some(StepSquares::Device(
            sharded.clone(),
            replicated.clone(),
            work.clone(),
        )));
        let out = dev.alloc(DType::F64, 2, c)?;
        let limit = max_norm.unwrap_or(f64::INFINITY);
        dev.clip_coefficient(&sharded, &replicated, limit, &out, c)?;
        if max_norm.is_some() {
            let coef = out.slice(1..2)?;
            for g in &self.groups {
                dev.scale_by(&g.grad_shard, &coef, c)?;
            }
        }
        DeviceScalar::pending(dev, &out.slice(0..1)?, work)
    }

    /// The gradient shards' sums of squares on the device, in `f64`: the sharded units' and
    /// the replicated units' apart, each added in the units' order (as on the host), the
    /// sharded sum all-reduced over the shard group by the returned work; nothing waited for.
    pub(crate) fn squares_on_device(
        &self,
        dev: &ComputeDevice,
    ) -> Result<(Buffer, Buffer, Option<Work>), FsdpError> {
        let c = dev.compute_stream();
        let sum = |sharded: bool| -> Result<Buffer, FsdpError> {
            let acc = dev.alloc(DType::F64, 1, c)?;
            dev.zero(&acc, c)?;
            for g in self.groups.iter().filter(|g| (g.factor > 1) == sharded) {
                dev.add_scalar(&acc, &dev.sum_of_squares(&g.grad_shard, c)?, c)?;
            }
            Ok(acc)
        };
        let (sharded, replicated) = (sum(true)?, sum(false)?);
        let work = self.ctx.sum_on_device(self.ctx.groups.shard(), &sharded)?;
        Ok((sharded, replicated, work))
    }
}
