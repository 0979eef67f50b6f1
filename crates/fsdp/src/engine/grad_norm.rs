//! The global gradient norm as a value the device may still be computing ([`GradNorm`]), and
//! clipping by it without the host reading it ([`Fsdp::clip_grad_norm_async`]): PyTorch's
//! `clip_grad_norm_`, which returns the norm as a tensor and scales the gradients on the GPU by
//! a coefficient computed there, so that only `.item()` synchronises.

use std::time::Duration;

use fsdp_collectives::{ReduceOp, Work};
use fsdp_device::{Buffer, DType, Event};

use super::device::ComputeDevice;
use super::fsdp::Fsdp;
use crate::trace::SpanKind;
use crate::FsdpError;

/// The global L2 norm of the gradients from [`Fsdp::grad_norm_async`] or
/// [`Fsdp::clip_grad_norm_async`]. The host engine computes it at once. With the shards on a
/// device ([`Fsdp::new_on`]) it is computed there, its collective and its copy to host memory
/// issued without the host waiting. [`value`](Self::value) then waits for it: read it when
/// the host needs it, e.g. one step later, as PyTorch's returned norm is read with `.item()`.
///
/// # Example
///
/// ```
/// use fsdp::engine::{FsdpConfig, ParamInit, ShardingStrategy};
/// use fsdp::optim::AdamWConfig;
/// use fsdp::units::{ParamSpec, UnitPlan, UnitSpec};
/// use fsdp::Fsdp;
/// use fsdp_collectives::ring;
///
/// let plan = UnitPlan {
///     units: vec![UnitSpec { name: "l".into(), params: vec![ParamSpec::new("w", vec![4])] }],
///     ignored: vec![],
/// };
/// let norms = ring::run_ranks(2, Default::default(), |comm| {
///     let config = FsdpConfig::new(ShardingStrategy::FullShard);
///     let adamw = AdamWConfig::default();
///     let mut fsdp = Fsdp::new(Box::new(comm), &plan, ParamInit::Zeros, config, adamw)?;
///     // No backward yet: every gradient is zero.
///     let norm = fsdp.clip_grad_norm_async(1.0)?;
///     norm.value()
/// })?;
/// assert!(norms.iter().all(|n| matches!(n, Ok(v) if *v == 0.0)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct GradNorm {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Ready(f64),
    Pending(Box<Pending>),
}

/// A norm on its way from the device: its copy in host memory and what it depends on.
#[derive(Debug)]
struct Pending {
    /// The norm, once the copy ran.
    host: Buffer,
    /// The copy's event.
    copied: Event,
    /// The all-reduce of the squared norms over the shard group, if any.
    work: Option<Work>,
    /// The device, whose streams' errors are the norm's.
    device: ComputeDevice,
    /// How long [`GradNorm::value`] waits for the copy.
    timeout: Duration,
}

impl From<f64> for GradNorm {
    /// A norm known on the host (what the host engine returns).
    fn from(v: f64) -> Self {
        GradNorm {
            inner: Inner::Ready(v),
        }
    }
}

impl GradNorm {
    /// Whether [`value`](Self::value) returns without waiting.
    pub fn is_ready(&self) -> bool {
        match &self.inner {
            Inner::Ready(_) => true,
            Inner::Pending(p) => p.copied.query() && p.work.as_ref().is_none_or(Work::is_completed),
        }
    }

    /// The norm: every rank gets the same value (see [`Fsdp::grad_norm`]). Waits on the host
    /// for the device when it is not ready yet (up to the collective's and the device's
    /// timeouts).
    ///
    /// # Errors
    /// The failure of the collective or of the device's work it depends on; a timeout.
    pub fn value(&self) -> Result<f64, FsdpError> {
        let p = match &self.inner {
            Inner::Ready(v) => return Ok(*v),
            Inner::Pending(p) => p,
        };
        if let Some(w) = &p.work {
            w.synchronize()?;
        }
        p.copied.synchronize_timeout(p.timeout)?;
        p.device.check()?;
        Ok(p.host.to_vec::<f64>()?[0])
    }
}

impl Fsdp {
    /// [`grad_norm`](Self::grad_norm) without waiting on the host: with the shards on a
    /// device, the units' squared norms are summed there, all-reduced over the shard group
    /// and copied to host memory while the host goes on; read the result with
    /// [`GradNorm::value`]. The host engine computes it at once. Every rank must call it.
    ///
    /// # Errors
    /// Unreduced gradients as in [`optimizer_step`](Self::optimizer_step); a failing
    /// collective or device operation known when it is issued.
    pub fn grad_norm_async(&self) -> Result<GradNorm, FsdpError> {
        match self.ctx.shards_on_device().cloned() {
            Some(dev) => self.norm_on_device(&dev, None),
            None => Ok(GradNorm::from(self.grad_norm()?)),
        }
    }

    /// [`clip_grad_norm`](Self::clip_grad_norm) without waiting on the host: with the shards
    /// on a device, the norm and the clip coefficient are computed there and the gradient
    /// shards scaled by it there (PyTorch's `clip_grad_norm_` on CUDA tensors), so a training
    /// step that clips never blocks the host; the returned norm is read with
    /// [`GradNorm::value`], when the host needs it. The same gradients and norm as
    /// [`clip_grad_norm`](Self::clip_grad_norm). Every rank must call it.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] for a negative or non-finite `max_norm`; those of
    /// [`grad_norm_async`](Self::grad_norm_async).
    pub fn clip_grad_norm_async(&mut self, max_norm: f64) -> Result<GradNorm, FsdpError> {
        match self.ctx.shards_on_device().cloned() {
            Some(dev) => {
                crate::optim::check_max_norm(max_norm)?;
                self.norm_on_device(&dev, Some(max_norm))
            }
            None => Ok(GradNorm::from(self.clip_grad_norm(max_norm)?)),
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
    ) -> Result<GradNorm, FsdpError> {
        self.check_reduced()?;
        self.unscale_shared()?;
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
        let mut work = None;
        if let Some(group) = self.ctx.groups.shard() {
            let w = self
                .ctx
                .traced(group.stream(), SpanKind::AllReduce, Vec::new(), 8, || {
                    Ok(group.all_reduce(&sharded, ReduceOp::Sum)?)
                })?;
            work = Some(w.clone());
            self.ctx.wait_or_defer(w)?;
        }
        let out = dev.alloc(DType::F64, 2, c)?;
        let limit = max_norm.unwrap_or(f64::INFINITY);
        dev.clip_coefficient(&sharded, &replicated, limit, &out, c)?;
        if max_norm.is_some() {
            let coef = out.slice(1..2)?;
            for g in &self.groups {
                dev.scale_by(&g.grad_shard, &coef, c)?;
            }
        }
        let (host, copied) = dev.copy_to_host_event(&out.slice(0..1)?, dev.transfer_stream())?;
        let timeout = dev.transfer_stream().timeout().max(c.timeout());
        Ok(GradNorm {
            inner: Inner::Pending(Box::new(Pending {
                host,
                copied,
                work,
                device: dev.clone(),
                timeout,
            })),
        })
    }
}
