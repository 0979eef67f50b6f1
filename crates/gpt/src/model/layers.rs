//! The layers of GPT-2 as plain functions over row-major slices, forward and backward.
//!
//! Every function is generic over [`Real`] (`f32` for the model, `f64` for finite-difference
//! checks). Shapes are given explicitly; `n` is the number of token rows. Matrix products run
//! on `matrixmultiply`'s sgemm/dgemm through `ndarray`'s safe strided views.
//!
//! Backward functions **accumulate** (`+=`) into every output they are given, like PyTorch's
//! autograd accumulates into `.grad`: the caller zeroes buffers that must start from zero.
//!
//! These are kernels: they check their slice lengths with assertions (and panic with a message
//! naming the slice), while the staged model API in [`crate::model`] validates everything first
//! and reports errors as [`FsdpError`](fsdp::FsdpError).

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2, ShapeBuilder};

/// The floating-point types the layers run on: `f32` (the model) and `f64` (gradient checks).
pub trait Real:
    ndarray::LinalgScalar
    + PartialOrd
    + std::fmt::Debug
    + std::ops::AddAssign
    + std::ops::Neg<Output = Self>
    + Send
    + Sync
{
    /// Converts from `f64` (rounding to nearest for `f32`).
    fn from_f64(v: f64) -> Self;
    /// Converts to `f64` exactly.
    fn to_f64(self) -> f64;
    /// `e^self`.
    fn exp(self) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// The standard normal distribution's CDF and density at `self`: `(Φ(x), φ(x))`, with
    /// `Φ(x) = ½·(1 + erf(x/√2))` and `φ(x) = e^(−x²/2)/√(2π)`. Exact to rounding for `f64`
    /// (`libm::erf`); for `f32` a fast, vectorisable approximation whose error is at most
    /// 4e-7 absolute on `Φ` (about 5 ulps at ½; 2.9e-7 measured) and 1e-7 on `φ`
    /// (see [`normal_cdf_pdf_f32`]).
    fn normal_cdf_pdf(self) -> (Self, Self);
}

