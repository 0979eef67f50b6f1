//! LayerNorm over the last dimension (`nn.LayerNorm`), forward and backward.

use super::{check_len, Real};

/// LayerNorm forward over the last dimension (`x, y: [n, e]`, biased variance):
/// `y = (x − mean)·rstd·w + b` with `rstd = 1/√(var + eps)`. Writes `y`, and `mean`, `rstd`
/// (`[n]`, kept for backward).
///
/// # Panics
/// If a slice's length does not match the shapes.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<T: Real>(
    x: &[T],
    w: &[T],
    b: &[T],
    n: usize,
    e: usize,
    eps: T,
    y: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
) {
    check_rows(x, mean, rstd, n, e);
    check_len("layernorm y", y, n * e);
    check_len("layernorm w", w, e);
    check_len("layernorm b", b, e);
    let inv_e = T::one() / T::from_f64(e as f64);
    for (r, (xr, yr)) in x.chunks_exact(e).zip(y.chunks_exact_mut(e)).enumerate() {
        let mut s = T::zero();
        for &v in xr {
            s += v;
        }
        let m = s * inv_e;
        let mut var = T::zero();
        for &v in xr {
            let d = v - m;
            var += d * d;
        }
        let rs = T::one() / (var * inv_e + eps).sqrt();
        for (((o, &v), &wi), &bi) in yr.iter_mut().zip(xr).zip(w).zip(b) {
            *o = (v - m) * rs * wi + bi;
        }
        mean[r] = m;
        rstd[r] = rs;
    }
}

/// LayerNorm backward, input part: `dx += rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂))` with `ĝ = dy·w`
/// and `x̂ = (x − mean)·rstd`.
///
/// # Panics
/// If a slice's length does not match the shapes.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_input<T: Real>(
    x: &[T],
    mean: &[T],
    rstd: &[T],
    w: &[T],
    dy: &[T],
    n: usize,
    e: usize,
    dx: &mut [T],
) {
    check_rows(x, mean, rstd, n, e);
    check_len("layernorm dy", dy, n * e);
    check_len("layernorm dx", dx, n * e);
    check_len("layernorm w", w, e);
    let inv_e = T::one() / T::from_f64(e as f64);
    for r in 0..n {
        let xr = &x[r * e..(r + 1) * e];
        let gr = &dy[r * e..(r + 1) * e];
        let (m, rs) = (mean[r], rstd[r]);
        let mut sum_g = T::zero();
        let mut sum_gx = T::zero();
        for ((&xv, &g), &wi) in xr.iter().zip(gr).zip(w) {
            let gh = g * wi;
            sum_g += gh;
            sum_gx += gh * (xv - m) * rs;
        }
        let mg = sum_g * inv_e;
        let mgx = sum_gx * inv_e;
        for (((d, &xv), &g), &wi) in dx[r * e..(r + 1) * e].iter_mut().zip(xr).zip(gr).zip(w) {
            let xh = (xv - m) * rs;
            *d += rs * (g * wi - mg - xh * mgx);
        }
    }
}

/// LayerNorm backward, parameter part: `dw += Σ_rows dy·x̂`, `db += Σ_rows dy`.
///
/// # Panics
/// If a slice's length does not match the shapes.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_params<T: Real>(
    x: &[T],
    mean: &[T],
    rstd: &[T],
    dy: &[T],
    n: usize,
    e: usize,
    dw: &mut [T],
    db: &mut [T],
) {
    check_rows(x, mean, rstd, n, e);
    check_len("layernorm dy", dy, n * e);
    check_len("layernorm dw", dw, e);
    check_len("layernorm db", db, e);
    for r in 0..n {
        let (m, rs) = (mean[r], rstd[r]);
        let xr = &x[r * e..(r + 1) * e];
        let gr = &dy[r * e..(r + 1) * e];
        for (((dwi, dbi), &xv), &g) in dw.iter_mut().zip(db.iter_mut()).zip(xr).zip(gr) {
            *dwi += g * (xv - m) * rs;
            *dbi += g;
        }
    }
}

/// Checks the lengths that every LayerNorm function shares: `x: [n, e]`, `mean: [n]`,
/// `rstd: [n]`.
#[track_caller]
fn check_rows<T>(x: &[T], mean: &[T], rstd: &[T], n: usize, e: usize) {
    check_len("layernorm x", x, n * e);
    check_len("layernorm mean", mean, n);
    check_len("layernorm rstd", rstd, n);
}
