//! The operations of a [`ComputeDevice`] that hold the shards ([`Fsdp::new_on`](super::Fsdp::new_on)
//! without `offload_params`): accumulating reduced gradients, scaling them, their sum of
//! squares and the clipping coefficient (the optimizer step is `device_optim.rs`'s), each
//! issued on a stream of the device and ordered by the buffers' events. On the host twin each
//! is a stream task running the host engine's own arithmetic ([`fsdp_device::host_task`]), so
//! a run there gives the host engine's bits.

use fsdp_device::{host_task, Buffer, DType, Stream, TaskRead, TaskWrite};

use super::device::{ComputeDevice, Kind};
use super::mixed_precision::round_to;
use crate::FsdpError;

/// A task's view as `T`, its error a message (the task's error becomes the stream's).
pub(super) fn read<'a, T: fsdp_device::Element>(r: &'a TaskRead<'_>) -> Result<&'a [T], String> {
    r.as_slice::<T>().map_err(|e| e.to_string())
}

/// A task's mutable view as `T`.
pub(super) fn write<'a, T: fsdp_device::Element>(
    w: &'a mut TaskWrite<'_>,
) -> Result<&'a mut [T], String> {
    w.as_mut_slice::<T>().map_err(|e| e.to_string())
}

/// `x`'s elements widened to `f32`, one by one, into `f`.
fn each_f32(x: &TaskRead<'_>, mut f: impl FnMut(usize, f32)) -> Result<(), String> {
    fn run<T: fsdp_device::Element>(
        x: &TaskRead<'_>,
        f: &mut impl FnMut(usize, f32),
    ) -> Result<(), String> {
        read::<T>(x)?
            .iter()
            .enumerate()
            .for_each(|(i, v)| f(i, v.to_f32()));
        Ok(())
    }
    match x.dtype() {
        DType::F32 => run::<f32>(x, &mut f),
        DType::BF16 => run::<half::bf16>(x, &mut f),
        DType::F16 => run::<half::f16>(x, &mut f),
        DType::F64 => Err("an f64 gradient".into()),
    }
}

/// `x[i] = f(x[i])` over a task's buffer of f32, bf16 or f16 (widened to `f32` for `f`, its
/// result rounded back).
fn map_in_place(x: &mut TaskWrite<'_>, f: impl Fn(f32) -> f32) -> Result<(), String> {
    fn run<T: fsdp_device::Element>(
        x: &mut TaskWrite<'_>,
        f: impl Fn(f32) -> f32,
    ) -> Result<(), String> {
        write::<T>(x)?
            .iter_mut()
            .for_each(|v| *v = T::from_f32(f(v.to_f32())));
        Ok(())
    }
    match x.dtype() {
        DType::F32 => run::<f32>(x, f),
        DType::BF16 => run::<half::bf16>(x, f),
        DType::F16 => run::<half::f16>(x, f),
        DType::F64 => Err("an f64 reduction".into()),
    }
}

