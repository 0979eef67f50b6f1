//! Launchers of the kernels that end a training step on the device (twins and the scalar
//! buffer's layout in [`host::step`](crate::host)): `loss_accumulate`, `step_decide` and
//! `adamw_decided_f32`, and `anyprecision_decided_*`; the engine's grad scaler on the device
//! (`engine_decide`, `unscale_by_f32`) and SGD as decided (`sgd_decided_f32`).

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::{enqueue, plan};
use crate::host::{
    check_anyprecision_call, check_scalars_len, same_len, AdamWChoice, AnyPrecision,
    AnyPrecisionChoice, EngineDecision, SgdChoice, SgdScalars, StepRule,
};
use crate::KernelError;

/// One micro-batch's per-token `losses` (of `accum` micro-batches) into the step's loss,
/// `scalars[STEP_LOSS]` ([`host::loss_accumulate`](crate::host::loss_accumulate), bitwise).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for no losses, `accum` of 0 or a short scalar buffer;
/// compile, load and launch failures.
pub fn loss_accumulate(
    stream: &CudaStream,
    losses: &impl DevicePtr<f32>,
    accum: u32,
    first: bool,
    scalars: &mut impl DevicePtrMut<f64>,
) -> Result<(), KernelError> {
    check_scalars_len("loss_accumulate", scalars.len(), 0)?;
    let n = losses.len();
    if n == 0 || accum == 0 {
        return Err(KernelError::InvalidArgument {
            kernel: "loss_accumulate",
            reason: format!("{n} losses of a micro-batch of {accum}"),
        });
    }
    let (l, _l) = losses.device_ptr(stream);
    let (s, _s) = scalars.device_ptr_mut(stream);
    let launches = plan::loss_accumulate(l, n, accum, first, s)?;
    // SAFETY: the `n` losses read, `scalars[0]` (checked long enough) read and written; both
    // held.
    unsafe { enqueue(stream, &launches) }
}

/// The step's decision from the tensors' sums of squares and its loss in `scalars`
/// ([`host::step_decide`](crate::host::step_decide), bitwise).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a scalar buffer too short for `rule.tensors` or
/// invalid scaler settings; compile, load and launch failures.
pub fn step_decide(
    stream: &CudaStream,
    rule: &StepRule,
    scalars: &mut impl DevicePtrMut<f64>,
) -> Result<(), KernelError> {
    check_scalars_len("step_decide", scalars.len(), rule.tensors)?;
    let (s, _s) = scalars.device_ptr_mut(stream);
    // The plan checks the rule before anything is enqueued.
    let launches = plan::step_decide(rule, s)?;
    // SAFETY: the first `STEP_SQUARES + rule.tensors` scalars read and written (checked
    // above), held.
    unsafe { enqueue(stream, &launches) }
}

/// AdamW on one tensor as [`step_decide`] decided: nothing unless applied, else the chosen
/// scalars and the clipped gradient ([`host::adamw_decided`](crate::host::adamw_decided),
/// bitwise).
///
/// # Errors
/// [`KernelError::Length`]; a short scalar buffer; compile, load and launch failures.
pub fn adamw_decided(
    stream: &CudaStream,
    choice: &AdamWChoice,
    scalars: &impl DevicePtr<f64>,
    param: &mut impl DevicePtrMut<f32>,
    grad: &impl DevicePtr<f32>,
    exp_avg: &mut impl DevicePtrMut<f32>,
    exp_avg_sq: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    check_scalars_len("adamw_decided", scalars.len(), 0)?;
    let n = param.len();
    same_len("adamw_decided", "grad", n, grad.len())?;
    same_len("adamw_decided", "exp_avg", n, exp_avg.len())?;
    same_len("adamw_decided", "exp_avg_sq", n, exp_avg_sq.len())?;
    if n == 0 {
        return Ok(());
    }
    let (p, _p) = param.device_ptr_mut(stream);
    let (g, _g) = grad.device_ptr(stream);
    let (m, _m) = exp_avg.device_ptr_mut(stream);
    let (v, _v) = exp_avg_sq.device_ptr_mut(stream);
    let (s, _s) = scalars.device_ptr(stream);
    let launches = plan::adamw_decided(choice, s, p, g, m, v, n);
    // SAFETY: the four tensors have `n` elements, the scalars at least STEP_SQUARES (checked
    // above; the kernel reads the decision's slots), all held.
    unsafe { enqueue(stream, &launches) }
}

/// `AnyPrecisionAdamW` on one tensor as [`step_decide`] decided
/// ([`host::anyprecision_decided`](crate::host::anyprecision_decided), bitwise): the state
/// buffers hold [`state_len`](crate::host::state_len) f32 elements (bf16 packed); the
/// compensation is required with Kahan summation and ignored without.
///
/// # Errors
/// [`KernelError::Length`]; a bad dtype, a missing compensation, a short scalar buffer;
/// compile, load and launch failures.
#[allow(clippy::too_many_arguments)]
pub fn anyprecision_decided(
    stream: &CudaStream,
    choice: &AnyPrecisionChoice,
    kind: AnyPrecision,
    scalars: &impl DevicePtr<f64>,
    param: &mut impl DevicePtrMut<f32>,
    grad: &impl DevicePtr<f32>,
    exp_avg: &mut impl DevicePtrMut<f32>,
    exp_avg_sq: &mut impl DevicePtrMut<f32>,
    compensation: Option<&mut impl DevicePtrMut<f32>>,
) -> Result<(), KernelError> {
    let n = param.len();
    let lens = [
        scalars.len(),
        n,
        grad.len(),
        exp_avg.len(),
        exp_avg_sq.len(),
    ];
    let kahan = check_anyprecision_call(kind, lens, compensation.as_ref().map(|c| c.len()))?;
    let compensation = compensation.filter(|_| kahan);
    if n == 0 {
        return Ok(());
    }
    let (p, _p) = param.device_ptr_mut(stream);
    let (g, _g) = grad.device_ptr(stream);
    let (m, _m) = exp_avg.device_ptr_mut(stream);
    let (v, _v) = exp_avg_sq.device_ptr_mut(stream);
    let (c, _c) = match compensation {
        Some(c) => {
            let (ptr, guard) = c.device_ptr_mut(stream);
            (Some(ptr), Some(guard))
        }
        None => (None, None),
    };
    let (s, _s) = scalars.device_ptr(stream);
    let launches = plan::anyprecision_decided(choice, kind, s, p, g, m, v, c, n)?;
    // SAFETY: the parameter and gradient have `n` f32 elements, the state buffers
    // `state_len(n)` f32 elements, which hold `n` values of the state's type (checked above);
    // the compensation is given exactly with Kahan summation (else null: the kernel never
    // reads it); the scalars have at least STEP_SQUARES elements; all held.
    unsafe { enqueue(stream, &launches) }
}

