//! The optimizer's side of a [`DeviceTrainer`](crate::device_train::DeviceTrainer): its
//! gradient accumulators and the optimizer's state (AdamW's moments, or `AnyPrecisionAdamW`'s
//! and its compensation) on the device, or under CPU offload with the master parameters on the
//! host; and the end of a step, enqueued without waiting: each gradient's sum of squares, the
//! decision ([`GptOps::step_decide`]) and the optimizer as decided.

use fsdp_device::DType;
use fsdp_kernels::gpt::{DecidedTensor, GptDims, GptOps, HostBuf, HostOps, Weights};
use fsdp_kernels::host::{
    state_len, AdamWChoice, AnyPrecision, AnyPrecisionChoice, StepRule, STEP_SQUARES,
};
use fsdp_kernels::KernelError;

use crate::device_shard::shard_len;

/// AdamW's two moments, one of each per parameter tensor, and `AnyPrecisionAdamW`'s Kahan
/// compensation. Under `AnyPrecisionAdamW` with bf16 state each buffer holds its values as
/// bf16 packed two to an f32 element ([`state_len`]).
pub(crate) struct Moments<B> {
    pub(crate) exp_avg: Weights<B>,
    pub(crate) exp_avg_sq: Weights<B>,
    pub(crate) compensation: Option<Weights<B>>,
}