impl ComputeDevice {
    /// `acc += x` (or `acc = x` with `replace`) on `stream`: `acc` an `f32` gradient shard, `x`
    /// a reduced shard of the same length in the reduce dtype, widened exactly (the host
    /// engine's accumulation of reduced gradients).
    ///
    /// # Errors
    /// Buffers that are not on this device or differ in length; the stream's errors.
    pub(crate) fn accumulate(
        &self,
        acc: &Buffer,
        x: &Buffer,
        replace: bool,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        if acc.dtype() != DType::F32 || acc.len() != x.len() {
            return Err(super::comm_context::internal(
                "a reduced gradient of another length, or a gradient shard that is not f32",
            ));
        }
        if replace && x.dtype() == DType::F32 {
            return self.copy(x, acc, stream);
        }
        match self.kind {
            // CUDA's widening copy of a reduced shard that is not f32.
            Kind::Meta if x.dtype() != DType::F32 => {
                self.alloc(DType::F32, x.len(), stream)?;
                Ok(())
            }
            Kind::Meta => Ok(()),
            Kind::HostTwin => {
                self.delay(stream)?;
                host_task(stream, &[x], &[acc], move |r, w| {
                    let acc = write::<f32>(&mut w[0])?;
                    each_f32(&r[0], |i, v| {
                        acc[i] = if replace { v } else { acc[i] + v };
                    })
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => {
                // `replace` only comes with an f32 `x` (copied above).
                let wide;
                let x = if x.dtype() == DType::F32 {
                    x
                } else {
                    wide = self.alloc(DType::F32, x.len(), stream)?;
                    self.cast(x, &wide, stream)?;
                    &wide
                };
                fsdp_kernels::launch::axpby_buffer(1.0, x, 1.0, acc, stream)
                    .map_err(cuda::kernel("accumulate kernel"))?;
                Ok(())
            }
        }
    }

    /// The division of a reduction by the data-parallel size, in place on `buf` (f32, bf16 or
    /// f16) on `stream`: each element multiplied by `premul`, then divided by `divide`, each
    /// result rounded to `buf`'s type (the host engine's `round_to(r, v·s)`, `round_to(r, v/d)`).
    ///
    /// # Errors
    /// A buffer that is not on this device or of another type; the stream's errors.
    pub(crate) fn scale_divide(
        &self,
        buf: &Buffer,
        premul: Option<f32>,
        divide: Option<f32>,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        if premul.is_none() && divide.is_none() {
            return Ok(());
        }
        match self.kind {
            Kind::Meta => Ok(()),
            Kind::HostTwin => {
                self.delay(stream)?;
                let r = buf.dtype();
                host_task(stream, &[], &[buf], move |_, w| {
                    map_in_place(&mut w[0], |mut v| {
                        if let Some(s) = premul {
                            v = round_to(r, v * s);
                        }
                        if let Some(d) = divide {
                            v = round_to(r, v / d);
                        }
                        v
                    })
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => {
                if let Some(s) = premul {
                    // s·v + 0·v: s·v rounded once, then to the buffer's type.
                    fsdp_kernels::launch::axpby_buffer(s, buf, 0.0, buf, stream)
                        .map_err(cuda::kernel("scale kernel"))?;
                }
                if let Some(d) = divide {
                    fsdp_kernels::launch::div_scalar_buffer(d, buf, stream)
                        .map_err(cuda::kernel("division kernel"))?;
                }
                Ok(())
            }
        }
    }

    /// `x *= c` on `stream`, `x` an `f32` gradient shard (clipping, loss scaling): the
    /// multiplication of [`scale_divide`](Self::scale_divide), rounded once (on CUDA an
    /// infinite `x` gives NaN, not finite either).
    ///
    /// # Errors
    /// A buffer that is not on this device; the stream's errors.
    pub(crate) fn scale(&self, x: &Buffer, c: f32, stream: &Stream) -> Result<(), FsdpError> {
        self.scale_divide(x, Some(c), None, stream)
    }

    /// The sum of the squares of the `f32` buffer `x`, in `f64`, into a new one-element `f64`
    /// buffer on the device, on `stream`: on the host twin in the elements' order (the host
    /// engine's, bit for bit), on CUDA in the norm kernels' blocked order (within rounding of
    /// it: the last bits may differ).
    ///
    /// # Errors
    /// A buffer that is not on this device, out of memory; the stream's errors.
    pub(crate) fn sum_of_squares(&self, x: &Buffer, stream: &Stream) -> Result<Buffer, FsdpError> {
        let out = self.alloc(DType::F64, 1, stream)?;
        match self.kind {
            Kind::Meta => Ok(out),
            Kind::HostTwin => {
                self.delay(stream)?;
                host_task(stream, &[x], &[&out], |r, w| {
                    let sum = read::<f32>(&r[0])?
                        .iter()
                        .map(|&g| f64::from(g) * f64::from(g))
                        .sum();
                    write::<f64>(&mut w[0])?[0] = sum;
                    Ok(())
                })?;
                Ok(out)
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => {
                fsdp_kernels::launch::sum_of_squares_buffer(x, &out, stream)
                    .map_err(cuda::kernel("sum of squares kernel"))?;
                Ok(out)
            }
        }
    }

    /// `acc += x` on `stream`, both one-element `f64` buffers (the host engine's sum of the
    /// units' squared norms, in their order).
    ///
    /// # Errors
    /// Buffers that are not on this device; the stream's errors.
    pub(crate) fn add_scalar(
        &self,
        acc: &Buffer,
        x: &Buffer,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        match self.kind {
            Kind::Meta => Ok(()),
            Kind::HostTwin => {
                self.delay(stream)?;
                host_task(stream, &[x], &[acc], |r, w| {
                    write::<f64>(&mut w[0])?[0] += read::<f64>(&r[0])?[0];
                    Ok(())
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => {
                fsdp_kernels::launch::axpby_buffer(1.0, x, 1.0, acc, stream)
                    .map_err(cuda::kernel("norm sum kernel"))?;
                Ok(())
            }
        }
    }

    /// The global norm `√(sharded + replicated)` (each a one-element `f64` buffer of squared
    /// norms) and the coefficient that clips it to `max_norm` (the host engine's
    /// [`clip_coefficient`](crate::optim::clip_coefficient), or 1 where it does not clip; a
    /// `max_norm` of `+∞` never clips) into the two elements of the `f64` buffer `out`, on
    /// `stream`: nothing is read on the host.
    ///
    /// # Errors
    /// Buffers that are not on this device; the stream's errors.
    pub(crate) fn clip_coefficient(
        &self,
        sharded: &Buffer,
        replicated: &Buffer,
        max_norm: f64,
        out: &Buffer,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        match self.kind {
            Kind::Meta => Ok(()),
            Kind::HostTwin => {
                self.delay(stream)?;
                host_task(stream, &[sharded, replicated], &[out], move |r, w| {
                    let (s, p) = (read::<f64>(&r[0])?[0], read::<f64>(&r[1])?[0]);
                    let total = (s + p).sqrt();
                    let coef = crate::optim::clip_coefficient(max_norm, total);
                    let out = write::<f64>(&mut w[0])?;
                    out[0] = total;
                    out[1] = coef.map_or(1.0, f64::from);
                    Ok(())
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => {
                fsdp_kernels::launch::clip_coefficient_buffers(
                    sharded, replicated, max_norm, out, stream,
                )
                .map_err(cuda::kernel("clip coefficient kernel"))?;
                Ok(())
            }
        }
    }

    /// `x *= c[0]` on `stream`, `x` an `f32` gradient shard and `c` a one-element `f64`
    /// buffer holding an `f32` coefficient computed on the device (nothing when it is 1): the
    /// host engine's clipping, `*x *= c`.
    ///
    /// # Errors
    /// Buffers that are not on this device; the stream's errors.
    pub(crate) fn scale_by(
        &self,
        x: &Buffer,
        c: &Buffer,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        match self.kind {
            Kind::Meta => Ok(()),
            Kind::HostTwin => {
                self.delay(stream)?;
                host_task(stream, &[c], &[x], |r, w| {
                    let c = read::<f64>(&r[0])?[0] as f32;
                    if c != 1.0 {
                        write::<f32>(&mut w[0])?.iter_mut().for_each(|v| *v *= c);
                    }
                    Ok(())
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => {
                fsdp_kernels::launch::scale_by_buffer(x, c, stream)
                    .map_err(cuda::kernel("clip scaling kernel"))?;
                Ok(())
            }
        }
    }
}

/// The CUDA side: the kernels' errors as the engine's.
#[cfg(feature = "cuda")]
pub(super) mod cuda {
    use fsdp_kernels::KernelError;

    use crate::FsdpError;

    /// A kernel's error as the engine's, naming the operation.
    pub(in crate::engine) fn kernel(op: &'static str) -> impl Fn(KernelError) -> FsdpError {
        move |e| {
            FsdpError::Device(fsdp_device::DeviceError::Cuda {
                op,
                message: e.to_string(),
            })
        }
    }
}
