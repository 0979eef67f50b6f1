//! The scalar functions of `cu/nn.cu` (e^x, ln x, erfc and the normal CDF and density) with
//! the kernels' operations in the kernels' order: IEEE f32 additions, products and divisions
//! (Rust rounds each one and never fuses a multiply-add), so the twins equal the kernels
//! bitwise.

const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `2^k` for `k` in `[-126, 127]`.
fn pow2i(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// `b` if `b > a`, else `a` (the kernels' maximum: a NaN `b` is skipped, a NaN `a` kept).
pub(crate) fn max_of(a: f32, b: f32) -> f32 {
    if b > a {
        b
    } else {
        a
    }
}

/// `e^x`: `k = round(x/ln 2)`, `r = x − k·ln 2` (two-part `ln 2`), a degree-7 Taylor polynomial
/// (relative error below 4e-7), times `2^k` in two exact steps.
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > 88.722_83 {
        return f32::INFINITY;
    }
    if x < -103.972_08 {
        return 0.0;
    }
    let kf = (x * LOG2E + ROUND_MAGIC) - ROUND_MAGIC;
    let r = (x - kf * LN2_HI) - kf * LN2_LO;
    let mut p = 1.984_127e-4f32;
    for c in [
        1.388_888_9e-3f32,
        8.333_334e-3,
        4.166_666_8e-2,
        1.666_666_7e-1,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    let k = kf as i32;
    let k1 = k / 2;
    (p * pow2i(k1)) * pow2i(k - k1)
}

/// `ln x`: `x = m·2^e` with `m` in `[√½, √2)`, `ln m = 2·atanh(s)`, `s = (m−1)/(m+1)`, by its
/// series to `s⁹` (error below 1e-9 on `ln m`).
pub fn ln(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < 0.0 {
        return f32::NAN;
    }
    if x == 0.0 {
        return f32::NEG_INFINITY;
    }
    if x == f32::INFINITY {
        return x;
    }
    let (mut x, mut e) = (x, 0i32);
    if x < f32::MIN_POSITIVE {
        x *= 8_388_608.0;
        e = -23;
    }
    let u = x.to_bits();
    e += ((u >> 23) & 0xff) as i32 - 127;
    let mut m = f32::from_bits((u & 0x7f_ffff) | 0x3f80_0000);
    if m > std::f32::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let mut p = 0.222_222_22f32;
    for c in [0.285_714_3f32, 0.4, 0.666_666_7, 2.0] {
        p = p * s2 + c;
    }
    let ef = e as f32;
    ef * LN2_HI + (ef * LN2_LO + p * s)
}

/// `erfc(z)` for `z ≥ 0`: the Chebyshev fit `t·e^(−z² + P(t))`, `t = 1/(1 + z/2)` (Numerical
/// Recipes' `erfcc`, relative error below 1.2e-7 before f32 rounding).
pub fn erfc(z: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut p = 0.170_872_77f32;
    for c in [
        -0.822_152_23f32,
        1.488_515_9,
        -1.135_204,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_7,
        -1.265_512_2,
    ] {
        p = p * t + c;
    }
    t * exp(-(z * z) + p)
}

/// The standard normal CDF `Φ(x) = erfc(−x/√2)/2`.
pub fn normal_cdf(x: f32) -> f32 {
    let h = 0.5 * erfc(x.abs() * std::f32::consts::FRAC_1_SQRT_2);
    if x < 0.0 {
        h
    } else {
        1.0 - h
    }
}

/// The standard normal density `e^(−x²/2)/√(2π)`.
pub fn normal_pdf(x: f32) -> f32 {
    exp(-0.5 * (x * x)) * 0.398_942_3
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: f32, b: f64) -> f64 {
        ((f64::from(a) - b) / b).abs()
    }

    #[test]
    fn functions_are_accurate_against_f64() {
        let mut worst = [0.0f64; 4];
        for i in 0..200_000 {
            let x = -87.0 + 175.0 * (i as f32 / 200_000.0); // normal results
            worst[0] = worst[0].max(rel(exp(x), f64::from(x).exp()));
            let y = (i as f32 + 0.5) * 1e-3;
            worst[1] = worst[1].max((f64::from(ln(y)) - f64::from(y).ln()).abs());
            let z = i as f32 * 4e-5 - 4.0;
            let cdf = 0.5 * libm_erfc(-f64::from(z) / std::f64::consts::SQRT_2);
            worst[2] = worst[2].max(rel(normal_cdf(z), cdf));
            let pdf = (-0.5 * f64::from(z).powi(2)).exp() * 0.398_942_280_401_432_7;
            worst[3] = worst[3].max(rel(normal_pdf(z), pdf));
        }
        assert!(worst[0] < 5e-7, "exp: {}", worst[0]);
        assert!(worst[1] < 2e-6, "ln (absolute): {}", worst[1]);
        assert!(worst[2] < 2e-6, "cdf: {}", worst[2]);
        assert!(worst[3] < 2e-6, "pdf: {}", worst[3]);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(ln(1.0), 0.0);
        assert_eq!(ln(0.0), f32::NEG_INFINITY);
        assert!(ln(-1.0).is_nan() && exp(f32::NAN).is_nan());
        assert!(rel(ln(1e-40), 1e-40f64.ln()) < 1e-6);
        // A subnormal result: within one unit of 2^-149 of the exact value.
        let sub = (f64::from(exp(-100.0)) - (-100.0f64).exp()).abs();
        assert!(sub <= f64::from(f32::from_bits(1)), "exp(-100): {sub}");
    }

    /// erfc in f64 by its continued fraction / series (an independent reference).
    fn libm_erfc(x: f64) -> f64 {
        // erf by its Taylor series for |x| < 3, erfc by the Laplace continued fraction beyond.
        if x.abs() < 3.0 {
            let (mut term, mut sum, mut k) = (x, x, 0.0f64);
            while term.abs() > 1e-18 * sum.abs().max(1e-300) {
                k += 1.0;
                term *= -x * x / k;
                sum += term / (2.0 * k + 1.0);
            }
            1.0 - sum * 2.0 / std::f64::consts::PI.sqrt()
        } else if x > 0.0 {
            let mut f = 0.0f64;
            for k in (1..60).rev() {
                f = f64::from(k) / 2.0 / (x + f);
            }
            (-x * x).exp() / (x + f) / std::f64::consts::PI.sqrt()
        } else {
            2.0 - libm_erfc(-x)
        }
    }
}
