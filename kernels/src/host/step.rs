//! Twins of the kernels that end a training step on the device without the host: the step's
//! loss summed into a scalar buffer (`loss_accumulate`), the decision (`step_decide`: the
//! global gradient norm, the clipping coefficient, whether the step is finite and AdamW runs,
//! which of the host's precomputed AdamW scalars apply) and AdamW reading that decision
//! (`adamw_decided_f32`). The host enqueues a whole step and reads its outcome later (one step
//! late), so no step waits for the device.
//!
//! The scalars live in one f64 buffer laid out as the `STEP_*` constants say; the slots from
//! [`STEP_SQUARES`] on hold each gradient tensor's sum of squares
//! ([`sum_of_squares`](super::sum_of_squares), written by the norm kernels into its slot).
//!
//! Dynamic loss scaling (PyTorch's `GradScaler`, [`ScalerRule`]) lives in the same buffer: the
//! scale ([`STEP_SCALE`]) that the cross-entropy's gradient seed is multiplied by, the growth
//! tracker and the count of the scaler's skips, all kept and updated on the device by the
//! decision, which also tells AdamW to unscale ([`STEP_UNSCALE`]). A buffer of zeros is a
//! trainer without a scaler.

use super::norm::tree_sum_f64;
use super::{adamw, same_len, sgd, AdamWScalars, SgdScalars, NORM_BLOCK};
use crate::KernelError;

/// The step's loss (an f32 value): the micro-batches' mean losses, each divided by their
/// count, added in f32.
pub const STEP_LOSS: usize = 0;
/// The global gradient norm (f64) before clipping.
pub const STEP_GRAD_NORM: usize = 1;
/// 1 when the gradients are clipped, else 0.
pub const STEP_CLIPPED: usize = 2;
/// The clipping coefficient (an f32 value) when [`STEP_CLIPPED`] is 1.
pub const STEP_CLIP_COEF: usize = 3;
/// 1 when AdamW runs (the step is finite and the trainer is not halted), else 0.
pub const STEP_APPLIED: usize = 4;
/// Which of [`AdamWChoice`]'s scalar sets AdamW uses: the optimizer steps taken before this
/// one minus the rule's [`base_steps`](StepRule::base_steps).
pub const STEP_CHOICE: usize = 5;
/// Optimizer steps taken, this one included (kept from step to step).
pub const STEP_COUNT: usize = 6;
/// Non-finite steps seen so far (kept from step to step).
pub const STEP_NONFINITE: usize = 7;
/// 1 once more non-finite steps were seen than the rule allows (kept: no later step applies).
pub const STEP_HALTED: usize = 8;
/// 1 when the optimizer steps taken were not among the choices the host offered (a trainer's
/// bookkeeping fault): the step is not applied.
pub const STEP_FAULT: usize = 9;
/// The loss scale of the next backward (an f32 value, kept from step to step): with a grad
/// scaler the cross-entropy's gradient seed is multiplied by it; [`step_decide`] updates it
/// (backed off on an overflow, grown after the growth interval). Unused without a scaler.
pub const STEP_SCALE: usize = 10;
/// What AdamW multiplies each gradient by before clipping: with a grad scaler `1 / scale` of
/// the step's scale, computed in f64 and rounded to f32 (torch's `inv_scale`); 0 without one,
/// meaning none.
pub const STEP_UNSCALE: usize = 11;
/// 1 when a grad scaler found the step's gradients overflowed (a NaN or an infinity): the
/// scaler's skip, not counted as a non-finite step.
pub const STEP_FOUND_INF: usize = 12;
/// The grad scaler's consecutive steps without overflow since its last growth or backoff
/// (kept: torch's `_growth_tracker`).
pub const STEP_GROWTH_TRACKER: usize = 13;
/// Steps the grad scaler skipped for an overflow so far (kept).
pub const STEP_SCALER_SKIPPED: usize = 14;
/// The first gradient tensor's sum of squares; tensor `i`'s is at `STEP_SQUARES + i`.
pub const STEP_SQUARES: usize = 15;
/// How many AdamW scalar sets a decision chooses from: the host may enqueue a step while the
/// outcome of one earlier step is still unread.
pub const STEP_CHOICES: usize = 2;

