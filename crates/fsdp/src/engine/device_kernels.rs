//! The operations of a [`ComputeDevice`] that hold the shards ([`Fsdp::new_on`](super::Fsdp::new_on)
//! without `offload_params`): accumulating reduced gradients, scaling them, their sum of
//! squares and the optimizer step, each issued on a stream of the device and ordered by the
//! buffers' events. On the host twin each is a stream task running the host engine's own
//! arithmetic ([`fsdp_device::host_task`]), so a run there gives the host engine's bits.

use fsdp_device::{host_task, Buffer, DType, Stream, TaskRead, TaskWrite};

use super::device::{ComputeDevice, Kind};
use crate::optim::{OptimizerConfig, ParamGroupOptions, ShardGroups};
use crate::FsdpError;

/// A task's view as `T`, its error a message (the task's error becomes the stream's).
fn read<'a, T: fsdp_device::Element>(r: &'a TaskRead<'_>) -> Result<&'a [T], String> {
    r.as_slice::<T>().map_err(|e| e.to_string())
}

/// A task's mutable view as `T`.
fn write<'a, T: fsdp_device::Element>(w: &'a mut TaskWrite<'_>) -> Result<&'a mut [T], String> {
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

impl ComputeDevice {
    /// The error for an operation the device does not have yet.
    #[cfg(feature = "cuda")]
    fn lacks(&self, op: &str) -> FsdpError {
        FsdpError::InvalidFsdpConfig {
            reason: format!("{op} is not implemented on {} yet", self.device()),
        }
    }

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
            self.delay(stream)?;
            acc.copy_from_device_async(x, stream)?;
            return Ok(());
        }
        match self.kind {
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
            Kind::Cuda => Err(self.lacks("accumulating gradient shards")),
        }
    }

    /// `x *= c` on `stream`, `x` an `f32` gradient shard (clipping).
    ///
    /// # Errors
    /// A buffer that is not on this device; the stream's errors.
    pub(crate) fn scale(&self, x: &Buffer, c: f32, stream: &Stream) -> Result<(), FsdpError> {
        match self.kind {
            Kind::HostTwin => {
                self.delay(stream)?;
                host_task(stream, &[], &[x], move |_, w| {
                    write::<f32>(&mut w[0])?.iter_mut().for_each(|v| *v *= c);
                    Ok(())
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => Err(self.lacks("scaling gradient shards")),
        }
    }

    /// The sum of the squares of the `f32` buffer `x`, in `f64` and in the elements' order (the
    /// host engine's), into a new one-element `f64` buffer on the device, on `stream`.
    ///
    /// # Errors
    /// A buffer that is not on this device, out of memory; the stream's errors.
    pub(crate) fn sum_of_squares(&self, x: &Buffer, stream: &Stream) -> Result<Buffer, FsdpError> {
        let out = self.alloc(DType::F64, 1, stream)?;
        match self.kind {
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
            Kind::Cuda => Err(self.lacks("the gradient norm")),
        }
    }

    /// One optimizer step (AdamW or SGD, step number `step`) on the `f32` shard `param` with
    /// its gradient shard `grad` and its state `moments` on the device (AdamW: `exp_avg`,
    /// `exp_avg_sq`; SGD: the momentum buffer, or none), each run of `segments` with its
    /// group's options, on `stream`. The arguments are checked here, before anything is
    /// issued.
    ///
    /// # Errors
    /// As [`OptimizerState::step_grouped`](crate::optim::OptimizerState::step_grouped); buffers
    /// not on this device; the stream's errors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn optimizer_step(
        &self,
        cfg: &OptimizerConfig,
        lr: f64,
        groups: &[ParamGroupOptions],
        segments: &ShardGroups,
        step: u64,
        param: &Buffer,
        grad: &Buffer,
        moments: &[Buffer],
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        crate::optim::check_f32_step(cfg, lr, groups, segments, step, param.len(), grad.len())?;
        match self.kind {
            Kind::HostTwin => {
                self.delay(stream)?;
                let (cfg, groups, segments) = (*cfg, groups.to_vec(), segments.clone());
                let writes: Vec<&Buffer> = std::iter::once(param).chain(moments).collect();
                host_task(stream, &[grad], &writes, move |r, w| {
                    let (p, m) = w.split_first_mut().ok_or("no parameter shard")?;
                    let mut m = m
                        .iter_mut()
                        .map(write::<f32>)
                        .collect::<Result<Vec<_>, _>>()?;
                    crate::optim::f32_step_slices(
                        &cfg,
                        lr,
                        &groups,
                        &segments,
                        step,
                        write::<f32>(p)?,
                        read::<f32>(&r[0])?,
                        &mut m,
                    )
                    .map_err(|e| e.to_string())
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => Err(self.lacks("the optimizer step on shards")),
        }
    }
}
