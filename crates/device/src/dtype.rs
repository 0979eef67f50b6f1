//! Element types: one trait ([`Element`]) over `f32`, `f64`, `bf16` and `f16`, and the runtime tag
//! ([`DType`]) that buffers carry.

use std::fmt;

use half::{bf16, f16};

/// The runtime tag of an element type, as stored in a [`Buffer`](crate::Buffer).
///
/// The set is closed (matching on it needs no wildcard arm), like the sealed [`Element`] trait.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary64.
    F64,
    /// bfloat16: 1 sign, 8 exponent, 7 fraction bits.
    BF16,
    /// IEEE 754 binary16: 1 sign, 5 exponent, 10 fraction bits.
    F16,
}

impl DType {
    /// Every supported type, in a fixed order.
    pub const ALL: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

    /// Size of one element in bytes.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The name PyTorch uses (`float32`, `bfloat16`, …).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A floating-point element type that buffers, collectives and flat parameters work with.
///
/// Arithmetic on the 16-bit types is done in `f32` and rounded back to nearest even after every
/// operation, which is what NCCL does for its reductions: the result of a reduction therefore
/// depends only on the order of the operands, never on the machine.
///
/// The trait is sealed: the set of types is the closed set of [`DType`].
pub trait Element:
    sealed::Sealed
    + bytemuck::Pod
    + Copy
    + Send
    + Sync
    + Default
    + PartialEq
    + PartialOrd
    + fmt::Debug
    + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Widen to `f64` (exact for every type).
    fn to_f64(self) -> f64;
    /// Round an `f64` to this type (nearest even).
    fn from_f64(v: f64) -> Self;
    /// Widen or narrow to `f32` (exact for the 16-bit types, nearest even for `f64`).
    fn to_f32(self) -> f32;
    /// Round an `f32` to this type (nearest even).
    fn from_f32(v: f32) -> Self;
    /// `self + other`.
    fn add(self, other: Self) -> Self;
    /// `self * other`.
    fn mul(self, other: Self) -> Self;
    /// `self / n`, for averaging over `n` ranks.
    fn div_count(self, n: usize) -> Self;
    /// The smaller value; NaN if either operand is NaN.
    fn min_nan(self, other: Self) -> Self;
    /// The larger value; NaN if either operand is NaN.
    fn max_nan(self, other: Self) -> Self;
    /// Whether the value is NaN.
    fn is_nan(self) -> bool;
}