/// The length of a step's scalar buffer for `tensors` gradient tensors.
pub const fn step_scalars_len(tensors: usize) -> usize {
    STEP_SQUARES + tensors
}

/// The settings of dynamic loss scaling on the device: `torch.amp.GradScaler`'s (see
/// [`step_decide`] for what the decision does with them). The scale itself is state, in the
/// scalars ([`STEP_SCALE`], set by [`step_scalars`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalerRule {
    /// The scale is multiplied by this after `growth_interval` steps without overflow (the
    /// product in f64 rounded to f32, not applied if infinite).
    pub growth_factor: f64,
    /// The scale is multiplied by this on an overflow (in f64, rounded to f32).
    pub backoff_factor: f64,
    /// Consecutive steps without overflow before the scale grows.
    pub growth_interval: u32,
}

/// A step's scalar buffer for `tensors` gradient tensors at the start of training: zeros,
/// and with a grad scaler its state — `scale`, `growth_tracker` and `skipped` steps (a new
/// scaler's: its initial scale, 0, 0).
pub fn step_scalars(tensors: usize, scaler: Option<(f32, u32, u64)>) -> Vec<f64> {
    let mut s = vec![0.0; step_scalars_len(tensors)];
    if let Some((scale, tracker, skipped)) = scaler {
        s[STEP_SCALE] = f64::from(scale);
        s[STEP_GROWTH_TRACKER] = f64::from(tracker);
        s[STEP_SCALER_SKIPPED] = skipped as f64;
    }
    s
}

/// What [`step_decide`] decides by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepRule {
    /// Gradient tensors whose sums of squares make the norm.
    pub tensors: usize,
    /// Clip the global norm to this (`None`: no clipping): the coefficient is
    /// `max_norm / (norm + 1e-6)`, applied when below 1 and the norm is finite (as
    /// `torch.nn.utils.clip_grad_norm_`).
    pub max_norm: Option<f64>,
    /// Non-finite steps skipped before the next one halts the trainer (`None`: every one is
    /// skipped and training goes on).
    pub skip_nonfinite: Option<u64>,
    /// The optimizer steps the host knows were taken; the device's count is this or up to
    /// `STEP_CHOICES − 1` more.
    pub base_steps: u64,
    /// Dynamic loss scaling (`None`: off; the gradients are those of the loss itself).
    pub scaler: Option<ScalerRule>,
}

/// The AdamW scalars of the optimizer step numbers `base_steps + 1 ..= base_steps +
/// STEP_CHOICES`, one of which [`step_decide`] chooses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWChoice(pub [AdamWScalars; STEP_CHOICES]);

/// A step's scalar buffer of `len` elements must hold the slots of `tensors` tensors.
pub(crate) fn check_scalars_len(
    kernel: &'static str,
    len: usize,
    tensors: usize,
) -> Result<(), KernelError> {
    if len < step_scalars_len(tensors) {
        return Err(KernelError::InvalidArgument {
            kernel,
            reason: format!(
                "a step's scalars for {tensors} tensors need {} elements, not {}",
                step_scalars_len(tensors),
                len
            ),
        });
    }
    Ok(())
}

/// A rule's scaler settings must be torch's valid ones: a growth factor above 1, a backoff
/// factor in (0, 1), a growth interval of at least 1 (the kernel's sign of no scaler is 0).
pub(crate) fn check_rule(kernel: &'static str, rule: &StepRule) -> Result<(), KernelError> {
    rule.scaler
        .as_ref()
        .map_or(Ok(()), |r| check_scaler(kernel, r))
}

/// A scaler's settings must be torch's valid ones (see [`check_rule`]).
pub(crate) fn check_scaler(kernel: &'static str, r: &ScalerRule) -> Result<(), KernelError> {
    if r.growth_factor.is_finite()
        && r.growth_factor > 1.0
        && r.backoff_factor > 0.0
        && r.backoff_factor < 1.0
        && r.growth_interval >= 1
    {
        return Ok(());
    }
    Err(KernelError::InvalidArgument {
        kernel,
        reason: format!(
            "a grad scaler needs a finite growth factor above 1, a backoff factor in (0, 1) \
             and a growth interval of at least 1, not {r:?}"
        ),
    })
}

