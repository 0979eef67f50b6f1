//! The launches that end a training step on the device (`launch/step.rs`): the loss's
//! accumulation (`cu/norm.cu`), the step's and the engine's decisions and the optimizers as
//! decided (`cu/optim.cu`, `cu/any_precision.cu`), the gradients' unscaling
//! (`cu/elementwise.cu`); and the choices of scalars they take by value.

use fsdp_device::DType;

use super::optim::{adamw_scalars, sgd_scalars};
use super::{blocks, config, CStruct, KernelLaunch, Param};
use crate::host::{
    check_rule, check_scaler, AdamWChoice, AnyPrecision, AnyPrecisionChoice, EngineDecision,
    SgdChoice, StepRule, NORM_BLOCK,
};
use crate::{KernelError, Program};

/// `AdamWChoice` of `cu/optim.cu`: per choice `AdamWArgs`, the one-tensor kernel's scalars
/// ([`adamw_scalars`]).
pub(super) fn adamw_choice(choice: &AdamWChoice) -> CStruct {
    let mut c = CStruct::new();
    for s in &choice.0 {
        c.fields(&adamw_scalars(s));
    }
    c
}

/// `AnyPrecisionChoice` of `cu/any_precision.cu`: per choice `AnyPrecisionArgs` — has_decay
/// (u32), decay (1 without), beta1, one_minus_beta1, beta2, one_minus_beta2,
/// denom_correction, eps, neg_step_size.
pub(super) fn anyprecision_choice(choice: &AnyPrecisionChoice) -> CStruct {
    let mut c = CStruct::new();
    for s in &choice.0 {
        c.u32s(&[u32::from(s.decay.is_some())]).f32s(&[
            s.decay.unwrap_or(1.0),
            s.beta1,
            s.one_minus_beta1,
            s.beta2,
            s.one_minus_beta2,
            s.denom_correction,
            s.eps,
            s.neg_step_size,
        ]);
    }
    c
}

/// `SgdChoice` of `cu/optim.cu`: per choice `SgdArgs`, the one-tensor kernel's scalars
/// ([`sgd_scalars`]).
fn sgd_choice(choice: &SgdChoice) -> CStruct {
    let mut c = CStruct::new();
    for s in &choice.0 {
        c.fields(&sgd_scalars(s));
    }
    c
}

/// The kernel of `AnyPrecisionAdamW` of `kind` (`one` or `many`: `anyprecision_decided_` or
/// `anyprecision_decided_many_`, then `bf16_state` or `f32`), and its `param_bf16`; checks
/// `kind`'s dtypes and that Kahan summation has a compensation (`has_compensation`).
pub(super) fn anyprecision_kernel(
    kind: AnyPrecision,
    prefix: &str,
    has_compensation: bool,
) -> Result<(String, Param), KernelError> {
    kind.validate()?;
    if kind.kahan && !has_compensation {
        return Err(KernelError::InvalidArgument {
            kernel: "anyprecision_decided",
            reason: "Kahan summation without a compensation buffer".into(),
        });
    }
    let state = if kind.state == DType::BF16 {
        "bf16_state"
    } else {
        "f32"
    };
    let param_bf16 = u32::from(kind.param == DType::BF16);
    Ok((format!("{prefix}{state}"), Param::U32(param_bf16)))
}

/// [`launch::loss_accumulate`](crate::launch::loss_accumulate): one micro-batch's `n` f32
/// losses at `losses` (of `accum` micro-batches) read, the step's loss in `scalars[0]`
/// (f64) read and written; one block of `NORM_BLOCK` threads.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for no losses or `accum` of 0.
pub fn loss_accumulate(
    losses: u64,
    n: usize,
    accum: u32,
    first: bool,
    scalars: u64,
) -> Result<Vec<KernelLaunch>, KernelError> {
    if n == 0 || accum == 0 {
        return Err(KernelError::InvalidArgument {
            kernel: "loss_accumulate",
            reason: format!("{n} losses of a micro-batch of {accum}"),
        });
    }
    // `loss_accumulate(const float*, u64, u32 accum, u32 first, double*)`.
    Ok(vec![KernelLaunch::new(
        Program::Norm,
        "loss_accumulate",
        blocks(1, NORM_BLOCK as u32),
        vec![
            Param::Ptr(losses),
            Param::U64(n as u64),
            Param::U32(accum),
            Param::U32(u32::from(first)),
            Param::Ptr(scalars),
        ],
    )])
}