const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// `e^x` in `f32` without a libm call, so that loops over it vectorise: Cephes' `expf`
/// (range reduction by `ln 2`, degree-6 polynomial), relative error below 2e-7 on
/// `[−87, 88]`; inputs outside are clamped to it. NaN gives NaN.
///
/// Integer steps use wrapping arithmetic (they cannot overflow here), so that builds with
/// overflow checks still vectorise the loops.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    // Written as selects (not `clamp`/`max`) so that NaN passes through.
    let x = if x < -87.0 { -87.0 } else { x };
    let x = if x > 88.0 { 88.0 } else { x };
    // Round x/ln 2 to the nearest integer n with the 1.5·2²³ trick: t's low mantissa bits hold
    // n in two's complement, and t − 1.5·2²³ is n as a float.
    let t = x * std::f32::consts::LOG2_E + 12_582_912.0;
    let n = t - 12_582_912.0;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = (((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * (r * r)
        + r
        + 1.0;
    // 2ⁿ: the biased exponent n + 127 shifted into place (n ∈ [−126, 127]).
    p * f32::from_bits(t.to_bits().wrapping_add(127).wrapping_shl(23))
}

/// `(Φ(x), φ(x))` in `f32` by Abramowitz & Stegun 7.1.26 (`erfc(z) ≈ t·P(t)·e^(−z²)`,
/// `t = 1/(1 + 0.3275911·z)`, `z = |x|/√2`, absolute error ≤ 1.5e-7 on `erfc`), with
/// [`exp_f32`]; branch-free so that loops over it vectorise.
#[inline(always)]
pub fn normal_cdf_pdf_f32(x: f32) -> (f32, f32) {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let e = exp_f32(-z * z);
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly = ((((1.061_405_4 * t - 1.453_152_1) * t + 1.421_413_7) * t - 0.284_496_74) * t
        + 0.254_829_6)
        * t;
    let half_erfc = 0.5 * poly * e;
    let cdf = if x >= 0.0 { 1.0 - half_erfc } else { half_erfc };
    (cdf, e * FRAC_1_SQRT_2PI as f32)
}

impl Real for f32 {
    #[inline]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    #[inline]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    #[inline]
    fn exp(self) -> Self {
        f32::exp(self)
    }
    #[inline]
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    #[inline]
    fn normal_cdf_pdf(self) -> (Self, Self) {
        normal_cdf_pdf_f32(self)
    }
}

impl Real for f64 {
    #[inline]
    fn from_f64(v: f64) -> Self {
        v
    }
    #[inline]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline]
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    #[inline]
    fn normal_cdf_pdf(self) -> (Self, Self) {
        let cdf = 0.5 * (1.0 + libm::erf(self * std::f64::consts::FRAC_1_SQRT_2));
        (cdf, (-0.5 * self * self).exp() * FRAC_1_SQRT_2PI)
    }
}

#[track_caller]
fn check_len<T>(what: &str, s: &[T], expected: usize) {
    assert_eq!(
        s.len(),
        expected,
        "{what}: slice has {} elements, expected {expected}",
        s.len()
    );
}

/// A strided matrix inside a slice: element `(i, j)` is at `off + i·rs + j·cs`.
#[derive(Debug, Clone, Copy)]
struct Mat {
    off: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl Mat {
    /// Row-major `rows × cols` at `off` with row stride `ld`.
    fn rm(off: usize, rows: usize, cols: usize, ld: usize) -> Mat {
        Mat {
            off,
            rows,
            cols,
            rs: ld,
            cs: 1,
        }
    }

    /// The transpose (same elements).
    fn t(self) -> Mat {
        Mat {
            off: self.off,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    fn view<T: Real>(self, s: &[T]) -> ArrayView2<'_, T> {
        ArrayView2::from_shape(
            (self.rows, self.cols).strides((self.rs, self.cs)),
            &s[self.off..],
        )
        .expect("strided matrix lies inside its slice")
    }

    fn view_mut<T: Real>(self, s: &mut [T]) -> ArrayViewMut2<'_, T> {
        ArrayViewMut2::from_shape(
            (self.rows, self.cols).strides((self.rs, self.cs)),
            &mut s[self.off..],
        )
        .expect("strided matrix lies inside its slice")
    }

    /// Its elements copied into a new column-major buffer, and the matrix there; `None` when
    /// the memory for the copy cannot be had.
    fn to_col_major<T: Real>(self, s: &[T]) -> Option<(Vec<T>, Mat)> {
        let mut out = Vec::new();
        out.try_reserve_exact(self.rows * self.cols).ok()?;
        out.resize(self.rows * self.cols, T::zero());
        let (r, c) = (self.rows, self.cols);
        if self.cs == 1 {
            // Contiguous rows: for each band of 16 columns (whose output, 16 columns of `r`
            // elements, stays in L1), read four rows side by side and write four-element runs.
            for j0 in (0..c).step_by(16) {
                let jb = 16.min(c - j0);
                let row = |i: usize| &s[self.off + i * self.rs + j0..][..jb];
                let mut i0 = 0;
                while i0 + 4 <= r {
                    let (r0, r1, r2, r3) = (row(i0), row(i0 + 1), row(i0 + 2), row(i0 + 3));
                    for (j, (((&a, &b), &cc), &d)) in r0.iter().zip(r1).zip(r2).zip(r3).enumerate()
                    {
                        // Four scalar stores: building a [T; 4] and copying it stalls on
                        // store forwarding.
                        let o = &mut out[(j0 + j) * r + i0..][..4];
                        o[0] = a;
                        o[1] = b;
                        o[2] = cc;
                        o[3] = d;
                    }
                    i0 += 4;
                }
                for i in i0..r {
                    for (j, &v) in row(i).iter().enumerate() {
                        out[(j0 + j) * r + i] = v;
                    }
                }
            }
        } else {
            for (j, col) in out.chunks_exact_mut(r).enumerate() {
                let base = self.off + j * self.cs;
                for (i, o) in col.iter_mut().enumerate() {
                    *o = s[base + i * self.rs];
                }
            }
        }
        let m = Mat {
            off: 0,
            rows: self.rows,
            cols: self.cols,
            rs: 1,
            cs: self.rows,
        };
        Some((out, m))
    }
}

/// `c = alpha·a·b + beta·c` through `matrixmultiply`, first copying `a` to column-major and `b`
/// to row-major order when they are not: `matrixmultiply` packs operands in those orders, and
/// for the small products of this model its strided packing costs several times the copy.
/// When the memory for a copy cannot be had, the operand is used in place (slower; the same
/// result bit for bit, since `matrixmultiply` packs every operand whatever its strides).
#[allow(clippy::too_many_arguments)]
fn mat_mul<T: Real>(alpha: T, a: &[T], am: Mat, b: &[T], bm: Mat, beta: T, c: &mut [T], cm: Mat) {
    let a_copy;
    let av = if am.rs == 1 || am.rows <= 1 {
        am.view(a)
    } else if let Some((buf, m)) = am.to_col_major(a) {
        a_copy = buf;
        m.view(&a_copy)
    } else {
        am.view(a)
    };
    let b_copy;
    let bv = if bm.cs == 1 || bm.cols <= 1 {
        bm.view(b)
    } else if let Some((buf, m)) = bm.t().to_col_major(b) {
        // Row-major `b` is column-major `bᵀ`.
        b_copy = buf;
        m.t().view(&b_copy)
    } else {
        bm.view(b)
    };
    general_mat_mul(alpha, &av, &bv, beta, &mut cm.view_mut(c));
}

/// `C[m×n] = alpha · op(A) · op(B) + beta · C` for row-major slices: `op(A)` is `A` stored as
/// `[m, k]`, or `Aᵀ` of `A` stored as `[k, m]` when `trans_a`; likewise `op(B)` is `[k, n]`, or
/// `Bᵀ` of `B` stored as `[n, k]` when `trans_b`. With `beta == 0` the old contents of `C` are
/// ignored.
///
/// # Panics
/// If a slice's length is not what its shape needs.
#[allow(clippy::too_many_arguments)]
pub fn gemm<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    alpha: T,
    a: &[T],
    trans_a: bool,
    b: &[T],
    trans_b: bool,
    beta: T,
    c: &mut [T],
) {
    check_len("gemm A", a, m * k);
    check_len("gemm B", b, k * n);
    check_len("gemm C", c, m * n);
    let am = if trans_a {
        Mat::rm(0, k, m, m).t()
    } else {
        Mat::rm(0, m, k, k)
    };
    let bm = if trans_b {
        Mat::rm(0, n, k, k).t()
    } else {
        Mat::rm(0, k, n, n)
    };
    mat_mul(alpha, a, am, b, bm, beta, c, Mat::rm(0, m, n, n));
}

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
    check_len("layernorm x", x, n * e);
    check_len("layernorm y", y, n * e);
    check_len("layernorm w", w, e);
    check_len("layernorm b", b, e);
    check_len("layernorm mean", mean, n);
    check_len("layernorm rstd", rstd, n);
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
    check_len("layernorm x", x, n * e);
    check_len("layernorm dy", dy, n * e);
    check_len("layernorm dx", dx, n * e);
    check_len("layernorm w", w, e);
    check_len("layernorm mean", mean, n);
    check_len("layernorm rstd", rstd, n);
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
    check_len("layernorm x", x, n * e);
    check_len("layernorm dy", dy, n * e);
    check_len("layernorm dw", dw, e);
    check_len("layernorm db", db, e);
    check_len("layernorm mean", mean, n);
    check_len("layernorm rstd", rstd, n);
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

/// Exact GELU (PyTorch's `approximate='none'`), `y = x·Φ(x) = ½·x·(1 + erf(x/√2))`, with
/// `Φ` from [`Real::normal_cdf_pdf`].
///
/// # Panics
/// If `x` and `y` differ in length.
pub fn gelu_forward<T: Real>(x: &[T], y: &mut [T]) {
    check_len("gelu y", y, x.len());
    for (o, &v) in y.iter_mut().zip(x) {
        *o = v * v.normal_cdf_pdf().0;
    }
}

/// GELU backward: `dx += dy·(Φ(x) + x·φ(x))`.
///
/// # Panics
/// If the slices differ in length.
pub fn gelu_backward<T: Real>(x: &[T], dy: &[T], dx: &mut [T]) {
    check_len("gelu dy", dy, x.len());
    check_len("gelu dx", dx, x.len());
    for ((d, &v), &g) in dx.iter_mut().zip(x).zip(dy) {
        let (cdf, pdf) = v.normal_cdf_pdf();
        *d += g * (cdf + v * pdf);
    }
}

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
    assert!(
        n_head > 0 && e % n_head == 0,
        "attention: e = {e} is not divisible by n_head = {n_head}"
    );
    check_len("attention qkv", qkv, b * t * 3 * e);
    check_len("attention att", att, b * n_head * t * t);
    check_len("attention y", y, b * t * e);
    let d = e / n_head;
    let scale = T::one() / T::from_f64(d as f64).sqrt();
    let tt = Mat::rm(0, t, t, t);
    for bi in 0..b {
        for h in 0..n_head {
            let base = bi * t * 3 * e + h * d;
            let q = Mat::rm(base, t, d, 3 * e);
            let k = Mat::rm(base + e, t, d, 3 * e);
            let v = Mat::rm(base + 2 * e, t, d, 3 * e);
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
    assert!(
        n_head > 0 && e % n_head == 0,
        "attention: e = {e} is not divisible by n_head = {n_head}"
    );
    check_len("attention qkv", qkv, b * t * 3 * e);
    check_len("attention att", att, b * n_head * t * t);
    check_len("attention dy", dy, b * t * e);
    check_len("attention dqkv", dqkv, b * t * 3 * e);
    let d = e / n_head;
    let scale = T::one() / T::from_f64(d as f64).sqrt();
    let mut ds = vec![T::zero(); t * t];
    let tt = Mat::rm(0, t, t, t);
    for bi in 0..b {
        for h in 0..n_head {
            let base = bi * t * 3 * e + h * d;
            let q = Mat::rm(base, t, d, 3 * e);
            let k = Mat::rm(base + e, t, d, 3 * e);
            let v = Mat::rm(base + 2 * e, t, d, 3 * e);
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

/// Token plus position embedding: row `r` of `x: [n, e]` is `wte[ids[r]] + wpe[r mod t]`,
/// where the `n = ids.len()` rows are sequences of `t` tokens one after the other.
///
/// # Panics
/// If a slice's length does not match the shapes or an id is out of `wte`.
pub fn embedding_forward<T: Real>(
    ids: &[u32],
    t: usize,
    wte: &[T],
    wpe: &[T],
    e: usize,
    x: &mut [T],
) {
    check_len("embedding x", x, ids.len() * e);
    assert!(
        t > 0 && ids.len() % t == 0 && wpe.len() >= t * e,
        "embedding: {} ids are not whole sequences of {t} positions covered by wpe",
        ids.len()
    );
    for (r, (&id, xr)) in ids.iter().zip(x.chunks_exact_mut(e)).enumerate() {
        let id = id as usize;
        let tok = &wte[id * e..(id + 1) * e];
        let pos = &wpe[(r % t) * e..(r % t + 1) * e];
        for ((o, &a), &p) in xr.iter_mut().zip(tok).zip(pos) {
            *o = a + p;
        }
    }
}

/// Embedding backward, token part: `dwte[ids[r]] += dx[r]` (a scatter-add; repeated ids add up).
///
/// # Panics
/// If a slice's length does not match the shapes or an id is out of `dwte`.
pub fn embedding_backward_tokens<T: Real>(ids: &[u32], dx: &[T], e: usize, dwte: &mut [T]) {
    check_len("embedding dx", dx, ids.len() * e);
    for (&id, g) in ids.iter().zip(dx.chunks_exact(e)) {
        let id = id as usize;
        for (d, &v) in dwte[id * e..(id + 1) * e].iter_mut().zip(g) {
            *d += v;
        }
    }
}

/// Embedding backward, position part: `dwpe[r mod t] += dx[r]` for every row `r` of `dx: [n, e]`.
///
/// # Panics
/// If `dx` is not whole sequences of `t` rows or `dwpe` has fewer than `t` rows.
pub fn embedding_backward_positions<T: Real>(t: usize, dx: &[T], e: usize, dwpe: &mut [T]) {
    assert!(
        t > 0 && dx.len() % (t * e) == 0 && dwpe.len() >= t * e,
        "embedding: dx of {} elements is not whole sequences of {t} positions covered by dwpe",
        dx.len()
    );
    for (r, g) in dx.chunks_exact(e).enumerate() {
        let p = r % t;
        for (d, &v) in dwpe[p * e..(p + 1) * e].iter_mut().zip(g) {
            *d += v;
        }
    }
}
