//! Every layer's backward against central finite differences of its forward, in `f64`, and
//! the accumulate (`+=`) semantics of the backward functions.
//!
//! Each check uses the scalar `L = Σ r ⊙ f(inputs)` with fixed random weights `r`, so that the
//! backward with `dy = r` must give `∂L/∂inputs`.

use fsdp_gpt::model::layers::{
    attention_backward, attention_forward, cross_entropy_backward, cross_entropy_forward,
    embedding_backward_positions, embedding_backward_tokens, embedding_forward, gelu_backward,
    gelu_forward, gemm, layernorm_backward_input, layernorm_backward_params, layernorm_forward,
    linear_backward_bias, linear_backward_input, linear_backward_weight, linear_forward,
};
use fsdp_gpt::model::SplitMix64;
use proptest::prelude::*;

const H: f64 = 1e-6;

fn randn(rng: &mut SplitMix64, n: usize, std: f64) -> Vec<f64> {
    (0..n).map(|_| rng.normal() * std).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Checks `analytic` against the central difference of `f` at `x`, element by element:
/// `|a − n| ≤ tol · max(1, max|n|)`.
fn check(what: &str, x: &[f64], f: impl Fn(&[f64]) -> f64, analytic: &[f64], tol: f64) {
    assert_eq!(x.len(), analytic.len(), "{what}");
    let mut numeric = Vec::with_capacity(x.len());
    let mut xp = x.to_vec();
    for i in 0..x.len() {
        let orig = xp[i];
        xp[i] = orig + H;
        let up = f(&xp);
        xp[i] = orig - H;
        let down = f(&xp);
        xp[i] = orig;
        numeric.push((up - down) / (2.0 * H));
    }
    let scale = numeric.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    for (i, (a, n)) in analytic.iter().zip(&numeric).enumerate() {
        assert!(
            (a - n).abs() <= tol * scale,
            "{what}[{i}]: analytic {a}, finite difference {n}"
        );
    }
}

#[test]
fn linear_backward_matches_finite_differences() {
    let mut rng = SplitMix64::new(1);
    let (n, i, o) = (5, 7, 3);
    let x = randn(&mut rng, n * i, 1.0);
    let w = randn(&mut rng, o * i, 0.5);
    let b = randn(&mut rng, o, 0.5);
    let r = randn(&mut rng, n * o, 1.0);
    let fwd = |x: &[f64], w: &[f64], b: &[f64]| {
        let mut y = vec![0.0; n * o];
        linear_forward(x, w, Some(b), n, i, o, &mut y);
        dot(&y, &r)
    };
    // y = x·Wᵀ + b, checked directly once.
    let mut y = vec![0.0; n * o];
    linear_forward(&x, &w, Some(&b), n, i, o, &mut y);
    for row in 0..n {
        for col in 0..o {
            let want = b[col] + (0..i).map(|k| x[row * i + k] * w[col * i + k]).sum::<f64>();
            assert!((y[row * o + col] - want).abs() < 1e-12);
        }
    }
    let mut dx = vec![0.0; n * i];
    let mut dw = vec![0.0; o * i];
    let mut db = vec![0.0; o];
    linear_backward_input(&r, &w, n, i, o, &mut dx);
    linear_backward_weight(&r, &x, n, i, o, &mut dw);
    linear_backward_bias(&r, n, o, &mut db);
    check("linear dx", &x, |x| fwd(x, &w, &b), &dx, 1e-8);
    check("linear dw", &w, |w| fwd(&x, w, &b), &dw, 1e-8);
    check("linear db", &b, |b| fwd(&x, &w, b), &db, 1e-8);
    // Without bias the output is x·Wᵀ only.
    let mut y0 = vec![f64::NAN; n * o];
    linear_forward(&x, &w, None, n, i, o, &mut y0);
    for (a, (yb, bb)) in y0.iter().zip(y.iter().zip(b.iter().cycle())) {
        assert!((a - (yb - bb)).abs() < 1e-12);
    }
}

#[test]
fn backward_functions_accumulate() {
    let mut rng = SplitMix64::new(2);
    let (n, i, o) = (4, 3, 5);
    let x = randn(&mut rng, n * i, 1.0);
    let w = randn(&mut rng, o * i, 1.0);
    let r = randn(&mut rng, n * o, 1.0);
    let start = randn(&mut rng, o * i, 1.0);
    let mut once = vec![0.0; o * i];
    linear_backward_weight(&r, &x, n, i, o, &mut once);
    let mut acc = start.clone();
    linear_backward_weight(&r, &x, n, i, o, &mut acc);
    linear_backward_weight(&r, &x, n, i, o, &mut acc);
    for ((a, s), g) in acc.iter().zip(&start).zip(&once) {
        assert!((a - (s + 2.0 * g)).abs() < 1e-12);
    }
    let mut dx = vec![1.0; n * i];
    let mut dx1 = vec![0.0; n * i];
    linear_backward_input(&r, &w, n, i, o, &mut dx);
    linear_backward_input(&r, &w, n, i, o, &mut dx1);
    for (a, g) in dx.iter().zip(&dx1) {
        assert!((a - (1.0 + g)).abs() < 1e-12);
    }
    let xs = randn(&mut rng, 10, 1.0);
    let mut d = vec![3.0; 10];
    let mut d1 = vec![0.0; 10];
    gelu_backward(&xs, &xs, &mut d);
    gelu_backward(&xs, &xs, &mut d1);
    for (a, g) in d.iter().zip(&d1) {
        assert!((a - (3.0 + g)).abs() < 1e-12);
    }
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    let mut rng = SplitMix64::new(3);
    let (n, e) = (4, 9);
    // Rows with an offset and different spreads.
    let x: Vec<f64> = randn(&mut rng, n * e, 1.0)
        .iter()
        .enumerate()
        .map(|(k, v)| v * (1.0 + (k / e) as f64) + 0.7)
        .collect();
    let w = randn(&mut rng, e, 1.0);
    let b = randn(&mut rng, e, 1.0);
    let r = randn(&mut rng, n * e, 1.0);
    let eps = 1e-5;
    let fwd = |x: &[f64], w: &[f64], b: &[f64]| {
        let mut y = vec![0.0; n * e];
        let (mut m, mut s) = (vec![0.0; n], vec![0.0; n]);
        layernorm_forward(x, w, b, n, e, eps, &mut y, &mut m, &mut s);
        dot(&y, &r)
    };
    let mut y = vec![0.0; n * e];
    let (mut m, mut s) = (vec![0.0; n], vec![0.0; n]);
    layernorm_forward(&x, &w, &b, n, e, eps, &mut y, &mut m, &mut s);
    // Normalised rows: with w = 1, b = 0 the output has mean 0 and (biased) variance ≈ 1.
    let ones = vec![1.0; e];
    let zeros = vec![0.0; e];
    let mut yn = vec![0.0; n * e];
    let (mut m2, mut s2) = (vec![0.0; n], vec![0.0; n]);
    layernorm_forward(&x, &ones, &zeros, n, e, eps, &mut yn, &mut m2, &mut s2);
    for row in yn.chunks(e) {
        let mean = row.iter().sum::<f64>() / e as f64;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / e as f64;
        assert!(
            mean.abs() < 1e-12 && (var - 1.0).abs() < 1e-4,
            "{mean} {var}"
        );
    }
    let mut dx = vec![0.0; n * e];
    let mut dw = vec![0.0; e];
    let mut db = vec![0.0; e];
    layernorm_backward_input(&x, &m, &s, &w, &r, n, e, &mut dx);
    layernorm_backward_params(&x, &m, &s, &r, n, e, &mut dw, &mut db);
    check("layernorm dx", &x, |x| fwd(x, &w, &b), &dx, 1e-7);
    check("layernorm dw", &w, |w| fwd(&x, w, &b), &dw, 1e-8);
    check("layernorm db", &b, |b| fwd(&x, &w, b), &db, 1e-8);
}

#[test]
fn gelu_is_exact_and_its_backward_matches_finite_differences() {
    // Reference values of x·Φ(x) (PyTorch's exact GELU).
    let xs: [f64; 7] = [-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0];
    let want: [f64; 7] = [
        -0.004_049_694_094_890_31,
        -0.158_655_253_931_457_07,
        -0.154_268_769_362_993_44,
        0.0,
        0.345_731_230_637_006_56,
        0.841_344_746_068_542_9,
        2.995_950_305_905_11,
    ];
    let mut y = vec![0.0; xs.len()];
    gelu_forward(&xs, &mut y);
    for ((a, w), x) in y.iter().zip(want).zip(xs) {
        assert!((a - w).abs() < 1e-14, "gelu({x}) = {a}, want {w}");
    }
    let mut yf = vec![0.0f32; xs.len()];
    let xf: Vec<f32> = xs.iter().map(|&v| v as f32).collect();
    gelu_forward(&xf, &mut yf);
    for (a, w) in yf.iter().zip(want) {
        assert!((f64::from(*a) - w).abs() < 1e-6);
    }

    let mut rng = SplitMix64::new(4);
    let x = randn(&mut rng, 40, 2.0);
    let r = randn(&mut rng, 40, 1.0);
    let fwd = |x: &[f64]| {
        let mut y = vec![0.0; x.len()];
        gelu_forward(x, &mut y);
        dot(&y, &r)
    };
    let mut dx = vec![0.0; x.len()];
    gelu_backward(&x, &r, &mut dx);
    check("gelu dx", &x, fwd, &dx, 1e-8);
}

fn attention_case(b: usize, t: usize, heads: usize, e: usize, seed: u64) {
    let mut rng = SplitMix64::new(seed);
    let qkv = randn(&mut rng, b * t * 3 * e, 1.0);
    let r = randn(&mut rng, b * t * e, 1.0);
    let fwd = |qkv: &[f64]| {
        let mut att = vec![0.0; b * heads * t * t];
        let mut y = vec![0.0; b * t * e];
        attention_forward(qkv, b, t, heads, e, &mut att, &mut y);
        dot(&y, &r)
    };
    let mut att = vec![0.0; b * heads * t * t];
    let mut y = vec![0.0; b * t * e];
    attention_forward(&qkv, b, t, heads, e, &mut att, &mut y);

    // Against a direct, loop-by-loop causal attention.
    let d = e / heads;
    let scale = 1.0 / (d as f64).sqrt();
    for bi in 0..b {
        for h in 0..heads {
            for i in 0..t {
                let q = |s: usize, c: usize| qkv[(bi * t + s) * 3 * e + h * d + c];
                let k = |s: usize, c: usize| qkv[(bi * t + s) * 3 * e + e + h * d + c];
                let v = |s: usize, c: usize| qkv[(bi * t + s) * 3 * e + 2 * e + h * d + c];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| (0..d).map(|c| q(i, c) * k(j, c)).sum::<f64>() * scale)
                    .collect();
                let mx = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
                for c in 0..d {
                    let want: f64 = (0..=i).map(|j| (scores[j] - mx).exp() / z * v(j, c)).sum();
                    let got = y[(bi * t + i) * e + h * d + c];
                    assert!((got - want).abs() < 1e-12, "y[{bi},{i},{h},{c}]");
                }
                let row = &att[((bi * heads + h) * t + i) * t..][..t];
                assert!(row[i + 1..].iter().all(|&p| p == 0.0), "causal mask");
                assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
            }
        }
    }

    let mut dqkv = vec![0.0; b * t * 3 * e];
    attention_backward(&qkv, &att, &r, b, t, heads, e, &mut dqkv);
    check("attention dqkv", &qkv, fwd, &dqkv, 1e-7);
}

