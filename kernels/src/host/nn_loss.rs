//! Twin of `cu/nn.cu`'s cross-entropy fused with its backward (the GPT's loss over the tied
//! head's logits), row reductions as [`nn`](super::nn)'s blocks.

use super::nn::{add, block_reduce, rows_of};
use super::nn_math::{exp, ln, max_of};
use super::same_len;
use crate::KernelError;

/// The shapes of the fused cross-entropy (twin and launch), by their lengths: `logits` and
/// `dlogits` whole rows of `v`, `targets` and `losses` one per row. Returns the rows.
pub(crate) fn check_cross_entropy(
    k: &'static str,
    logits: usize,
    v: usize,
    targets: usize,
    losses: usize,
    dlogits: usize,
) -> Result<usize, KernelError> {
    let n = rows_of(k, "logits", logits, v)?;
    same_len(k, "targets", n, targets)?;
    same_len(k, "losses", n, losses)?;
    same_len(k, "dlogits", logits, dlogits)?;
    Ok(n)
}

/// Cross-entropy over rows of `logits: [n, v]` (`n = targets.len()`) fused with its backward.
/// Writes the per-row `losses[r] = ln Σ_j e^(l_j − max) + (max − l_target)` (the mean over
/// rows is the caller's) and `dlogits = dloss·(softmax(l) − onehot(target))` (**writes**;
/// `dloss` is `∂L/∂losses[r]`, e.g. `1/n` for a mean). A target `≥ v` gives a NaN loss and a
/// NaN row of `dlogits`, as the kernel (which cannot report errors); check targets first.
///
/// # Errors
/// [`KernelError::Length`] / [`KernelError::InvalidArgument`] for mismatched shapes.
pub fn cross_entropy_fused(
    logits: &[f32],
    targets: &[u32],
    v: usize,
    dloss: f32,
    losses: &mut [f32],
    dlogits: &mut [f32],
) -> Result<(), KernelError> {
    let k = "cross_entropy_fused_f32";
    let n = check_cross_entropy(
        k,
        logits.len(),
        v,
        targets.len(),
        losses.len(),
        dlogits.len(),
    )?;
    for r in 0..n {
        let l = &logits[r * v..(r + 1) * v];
        let row = CrossEntropyRow::of(l, targets[r] as usize);
        for (j, d) in dlogits[r * v..(r + 1) * v].iter_mut().enumerate() {
            *d = row.grad(l[j], j, dloss);
        }
        losses[r] = row.loss;
    }
    Ok(())
}

/// [`cross_entropy_fused`] with `dlogits` written over `logits` (the head's working memory
/// held once, as the model's step does): the same values, each row's loss taken before its
/// logits are overwritten.
///
/// # Errors
/// As [`cross_entropy_fused`].
pub fn cross_entropy_fused_in_place(
    logits: &mut [f32],
    targets: &[u32],
    v: usize,
    dloss: f32,
    losses: &mut [f32],
) -> Result<(), KernelError> {
    let k = "cross_entropy_fused_f32";
    let len = logits.len();
    let n = check_cross_entropy(k, len, v, targets.len(), losses.len(), len)?;
    for r in 0..n {
        let l = &mut logits[r * v..(r + 1) * v];
        let row = CrossEntropyRow::of(l, targets[r] as usize);
        for (j, x) in l.iter_mut().enumerate() {
            *x = row.grad(*x, j, dloss);
        }
        losses[r] = row.loss;
    }
    Ok(())
}

/// One row of the fused cross-entropy: the kernel's max and sum of `e^(l_j − max)`, and the
/// row's loss.
struct CrossEntropyRow {
    mx: f32,
    sum: f32,
    target: usize,
    ok: bool,
    loss: f32,
}

impl CrossEntropyRow {
    fn of(l: &[f32], target: usize) -> CrossEntropyRow {
        let v = l.len();
        let mx = block_reduce(v, f32::NEG_INFINITY, |j| l[j], max_of);
        let sum = block_reduce(v, 0.0, |j| exp(l[j] - mx), add);
        let ok = target < v;
        let loss = if ok {
            ln(sum) + (mx - l[target])
        } else {
            f32::NAN
        };
        CrossEntropyRow {
            mx,
            sum,
            target,
            ok,
            loss,
        }
    }

    /// `dloss·(softmax(l)_j − [j = target])` of the logit `x` in column `j`.
    fn grad(&self, x: f32, j: usize, dloss: f32) -> f32 {
        if self.ok {
            let q = exp(x - self.mx) / self.sum;
            dloss * (q - if j == self.target { 1.0 } else { 0.0 })
        } else {
            f32::NAN
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cross_entropy_in_place_gives_the_same_bits() {
        let (n, v) = (5, 300);
        let logits: Vec<f32> = (0..n * v)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.03)
            .collect();
        let targets = [0u32, 299, 17, 300, 150]; // 300: out of range, a NaN row
        let (mut losses, mut d) = (vec![0.0; n], vec![0.0; n * v]);
        cross_entropy_fused(&logits, &targets, v, 0.2, &mut losses, &mut d).unwrap();
        let (mut in_place, mut l2) = (logits.clone(), vec![0.0; n]);
        cross_entropy_fused_in_place(&mut in_place, &targets, v, 0.2, &mut l2).unwrap();
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&l2), bits(&losses));
        assert_eq!(bits(&in_place), bits(&d));
        assert!(losses[3].is_nan() && losses[..3].iter().all(|l| l.is_finite()));
        assert!(cross_entropy_fused_in_place(&mut in_place, &targets, 7, 0.2, &mut l2).is_err());
    }
}
