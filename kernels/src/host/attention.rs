//! Twins of `cu/attention.cu`: causal self-attention fused into one pass over each
//! (sequence, head) pair (flash attention), no `t × t` matrix kept. `q`, `k` and `v` are the
//! products' operands (their values already rounded to the operands' type `H`), `[pairs, t,
//! d]`; everything is computed in f32 and the probabilities `P` and the scores' gradient `dS`
//! are rounded to `H` where a product reads them, as the kernels' tensor-core products do.
//!
//! The kernels agree with these twins within the rounding of f32 sums taken in another order
//! (the tensor cores', and flash attention's running maximum, by which the kernels scale the
//! probabilities before rounding them), not bitwise: `tests/gpu_attention.rs` states the
//! bounds.
//!
//! Scores are taken in base 2, as the kernels take them: `s2 = (q·k)·scale2` with
//! `scale2 = scale·log₂e`, so that `P = 2^(s2 − lse2)` with `lse2 = m + log₂ Σ 2^(s2 − m)`.

use super::{same_len, CastFloat};
use crate::host::nn::HeadsLayout;
use crate::KernelError;

/// The shape of one fused attention: `pairs` (sequence, head) pairs of `t` tokens, `d` values
/// a head, and the scores' scale (`1/√d` for a GPT).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FusedAttention {
    /// (sequence, head) pairs.
    pub pairs: usize,
    /// Tokens per sequence.
    pub t: usize,
    /// Values per head.
    pub d: usize,
    /// The scores' scale.
    pub scale: f32,
}

impl FusedAttention {
    /// The attention of the heads `layout` describes (`b·h` pairs of `t` tokens and `d`
    /// values) with the scale `scale`.
    pub fn of(layout: &HeadsLayout, scale: f32) -> FusedAttention {
        FusedAttention {
            pairs: layout.b * layout.h,
            t: layout.t,
            d: layout.d,
            scale,
        }
    }

    /// The scale of the base-2 scores: `scale·log₂e` rounded to f32 (the kernels' argument).
    pub fn scale2(&self) -> f32 {
        self.scale * std::f32::consts::LOG2_E
    }

    /// Elements of `q`, `k`, `v`, `y` and the gradients: `pairs·t·d`.
    pub fn len(&self) -> usize {
        self.pairs * self.t * self.d
    }

    /// Whether there is nothing to attend to (no pair or no token).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows, `pairs·t`: the elements of `lse` and of backward's row sums.
    pub fn rows(&self) -> usize {
        self.pairs * self.t
    }

