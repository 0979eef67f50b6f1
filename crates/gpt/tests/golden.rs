//! The reference model against PyTorch's golden numbers (tests/fixtures, copied from the
//! project's shared golden reference): gradients of the first batch, ten AdamW losses and the
//! final weights, single-process.

mod common;

use std::collections::HashMap;

use common::*;
use fsdp::optim::AdamWState;
use fsdp_gpt::data::get_batch;
use fsdp_gpt::model::{
    block_backward, block_forward, embed_backward, embed_forward, forward_backward, forward_loss,
    head_backward, head_forward, zeros_like_params,
};

#[test]
fn gradients_of_the_first_batch_match_pytorch() {
    let cfg = cfg();
    let params = init();
    let toks = tokens();
    assert_eq!(toks.len(), 20_000);
    let batch = get_batch(&toks, 0, B, T, 0, 1).unwrap();
    let mut grads = zeros_like_params(&cfg);
    let loss = forward_backward(&cfg, &params, &mut grads, &batch, B * T).unwrap();
    let expected = load("expected_grads_step0.safetensors");
    let (worst, name) = compare(&grads, &expected, GRAD_TOL, "gradient");
    // The key bias's gradient is zero in exact arithmetic (see the AdamW test): only noise.
    for layer in 0..cfg.n_layer {
        let g = &grads[&format!("transformer.h.{layer}.attn.c_attn.bias")];
        assert!(
            max_abs(key_bias(g)) < 1e-7 * max_abs(g),
            "{:?}",
            key_bias(g)
        );
    }
    println!("step-0 loss {loss}, max gradient relative error {worst:.3e} ({name})");
}

#[test]
fn staged_api_split_over_ranks_sums_to_the_global_gradients() {
    // The batch split over 4 "ranks", each with the global normaliser: the losses and
    // gradients add up to the global batch's, and the stages chained by hand equal
    // forward_backward.
    let cfg = cfg();
    let params = init();
    let toks = tokens();
    let world = 4;
    let mut grads = zeros_like_params(&cfg);
    let mut loss = 0.0f64;
    for rank in 0..world {
        let b = get_batch(&toks, 0, B, T, rank, world).unwrap();
        let x = embed_forward(&cfg, &params, &b.inputs, b.shape).unwrap();
        let (x, c0) = block_forward(&cfg, &params, 0, x, b.shape).unwrap();
        let (x, c1) = block_forward(&cfg, &params, 1, x, b.shape).unwrap();
        let (l, hc) = head_forward(&cfg, &params, x, &b.targets, b.shape, B * T).unwrap();
        loss += f64::from(l);
        let dx = head_backward(&cfg, &params, &mut grads, &hc, 1.0).unwrap();
        let dx = block_backward(&cfg, &params, &mut grads, 1, &c1, &dx).unwrap();
        let dx = block_backward(&cfg, &params, &mut grads, 0, &c0, &dx).unwrap();
        embed_backward(&cfg, &mut grads, &b.inputs, b.shape, &dx).unwrap();
    }
    let expected_loss: f64 = 4.575_279_71;
    assert!(
        ((loss - expected_loss) / expected_loss).abs() < LOSS_TOL,
        "{loss}"
    );
    let expected = load("expected_grads_step0.safetensors");
    let (worst, name) = compare(&grads, &expected, GRAD_TOL, "rank-summed gradient");
    println!("4 ranks summed: max gradient relative error {worst:.3e} ({name})");
}

#[test]
fn ten_adamw_steps_match_pytorch_losses_and_final_weights() {
    let cfg = cfg();
    let mut params = init();
    let toks = tokens();
    let losses = expected_losses();
    assert_eq!(losses.len(), 10);
    let opt = adamw();
    let mut states: HashMap<String, AdamWState> = params
        .iter()
        .map(|(k, v)| (k.clone(), AdamWState::new(v.len())))
        .collect();
    let mut grads = zeros_like_params(&cfg);
    let mut worst_loss = 0.0f64;
    for (k, &expected) in losses.iter().enumerate() {
        for g in grads.values_mut() {
            g.fill(0.0);
        }
        let batch = get_batch(&toks, k as u64, B, T, 0, 1).unwrap();
        let loss = forward_backward(&cfg, &params, &mut grads, &batch, B * T).unwrap();
        let rel = ((f64::from(loss) - expected) / expected).abs();
        println!("step {k}: loss {loss:.8} (PyTorch {expected:.8}, relative error {rel:.2e})");
        assert!(rel < LOSS_TOL, "step {k}: loss {loss} vs {expected}");
        worst_loss = worst_loss.max(rel);
        for (name, p) in params.iter_mut() {
            states
                .get_mut(name)
                .unwrap()
                .step(&opt, p, &grads[name])
                .unwrap();
        }
    }
    // The key bias (the middle third of `attn.c_attn.bias`) is held to a noise bound, the rest
    // to the tolerance: see `common::check_final_weights`.
    let FinalWeightErrors {
        worst,
        name,
        worst_key,
    } = check_final_weights(&params);
    println!(
        "max loss relative error {worst_loss:.3e}; max final-weight relative error {worst:.3e} \
         ({name}); key-bias noise: {worst_key:.3e} of the tensor's largest magnitude"
    );
    // forward_loss agrees with forward_backward's loss.
    let b0 = get_batch(&toks, 0, B, T, 0, 1).unwrap();
    let l0 = forward_loss(&cfg, &init(), &b0, B * T).unwrap();
    assert!(((f64::from(l0) - losses[0]) / losses[0]).abs() < LOSS_TOL);
}
