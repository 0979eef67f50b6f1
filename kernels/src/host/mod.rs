//! Host twins: each kernel's arithmetic in Rust, in the same order and with the same rounding,
//! so that a GPU result can be compared bitwise (NaN payloads aside: a GPU makes every NaN of
//! an addition or product the canonical `0x7fffffff`).

mod any_precision;
pub mod attention;
mod convert;
pub mod nn;
mod nn_heads;
mod nn_loss;
pub mod nn_math;
mod norm;
mod optim;
mod step;
pub(crate) use any_precision::check_call as check_anyprecision_call;
pub(crate) use step::{check_rule, check_scalars_len, check_scaler, decided_grad};

pub use any_precision::{
    anyprecision_decided, pack_state, state_len, unpack_state, AnyPrecision, AnyPrecisionChoice,
    AnyPrecisionScalars,
};
pub use convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
pub use norm::{clip_coefficient, scale_by, sum_of_squares, NORM_BLOCK, NORM_ITEMS};
pub use optim::{adamw, sgd, AdamW, AdamWScalars, MomentFloat, Sgd, SgdScalars};
pub use step::{
    adamw_decided, engine_decide, loss_accumulate, scaled_seed, sgd_decided, step_decide,
    step_scalars, step_scalars_len, unscale_by, AdamWChoice, EngineDecision, NonfiniteRule,
    ScalerRule, SgdChoice, StepRule, STEP_APPLIED, STEP_CHOICE, STEP_CHOICES, STEP_CLIPPED,
    STEP_CLIP_COEF, STEP_COUNT, STEP_FAULT, STEP_FOUND_INF, STEP_GRAD_NORM, STEP_GROWTH_TRACKER,
    STEP_HALTED, STEP_LOSS, STEP_NONFINITE, STEP_SCALE, STEP_SCALER_SKIPPED, STEP_SQUARES,
    STEP_UNSCALE,
};

use std::fmt::Debug;

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use fsdp_device::DType;
use half::{bf16, f16};

use crate::KernelError;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// The type arithmetic is done in: `f32` for f32, bf16 and f16, `f64` for f64. Its operations
/// are those of the ring (`fsdp_device::Element`): min and max give NaN if either operand is.
pub trait Compute: Copy + PartialOrd + Debug + DeviceRepr + sealed::Sealed + 'static {
    /// `a + b`.
    fn add(self, b: Self) -> Self;
    /// `a · b`.
    fn mul(self, b: Self) -> Self;
    /// `a / n`.
    fn div_count(self, n: u32) -> Self;
    /// `a / b`.
    fn div(self, b: Self) -> Self;
    /// The smaller (`b` only if strictly smaller), NaN if either is NaN.
    fn min_nan(self, b: Self) -> Self;
    /// The larger (`b` only if strictly larger), NaN if either is NaN.
    fn max_nan(self, b: Self) -> Self;
    /// An `f64` scalar rounded to this type.
    fn from_f64(v: f64) -> Self;
    /// The value as a kernel parameter (a float or a double).
    fn param(self) -> crate::launch::plan::Param;
}

