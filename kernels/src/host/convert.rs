//! The 16-bit conversions of `cu/common.cuh`, in Rust, bit for bit (round to nearest even).

/// bf16 bits to f32 (exact).
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// f16 bits to f32 (exact).
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits & 0x8000) << 16;
    let exp = u32::from((bits >> 10) & 0x1f);
    let man = u32::from(bits & 0x3ff);
    if exp == 0x1f {
        return f32::from_bits(sign | 0x7f80_0000 | (man << 13));
    }
    if exp == 0 {
        let mag = man as f32 * 5.960_464_5e-8; // man · 2^-24, exact
        return f32::from_bits(sign | mag.to_bits());
    }
    f32::from_bits(sign | ((exp + 112) << 23) | (man << 13))
}

/// Round the kept bits `q` by the dropped `rem` of `shift` bits: nearest, ties to even.
fn round_kept(q: u32, rem: u32, shift: u32) -> u32 {
    let half = 1u32 << (shift - 1);
    if rem > half || (rem == half && q & 1 == 1) {
        q + 1
    } else {
        q
    }
}

/// f32 to bf16 bits, round to nearest even; NaN stays NaN (quiet, payload's top kept).
pub fn f32_to_bf16(v: f32) -> u16 {
    let x = v.to_bits();
    if x & 0x7fff_ffff > 0x7f80_0000 {
        return ((x >> 16) | 0x0040) as u16;
    }
    round_kept(x >> 16, x & 0xffff, 16) as u16
}

/// f32 to f16 bits, round to nearest even (overflow to infinity, gradual underflow).
pub fn f32_to_f16(v: f32) -> u16 {
    let x = v.to_bits();
    let sign = (x >> 16) & 0x8000;
    let a = x & 0x7fff_ffff;
    let bits = if a > 0x7f80_0000 {
        sign | 0x7e00 | ((a >> 13) & 0x3ff)
    } else if a >= 0x4780_0000 {
        sign | 0x7c00
    } else if a >= 0x3880_0000 {
        let kept = (((a >> 23) - 112) << 10) | ((a & 0x7f_ffff) >> 13);
        sign | round_kept(kept, a & 0x1fff, 13)
    } else if a > 0x3300_0000 {
        let m = (a & 0x7f_ffff) | 0x80_0000;
        let shift = 126 - (a >> 23);
        sign | round_kept(m >> shift, m & ((1 << shift) - 1), shift)
    } else {
        sign
    };
    bits as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Equal bits, or both NaN with equal bits after `half`'s NaN conversion.
    fn same16(a: u16, b: u16) -> bool {
        a == b
    }

    #[test]
    fn widening_matches_half_for_every_value() {
        for bits in 0..=u16::MAX {
            let (ours, theirs) = (bf16_to_f32(bits), bf16::from_bits(bits).to_f32());
            assert!(ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()));
            let (ours, theirs) = (f16_to_f32(bits), f16::from_bits(bits).to_f32());
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "f16 {bits:#06x}: {ours:e} vs {theirs:e}"
            );
        }
    }

    /// f32 values on every exponent: the ties, their neighbours, and a pseudo-random spread of
    /// significands (a splitmix64 sequence).
    fn samples() -> Vec<f32> {
        let mut out = Vec::new();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        for sign in [0u32, 0x8000_0000] {
            for exp in 0..=255u32 {
                let base = sign | (exp << 23);
                for man in [
                    0u32, 1, 0x1000, 0xfff, 0x1001, 0x3000, 0x8000, 0x7fff, 0x8001,
                ]
                .into_iter()
                .chain([0x1_8000, 0x7f_ffff, 0x7f_e000, 0x40_0000])
                {
                    out.push(f32::from_bits(base | man));
                }
                for _ in 0..2000 {
                    out.push(f32::from_bits(base | (next() as u32 & 0x7f_ffff)));
                }
            }
        }
        out
    }

    #[test]
    fn narrowing_matches_half_on_every_exponent() {
        for v in samples() {
            let (ours, theirs) = (f32_to_bf16(v), bf16::from_f32(v).to_bits());
            assert!(
                same16(ours, theirs),
                "bf16 of {:#010x}: {ours:#06x} vs {theirs:#06x}",
                v.to_bits()
            );
            let (ours, theirs) = (f32_to_f16(v), f16::from_f32(v).to_bits());
            assert!(
                same16(ours, theirs) || (v.is_nan() && f16_to_f32(ours).is_nan()),
                "f16 of {:#010x}: {ours:#06x} vs {theirs:#06x}",
                v.to_bits()
            );
        }
    }

    #[test]
    fn narrowing_is_the_nearest_even_against_f64() {
        // Independent of `half`: the exact midpoints between neighbours round to even.
        for bits in (0x3c00u16..0x3c20).chain(0x0001..0x0020) {
            let lo = f64::from(f16_to_f32(bits));
            let hi = f64::from(f16_to_f32(bits + 1));
            let mid = ((lo + hi) / 2.0) as f32; // exact: f16 midpoints fit in f32
            let even = if bits % 2 == 0 { bits } else { bits + 1 };
            assert_eq!(f32_to_f16(mid), even, "midpoint above {bits:#06x}");
            assert_eq!(f32_to_f16(f32::from_bits(mid.to_bits() + 1)), bits + 1);
            assert_eq!(f32_to_f16(f32::from_bits(mid.to_bits() - 1)), bits);
        }
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // the tie above the largest finite rounds up
        assert_eq!(f32_to_f16(65519.99), 0x7bff);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0); // tie with zero: even
        assert_eq!(f32_to_f16(-(2f32.powi(-25) * 1.0001)), 0x8001);
    }
}