macro_rules! native_element {
    ($t:ty, $dtype:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dtype;
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_f32(self) -> f32 {
                self as f32
            }
            #[inline]
            fn from_f32(v: f32) -> Self {
                v as $t
            }
            #[inline]
            fn add(self, other: Self) -> Self {
                self + other
            }
            #[inline]
            fn mul(self, other: Self) -> Self {
                self * other
            }
            #[inline]
            fn div_count(self, n: usize) -> Self {
                self / (n as $t)
            }
            #[inline]
            fn min_nan(self, other: Self) -> Self {
                if self.is_nan() || other.is_nan() {
                    <$t>::NAN
                } else if other < self {
                    other
                } else {
                    self
                }
            }
            #[inline]
            fn max_nan(self, other: Self) -> Self {
                if self.is_nan() || other.is_nan() {
                    <$t>::NAN
                } else if other > self {
                    other
                } else {
                    self
                }
            }
            #[inline]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    };
}

native_element!(f32, DType::F32);
native_element!(f64, DType::F64);

/// Round an `f64` to `f32` towards zero, setting the last bit when inexact ("round to odd").
/// A second rounding to any format with at least two fewer significand bits is then correct.
fn f64_to_f32_round_to_odd(v: f64) -> f32 {
    let nearest = v as f32;
    if !nearest.is_finite() || nearest as f64 == v {
        return nearest;
    }
    let mut bits = nearest.to_bits();
    if (nearest as f64).abs() > v.abs() {
        bits -= 1; // sign-magnitude: one step towards zero
    }
    f32::from_bits(bits | 1)
}

macro_rules! half_element {
    ($t:ty, $dtype:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dtype;
            #[inline]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                // f64 -> f32 rounded to odd, then to nearest even: one correct rounding (the
                // direct conversion of `half` rounds twice).
                <$t>::from_f32(f64_to_f32_round_to_odd(v))
            }
            #[inline]
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            #[inline]
            fn from_f32(v: f32) -> Self {
                <$t>::from_f32(v)
            }
            #[inline]
            fn add(self, other: Self) -> Self {
                <$t>::from_f32(<$t>::to_f32(self) + <$t>::to_f32(other))
            }
            #[inline]
            fn mul(self, other: Self) -> Self {
                <$t>::from_f32(<$t>::to_f32(self) * <$t>::to_f32(other))
            }
            #[inline]
            fn div_count(self, n: usize) -> Self {
                <$t>::from_f32(<$t>::to_f32(self) / n as f32)
            }
            #[inline]
            fn min_nan(self, other: Self) -> Self {
                <$t>::from_f32(<f32 as Element>::min_nan(self.to_f32(), other.to_f32()))
            }
            #[inline]
            fn max_nan(self, other: Self) -> Self {
                <$t>::from_f32(<f32 as Element>::max_nan(self.to_f32(), other.to_f32()))
            }
            #[inline]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    };
}

half_element!(bf16, DType::BF16);
half_element!(f16, DType::F16);

/// Call a generic function with the element type named by a runtime [`DType`].
///
/// `with_element!(dtype, T => expr)` evaluates `expr` with `T` bound to the matching
/// [`Element`] type.
///
/// ```
/// use fsdp_device::{with_element, DType, Element};
/// fn size_of<T: Element>() -> usize { std::mem::size_of::<T>() }
/// assert_eq!(with_element!(DType::BF16, T => size_of::<T>()), 2);
/// ```
#[macro_export]
macro_rules! with_element {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::BF16 => {
                type $t = $crate::half::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $t = $crate::half::f16;
                $body
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::F32.size_in_bytes(), std::mem::size_of::<f32>());
        assert_eq!(DType::F64.size_in_bytes(), std::mem::size_of::<f64>());
        assert_eq!(DType::BF16.size_in_bytes(), std::mem::size_of::<bf16>());
        assert_eq!(DType::F16.size_in_bytes(), std::mem::size_of::<f16>());
    }

    #[test]
    fn half_add_rounds_like_f32_then_nearest_even() {
        let a = bf16::from_f32(1.0);
        let b = bf16::from_f32(1.0 / 256.0); // below half an ulp of 1.0 in bf16 (2^-8 = half ulp)
        assert_eq!(a.add(b), bf16::from_f32(1.0)); // ties to even
        let c = bf16::from_f32(3.0 / 256.0);
        assert_eq!(a.add(c).to_f32(), 1.0 + 1.0 / 64.0);
    }

    #[test]
    fn from_f64_rounds_once() {
        let v = 1.0 + 2f64.powi(-8) + 2f64.powi(-40); // just above the bf16 tie at 1 + 2^-8
        assert_eq!(<bf16 as Element>::from_f64(v).to_f64(), 1.0078125);
        let w = 1.0 + 2f64.powi(-11) + 2f64.powi(-40); // just above the f16 tie
        assert_eq!(<f16 as Element>::from_f64(w).to_f64(), 1.0 + 2f64.powi(-10));
        assert_eq!(
            <f16 as Element>::from_f64(-w).to_f64(),
            -(1.0 + 2f64.powi(-10))
        );
        assert_eq!(
            <bf16 as Element>::from_f64(1.0 + 2f64.powi(-8)).to_f64(),
            1.0
        ); // exact tie: even
        assert!(<bf16 as Element>::from_f64(f64::NAN).is_nan());
        assert_eq!(<f16 as Element>::from_f64(1e10).to_f64(), f64::INFINITY);
    }

    #[test]
    fn min_max_propagate_nan() {
        assert!(1.0f32.min_nan(f32::NAN).is_nan());
        assert!(f64::NAN.max_nan(2.0).is_nan());
        assert_eq!(3.0f32.min_nan(-1.0), -1.0);
        assert_eq!(f16::from_f32(2.0).max_nan(f16::from_f32(5.0)).to_f32(), 5.0);
    }
}