macro_rules! compute {
    ($t:ty, $p:ident) => {
        impl Compute for $t {
            fn add(self, b: Self) -> Self {
                self + b
            }
            fn mul(self, b: Self) -> Self {
                self * b
            }
            fn div_count(self, n: u32) -> Self {
                self / n as $t
            }
            fn div(self, b: Self) -> Self {
                self / b
            }
            fn min_nan(self, b: Self) -> Self {
                if self.is_nan() || b.is_nan() {
                    <$t>::NAN
                } else if b < self {
                    b
                } else {
                    self
                }
            }
            fn max_nan(self, b: Self) -> Self {
                if self.is_nan() || b.is_nan() {
                    <$t>::NAN
                } else if b > self {
                    b
                } else {
                    self
                }
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn param(self) -> crate::launch::plan::Param {
                crate::launch::plan::Param::$p(self)
            }
        }
    };
}
compute!(f32, F32);
compute!(f64, F64);

/// An element type of the kernels: f32, f64, bf16, f16.
pub trait KernelFloat:
    Copy
    + PartialEq
    + Default
    + Debug
    + Send
    + Sync
    + DeviceRepr
    + ValidAsZeroBits
    + sealed::Sealed
    + 'static
{
    /// The suffix of its kernels (`f32`, `bf16`, …).
    const NAME: &'static str;
    /// The runtime tag.
    const DTYPE: DType;
    /// The type it computes in.
    type C: Compute;
    /// Widen to the compute type (exact).
    fn load(self) -> Self::C;
    /// Round from the compute type (nearest even).
    fn store(c: Self::C) -> Self;
    /// The bits, zero-extended (for memset and bitwise comparisons).
    fn bits(self) -> u64;
    /// Whether the value is NaN.
    fn is_nan(self) -> bool;
}

impl KernelFloat for f32 {
    const NAME: &'static str = "f32";
    const DTYPE: DType = DType::F32;
    type C = f32;
    fn load(self) -> f32 {
        self
    }
    fn store(c: f32) -> Self {
        c
    }
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
}

impl KernelFloat for f64 {
    const NAME: &'static str = "f64";
    const DTYPE: DType = DType::F64;
    type C = f64;
    fn load(self) -> f64 {
        self
    }
    fn store(c: f64) -> Self {
        c
    }
    fn bits(self) -> u64 {
        self.to_bits()
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
}

impl KernelFloat for bf16 {
    const NAME: &'static str = "bf16";
    const DTYPE: DType = DType::BF16;
    type C = f32;
    fn load(self) -> f32 {
        bf16_to_f32(self.to_bits())
    }
    fn store(c: f32) -> Self {
        bf16::from_bits(f32_to_bf16(c))
    }
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
    fn is_nan(self) -> bool {
        bf16::is_nan(self)
    }
}

impl KernelFloat for f16 {
    const NAME: &'static str = "f16";
    const DTYPE: DType = DType::F16;
    type C = f32;
    fn load(self) -> f32 {
        f16_to_f32(self.to_bits())
    }
    fn store(c: f32) -> Self {
        f16::from_bits(f32_to_f16(c))
    }
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
    fn is_nan(self) -> bool {
        f16::is_nan(self)
    }
}

/// The types the cast kernels convert between (their compute type is `f32`).
pub trait CastFloat: KernelFloat<C = f32> {}
impl CastFloat for f32 {}
impl CastFloat for bf16 {}
impl CastFloat for f16 {}

/// The reductions of the ring (NCCL's `ncclRedOp_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceKind {
    /// Sum.
    Sum,
    /// Sum, then a division by the number of ranks at the last step.
    Avg,
    /// Minimum (NaN if either is NaN).
    Min,
    /// Maximum (NaN if either is NaN).
    Max,
    /// Product.
    Product,
}

impl ReduceKind {
    /// Every reduction.
    pub const ALL: [ReduceKind; 5] = [
        ReduceKind::Sum,
        ReduceKind::Avg,
        ReduceKind::Min,
        ReduceKind::Max,
        ReduceKind::Product,
    ];

    /// The kernel name's operation part (avg runs the sum kernel).
    pub(crate) const fn kernel_op(self) -> &'static str {
        match self {
            ReduceKind::Sum | ReduceKind::Avg => "sum",
            ReduceKind::Min => "min",
            ReduceKind::Max => "max",
            ReduceKind::Product => "prod",
        }
    }

    /// `a ⊕ b` in the compute type.
    pub fn combine<C: Compute>(self, a: C, b: C) -> C {
        match self {
            ReduceKind::Sum | ReduceKind::Avg => a.add(b),
            ReduceKind::Min => a.min_nan(b),
            ReduceKind::Max => a.max_nan(b),
            ReduceKind::Product => a.mul(b),
        }
    }
}

