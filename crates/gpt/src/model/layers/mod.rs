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

mod attention;
mod cross_entropy;
mod embedding;
mod gelu;
mod layernorm;
mod linear;
mod matmul;

pub use attention::{attention_backward, attention_forward};
pub use cross_entropy::{cross_entropy_backward, cross_entropy_forward};
pub use embedding::{embedding_backward_positions, embedding_backward_tokens, embedding_forward};
pub use gelu::{gelu_backward, gelu_forward};
pub use layernorm::{layernorm_backward_input, layernorm_backward_params, layernorm_forward};
pub use linear::{
    linear_backward_bias, linear_backward_input, linear_backward_weight, linear_forward,
};
pub use matmul::gemm;

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

/// `(Φ(x), φ(x))` in `f64`, exact to rounding (`libm::erf`).
fn normal_cdf_pdf_f64(x: f64) -> (f64, f64) {
    let cdf = 0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2));
    (cdf, (-0.5 * x * x).exp() * FRAC_1_SQRT_2PI)
}

/// Implements [`Real`] for `$t`: `from_f64` and `to_f64` by the two closures' bodies, `exp` and
/// `sqrt` the type's own, `normal_cdf_pdf` the function given.
macro_rules! impl_real {
    ($t:ty, |$v:ident| $from:expr, |$x:ident| $to:expr, $cdf:path) => {
        impl Real for $t {
            #[inline]
            fn from_f64($v: f64) -> Self {
                $from
            }
            #[inline]
            fn to_f64(self) -> f64 {
                let $x = self;
                $to
            }
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn normal_cdf_pdf(self) -> (Self, Self) {
                $cdf(self)
            }
        }
    };
}

impl_real!(f32, |v| v as f32, |x| f64::from(x), normal_cdf_pdf_f32);
impl_real!(f64, |v| v, |x| x, normal_cdf_pdf_f64);

#[track_caller]
pub(super) fn check_len<T>(what: &str, s: &[T], expected: usize) {
    assert_eq!(
        s.len(),
        expected,
        "{what}: slice has {} elements, expected {expected}",
        s.len()
    );
}
