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

use super::norm::tree_sum_f64;
use super::{adamw, same_len, AdamWScalars, NORM_BLOCK};
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
/// The first gradient tensor's sum of squares; tensor `i`'s is at `STEP_SQUARES + i`.
pub const STEP_SQUARES: usize = 10;
/// How many AdamW scalar sets a decision chooses from: the host may enqueue a step while the
/// outcome of one earlier step is still unread.
pub const STEP_CHOICES: usize = 2;

/// The length of a step's scalar buffer for `tensors` gradient tensors.
pub const fn step_scalars_len(tensors: usize) -> usize {
    STEP_SQUARES + tensors
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
/// # Errors
/// [`KernelError::InvalidArgument`] for a scalar buffer shorter than the rule's tensors need.
pub fn step_decide(rule: &StepRule, scalars: &mut [f64]) -> Result<(), KernelError> {
    check_scalars_len("step_decide", scalars.len(), rule.tensors)?;
    let s = scalars;
    let sq = s[STEP_SQUARES..STEP_SQUARES + rule.tensors]
        .iter()
        .fold(0.0f64, |a, &b| a + b);
    let norm = sq.sqrt();
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
    let finite = (s[STEP_LOSS] as f32).is_finite() && norm.is_finite();
    if !finite {
        s[STEP_NONFINITE] += 1.0;
        if rule
            .skip_nonfinite
            .is_some_and(|k| s[STEP_NONFINITE] > k as f64)
        {
            s[STEP_HALTED] = 1.0;
        }
    }
    let choice = s[STEP_COUNT] - rule.base_steps as f64;
    let in_range = (0.0..STEP_CHOICES as f64).contains(&choice);
    s[STEP_FAULT] = if in_range { 0.0 } else { 1.0 };
    s[STEP_CHOICE] = if in_range { choice } else { 0.0 };
    let applied = finite && s[STEP_HALTED] == 0.0 && in_range;
    s[STEP_APPLIED] = if applied { 1.0 } else { 0.0 };
    if applied {
        s[STEP_COUNT] += 1.0;
    }
    Ok(())
}

/// Twin of `adamw_decided_f32`: nothing unless [`STEP_APPLIED`] is 1; else
/// [`adamw`] with the chosen scalar set on the gradient, first multiplied by the clipping
/// coefficient when clipped (each element `c·g + 0`, as `axpby(c, g, 0, 0)` rounds it).
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
    if scalars[STEP_APPLIED] != 1.0 {
        return Ok(());
    }
    let s = &choice.0[(scalars[STEP_CHOICE] as usize).min(STEP_CHOICES - 1)];
    if scalars[STEP_CLIPPED] == 1.0 {
        let c = scalars[STEP_CLIP_COEF] as f32;
        let clipped: Vec<f32> = grad.iter().map(|&g| c * g + 0.0).collect();
        adamw::<f32>(s, param, &clipped, exp_avg, exp_avg_sq)
    } else {
        adamw::<f32>(s, param, grad, exp_avg, exp_avg_sq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::AdamW;

    fn rule(tensors: usize, max_norm: Option<f64>, skip: Option<u64>, base: u64) -> StepRule {
        StepRule {
            tensors,
            max_norm,
            skip_nonfinite: skip,
            base_steps: base,
        }
    }

    /// The loss: the micro-batches' means, each over its count, added in f32 — for values
    /// exact in binary, the closed form.
    #[test]
    fn loss_accumulate_is_the_mean_over_micro_batches() {
        let mut s = vec![7.0; step_scalars_len(0)];
        loss_accumulate(&[1.0, 2.0, 3.0, 6.0], 2, true, &mut s).unwrap();
        assert_eq!(s[STEP_LOSS], 1.5);
        loss_accumulate(&vec![0.5; 1000], 2, false, &mut s).unwrap();
        assert_eq!(s[STEP_LOSS], 1.75);
        // Many values: within f32 rounding of the f64 mean.
        let l: Vec<f32> = (0..10_007).map(|i| (i % 97) as f32 * 0.013 + 1.0).collect();
        loss_accumulate(&l, 1, true, &mut s).unwrap();
        let mean = l.iter().map(|&x| f64::from(x)).sum::<f64>() / l.len() as f64;
        assert!(
            (s[STEP_LOSS] - mean).abs() <= mean * 1e-7,
            "{} vs {mean}",
            s[STEP_LOSS]
        );
        assert!(loss_accumulate(&[], 1, true, &mut s).is_err());
        assert!(loss_accumulate(&[1.0], 0, true, &mut s).is_err());
        assert!(loss_accumulate(&[1.0], 1, true, &mut [0.0; 3]).is_err());
    }

    /// The norm, the clipping coefficient (`torch.nn.utils.clip_grad_norm_`'s), the count.
    #[test]
    fn step_decide_takes_the_norm_clips_and_counts() {
        let mut s = vec![0.0; step_scalars_len(2)];
        s[STEP_LOSS] = 2.0;
        s[STEP_SQUARES] = 9.0;
        s[STEP_SQUARES + 1] = 16.0;
        step_decide(&rule(2, Some(1.0), None, 0), &mut s).unwrap();
        assert_eq!(s[STEP_GRAD_NORM], 5.0);
        assert_eq!(s[STEP_CLIPPED], 1.0);
        assert_eq!(s[STEP_CLIP_COEF], f64::from((1.0 / (5.0 + 1e-6)) as f32));
        assert_eq!(
            (s[STEP_APPLIED], s[STEP_CHOICE], s[STEP_COUNT]),
            (1.0, 0.0, 1.0)
        );
        // A norm below the limit is not clipped; the count goes on (base 0: choice 1).
        s[STEP_SQUARES] = 0.25;
        s[STEP_SQUARES + 1] = 0.0;
        step_decide(&rule(2, Some(1.0), None, 0), &mut s).unwrap();
        assert_eq!((s[STEP_GRAD_NORM], s[STEP_CLIPPED]), (0.5, 0.0));
        assert_eq!(
            (s[STEP_APPLIED], s[STEP_CHOICE], s[STEP_COUNT]),
            (1.0, 1.0, 2.0)
        );
        // A count the host offered no scalars for: a fault, nothing applied.
        step_decide(&rule(2, None, None, 0), &mut s).unwrap();
        assert_eq!(
            (s[STEP_FAULT], s[STEP_APPLIED], s[STEP_COUNT]),
            (1.0, 0.0, 2.0)
        );
        assert!(step_decide(&rule(3, None, None, 0), &mut s).is_err());
    }

    /// Non-finite losses and norms are skipped; past the limit the trainer halts and no later
    /// step applies, finite or not.
    #[test]
    fn step_decide_skips_then_halts() {
        let mut s = vec![0.0; step_scalars_len(1)];
        let mut decide = |loss: f64, sq: f64| {
            s[STEP_LOSS] = loss;
            s[STEP_SQUARES] = sq;
            let base = s[STEP_COUNT] as u64;
            step_decide(&rule(1, Some(1.0), Some(1), base), &mut s).unwrap();
            (
                s[STEP_APPLIED],
                s[STEP_NONFINITE],
                s[STEP_HALTED],
                s[STEP_CLIPPED],
            )
        };
        assert_eq!(decide(1.0, 0.25), (1.0, 0.0, 0.0, 0.0));
        assert_eq!(decide(f64::NAN, 4.0), (0.0, 1.0, 0.0, 1.0));
        assert_eq!(decide(1.0, 0.5), (1.0, 1.0, 0.0, 0.0));
        // An infinite norm: not finite, never clipped.
        assert_eq!(decide(1.0, f64::INFINITY), (0.0, 2.0, 1.0, 0.0));
        assert_eq!(decide(1.0, 0.5), (0.0, 2.0, 1.0, 0.0));
        assert_eq!(s[STEP_COUNT], 2.0);
    }

    /// AdamW as decided: nothing when not applied; the chosen scalar set; the clipped gradient
    /// as `axpby(c, g, 0, 0)` rounds it.
    #[test]
    fn adamw_decided_applies_the_chosen_step_to_the_clipped_gradient() {
        let cfg = AdamW {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let choice = AdamWChoice([
            AdamWScalars::new(&cfg, 1).unwrap(),
            AdamWScalars::new(&cfg, 2).unwrap(),
        ]);
        let g = vec![0.3f32, -2.0, 0.0, 5.5];
        let start = || {
            (
                vec![1.0f32, -1.0, 0.5, 2.0],
                vec![0.1f32; 4],
                vec![0.01f32; 4],
            )
        };
        let mut s = vec![0.0; step_scalars_len(0)];
        let (mut p, mut m, mut v) = start();
        adamw_decided(&choice, &s, &mut p, &g, &mut m, &mut v).unwrap();
        assert_eq!((p.clone(), m.clone(), v.clone()), start(), "not applied");
        s[STEP_APPLIED] = 1.0;
        s[STEP_CHOICE] = 1.0;
        s[STEP_CLIPPED] = 1.0;
        s[STEP_CLIP_COEF] = f64::from(0.25f32);
        adamw_decided(&choice, &s, &mut p, &g, &mut m, &mut v).unwrap();
        let (mut wp, mut wm, mut wv) = start();
        let mut clipped = vec![0.0f32; 4];
        crate::host::axpby(0.25f32, &g, 0.0, &mut clipped).unwrap();
        adamw::<f32>(&choice.0[1], &mut wp, &clipped, &mut wm, &mut wv).unwrap();
        assert_eq!((p, m, v), (wp, wm, wv));
    }
}
