//! A scalar the device may still be computing ([`DeviceScalar`]): the gradient norm of
//! [`Fsdp::clip_grad_norm_async`] and the loss of [`Fsdp::forward_backward_async`], read by the
//! host when it needs them, as PyTorch's returned tensors are read with `.item()`.

use std::time::Duration;

use fsdp_collectives::Work;
use fsdp_device::{Buffer, Event};

use super::device::ComputeDevice;
#[cfg(doc)]
use super::fsdp::Fsdp;
use crate::FsdpError;

/// A scalar of a step — the global gradient norm ([`Fsdp::grad_norm_async`],
/// [`Fsdp::clip_grad_norm_async`]) or the loss summed over the ranks
/// ([`Fsdp::forward_backward_async`]) — that the device may still be computing. The host
/// engine computes it at once. On a device it is computed there, its collective and its copy
/// to host memory issued without the host waiting. [`value`](Self::value) then waits for it:
/// read it when the host needs it, e.g. one step later, as PyTorch's returned tensors are read
/// with `.item()`.
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
pub struct DeviceScalar {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Ready(f64),
    Pending(Box<Pending>),
}

/// A scalar on its way from the device: its copy in host memory and what it depends on.
#[derive(Debug)]
struct Pending {
    /// The value (one `f32` or `f64`), once the copy ran.
    host: Buffer,
    /// The copy's event.
    copied: Event,
    /// The all-reduce the value depends on, if any.
    work: Option<Work>,
    /// The device, whose streams' errors are the value's.
    device: ComputeDevice,
    /// How long [`DeviceScalar::value`] waits for the copy.
    timeout: Duration,
}

impl From<f64> for DeviceScalar {
    /// A value known on the host (what the host engine returns).
    fn from(v: f64) -> Self {
        DeviceScalar {
            inner: Inner::Ready(v),
        }
    }
}

impl DeviceScalar {
    /// The one-element `f32` or `f64` buffer `buf` on `dev`, copied to host memory on the
    /// transfer stream after the work that writes it (the collective `work` included); the
    /// host does not wait.
    ///
    /// # Errors
    /// A failing allocation or copy.
    pub(crate) fn pending(
        dev: &ComputeDevice,
        buf: &Buffer,
        work: Option<Work>,
    ) -> Result<Self, FsdpError> {
        let (host, copied) = dev.copy_to_host_event(buf, dev.transfer_stream())?;
        let timeout = dev
            .transfer_stream()
            .timeout()
            .max(dev.compute_stream().timeout());
        Ok(DeviceScalar {
            inner: Inner::Pending(Box::new(Pending {
                host,
                copied,
                work,
                device: dev.clone(),
                timeout,
            })),
        })
    }

    /// Whether [`value`](Self::value) returns without waiting.
    pub fn is_ready(&self) -> bool {
        match &self.inner {
            Inner::Ready(_) => true,
            Inner::Pending(p) => p.copied.query() && p.work.as_ref().is_none_or(Work::is_completed),
        }
    }

    /// The value (a loss widened exactly from `f32`): every rank gets the same. Waits on the
    /// host for the device when it is not ready yet (up to the collective's and the device's
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
        Ok(match p.host.dtype() {
            fsdp_device::DType::F32 => f64::from(p.host.to_vec::<f32>()?[0]),
            _ => p.host.to_vec::<f64>()?[0],
        })
    }
}
