//! How the GPT's device operations ([`GptOps`]) see the [`fsdp`] engine's unsharded parameters
//! and gradients: [`EngineViews`], implemented by the host twins ([`HostOps`], by copies), by
//! CUDA ([`CudaOps`], without copies) and by a plan's meta operations ([`MetaOps`], lengths
//! only). [`crate::engine_gpt`] runs the GPT's pass over them.

use fsdp::engine::{copy_from_host_f32, copy_from_host_f64, copy_to_host_f32, ComputeDevice};
use fsdp::{FsdpError, Grads, Params};
use fsdp_device::{AccessMode, Buffer, Stream};
use fsdp_kernels::gpt::{CudaMemory, CudaOps, GptOps, HostBuf, HostOps, MetaOps, Products};
use fsdp_kernels::host::{step_scalars_len, STEP_LOSS};
use fsdp_kernels::KernelError;

use crate::device_config::DeviceTrainError;

/// A parameter or gradient of another length than the GPT's.
fn wrong_length(name: &str, got: usize, want: usize) -> DeviceTrainError {
    DeviceTrainError::Fsdp(FsdpError::InvalidShape {
        reason: format!("`{name}` has {got} elements in the engine, the GPT's has {want}"),
    })
}

/// How one device's GPT operations see the engine's unsharded buffers while a unit is
/// unsharded ([`fsdp::Fsdp::param_views`], [`fsdp::Fsdp::grad_views`]). `stream` is the
/// engine's compute stream when it runs on a [`ComputeDevice`], `None` on the host.
pub trait EngineViews: GptOps {
    /// Parameter `name` (`len` elements) as one of the operations' buffers, to read until it
    /// is dropped (before the unit is resharded).
    ///
    /// # Errors
    /// A parameter not held in `params` or of another length; a failing copy or view.
    fn param_view(
        &self,
        params: &dyn Params,
        stream: Option<&Stream>,
        name: &str,
        len: usize,
    ) -> Result<Self::Buf, DeviceTrainError>;

    /// The gradient of parameter `name` as one of the operations' buffers, holding the
    /// engine's unsharded gradient's values (zeros, or what earlier passes accumulated under
    /// `no_sync`): the GPT adds its gradient into it.
    ///
    /// # Errors
    /// A gradient not held in `grads` or of another length; a failing copy or view.
    fn grad_view(
        &self,
        grads: &mut dyn Grads,
        stream: Option<&Stream>,
        name: &str,
        len: usize,
    ) -> Result<Self::Buf, DeviceTrainError>;

    /// After the unit's backward: `buf`, from [`grad_view`](Self::grad_view), becomes the
    /// engine's unsharded gradient of `name` (copied back, or a view simply dropped).
    ///
    /// # Errors
    /// A failing copy.
    fn grad_return(
        &self,
        grads: &mut dyn Grads,
        stream: Option<&Stream>,
        name: &str,
        buf: Self::Buf,
    ) -> Result<(), DeviceTrainError>;

    /// This pass's per-token `losses`' mean over `accum` parts added into the step's loss
    /// `step` (an `f64` buffer of the engine, of at least
    /// [`step_scalars_len`]`(0)` elements, its first the
    /// loss: an `f32` value), as the kernels' `loss_accumulate` adds it (into 0 when `first`).
    ///
    /// # Errors
    /// A buffer of another dtype or device; a failing copy, view or operation.
    fn loss_into(
        &self,
        losses: &Self::Buf,
        accum: u32,
        first: bool,
        step: &Buffer,
        stream: Option<&Stream>,
    ) -> Result<(), DeviceTrainError>;
}

/// `values` of `name` as a host twins' buffer, of the GPT's length `len`.
fn host_buf(
    ops: &HostOps,
    name: &str,
    values: &[f32],
    len: usize,
) -> Result<HostBuf, DeviceTrainError> {
    if values.len() != len {
        return Err(wrong_length(name, values.len(), len));
    }
    Ok(ops.upload(values)?)
}

