//! The optimizer's side of a [`DeviceTrainer`](crate::device_train::DeviceTrainer): its
//! gradient accumulators and AdamW's moments on the device, or under CPU offload with the
//! master parameters on the host; and the end of a step, enqueued without waiting: each
//! gradient's sum of squares, the decision ([`GptOps::step_decide`]) and AdamW as decided.

use fsdp_kernels::gpt::{GptDims, GptOps, HostBuf, HostOps, Weights};
use fsdp_kernels::host::{AdamWChoice, StepRule, STEP_SQUARES};
use fsdp_kernels::KernelError;

/// AdamW's two moments, one of each per parameter tensor.
pub(crate) struct Moments<B> {
    pub(crate) exp_avg: Weights<B>,
    pub(crate) exp_avg_sq: Weights<B>,
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
    ) -> Result<Optim<B>, KernelError> {
        Ok(Optim {
            acc: if accumulators {
                Some(Weights::try_build(dims, |_, len| ops.zeros(len))?)
            } else {
                None
            },
            moments: Moments {
                exp_avg: Weights::try_build(dims, |_, len| ops.zeros(len))?,
                exp_avg_sq: Weights::try_build(dims, |_, len| ops.zeros(len))?,
            },
        })
    }

    /// Zero the accumulators, if any.
    pub(crate) fn zero_accumulators<P: GptOps<Buf = B>>(
        &mut self,
        ops: &P,
    ) -> Result<(), KernelError> {
        if let Some(acc) = &mut self.acc {
            for b in acc.all_mut() {
                ops.fill_zero(b)?;
            }
        }
        Ok(())
    }
}

/// CPU offload's host side: the master parameters, the optimizer and the step's scalars on
/// the host twins.
pub(crate) struct HostSide {
    pub(crate) ops: HostOps,
    pub(crate) params: Weights<HostBuf>,
    pub(crate) optim: Optim<HostBuf>,
    pub(crate) scalars: <HostOps as GptOps>::Scalars,
}

/// The optimizer's side of a trainer.
pub(crate) enum Placement<O: GptOps> {
    /// On the device, beside the model.
    Device(Optim<O::Buf>),
    /// CPU offload: the master parameters and the optimizer on the host twins.
    Host(Box<HostSide>),
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
    choices: &[AdamWChoice; 2],
    decays: &[bool],
) -> Result<(), KernelError> {
    for (i, (_, g)) in grads.named().into_iter().enumerate() {
        ops.sum_of_squares_at(g, scalars, STEP_SQUARES + i)?;
    }
    ops.step_decide(rule, scalars)?;
    let m = moments
        .exp_avg
        .all_mut()
        .into_iter()
        .zip(moments.exp_avg_sq.all_mut());
    for (((p, (_, g)), (m, v)), &decay) in params
        .all_mut()
        .into_iter()
        .zip(grads.named())
        .zip(m)
        .zip(decays)
    {
        ops.adamw_decided(&choices[usize::from(decay)], scalars, p, g, m, v)?;
    }
    Ok(())
}