/// The scaler's settings as `step_decide` and `engine_decide` take them: growth factor,
/// backoff factor, interval (all 0 without a scaler: the kernels' sign of none).
fn scaler_params(scaler: Option<crate::host::ScalerRule>) -> [Param; 3] {
    let (growth, backoff, interval) = scaler.map_or((0.0, 0.0, 0.0), |r| {
        (
            r.growth_factor,
            r.backoff_factor,
            f64::from(r.growth_interval),
        )
    });
    [
        Param::F64(growth),
        Param::F64(backoff),
        Param::F64(interval),
    ]
}

/// [`launch::step_decide`](crate::launch::step_decide): the step's decision in `scalars`
/// (f64; the first `STEP_SQUARES + rule.tensors` read and written), one thread. No clipping
/// and no skip limit are passed as -1.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for invalid scaler settings.
pub fn step_decide(rule: &StepRule, scalars: u64) -> Result<Vec<KernelLaunch>, KernelError> {
    check_rule("step_decide", rule)?;
    let mut params = vec![
        Param::Ptr(scalars),
        Param::U64(rule.tensors as u64),
        Param::F64(rule.max_norm.unwrap_or(-1.0)),
        Param::F64(rule.skip_nonfinite.map_or(-1.0, |k| k as f64)),
        Param::F64(rule.base_steps as f64),
    ];
    params.extend(scaler_params(rule.scaler));
    // `step_decide(double*, u64 tensors, double max_norm, double skip, double base,
    // double growth, double backoff, double interval)`.
    Ok(vec![KernelLaunch::new(
        Program::Optim,
        "step_decide",
        blocks(1, 1),
        params,
    )])
}

/// [`launch::adamw_decided`](crate::launch::adamw_decided): AdamW as decided on `n` f32
/// parameters `p`, gradients `g` and moments `m`, `v` (read and written unless the step is
/// not applied), reading the decision's slots of `scalars` (f64).
pub fn adamw_decided(
    choice: &AdamWChoice,
    scalars: u64,
    p: u64,
    g: u64,
    m: u64,
    v: u64,
    n: usize,
) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // `adamw_decided_f32(float*, const float*, float*, float*, u64, const double*,
    // AdamWChoice)`.
    vec![KernelLaunch::new(
        Program::Optim,
        "adamw_decided_f32",
        config(n),
        vec![
            Param::Ptr(p),
            Param::Ptr(g),
            Param::Ptr(m),
            Param::Ptr(v),
            Param::U64(n as u64),
            Param::Ptr(scalars),
            Param::Struct(adamw_choice(choice)),
        ],
    )]
}

/// [`launch::anyprecision_decided`](crate::launch::anyprecision_decided): `AnyPrecisionAdamW`
/// of `kind` as decided on `n` f32 parameters `p` and gradients `g`, the state buffers `m`,
/// `v` and (with Kahan summation; a null pointer without, whatever is given) `compensation`
/// of [`state_len`](crate::host::state_len)`(n)` f32 each, reading the decision's slots of
/// `scalars` (f64).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a dtype other than f32 and bf16, or Kahan summation
/// without a compensation.
#[allow(clippy::too_many_arguments)]
pub fn anyprecision_decided(
    choice: &AnyPrecisionChoice,
    kind: AnyPrecision,
    scalars: u64,
    p: u64,
    g: u64,
    m: u64,
    v: u64,
    compensation: Option<u64>,
    n: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let (kernel, param_bf16) =
        anyprecision_kernel(kind, "anyprecision_decided_", compensation.is_some())?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let c = compensation.filter(|_| kind.kahan).unwrap_or(0);
    // `anyprecision_decided_<f32|bf16_state>(float*, const float*, S*, S*, S*, u64,
    // const double*, AnyPrecisionChoice, u32 param_bf16)`.
    Ok(vec![KernelLaunch::new(
        Program::AnyPrecision,
        kernel,
        config(n),
        vec![
            Param::Ptr(p),
            Param::Ptr(g),
            Param::Ptr(m),
            Param::Ptr(v),
            Param::Ptr(c),
            Param::U64(n as u64),
            Param::Ptr(scalars),
            Param::Struct(anyprecision_choice(choice)),
            param_bf16,
        ],
    )])
}

