//! The operations of a [`ComputeDevice`] that hold the shards ([`Fsdp::new_on`](super::Fsdp::new_on)
//! without `offload_params`): accumulating reduced gradients, scaling them, their sum of
//! squares and the optimizer step, each issued on a stream of the device and ordered by the
//! buffers' events. On the host twin each is a stream task running the host engine's own
//! arithmetic ([`fsdp_device::host_task`]), so a run there gives the host engine's bits.

use fsdp_device::{host_task, Buffer, DType, Stream, TaskRead, TaskWrite};
use half::bf16;

use super::device::{ComputeDevice, Kind};
use super::mixed_precision::round_to;
use crate::optim::{
    any_precision_grouped, AnyPrecisionAdamWConfig, AnyPrecisionAdamWState, OptimizerConfig,
    ParamGroupOptions, PrecisionVec, ShardGroups,
};
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
        let configs =
            crate::optim::step_configs(cfg, lr, groups, segments, step, param.len(), grad.len())?;
        if let OptimizerConfig::AnyPrecisionAdamW(c) = cfg {
            return self
                .any_precision_step(c, &configs, segments, step, param, grad, moments, stream);
        }
        match self.kind {
            Kind::HostTwin => {
                self.delay(stream)?;
                let segments = segments.clone();
                let writes: Vec<&Buffer> = std::iter::once(param).chain(moments).collect();
                host_task(stream, &[grad], &writes, move |r, w| {
                    let (p, m) = w.split_first_mut().ok_or("no parameter shard")?;
                    let mut m = m
                        .iter_mut()
                        .map(write::<f32>)
                        .collect::<Result<Vec<_>, _>>()?;
                    crate::optim::f32_step_runs(
                        &configs,
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
            Kind::Cuda => {
                cuda::optimizer_step(&configs, segments, step, param, grad, moments, stream)
            }
        }
    }
}

impl ComputeDevice {
    /// Whether this device steps `cfg` on shards of `shards`: on CUDA, AnyPrecisionAdamW
    /// keeps its state in one dtype, f32 or bf16 (the kernel's).
    ///
    /// # Errors
    /// [`FsdpError::InvalidFsdpConfig`] naming the dtypes.
    pub(crate) fn check_optimizer(
        &self,
        cfg: &OptimizerConfig,
        shards: DType,
    ) -> Result<(), FsdpError> {
        match (&self.kind, cfg) {
            #[cfg(feature = "cuda")]
            (Kind::Cuda, OptimizerConfig::AnyPrecisionAdamW(c)) => {
                cuda::any_precision_kind(c, shards).map(drop)
            }
            _ => {
                let _ = shards;
                Ok(())
            }
        }
    }

    /// AnyPrecisionAdamW (`cfg`, each group's config in `configs`) at step number `step` on
    /// the shard `param` (bf16 or f32) with its `f32` gradient shard and its state `moments`
    /// (momentum, variance and, with Kahan summation, compensation, each of its dtype), on
    /// `stream`. On the host twin, the host engine's own update; on CUDA, the fused
    /// `anyprecision_decided` kernel, which needs one state dtype, f32 or bf16.
    #[allow(clippy::too_many_arguments)]
    fn any_precision_step(
        &self,
        cfg: &AnyPrecisionAdamWConfig,
        configs: &[OptimizerConfig],
        segments: &ShardGroups,
        step: u64,
        param: &Buffer,
        grad: &Buffer,
        moments: &[Buffer],
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        let [_, _, ..] = moments else {
            return Err(super::comm_context::internal(
                "AnyPrecisionAdamW without its moments",
            ));
        };
        match self.kind {
            Kind::HostTwin => {
                self.delay(stream)?;
                let (cfg, configs, segments) = (*cfg, configs.to_vec(), segments.clone());
                let writes: Vec<&Buffer> = std::iter::once(param).chain(moments).collect();
                host_task(stream, &[grad], &writes, move |r, w| {
                    let (p, st) = w.split_first_mut().ok_or("no parameter shard")?;
                    let mut state = AnyPrecisionAdamWState {
                        step: step - 1,
                        exp_avg: take_state(&mut st[0])?,
                        exp_avg_sq: take_state(&mut st[1])?,
                        compensation: st.get_mut(2).map(take_state).transpose()?,
                    };
                    let g = read::<f32>(&r[0])?;
                    let run = match p.dtype() {
                        DType::BF16 => any_precision_grouped(
                            &mut state,
                            &cfg,
                            &configs,
                            &segments,
                            write::<bf16>(p)?,
                            g,
                        ),
                        _ => any_precision_grouped(
                            &mut state,
                            &cfg,
                            &configs,
                            &segments,
                            write::<f32>(p)?,
                            g,
                        ),
                    };
                    run.map_err(|e| e.to_string())?;
                    put_state(&mut st[0], &state.exp_avg)?;
                    put_state(&mut st[1], &state.exp_avg_sq)?;
                    if let (Some(w), Some(c)) = (st.get_mut(2), &state.compensation) {
                        put_state(w, c)?;
                    }
                    Ok(())
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => cuda::any_precision_step(
                self, cfg, configs, segments, step, param, grad, moments, stream,
            ),
        }
    }
}

/// A task's state buffer as AnyPrecisionAdamW's host state (a copy).
fn take_state(w: &mut TaskWrite<'_>) -> Result<PrecisionVec, String> {
    Ok(match w.dtype() {
        DType::F32 => PrecisionVec::F32(write::<f32>(w)?.to_vec()),
        DType::BF16 => PrecisionVec::BF16(write::<bf16>(w)?.to_vec()),
        DType::F16 => PrecisionVec::F16(write::<half::f16>(w)?.to_vec()),
        DType::F64 => return Err("an f64 optimizer state".into()),
    })
}

/// Write AnyPrecisionAdamW's host state `v` back into a task's state buffer of its dtype.
fn put_state(w: &mut TaskWrite<'_>, v: &PrecisionVec) -> Result<(), String> {
    match v {
        PrecisionVec::F32(x) => write::<f32>(w)?.copy_from_slice(x),
        PrecisionVec::BF16(x) => write::<bf16>(w)?.copy_from_slice(x),
        PrecisionVec::F16(x) => write::<half::f16>(w)?.copy_from_slice(x),
    }
    Ok(())
}

/// The CUDA side: `fsdp-kernels`' kernels over stream-ordered buffers.
#[cfg(feature = "cuda")]
mod cuda {
    use fsdp_device::{Buffer, DType, Stream};
    use fsdp_kernels::host::{
        AdamW, AdamWScalars, AnyPrecision, AnyPrecisionChoice, AnyPrecisionScalars, Sgd,
        SgdScalars, STEP_APPLIED, STEP_SQUARES,
    };
    use fsdp_kernels::launch::{adamw_buffers, anyprecision_buffers, sgd_buffers};
    use fsdp_kernels::KernelError;

    use super::ComputeDevice;
    use crate::optim::{AnyPrecisionAdamWConfig, OptimizerConfig, ShardGroups};
    use crate::FsdpError;

    /// A kernel's error as the engine's, naming the operation.
    pub(super) fn kernel(op: &'static str) -> impl Fn(KernelError) -> FsdpError {
        move |e| {
            FsdpError::Device(fsdp_device::DeviceError::Cuda {
                op,
                message: e.to_string(),
            })
        }
    }

    /// Whether the CUDA kernel runs AnyPrecisionAdamW with `cfg` on shards of `param`: its
    /// state dtypes, which must be one, f32 or bf16, as the shards'.
    ///
    /// # Errors
    /// [`FsdpError::InvalidFsdpConfig`] naming the dtypes.
    pub(crate) fn any_precision_kind(
        cfg: &AnyPrecisionAdamWConfig,
        param: DType,
    ) -> Result<AnyPrecision, FsdpError> {
        let kahan = cfg.use_kahan_summation;
        let state = cfg.momentum_dtype;
        let same =
            cfg.variance_dtype == state && (!kahan || cfg.compensation_buffer_dtype == state);
        let kind = AnyPrecision {
            param,
            state,
            kahan,
        };
        if !same || kind.validate().is_err() {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: format!(
                    "AnyPrecisionAdamW on CUDA keeps its momentum, variance and compensation in \
                     one dtype, f32 or bf16, and bf16 or f32 shards (momentum {}, variance {}, \
                     compensation {}, shards {param})",
                    cfg.momentum_dtype, cfg.variance_dtype, cfg.compensation_buffer_dtype
                ),
            });
        }
        Ok(kind)
    }

    /// AnyPrecisionAdamW through the fused `anyprecision_decided` kernel over each run of
    /// `segments` with its group's config (`configs`), at step number `step`, on an `f32`
    /// copy of a bf16 shard (exact both ways: the kernel rounds every value it writes to
    /// bf16), with a step decided as applied and neither clipped nor unscaled.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn any_precision_step(
        dev: &ComputeDevice,
        cfg: &AnyPrecisionAdamWConfig,
        configs: &[OptimizerConfig],
        segments: &ShardGroups,
        step: u64,
        param: &Buffer,
        grad: &Buffer,
        moments: &[Buffer],
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        let err = kernel("AnyPrecisionAdamW kernel");
        let kind = any_precision_kind(cfg, param.dtype())?;
        let mut decided = vec![0.0f64; STEP_SQUARES];
        decided[STEP_APPLIED] = 1.0;
        let scalars = dev.copy_from_host(&Buffer::from_slice(&decided)?, stream)?;
        let wide;
        let p32 = if param.dtype() == DType::F32 {
            param
        } else {
            wide = dev.alloc(DType::F32, param.len(), stream)?;
            dev.cast(param, &wide, stream)?;
            &wide
        };
        for (range, group) in segments.segments() {
            let Some(OptimizerConfig::AnyPrecisionAdamW(c)) = configs.get(*group) else {
                continue; // SKIP_GROUP
            };
            let hyper = AdamW {
                lr: c.lr,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                weight_decay: c.weight_decay,
            };
            let s = AnyPrecisionScalars::new(&hyper, step).map_err(&err)?;
            let view = |b: &Buffer| b.slice(range.clone());
            let comp = moments.get(2).map(view).transpose()?;
            anyprecision_buffers(
                &AnyPrecisionChoice([s, s]),
                kind,
                &scalars,
                &view(p32)?,
                &view(grad)?,
                &view(&moments[0])?,
                &view(&moments[1])?,
                comp.as_ref(),
                stream,
            )
            .map_err(&err)?;
        }
        if !std::ptr::eq(p32, param) {
            dev.cast(p32, param, stream)?;
        }
        Ok(())
    }

    /// The fused AdamW or SGD kernel over each run of `segments`, with its group's config
    /// (`configs`; runs of no group are skipped), at step number `step`.
    pub(super) fn optimizer_step(
        configs: &[OptimizerConfig],
        segments: &ShardGroups,
        step: u64,
        param: &Buffer,
        grad: &Buffer,
        moments: &[Buffer],
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        let err = kernel("optimizer kernel");
        for (range, group) in segments.segments() {
            let view = |b: &Buffer| b.slice(range.clone());
            let (p, g) = (view(param)?, view(grad)?);
            match (configs.get(*group), moments) {
                (None, _) => {} // SKIP_GROUP
                (Some(OptimizerConfig::AdamW(c)), [m, v]) => {
                    let host = AdamW {
                        lr: c.lr,
                        beta1: c.beta1,
                        beta2: c.beta2,
                        eps: c.eps,
                        weight_decay: c.weight_decay,
                    };
                    let s = AdamWScalars::new(&host, step).map_err(&err)?;
                    adamw_buffers(&s, &p, &g, &view(m)?, &view(v)?, stream).map_err(&err)?;
                }
                (Some(OptimizerConfig::Sgd(c)), buf) => {
                    let host = Sgd {
                        lr: c.lr,
                        momentum: c.momentum,
                        dampening: c.dampening,
                        weight_decay: c.weight_decay,
                        nesterov: c.nesterov,
                    };
                    let s = SgdScalars::new(&host, step).map_err(&err)?;
                    let buf = buf.first().map(view).transpose()?;
                    sgd_buffers(&s, &p, &g, buf.as_ref(), stream).map_err(&err)?;
                }
                _ => {
                    return Err(FsdpError::InvalidFsdpConfig {
                        reason: "an optimizer state that does not fit the optimizer".into(),
                    })
                }
            }
        }
        Ok(())
    }
}
