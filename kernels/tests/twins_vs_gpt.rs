//! The nn twins (`fsdp_kernels::host::nn`) against the CPU GPT's layers (`fsdp_gpt::model::
//! layers`, matched to PyTorch by that crate's golden tests), the independent reference.
//!
//! - Against the layers run in **f64** on the same inputs (exact `erf` and `exp`): every output
//!   and gradient within `|twin − ref| ≤ 2e-5·|ref| + 2e-6·max|ref|` (the twins compute in f32
//!   in another order, with their own e^x, ln and erfc of relative error ≤ 4e-7).
//! - Against the layers in **f32**, bitwise where the twin uses the layer's own order and
//!   expressions: embedding forward and both backward parts. (The bias gradient and layer
//!   norm's parameter gradients sum their rows in groups, as the GPU does, and are checked
//!   against f64.)

mod common;

use common::{bits, data};
use fsdp_gpt::model::layers as gpt;
use fsdp_kernels::host::nn;
use fsdp_kernels::KernelError;

fn wide(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// Asserts `|a − b| ≤ 2e-5·|b| + 2e-6·max|b|` element-wise; returns the worst relative error.
#[track_caller]
fn close(what: &str, twin: &[f32], reference: &[f64]) -> f64 {
    assert_eq!(twin.len(), reference.len(), "{what}: lengths");
    let top = reference.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let mut worst = 0.0f64;
    for (i, (&a, &b)) in twin.iter().zip(reference).enumerate() {
        let err = (f64::from(a) - b).abs();
        assert!(
            err <= 2e-5 * b.abs() + 2e-6 * top,
            "{what} [{i}]: twin {a} vs reference {b} (max |ref| {top})"
        );
        if b != 0.0 {
            worst = worst.max(err / b.abs());
        }
    }
    worst
}

#[test]
fn layernorm_matches_the_gpt() {
    for (n, c) in [(5usize, 48usize), (7, 300), (3, 768), (70, 40)] {
        let x: Vec<f32> = data(n * c, 1, 3.0).iter().map(|v| v + 0.5).collect();
        let (w, b) = (data(c, 2, 1.0), data(c, 3, 0.5));
        let dy = data(n * c, 4, 1.0);
        let eps = 1e-5f32;
        let (mut y, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        nn::layernorm_forward(&x, &w, &b, eps, &mut y, &mut mean, &mut rstd).unwrap();
        let (xd, wd, bd, dyd) = (wide(&x), wide(&w), wide(&b), wide(&dy));
        let (mut yr, mut mr, mut rr) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        gpt::layernorm_forward(&xd, &wd, &bd, n, c, 1e-5, &mut yr, &mut mr, &mut rr);
        close("layernorm y", &y, &yr);
        close("layernorm mean", &mean, &mr);
        close("layernorm rstd", &rstd, &rr);

        // Backward accumulates: both start from the same nonzero gradients.
        let dx0 = data(n * c, 5, 0.1);
        let mut dx = dx0.clone();
        nn::layernorm_backward_input(&dy, &x, &w, &mean, &rstd, &mut dx).unwrap();
        let mut dxr = wide(&dx0);
        gpt::layernorm_backward_input(&xd, &mr, &rr, &wd, &dyd, n, c, &mut dxr);
        close("layernorm dx", &dx, &dxr);

        let (dw0, db0) = (data(c, 6, 0.1), data(c, 7, 0.1));
        let (mut dw, mut db) = (dw0.clone(), db0.clone());
        nn::layernorm_backward_params(&dy, &x, &mean, &rstd, &mut dw, &mut db).unwrap();
        let (mut dwr, mut dbr) = (wide(&dw0), wide(&db0));
        gpt::layernorm_backward_params(&xd, &mr, &rr, &dyd, n, c, &mut dwr, &mut dbr);
        close("layernorm dweight", &dw, &dwr);
        close("layernorm dbias", &db, &dbr);
    }
}

#[test]
fn gelu_matches_the_gpt() {
    let x = data(100_000, 11, 8.0);
    let dy = data(x.len(), 12, 2.0);
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    nn::gelu_forward(&x, &mut y).unwrap();
    nn::gelu_backward(&x, &dy, &mut dx).unwrap();
    let (xd, dyd) = (wide(&x), wide(&dy));
    let (mut yr, mut dxr) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    gpt::gelu_forward(&xd, &mut yr);
    gpt::gelu_backward(&xd, &dyd, &mut dxr);
    close("gelu y", &y, &yr);
    close("gelu dx", &dx, &dxr);
    // Where the reference's `1 + erf` does not cancel (|x| ≤ 5): relative error alone (the
    // derivative's root near x = −0.75 loses relative accuracy to cancellation).
    let inner: Vec<usize> = (0..x.len()).filter(|&i| x[i].abs() <= 5.0).collect();
    let pick = |v: &[f32]| inner.iter().map(|&i| v[i]).collect::<Vec<_>>();
    let pick64 = |v: &[f64]| inner.iter().map(|&i| v[i]).collect::<Vec<_>>();
    let rel = |a: &[f32], b: &[f64]| {
        a.iter()
            .zip(b)
            .filter(|(_, &b)| b != 0.0)
            .map(|(&a, &b)| ((f64::from(a) - b) / b).abs())
            .fold(0.0, f64::max)
    };
    let (wf, wb) = (rel(&pick(&y), &pick64(&yr)), rel(&pick(&dx), &pick64(&dxr)));
    println!("GELU on |x| <= 5: worst relative error {wf:.2e} forward, {wb:.2e} backward");
    assert!(
        wf < 2e-5 && wb < 1e-3,
        "GELU relative errors {wf:e}, {wb:e}"
    );
}

/// Attention with `d = t`, one head, `K = V = I`: the scores are `Q` itself, the output is the
/// probabilities (`Y = P·I`), `dP = dY` and `dQ = scale·dS`, so the GPT's attention exposes
/// its causal softmax and the softmax's backward.
#[test]
fn causal_softmax_matches_the_gpt_attention() {
    for (b, t) in [(3usize, 5usize), (2, 300)] {
        let e = t;
        let scale = 1.0 / (e as f32).sqrt();
        let q = data(b * t * t, 21, 6.0);
        let dp = data(b * t * t, 22, 1.0);
        let mut qkv = vec![0.0f64; b * t * 3 * e];
        for r in 0..b * t {
            let (row, i) = (&mut qkv[r * 3 * e..(r + 1) * 3 * e], r % t);
            for j in 0..e {
                row[j] = f64::from(q[r * t + j]);
            }
            row[e + i] = 1.0;
            row[2 * e + i] = 1.0;
        }
        let mut att = vec![0.0f64; b * t * t];
        let mut y = vec![0.0f64; b * t * e];
        gpt::attention_forward(&qkv, b, t, 1, e, &mut att, &mut y);
        let mut dqkv = vec![0.0f64; qkv.len()];
        gpt::attention_backward(&qkv, &att, &wide(&dp), b, t, 1, e, &mut dqkv);
        let ds_ref: Vec<f64> = (0..b * t * t)
            .map(|k| dqkv[(k / t) * 3 * e + k % t] / f64::from(scale))
            .collect();

        let mut p = vec![f32::NAN; b * t * t];
        nn::causal_softmax_forward(&q, t, scale, &mut p).unwrap();
        close("softmax p", &p, &att);
        assert!((0..b * t * t).all(|k| k % t <= (k / t) % t || p[k] == 0.0));
        let mut ds = vec![f32::NAN; b * t * t];
        nn::causal_softmax_backward(&p, &dp, t, scale, &mut ds).unwrap();
        let ds_unscaled: Vec<f32> = ds.iter().map(|v| v / scale).collect();
        close("softmax ds", &ds_unscaled, &ds_ref);
    }
}

#[test]
fn cross_entropy_matches_the_gpt() {
    for (n, v) in [(4usize, 10usize), (6, 1000)] {
        let logits = data(n * v, 31, 8.0);
        let targets: Vec<u32> = (0..n).map(|r| (r * 7919 % v) as u32).collect();
        let dloss = 1.0 / n as f32;
        let mut losses = vec![0.0; n];
        let mut dlogits = vec![0.0; n * v];
        nn::cross_entropy_fused(&logits, &targets, v, dloss, &mut losses, &mut dlogits).unwrap();
        let ld = wide(&logits);
        let mut probs = vec![0.0f64; n * v];
        let loss_ref: Vec<f64> = (0..n)
            .map(|r| {
                let row = &ld[r * v..(r + 1) * v];
                let p = &mut probs[r * v..(r + 1) * v];
                gpt::cross_entropy_forward(row, &targets[r..=r], 1, v, p)
            })
            .collect();
        let mut dref = vec![0.0f64; n * v];
        gpt::cross_entropy_backward(&probs, &targets, n, v, f64::from(dloss), &mut dref);
        close("cross-entropy losses", &losses, &loss_ref);
        close("cross-entropy dlogits", &dlogits, &dref);
    }
}

#[test]
fn embeddings_equal_the_gpt_bitwise() {
    let (vocab, c, t, seqs) = (50usize, 24usize, 8usize, 5usize);
    let n = t * seqs;
    let ids: Vec<u32> = (0..n).map(|r| ((r * r * 31 + 7) % vocab) as u32).collect();
    let (wte, wpe) = (data(vocab * c, 41, 1.0), data((t + 3) * c, 42, 1.0));
    let mut x = vec![0.0f32; n * c];
    nn::embedding_forward(&ids, &wte, &wpe, t, c, &mut x).unwrap();
    let mut xr = vec![0.0f32; n * c];
    gpt::embedding_forward(&ids, t, &wte, &wpe, c, &mut xr);
    assert_eq!(bits(&x), bits(&xr), "embedding forward");

    let dx = data(n * c, 43, 1.0);
    let (mut dwte, mut dwpe) = (data(vocab * c, 44, 0.1), data((t + 3) * c, 45, 0.1));
    let (mut dwte_r, mut dwpe_r) = (dwte.clone(), dwpe.clone());
    nn::embedding_backward_tokens(&ids, &dx, c, &mut dwte).unwrap();
    nn::embedding_backward_positions(&dx, t, c, &mut dwpe).unwrap();
    gpt::embedding_backward_tokens(&ids, &dx, c, &mut dwte_r);
    gpt::embedding_backward_positions(t, &dx, c, &mut dwpe_r);
    assert_eq!(bits(&dwte), bits(&dwte_r), "token embedding gradient");
    assert_eq!(bits(&dwpe), bits(&dwpe_r), "position embedding gradient");
    // Repeated ids did add up (the test is not vacuous).
    assert!(ids.iter().enumerate().any(|(i, a)| ids[..i].contains(a)));
}

/// The bias gradient, a column reduction in row groups (not the GPT's row order), against the
/// GPT's in f64; with more rows than groups, so that the groups' order matters.
#[test]
fn bias_grad_matches_the_gpt() {
    let (n, c) = (3 * nn::NN_COL_GROUPS + 5, 37usize);
    let dy = data(n * c, 46, 1.0);
    let db0 = data(c, 47, 0.1);
    let mut db = db0.clone();
    nn::bias_grad(&dy, &mut db).unwrap();
    let mut db_r = wide(&db0);
    gpt::linear_backward_bias(&wide(&dy), n, c, &mut db_r);
    close("bias gradient", &db, &db_r);
}

#[test]
fn bad_shapes_are_errors_and_bad_ids_give_nan() {
    let mut out = vec![0.0f32; 6];
    let e = nn::layernorm_forward(
        &[0.0; 6],
        &[1.0; 4],
        &[0.0; 4],
        1e-5,
        &mut out,
        &mut [0.0],
        &mut [0.0],
    );
    assert!(
        matches!(e, Err(KernelError::InvalidArgument { .. })),
        "{e:?}"
    );
    let e = nn::causal_softmax_forward(&[0.0; 8], 2, 1.0, &mut out);
    assert!(matches!(e, Err(KernelError::Length { .. })), "{e:?}");
    let e = nn::causal_softmax_forward(&[0.0; 6], 2, 1.0, &mut out);
    assert!(
        matches!(e, Err(KernelError::InvalidArgument { .. })),
        "{e:?}"
    );
    let e = nn::embedding_forward(&[0; 3], &[0.0; 8], &[0.0; 8], 2, 2, &mut out);
    assert!(e.unwrap_err().to_string().contains("sequences"));
    let e = nn::bias_grad(&[0.0; 5], &mut [0.0; 2]);
    assert!(e.unwrap_err().to_string().contains("whole rows"));

    let (mut losses, mut d) = (vec![0.0f32; 2], vec![0.0f32; 6]);
    nn::cross_entropy_fused(&[0.0; 6], &[1, 3], 3, 0.5, &mut losses, &mut d).unwrap();
    assert!((losses[0] - 3f32.ln()).abs() < 1e-6 && losses[1].is_nan());
    assert!(d[..3].iter().all(|v| v.is_finite()) && d[3..].iter().all(|v| v.is_nan()));
    let mut x = vec![0.0f32; 4];
    nn::embedding_forward(&[1, 9], &[1.0; 4], &[0.5; 2], 1, 2, &mut x).unwrap();
    assert_eq!(&x[..2], &[1.5, 1.5]);
    assert!(x[2].is_nan() && x[3].is_nan());
}
