//! Casting shards between element types, for mixed precision.
//!
//! FSDP keeps fp32 master shards and casts the *shard* to the parameter dtype before the
//! all-gather (and gradients from the reduce dtype back), so no second full copy of the model
//! ever exists. Every conversion here rounds to nearest, ties to even, once: a narrowing from
//! `f64` to a 16-bit type goes through `f32` rounded *to odd*, which keeps the final rounding
//! exact (a plain `f64 → f32 → bf16` would round twice).

use fsdp_device::{DType, Element};

use crate::error::{FlatParamError, Result};

/// Round `x` to `f32` with round-to-odd: truncate toward zero and, if the result is inexact, set
/// the last significand bit. Rounding that to a format with at least two fewer significand bits
/// gives the correctly rounded result.
fn f64_to_f32_round_to_odd(x: f64) -> f32 {
    let r = x as f32; // nearest even
    if r.is_nan() || f64::from(r) == x {
        return r;
    }
    let mut bits = r.to_bits();
    if f64::from(r).abs() > x.abs() {
        // Rounded away from zero (possibly to infinity): step back toward zero. `r` is not zero
        // here, so its magnitude bits are at least 1.
        bits -= 1;
    }
    f32::from_bits(bits | 1)
}

/// Convert one element, rounding to nearest even.
#[inline(always)]
fn convert<S: Element, D: Element>(s: S) -> D {
    match (S::DTYPE, D::DTYPE) {
        // Wider than f32 on either side: through f64 (exact widening), except f64 → 16-bit.
        (DType::F64, DType::BF16 | DType::F16) => D::from_f32(f64_to_f32_round_to_odd(s.to_f64())),
        (DType::F64, _) | (_, DType::F64) => D::from_f64(s.to_f64()),
        // f32, bf16, f16 are all exact in f32.
        _ => D::from_f32(s.to_f32()),
    }
}

/// Cast `src` into `dst` element by element (round to nearest even), e.g. an `f32` master shard
/// into the `bf16` shard that is all-gathered, or a `bf16` reduced gradient shard back to `f32`.
/// Same-type casts copy the bits.
///
/// # Errors
/// [`LengthMismatch`](FlatParamError::LengthMismatch) when the lengths differ.
///
/// ```
/// use fsdp_flatparam::cast_into;
/// use half::bf16;
/// let master = [0.5f32, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0];
/// let mut low = [bf16::ZERO; 3];
/// cast_into(&master, &mut low)?;
/// assert_eq!(low[0].to_f32(), 0.5); // representable: exact
/// assert_eq!(low[1], bf16::ONE); // a tie rounds to the even neighbour
/// assert_eq!(low[2].to_f32(), 1.0 + 1.0 / 64.0); // nearest
///
/// let mut back = [0.0f32; 3];
/// cast_into(&low, &mut back)?; // widening is exact
/// assert_eq!(back, [0.5, 1.0, 1.0 + 1.0 / 64.0]);
/// # Ok::<(), fsdp_flatparam::FlatParamError>(())
/// ```
pub fn cast_into<S: Element, D: Element>(src: &[S], dst: &mut [D]) -> Result<()> {
    if src.len() != dst.len() {
        return Err(FlatParamError::LengthMismatch {
            what: format!("the {} destination of a cast", D::DTYPE),
            expected: src.len(),
            actual: dst.len(),
        });
    }
    if S::DTYPE == D::DTYPE {
        let src: &[u8] = bytemuck::cast_slice(src);
        let dst: &mut [u8] = bytemuck::cast_slice_mut(dst);
        dst.copy_from_slice(src);
        return Ok(());
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = convert(*s);
    }
    Ok(())
}

/// Cast `src` into a new vector of `D` (round to nearest even).
pub fn cast<S: Element, D: Element>(src: &[S]) -> Vec<D> {
    if S::DTYPE == D::DTYPE {
        return bytemuck::cast_slice(src).to_vec();
    }
    src.iter().map(|s| convert(*s)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_to_odd_then_bf16_is_a_single_rounding() {
        // 1 + 2^-8 is the midpoint between bf16's 1 and 1 + 2^-7; a tiny bit above it must round
        // up, which a double rounding through f32 gets wrong (f32 rounds it to the midpoint).
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        let via_f32 = half::bf16::from_f32(x as f32);
        assert_eq!(
            via_f32.to_f32(),
            1.0,
            "plain double rounding lands on the even side"
        );
        let b: half::bf16 = convert(x);
        assert_eq!(b.to_f64(), 1.0 + 2f64.powi(-7));
        let h: half::f16 = convert(1.0 + 2f64.powi(-11) + 2f64.powi(-40));
        assert_eq!(h.to_f64(), 1.0 + 2f64.powi(-10));
    }

    #[test]
    fn f64_narrowing_edges() {
        let big: half::bf16 = convert(1e300f64);
        assert!(big.is_infinite() && big.is_sign_positive());
        let tiny: half::bf16 = convert(-1e-300f64);
        assert_eq!(tiny.to_bits(), 0x8000);
        let nan: half::f16 = convert(f64::NAN);
        assert!(nan.is_nan());
        let inf: half::f16 = convert(f64::NEG_INFINITY);
        assert_eq!(inf, half::f16::NEG_INFINITY);
        let exact: half::bf16 = convert(0.5f64);
        assert_eq!(exact.to_f32(), 0.5);
    }
}