/// The host twins see the engine's buffers through copies: on the host, the views' slices;
/// on a device (the host twin of [`fsdp::engine::ComputeDevice`], or a GPU), copies through
/// host memory that wait for the device. The twins' arithmetic is unchanged, so this checks
/// the engine's hooks around the GPT's pass, not speed.
impl EngineViews for HostOps {
    fn param_view(
        &self,
        params: &dyn Params,
        stream: Option<&Stream>,
        name: &str,
        len: usize,
    ) -> Result<Self::Buf, DeviceTrainError> {
        let values = match stream {
            None => params.param(name)?.to_vec(),
            Some(s) => copy_to_host_f32(&params.buffer(name)?, s)?,
        };
        host_buf(self, name, &values, len)
    }

    fn grad_view(
        &self,
        grads: &mut dyn Grads,
        stream: Option<&Stream>,
        name: &str,
        len: usize,
    ) -> Result<Self::Buf, DeviceTrainError> {
        let values = match stream {
            None => grads.grad_mut(name)?.to_vec(),
            Some(s) => copy_to_host_f32(&grads.grad_buffer(name)?, s)?,
        };
        host_buf(self, name, &values, len)
    }

    fn grad_return(
        &self,
        grads: &mut dyn Grads,
        stream: Option<&Stream>,
        name: &str,
        buf: Self::Buf,
    ) -> Result<(), DeviceTrainError> {
        match stream {
            None => {
                let g = grads.grad_mut(name)?;
                if g.len() != buf.len() {
                    return Err(wrong_length(name, g.len(), buf.len()));
                }
                g.copy_from_slice(&buf);
            }
            Some(s) => copy_from_host_f32(&grads.grad_buffer(name)?, &buf, s)?,
        }
        Ok(())
    }

    fn loss_into(
        &self,
        losses: &Self::Buf,
        accum: u32,
        first: bool,
        step: &Buffer,
        stream: Option<&Stream>,
    ) -> Result<(), DeviceTrainError> {
        let before = match stream {
            _ if first => 0.0,
            None => step.read::<f64>()?[0],
            // The loss is an f32 value: its f32 copy is exact.
            Some(s) => f64::from(copy_to_host_f32(&step.slice(0..1)?, s)?[0]),
        };
        let mut scalars = self.scalars(&[0.0; step_scalars_len(0)])?;
        scalars[STEP_LOSS] = before;
        self.loss_accumulate(losses, accum, first, &mut scalars)?;
        let loss = scalars[STEP_LOSS];
        match stream {
            None => step.write::<f64>()?[0] = loss,
            Some(s) => copy_from_host_f64(&step.slice(0..1)?, &[loss], s)?,
        }
        Ok(())
    }
}

/// The GPT's CUDA operations for the engine on `device` (a CUDA [`ComputeDevice`]): on its
/// compute stream, where CUDA's [`EngineViews`] read the engine's buffers in place, with
/// `products`, their buffers from the engine's caching allocator — one pool and one set of
/// statistics for the engine's buffers and the kernels' (what `fsdp train --engine` and
/// `gpt-device-bench --engine` run).
///
/// # Errors
/// A device without a CUDA caching allocator (the host twin, a dry run); the kernels failing
/// to load.
pub fn cuda_ops_on(
    device: &ComputeDevice,
    products: Products,
) -> Result<CudaOps, DeviceTrainError> {
    let memory = device
        .cuda_allocator()
        .cloned()
        .map(CudaMemory::Caching)
        .ok_or_else(|| KernelError::InvalidArgument {
            kernel: "gpt",
            reason: format!("{} has no CUDA caching allocator", device.device()),
        })?;
    Ok(CudaOps::with_memory(device.compute_stream().clone(), memory)?.with_products(products))
}

/// CUDA sees the engine's buffers in place ([`CudaOps::view`]): the operations must run on
/// the engine's compute stream, and the engine must keep its unsharded parameters in `f32`
/// (`param_dtype` f32; bf16 products round them as they read them).
impl EngineViews for CudaOps {
    fn param_view(
        &self,
        params: &dyn Params,
        stream: Option<&Stream>,
        name: &str,
        len: usize,
    ) -> Result<Self::Buf, DeviceTrainError> {
        let buf = params.buffer(name)?;
        check_cuda_view(self, stream, name, buf.len(), len)?;
        Ok(self.view(&buf, AccessMode::Shared)?)
    }

