//! The staged forward and backward of GPT-2 (embedding, blocks, head) in `f32`.

use super::layers::{
    attention_backward, attention_forward, cross_entropy_backward, cross_entropy_forward,
    embedding_backward_positions, embedding_backward_tokens, embedding_forward, gelu_backward,
    gelu_forward, layernorm_backward_input, layernorm_backward_params, layernorm_forward,
    linear_backward_bias, linear_backward_input, linear_backward_weight, linear_forward,
};
use super::{
    block_param_specs, embed_param_specs, head_param_specs, param_specs, BatchShape, GptConfig,
    Grads, ParamSpec, Params, LAYER_NORM_EPS,
};
use crate::data::Batch;
use fsdp::FsdpError;

const WTE: &str = "transformer.wte.weight";
const WPE: &str = "transformer.wpe.weight";
const LNF_W: &str = "transformer.ln_f.weight";
const LNF_B: &str = "transformer.ln_f.bias";

/// `len` zeros for the buffer `what` of the forward or backward, allocated fallibly: an
/// allocation the system refuses is [`FsdpError::HostOutOfMemory`] naming the buffer and its
/// bytes, not an abort.
fn zeros(len: usize, what: &str) -> Result<Vec<f32>, FsdpError> {
    fsdp::try_filled_vec(len, 0.0, &format!("the GPT buffer `{what}`"))
}

/// A copy of `src` for the buffer `what`, allocated fallibly as [`zeros`].
fn copied<T: Copy + Default>(src: &[T], what: &str) -> Result<Vec<T>, FsdpError> {
    let mut v = fsdp::try_filled_vec(src.len(), T::default(), &format!("the GPT buffer `{what}`"))?;
    v.copy_from_slice(src);
    Ok(v)
}

/// Reads parameter `name` and checks it has `len` elements.
fn fetch<'a, P: Params + ?Sized>(
    params: &'a P,
    name: &str,
    len: usize,
) -> Result<&'a [f32], FsdpError> {
    let s = params.param(name)?;
    if s.len() != len {
        return Err(FsdpError::ParameterLength {
            name: name.into(),
            expected: len,
            actual: s.len(),
        });
    }
    Ok(s)
}

/// The gradient of `name`, checked to have `len` elements.
fn grad<'a, G: Grads + ?Sized>(
    grads: &'a mut G,
    name: &str,
    len: usize,
) -> Result<&'a mut [f32], FsdpError> {
    let s = grads.grad_mut(name)?;
    if s.len() != len {
        return Err(FsdpError::ParameterLength {
            name: name.into(),
            expected: len,
            actual: s.len(),
        });
    }
    Ok(s)
}

/// Checks that every gradient of `specs` is present with the right length, so that a backward
/// stage either writes all its gradients or none.
fn check_grads<G: Grads + ?Sized>(grads: &mut G, specs: &[ParamSpec]) -> Result<(), FsdpError> {
    for s in specs {
        grad(grads, &s.name, s.numel())?;
    }
    Ok(())
}

/// Adds `src` into the gradient `name`.
fn add_into<G: Grads + ?Sized>(grads: &mut G, name: &str, src: &[f32]) -> Result<(), FsdpError> {
    let g = grad(grads, name, src.len())?;
    for (d, &s) in g.iter_mut().zip(src) {
        *d += s;
    }
    Ok(())
}

fn check_shape(cfg: &GptConfig, shape: BatchShape) -> Result<(), FsdpError> {
    cfg.validate()?;
    if shape.rows == 0 || shape.seq_len == 0 {
        return Err(FsdpError::InvalidShape {
            reason: format!(
                "a batch needs at least one row of at least one token, got {} rows of {}",
                shape.rows, shape.seq_len
            ),
        });
    }
    if shape.seq_len > cfg.block_size {
        return Err(FsdpError::InvalidShape {
            reason: format!(
                "sequence length {} exceeds the block size {}",
                shape.seq_len, cfg.block_size
            ),
        });
    }
    // The element counts of the largest buffers (MLP activations, logits, attention
    // probabilities) must be representable, so that no size computation below overflows.
    let (rows, t, e) = (shape.rows, shape.seq_len, cfg.n_embd);
    let fits = (|| {
        let n = rows.checked_mul(t)?;
        n.checked_mul(e.checked_mul(4)?)?;
        n.checked_mul(cfg.vocab_size)?;
        rows.checked_mul(cfg.n_head)?.checked_mul(t)?.checked_mul(t)
    })();
    if fits.is_none() {
        return Err(FsdpError::InvalidShape {
            reason: format!(
                "a batch of {rows} rows of {t} tokens: the activations' sizes overflow usize"
            ),
        });
    }
    Ok(())
}