#[test]
fn attention_backward_matches_finite_differences() {
    attention_case(2, 5, 2, 8, 5);
    attention_case(1, 7, 3, 9, 6);
    attention_case(3, 1, 1, 4, 7);
}

#[test]
fn cross_entropy_backward_matches_finite_differences() {
    let mut rng = SplitMix64::new(8);
    let (n, v) = (6, 11);
    let logits: Vec<f64> = randn(&mut rng, n * v, 3.0);
    let targets: Vec<u32> = (0..n).map(|i| ((i * 7 + 3) % v) as u32).collect();
    let scale = 1.0 / 17.0;
    let fwd = |l: &[f64]| {
        let mut p = vec![0.0; n * v];
        cross_entropy_forward(l, &targets, n, v, &mut p) * scale
    };
    // Loss = Σ (logsumexp − logit[target]) computed directly.
    let mut probs = vec![0.0; n * v];
    let sum = cross_entropy_forward(&logits, &targets, n, v, &mut probs);
    let want: f64 = logits
        .chunks(v)
        .zip(&targets)
        .map(|(row, &tg)| row.iter().map(|x| x.exp()).sum::<f64>().ln() - row[tg as usize])
        .sum();
    assert!((sum - want).abs() < 1e-12);
    // Large logits do not overflow.
    let big = vec![1000.0, 0.0, -1000.0];
    let mut p = vec![0.0; 3];
    let l = cross_entropy_forward(&big, &[1], 1, 3, &mut p);
    assert!((l - 1000.0).abs() < 1e-9, "{l}");

    let mut dl = vec![0.0; n * v];
    cross_entropy_backward(&probs, &targets, n, v, scale, &mut dl);
    check("cross-entropy dlogits", &logits, fwd, &dl, 1e-8);
    // Each row's gradient sums to zero.
    for row in dl.chunks(v) {
        assert!(row.iter().sum::<f64>().abs() < 1e-12);
    }
}