/// The cross-entropy's gradient seed as the kernels take it: `dloss`, times the loss scale of
/// a grad scaler's step `scalars` ([`STEP_SCALE`], rounded to f32) when given — one f32
/// product, exact for a power-of-two scale, so the backward is the scaled loss's.
///
/// # Errors
/// [`KernelError::InvalidArgument`] (naming `kernel`) for a scalar buffer without the slot.
pub fn scaled_seed(
    kernel: &'static str,
    dloss: f32,
    scalars: Option<&[f64]>,
) -> Result<f32, KernelError> {
    match scalars {
        None => Ok(dloss),
        Some(s) => {
            check_scalars_len(kernel, s.len(), 0)?;
            Ok(dloss * s[STEP_SCALE] as f32)
        }
    }
}

/// Twin of `loss_accumulate`: `losses` (the per-token losses of one micro-batch of `accum`)
/// summed in f64 by one block of [`NORM_BLOCK`] threads (thread `t` sums elements `t, t +
/// NORM_BLOCK, …` in order, then the tree of the norm kernels), their mean rounded to f32,
/// divided by `accum` in f64 and rounded again, and added in f32 to the step's loss (to 0 when
/// `first`).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for no losses, `accum` of 0, or a scalar buffer shorter
/// than [`STEP_SQUARES`].
pub fn loss_accumulate(
    losses: &[f32],
    accum: u32,
    first: bool,
    scalars: &mut [f64],
) -> Result<(), KernelError> {
    check_scalars_len("loss_accumulate", scalars.len(), 0)?;
    if losses.is_empty() || accum == 0 {
        return Err(KernelError::InvalidArgument {
            kernel: "loss_accumulate",
            reason: format!("{} losses of a micro-batch of {accum}", losses.len()),
        });
    }
    let partial = (0..NORM_BLOCK)
        .map(|t| {
            losses
                .iter()
                .skip(t)
                .step_by(NORM_BLOCK)
                .fold(0.0f64, |a, &l| a + f64::from(l))
        })
        .collect();
    let total = tree_sum_f64(partial);
    let mean = (total / losses.len() as f64) as f32;
    let part = (f64::from(mean) / f64::from(accum)) as f32;
    let before = if first {
        0.0f32
    } else {
        scalars[STEP_LOSS] as f32
    };
    scalars[STEP_LOSS] = f64::from(before + part);
    Ok(())
}

