//! Launchers of the kernels that end a training step on the device (twins and the scalar
//! buffer's layout in [`host::step`](crate::host)): `loss_accumulate`, `step_decide` and
//! `adamw_decided_f32`, and `anyprecision_decided_*`; the engine's grad scaler on the device
//! (`engine_decide`, `unscale_by_f32`) and SGD as decided (`sgd_decided_f32`).

use cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::{config, driver, function};
use crate::host::{
    check_anyprecision_call, check_scalars_len, same_len, AdamWChoice, AdamWScalars, AnyPrecision,
    AnyPrecisionChoice, AnyPrecisionScalars, EngineDecision, SgdChoice, SgdScalars, StepRule,
    NORM_BLOCK, STEP_CHOICES,
};
use crate::{KernelError, Program};

/// `AdamWArgs` of `cu/optim.cu`: [`AdamWScalars`] with `lerp_small` as a u32.
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamWArgs {
    decay: f32,
    w1: f32,
    one_minus_w1: f32,
    lerp_small: u32,
    beta2: f32,
    one_minus_beta2: f32,
    neg_step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
}

/// `AdamWChoice` of `cu/optim.cu`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AdamWChoiceArgs {
    at: [AdamWArgs; STEP_CHOICES],
}

impl From<&AdamWChoice> for AdamWChoiceArgs {
    fn from(choice: &AdamWChoice) -> AdamWChoiceArgs {
        AdamWChoiceArgs {
            at: choice.0.each_ref().map(AdamWArgs::from),
        }
    }
}

// SAFETY: plain `repr(C)` structs of 4-byte scalars, laid out as their CUDA C twins (no
// padding, no pointers); passed by value as a kernel parameter.
unsafe impl DeviceRepr for AdamWChoiceArgs {}

impl From<&AdamWScalars> for AdamWArgs {
    fn from(s: &AdamWScalars) -> AdamWArgs {
        AdamWArgs {
            decay: s.decay,
            w1: s.w1,
            one_minus_w1: s.one_minus_w1,
            lerp_small: u32::from(s.lerp_small),
            beta2: s.beta2,
            one_minus_beta2: s.one_minus_beta2,
            neg_step_size: s.neg_step_size,
            bc2_sqrt: s.bc2_sqrt,
            eps: s.eps,
        }
    }
}

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
    let f = function(stream, Program::Norm, "loss_accumulate")?;
    let (l, _l) = losses.device_ptr(stream);
    let (s, _s) = scalars.device_ptr_mut(stream);
    let (n64, first) = (n as u64, u32::from(first));
    let mut b = stream.launch_builder(&f);
    b.arg(&l).arg(&n64).arg(&accum).arg(&first).arg(&s);
    let one_block = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (NORM_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `loss_accumulate(const float*, u64, u32, u32, double*)`, one block of
    // NORM_BLOCK threads: reads the `n` losses, writes `scalars[0]` (checked long enough).
    unsafe { b.launch(one_block) }.map_err(|e| driver("cuLaunchKernel", "loss_accumulate", e))?;
    Ok(())
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
    crate::host::check_rule("step_decide", rule)?;
    let f = function(stream, Program::Optim, "step_decide")?;
    let (s, _s) = scalars.device_ptr_mut(stream);
    let tensors = rule.tensors as u64;
    let max_norm = rule.max_norm.unwrap_or(-1.0);
    let skip = rule.skip_nonfinite.map_or(-1.0, |k| k as f64);
    let base = rule.base_steps as f64;
    // No scaler: a growth interval of 0 (the kernel's sign of none).
    let (growth, backoff, interval) = rule.scaler.map_or((0.0, 0.0, 0.0), |r| {
        (
            r.growth_factor,
            r.backoff_factor,
            f64::from(r.growth_interval),
        )
    });
    let mut b = stream.launch_builder(&f);
    b.arg(&s).arg(&tensors).arg(&max_norm).arg(&skip).arg(&base);
    b.arg(&growth).arg(&backoff).arg(&interval);
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `step_decide(double*, u64, double ×6)`, one thread: reads and writes
    // the first `STEP_SQUARES + tensors` scalars (checked above).
    unsafe { b.launch(one) }.map_err(|e| driver("cuLaunchKernel", "step_decide", e))?;
    Ok(())
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
    let f = function(stream, Program::Optim, "adamw_decided_f32")?;
    let (p, _p) = param.device_ptr_mut(stream);
    let (g, _g) = grad.device_ptr(stream);
    let (m, _m) = exp_avg.device_ptr_mut(stream);
    let (v, _v) = exp_avg_sq.device_ptr_mut(stream);
    let (s, _s) = scalars.device_ptr(stream);
    let args = AdamWChoiceArgs::from(choice);
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&p)
        .arg(&g)
        .arg(&m)
        .arg(&v)
        .arg(&n64)
        .arg(&s)
        .arg(&args);
    // SAFETY: `adamw_decided_f32(float*, const float*, float*, float*, u64, const double*,
    // AdamWChoice)`: the four tensors have `n` elements, the scalars at least STEP_SQUARES
    // (it reads the decision's slots), the choice passed by value as its C layout.
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", "adamw_decided_f32", e))?;
    Ok(())
}