/// The end of the engine's step in `scalars` from the squared parts `sharded[0]` and
/// `replicated[0]` of its (unscaled) gradients and, with the non-finite rule, the step's
/// `loss[0]` ([`host::engine_decide`](crate::host::engine_decide), bitwise).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a scalar buffer shorter than
/// [`STEP_SQUARES`](crate::host::STEP_SQUARES), invalid scaler settings, or a non-finite rule
/// without a loss; [`KernelError::Length`] for parts or a loss of other than one element;
/// compile, load and launch failures.
pub fn engine_decide<L: DevicePtr<f64>>(
    stream: &CudaStream,
    decision: &EngineDecision,
    scalars: &mut impl DevicePtrMut<f64>,
    sharded: &impl DevicePtr<f64>,
    replicated: &impl DevicePtr<f64>,
    loss: Option<&L>,
) -> Result<(), KernelError> {
    check_scalars_len("engine_decide", scalars.len(), 0)?;
    same_len("engine_decide", "sharded", 1, sharded.len())?;
    same_len("engine_decide", "replicated", 1, replicated.len())?;
    if let Some(l) = loss {
        same_len("engine_decide", "loss", 1, l.len())?;
    }
    if let Some(r) = &decision.scaler {
        crate::host::check_scaler("engine_decide", r)?;
    }
    if decision.nonfinite.is_some() && loss.is_none() {
        return Err(KernelError::InvalidArgument {
            kernel: "engine_decide",
            reason: "the non-finite rule reads the step's loss: none was given".into(),
        });
    }
    let (s, _s) = scalars.device_ptr_mut(stream);
    let (sh, _sh) = sharded.device_ptr(stream);
    let (re, _re) = replicated.device_ptr(stream);
    let (l, _l) = match loss {
        Some(l) => {
            let (p, g) = l.device_ptr(stream);
            (Some(p), Some(g))
        }
        None => (None, None),
    };
    let launches = plan::engine_decide(decision, s, sh, re, l)?;
    // SAFETY: the first STEP_SQUARES scalars read and written, one element of each part and,
    // with the rule, of the loss read (lengths checked above; without the rule the loss's
    // address is not read); all held.
    unsafe { enqueue(stream, &launches) }
}

/// `x *= 1 / scale[0]` (the quotient in f64 rounded to f32; nothing when it is 1): the twin
/// [`host::unscale_by`](crate::host::unscale_by), bitwise.
///
/// # Errors
/// [`KernelError::Length`] unless `scale` has one element; compile, load and launch failures.
pub fn unscale_by(
    stream: &CudaStream,
    x: &mut impl DevicePtrMut<f32>,
    scale: &impl DevicePtr<f64>,
) -> Result<(), KernelError> {
    same_len("unscale_by", "scale", 1, scale.len())?;
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let (xp, _x) = x.device_ptr_mut(stream);
    let (sp, _s) = scale.device_ptr(stream);
    // SAFETY: `n` elements of `x`, one of `scale`, both held.
    unsafe { enqueue(stream, &plan::unscale_by(xp, sp, n)) }
}

/// SGD on one tensor as decided: nothing unless applied, else the chosen scalars and the
/// gradient as the decision says ([`host::sgd_decided`](crate::host::sgd_decided), bitwise).
/// `momentum_buffer` may be empty when no choice uses it.
///
/// # Errors
/// [`KernelError::Length`]; a short scalar buffer; compile, load and launch failures.
pub fn sgd_decided(
    stream: &CudaStream,
    choice: &SgdChoice,
    scalars: &impl DevicePtr<f64>,
    param: &mut impl DevicePtrMut<f32>,
    grad: &impl DevicePtr<f32>,
    momentum_buffer: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    check_scalars_len("sgd_decided", scalars.len(), 0)?;
    let n = param.len();
    same_len("sgd_decided", "grad", n, grad.len())?;
    if choice.0.iter().any(SgdScalars::uses_buffer) {
        same_len("sgd_decided", "momentum_buffer", n, momentum_buffer.len())?;
    }
    if n == 0 {
        return Ok(());
    }
    let (p, _p) = param.device_ptr_mut(stream);
    let (g, _g) = grad.device_ptr(stream);
    let (m, _m) = momentum_buffer.device_ptr_mut(stream);
    let (s, _s) = scalars.device_ptr(stream);
    let launches = plan::sgd_decided(choice, s, p, g, m, n);
    // SAFETY: the parameter and gradient have `n` elements, the momentum buffer too whenever
    // a choice uses it (the kernel touches it only then), the scalars at least STEP_SQUARES;
    // all held.
    unsafe { enqueue(stream, &launches) }
}