#[test]
fn embedding_backward_matches_finite_differences() {
    let mut rng = SplitMix64::new(9);
    let (vocab, t, e, rows) = (7, 4, 3, 3);
    let wte = randn(&mut rng, vocab * e, 1.0);
    let wpe = randn(&mut rng, 6 * e, 1.0); // block size 6 > t: the last rows get no gradient
    let ids: Vec<u32> = vec![1, 3, 3, 0, 6, 1, 1, 2, 5, 3, 0, 1]; // repeats add up
    assert_eq!(ids.len(), rows * t);
    let r = randn(&mut rng, rows * t * e, 1.0);
    let fwd = |wte: &[f64], wpe: &[f64]| {
        let mut x = vec![0.0; rows * t * e];
        embedding_forward(&ids, t, wte, wpe, e, &mut x);
        dot(&x, &r)
    };
    let mut dwte = vec![0.0; vocab * e];
    let mut dwpe = vec![0.0; 6 * e];
    embedding_backward_tokens(&ids, &r, e, &mut dwte);
    embedding_backward_positions(t, &r, e, &mut dwpe);
    check("embedding dwte", &wte, |w| fwd(w, &wpe), &dwte, 1e-8);
    check("embedding dwpe", &wpe, |w| fwd(&wte, w), &dwpe, 1e-8);
    assert!(dwpe[t * e..].iter().all(|&g| g == 0.0));
    assert!(
        dwte[4 * e..5 * e].iter().all(|&g| g == 0.0),
        "token 4 is unused"
    );
}

