//! The reference model: GPT-2 exactly as written in nanoGPT's `model.py` (bias on, dropout 0),
//! with forward and backward on the host in `f32`.
//!
//! - [`GptConfig`] describes the model; [`param_specs`] lists its parameters with nanoGPT's names
//!   and shapes, in nanoGPT's order (`lm_head.weight` omitted: it is tied to
//!   `transformer.wte.weight`); [`init_params`] initialises them as nanoGPT does.
//! - Parameters are read through the [`Params`] trait and gradients written through [`Grads`],
//!   so that a caller can hand views of its own (flat, sharded, gathered) buffers. Both are
//!   implemented for `HashMap<String, Vec<f32>>` and for maps of borrowed slices.
//! - The model runs in **stages** that match FSDP units: [`embed_forward`], [`block_forward`]
//!   (one per transformer block) and [`head_forward`] (final LayerNorm, tied `lm_head`,
//!   cross-entropy), then [`head_backward`], [`block_backward`] in reverse and
//!   [`embed_backward`]. Each backward stage **accumulates** into the gradients of its own
//!   parameters only; the head also adds the tied `lm_head` term into `wte`'s gradient.
//! - [`forward_backward`] and [`forward_loss`] chain the stages for single-process use.
//!
//! The loss is the sum of the per-token cross-entropies of the tokens given, divided by a
//! normaliser that the caller passes: the number of tokens of the **global** batch, so that
//! a rank's loss and gradients are its share of the global mean and summing them over ranks
//! gives exactly the global mean's.

mod block;
mod embed;
mod gpt;
mod head;
pub mod layers;
mod stage;

pub use block::{block_backward, block_forward, BlockCache};
pub use embed::{embed_backward, embed_forward};
pub use gpt::{forward_backward, forward_loss};
pub use head::{head_backward, head_forward, HeadCache};

use std::collections::HashMap;

pub use fsdp::units::ParamSpec;
use fsdp::FsdpError;
pub use fsdp::{Grads, Params};

/// LayerNorm's epsilon, as `torch.nn.LayerNorm`'s default and nanoGPT.
pub const LAYER_NORM_EPS: f32 = 1e-5;

/// The shape of a GPT-2 model, as nanoGPT's `GPTConfig` (bias always on, dropout 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GptConfig {
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Number of attention heads per block.
    pub n_head: usize,
    /// Embedding width `E`; must be divisible by `n_head`.
    pub n_embd: usize,
    /// Maximum sequence length (rows of `wpe`).
    pub block_size: usize,
    /// Vocabulary size (rows of `wte`).
    pub vocab_size: usize,
}

impl GptConfig {
    /// A validated configuration.
    ///
    /// # Errors
    /// [`FsdpError::InvalidConfig`] as described in [`GptConfig::validate`].
    pub fn new(
        n_layer: usize,
        n_head: usize,
        n_embd: usize,
        block_size: usize,
        vocab_size: usize,
    ) -> Result<Self, FsdpError> {
        let cfg = GptConfig {
            n_layer,
            n_head,
            n_embd,
            block_size,
            vocab_size,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The tiny model of the golden reference: 2 layers, 2 heads, `E = 32`, block size 16,
    /// vocabulary 96.
    pub fn tiny() -> Self {
        GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 32,
            block_size: 16,
            vocab_size: 96,
        }
    }

    /// GPT-2 small (124M): 12 layers, 12 heads, `E = 768`, block size 1024, vocabulary 50257.
    pub fn gpt2() -> Self {
        GptConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab_size: 50257,
        }
    }