    fn check(
        &self,
        kernel: &'static str,
        tensors: &[(&'static str, usize)],
    ) -> Result<(), KernelError> {
        if self.d == 0 && self.pairs * self.t > 0 {
            return Err(KernelError::InvalidArgument {
                kernel,
                reason: "heads of 0 values".into(),
            });
        }
        for &(what, len) in tensors {
            let expected = if what == "lse" || what == "dsum" {
                self.rows()
            } else {
                self.len()
            };
            same_len(kernel, what, expected, len)?;
        }
        Ok(())
    }
}

/// `Σ_k a_k·b_k` of two rows of `d` values in f32, in order.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |acc, (x, y)| acc + x * y)
}

/// A value rounded to `H` and widened back (the identity for f32).
fn round<H: CastFloat>(x: f32) -> f32 {
    H::store(x).load()
}

/// Forward (**writes** `y` and `lse`): for each pair and row `i`,
/// `y_i = (Σ_{j≤i} H(2^(s2_j − m))·v_j) · (1/l)` with `s2_j = (q_i·k_j)·scale2`,
/// `m = max_{j≤i} s2_j` and `l = Σ_{j≤i} 2^(s2_j − m)` (unrounded), and
/// `lse_i = m + log₂ l`, every sum in f32 and in order.
///
/// # Errors
/// [`KernelError::Length`] for a tensor of another length than `a` gives.
pub fn flash_forward<H: CastFloat>(
    a: &FusedAttention,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    y: &mut [f32],
    lse: &mut [f32],
) -> Result<(), KernelError> {
    let kernel = "flash_forward";
    a.check(
        kernel,
        &[
            ("q", q.len()),
            ("k", k.len()),
            ("v", v.len()),
            ("y", y.len()),
            ("lse", lse.len()),
        ],
    )?;
    let (t, d, scale2) = (a.t, a.d, a.scale2());
    let mut s = vec![0.0f32; t];
    for p in 0..a.pairs {
        let base = p * t * d;
        let at = |i: usize| base + i * d..base + (i + 1) * d;
        for i in 0..t {
            let qi = &q[at(i)];
            let mut m = f32::NEG_INFINITY;
            for (j, sj) in s.iter_mut().enumerate().take(i + 1) {
                *sj = dot(qi, &k[at(j)]) * scale2;
                m = m.max(*sj);
            }
            let mut l = 0.0f32;
            let yi = &mut y[at(i)];
            yi.fill(0.0);
            for (j, &sj) in s.iter().enumerate().take(i + 1) {
                let e = (sj - m).exp2();
                l += e;
                let pe = round::<H>(e);
                for (yv, vv) in yi.iter_mut().zip(&v[at(j)]) {
                    *yv += pe * vv;
                }
            }
            let inv = 1.0 / l;
            for yv in yi.iter_mut() {
                *yv *= inv;
            }
            lse[p * t + i] = m + l.log2();
        }
    }
    Ok(())
}

/// Backward's first pass (**writes** `dsum`): `dsum_i = Σ_d dO_id·y_id` for each pair's row
/// `i`, with `dout` `[pairs, t, d]` and `y` forward's output in token rows as `layout`
/// places its heads (the projection's operand), each sum in f32 and in order.
///
/// # Errors
/// [`KernelError::Length`] for tensors of other lengths than `layout` gives;
/// [`KernelError::InvalidArgument`] for heads that do not fit their rows.
pub fn flash_backward_dot(
    layout: &HeadsLayout,
    dout: &[f32],
    y: &[f32],
    dsum: &mut [f32],
) -> Result<(), KernelError> {
    let kernel = "flash_backward_dot";
    layout.check(kernel, y.len(), dout.len())?;
    same_len(kernel, "dsum", layout.b * layout.h * layout.t, dsum.len())?;
    let (t, h, d) = (layout.t, layout.h, layout.d);
    for (r, out) in dsum.iter_mut().enumerate() {
        let (pair, i) = (r / t, r % t);
        let (b, hh) = (pair / h, pair % h);
        let at = (b * t + i) * layout.row + layout.offset + hh * d;
        *out = dot(&dout[r * d..(r + 1) * d], &y[at..at + d]);
    }
    Ok(())
}

/// Backward (**writes** `dq`, `dk`, `dv`) from the heads' output gradient `dout` (`[pairs, t,
/// d]`), forward's `lse` and [`flash_backward_dot`]'s `dsum`: for `j ≤ i`,
/// `P_ij = 2^((q_i·k_j)·scale2 − lse_i)`, `dP_ij = dO_i·v_j` and
/// `dS_ij = (P_ij·(dP_ij − dsum_i))·scale`; then `dv_j = Σ_i H(P_ij)·dO_i`,
/// `dq_i = Σ_j H(dS_ij)·k_j` and `dk_j = Σ_i H(dS_ij)·q_i`, in f32 and in order of `i` and `j`.
///
/// # Errors
/// As [`flash_forward`].
#[allow(clippy::too_many_arguments)]
pub fn flash_backward<H: CastFloat>(
    a: &FusedAttention,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    lse: &[f32],
    dsum: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) -> Result<(), KernelError> {
    let kernel = "flash_backward";
    a.check(
        kernel,
        &[
            ("q", q.len()),
            ("k", k.len()),
            ("v", v.len()),
            ("dout", dout.len()),
            ("lse", lse.len()),
            ("dsum", dsum.len()),
            ("dq", dq.len()),
            ("dk", dk.len()),
            ("dv", dv.len()),
        ],
    )?;
    let (t, d, scale, scale2) = (a.t, a.d, a.scale, a.scale2());
    dq.fill(0.0);
    dk.fill(0.0);
    dv.fill(0.0);
    for p in 0..a.pairs {
        let base = p * t * d;
        let at = |i: usize| base + i * d..base + (i + 1) * d;
        for i in 0..t {
            let (l, ds_i) = (lse[p * t + i], dsum[p * t + i]);
            for j in 0..=i {
                let pij = (dot(&q[at(i)], &k[at(j)]) * scale2 - l).exp2();
                let dp = dot(&dout[at(i)], &v[at(j)]);
                let ds = round::<H>((pij * (dp - ds_i)) * scale);
                let pr = round::<H>(pij);
                for x in 0..d {
                    dv[base + j * d + x] += pr * dout[base + i * d + x];
                    dq[base + i * d + x] += ds * k[base + j * d + x];
                    dk[base + j * d + x] += ds * q[base + i * d + x];
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;