fn check_tokens(
    cfg: &GptConfig,
    ids: &[u32],
    shape: BatchShape,
    what: &str,
) -> Result<(), FsdpError> {
    if ids.len() != shape.tokens() {
        return Err(FsdpError::InvalidShape {
            reason: format!(
                "{what} has {} token ids, the batch shape {}×{} needs {}",
                ids.len(),
                shape.rows,
                shape.seq_len,
                shape.tokens()
            ),
        });
    }
    if let Some(&token) = ids.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(FsdpError::TokenOutOfVocab {
            token,
            vocab_size: cfg.vocab_size,
        });
    }
    Ok(())
}

fn check_activation(
    cfg: &GptConfig,
    x: &[f32],
    shape: BatchShape,
    what: &str,
) -> Result<(), FsdpError> {
    let expected = shape.tokens() * cfg.n_embd;
    if x.len() != expected {
        return Err(FsdpError::InvalidShape {
            reason: format!(
                "{what} has {} elements, {} tokens of width {} need {expected}",
                x.len(),
                shape.tokens(),
                cfg.n_embd
            ),
        });
    }
    Ok(())
}

fn check_layer(cfg: &GptConfig, layer: usize) -> Result<(), FsdpError> {
    if layer >= cfg.n_layer {
        return Err(FsdpError::LayerOutOfRange {
            layer,
            n_layer: cfg.n_layer,
        });
    }
    Ok(())
}

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

