//! The optimizer step of a [`ComputeDevice`] that holds the shards: AdamW, SGD or
//! AnyPrecisionAdamW over each run of a shard's parameter groups, issued on a stream and
//! ordered by the buffers' events. Either a step the host knows is taken
//! ([`StepPlan::Known`]), or one of two steps that a grad scaler's decision on the device
//! chooses between, or skips ([`StepPlan::Decided`]). On the host twin a stream task runs the
//! host engine's own update; on CUDA the fused kernels of `fsdp-kernels`.

use fsdp_device::{host_task, Buffer, DType, Stream, TaskRead, TaskWrite};
use half::bf16;

use super::device::{ComputeDevice, Kind};
use super::device_kernels::{read, write};
use super::scaler_device::slot;
use crate::optim::{
    any_precision_grouped, AnyPrecisionAdamWConfig, AnyPrecisionAdamWState, OptimizerConfig,
    ParamGroupOptions, PrecisionVec, ShardGroups,
};
use crate::FsdpError;

/// Which optimizer step a shard takes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum StepPlan<'a> {
    /// Step number `step` at the learning rate `lr`: the host knows the step is taken.
    Known { lr: f64, step: u64 },
    /// As the grad scaler's decision in `state` (its `f64` state buffer on the device) says:
    /// nothing when the step does not apply, else choice `i` — step number `steps[i]` at the
    /// learning rate `lrs[i]`, `i` the optimizer steps the device counted beyond the host's.
    Decided {
        state: &'a Buffer,
        lrs: [f64; 2],
        steps: [u64; 2],
    },
}

impl StepPlan<'_> {
    /// The (learning rate, step number) of each choice.
    fn choices(&self) -> Vec<(f64, u64)> {
        match *self {
            StepPlan::Known { lr, step } => vec![(lr, step)],
            StepPlan::Decided { lrs, steps, .. } => lrs.into_iter().zip(steps).collect(),
        }
    }

    /// The decision's state buffer, if any.
    fn state(&self) -> Option<&Buffer> {
        match self {
            StepPlan::Known { .. } => None,
            StepPlan::Decided { state, .. } => Some(state),
        }
    }
}

/// Each choice's per-group configs and step number.
type Choices = Vec<(Vec<OptimizerConfig>, u64)>;

/// The choice a stream task takes: the only one without a decision; with one (`state`, read
/// by the task), `None` when the step does not apply, else the chosen one (the last for a
/// choice beyond them, as the kernels do; the decision then marks a fault and does not apply).
fn chosen<'c, T>(choices: &'c [T], state: Option<&TaskRead<'_>>) -> Result<Option<&'c T>, String> {
    let Some(state) = state else {
        return Ok(choices.first());
    };
    let s = read::<f64>(state)?;
    if s[slot::APPLIED] != 1.0 {
        return Ok(None);
    }
    Ok(choices.get(s[slot::CHOICE] as usize).or(choices.last()))
}

