//! Causal self-attention (nanoGPT's `CausalSelfAttention` after `c_attn`), forward and backward.

use super::matmul::{mat_mul, Mat};
use super::{check_len, Real};

/// Causal self-attention forward, as nanoGPT's `CausalSelfAttention` after `c_attn`.
///
/// `qkv: [b·t, 3e]` holds q, k, v side by side (each `[e]`), and head `h` uses columns
/// `h·d .. (h+1)·d` of each (`d = e / n_head`). Writes the attention probabilities
/// `att: [b, n_head, t, t]` (zero above the diagonal) and the heads' outputs re-assembled as
/// `y: [b·t, e]`. Scores are scaled by `1/√d`.
///
/// # Panics
/// If `e` is not divisible by `n_head` or a slice's length does not match the shapes.
pub fn attention_forward<T: Real>(
    qkv: &[T],
    b: usize,
    t: usize,
    n_head: usize,
    e: usize,
    att: &mut [T],
    y: &mut [T],
) {
    let heads = Heads::new(qkv, att, b, t, n_head, e);
    check_len("attention y", y, b * t * e);
    let (d, scale) = (heads.d, heads.scale::<T>());
    let tt = Mat::rm(0, t, t, t);
    for bi in 0..b {
        for h in 0..n_head {
            let [q, k, v] = heads.qkv(bi, h);
            let a_off = (bi * n_head + h) * t * t;
            let a = &mut att[a_off..a_off + t * t];
            // S = scale · Q·Kᵀ
            mat_mul(scale, qkv, q, qkv, k.t(), T::zero(), a, tt);
            for i in 0..t {
                let row = &mut a[i * t..(i + 1) * t];
                let mut mx = row[0];
                for &s in &row[1..=i] {
                    if s > mx {
                        mx = s;
                    }
                }
                let mut sum = T::zero();
                for s in &mut row[..=i] {
                    *s = (*s - mx).exp();
                    sum += *s;
                }
                let inv = T::one() / sum;
                for s in &mut row[..=i] {
                    *s = *s * inv;
                }
                for s in &mut row[i + 1..] {
                    *s = T::zero();
                }
            }
            // Y_h = P·V
            let yh = Mat::rm(bi * t * e + h * d, t, d, e);
            mat_mul(T::one(), a, tt, qkv, v, T::zero(), y, yh);
        }
    }
}

/// Causal self-attention backward: from `dy: [b·t, e]`, the saved `qkv` and `att` of
/// [`attention_forward`], accumulates `dqkv += ∂L/∂qkv` (`[b·t, 3e]`).
///
/// # Panics
/// If `e` is not divisible by `n_head` or a slice's length does not match the shapes.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Real>(
    qkv: &[T],
    att: &[T],
    dy: &[T],
    b: usize,
    t: usize,
    n_head: usize,
    e: usize,
    dqkv: &mut [T],
) {
    let heads = Heads::new(qkv, att, b, t, n_head, e);
    check_len("attention dy", dy, b * t * e);
    check_len("attention dqkv", dqkv, b * t * 3 * e);
    let (d, scale) = (heads.d, heads.scale::<T>());
    let mut ds = vec![T::zero(); t * t];
    let tt = Mat::rm(0, t, t, t);
    for bi in 0..b {
        for h in 0..n_head {
            let [q, k, v] = heads.qkv(bi, h);
            let a_off = (bi * n_head + h) * t * t;
            let a = &att[a_off..a_off + t * t];
            let dyh = Mat::rm(bi * t * e + h * d, t, d, e);
            // dP = dY·Vᵀ
            mat_mul(T::one(), dy, dyh, qkv, v.t(), T::zero(), &mut ds, tt);
            // dV += Pᵀ·dY
            mat_mul(T::one(), a, tt.t(), dy, dyh, T::one(), dqkv, v);
            // dS = P ⊙ (dP − rowsum(P ⊙ dP)), masked entries stay zero since P is zero there.
            for i in 0..t {
                let pr = &a[i * t..(i + 1) * t];
                let dr = &mut ds[i * t..(i + 1) * t];
                let mut dot = T::zero();
                for (&p, &g) in pr[..=i].iter().zip(&dr[..=i]) {
                    dot += p * g;
                }
                for (g, &p) in dr[..=i].iter_mut().zip(&pr[..=i]) {
                    *g = p * (*g - dot);
                }
                for g in &mut dr[i + 1..] {
                    *g = T::zero();
                }
            }
            // dQ += scale · dS·K
            mat_mul(scale, &ds, tt, qkv, k, T::one(), dqkv, q);
            // dK += scale · dSᵀ·Q
            mat_mul(scale, &ds, tt.t(), qkv, q, T::one(), dqkv, k);
        }
    }
}

/// The heads of `b` sequences of `t` tokens in `qkv: [b·t, 3e]`: their width `d = e / n_head`
/// and the views of each head's q, k and v.
struct Heads {
    t: usize,
    e: usize,
    d: usize,
}

impl Heads {
    /// Checks that `e` divides into `n_head` heads and the lengths of `qkv` and `att`.
    fn new<T: Real>(qkv: &[T], att: &[T], b: usize, t: usize, n_head: usize, e: usize) -> Self {
        assert!(
            n_head > 0 && e % n_head == 0,
            "attention: e = {e} is not divisible by n_head = {n_head}"
        );
        check_len("attention qkv", qkv, b * t * 3 * e);
        check_len("attention att", att, b * n_head * t * t);
        Heads {
            t,
            e,
            d: e / n_head,
        }
    }

    /// The scores' scale `1/√d`.
    fn scale<T: Real>(&self) -> T {
        T::one() / T::from_f64(self.d as f64).sqrt()
    }

    /// The `[t, d]` views of head `h`'s q, k and v in sequence `bi`.
    fn qkv(&self, bi: usize, h: usize) -> [Mat; 3] {
        let (t, e, d) = (self.t, self.e, self.d);
        let base = bi * t * 3 * e + h * d;
        [0, e, 2 * e].map(|off| Mat::rm(base + off, t, d, 3 * e))
    }
}
