//! What the stages of the GPT share: parameter and gradient access checked against the
//! configuration, validation of shapes and token ids, fallible buffers, and the LayerNorm and
//! linear steps that every stage runs the same way.

use super::layers::{
    layernorm_backward_input, layernorm_backward_params, layernorm_forward, linear_backward_bias,
    linear_backward_input, linear_backward_weight,
};
use super::{BatchShape, GptConfig, Grads, ParamSpec, Params, LAYER_NORM_EPS};
use fsdp::FsdpError;

pub(super) const WTE: &str = "transformer.wte.weight";
pub(super) const WPE: &str = "transformer.wpe.weight";
pub(super) const LNF_W: &str = "transformer.ln_f.weight";
pub(super) const LNF_B: &str = "transformer.ln_f.bias";

/// `len` zeros for the buffer `what` of the forward or backward, allocated fallibly: an
/// allocation the system refuses is [`FsdpError::HostOutOfMemory`] naming the buffer and its
/// bytes, not an abort.
pub(super) fn zeros(len: usize, what: &str) -> Result<Vec<f32>, FsdpError> {
    fsdp::try_filled_vec(len, 0.0, &format!("the GPT buffer `{what}`"))
}

/// A copy of `src` for the buffer `what`, allocated fallibly as [`zeros`].
pub(super) fn copied<T: Copy + Default>(src: &[T], what: &str) -> Result<Vec<T>, FsdpError> {
    let mut v = fsdp::try_filled_vec(src.len(), T::default(), &format!("the GPT buffer `{what}`"))?;
    v.copy_from_slice(src);
    Ok(v)
}

/// Reads parameter `name` and checks it has `len` elements.
pub(super) fn fetch<'a, P: Params + ?Sized>(
    params: &'a P,
    name: &str,
    len: usize,
) -> Result<&'a [f32], FsdpError> {
    let s = params.param(name)?;
    check_len(name, len, s.len())?;
    Ok(s)
}

/// The gradient of `name`, checked to have `len` elements.
pub(super) fn grad<'a, G: Grads + ?Sized>(
    grads: &'a mut G,
    name: &str,
    len: usize,
) -> Result<&'a mut [f32], FsdpError> {
    let s = grads.grad_mut(name)?;
    check_len(name, len, s.len())?;
    Ok(s)
}

/// [`FsdpError::ParameterLength`] when the parameter or gradient `name` holds `actual`
/// elements instead of `expected`.
fn check_len(name: &str, expected: usize, actual: usize) -> Result<(), FsdpError> {
    if actual != expected {
        return Err(FsdpError::ParameterLength {
            name: name.into(),
            expected,
            actual,
        });
    }
    Ok(())
}

/// Checks that every gradient of `specs` is present with the right length, so that a backward
/// stage either writes all its gradients or none.
pub(super) fn check_grads<G: Grads + ?Sized>(
    grads: &mut G,
    specs: &[ParamSpec],
) -> Result<(), FsdpError> {
    for s in specs {
        grad(grads, &s.name, s.numel())?;
    }
    Ok(())
}

/// Adds `src` into the gradient `name`.
pub(super) fn add_into<G: Grads + ?Sized>(
    grads: &mut G,
    name: &str,
    src: &[f32],
) -> Result<(), FsdpError> {
    let g = grad(grads, name, src.len())?;
    for (d, &s) in g.iter_mut().zip(src) {
        *d += s;
    }
    Ok(())
}

pub(super) fn check_shape(cfg: &GptConfig, shape: BatchShape) -> Result<(), FsdpError> {
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

pub(super) fn check_tokens(
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

pub(super) fn check_activation(
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

pub(super) fn check_layer(cfg: &GptConfig, layer: usize) -> Result<(), FsdpError> {
    if layer >= cfg.n_layer {
        return Err(FsdpError::LayerOutOfRange {
            layer,
            n_layer: cfg.n_layer,
        });
    }
    Ok(())
}

/// A LayerNorm output and its per-row statistics: `(y, mean, rstd)`.
pub(super) type Normed = (Vec<f32>, Vec<f32>, Vec<f32>);

/// LayerNorm forward of `x: [n, e]` with parameters `w`, `b`: returns `(y, mean, rstd)`, the
/// statistics kept for [`layer_norm_backward`]. `what` names the buffers `[mean, rstd, y]` in
/// allocation errors.
pub(super) fn layer_norm(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    n: usize,
    e: usize,
    what: [&str; 3],
) -> Result<Normed, FsdpError> {
    let mut mean = zeros(n, what[0])?;
    let mut rstd = zeros(n, what[1])?;
    let mut y = zeros(n * e, what[2])?;
    layernorm_forward(x, w, b, n, e, LAYER_NORM_EPS, &mut y, &mut mean, &mut rstd);
    Ok((y, mean, rstd))
}

/// What LayerNorm forward keeps for backward: its input and the per-row statistics of
/// [`layer_norm`].
pub(super) struct LayerNormSaved<'a> {
    x: &'a [f32],
    mean: &'a [f32],
    rstd: &'a [f32],
}

impl<'a> LayerNormSaved<'a> {
    /// The input `x` and the statistics `mean`, `rstd` of one LayerNorm forward.
    pub(super) fn new(x: &'a [f32], mean: &'a [f32], rstd: &'a [f32]) -> Self {
        LayerNormSaved { x, mean, rstd }
    }
}

/// LayerNorm backward from `dy`, the gradient of [`layer_norm`]'s `y`: accumulates the input
/// gradient into `dx` and adds the weight and bias gradients into `grads`' `{module}.weight` and
/// `{module}.bias`.
#[allow(clippy::too_many_arguments)]
pub(super) fn layer_norm_backward<G: Grads + ?Sized>(
    grads: &mut G,
    module: &str,
    saved: LayerNormSaved<'_>,
    w: &[f32],
    dy: &[f32],
    n: usize,
    e: usize,
    dx: &mut [f32],
) -> Result<(), FsdpError> {
    let LayerNormSaved { x, mean, rstd } = saved;
    layernorm_backward_input(x, mean, rstd, w, dy, n, e, dx);
    let mut dw = zeros(e, "dw")?;
    let mut db = zeros(e, "db")?;
    layernorm_backward_params(x, mean, rstd, dy, n, e, &mut dw, &mut db);
    add_into(grads, &format!("{module}.weight"), &dw)?;
    add_into(grads, &format!("{module}.bias"), &db)
}

/// Linear backward from `dy: [n, out_f]` of `y = x·Wᵀ + b`: adds the weight and bias
/// gradients into `grads`' `{module}.weight` and `{module}.bias` and returns the input gradient
/// `[n, in_f]`, the buffer `what`.
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_backward<G: Grads + ?Sized>(
    grads: &mut G,
    module: &str,
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    n: usize,
    in_f: usize,
    out_f: usize,
    what: &str,
) -> Result<Vec<f32>, FsdpError> {
    let dw = grad(grads, &format!("{module}.weight"), out_f * in_f)?;
    linear_backward_weight(dy, x, n, in_f, out_f, dw);
    linear_backward_bias(dy, n, out_f, grad(grads, &format!("{module}.bias"), out_f)?);
    let mut dx = zeros(n * in_f, what)?;
    linear_backward_input(dy, w, n, in_f, out_f, &mut dx);
    Ok(dx)
}