fn naive_gemm(m: usize, n: usize, k: usize, a: &[f64], ta: bool, b: &[f64], tb: bool) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|p| {
                    let av = if ta { a[p * m + i] } else { a[i * k + p] };
                    let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                    av * bv
                })
                .sum();
        }
    }
    c
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn gemm_matches_the_naive_product(
        m in 1usize..9, n in 1usize..9, k in 1usize..9,
        ta in any::<bool>(), tb in any::<bool>(), seed in any::<u64>(),
        alpha in -2.0f64..2.0, beta in -2.0f64..2.0,
    ) {
        let mut rng = SplitMix64::new(seed);
        let a = randn(&mut rng, m * k, 1.0);
        let b = randn(&mut rng, k * n, 1.0);
        let c0 = randn(&mut rng, m * n, 1.0);
        let mut c = c0.clone();
        gemm(m, n, k, alpha, &a, ta, &b, tb, beta, &mut c);
        let p = naive_gemm(m, n, k, &a, ta, &b, tb);
        for i in 0..m * n {
            prop_assert!((c[i] - (alpha * p[i] + beta * c0[i])).abs() < 1e-12);
        }
        // f32 goes through sgemm with the same layout handling.
        let af: Vec<f32> = a.iter().map(|&v| v as f32).collect();
        let bf: Vec<f32> = b.iter().map(|&v| v as f32).collect();
        let mut cf = vec![f32::NAN; m * n]; // beta = 0 ignores the old contents
        gemm(m, n, k, 1.0f32, &af, ta, &bf, tb, 0.0, &mut cf);
        for i in 0..m * n {
            prop_assert!((f64::from(cf[i]) - p[i]).abs() < 1e-4);
        }
    }
}