/// [`launch::engine_decide`](crate::launch::engine_decide): the engine's decision in
/// `scalars` (f64, the first `STEP_SQUARES` read and written) from `sharded[0]`,
/// `replicated[0]` and, with the non-finite rule, `loss[0]` (without it the kernel reads no
/// loss: `sharded` stands in for its address), one thread.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for invalid scaler settings, or the non-finite rule
/// without a loss.
pub fn engine_decide(
    decision: &EngineDecision,
    scalars: u64,
    sharded: u64,
    replicated: u64,
    loss: Option<u64>,
) -> Result<Vec<KernelLaunch>, KernelError> {
    if let Some(r) = &decision.scaler {
        check_scaler("engine_decide", r)?;
    }
    if decision.nonfinite.is_some() && loss.is_none() {
        return Err(KernelError::InvalidArgument {
            kernel: "engine_decide",
            reason: "the non-finite rule reads the step's loss: none was given".into(),
        });
    }
    let skip = decision
        .nonfinite
        .and_then(|r| r.skip_limit)
        .map_or(-1.0, |k| k as f64);
    let mut params = vec![
        Param::Ptr(scalars),
        Param::Ptr(sharded),
        Param::Ptr(replicated),
        Param::Ptr(loss.unwrap_or(sharded)),
        Param::F64(decision.base_steps as f64),
        Param::U32(u32::from(decision.take)),
        Param::U32(u32::from(decision.nonfinite.is_some())),
        Param::F64(skip),
    ];
    params.extend(scaler_params(decision.scaler));
    // `engine_decide(double*, const double* sharded, const double* replicated,
    // const double* loss, double base, u32 take, u32 guard, double skip, double growth,
    // double backoff, double interval)`.
    Ok(vec![KernelLaunch::new(
        Program::Optim,
        "engine_decide",
        blocks(1, 1),
        params,
    )])
}

/// [`launch::unscale_by`](crate::launch::unscale_by): `x *= 1 / scale[0]` over `n` f32.
pub fn unscale_by(x: u64, scale: u64, n: usize) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // `unscale_by_f32(float*, const double*, u64)`.
    vec![KernelLaunch::new(
        Program::Elementwise,
        "unscale_by_f32",
        config(n),
        vec![Param::Ptr(x), Param::Ptr(scale), Param::U64(n as u64)],
    )]
}

/// [`launch::sgd_decided`](crate::launch::sgd_decided): SGD as decided on `n` f32 parameters
/// `p`, gradients `g` and momentum buffer `m` (touched only when the chosen flags say
/// momentum), reading the decision's slots of `scalars` (f64).
pub fn sgd_decided(
    choice: &SgdChoice,
    scalars: u64,
    p: u64,
    g: u64,
    m: u64,
    n: usize,
) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // `sgd_decided_f32(float*, const float*, float*, u64, const double*, SgdChoice)`.
    vec![KernelLaunch::new(
        Program::Optim,
        "sgd_decided_f32",
        config(n),
        vec![
            Param::Ptr(p),
            Param::Ptr(g),
            Param::Ptr(m),
            Param::U64(n as u64),
            Param::Ptr(scalars),
            Param::Struct(sgd_choice(choice)),
        ],
    )]
}
