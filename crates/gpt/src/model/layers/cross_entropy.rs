//! Cross-entropy over class indices (`F.cross_entropy`), forward and backward.

use super::{check_len, Real};

/// Cross-entropy forward over `n` rows of `logits: [n, v]` with class indices `targets: [n]`.
/// Writes the softmax probabilities into `probs: [n, v]` (kept for backward) and returns the
/// **sum** of the per-row losses `logsumexp(row) − row[target]`, accumulated in `f64`.
///
/// # Panics
/// If a slice's length does not match the shapes or a target is not below `v`.
pub fn cross_entropy_forward<T: Real>(
    logits: &[T],
    targets: &[u32],
    n: usize,
    v: usize,
    probs: &mut [T],
) -> f64 {
    check_len("cross-entropy logits", logits, n * v);
    check_len("cross-entropy targets", targets, n);
    check_len("cross-entropy probs", probs, n * v);
    let mut total = 0.0f64;
    for ((lr, pr), &tg) in logits
        .chunks_exact(v)
        .zip(probs.chunks_exact_mut(v))
        .zip(targets)
    {
        let tg = tg as usize;
        assert!(tg < v, "cross-entropy: target {tg} is not below {v}");
        let mut mx = lr[0];
        for &l in &lr[1..] {
            if l > mx {
                mx = l;
            }
        }
        let mut sum = T::zero();
        for (p, &l) in pr.iter_mut().zip(lr) {
            *p = (l - mx).exp();
            sum += *p;
        }
        let inv = T::one() / sum;
        for p in pr.iter_mut() {
            *p = *p * inv;
        }
        total += sum.to_f64().ln() + (mx - lr[tg]).to_f64();
    }
    total
}

/// Cross-entropy backward: `dlogits += scale·(probs − onehot(targets))`; `scale` is
/// `∂L/∂(sum of row losses)`, e.g. `1/N` for a mean over `N` tokens.
///
/// # Panics
/// If a slice's length does not match the shapes or a target is not below `v`.
pub fn cross_entropy_backward<T: Real>(
    probs: &[T],
    targets: &[u32],
    n: usize,
    v: usize,
    scale: T,
    dlogits: &mut [T],
) {
    check_len("cross-entropy probs", probs, n * v);
    check_len("cross-entropy targets", targets, n);
    check_len("cross-entropy dlogits", dlogits, n * v);
    for ((pr, dr), &tg) in probs
        .chunks_exact(v)
        .zip(dlogits.chunks_exact_mut(v))
        .zip(targets)
    {
        let tg = tg as usize;
        assert!(tg < v, "cross-entropy: target {tg} is not below {v}");
        for (d, &p) in dr.iter_mut().zip(pr) {
            *d += scale * p;
        }
        dr[tg] += -scale;
    }
}