    /// Checks that every size is positive, that `n_embd` is divisible by `n_head`, that token
    /// ids fit in `u32`, and that the parameter count fits in `usize`.
    ///
    /// # Errors
    /// [`FsdpError::InvalidConfig`] naming the first problem found.
    pub fn validate(&self) -> Result<(), FsdpError> {
        let bad = |reason: String| Err(FsdpError::InvalidConfig { reason });
        for (name, v) in [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("block_size", self.block_size),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if self.n_embd % self.n_head != 0 {
            return bad(format!(
                "n_embd {} is not divisible by n_head {}",
                self.n_embd, self.n_head
            ));
        }
        if u32::try_from(self.vocab_size).is_err() {
            return bad(format!(
                "vocab_size {} does not fit in u32",
                self.vocab_size
            ));
        }
        if self.checked_num_params().is_none() {
            return bad("the number of parameters overflows usize".to_string());
        }
        Ok(())
    }

    /// The number of parameters, computed without listing them, or `None` when it overflows
    /// `usize`: `(V + T)·E` for the embeddings, `12·E² + 13·E` per block, `2·E` for `ln_f`.
    pub fn checked_num_params(&self) -> Option<usize> {
        let e = self.n_embd;
        let emb = self
            .vocab_size
            .checked_add(self.block_size)?
            .checked_mul(e)?;
        let block = e
            .checked_mul(e)?
            .checked_mul(12)?
            .checked_add(e.checked_mul(13)?)?;
        emb.checked_add(block.checked_mul(self.n_layer)?)?
            .checked_add(e.checked_mul(2)?)
    }

    /// Width of one attention head, `n_embd / n_head`.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Total number of parameters (the tied `lm_head` counted once), the sum of
    /// [`param_specs`]' sizes; saturates at `usize::MAX` for a configuration that
    /// [`validate`](Self::validate) refuses.
    pub fn num_params(&self) -> usize {
        self.checked_num_params().unwrap_or(usize::MAX)
    }
}

/// Name of a parameter of block `layer`, e.g. `block_param(0, "attn.c_attn.weight")`.
pub fn block_param(layer: usize, suffix: &str) -> String {
    format!("transformer.h.{layer}.{suffix}")
}

/// The suffixes of one block's parameters, in nanoGPT's order, with their shapes for width `e`.
fn block_suffixes(e: usize) -> [(&'static str, Vec<usize>); 12] {
    [
        ("ln_1.weight", vec![e]),
        ("ln_1.bias", vec![e]),
        ("attn.c_attn.weight", vec![3 * e, e]),
        ("attn.c_attn.bias", vec![3 * e]),
        ("attn.c_proj.weight", vec![e, e]),
        ("attn.c_proj.bias", vec![e]),
        ("ln_2.weight", vec![e]),
        ("ln_2.bias", vec![e]),
        ("mlp.c_fc.weight", vec![4 * e, e]),
        ("mlp.c_fc.bias", vec![4 * e]),
        ("mlp.c_proj.weight", vec![e, 4 * e]),
        ("mlp.c_proj.bias", vec![e]),
    ]
}

/// The parameters of the embedding stage: `transformer.wte.weight`, `transformer.wpe.weight`.
pub fn embed_param_specs(cfg: &GptConfig) -> Vec<ParamSpec> {
    vec![
        ParamSpec {
            name: "transformer.wte.weight".into(),
            shape: vec![cfg.vocab_size, cfg.n_embd],
        },
        ParamSpec {
            name: "transformer.wpe.weight".into(),
            shape: vec![cfg.block_size, cfg.n_embd],
        },
    ]
}

/// The parameters of transformer block `layer`, in nanoGPT's order.
pub fn block_param_specs(cfg: &GptConfig, layer: usize) -> Vec<ParamSpec> {
    block_suffixes(cfg.n_embd)
        .into_iter()
        .map(|(s, shape)| ParamSpec {
            name: block_param(layer, s),
            shape,
        })
        .collect()
}

/// The parameters owned by the head stage: `transformer.ln_f.{weight,bias}`. (The head also
/// reads `transformer.wte.weight`, the tied `lm_head`, and adds to its gradient.)
pub fn head_param_specs(cfg: &GptConfig) -> Vec<ParamSpec> {
    let e = cfg.n_embd;
    vec![
        ParamSpec {
            name: "transformer.ln_f.weight".into(),
            shape: vec![e],
        },
        ParamSpec {
            name: "transformer.ln_f.bias".into(),
            shape: vec![e],
        },
    ]
}

/// All parameters in nanoGPT's order (`named_parameters()` order): `wte`, `wpe`, the blocks,
/// `ln_f`. `lm_head.weight` is omitted: it is tied to `transformer.wte.weight`.
pub fn param_specs(cfg: &GptConfig) -> Vec<ParamSpec> {
    let mut specs = embed_param_specs(cfg);
    for layer in 0..cfg.n_layer {
        specs.extend(block_param_specs(cfg, layer));
    }
    specs.extend(head_param_specs(cfg));
    specs
}

/// A small deterministic generator (SplitMix64) with normal samples by Box–Muller.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
    spare: Option<f64>,
}

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        SplitMix64 {
            state: seed,
            spare: None,
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A standard normal sample.
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let th = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some(r * th.sin());
        r * th.cos()
    }
}

