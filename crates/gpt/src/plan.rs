//! The memory and communication plan of training the reference GPT: the engine's dry run
//! ([`fsdp::plan::plan`]) over the GPT's spans, with the GPT's activation estimate.

use fsdp::plan::MemoryPlan;
use fsdp::units::UnitPlan;
use fsdp::{FsdpConfig, FsdpError, FsdpModel};

use crate::model::GptConfig;
use crate::runtime::GptModel;

pub use fsdp::plan::{available_memory, AvailableMemory, RankMemory, UnitPlanRow};

/// Plan `config` for the model `cfg` with `units` at `world` ranks, each with a batch of
/// `batch_per_rank` sequences of `seq` tokens (one micro-batch per step).
///
/// # Errors
/// The model configuration's validation errors, [`FsdpError::InvalidPlan`] for a plan that
/// does not cover the model, [`FsdpError::InvalidFsdpConfig`] for a world of 0, a
/// `ranks_per_node` that does not divide the world, a limit of 0, or a batch of 0 rows or a
/// `seq` of 0 or above the block size, or activations whose bytes overflow `u64`.
pub fn plan(
    cfg: &GptConfig,
    world: usize,
    config: &FsdpConfig,
    units: &UnitPlan,
    batch_per_rank: usize,
    seq: usize,
) -> Result<MemoryPlan, FsdpError> {
    plan_accumulated(cfg, world, config, units, batch_per_rank, seq, 1)
}

/// [`plan`] with `micro_batches` micro-batches of `batch_per_rank` sequences per optimizer
/// step, accumulated under `no_sync` ([`fsdp::plan::plan_accumulated`]).
///
/// # Errors
/// As [`plan`]; 0 micro-batches.
pub fn plan_accumulated(
    cfg: &GptConfig,
    world: usize,
    config: &FsdpConfig,
    units: &UnitPlan,
    batch_per_rank: usize,
    seq: usize,
    micro_batches: usize,
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
    let activations = checked_activation_bytes(cfg, batch_per_rank, seq).ok_or_else(|| {
        FsdpError::InvalidFsdpConfig {
            reason: format!(
                "the activations of {batch_per_rank} rows of {seq} tokens per rank overflow \
                 u64 bytes"
            ),
        }
    })?;
    crate::runtime::check_plan(cfg, units)?;
    let p = fsdp::plan::plan_accumulated(units, &model.spans(), world, config, micro_batches)?;
    Ok(p.with_activations(activations))
}

/// The bytes of the caches the GPT's forward keeps for backward (an estimate: the blocks'
/// inputs, normalised activations, attention probabilities and MLP activations, and the
/// head's logits), for `rows` sequences of `seq` tokens; `u64::MAX` when that overflows (see
/// [`checked_activation_bytes`]).
pub fn activation_bytes(cfg: &GptConfig, rows: usize, seq: usize) -> u64 {
    checked_activation_bytes(cfg, rows, seq).unwrap_or(u64::MAX)
}

/// [`activation_bytes`], or `None` when the figure overflows `u64`.
pub fn checked_activation_bytes(cfg: &GptConfig, rows: usize, seq: usize) -> Option<u64> {
    let (b, t, e, h, v) = (
        rows as u64,
        seq as u64,
        cfg.n_embd as u64,
        cfg.n_head as u64,
        cfg.vocab_size as u64,
    );
    let tokens = b.checked_mul(t)?;
    let te = tokens.checked_mul(e)?;
    // 16·tokens·e + 4·tokens + b·h·t·t per block.
    let per_block = te
        .checked_mul(16)?
        .checked_add(tokens.checked_mul(4)?)?
        .checked_add(b.checked_mul(h)?.checked_mul(t)?.checked_mul(t)?)?;
    // 2·tokens·e + 2·tokens + tokens·v + tokens for the head.
    let head_cache = te
        .checked_mul(2)?
        .checked_add(tokens.checked_mul(3)?)?
        .checked_add(tokens.checked_mul(v)?)?;
    (cfg.n_layer as u64)
        .checked_mul(per_block)?
        .checked_add(head_cache)?
        .checked_add(te)?
        .checked_mul(4)
}
