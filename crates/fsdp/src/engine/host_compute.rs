//! [`HostCompute`]: a host model run on a device's buffers, by copies.

use std::time::Duration;

use fsdp_device::{AccessMode, Buffer, DType, Device, Stream};

use super::mixed_precision::MixedPrecisionPolicy;
use super::model::{FsdpModel, Span};
use super::views::{Grads, Params};
use crate::FsdpError;

/// A model written for host memory (it reads [`Params::param`] and adds into
/// [`Grads::grad_mut`]) run by an engine whose parameters live on a
/// [`ComputeDevice`](super::ComputeDevice): each span copies its parameters to host memory on
/// the compute stream (widened to `f32` from `param_dtype`), computes there, and writes its
/// gradients back — the model's own additions, made on copies of the device's gradients, so
/// the arithmetic is the host engine's exactly. For checking a device run against the host's
/// and for models without device kernels, not for speed: every span waits for its copies.
///
/// With a [`lag`](Self::with_lag), each span also leaves work on the compute stream that reads
/// its parameters for that long after it returned, as a GPU's kernels still run when the host
/// has moved on (the host twin's tests of the limiter use it).
///
/// On the host (an engine without a device) it runs the model as it is.
pub struct HostCompute<'m, M> {
    model: &'m M,
    lag: Option<Duration>,
}

impl<'m, M> HostCompute<'m, M> {
    /// `model` run by copies.
    pub fn new(model: &'m M) -> Self {
        HostCompute { model, lag: None }
    }

    /// With work reading each span's parameters for `lag` after the span returned (a test
    /// aid of the host twin, whose streams run host tasks: on CUDA each span then fails with
    /// an error naming it).
    #[must_use]
    pub fn with_lag(mut self, lag: Duration) -> Self {
        self.lag = Some(lag);
        self
    }
}

/// A span's parameters as host `f32` vectors, with the views' policy.
struct HostCopies {
    map: std::collections::HashMap<String, Vec<f32>>,
    policy: Option<MixedPrecisionPolicy>,
}

impl Params for HostCopies {
    fn param(&self, name: &str) -> Result<&[f32], FsdpError> {
        self.map.param(name)
    }
    fn mixed_precision(&self) -> Option<MixedPrecisionPolicy> {
        self.policy
    }
}

/// A host buffer that a buffer on `device` is copied to and from (pinned for CUDA).
fn host_buffer(device: Device, dtype: DType, len: usize) -> Result<Buffer, FsdpError> {
    #[cfg(feature = "cuda")]
    if matches!(device, Device::Cuda(_)) {
        return Ok(Buffer::pinned_zeros(dtype, len)?);
    }
    let _ = device;
    Ok(Buffer::zeros(dtype, len)?)
}

/// `buf` (f32, bf16, f16 or f64) copied to host memory on `stream` and widened (or for f64
/// rounded) to `f32`: the engine's buffers on a [`ComputeDevice`](super::ComputeDevice) read
/// on the host (the host waits for the copy, and for the work on `buf` it is ordered after).
///
/// # Errors
/// A failing allocation or copy; a wait past the stream's timeout.
pub fn copy_to_host_f32(buf: &Buffer, stream: &Stream) -> Result<Vec<f32>, FsdpError> {
    let host = host_buffer(buf.device(), buf.dtype(), buf.len())?;
    buf.copy_to_host_async(&host, stream)?;
    Ok(match host.dtype() {
        DType::BF16 => host
            .to_vec::<half::bf16>()?
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        DType::F16 => host
            .to_vec::<half::f16>()?
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        DType::F64 => host.to_vec::<f64>()?.iter().map(|&v| v as f32).collect(),
        DType::F32 => host.to_vec::<f32>()?,
    })
}

/// `values` copied into the `f32` buffer `buf` of a [`ComputeDevice`](super::ComputeDevice) on
/// `stream` (staged through host memory that the copy owns: the host does not wait).
///
/// # Errors
/// `values` of another length than `buf`, a buffer of another dtype; a failing allocation or
/// copy.
pub fn copy_from_host_f32(buf: &Buffer, values: &[f32], stream: &Stream) -> Result<(), FsdpError> {
    copy_from_host(buf, values, stream)
}

/// [`copy_from_host_f32`] into an `f64` buffer (e.g. a step's scalars).
///
/// # Errors
/// As [`copy_from_host_f32`].
pub fn copy_from_host_f64(buf: &Buffer, values: &[f64], stream: &Stream) -> Result<(), FsdpError> {
    copy_from_host(buf, values, stream)
}