    fn grad_view(
        &self,
        grads: &mut dyn Grads,
        stream: Option<&Stream>,
        name: &str,
        len: usize,
    ) -> Result<Self::Buf, DeviceTrainError> {
        let buf = grads.grad_buffer(name)?;
        check_cuda_view(self, stream, name, buf.len(), len)?;
        Ok(self.view(&buf, AccessMode::Exclusive)?)
    }

    fn grad_return(
        &self,
        _: &mut dyn Grads,
        _: Option<&Stream>,
        _: &str,
        buf: Self::Buf,
    ) -> Result<(), DeviceTrainError> {
        // The view wrote the engine's gradient in place; dropping it records the use.
        drop(buf);
        Ok(())
    }

    fn loss_into(
        &self,
        losses: &Self::Buf,
        accum: u32,
        first: bool,
        step: &Buffer,
        stream: Option<&Stream>,
    ) -> Result<(), DeviceTrainError> {
        check_cuda_view(self, stream, "the step's loss", step.len(), step.len())?;
        let mut scalars = self.scalars_view(step)?;
        self.loss_accumulate(losses, accum, first, &mut scalars)?;
        Ok(())
    }
}

/// The meta operations see the engine's buffers by their lengths only (a plan's dry run of the
/// engine, whose parameters hold no values): views of the GPT's lengths, nothing copied back.
impl EngineViews for MetaOps {
    fn param_view(
        &self,
        _: &dyn Params,
        _: Option<&Stream>,
        _: &str,
        len: usize,
    ) -> Result<Self::Buf, DeviceTrainError> {
        Ok(self.view(len))
    }

    fn grad_view(
        &self,
        _: &mut dyn Grads,
        _: Option<&Stream>,
        _: &str,
        len: usize,
    ) -> Result<Self::Buf, DeviceTrainError> {
        Ok(self.view(len))
    }

    fn grad_return(
        &self,
        _: &mut dyn Grads,
        _: Option<&Stream>,
        _: &str,
        _: Self::Buf,
    ) -> Result<(), DeviceTrainError> {
        Ok(())
    }

    fn loss_into(
        &self,
        _: &Self::Buf,
        _: u32,
        _: bool,
        _: &Buffer,
        _: Option<&Stream>,
    ) -> Result<(), DeviceTrainError> {
        Ok(())
    }
}

/// A CUDA view needs the engine on the operations' stream and the GPT's length.
fn check_cuda_view(
    ops: &CudaOps,
    stream: Option<&Stream>,
    name: &str,
    got: usize,
    want: usize,
) -> Result<(), DeviceTrainError> {
    let same = stream.is_some_and(|s| {
        matches!((s.cuda_stream(), ops.stream().cuda_stream()), (Some(a), Some(b)) if std::sync::Arc::ptr_eq(a, b))
    });
    if !same {
        return Err(DeviceTrainError::Fsdp(FsdpError::InvalidFsdpConfig {
            reason: format!(
                "`{name}`: the GPT's CUDA operations run on stream `{}`, not on the engine's \
                 compute stream{}: build them with CudaOps::new(engine's compute stream)",
                ops.stream().name(),
                stream.map_or(" (the engine has no device)".to_string(), |s| format!(
                    " `{}`",
                    s.name()
                ))
            ),
        }));
    }
    if got != want {
        return Err(wrong_length(name, got, want));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine's CUDA operations need the engine's CUDA caching allocator: on the host twin
    /// of a device, a named refusal (before any CUDA library is loaded).
    #[test]
    fn cuda_ops_on_a_device_without_a_cuda_allocator_is_refused() {
        let twin = ComputeDevice::host_twin(1 << 20, Default::default()).unwrap();
        let Err(e) = cuda_ops_on(&twin, Products::F32) else {
            panic!("CUDA operations on the host twin");
        };
        let e = e.to_string();
        assert!(e.contains("has no CUDA caching allocator"), "{e}");
    }
}