#[test]
fn fast_f32_exp_and_normal_cdf_are_accurate() {
    use fsdp_gpt::model::layers::{exp_f32, normal_cdf_pdf_f32, Real};
    // exp_f32: relative error below 2e-7 over its whole range.
    let mut worst = 0.0f64;
    let mut x = -87.0f32;
    while x <= 88.0 {
        let want = f64::from(x).exp();
        worst = worst.max((f64::from(exp_f32(x)) - want).abs() / want);
        x += 0.0137;
    }
    assert!(worst < 2e-7, "exp_f32 relative error {worst:e}");
    assert_eq!(exp_f32(0.0), 1.0);
    assert!(exp_f32(f32::NAN).is_nan());
    assert!(exp_f32(-1000.0) >= 0.0 && exp_f32(-1000.0) < 1e-37);
    assert!(exp_f32(1000.0).is_finite() && exp_f32(1000.0) > 1e38);

    // Φ and φ in f32 against the exact f64 values.
    let (mut e_cdf, mut e_pdf) = (0.0f64, 0.0f64);
    for i in -10_000..=10_000 {
        let x = i as f32 * 1e-3;
        let (c, p) = normal_cdf_pdf_f32(x);
        let (wc, wp) = f64::from(x).normal_cdf_pdf();
        e_cdf = e_cdf.max((f64::from(c) - wc).abs());
        e_pdf = e_pdf.max((f64::from(p) - wp).abs());
    }
    assert!(e_cdf <= 4e-7, "Φ error {e_cdf:e}");
    assert!(e_pdf <= 1e-7, "φ error {e_pdf:e}");
    let (c, p) = normal_cdf_pdf_f32(f32::NAN);
    assert!(c.is_nan() && p.is_nan());
    assert_eq!(normal_cdf_pdf_f32(50.0).0, 1.0);
    assert!(normal_cdf_pdf_f32(-50.0).0 < 1e-30);

    // The f32 GELU and its backward against the f64 ones.
    let xs: Vec<f64> = (-800..=800).map(|i| f64::from(i) * 0.01).collect();
    let xf: Vec<f32> = xs.iter().map(|&v| v as f32).collect();
    let (mut y64, mut y32) = (vec![0.0; xs.len()], vec![0.0f32; xs.len()]);
    gelu_forward(&xs, &mut y64);
    gelu_forward(&xf, &mut y32);
    let (mut d64, mut d32) = (vec![0.0; xs.len()], vec![0.0f32; xs.len()]);
    gelu_backward(&xs, &vec![1.0; xs.len()], &mut d64);
    gelu_backward(&xf, &vec![1.0f32; xs.len()], &mut d32);
    for i in 0..xs.len() {
        let tol = 4e-7 * xs[i].abs().max(1.0);
        assert!((f64::from(y32[i]) - y64[i]).abs() <= tol, "gelu({})", xs[i]);
        assert!(
            (f64::from(d32[i]) - d64[i]).abs() <= tol,
            "gelu'({})",
            xs[i]
        );
    }
}
