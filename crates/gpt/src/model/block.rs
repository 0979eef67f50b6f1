//! The transformer-block stage of GPT-2 (`ln_1`, attention, `ln_2`, MLP), forward and backward.

use super::layers::{
    attention_backward, attention_forward, gelu_backward, gelu_forward, linear_forward,
};
use super::stage::{
    check_activation, check_grads, check_layer, check_shape, copied, fetch, layer_norm,
    layer_norm_backward, linear_backward, zeros, LayerNormSaved,
};
use super::{block_param_specs, BatchShape, GptConfig, Grads, Params};
use fsdp::FsdpError;

/// What one transformer block keeps from forward for its backward.
#[derive(Debug, Clone)]
pub struct BlockCache {
    layer: usize,
    shape: BatchShape,
    /// Block input.
    x: Vec<f32>,
    ln1_mean: Vec<f32>,
    ln1_rstd: Vec<f32>,
    /// `ln_1(x)`.
    h1: Vec<f32>,
    /// `c_attn(h1)`: `[n, 3E]`.
    qkv: Vec<f32>,
    /// Attention probabilities `[rows, n_head, T, T]`.
    att: Vec<f32>,
    /// Heads' outputs before `c_proj`: `[n, E]`.
    y: Vec<f32>,
    /// `x + attn(ln_1(x))`.
    x2: Vec<f32>,
    ln2_mean: Vec<f32>,
    ln2_rstd: Vec<f32>,
    /// `ln_2(x2)`.
    h2: Vec<f32>,
    /// `c_fc(h2)`, before GELU: `[n, 4E]`.
    fc: Vec<f32>,
    /// `gelu(fc)`.
    g: Vec<f32>,
}

impl BlockCache {
    /// The block this cache belongs to.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The batch shape it was computed for.
    pub fn shape(&self) -> BatchShape {
        self.shape
    }

    /// Bytes of activations kept.
    pub fn bytes(&self) -> usize {
        let f = [
            &self.x,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.h1,
            &self.qkv,
            &self.att,
            &self.y,
            &self.x2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.h2,
            &self.fc,
            &self.g,
        ];
        f.iter().map(|v| v.len()).sum::<usize>() * std::mem::size_of::<f32>()
    }

    /// The block's input, the rest dropped (what activation checkpointing keeps: the block's
    /// forward recomputes the rest from it).
    pub fn into_input(self) -> Vec<f32> {
        self.x
    }
}

/// The weight and bias of one module of a block.
struct WeightBias<'a> {
    w: &'a [f32],
    b: &'a [f32],
}

/// The values of one block's parameters, in [`block_param_specs`] order.
struct BlockParams<'a> {
    ln1: WeightBias<'a>,
    attn: WeightBias<'a>,
    aproj: WeightBias<'a>,
    ln2: WeightBias<'a>,
    fc: WeightBias<'a>,
    mproj: WeightBias<'a>,
}

fn block_params<'a, P: Params + ?Sized>(
    cfg: &GptConfig,
    params: &'a P,
    layer: usize,
) -> Result<BlockParams<'a>, FsdpError> {
    let specs = block_param_specs(cfg, layer);
    let mut v = Vec::with_capacity(12);
    for s in &specs {
        v.push(fetch(params, &s.name, s.numel())?);
    }
    let wb = |i: usize| WeightBias {
        w: v[2 * i],
        b: v[2 * i + 1],
    };
    Ok(BlockParams {
        ln1: wb(0),
        attn: wb(1),
        aproj: wb(2),
        ln2: wb(3),
        fc: wb(4),
        mproj: wb(5),
    })
}