/// `AnyPrecisionArgs` of `cu/optim.cu`: [`AnyPrecisionScalars`] with the decay's presence as
/// a u32.
#[repr(C)]
#[derive(Clone, Copy)]
struct AnyPrecisionArgs {
    has_decay: u32,
    decay: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    denom_correction: f32,
    eps: f32,
    neg_step_size: f32,
}

/// `AnyPrecisionChoice` of `cu/optim.cu`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AnyPrecisionChoiceArgs {
    at: [AnyPrecisionArgs; STEP_CHOICES],
}

impl From<&AnyPrecisionChoice> for AnyPrecisionChoiceArgs {
    fn from(choice: &AnyPrecisionChoice) -> AnyPrecisionChoiceArgs {
        AnyPrecisionChoiceArgs {
            at: choice.0.each_ref().map(AnyPrecisionArgs::from),
        }
    }
}

// SAFETY: plain `repr(C)` structs of 4-byte scalars, laid out as their CUDA C twins (no
// padding, no pointers); passed by value as a kernel parameter.
unsafe impl DeviceRepr for AnyPrecisionChoiceArgs {}

impl From<&AnyPrecisionScalars> for AnyPrecisionArgs {
    fn from(s: &AnyPrecisionScalars) -> AnyPrecisionArgs {
        AnyPrecisionArgs {
            has_decay: u32::from(s.decay.is_some()),
            decay: s.decay.unwrap_or(1.0),
            beta1: s.beta1,
            one_minus_beta1: s.one_minus_beta1,
            beta2: s.beta2,
            one_minus_beta2: s.one_minus_beta2,
            denom_correction: s.denom_correction,
            eps: s.eps,
            neg_step_size: s.neg_step_size,
        }
    }
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
    let name = if kind.state == fsdp_device::DType::BF16 {
        "anyprecision_decided_bf16_state"
    } else {
        "anyprecision_decided_f32"
    };
    let f = function(stream, Program::AnyPrecision, name)?;
    let (p, _p) = param.device_ptr_mut(stream);
    let (g, _g) = grad.device_ptr(stream);
    let (m, _m) = exp_avg.device_ptr_mut(stream);
    let (v, _v) = exp_avg_sq.device_ptr_mut(stream);
    let (c, _c) = match compensation {
        Some(c) => {
            let (ptr, guard) = c.device_ptr_mut(stream);
            (ptr, Some(guard))
        }
        None => (0, None),
    };
    let (s, _s) = scalars.device_ptr(stream);
    let args = AnyPrecisionChoiceArgs::from(choice);
    let n64 = n as u64;
    let param_bf16 = u32::from(kind.param == fsdp_device::DType::BF16);
    let mut b = stream.launch_builder(&f);
    b.arg(&p)
        .arg(&g)
        .arg(&m)
        .arg(&v)
        .arg(&c)
        .arg(&n64)
        .arg(&s)
        .arg(&args)
        .arg(&param_bf16);
    // SAFETY: `anyprecision_decided_*(float*, const float*, S*, S*, S*, u64, const double*,
    // AnyPrecisionChoice, u32)`: the parameter and gradient have `n` f32 elements, the state
    // buffers `state_len(n)` f32 elements, which hold `n` values of S (checked above); the
    // compensation is null exactly when Kahan summation is off (the kernel then never reads
    // it); the scalars have at least STEP_SQUARES elements; the choice is passed by value as
    // its C layout.
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", name, e))?;
    Ok(())
}