pub(crate) fn same_len(
    kernel: &'static str,
    what: &'static str,
    expected: usize,
    actual: usize,
) -> Result<(), KernelError> {
    if expected == actual {
        Ok(())
    } else {
        Err(KernelError::Length {
            kernel,
            what,
            expected,
            actual,
        })
    }
}

/// Twin of `cast_<S>_<D>`: `dst[i] = D(src[i])`, round to nearest even.
///
/// # Errors
/// [`KernelError::Length`] if the lengths differ.
pub fn cast<S: CastFloat, D: CastFloat>(src: &[S], dst: &mut [D]) -> Result<(), KernelError> {
    same_len("cast", "dst", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = D::store(s.load());
    }
    Ok(())
}

/// Twin of `axpby_<T>`: `y[i] = alpha·x[i] + beta·y[i]`, each product and the sum rounded
/// separately (no fused multiply-add), in `T`'s compute type.
///
/// # Errors
/// [`KernelError::Length`] if the lengths differ.
pub fn axpby<T: KernelFloat>(
    alpha: T::C,
    x: &[T],
    beta: T::C,
    y: &mut [T],
) -> Result<(), KernelError> {
    same_len("axpby", "y", x.len(), y.len())?;
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi = T::store(alpha.mul(xi.load()).add(beta.mul(yi.load())));
    }
    Ok(())
}

/// Twin of `div_scalar_<T>`: `y = y / d`, the quotient rounded to `T`.
pub fn div_scalar<T: KernelFloat>(d: T::C, y: &mut [T]) {
    for yi in y.iter_mut() {
        *yi = T::store(yi.load().div(d));
    }
}

/// Twin of `memset_b<bits>`: every element becomes `value`.
pub fn memset<T: KernelFloat>(dst: &mut [T], value: T) {
    dst.fill(value);
}

/// One element of `reduce_<op>_<T>`: `acc ⊕ x`, rounded to `T`, then divided by `finish`
/// (an average's last step) and rounded again.
pub fn reduce_one<T: KernelFloat>(op: ReduceKind, acc: T, x: T, finish: Option<u32>) -> T {
    let v = T::store(op.combine(acc.load(), x.load()));
    match (op, finish) {
        (ReduceKind::Avg, Some(n)) => T::store(v.load().div_count(n)),
        _ => v,
    }
}

/// Twin of `reduce_<op>_<T>`: `dst[i] = acc[i] ⊕ x[i]` (see [`reduce_one`]).
///
/// # Errors
/// [`KernelError::Length`] if the lengths differ, [`KernelError::InvalidArgument`] for a
/// finishing division by 0.
pub fn reduce<T: KernelFloat>(
    op: ReduceKind,
    dst: &mut [T],
    acc: &[T],
    x: &[T],
    finish: Option<u32>,
) -> Result<(), KernelError> {
    check_reduce("reduce", dst.len(), acc.len(), finish)?;
    same_len("reduce", "x", dst.len(), x.len())?;
    for ((d, &a), &b) in dst.iter_mut().zip(acc).zip(x) {
        *d = reduce_one(op, a, b, finish);
    }
    Ok(())
}

/// In place: `dst[i] = acc[i] ⊕ dst[i]`.
///
/// # Errors
/// As [`reduce`].
pub fn reduce_in_place<T: KernelFloat>(
    op: ReduceKind,
    dst: &mut [T],
    acc: &[T],
    finish: Option<u32>,
) -> Result<(), KernelError> {
    check_reduce("reduce", dst.len(), acc.len(), finish)?;
    for (d, &a) in dst.iter_mut().zip(acc) {
        *d = reduce_one(op, a, *d, finish);
    }
    Ok(())
}

pub(crate) fn check_reduce(
    kernel: &'static str,
    dst: usize,
    acc: usize,
    finish: Option<u32>,
) -> Result<(), KernelError> {
    same_len(kernel, "acc", dst, acc)?;
    if finish == Some(0) {
        return Err(KernelError::InvalidArgument {
            kernel,
            reason: "an average over 0 ranks".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