/// The values of one block's parameters, in [`block_param_specs`] order.
struct BlockParams<'a> {
    ln1_w: &'a [f32],
    ln1_b: &'a [f32],
    attn_w: &'a [f32],
    attn_b: &'a [f32],
    aproj_w: &'a [f32],
    aproj_b: &'a [f32],
    ln2_w: &'a [f32],
    ln2_b: &'a [f32],
    fc_w: &'a [f32],
    fc_b: &'a [f32],
    mproj_w: &'a [f32],
    mproj_b: &'a [f32],
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
    Ok(BlockParams {
        ln1_w: v[0],
        ln1_b: v[1],
        attn_w: v[2],
        attn_b: v[3],
        aproj_w: v[4],
        aproj_b: v[5],
        ln2_w: v[6],
        ln2_b: v[7],
        fc_w: v[8],
        fc_b: v[9],
        mproj_w: v[10],
        mproj_b: v[11],
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

    let mut ln1_mean = zeros(n, "ln1_mean")?;
    let mut ln1_rstd = zeros(n, "ln1_rstd")?;
    let mut h1 = zeros(n * e, "h1")?;
    layernorm_forward(
        &x,
        p.ln1_w,
        p.ln1_b,
        n,
        e,
        LAYER_NORM_EPS,
        &mut h1,
        &mut ln1_mean,
        &mut ln1_rstd,
    );
    let mut qkv = zeros(n * 3 * e, "qkv")?;
    linear_forward(&h1, p.attn_w, Some(p.attn_b), n, e, 3 * e, &mut qkv);
    let mut att = zeros(shape.rows * h * t * t, "att")?;
    let mut y = zeros(n * e, "y")?;
    attention_forward(&qkv, shape.rows, t, h, e, &mut att, &mut y);
    let mut x2 = zeros(n * e, "x2")?;
    linear_forward(&y, p.aproj_w, Some(p.aproj_b), n, e, e, &mut x2);
    for (o, &r) in x2.iter_mut().zip(&x) {
        *o += r;
    }

    let mut ln2_mean = zeros(n, "ln2_mean")?;
    let mut ln2_rstd = zeros(n, "ln2_rstd")?;
    let mut h2 = zeros(n * e, "h2")?;
    layernorm_forward(
        &x2,
        p.ln2_w,
        p.ln2_b,
        n,
        e,
        LAYER_NORM_EPS,
        &mut h2,
        &mut ln2_mean,
        &mut ln2_rstd,
    );
    let mut fc = zeros(n * 4 * e, "fc")?;
    linear_forward(&h2, p.fc_w, Some(p.fc_b), n, e, 4 * e, &mut fc);
    let mut g = zeros(n * 4 * e, "g")?;
    gelu_forward(&fc, &mut g);
    let mut out = zeros(n * e, "out")?;
    linear_forward(&g, p.mproj_w, Some(p.mproj_b), n, 4 * e, e, &mut out);
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
    linear_backward_weight(
        dy,
        &c.g,
        n,
        4 * e,
        e,
        grad(grads, &name("mlp.c_proj.weight"), 4 * e * e)?,
    );
    linear_backward_bias(dy, n, e, grad(grads, &name("mlp.c_proj.bias"), e)?);
    let mut dg = zeros(n * 4 * e, "dg")?;
    linear_backward_input(dy, p.mproj_w, n, 4 * e, e, &mut dg);
    let mut dfc = zeros(n * 4 * e, "dfc")?;
    gelu_backward(&c.fc, &dg, &mut dfc);
    drop(dg);
    linear_backward_weight(
        &dfc,
        &c.h2,
        n,
        e,
        4 * e,
        grad(grads, &name("mlp.c_fc.weight"), 4 * e * e)?,
    );
    linear_backward_bias(&dfc, n, 4 * e, grad(grads, &name("mlp.c_fc.bias"), 4 * e)?);
    let mut dh2 = zeros(n * e, "dh2")?;
    linear_backward_input(&dfc, p.fc_w, n, e, 4 * e, &mut dh2);
    drop(dfc);
    layernorm_backward_input(
        &c.x2,
        &c.ln2_mean,
        &c.ln2_rstd,
        p.ln2_w,
        &dh2,
        n,
        e,
        &mut dx2,
    );
    let mut dw = zeros(e, "dw")?;
    let mut db = zeros(e, "db")?;
    layernorm_backward_params(
        &c.x2,
        &c.ln2_mean,
        &c.ln2_rstd,
        &dh2,
        n,
        e,
        &mut dw,
        &mut db,
    );
    add_into(grads, &name("ln_2.weight"), &dw)?;
    add_into(grads, &name("ln_2.bias"), &db)?;

    // Attention: x2 = x + c_proj(attn(c_attn(h1))).
    linear_backward_weight(
        &dx2,
        &c.y,
        n,
        e,
        e,
        grad(grads, &name("attn.c_proj.weight"), e * e)?,
    );
    linear_backward_bias(&dx2, n, e, grad(grads, &name("attn.c_proj.bias"), e)?);
    let mut dyatt = zeros(n * e, "dyatt")?;
    linear_backward_input(&dx2, p.aproj_w, n, e, e, &mut dyatt);
    let mut dqkv = zeros(n * 3 * e, "dqkv")?;
    attention_backward(&c.qkv, &c.att, &dyatt, shape.rows, t, h, e, &mut dqkv);
    drop(dyatt);
    linear_backward_weight(
        &dqkv,
        &c.h1,
        n,
        e,
        3 * e,
        grad(grads, &name("attn.c_attn.weight"), 3 * e * e)?,
    );
    linear_backward_bias(
        &dqkv,
        n,
        3 * e,
        grad(grads, &name("attn.c_attn.bias"), 3 * e)?,
    );
    let mut dh1 = zeros(n * e, "dh1")?;
    linear_backward_input(&dqkv, p.attn_w, n, e, 3 * e, &mut dh1);
    drop(dqkv);
    let mut dx = dx2;
    layernorm_backward_input(&c.x, &c.ln1_mean, &c.ln1_rstd, p.ln1_w, &dh1, n, e, &mut dx);
    dw.fill(0.0);
    db.fill(0.0);
    layernorm_backward_params(&c.x, &c.ln1_mean, &c.ln1_rstd, &dh1, n, e, &mut dw, &mut db);
    add_into(grads, &name("ln_1.weight"), &dw)?;
    add_into(grads, &name("ln_1.bias"), &db)?;
    Ok(dx)
}

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
    let mut mean = zeros(n, "mean")?;
    let mut rstd = zeros(n, "rstd")?;
    let mut hf = zeros(n * e, "hf")?;
    layernorm_forward(
        &x,
        lnf_w,
        lnf_b,
        n,
        e,
        LAYER_NORM_EPS,
        &mut hf,
        &mut mean,
        &mut rstd,
    );
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
    layernorm_backward_input(
        &cache.x,
        &cache.mean,
        &cache.rstd,
        lnf_w,
        &dhf,
        n,
        e,
        &mut dx,
    );
    let mut dw = zeros(e, "dw")?;
    let mut db = zeros(e, "db")?;
    layernorm_backward_params(
        &cache.x,
        &cache.mean,
        &cache.rstd,
        &dhf,
        n,
        e,
        &mut dw,
        &mut db,
    );
    add_into(grads, LNF_W, &dw)?;
    add_into(grads, LNF_B, &db)?;
    Ok(dx)
}

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
