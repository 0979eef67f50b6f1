//! Matrix products on the host for [`HostOps`](super::HostOps): f32 left to right
//! ([`gemm_f32`]), accumulated in f64 and rounded once ([`gemm_f64_rounded`]), or of operands
//! rounded to bf16 or f16 ([`gemm_bf16_operands`], [`gemm_half_operands`]).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::memory::{bytes_of, Counted, MemoryCounter, Stamp};
use crate::gemm::MatMul;
use fsdp_device::DType;

use crate::host::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::KernelError;

/// How [`HostOps`](super::HostOps) multiplies matrices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostProducts {
    /// [`gemm_f32`]: f32, left to right (the default).
    #[default]
    F32,
    /// [`gemm_f64_rounded`]: accumulated in f64, rounded once.
    F64Rounded,
    /// [`gemm_bf16_operands`](super::gemm_bf16_operands): both operands rounded to bf16 (as
    /// the cast kernel rounds), products summed in f32 ([`gemm_f32`]'s order) — what
    /// [`CudaOps`](super::CudaOps) with
    /// [`Products::Bf16`](super::Products::Bf16) computes, in another summation order.
    Bf16Operands,
    /// [`gemm_half_operands`](super::gemm_half_operands) in f16: both operands rounded to f16
    /// (an operand past f16's range becomes infinite, as on the device: what a grad scaler's
    /// overflow check catches), products summed in f32 — [`Products::F16`](super::Products::F16)'s
    /// twin.
    F16Operands,
}

impl HostProducts {
    /// The dtype products round their operands to: bf16, f16, or `None` (f32 operands).
    pub fn half(self) -> Option<DType> {
        match self {
            HostProducts::Bf16Operands => Some(DType::BF16),
            HostProducts::F16Operands => Some(DType::F16),
            HostProducts::F32 | HostProducts::F64Rounded => None,
        }
    }
}

/// `c[i, j]` of every batch from `dot(a, b, i, j)`, the product's `k` terms in order.
fn each(
    g: &MatMul,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    dot: impl Fn(&mut dyn Iterator<Item = (f32, f32)>) -> f32,
) {
    let (a, b) = (&a[g.offset_a..], &b[g.offset_b..]);
    let c = &mut c[g.offset_c..];
    for t in 0..g.batch {
        let (a, b) = (&a[t * g.stride_a..], &b[t * g.stride_b..]);
        let c = &mut c[t * g.stride_c..];
        for i in 0..g.m {
            for j in 0..g.n {
                let mut terms = (0..g.k).map(|p| {
                    let x = if g.trans_a {
                        a[p * g.m + i]
                    } else {
                        a[i * g.k + p]
                    };
                    let y = if g.trans_b {
                        b[j * g.k + p]
                    } else {
                        b[p * g.n + j]
                    };
                    (x, y)
                });
                let acc = dot(&mut terms);
                let o = &mut c[i * g.n + j];
                *o = if g.beta == 0.0 {
                    g.alpha * acc
                } else {
                    g.alpha * acc + g.beta * *o
                };
            }
        }
    }
}

/// The row-major product `g` in f32 on the host: for each batch, row `i` and column `j` in
/// order, `acc` starts at 0 and adds `op(a)[i, p]·op(b)[p, j]` for `p = 0, 1, …, k−1`, each
/// product and sum rounded to f32 (no fused multiply-add); then `c = alpha·acc` when
/// `beta == 0` (c's old value, even NaN, ignored, as BLAS), else `alpha·acc + beta·c`. Not
/// cuBLAS's order: the two agree within f32 rounding of a `k`-term sum, not bitwise.
///
/// # Errors
/// [`KernelError::Length`] for an operand shorter than [`MatMul::extents`];
/// [`KernelError::InvalidArgument`] for batches of `c` that overlap.
pub fn gemm_f32(g: &MatMul, a: &[f32], b: &[f32], c: &mut [f32]) -> Result<(), KernelError> {
    g.check_operands(a.len(), b.len(), c.len())?;
    each(g, a, b, c, |terms| {
        terms.fold(0.0f32, |acc, (x, y)| acc + x * y)
    });
    Ok(())
}

/// [`gemm_f32`] with each dot product accumulated in f64 (exact products, f64 sums) and
/// rounded to f32 once: within about one f32 rounding of the exact product, so that
/// [`gemm_f32`] against it shows what the products' rounding alone does to a model (the
/// difference cuBLAS's own summation order makes is of the same kind).
///
/// # Errors
/// As [`gemm_f32`].
pub fn gemm_f64_rounded(
    g: &MatMul,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
) -> Result<(), KernelError> {
    g.check_operands(a.len(), b.len(), c.len())?;
    each(g, a, b, c, |terms| {
        terms.fold(0.0f64, |acc, (x, y)| acc + f64::from(x) * f64::from(y)) as f32
    });
    Ok(())
}