impl ComputeDevice {
    /// One optimizer step (AdamW, SGD or AnyPrecisionAdamW, as `plan` says) on the shard
    /// `param` with its `f32` gradient shard `grad` and its state `moments` on the device
    /// (AdamW: `exp_avg`, `exp_avg_sq`; SGD: the momentum buffer, or none;
    /// AnyPrecisionAdamW: momentum, variance and, with Kahan summation, compensation), each
    /// run of `segments` with its group's options, on `stream`. The arguments are checked
    /// here, before anything is issued.
    ///
    /// # Errors
    /// As [`OptimizerState::step_grouped`](crate::optim::OptimizerState::step_grouped); buffers
    /// not on this device; the stream's errors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn optimizer_step(
        &self,
        cfg: &OptimizerConfig,
        plan: &StepPlan<'_>,
        groups: &[ParamGroupOptions],
        segments: &ShardGroups,
        param: &Buffer,
        grad: &Buffer,
        moments: &[Buffer],
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        let choices = plan
            .choices()
            .into_iter()
            .map(|(lr, step)| {
                let configs = crate::optim::step_configs(
                    cfg,
                    lr,
                    groups,
                    segments,
                    step,
                    param.len(),
                    grad.len(),
                )?;
                Ok((configs, step))
            })
            .collect::<Result<Choices, FsdpError>>()?;
        if let OptimizerConfig::AnyPrecisionAdamW(c) = cfg {
            return self.any_precision_step(
                c,
                choices,
                plan.state(),
                segments,
                param,
                grad,
                moments,
                stream,
            );
        }
        match self.kind {
            Kind::Meta => Ok(()),
            Kind::HostTwin => {
                let segments = segments.clone();
                let update = move |configs: &[OptimizerConfig],
                                   step: u64,
                                   p: &mut TaskWrite<'_>,
                                   m: &mut [TaskWrite<'_>],
                                   g: &[f32]| {
                    let mut m = m
                        .iter_mut()
                        .map(write::<f32>)
                        .collect::<Result<Vec<_>, _>>()?;
                    crate::optim::f32_step_runs(configs, &segments, step, write(p)?, g, &mut m)
                        .map_err(|e| e.to_string())
                };
                let state = plan.state();
                self.twin_step(choices, state, param, grad, moments, stream, update)
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => cuda::optimizer_step(
                &choices,
                plan.state(),
                segments,
                param,
                grad,
                moments,
                stream,
            ),
        }
    }

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

    /// AnyPrecisionAdamW (`cfg`, each choice's per-group configs and step number in
    /// `choices`, chosen by the decision in `state` when there is one) on the shard `param`
    /// (bf16 or f32) with its `f32` gradient shard and its state `moments` (momentum,
    /// variance and, with Kahan summation, compensation, each of its dtype), on `stream`. On
    /// the host twin, the host engine's own update; on CUDA, the fused `anyprecision_decided`
    /// kernel, which needs one state dtype, f32 or bf16.
    #[allow(clippy::too_many_arguments)]
    fn any_precision_step(
        &self,
        cfg: &AnyPrecisionAdamWConfig,
        choices: Choices,
        state: Option<&Buffer>,
        segments: &ShardGroups,
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
            Kind::Meta => {
                // CUDA's temporaries: the decision's scalars when none is given, an f32 copy
                // of a shard that is not f32.
                let _scalars = state
                    .is_none()
                    .then(|| self.alloc(DType::F64, super::scaler_device::slot::LEN, stream))
                    .transpose()?;
                let _wide = (param.dtype() != DType::F32)
                    .then(|| self.alloc(DType::F32, param.len(), stream))
                    .transpose()?;
                Ok(())
            }
            Kind::HostTwin => {
                let (cfg, segments) = (*cfg, segments.clone());
                let update = move |configs: &[OptimizerConfig],
                                   step: u64,
                                   p: &mut TaskWrite<'_>,
                                   st: &mut [TaskWrite<'_>],
                                   g: &[f32]| {
                    let mut state = AnyPrecisionAdamWState {
                        step: step - 1,
                        exp_avg: take_state(&mut st[0])?,
                        exp_avg_sq: take_state(&mut st[1])?,
                        compensation: st.get_mut(2).map(take_state).transpose()?,
                    };
                    let run = match p.dtype() {
                        DType::BF16 => any_precision_grouped(
                            &mut state,
                            &cfg,
                            configs,
                            &segments,
                            write::<bf16>(p)?,
                            g,
                        ),
                        _ => any_precision_grouped(
                            &mut state,
                            &cfg,
                            configs,
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
                };
                self.twin_step(choices, state, param, grad, moments, stream, update)
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => cuda::any_precision_step(
                self, cfg, &choices, state, segments, param, grad, moments, stream,
            ),
        }
    }
}

impl ComputeDevice {
    /// The host twin's optimizer step: a stream task that takes the choice (`chosen`: the only
    /// one, or the decision's in `state`; nothing when it does not apply) and runs `update`
    /// with its per-group configs and step number on the shard `param`, the state `moments`
    /// and the gradient shard `grad`.
    #[allow(clippy::too_many_arguments)]
    fn twin_step(
        &self,
        choices: Choices,
        state: Option<&Buffer>,
        param: &Buffer,
        grad: &Buffer,
        moments: &[Buffer],
        stream: &Stream,
        update: impl FnOnce(
                &[OptimizerConfig],
                u64,
                &mut TaskWrite<'_>,
                &mut [TaskWrite<'_>],
                &[f32],
            ) -> Result<(), String>
            + Send
            + 'static,
    ) -> Result<(), FsdpError> {
        self.delay(stream)?;
        let reads: Vec<&Buffer> = std::iter::once(grad).chain(state).collect();
        let writes: Vec<&Buffer> = std::iter::once(param).chain(moments).collect();
        host_task(stream, &reads, &writes, move |r, w| {
            let Some((configs, step)) = chosen(&choices, r.get(1))? else {
                return Ok(());
            };
            let (p, m) = w.split_first_mut().ok_or("no parameter shard")?;
            update(configs, *step, p, m, read::<f32>(&r[0])?)
        })?;
        Ok(())
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

/// The CUDA side: `fsdp-kernels`' optimizer kernels over stream-ordered buffers.
#[cfg(feature = "cuda")]
mod cuda {
    use fsdp_device::{Buffer, DType, Stream};
    use fsdp_kernels::host::{
        AdamW, AdamWChoice, AdamWScalars, AnyPrecision, AnyPrecisionChoice, AnyPrecisionScalars,
        Sgd, SgdChoice, SgdScalars, STEP_APPLIED, STEP_SQUARES,
    };
    use fsdp_kernels::launch::{
        adamw_buffers, adamw_decided_buffers, anyprecision_buffers, sgd_buffers,
        sgd_decided_buffers,
    };

    use super::super::device_kernels::cuda::kernel;
    use super::{Choices, ComputeDevice};
    use crate::optim::{AnyPrecisionAdamWConfig, OptimizerConfig, ShardGroups};
    use crate::FsdpError;

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

    /// The two scalar sets of a kernel's choice: each choice's, or the only one twice.
    fn pair<T: Copy>(
        choices: &Choices,
        group: usize,
        f: impl Fn(&OptimizerConfig, u64) -> Result<Option<T>, FsdpError>,
    ) -> Result<Option<[T; 2]>, FsdpError> {
        let one = |i: usize| -> Result<Option<T>, FsdpError> {
            let (configs, step) = &choices[i.min(choices.len() - 1)];
            match configs.get(group) {
                None => Ok(None), // SKIP_GROUP
                Some(c) => f(c, *step),
            }
        };
        Ok(match (one(0)?, one(1)?) {
            (Some(a), Some(b)) => Some([a, b]),
            _ => None,
        })
    }

    /// AnyPrecisionAdamW through the fused `anyprecision_decided` kernel over each run of
    /// `segments` with its group's config, on an `f32` copy of a bf16 shard (exact both ways:
    /// the kernel rounds every value it writes to bf16): as the decision in `state` says, or
    /// without one as a step decided as applied and neither clipped nor unscaled.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn any_precision_step(
        dev: &ComputeDevice,
        cfg: &AnyPrecisionAdamWConfig,
        choices: &Choices,
        state: Option<&Buffer>,
        segments: &ShardGroups,
        param: &Buffer,
        grad: &Buffer,
        moments: &[Buffer],
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        let err = kernel("AnyPrecisionAdamW kernel");
        let kind = any_precision_kind(cfg, param.dtype())?;
        let applied;
        let scalars = match state {
            Some(s) => s,
            None => {
                let mut decided = vec![0.0f64; STEP_SQUARES];
                decided[STEP_APPLIED] = 1.0;
                applied = dev.copy_from_host(&Buffer::from_slice(&decided)?, stream)?;
                &applied
            }
        };
        let wide;
        let p32 = if param.dtype() == DType::F32 {
            param
        } else {
            wide = dev.alloc(DType::F32, param.len(), stream)?;
            dev.cast(param, &wide, stream)?;
            &wide
        };
        for (range, group) in segments.segments() {
            let set = pair(choices, *group, |c, step| match c {
                OptimizerConfig::AnyPrecisionAdamW(c) => {
                    let hyper = AdamW {
                        lr: c.lr,
                        beta1: c.beta1,
                        beta2: c.beta2,
                        eps: c.eps,
                        weight_decay: c.weight_decay,
                    };
                    Ok(Some(AnyPrecisionScalars::new(&hyper, step).map_err(&err)?))
                }
                _ => Ok(None),
            })?;
            let Some(set) = set else {
                continue; // SKIP_GROUP
            };
            let view = |b: &Buffer| b.slice(range.clone());
            let comp = moments.get(2).map(view).transpose()?;
            anyprecision_buffers(
                &AnyPrecisionChoice(set),
                kind,
                scalars,
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
    /// (runs of no group are skipped): the only choice's without a decision, else the decided
    /// kernels choosing as `state` says.
    pub(super) fn optimizer_step(
        choices: &Choices,
        state: Option<&Buffer>,
        segments: &ShardGroups,
        param: &Buffer,
        grad: &Buffer,
        moments: &[Buffer],
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        let err = kernel("optimizer kernel");
        let adamw = |c: &OptimizerConfig, step: u64| match c {
            OptimizerConfig::AdamW(c) => {
                let host = AdamW {
                    lr: c.lr,
                    beta1: c.beta1,
                    beta2: c.beta2,
                    eps: c.eps,
                    weight_decay: c.weight_decay,
                };
                Ok(Some(AdamWScalars::new(&host, step).map_err(&err)?))
            }
            _ => Ok(None),
        };
        let sgd = |c: &OptimizerConfig, step: u64| match c {
            OptimizerConfig::Sgd(c) => {
                let host = Sgd {
                    lr: c.lr,
                    momentum: c.momentum,
                    dampening: c.dampening,
                    weight_decay: c.weight_decay,
                    nesterov: c.nesterov,
                };
                Ok(Some(SgdScalars::new(&host, step).map_err(&err)?))
            }
            _ => Ok(None),
        };
        let mismatch = || FsdpError::InvalidFsdpConfig {
            reason: "an optimizer state that does not fit the optimizer".into(),
        };
        for (range, group) in segments.segments() {
            let view = |b: &Buffer| b.slice(range.clone());
            let (p, g) = (view(param)?, view(grad)?);
            let Some((first, _)) = choices.first() else {
                return Ok(());
            };
            match (first.get(*group), moments) {
                (None, _) => {} // SKIP_GROUP
                (Some(OptimizerConfig::AdamW(_)), [m, v]) => {
                    let set = pair(choices, *group, adamw)?.ok_or_else(mismatch)?;
                    let (m, v) = (view(m)?, view(v)?);
                    match state {
                        None => adamw_buffers(&set[0], &p, &g, &m, &v, stream),
                        Some(s) => {
                            adamw_decided_buffers(&AdamWChoice(set), s, &p, &g, &m, &v, stream)
                        }
                    }
                    .map_err(&err)?;
                }
                (Some(OptimizerConfig::Sgd(_)), buf) => {
                    let set = pair(choices, *group, sgd)?.ok_or_else(mismatch)?;
                    let buf = buf.first().map(view).transpose()?;
                    match state {
                        None => sgd_buffers(&set[0], &p, &g, buf.as_ref(), stream),
                        Some(s) => {
                            sgd_decided_buffers(&SgdChoice(set), s, &p, &g, buf.as_ref(), stream)
                        }
                    }
                    .map_err(&err)?;
                }
                _ => return Err(mismatch()),
            }
        }
        Ok(())
    }
}