fn copy_from_host<T: fsdp_device::Element>(
    buf: &Buffer,
    values: &[T],
    stream: &Stream,
) -> Result<(), FsdpError> {
    if buf.dtype() != T::DTYPE {
        return Err(FsdpError::InvalidShape {
            reason: format!(
                "a copy of {} values into a {} buffer",
                T::DTYPE,
                buf.dtype()
            ),
        });
    }
    let host = host_buffer(buf.device(), T::DTYPE, values.len())?;
    host.copy_from_slice(values)?;
    buf.copy_from_host_async(&host, stream)?;
    Ok(())
}

impl<M: FsdpModel> HostCompute<'_, M> {
    /// Span `s`'s parameters copied to the host, and the stream, when `p` is on a device.
    fn params(&self, s: usize, p: &dyn Params) -> Result<Option<(HostCopies, Stream)>, FsdpError> {
        let Some(stream) = p.compute_stream().cloned() else {
            return Ok(None);
        };
        let mut map = std::collections::HashMap::new();
        for n in &self.model.spans()[s].params {
            if !map.contains_key(n) {
                map.insert(n.clone(), copy_to_host_f32(&p.buffer(n)?, &stream)?);
            }
        }
        let policy = p.mixed_precision();
        Ok(Some((HostCopies { map, policy }, stream)))
    }

    /// With a lag: work on `stream` that reads the span's parameters (`copies`' names) for that
    /// long.
    fn linger(
        &self,
        copies: &HostCopies,
        p: &dyn Params,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        let Some(lag) = self.lag else {
            return Ok(());
        };
        if !stream.runs_host_tasks() {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: format!(
                    "HostCompute::with_lag: the stream `{}` on {} runs no host tasks to lag \
                     with (the host twin's do)",
                    stream.name(),
                    stream.device()
                ),
            });
        }
        let uses = copies
            .map
            .keys()
            .map(|n| Ok(p.buffer(n)?.use_on(stream, AccessMode::Shared)?))
            .collect::<Result<Vec<_>, FsdpError>>()?;
        stream.enqueue(move || std::thread::sleep(lag))?;
        for u in uses {
            u.finish();
        }
        Ok(())
    }
}

impl<M: FsdpModel> FsdpModel for HostCompute<'_, M> {
    type Batch = M::Batch;
    type Tape = M::Tape;

    fn spans(&self) -> Vec<Span> {
        self.model.spans()
    }

    fn forward(
        &self,
        s: usize,
        p: &dyn Params,
        b: &M::Batch,
        t: &mut M::Tape,
    ) -> Result<(), FsdpError> {
        let Some((params, stream)) = self.params(s, p)? else {
            return self.model.forward(s, p, b, t);
        };
        self.model.forward(s, &params, b, t)?;
        self.linger(&params, p, &stream)
    }

    fn loss(&self, t: &M::Tape) -> Result<f32, FsdpError> {
        self.model.loss(t)
    }

    fn backward(
        &self,
        s: usize,
        p: &dyn Params,
        g: &mut dyn Grads,
        b: &M::Batch,
        t: &mut M::Tape,
    ) -> Result<(), FsdpError> {
        let Some((params, stream)) = self.params(s, p)? else {
            return self.model.backward(s, p, g, b, t);
        };
        // The gradients of the span's parameters: the copies' names.
        let mut grads = std::collections::HashMap::new();
        for n in params.map.keys() {
            grads.insert(n.clone(), copy_to_host_f32(&g.grad_buffer(n)?, &stream)?);
        }
        self.model.backward(s, &params, &mut grads, b, t)?;
        for (n, values) in &grads {
            copy_from_host_f32(&g.grad_buffer(n)?, values, &stream)?;
        }
        self.linger(&params, p, &stream)
    }

    fn checkpointable(&self, span: usize) -> bool {
        self.model.checkpointable(span)
    }

    fn discard_saved(&self, span: usize, tape: &mut M::Tape) -> Result<(), FsdpError> {
        self.model.discard_saved(span, tape)
    }

    fn recompute(
        &self,
        s: usize,
        p: &dyn Params,
        b: &M::Batch,
        t: &mut M::Tape,
    ) -> Result<(), FsdpError> {
        match self.params(s, p)? {
            Some((params, _)) => self.model.recompute(s, &params, b, t),
            None => self.model.recompute(s, p, b, t),
        }
    }

    fn tape_bytes(&self, tape: &M::Tape) -> u64 {
        self.model.tape_bytes(tape)
    }
}