/// Initial values of every parameter, in [`param_specs`] order, as nanoGPT initialises them:
/// weights of Linear and Embedding layers normal with std 0.02, `c_proj` weights std
/// `0.02/√(2·n_layer)`, biases 0, LayerNorm weights 1. Deterministic in `seed` (SplitMix64),
/// not bitwise equal to PyTorch's generator.
pub fn init_params(cfg: &GptConfig, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64::new(seed);
    let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
    param_specs(cfg)
        .iter()
        .map(|spec| {
            let n = spec.numel();
            let name = spec.name.as_str();
            if name.ends_with(".bias") {
                vec![0.0; n]
            } else if name.contains(".ln_") {
                vec![1.0; n]
            } else {
                let std = if name.ends_with("c_proj.weight") {
                    proj_std
                } else {
                    0.02
                };
                (0..n).map(|_| (rng.normal() * std) as f32).collect()
            }
        })
        .collect()
}

/// Pairs [`param_specs`] names with values in the same order (e.g. from [`init_params`]) as a
/// map usable as [`Params`] and [`Grads`].
///
/// # Errors
/// [`FsdpError::ParameterLength`] when a value's length does not match its shape, or
/// [`FsdpError::InvalidShape`] when the number of values differs from the number of parameters.
pub fn named_params(
    cfg: &GptConfig,
    values: Vec<Vec<f32>>,
) -> Result<HashMap<String, Vec<f32>>, FsdpError> {
    let specs = param_specs(cfg);
    if specs.len() != values.len() {
        return Err(FsdpError::InvalidShape {
            reason: format!(
                "{} values given for {} parameters",
                values.len(),
                specs.len()
            ),
        });
    }
    specs
        .into_iter()
        .zip(values)
        .map(|(spec, v)| {
            if v.len() != spec.numel() {
                Err(FsdpError::ParameterLength {
                    expected: spec.numel(),
                    actual: v.len(),
                    name: spec.name,
                })
            } else {
                Ok((spec.name, v))
            }
        })
        .collect()
}

/// A zero-filled gradient (or parameter) map with every parameter of the model.
pub fn zeros_like_params(cfg: &GptConfig) -> HashMap<String, Vec<f32>> {
    param_specs(cfg)
        .into_iter()
        .map(|s| {
            let n = s.numel();
            (s.name, vec![0.0; n])
        })
        .collect()
}

/// The shape of a batch of token rows: `rows` sequences of `seq_len` tokens, laid out one row
/// after the other (`rows · seq_len` tokens in all).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchShape {
    /// Number of sequences.
    pub rows: usize,
    /// Tokens per sequence (at most the model's `block_size`).
    pub seq_len: usize,
}

impl BatchShape {
    /// Number of tokens, `rows · seq_len`.
    pub fn tokens(&self) -> usize {
        self.rows * self.seq_len
    }
}