/// Twin of `step_decide` (one thread): the global norm `√Σ squares` (added in tensor order),
/// the clipping, whether the step is finite (its loss and norm), the non-finite count and the
/// halt, which AdamW scalar set applies, and the optimizer step count.
///
/// With a grad scaler ([`StepRule::scaler`]) the squares are of the scaled gradients: the norm
/// is `√Σ squares · inv` with `inv = 1 / scale` rounded to f32 ([`STEP_UNSCALE`], which AdamW
/// multiplies each gradient by) — for a power-of-two scale (the default `2^16`, grown by 2 and
/// backed off by ½) exactly the unscaled gradients' norm, for another within its rounding
/// (torch takes the norm of the unscaled elements). A non-finite norm is then the scaler's
/// overflow ([`STEP_FOUND_INF`]): the step is skipped, counted in [`STEP_SCALER_SKIPPED`]
/// and not as non-finite, and the scale is backed off and the tracker reset; the non-finite
/// rule applies to the loss alone. A step that applies counts towards the growth interval,
/// at whose end the scale grows (if finite) and the tracker restarts; a step skipped for its
/// loss leaves the scaler as it is. The engine's `fsdp train` loop does the same
/// (`GradScaler::update`, with `nonfinite` checking the loss before the scaler's overflow).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a scalar buffer shorter than the rule's tensors need,
/// or invalid scaler settings.
pub fn step_decide(rule: &StepRule, scalars: &mut [f64]) -> Result<(), KernelError> {
    check_scalars_len("step_decide", scalars.len(), rule.tensors)?;
    check_rule("step_decide", rule)?;
    let s = scalars;
    let sq = s[STEP_SQUARES..STEP_SQUARES + rule.tensors]
        .iter()
        .fold(0.0f64, |a, &b| a + b);
    let unscale = rule.scaler.map(|_| f64::from((1.0 / s[STEP_SCALE]) as f32));
    let norm = match unscale {
        Some(inv) => sq.sqrt() * inv,
        None => sq.sqrt(),
    };
    s[STEP_UNSCALE] = unscale.unwrap_or(0.0);
    s[STEP_GRAD_NORM] = norm;
    let (clipped, coef) = match rule.max_norm {
        Some(m) => {
            let c = m / (norm + 1e-6);
            if norm.is_finite() && c < 1.0 {
                (1.0, f64::from(c as f32))
            } else {
                (0.0, 1.0)
            }
        }
        None => (0.0, 1.0),
    };
    s[STEP_CLIPPED] = clipped;
    s[STEP_CLIP_COEF] = coef;
    let found_inf = rule.scaler.is_some() && !norm.is_finite();
    let finite = (s[STEP_LOSS] as f32).is_finite() && (found_inf || norm.is_finite());
    if !finite {
        s[STEP_NONFINITE] += 1.0;
        if rule
            .skip_nonfinite
            .is_some_and(|k| s[STEP_NONFINITE] > k as f64)
        {
            s[STEP_HALTED] = 1.0;
        }
    }
    let applied = count_step(
        s,
        rule.base_steps,
        finite && !found_inf && s[STEP_HALTED] == 0.0,
    );
    s[STEP_FOUND_INF] = if found_inf { 1.0 } else { 0.0 };
    if let Some(r) = rule.scaler {
        scaler_update(&r, s, found_inf, applied);
    }
    Ok(())
}

/// A decision's choice and count: which scalar set applies ([`STEP_CHOICE`], the steps
/// counted before this one minus `base_steps`; a count outside the choices is a fault,
/// [`STEP_FAULT`]), and whether the step applies ([`STEP_APPLIED`]: `wanted` and no fault),
/// counted in [`STEP_COUNT`] when it does. Returns whether it applies.
fn count_step(s: &mut [f64], base_steps: u64, wanted: bool) -> bool {
    let choice = s[STEP_COUNT] - base_steps as f64;
    let in_range = (0.0..STEP_CHOICES as f64).contains(&choice);
    s[STEP_FAULT] = if in_range { 0.0 } else { 1.0 };
    s[STEP_CHOICE] = if in_range { choice } else { 0.0 };
    let applied = wanted && in_range;
    s[STEP_APPLIED] = if applied { 1.0 } else { 0.0 };
    if applied {
        s[STEP_COUNT] += 1.0;
    }
    applied
}

/// The grad scaler's update after a decision: on an overflow the skip is counted, the scale
/// backed off and the tracker reset; an applied step counts towards the growth interval, at
/// whose end the scale grows (if finite) and the tracker restarts. Each product in f64,
/// rounded to f32.
fn scaler_update(r: &ScalerRule, s: &mut [f64], found_inf: bool, applied: bool) {
    if found_inf {
        s[STEP_SCALER_SKIPPED] += 1.0;
        s[STEP_SCALE] = f64::from((s[STEP_SCALE] * r.backoff_factor) as f32);
        s[STEP_GROWTH_TRACKER] = 0.0;
    } else if applied {
        let successful = s[STEP_GROWTH_TRACKER] + 1.0;
        if successful >= f64::from(r.growth_interval) {
            let grown = (s[STEP_SCALE] * r.growth_factor) as f32;
            if grown.is_finite() {
                s[STEP_SCALE] = f64::from(grown);
            }
            s[STEP_GROWTH_TRACKER] = 0.0;
        } else {
            s[STEP_GROWTH_TRACKER] = successful;
        }
    }
}

/// The engine's rule for non-finite steps on the device ([`EngineDecision::nonfinite`]): a
/// step whose loss or gradient norm is not finite is not applied, and counted
/// ([`STEP_NONFINITE`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NonfiniteRule {
    /// Non-finite steps skipped before the next one halts the engine ([`STEP_HALTED`]: no
    /// later step applies); `None`: every one is skipped and training goes on.
    pub skip_limit: Option<u64>,
}