/// One thread: a launch configuration of one block of one thread.
const ONE: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

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
    let f = function(stream, Program::Optim, "engine_decide")?;
    let (s, _s) = scalars.device_ptr_mut(stream);
    let (sh, _sh) = sharded.device_ptr(stream);
    let (re, _re) = replicated.device_ptr(stream);
    // Without the rule the kernel reads no loss: the sharded part stands in for its address.
    let (l, _l) = match loss {
        Some(l) => {
            let (p, g) = l.device_ptr(stream);
            (p, Some(g))
        }
        None => (sh, None),
    };
    let base = decision.base_steps as f64;
    let take = u32::from(decision.take);
    let guard = u32::from(decision.nonfinite.is_some());
    let skip = decision
        .nonfinite
        .and_then(|r| r.skip_limit)
        .map_or(-1.0, |k| k as f64);
    // No scaler: a growth interval of 0 (the kernel's sign of none).
    let (growth, backoff, interval) = decision.scaler.map_or((0.0, 0.0, 0.0), |r| {
        (
            r.growth_factor,
            r.backoff_factor,
            f64::from(r.growth_interval),
        )
    });
    let mut b = stream.launch_builder(&f);
    b.arg(&s).arg(&sh).arg(&re).arg(&l).arg(&base).arg(&take);
    b.arg(&guard).arg(&skip);
    b.arg(&growth).arg(&backoff).arg(&interval);
    // SAFETY: `engine_decide(double*, const double* ×3, double, u32, u32, double ×4)`, one
    // thread: reads and writes the first STEP_SQUARES scalars, reads one element of each part
    // and, with the rule, of the loss (lengths checked above; without the rule the loss's
    // address is not read).
    unsafe { b.launch(ONE) }.map_err(|e| driver("cuLaunchKernel", "engine_decide", e))?;
    Ok(())
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
    let f = function(stream, Program::Elementwise, "unscale_by_f32")?;
    let (xp, _x) = x.device_ptr_mut(stream);
    let (sp, _s) = scale.device_ptr(stream);
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&xp).arg(&sp).arg(&n64);
    // SAFETY: `unscale_by_f32(float*, const double*, u64)`: `n` elements of `x`, one of
    // `scale`.
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", "unscale_by_f32", e))?;
    Ok(())
}

/// `SgdArgs` of `cu/optim.cu`: [`SgdScalars`].
#[repr(C)]
#[derive(Clone, Copy)]
struct SgdArgs {
    neg_lr: f32,
    wd: f32,
    momentum: f32,
    damp: f32,
    flags: u32,
}

/// `SgdChoice` of `cu/optim.cu`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct SgdChoiceArgs {
    at: [SgdArgs; STEP_CHOICES],
}

// SAFETY: plain `repr(C)` structs of 4-byte scalars, laid out as their CUDA C twins (no
// padding, no pointers); passed by value as a kernel parameter.
unsafe impl DeviceRepr for SgdChoiceArgs {}

impl From<&SgdScalars> for SgdArgs {
    fn from(s: &SgdScalars) -> SgdArgs {
        SgdArgs {
            neg_lr: s.neg_lr,
            wd: s.wd,
            momentum: s.momentum,
            damp: s.damp,
            flags: s.flags,
        }
    }
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
    let f = function(stream, Program::Optim, "sgd_decided_f32")?;
    let (p, _p) = param.device_ptr_mut(stream);
    let (g, _g) = grad.device_ptr(stream);
    let (m, _m) = momentum_buffer.device_ptr_mut(stream);
    let (s, _s) = scalars.device_ptr(stream);
    let args = SgdChoiceArgs {
        at: choice.0.each_ref().map(SgdArgs::from),
    };
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&p).arg(&g).arg(&m).arg(&n64).arg(&s).arg(&args);
    // SAFETY: `sgd_decided_f32(float*, const float*, float*, u64, const double*, SgdChoice)`:
    // the parameter and gradient have `n` elements, the momentum buffer too whenever a choice
    // uses it (the kernel touches it only then), the scalars at least STEP_SQUARES; the choice
    // is passed by value as its C layout.
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", "sgd_decided_f32", e))?;
    Ok(())
}
