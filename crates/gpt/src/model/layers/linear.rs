//! The linear layer (`nn.Linear`), forward and backward.

use super::matmul::gemm;
use super::{check_len, Real};

/// Linear layer forward, `y = x·Wᵀ + b`, with `x: [n, in_f]`, `w: [out_f, in_f]`,
/// `b: [out_f]`, `y: [n, out_f]` (overwritten).
///
/// # Panics
/// If a slice's length does not match the shapes.
pub fn linear_forward<T: Real>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    n: usize,
    in_f: usize,
    out_f: usize,
    y: &mut [T],
) {
    check_len("linear y", y, n * out_f);
    let beta = match b {
        Some(b) => {
            check_len("linear bias", b, out_f);
            for row in y.chunks_exact_mut(out_f) {
                row.copy_from_slice(b);
            }
            T::one()
        }
        None => T::zero(),
    };
    gemm(n, out_f, in_f, T::one(), x, false, w, true, beta, y);
}

/// Linear backward, input part: `dx += dy·W` (`dy: [n, out_f]`, `w: [out_f, in_f]`).
///
/// # Panics
/// If a slice's length does not match the shapes.
pub fn linear_backward_input<T: Real>(
    dy: &[T],
    w: &[T],
    n: usize,
    in_f: usize,
    out_f: usize,
    dx: &mut [T],
) {
    gemm(n, in_f, out_f, T::one(), dy, false, w, false, T::one(), dx);
}

/// Linear backward, weight part: `dw += dyᵀ·x` (`dw: [out_f, in_f]`).
///
/// # Panics
/// If a slice's length does not match the shapes.
pub fn linear_backward_weight<T: Real>(
    dy: &[T],
    x: &[T],
    n: usize,
    in_f: usize,
    out_f: usize,
    dw: &mut [T],
) {
    gemm(out_f, in_f, n, T::one(), dy, true, x, false, T::one(), dw);
}

/// Linear backward, bias part: `db += Σ_rows dy`.
///
/// # Panics
/// If a slice's length does not match the shapes.
pub fn linear_backward_bias<T: Real>(dy: &[T], n: usize, out_f: usize, db: &mut [T]) {
    check_len("linear dy", dy, n * out_f);
    check_len("linear db", db, out_f);
    for row in dy.chunks_exact(out_f) {
        for (d, &g) in db.iter_mut().zip(row) {
            *d += g;
        }
    }
}