impl<B> Moments<B> {
    /// The buffers by the names the engine's checkpoints give them: `exp_avg`, `exp_avg_sq`
    /// and, if any, `compensation`.
    pub(crate) fn kinds(&self) -> Vec<(&'static str, &Weights<B>)> {
        let mut k = vec![("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq)];
        if let Some(c) = &self.compensation {
            k.push(("compensation", c));
        }
        k
    }
}

/// The optimizer's scalars of one step, for parameters without and with weight decay.
pub(crate) enum StepChoices {
    /// AdamW's.
    AdamW([AdamWChoice; 2]),
    /// `AnyPrecisionAdamW`'s, and its dtypes.
    AnyPrecision([AnyPrecisionChoice; 2], AnyPrecision),
}

/// The step's gradient accumulators (none with one micro-batch a step on the device: the
/// model's gradients serve) and AdamW's moments, on one side.
pub(crate) struct Optim<B> {
    pub(crate) acc: Option<Weights<B>>,
    pub(crate) moments: Moments<B>,
}

impl<B> Optim<B> {
    pub(crate) fn zeros<P: GptOps<Buf = B>>(
        ops: &P,
        dims: &GptDims,
        accumulators: bool,
        any: Option<AnyPrecision>,
    ) -> Result<Optim<B>, KernelError> {
        Self::sharded_zeros(ops, dims, accumulators, 1, any)
    }

    /// Zero accumulators (if `accumulators`) and optimizer state of this rank's shards over
    /// `factor` ranks ([`shard_len`](crate::device_shard::shard_len) elements of each
    /// tensor): AdamW's f32 moments, or `any`'s moments and compensation in its state dtype.
    pub(crate) fn sharded_zeros<P: GptOps<Buf = B>>(
        ops: &P,
        dims: &GptDims,
        accumulators: bool,
        factor: usize,
        any: Option<AnyPrecision>,
    ) -> Result<Optim<B>, KernelError> {
        let state = any.map_or(DType::F32, |a| a.state);
        let zeros = |d: DType| {
            Weights::try_build(dims, |_, len| {
                ops.zeros(state_len(shard_len(len, factor), d))
            })
        };
        Ok(Optim {
            acc: if accumulators {
                Some(zeros(DType::F32)?)
            } else {
                None
            },
            moments: Moments {
                exp_avg: zeros(state)?,
                exp_avg_sq: zeros(state)?,
                compensation: match any {
                    Some(a) if a.kahan => Some(zeros(state)?),
                    _ => None,
                },
            },
        })
    }

    /// Zero the accumulators, if any.
    pub(crate) fn zero_accumulators<P: GptOps<Buf = B>>(
        &mut self,
        ops: &P,
    ) -> Result<(), KernelError> {
        match &mut self.acc {
            Some(acc) => ops.fill_zero_many(&mut acc.all_mut()),
            None => Ok(()),
        }
    }
}

/// The bytes of one of the optimizer's state buffers over every tensor, each sharded over
/// `factor` ranks (1: whole), and of the compensation (0 without one): f32 for AdamW,
/// `AnyPrecisionAdamW`'s state dtype packed ([`state_len`]) otherwise.
pub(crate) fn state_bytes(
    c: &crate::device_config::DeviceTrainConfig,
    factor: usize,
) -> (u64, u64) {
    let d = c.state_dtype();
    let each: u64 = crate::device_state::tensor_lens(c)
        .into_iter()
        .map(|n| state_len(shard_len(n, factor), d) as u64 * 4)
        .sum();
    let kahan = c.any_precision.is_some_and(|a| a.kahan);
    (each, if kahan { each } else { 0 })
}

/// CPU offload's host side: the master parameters, the optimizer and the step's scalars on
/// the host twins.
pub(crate) struct HostSide {
    pub(crate) ops: HostOps,
    pub(crate) params: Weights<HostBuf>,
    pub(crate) optim: Optim<HostBuf>,
    pub(crate) scalars: <HostOps as GptOps>::Scalars,
}

/// CPU offload's staging memory ([`GptOps::Staging`], page-locked on a GPU): the gradients of
/// a micro-batch copied out (two sets with several micro-batches a step, so that one is read
/// while the next is copied) and the updated parameters copied in.
pub(crate) struct OffloadStaging<S> {
    pub(crate) grads: Vec<Weights<S>>,
    pub(crate) params: Weights<S>,
}

impl<S> OffloadStaging<S> {
    /// Two sets of gradients (one with one micro-batch a step) and one of parameters, each
    /// tensor's shard over `factor` ranks (1: whole).
    pub(crate) fn new<P: GptOps<Staging = S>>(
        ops: &P,
        dims: &GptDims,
        grad_accum: usize,
        factor: usize,
    ) -> Result<OffloadStaging<S>, KernelError> {
        let sets = grad_accum.clamp(1, 2);
        let make = |_: &str, len: usize| ops.staging(len.div_ceil(factor.max(1)));
        Ok(OffloadStaging {
            grads: (0..sets)
                .map(|_| Weights::try_build(dims, make))
                .collect::<Result<_, _>>()?,
            params: Weights::try_build(dims, make)?,
        })
    }

    /// The gradient set of micro-batch `m`.
    pub(crate) fn slot(&self, m: usize) -> usize {
        m % self.grads.len()
    }
}

/// The optimizer's side of a trainer.
pub(crate) enum Placement<O: GptOps> {
    /// On the device, beside the model.
    Device(Optim<O::Buf>),
    /// CPU offload: the master parameters and the optimizer on the host twins, and the
    /// staging of the copies between them and the device.
    Host(Box<HostSide>, Box<OffloadStaging<O::Staging>>),
}

/// Offload: adds `alpha ×` the gradients staged in `staged` (waiting for their copies only)
/// to the host's accumulators.
pub(crate) fn accumulate_staged<P: GptOps>(
    ops: &P,
    host: &mut HostSide,
    staged: &Weights<P::Staging>,
    alpha: f32,
) -> Result<(), KernelError> {
    let acc = host
        .optim
        .acc
        .as_mut()
        .ok_or_else(|| KernelError::InvalidArgument {
            kernel: "offload",
            reason: "the host side has no accumulators".into(),
        })?;
    for (a, (_, s)) in acc.all_mut().into_iter().zip(staged.named()) {
        fsdp_kernels::host::axpby(alpha, ops.staged(s)?, 1.0, a)?;
    }
    Ok(())
}

/// Enqueues the sum of squares of each of `grads` into its slot of `scalars` (all at once:
/// on CUDA two launches per 96 tensors).
pub(crate) fn squares<P: GptOps>(
    ops: &P,
    grads: &Weights<P::Buf>,
    scalars: &mut P::Scalars,
) -> Result<(), KernelError> {
    let xs: Vec<&P::Buf> = grads.named().into_iter().map(|(_, g)| g).collect();
    ops.sum_of_squares_many(&xs, scalars, STEP_SQUARES)
}

/// Enqueues the decision by `rule` (the loss and the squares in `scalars`), then the
/// optimizer on every parameter with `choices`' set for its group (`decays`) as decided.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decide_and_apply<P: GptOps>(
    ops: &P,
    params: &mut Weights<P::Buf>,
    grads: &Weights<P::Buf>,
    moments: &mut Moments<P::Buf>,
    scalars: &mut P::Scalars,
    rule: &StepRule,
    choices: &StepChoices,
    decays: &[bool],
) -> Result<(), KernelError> {
    ops.step_decide(rule, scalars)?;
    // Every tensor at once (on CUDA a launch per 64 tensors, 48 for AnyPrecisionAdamW).
    let mut comps = moments
        .compensation
        .as_mut()
        .map(|c| c.all_mut().into_iter());
    let m = moments
        .exp_avg
        .all_mut()
        .into_iter()
        .zip(moments.exp_avg_sq.all_mut());
    let mut tensors: Vec<DecidedTensor<'_, P::Buf>> = params
        .all_mut()
        .into_iter()
        .zip(grads.named())
        .zip(m)
        .zip(decays)
        .map(
            |(((param, (_, grad)), (exp_avg, exp_avg_sq)), &decay)| DecidedTensor {
                param,
                grad,
                exp_avg,
                exp_avg_sq,
                compensation: comps.as_mut().and_then(Iterator::next),
                decay,
            },
        )
        .collect();
    match choices {
        StepChoices::AdamW(a) => ops.adamw_decided_many(a, scalars, &mut tensors),
        StepChoices::AnyPrecision(a, kind) => {
            ops.anyprecision_decided_many(a, *kind, scalars, &mut tensors)
        }
    }
}

/// Enqueues the end of a step on one side: the sum of squares of each of `grads` into its
/// slot of `scalars` (the step's loss already there), the decision by `rule`, then AdamW on
/// every parameter with `choices[decay]` as decided. Nothing waits.
#[allow(clippy::too_many_arguments)]
pub(crate) fn end_step<P: GptOps>(
    ops: &P,
    params: &mut Weights<P::Buf>,
    grads: &Weights<P::Buf>,
    moments: &mut Moments<P::Buf>,
    scalars: &mut P::Scalars,
    rule: &StepRule,
    choices: &StepChoices,
    decays: &[bool],
) -> Result<(), KernelError> {
    squares(ops, grads, scalars)?;
    decide_and_apply(ops, params, grads, moments, scalars, rule, choices, decays)
}