/// Block stage forward for transformer block `layer`:
/// `x2 = x + attn(ln_1(x))`, `out = x2 + mlp(ln_2(x2))`. Takes the block input by value (it is
/// kept in the cache, so no copy is made) and returns the block output and the activations
/// that [`block_backward`] needs. Reads only `transformer.h.{layer}.*`.
///
/// # Errors
/// An invalid configuration, shape or layer, `x` of the wrong length, or a missing or
/// mis-sized parameter.
pub fn block_forward<P: Params + ?Sized>(
    cfg: &GptConfig,
    params: &P,
    layer: usize,
    x: Vec<f32>,
    shape: BatchShape,
) -> Result<(Vec<f32>, BlockCache), FsdpError> {
    check_shape(cfg, shape)?;
    check_layer(cfg, layer)?;
    check_activation(cfg, &x, shape, "block input")?;
    let p = block_params(cfg, params, layer)?;
    let (n, e, h, t) = (shape.tokens(), cfg.n_embd, cfg.n_head, shape.seq_len);

    let (h1, ln1_mean, ln1_rstd) =
        layer_norm(&x, p.ln1.w, p.ln1.b, n, e, ["ln1_mean", "ln1_rstd", "h1"])?;
    let mut qkv = zeros(n * 3 * e, "qkv")?;
    linear_forward(&h1, p.attn.w, Some(p.attn.b), n, e, 3 * e, &mut qkv);
    let mut att = zeros(shape.rows * h * t * t, "att")?;
    let mut y = zeros(n * e, "y")?;
    attention_forward(&qkv, shape.rows, t, h, e, &mut att, &mut y);
    let mut x2 = zeros(n * e, "x2")?;
    linear_forward(&y, p.aproj.w, Some(p.aproj.b), n, e, e, &mut x2);
    for (o, &r) in x2.iter_mut().zip(&x) {
        *o += r;
    }

    let (h2, ln2_mean, ln2_rstd) =
        layer_norm(&x2, p.ln2.w, p.ln2.b, n, e, ["ln2_mean", "ln2_rstd", "h2"])?;
    let mut fc = zeros(n * 4 * e, "fc")?;
    linear_forward(&h2, p.fc.w, Some(p.fc.b), n, e, 4 * e, &mut fc);
    let mut g = zeros(n * 4 * e, "g")?;
    gelu_forward(&fc, &mut g);
    let mut out = zeros(n * e, "out")?;
    linear_forward(&g, p.mproj.w, Some(p.mproj.b), n, 4 * e, e, &mut out);
    for (o, &r) in out.iter_mut().zip(&x2) {
        *o += r;
    }

    let cache = BlockCache {
        layer,
        shape,
        x,
        ln1_mean,
        ln1_rstd,
        h1,
        qkv,
        att,
        y,
        x2,
        ln2_mean,
        ln2_rstd,
        h2,
        fc,
        g,
    };
    Ok((out, cache))
}

/// Block stage backward for transformer block `layer`: from `dy`, the gradient of the block's
/// output, accumulates the gradients of `transformer.h.{layer}.*` (and nothing else) and
/// returns the gradient of the block's input.
///
/// # Errors
/// An invalid configuration or layer, a cache of another layer, `dy` of the wrong length, or a
/// missing or mis-sized parameter or gradient (then no gradient is written).
pub fn block_backward<P: Params + ?Sized, G: Grads + ?Sized>(
    cfg: &GptConfig,
    params: &P,
    grads: &mut G,
    layer: usize,
    cache: &BlockCache,
    dy: &[f32],
) -> Result<Vec<f32>, FsdpError> {
    check_layer(cfg, layer)?;
    if cache.layer != layer {
        return Err(FsdpError::InvalidShape {
            reason: format!(
                "backward of block {layer} was given the cache of block {}",
                cache.layer
            ),
        });
    }
    let shape = cache.shape;
    check_shape(cfg, shape)?;
    check_activation(cfg, &cache.x, shape, "cached block input")?;
    check_activation(cfg, dy, shape, "block output gradient")?;
    let p = block_params(cfg, params, layer)?;
    check_grads(grads, &block_param_specs(cfg, layer))?;
    let (n, e, h, t) = (shape.tokens(), cfg.n_embd, cfg.n_head, shape.seq_len);
    let c = cache;
    let name = |s: &str| super::block_param(layer, s);

    // MLP: out = x2 + c_proj(gelu(c_fc(h2))).
    let mut dx2 = copied(dy, "dx2")?;
    let module = name("mlp.c_proj");
    let dg = linear_backward(grads, &module, dy, &c.g, p.mproj.w, n, 4 * e, e, "dg")?;
    let mut dfc = zeros(n * 4 * e, "dfc")?;
    gelu_backward(&c.fc, &dg, &mut dfc);
    drop(dg);
    let module = name("mlp.c_fc");
    let dh2 = linear_backward(grads, &module, &dfc, &c.h2, p.fc.w, n, e, 4 * e, "dh2")?;
    drop(dfc);
    let saved = LayerNormSaved::new(&c.x2, &c.ln2_mean, &c.ln2_rstd);
    let module = name("ln_2");
    layer_norm_backward(grads, &module, saved, p.ln2.w, &dh2, n, e, &mut dx2)?;

    // Attention: x2 = x + c_proj(attn(c_attn(h1))).
    let module = name("attn.c_proj");
    let dyatt = linear_backward(grads, &module, &dx2, &c.y, p.aproj.w, n, e, e, "dyatt")?;
    let mut dqkv = zeros(n * 3 * e, "dqkv")?;
    attention_backward(&c.qkv, &c.att, &dyatt, shape.rows, t, h, e, &mut dqkv);
    drop(dyatt);
    let module = name("attn.c_attn");
    let dh1 = linear_backward(grads, &module, &dqkv, &c.h1, p.attn.w, n, e, 3 * e, "dh1")?;
    drop(dqkv);
    let mut dx = dx2;
    let saved = LayerNormSaved::new(&c.x, &c.ln1_mean, &c.ln1_rstd);
    let module = name("ln_1");
    layer_norm_backward(grads, &module, saved, p.ln1.w, &dh1, n, e, &mut dx)?;
    Ok(dx)
}
