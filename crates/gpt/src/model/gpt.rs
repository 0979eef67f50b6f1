//! The GPT-2 model end to end: its stages chained for single-process forward and backward.

use super::stage::{check_grads, check_shape, check_tokens};
use super::{
    block_backward, block_forward, embed_backward, embed_forward, head_backward, head_forward,
    param_specs, GptConfig, Grads, Params,
};
use crate::data::Batch;
use fsdp::FsdpError;

/// The loss of `batch` (summed cross-entropy divided by `global_tokens`), forward only.
///
/// # Errors
/// As the stages: invalid configuration or batch, or missing or mis-sized parameters.
pub fn forward_loss<P: Params + ?Sized>(
    cfg: &GptConfig,
    params: &P,
    batch: &Batch,
    global_tokens: usize,
) -> Result<f32, FsdpError> {
    let shape = batch.shape;
    let mut x = embed_forward(cfg, params, &batch.inputs, shape)?;
    for layer in 0..cfg.n_layer {
        x = block_forward(cfg, params, layer, x, shape)?.0;
    }
    Ok(head_forward(cfg, params, x, &batch.targets, shape, global_tokens)?.0)
}

/// Forward and backward of `batch` through every stage: returns the loss (summed
/// cross-entropy divided by `global_tokens`) and **adds** the gradients of every parameter into
/// `grads` (`wte`'s including the tied `lm_head` term).
///
/// # Errors
/// As the stages. Every gradient is checked before backward starts, so on error no gradient
/// has been written.
pub fn forward_backward<P: Params + ?Sized, G: Grads + ?Sized>(
    cfg: &GptConfig,
    params: &P,
    grads: &mut G,
    batch: &Batch,
    global_tokens: usize,
) -> Result<f32, FsdpError> {
    let shape = batch.shape;
    check_shape(cfg, shape)?;
    check_tokens(cfg, &batch.inputs, shape, "inputs")?;
    check_grads(grads, &param_specs(cfg))?;
    let mut x = embed_forward(cfg, params, &batch.inputs, shape)?;
    let mut caches = Vec::new();
    for layer in 0..cfg.n_layer {
        let (y, cache) = block_forward(cfg, params, layer, x, shape)?;
        caches.push(cache);
        x = y;
    }
    let (loss, head) = head_forward(cfg, params, x, &batch.targets, shape, global_tokens)?;
    let mut dx = head_backward(cfg, params, grads, &head, 1.0)?;
    drop(head);
    for layer in (0..cfg.n_layer).rev() {
        let cache = caches.pop().expect("one cache per layer");
        dx = block_backward(cfg, params, grads, layer, &cache, &dx)?;
    }
    embed_backward(cfg, grads, &batch.inputs, shape, &dx)?;
    Ok(loss)
}
