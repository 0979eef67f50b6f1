//! Helpers shared by the golden tests (`golden.rs`, `golden_fsdp.rs`, `wrap_runtime.rs`): the
//! PyTorch fixtures in `tests/fixtures`, their configuration (tiny GPT, global batch 8 × 16,
//! AdamW lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1), the tolerances and the
//! comparison rules, the key-bias rule included. [`cli`]: the helpers of the tests that run
//! the `fsdp` binary; [`training`]: those of the tests that train with FSDP against a
//! reference; [`device`]: the device trainer's shared run; [`gpu`]: the GPU tests' `fsdp` program
//! and files.

// Each test crate that includes this module uses a different subset of it.
#![allow(dead_code)]

pub mod cli;
pub mod device;
pub mod gpu;
pub mod training;

use std::collections::HashMap;
use std::path::PathBuf;

use fsdp::optim::AdamWConfig;
use fsdp_gpt::data::read_token_file;
use fsdp_gpt::model::{param_specs, GptConfig};

/// Rows of the global batch.
pub const B: usize = 8;
/// Tokens per row.
pub const T: usize = 16;
/// Gradients: relative to each tensor's largest magnitude.
pub const GRAD_TOL: f64 = 1e-4;
/// Losses: relative.
pub const LOSS_TOL: f64 = 1e-5;
/// Final weights: relative to each tensor's largest magnitude.
pub const WEIGHT_TOL: f64 = 1e-4;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
        .join(name)
}

pub fn load(name: &str) -> HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(fixture(name)).expect("fixture is readable");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{k}");
            let data = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (k, data)
        })
        .collect()
}

pub fn cfg() -> GptConfig {
    GptConfig::tiny()
}

pub fn tokens() -> Vec<u16> {
    read_token_file(fixture("tokens.bin")).unwrap()
}

pub fn init() -> HashMap<String, Vec<f32>> {
    let p = load("gpt_tiny_init.safetensors");
    // Every parameter of the spec is there with its shape, nothing else.
    let specs = param_specs(&cfg());
    assert_eq!(p.len(), specs.len());
    for s in &specs {
        assert_eq!(p[&s.name].len(), s.numel(), "{}", s.name);
    }
    p
}

/// The AdamW settings PyTorch used.
pub fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// max |a − e| / max |e| for one tensor.
pub fn rel_err(actual: &[f32], expected: &[f32]) -> f64 {
    assert_eq!(actual.len(), expected.len());
    let scale = expected
        .iter()
        .map(|v| f64::from(v.abs()))
        .fold(0.0, f64::max);
    let diff = actual
        .iter()
        .zip(expected)
        .map(|(a, e)| (f64::from(*a) - f64::from(*e)).abs())
        .fold(0.0, f64::max);
    if scale == 0.0 {
        diff
    } else {
        diff / scale
    }
}

/// Compares every parameter; returns the worst relative error and its tensor.
pub fn compare(
    actual: &HashMap<String, Vec<f32>>,
    expected: &HashMap<String, Vec<f32>>,
    tol: f64,
    what: &str,
) -> (f64, String) {
    let mut worst = (0.0, String::new());
    for s in param_specs(&cfg()) {
        let e = rel_err(&actual[&s.name], &expected[&s.name]);
        assert!(
            e <= tol,
            "{what} of {}: relative error {e:.3e} > {tol:e}",
            s.name
        );
        if e > worst.0 {
            worst = (e, s.name.clone());
        }
    }
    worst
}

/// The key third `[E, 2E)` of an `attn.c_attn.bias`.
pub fn key_bias(v: &[f32]) -> &[f32] {
    let e = cfg().n_embd;
    &v[e..2 * e]
}

/// `v` with its key third set to zero.
pub fn without_key_bias(v: &[f32]) -> Vec<f32> {
    let e = cfg().n_embd;
    let mut v = v.to_vec();
    v[e..2 * e].fill(0.0);
    v
}

/// Largest magnitude.
pub fn max_abs(v: &[f32]) -> f64 {
    v.iter().map(|x| f64::from(x.abs())).fold(0.0, f64::max)
}

pub fn expected_losses() -> Vec<f64> {
    let text = std::fs::read_to_string(fixture("expected_losses.csv")).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("step,loss"));
    lines
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            let (step, loss) = l.split_once(',').unwrap();
            assert_eq!(step.parse::<usize>().unwrap(), i);
            loss.parse().unwrap()
        })
        .collect()
}

/// The worst final-weight error: relative error (key bias left out), its tensor, and the
/// key-bias difference as a fraction of its tensor's largest magnitude.
#[derive(Debug, Clone, PartialEq)]
pub struct FinalWeightErrors {
    pub worst: f64,
    pub name: String,
    pub worst_key: f64,
}

/// Compares trained weights with PyTorch's `expected_final.safetensors`, with the key-bias
/// rule, asserting the tolerances.
///
/// The key bias (the middle third of `attn.c_attn.bias`) has a zero gradient in exact
/// arithmetic: adding it to every key adds the same `q·b_k` to a whole row of scores, which
/// the softmax ignores. Its computed gradient is rounding noise (~1e-11 here, in PyTorch as
/// in this crate) that AdamW amplifies by `1/eps`, so after 10 steps both weights are noise
/// of order `lr · 10 · |g| / eps ≈ 1e-6`, which no other summation order reproduces. They
/// are held to that noise bound instead, and the rest of the tensor to the tolerance.
pub fn check_final_weights(params: &HashMap<String, Vec<f32>>) -> FinalWeightErrors {
    let cfg = cfg();
    let mut expected = load("expected_final.safetensors");
    let mut actual = params.clone();
    let mut worst_key = 0.0f64;
    for layer in 0..cfg.n_layer {
        let name = format!("transformer.h.{layer}.attn.c_attn.bias");
        let (a, x) = (&actual[&name], &expected[&name]);
        let scale = max_abs(x);
        let noise_bound = 1e-5;
        assert!(
            max_abs(key_bias(a)) < noise_bound,
            "{name}: key bias {:?}",
            key_bias(a)
        );
        assert!(
            max_abs(key_bias(x)) < noise_bound,
            "{name}: PyTorch key bias"
        );
        worst_key = worst_key.max(rel_err(key_bias(a), key_bias(x)) * max_abs(key_bias(x)) / scale);
        let (a, x) = (without_key_bias(a), without_key_bias(x));
        assert_eq!(
            max_abs(&x),
            scale,
            "the key bias is not the tensor's largest part"
        );
        actual.insert(name.clone(), a);
        expected.insert(name, x);
    }
    let (worst, name) = compare(&actual, &expected, WEIGHT_TOL, "final weight");
    FinalWeightErrors {
        worst,
        name,
        worst_key,
    }
}

/// The L2 norm (in f64) of PyTorch's step-0 gradients, every parameter once (the `wte`
/// gradient includes the tied `lm_head` term).
pub fn expected_grad_norm() -> f64 {
    let g = load("expected_grads_step0.safetensors");
    param_specs(&cfg())
        .iter()
        .flat_map(|s| g[&s.name].iter())
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt()
}