/// What [`engine_decide`] decides by: the end of the engine's step on the device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineDecision {
    /// The grad scaler's settings (`None`: no scaler).
    pub scaler: Option<ScalerRule>,
    /// The non-finite rule (`None`: the loss and the norm are not checked).
    pub nonfinite: Option<NonfiniteRule>,
    /// The optimizer steps the host knows were taken; the device's count
    /// ([`STEP_COUNT`]) is this or up to `STEP_CHOICES − 1` more.
    pub base_steps: u64,
    /// An optimizer step (`true`), or a skip the trainer asked for (`false`).
    pub take: bool,
}

/// Twin of `engine_decide` (one thread), the end of a step of the engine on the device, whose
/// gradients were unscaled (under a grad scaler) and clipped in memory: their norm
/// `√(sharded + replicated)`, the sum of their squares (the sharded part summed over the shard
/// group), goes to [`STEP_GRAD_NORM`]. With a grad scaler they overflowed
/// ([`STEP_FOUND_INF`]) when that sum is not finite. With the non-finite rule the step's
/// `loss` (summed over the world, an f32 value) goes to [`STEP_LOSS`], and a step is finite
/// when its loss is and its norm is too (the norm not checked on an overflow, which is the
/// scaler's to skip), as `fsdp train`'s loop decides; a step that is not is counted
/// ([`STEP_NONFINITE`]), and beyond the rule's limit halts the engine ([`STEP_HALTED`], kept:
/// no later step applies). The step applies ([`STEP_APPLIED`], the count [`STEP_COUNT`] then
/// grows by one) when it is taken, finite, did not overflow, the engine is not halted and the
/// count is among the choices ([`STEP_CHOICE`]; else [`STEP_FAULT`]). On an overflow the
/// scaler counts the skip ([`STEP_SCALER_SKIPPED`]), backs off the scale and resets the
/// tracker; an applied step counts towards the growth interval, at whose end the scale grows
/// (if finite) and the tracker restarts — `GradScaler::update` of the engine, each product in
/// f64 rounded to f32. A skip without an overflow leaves the scaler as it is.
/// [`STEP_UNSCALE`] and [`STEP_CLIPPED`] are set to 0: the decided optimizers take the
/// gradients as they are.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a scalar buffer shorter than [`STEP_SQUARES`] or
/// invalid scaler settings.
pub fn engine_decide(
    d: &EngineDecision,
    scalars: &mut [f64],
    sharded: f64,
    replicated: f64,
    loss: f64,
) -> Result<(), KernelError> {
    check_scalars_len("engine_decide", scalars.len(), 0)?;
    if let Some(r) = &d.scaler {
        check_scaler("engine_decide", r)?;
    }
    let s = scalars;
    let sum = sharded + replicated;
    let norm = sum.sqrt();
    s[STEP_GRAD_NORM] = norm;
    let found_inf = d.scaler.is_some() && !sum.is_finite();
    let mut finite = true;
    if let Some(rule) = d.nonfinite {
        s[STEP_LOSS] = loss;
        finite = (loss as f32).is_finite() && (found_inf || norm.is_finite());
        if !finite {
            s[STEP_NONFINITE] += 1.0;
            if rule
                .skip_limit
                .is_some_and(|k| s[STEP_NONFINITE] > k as f64)
            {
                s[STEP_HALTED] = 1.0;
            }
        }
    }
    let wanted = d.take && finite && !found_inf && s[STEP_HALTED] == 0.0;
    let applied = count_step(s, d.base_steps, wanted);
    s[STEP_FOUND_INF] = if found_inf { 1.0 } else { 0.0 };
    s[STEP_UNSCALE] = 0.0;
    s[STEP_CLIPPED] = 0.0;
    if let Some(r) = d.scaler {
        scaler_update(&r, s, found_inf, applied);
    }
    Ok(())
}

/// Twin of `unscale_by_f32`: `x *= 1 / scale`, the quotient taken in f64 and rounded to f32
/// (a grad scaler's `inv_scale`), each product rounded once; nothing when it is 1.
pub fn unscale_by(x: &mut [f32], scale: f64) {
    let f = (1.0 / scale) as f32;
    if f != 1.0 {
        x.iter_mut().for_each(|v| *v *= f);
    }
}

