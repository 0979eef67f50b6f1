//! The embedding stage of GPT-2: token plus position embeddings, forward and backward.

use super::layers::{embedding_backward_positions, embedding_backward_tokens, embedding_forward};
use super::stage::{
    check_activation, check_grads, check_shape, check_tokens, fetch, grad, zeros, WPE, WTE,
};
use super::{embed_param_specs, BatchShape, GptConfig, Grads, Params};
use fsdp::FsdpError;

/// Embedding stage forward: the activations `x: [rows·seq_len, n_embd]`,
/// `x[r] = wte[inputs[r]] + wpe[r mod seq_len]`. Reads `transformer.wte.weight` and
/// `transformer.wpe.weight`.
///
/// # Errors
/// An invalid configuration or shape, a token id out of the vocabulary, or a missing or
/// mis-sized parameter.
pub fn embed_forward<P: Params + ?Sized>(
    cfg: &GptConfig,
    params: &P,
    inputs: &[u32],
    shape: BatchShape,
) -> Result<Vec<f32>, FsdpError> {
    check_shape(cfg, shape)?;
    check_tokens(cfg, inputs, shape, "inputs")?;
    let e = cfg.n_embd;
    let wte = fetch(params, WTE, cfg.vocab_size * e)?;
    let wpe = fetch(params, WPE, cfg.block_size * e)?;
    let mut x = zeros(shape.tokens() * e, "x")?;
    embedding_forward(inputs, shape.seq_len, wte, wpe, e, &mut x);
    Ok(x)
}

/// Embedding stage backward: adds `dx` (the gradient of the embedding output) into the
/// gradients of `transformer.wte.weight` (rows of the input ids) and `transformer.wpe.weight`.
///
/// # Errors
/// An invalid configuration or shape, a token id out of the vocabulary, `dx` of the wrong
/// length, or a missing or mis-sized gradient (then nothing is written).
pub fn embed_backward<G: Grads + ?Sized>(
    cfg: &GptConfig,
    grads: &mut G,
    inputs: &[u32],
    shape: BatchShape,
    dx: &[f32],
) -> Result<(), FsdpError> {
    check_shape(cfg, shape)?;
    check_tokens(cfg, inputs, shape, "inputs")?;
    check_activation(cfg, dx, shape, "embedding output gradient")?;
    check_grads(grads, &embed_param_specs(cfg))?;
    let e = cfg.n_embd;
    embedding_backward_tokens(inputs, dx, e, grad(grads, WTE, cfg.vocab_size * e)?);
    embedding_backward_positions(shape.seq_len, dx, e, grad(grads, WPE, cfg.block_size * e)?);
    Ok(())
}
