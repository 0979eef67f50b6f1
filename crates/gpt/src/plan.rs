//! The memory and communication plan of training the reference GPT: the engine's dry run
//! ([`fsdp::plan::plan`]) over the GPT's spans, with the GPT's activation estimate.

use fsdp::plan::MemoryPlan;
use fsdp::units::UnitPlan;
use fsdp::{FsdpConfig, FsdpError, FsdpModel};

use crate::model::GptConfig;
use crate::runtime::GptModel;

pub use fsdp::plan::{RankMemory, UnitPlanRow};

/// Plan `config` for the model `cfg` with `units` at `world` ranks, each with a batch of
/// `batch_per_rank` sequences of `seq` tokens (one micro-batch per step).
///
/// # Errors
/// The model configuration's validation errors, [`FsdpError::InvalidPlan`] for a plan that
/// does not cover the model, [`FsdpError::InvalidFsdpConfig`] for a world of 0, a
/// `ranks_per_node` that does not divide the world, a limit of 0, or a batch of 0 rows or a
/// `seq` of 0 or above the block size.
pub fn plan(
    cfg: &GptConfig,
    world: usize,
    config: &FsdpConfig,
    units: &UnitPlan,
    batch_per_rank: usize,
    seq: usize,
) -> Result<MemoryPlan, FsdpError> {
    let model = GptModel::new(*cfg, 1)?;
    if batch_per_rank == 0 || seq == 0 || seq > cfg.block_size {
        return Err(FsdpError::InvalidFsdpConfig {
            reason: format!(
                "a batch of {batch_per_rank} rows of {seq} tokens (block size {})",
                cfg.block_size
            ),
        });
    }
    crate::runtime::check_plan(cfg, units)?;
    let p = fsdp::plan::plan(units, &model.spans(), world, config)?;
    Ok(p.with_activations(activation_bytes(cfg, batch_per_rank, seq)))
}

/// The bytes of the caches the GPT's forward keeps for backward (an estimate: the blocks'
/// inputs, normalised activations, attention probabilities and MLP activations, and the
/// head's logits), for `rows` sequences of `seq` tokens.
pub fn activation_bytes(cfg: &GptConfig, rows: usize, seq: usize) -> u64 {
    let (b, t, e, h, v) = (
        rows as u64,
        seq as u64,
        cfg.n_embd as u64,
        cfg.n_head as u64,
        cfg.vocab_size as u64,
    );
    let tokens = b * t;
    let per_block = 16 * tokens * e + 4 * tokens + b * h * t * t;
    let head_cache = 2 * tokens * e + 2 * tokens + tokens * v + tokens;
    4 * (cfg.n_layer as u64 * per_block + head_cache + tokens * e)
}
