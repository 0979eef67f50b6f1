//! Property tests of shard casts: f32 → bf16/f16 rounds to nearest even (within half an ulp,
//! ties to even), and is exact for representable values; widening back is exact.

use fsdp_flatparam::{cast, cast_into};
use half::{bf16, f16};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

/// Reference: round f32 bits to bf16 bits, nearest even, on the bit pattern.
fn bf16_reference(x: f32) -> u16 {
    let b = x.to_bits();
    let trunc = (b >> 16) as u16;
    let rem = b & 0xFFFF;
    if rem > 0x8000 || (rem == 0x8000 && trunc & 1 == 1) {
        trunc + 1
    } else {
        trunc
    }
}

/// Half of the spacing of a format with `frac_bits` fraction bits and minimum normal exponent
/// `min_exp` around `x` (finite, non-zero).
fn half_ulp(x: f64, frac_bits: i32, min_exp: i32) -> f64 {
    let e = (((x.abs().to_bits() >> 52) & 0x7FF) as i32 - 1023).max(min_exp);
    2f64.powi(e - frac_bits - 1)
}

fn finite_f32() -> impl Strategy<Value = f32> {
    any::<u32>()
        .prop_map(f32::from_bits)
        .prop_filter("finite", |x| x.is_finite())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 32768,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn f32_to_bf16_to_f32_within_rounding_bound(xs in prop::collection::vec(finite_f32(), 1..16)) {
        let low: Vec<bf16> = cast(&xs);
        let mut back = vec![0f32; xs.len()];
        cast_into(&low, &mut back).unwrap();
        for ((&x, &y), &b) in xs.iter().zip(&back).zip(&low) {
            prop_assert_eq!(b.to_bits(), bf16_reference(x), "x = {:e}", x);
            prop_assert_eq!(y.to_bits(), u32::from(b.to_bits()) << 16); // widening is exact
            if y.is_finite() && x != 0.0 {
                let err = (f64::from(y) - f64::from(x)).abs();
                let h = half_ulp(f64::from(x), 7, -126);
                prop_assert!(err <= h, "x = {:e}, y = {:e}", x, y);
                if err == h {
                    prop_assert_eq!(b.to_bits() & 1, 0, "tie not to even for {:e}", x);
                }
            } else if !y.is_finite() {
                // Only values at or past the midpoint between bf16::MAX and 2^128 overflow.
                prop_assert!(f64::from(x).abs() >= bf16::MAX.to_f64() + half_ulp(bf16::MAX.to_f64(), 7, -126));
            }
        }
    }

    #[test]
    fn f32_to_f16_to_f32_within_rounding_bound(xs in prop::collection::vec(-70000f32..70000f32, 1..16)) {
        let low: Vec<f16> = cast(&xs);
        let back: Vec<f32> = cast(&low);
        for (&x, &y) in xs.iter().zip(&back) {
            if y.is_finite() && x != 0.0 {
                let err = (f64::from(y) - f64::from(x)).abs();
                let h = half_ulp(f64::from(x), 10, -14);
                prop_assert!(err <= h, "x = {:e}, y = {:e}", x, y);
                if err == h {
                    prop_assert_eq!(f16::from_f32(y).to_bits() & 1, 0);
                }
            } else if !y.is_finite() {
                prop_assert!(x.abs() >= 65520.0);
            }
        }
    }

    #[test]
    fn f64_to_bf16_rounds_once(x in any::<u64>().prop_map(f64::from_bits).prop_filter("finite", |x| x.is_finite())) {
        let b: Vec<bf16> = cast(&[x]);
        let y = b[0].to_f64();
        if y.is_finite() && x != 0.0 {
            // Exact subtraction (Sterbenz) except far below the subnormals, where y is 0.
            let err = (y - x).abs();
            let h = half_ulp(x, 7, -126);
            prop_assert!(err <= h, "x = {:e}, y = {:e}", x, y);
            if err == h {
                prop_assert_eq!(b[0].to_bits() & 1, 0);
            }
        } else if !y.is_finite() {
            prop_assert!(x.abs() >= bf16::MAX.to_f64() + half_ulp(bf16::MAX.to_f64(), 7, -126));
        }
    }
}

/// Every bf16 and every f16 value (NaNs aside) survives 16-bit → f32 → 16-bit and
/// 16-bit → f64 → 16-bit bit for bit: casting representable values is exact.
#[test]
fn representable_values_are_exact_exhaustively() {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let bf: Vec<bf16> = all
        .iter()
        .map(|&b| bf16::from_bits(b))
        .filter(|b| !b.is_nan())
        .collect();
    let hf: Vec<f16> = all
        .iter()
        .map(|&b| f16::from_bits(b))
        .filter(|h| !h.is_nan())
        .collect();
    let wide: Vec<f32> = cast(&bf);
    assert!(wide
        .iter()
        .zip(&bf)
        .all(|(w, b)| w.to_bits() == u32::from(b.to_bits()) << 16));
    let again: Vec<bf16> = cast(&wide);
    assert!(again
        .iter()
        .zip(&bf)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let again: Vec<bf16> = cast(&cast::<bf16, f64>(&bf));
    assert!(again
        .iter()
        .zip(&bf)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let again: Vec<f16> = cast(&cast::<f16, f32>(&hf));
    assert!(again
        .iter()
        .zip(&hf)
        .all(|(a, h)| a.to_bits() == h.to_bits()));
    let again: Vec<f16> = cast(&cast::<f16, f64>(&hf));
    assert!(again
        .iter()
        .zip(&hf)
        .all(|(a, h)| a.to_bits() == h.to_bits()));
}

#[test]
fn nan_and_infinities_survive() {
    let xs = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0];
    let b: Vec<bf16> = cast(&xs);
    assert!(b[0].is_nan());
    assert_eq!(b[1], bf16::INFINITY);
    assert_eq!(b[2], bf16::NEG_INFINITY);
    assert_eq!(b[3].to_bits(), 0x8000);
    let h: Vec<f16> = cast(&xs);
    assert!(h[0].is_nan());
    assert_eq!(h[1], f16::INFINITY);
    assert_eq!(h[3].to_bits(), 0x8000);
}

#[test]
fn same_type_cast_copies_bits() {
    let xs = [f32::from_bits(0x7FC0_1234), 1.5, -0.0];
    let mut out = [0f32; 3];
    cast_into(&xs, &mut out).unwrap();
    assert_eq!(out.map(f32::to_bits), xs.map(f32::to_bits));
}
