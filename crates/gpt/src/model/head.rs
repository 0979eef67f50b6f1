//! The head stage of GPT-2 (`ln_f`, the tied `lm_head`, cross-entropy), forward and backward.

use super::layers::{
    cross_entropy_backward, cross_entropy_forward, linear_backward_input, linear_backward_weight,
    linear_forward,
};
use super::stage::{
    check_activation, check_grads, check_shape, check_tokens, copied, fetch, grad, layer_norm,
    layer_norm_backward, zeros, LayerNormSaved, LNF_B, LNF_W, WTE,
};
use super::{head_param_specs, BatchShape, GptConfig, Grads, Params};
use fsdp::FsdpError;

/// What the head stage keeps from forward for its backward.
#[derive(Debug, Clone)]
pub struct HeadCache {
    shape: BatchShape,
    global_tokens: usize,
    x: Vec<f32>,
    mean: Vec<f32>,
    rstd: Vec<f32>,
    /// `ln_f(x)`.
    hf: Vec<f32>,
    /// Softmax of the logits, `[n, V]`.
    probs: Vec<f32>,
    targets: Vec<u32>,
}

impl HeadCache {
    /// The batch shape it was computed for.
    pub fn shape(&self) -> BatchShape {
        self.shape
    }

    /// The loss normaliser it was computed with (the global batch's token count).
    pub fn global_tokens(&self) -> usize {
        self.global_tokens
    }

    /// Bytes of activations kept: the input, the `ln_f` output and statistics, the softmax of
    /// the logits (`f32`) and the targets (`u32`).
    pub fn bytes(&self) -> usize {
        let f = [&self.x, &self.mean, &self.rstd, &self.hf, &self.probs];
        (f.iter().map(|v| v.len()).sum::<usize>() + self.targets.len()) * 4
    }
}

/// Head stage forward: `ln_f`, the tied `lm_head` (`logits = ln_f(x)·wteᵀ`) and the
/// cross-entropy against `targets`, **summed** over the tokens given and divided by
/// `global_tokens` (pass the global batch's token count, so that the ranks' losses add up to
/// the global mean; pass `shape.tokens()` for a plain mean). Reads `transformer.ln_f.*` and
/// `transformer.wte.weight`.
///
/// # Errors
/// An invalid configuration or shape, `global_tokens == 0`, `x` of the wrong length, a target
/// out of the vocabulary, or a missing or mis-sized parameter.
pub fn head_forward<P: Params + ?Sized>(
    cfg: &GptConfig,
    params: &P,
    x: Vec<f32>,
    targets: &[u32],
    shape: BatchShape,
    global_tokens: usize,
) -> Result<(f32, HeadCache), FsdpError> {
    check_shape(cfg, shape)?;
    check_activation(cfg, &x, shape, "head input")?;
    check_tokens(cfg, targets, shape, "targets")?;
    if global_tokens == 0 {
        return Err(FsdpError::InvalidShape {
            reason: "the loss normaliser (global token count) must be at least 1".into(),
        });
    }
    let (n, e, v) = (shape.tokens(), cfg.n_embd, cfg.vocab_size);
    let lnf_w = fetch(params, LNF_W, e)?;
    let lnf_b = fetch(params, LNF_B, e)?;
    let wte = fetch(params, WTE, v * e)?;
    let (hf, mean, rstd) = layer_norm(&x, lnf_w, lnf_b, n, e, ["mean", "rstd", "hf"])?;
    let mut logits = zeros(n * v, "logits")?;
    linear_forward(&hf, wte, None, n, e, v, &mut logits);
    let mut probs = zeros(n * v, "probs")?;
    let sum = cross_entropy_forward(&logits, targets, n, v, &mut probs);
    drop(logits);
    let loss = (sum / global_tokens as f64) as f32;
    let cache = HeadCache {
        shape,
        global_tokens,
        x,
        mean,
        rstd,
        hf,
        probs,
        targets: copied(targets, "targets")?,
    };
    Ok((loss, cache))
}

/// Head stage backward: from `dloss`, the gradient of the returned loss (1 normally; the loss
/// scale under loss scaling), accumulates the gradients of `transformer.ln_f.*` and the tied
/// `lm_head` term of `transformer.wte.weight`'s gradient, and returns the gradient of the head's
/// input.
///
/// # Errors
/// An invalid configuration or a cache of another shape, or a missing or mis-sized parameter
/// or gradient (then no gradient is written).
pub fn head_backward<P: Params + ?Sized, G: Grads + ?Sized>(
    cfg: &GptConfig,
    params: &P,
    grads: &mut G,
    cache: &HeadCache,
    dloss: f32,
) -> Result<Vec<f32>, FsdpError> {
    let shape = cache.shape;
    check_shape(cfg, shape)?;
    check_activation(cfg, &cache.x, shape, "cached head input")?;
    let (n, e, v) = (shape.tokens(), cfg.n_embd, cfg.vocab_size);
    if cache.probs.len() != n * v {
        return Err(FsdpError::InvalidShape {
            reason: format!(
                "head cache holds {} probabilities, the model needs {}",
                cache.probs.len(),
                n * v
            ),
        });
    }
    let lnf_w = fetch(params, LNF_W, e)?;
    let wte = fetch(params, WTE, v * e)?;
    check_grads(grads, &head_param_specs(cfg))?;
    grad(grads, WTE, v * e)?;

    let scale = (f64::from(dloss) / cache.global_tokens as f64) as f32;
    let mut dlogits = zeros(n * v, "dlogits")?;
    cross_entropy_backward(&cache.probs, &cache.targets, n, v, scale, &mut dlogits);
    linear_backward_weight(&dlogits, &cache.hf, n, e, v, grad(grads, WTE, v * e)?);
    let mut dhf = zeros(n * e, "dhf")?;
    linear_backward_input(&dlogits, wte, n, e, v, &mut dhf);
    drop(dlogits);
    let mut dx = zeros(n * e, "dx")?;
    let saved = LayerNormSaved::new(&cache.x, &cache.mean, &cache.rstd);
    layer_norm_backward(grads, "transformer.ln_f", saved, lnf_w, &dhf, n, e, &mut dx)?;
    Ok(dx)
}