/// [`gemm_f32`] of the operands rounded to bf16 (round to nearest even, as the cast kernel):
/// the host twin of mixed-precision products (bf16 operands, f32 sums and output). cuBLAS
/// multiplies the same rounded values, so the two differ only by the f32 summation order.
///
/// # Errors
/// As [`gemm_f32`].
pub fn gemm_bf16_operands(
    g: &MatMul,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
) -> Result<(), KernelError> {
    gemm_half_operands(DType::BF16, g, a, b, c)
}

/// [`gemm_f32`] of the operands rounded to `half` (bf16 or f16; round to nearest even, as the
/// cast kernel; an f16 rounding past f16's range is infinite): the twin of
/// [`Products::Bf16`](super::Products::Bf16) and [`Products::F16`](super::Products::F16).
///
/// # Errors
/// As [`gemm_f32`]; a `half` that is not bf16 or f16.
pub fn gemm_half_operands(
    half: DType,
    g: &MatMul,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
) -> Result<(), KernelError> {
    if !matches!(half, DType::BF16 | DType::F16) {
        return Err(KernelError::InvalidArgument {
            kernel: "gemm_half_operands",
            reason: format!("operands rounded to {half}: bf16 or f16"),
        });
    }
    // gemm_f32 checks the lengths (the rounded copies keep them).
    gemm_f32(g, &rounded_to(half, a), &rounded_to(half, b), c)
}

/// `x` rounded to `half` (f16, else bf16; round to nearest even, as the cast kernel), widened
/// back to f32.
pub(super) fn round_half(half: DType, x: f32) -> f32 {
    match half {
        DType::F16 => f16_to_f32(f32_to_f16(x)),
        _ => bf16_to_f32(f32_to_bf16(x)),
    }
}

/// Every value of `v` rounded to `half` ([`round_half`]).
pub(super) fn rounded_to(half: DType, v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| round_half(half, x)).collect()
}

/// A kept bf16 copy of one operand position of the products (grown to the largest operand
/// it is given, the short copy freed first) and the operand it was last rounded from, by
/// [`Stamp`] and element range (a product may read part of a buffer: [`MatMul::at`]): a
/// product whose operand in that position is the same part of the same buffer, unwritten
/// since, uses the copy as it is (the backward's `dY` of a linear layer, the attention's `dS`
/// and the head's `dlogits` each feed two products in a row).
#[derive(Debug)]
pub(super) struct Kept<T> {
    /// The copy.
    pub(super) copy: Option<Counted<T>>,
    /// What the copy's front holds, rounded: the source and its element range.
    holds: Option<(Stamp, usize, usize)>,
}

impl<T> Default for Kept<T> {
    fn default() -> Kept<T> {
        Kept {
            copy: None,
            holds: None,
        }
    }
}

impl<T> Kept<T> {
    /// Makes the copy's first `range.len()` elements the operand of stamp `src` over `range`,
    /// rounded: nothing when it holds them already; else a copy shorter than that (`len`) is
    /// freed first and `alloc(n)` takes its place, and `round` writes it. Returns whether it
    /// rounded. The one policy of [`CudaOps`](super::CudaOps) and of its host twin, whose
    /// memory counts agree.
    ///
    /// # Errors
    /// Those of `alloc` and `round` (the copy then holds nothing).
    pub(super) fn refill<E>(
        &mut self,
        src: Stamp,
        range: std::ops::Range<usize>,
        len: impl Fn(&T) -> usize,
        alloc: impl FnOnce(usize) -> Result<Counted<T>, E>,
        round: impl FnOnce(&mut Counted<T>) -> Result<(), E>,
    ) -> Result<bool, E> {
        let n = range.len();
        let key = (src, range.start, n);
        if self.copy.is_some() && self.holds == Some(key) {
            return Ok(false);
        }
        self.holds = None;
        let copy = match self.copy.take() {
            Some(k) if len(&k) >= n => self.copy.insert(k),
            old => {
                drop(old); // free the short copy before allocating the larger one
                self.copy.insert(alloc(n)?)
            }
        };
        round(copy)?;
        self.holds = Some(key);
        Ok(true)
    }
}

