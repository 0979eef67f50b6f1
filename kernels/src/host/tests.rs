//! The twins against independent references: the `half` crate's conversions and
//! `fsdp_device::Element`'s arithmetic (what the host ring reduces with).

use super::*;
use fsdp_device::Element;

/// A splitmix64 stream of values with varied exponents, signs, zeros, infinities and NaNs.
pub(crate) fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut state = seed;
    (0..n)
        .map(|i| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            match i % 97 {
                0 => 0.0,
                1 => -0.0,
                2 => f64::INFINITY,
                3 => f64::NAN,
                _ => {
                    let unit = (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
                    unit * 2f64.powi(((z & 0x1f) as i32) - 16)
                }
            }
        })
        .collect()
}

fn same<T: KernelFloat>(a: T, b: T) -> bool {
    a.bits() == b.bits() || (a.is_nan() && b.is_nan())
}

fn reduce_matches_element<T: KernelFloat + Element>() {
    let a: Vec<T> = values(5000, 1).into_iter().map(T::from_f64).collect();
    let b: Vec<T> = values(5000, 2).into_iter().map(T::from_f64).collect();
    for op in ReduceKind::ALL {
        for finish in [None, Some(3)] {
            let mut dst = vec![T::default(); a.len()];
            reduce(op, &mut dst, &a, &b, finish).unwrap();
            let mut in_place = b.clone();
            reduce_in_place(op, &mut in_place, &a, finish).unwrap();
            for i in 0..a.len() {
                let (x, y) = (a[i], b[i]);
                let mut want = match op {
                    ReduceKind::Sum | ReduceKind::Avg => x.add(y),
                    ReduceKind::Min => x.min_nan(y),
                    ReduceKind::Max => x.max_nan(y),
                    ReduceKind::Product => x.mul(y),
                };
                if let (ReduceKind::Avg, Some(n)) = (op, finish) {
                    want = want.div_count(n as usize);
                }
                assert!(
                    same(dst[i], want),
                    "{op:?} {finish:?} {}: {x:?} {y:?}",
                    T::NAME
                );
                assert!(same(in_place[i], want));
                // min/max of a NaN: the canonical NaN, bit for bit.
                if matches!(op, ReduceKind::Min | ReduceKind::Max) {
                    assert_eq!(dst[i].bits(), want.bits());
                }
            }
        }
    }
}

#[test]
fn reductions_match_the_host_ring_arithmetic() {
    reduce_matches_element::<f32>();
    reduce_matches_element::<f64>();
    reduce_matches_element::<bf16>();
    reduce_matches_element::<f16>();
}

#[test]
fn casts_match_half() {
    let src: Vec<f32> = values(20_000, 3).into_iter().map(|v| v as f32).collect();
    let mut b = vec![bf16::default(); src.len()];
    let mut h = vec![f16::default(); src.len()];
    cast(&src, &mut b).unwrap();
    cast(&src, &mut h).unwrap();
    let mut back = vec![0.0f32; src.len()];
    for i in 0..src.len() {
        assert!(same(b[i], bf16::from_f32(src[i])));
        assert!(same(h[i], f16::from_f32(src[i])));
    }
    cast(&h, &mut back).unwrap();
    for i in 0..src.len() {
        assert!(same(back[i], h[i].to_f32()));
    }
    let mut hb = vec![bf16::default(); src.len()];
    cast(&h, &mut hb).unwrap();
    for i in 0..src.len() {
        assert!(same(hb[i], bf16::from_f32(h[i].to_f32())));
    }
    assert!(matches!(
        cast(&src, &mut back[..3]),
        Err(KernelError::Length { .. })
    ));
}

#[test]
fn axpby_rounds_each_operation() {
    let x: Vec<f32> = values(4000, 4).into_iter().map(|v| v as f32).collect();
    let y0: Vec<f32> = values(4000, 5).into_iter().map(|v| v as f32).collect();
    let (alpha, beta) = (0.3f32, -1.7f32);
    let mut y = y0.clone();
    axpby(alpha, &x, beta, &mut y).unwrap();
    let mut yb: Vec<bf16> = y0.iter().map(|&v| bf16::from_f32(v)).collect();
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    axpby(alpha, &xb, beta, &mut yb).unwrap();
    for i in 0..x.len() {
        let want = alpha * x[i] + beta * y0[i];
        assert!(same(y[i], want));
        let wantb = bf16::from_f32(alpha * xb[i].to_f32() + beta * bf16::from_f32(y0[i]).to_f32());
        assert!(same(yb[i], wantb));
    }
    let mut z = vec![1.0f64; 5];
    memset(&mut z, -2.5);
    assert_eq!(z, vec![-2.5; 5]);
}

#[test]
fn sum_of_squares_is_the_sum_in_another_order() {
    for n in [0usize, 1, 255, 4096, 4097, 100_000, 1 << 20] {
        let x: Vec<f32> = values(n, 6)
            .into_iter()
            .map(|v| if v.is_finite() { v as f32 } else { 0.5 })
            .collect();
        let naive: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let twin = sum_of_squares(&x);
        assert!(
            (twin - naive).abs() <= 1e-12 * naive.max(f64::MIN_POSITIVE),
            "n {n}: {twin} vs {naive}"
        );
    }
    // Small integers: every order gives the exact sum.
    let x: Vec<f32> = (0..70_000).map(|i| (i % 13) as f32).collect();
    let exact: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    assert_eq!(sum_of_squares(&x), exact);
    assert!(sum_of_squares(&[1.0, f32::NAN]).is_nan());
}
