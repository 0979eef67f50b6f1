//! The reference GPT's initialisation as a rule for the engine's sharded initialisation
//! ([`fsdp::ParamInit::Seeded`]): each rank draws only its own shards, and the same seed gives
//! the same model at every world size.

use fsdp::init::Init;
use fsdp::FsdpError;

/// nanoGPT's initialisation of the reference GPT-2 (`GPT._init_weights` plus its `c_proj`
/// special case), as a rule for [`fsdp::init::fill_shard`]:
///
/// - every `*.bias` → [`Init::Zeros`] (Linear biases are zeroed, LayerNorm biases default to 0);
/// - LayerNorm weights (names containing `ln_` and ending `.weight`, 1-D) → [`Init::Ones`]
///   (PyTorch's default);
/// - `*c_proj.weight` → `Normal(0, 0.02 / sqrt(2 * n_layer))`, nanoGPT's scaled init of the
///   residual projections (`attn.c_proj` and `mlp.c_proj`);
/// - every other `*.weight` (Linear and Embedding, 2-D) → `Normal(0, 0.02)`.
///
/// `lm_head.weight` is tied to `transformer.wte.weight` and takes no space of its own, so
/// callers never ask for it; if asked, it gets the `wte` rule, `Normal(0, 0.02)`.
///
/// # Errors
/// The returned rule fails with [`FsdpError::UnknownParameter`] for a name ending neither
/// `.weight` nor `.bias`, [`FsdpError::InvalidShape`] for a LayerNorm weight that is not 1-D or
/// another weight that is not 2-D, and [`FsdpError::InvalidConfig`] for a `c_proj` weight when
/// `n_layer` is 0.
///
/// ```
/// use fsdp::init::Init;
/// use fsdp_gpt::init::gpt2_init;
///
/// # fn main() -> Result<(), fsdp::FsdpError> {
/// let rule = gpt2_init(2);
/// assert_eq!(rule("transformer.h.0.ln_1.weight", &[8])?, Init::Ones);
/// assert_eq!(rule("transformer.h.0.attn.c_attn.bias", &[24])?, Init::Zeros);
/// assert_eq!(
///     rule("transformer.wte.weight", &[96, 8])?,
///     Init::Normal { mean: 0.0, std: 0.02 }
/// );
/// assert_eq!(
///     rule("transformer.h.1.mlp.c_proj.weight", &[8, 32])?,
///     Init::Normal { mean: 0.0, std: 0.01 } // 0.02 / sqrt(2 * 2)
/// );
/// # Ok(())
/// # }
/// ```
pub fn gpt2_init(n_layer: usize) -> impl Fn(&str, &[usize]) -> Result<Init, FsdpError> {
    move |name: &str, shape: &[usize]| {
        if name.ends_with(".bias") {
            return Ok(Init::Zeros);
        }
        if !name.ends_with(".weight") {
            return Err(FsdpError::UnknownParameter { name: name.into() });
        }
        if name.contains("ln_") {
            if shape.len() != 1 {
                return Err(FsdpError::InvalidShape {
                    reason: format!("LayerNorm weight `{name}` has shape {shape:?}, not 1-D"),
                });
            }
            return Ok(Init::Ones);
        }
        if shape.len() != 2 {
            return Err(FsdpError::InvalidShape {
                reason: format!("Linear or Embedding weight `{name}` has shape {shape:?}, not 2-D"),
            });
        }
        let std = if name.ends_with("c_proj.weight") {
            if n_layer == 0 {
                return Err(FsdpError::InvalidConfig {
                    reason: format!("`{name}` needs n_layer > 0 for its scaled init"),
                });
            }
            0.02 / (2.0 * n_layer as f64).sqrt()
        } else {
            0.02
        };
        Ok(Init::Normal { mean: 0.0, std })
    }
}
