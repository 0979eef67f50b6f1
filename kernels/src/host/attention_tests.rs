//! The fused attention's twins against attention computed the textbook way in f64: the
//! `t × t` scores, a causal softmax and its gradient, the products.

use super::*;
use half::bf16;

/// Uniform values in [-1, 1) from a splitmix64 stream, rounded to `H`.
fn inputs<H: CastFloat>(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            round::<H>(((z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32)
        })
        .collect()
}

/// Attention in f64: `y`, and the gradients `[dq, dk, dv]` of `Σ dout·y`.
fn reference(a: &FusedAttention, q: &[f32], k: &[f32], v: &[f32], dout: &[f32]) -> [Vec<f64>; 4] {
    let (t, d, scale) = (a.t, a.d, f64::from(a.scale));
    let mut out = [
        vec![0.0; a.len()],
        vec![0.0; a.len()],
        vec![0.0; a.len()],
        vec![0.0; a.len()],
    ];
    let x = |s: &[f32], p: usize, i: usize, c: usize| f64::from(s[(p * t + i) * d + c]);
    for p in 0..a.pairs {
        for i in 0..t {
            let s: Vec<f64> = (0..=i)
                .map(|j| (0..d).map(|c| x(q, p, i, c) * x(k, p, j, c)).sum::<f64>() * scale)
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|s| (s - m).exp()).collect();
            let l: f64 = e.iter().sum();
            let pr: Vec<f64> = e.iter().map(|e| e / l).collect();
            let dp: Vec<f64> = (0..=i)
                .map(|j| (0..d).map(|c| x(dout, p, i, c) * x(v, p, j, c)).sum())
                .collect();
            let rowsum: f64 = pr.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
            for j in 0..=i {
                let ds = pr[j] * (dp[j] - rowsum) * scale;
                for c in 0..d {
                    let (ii, jj) = ((p * t + i) * d + c, (p * t + j) * d + c);
                    out[0][ii] += pr[j] * x(v, p, j, c);
                    out[1][ii] += ds * x(k, p, j, c);
                    out[2][jj] += ds * x(q, p, i, c);
                    out[3][jj] += pr[j] * x(dout, p, i, c);
                }
            }
        }
    }
    out
}

/// The largest `|got − want|` over the largest `|want|`.
fn error(got: &[f32], want: &[f64]) -> f64 {
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - w).abs())
        .fold(0.0, f64::max);
    worst / want.iter().map(|w| w.abs()).fold(1e-30, f64::max)
}

/// Runs both twins on random inputs and returns the errors of `[y, dq, dk, dv]` against the
/// reference, and whether `lse` is the rows' log-sum-exp.
fn errors<H: CastFloat>(a: FusedAttention) -> [f64; 4] {
    let n = a.len();
    let (q, k, v, dout) = (
        inputs::<H>(n, 1),
        inputs::<H>(n, 2),
        inputs::<H>(n, 3),
        inputs::<H>(n, 4),
    );
    let (mut y, mut lse) = (vec![f32::NAN; n], vec![f32::NAN; a.rows()]);
    flash_forward::<H>(&a, &q, &k, &v, &mut y, &mut lse).unwrap();
    // `y` as the projection's operand: token rows of the pairs' heads (one sequence, `pairs`
    // heads), rounded to `H` as the model hands it over.
    let layout = HeadsLayout {
        b: 1,
        t: a.t,
        h: a.pairs,
        d: a.d,
        row: a.pairs * a.d + 3,
        offset: 2,
    };
    let mut rows = vec![0.0f32; layout.rows_len()];
    for p in 0..a.pairs {
        for i in 0..a.t {
            for c in 0..a.d {
                rows[i * layout.row + 2 + p * a.d + c] = round::<H>(y[(p * a.t + i) * a.d + c]);
            }
        }
    }
    let mut dsum = vec![f32::NAN; a.rows()];
    flash_backward_dot(&layout, &dout, &rows, &mut dsum).unwrap();
    let mut g = [vec![f32::NAN; n], vec![f32::NAN; n], vec![f32::NAN; n]];
    let [dq, dk, dv] = &mut g;
    flash_backward::<H>(&a, &q, &k, &v, &dout, &lse, &dsum, dq, dk, dv).unwrap();
    let want = reference(&a, &q, &k, &v, &dout);
    // lse2 against log₂ Σ_j 2^(s2_j), in f64.
    for p in 0..a.pairs {
        for i in 0..a.t {
            let x = |s: &[f32], j: usize, c: usize| f64::from(s[(p * a.t + j) * a.d + c]);
            let s2 = |j: usize| {
                (0..a.d).map(|c| x(&q, i, c) * x(&k, j, c)).sum::<f64>() * f64::from(a.scale2())
            };
            let exact = (0..=i).map(|j| s2(j).exp2()).sum::<f64>().log2();
            let got = f64::from(lse[p * a.t + i]);
            assert!(
                (got - exact).abs() <= 1e-5 * exact.abs().max(1.0),
                "lse {got} {exact}"
            );
        }
    }
    [
        error(&y, &want[0]),
        error(&g[0], &want[1]),
        error(&g[1], &want[2]),
        error(&g[2], &want[3]),
    ]
}

#[test]
fn f32_operands_give_attention_and_its_gradients() {
    // d odd and t of no particular multiple: the twins take any shape.
    let e = errors::<f32>(FusedAttention {
        pairs: 3,
        t: 37,
        d: 5,
        scale: 1.0 / 5f32.sqrt(),
    });
    // Only f32 rounding: sums of at most 37 terms and exp2's error.
    for (what, e) in ["y", "dq", "dk", "dv"].iter().zip(e) {
        assert!(e < 2e-6, "{what}: {e:e}");
    }
}

#[test]
fn bf16_operands_stay_within_the_rounding_of_p_and_ds() {
    let a = FusedAttention {
        pairs: 2,
        t: 70,
        d: 16,
        scale: 0.25,
    };
    let e = errors::<bf16>(a);
    // P rounded to bf16 is within 2⁻⁹ of itself, so y = Σ P·v (weights summing to 1) is
    // within 2⁻⁹·max|v| ≤ 2⁻⁹ of the exact one; y's operand (rounded, another 2⁻⁹) feeds
    // dsum. dS's rounding adds 2⁻⁹ of each term, and the gradients are sums of such terms
    // whose signs vary, so they stay within a few 2⁻⁹ of their largest value: the bound 2⁻⁶
    // leaves a margin of 8 over that, and f32 operands (above) are 4 orders tighter.
    for (what, e) in ["y", "dq", "dk", "dv"].iter().zip(e) {
        assert!(e < 1.0 / 64.0, "{what}: {e:e}");
        assert!(
            e > 1e-6,
            "{what}: {e:e}: the rounding to bf16 did not happen"
        );
    }
}

#[test]
fn the_lengths_are_checked() {
    let a = FusedAttention {
        pairs: 2,
        t: 4,
        d: 3,
        scale: 1.0,
    };
    let x = vec![0.0; a.len()];
    let (mut y, mut lse) = (vec![0.0; a.len()], vec![0.0; a.rows() - 1]);
    let err = flash_forward::<f32>(&a, &x, &x, &x, &mut y, &mut lse).unwrap_err();
    assert!(err.to_string().contains("lse"), "{err}");
    let short = vec![0.0; a.len() - 1];
    let mut lse = vec![0.0; a.rows()];
    let err = flash_forward::<f32>(&a, &x, &short, &x, &mut y, &mut lse).unwrap_err();
    assert!(err.to_string().contains('k'), "{err}");
}