/// `src[range]` rounded to `half` into the front of `kept` ([`Kept::refill`]), counted in
/// `memory` at 2 bytes an element: [`HostOps`](super::HostOps)' kept operand copies of bf16
/// or f16 products. Each rounding is counted in `roundings`.
pub(super) fn round_into<'a>(
    half: DType,
    memory: &Arc<MemoryCounter>,
    kept: &'a mut Kept<Vec<f32>>,
    src: &Counted<Vec<f32>>,
    range: std::ops::Range<usize>,
    roundings: &AtomicU64,
) -> &'a [f32] {
    let n = range.len();
    let part = &src[range.clone()];
    let rounded = kept.refill(
        src.stamp(),
        range,
        Vec::len,
        |n| Ok::<_, Infallible>(Counted::new(vec![0.0; n], bytes_of::<u16>(n), memory)),
        |copy| {
            for (d, &x) in copy.iter_mut().zip(part.iter()) {
                *d = round_half(half, x);
            }
            Ok(())
        },
    );
    if rounded.unwrap_or_else(|never| match never {}) {
        roundings.fetch_add(1, Ordering::Relaxed);
    }
    match &kept.copy {
        Some(copy) => &copy[..n],
        None => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_product_is_the_row_major_definition() {
        let vals = |n: usize, s: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 37 + s * 11) % 23) as f32 / 8.0 - 1.4)
                .collect()
        };
        for trans_a in [false, true] {
            for trans_b in [false, true] {
                for (batch, beta, (oa, ob, oc)) in [
                    (1, 0.0, (0, 0, 0)),
                    (3, 1.0, (2, 3, 1)),
                    (2, 0.5, (0, 5, 0)),
                ] {
                    let (m, n, k) = (3, 5, 7);
                    let g = MatMul::new(m, n, k, trans_a, trans_b)
                        .batched(batch, m * k + 1, k * n + 2, m * n + 3)
                        .at(oa, ob, oc)
                        .with_alpha(0.75)
                        .with_beta(beta);
                    let (ea, eb, ec) = g.extents();
                    let (a, b, c0) = (vals(ea, 1), vals(eb, 2), vals(ec, 3));
                    let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
                    let mut want = wide(&c0);
                    g.host(&wide(&a), &wide(&b), &mut want);
                    for f in [gemm_f32, gemm_f64_rounded] {
                        let mut got = c0.clone();
                        f(&g, &a, &b, &mut got).unwrap();
                        for (x, w) in got.iter().zip(&want) {
                            let err = (f64::from(*x) - w).abs();
                            assert!(err <= 1e-5 * (1.0 + w.abs()), "{g:?}");
                        }
                    }
                }
            }
        }
        let g = MatMul::new(2, 2, 2, false, false);
        assert!(gemm_f32(&g, &[0.0; 3], &[0.0; 4], &mut [0.0; 4]).is_err());
        // An offset past what the buffer holds.
        let off = g.at(0, 1, 0);
        assert!(gemm_f32(&off, &[0.0; 4], &[0.0; 4], &mut [0.0; 4]).is_err());
        assert!(gemm_f32(&off, &[0.0; 4], &[0.0; 5], &mut [0.0; 4]).is_ok());
        let overlapping = g.batched(2, 4, 4, 3);
        let e = gemm_f64_rounded(&overlapping, &[0.0; 8], &[0.0; 8], &mut [0.0; 8]);
        assert!(e.unwrap_err().to_string().contains("overlap"));
    }

    #[test]
    fn bf16_operands_are_rounded_before_the_product() {
        // 1 + 2^-9 rounds to 1 in bf16 (8 significant bits); 3 is exact.
        let g = MatMul::new(1, 1, 2, false, false);
        let (a, b) = ([1.0 + 2f32.powi(-9), 3.0], [1.0f32, 1.0 + 2f32.powi(-6)]);
        let mut c = [0.0f32];
        gemm_bf16_operands(&g, &a, &b, &mut c).unwrap();
        assert_eq!(c[0], 1.0 + 3.0 * (1.0 + 2f32.powi(-6)));
        gemm_f32(&g, &a, &b, &mut c).unwrap();
        assert_ne!(c[0], 1.0 + 3.0 * (1.0 + 2f32.powi(-6)));
    }

    /// f16 keeps 11 significant bits (1 + 2^-9 survives, 1 + 2^-12 does not) and overflows
    /// past 65504 (an infinite operand, what a grad scaler catches); bf16 keeps f32's range.
    #[test]
    fn f16_operands_are_rounded_and_overflow() {
        let g = MatMul::new(1, 1, 2, false, false);
        let (a, b) = ([1.0 + 2f32.powi(-9), 1.0 + 2f32.powi(-12)], [1.0f32, 1.0]);
        let mut c = [0.0f32];
        gemm_half_operands(DType::F16, &g, &a, &b, &mut c).unwrap();
        assert_eq!(c[0], 2.0 + 2f32.powi(-9));
        let big = [70_000.0f32, 0.0];
        gemm_half_operands(DType::F16, &g, &big, &b, &mut c).unwrap();
        assert_eq!(c[0], f32::INFINITY);
        gemm_half_operands(DType::BF16, &g, &big, &b, &mut c).unwrap();
        assert_eq!(c[0], 70_144.0, "70000 in bf16");
        let e = gemm_half_operands(DType::F32, &g, &a, &b, &mut c).unwrap_err();
        assert!(e.to_string().contains("bf16 or f16"), "{e}");
    }
}