/// The SGD scalars of the optimizer step numbers `base_steps + 1 ..= base_steps +
/// STEP_CHOICES`, one of which a decision chooses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdChoice(pub [SgdScalars; STEP_CHOICES]);

/// Twin of `sgd_decided_f32`: nothing unless [`STEP_APPLIED`] is 1; else [`sgd`] with the
/// chosen scalar set on the gradient as the decision says (unscaled, then clipped, as
/// [`adamw_decided`]'s).
///
/// # Errors
/// As [`sgd`]; a scalar buffer shorter than [`STEP_SQUARES`].
pub fn sgd_decided(
    choice: &SgdChoice,
    scalars: &[f64],
    param: &mut [f32],
    grad: &[f32],
    momentum_buffer: &mut [f32],
) -> Result<(), KernelError> {
    check_scalars_len("sgd_decided", scalars.len(), 0)?;
    same_len("sgd_decided", "grad", param.len(), grad.len())?;
    let Some(s) = chosen(&choice.0, scalars) else {
        return Ok(());
    };
    let g = decided_grad(scalars, grad);
    sgd(s, param, &g, momentum_buffer)
}

/// The scalar set of `choices` that a decision in `scalars` chose ([`STEP_CHOICE`], the last
/// beyond them), or `None` when the step is not applied ([`STEP_APPLIED`]).
pub(crate) fn chosen<'a, T>(choices: &'a [T; STEP_CHOICES], scalars: &[f64]) -> Option<&'a T> {
    (scalars[STEP_APPLIED] == 1.0)
        .then(|| &choices[(scalars[STEP_CHOICE] as usize).min(STEP_CHOICES - 1)])
}

/// The factor of a gradient before clipping: [`STEP_UNSCALE`]'s, or `None` (0: no scaler).
pub(crate) fn unscale_of(scalars: &[f64]) -> Option<f32> {
    let u = scalars[STEP_UNSCALE];
    (u != 0.0).then_some(u as f32)
}

/// Twin of `adamw_decided_f32`: nothing unless [`STEP_APPLIED`] is 1; else
/// [`adamw`] with the chosen scalar set on the gradient, first unscaled (times
/// [`STEP_UNSCALE`] when a grad scaler set it, rounded to f32 as torch's `unscale_`), then
/// multiplied by the clipping coefficient when clipped (each element `c·g + 0`, as
/// `axpby(c, g, 0, 0)` rounds it).
///
/// # Errors
/// [`KernelError::Length`] if the slices differ in length; a scalar buffer shorter than
/// [`STEP_SQUARES`].
pub fn adamw_decided(
    choice: &AdamWChoice,
    scalars: &[f64],
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
) -> Result<(), KernelError> {
    check_scalars_len("adamw_decided", scalars.len(), 0)?;
    same_len("adamw_decided", "grad", param.len(), grad.len())?;
    let Some(s) = chosen(&choice.0, scalars) else {
        return Ok(());
    };
    let g = decided_grad(scalars, grad);
    adamw::<f32>(s, param, &g, exp_avg, exp_avg_sq)
}

/// The gradient AdamW reads as the decision says: times [`STEP_UNSCALE`] when set, then times
/// the clipping coefficient when clipped (`c·g + 0`).
pub(crate) fn decided_grad<'a>(scalars: &[f64], grad: &'a [f32]) -> std::borrow::Cow<'a, [f32]> {
    let unscale = unscale_of(scalars);
    let clip = (scalars[STEP_CLIPPED] == 1.0).then(|| scalars[STEP_CLIP_COEF] as f32);
    if unscale.is_none() && clip.is_none() {
        return std::borrow::Cow::Borrowed(grad);
    }
    let one = |g: f32| {
        let g = unscale.map_or(g, |u| g * u);
        clip.map_or(g, |c| c * g + 0.0)
    };
    std::borrow::Cow::Owned(grad.iter().map(|&g| one(g)).collect())
}

#[cfg(test)]
#[path = "step_tests.rs"]
mod tests;
