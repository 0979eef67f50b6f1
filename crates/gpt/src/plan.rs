//! The memory and communication plan of training the reference GPT: the engine's dry run
//! ([`fsdp::plan::plan_with_optimizer`]) over the GPT's spans, with the bytes each span adds
//! to the tape ([`span_activations`]), so that the activations' peak — with or without
//! activation checkpointing ([`FsdpConfig::activation_checkpointing`]) — and the peak of the
//! allocator's bytes plus the activations are the run's, byte for byte. [`plan`] and
//! [`plan_accumulated`] plan AdamW; [`plan_with_optimizer`] any [`OptimizerConfig`] (its state,
//! and under AnyPrecisionAdamW the shards held in `param_dtype`).

use fsdp::engine::SpanActivations;
use fsdp::optim::{AdamWConfig, OptimizerConfig};
use fsdp::plan::MemoryPlan;
use fsdp::units::UnitPlan;
use fsdp::{FsdpConfig, FsdpError, FsdpModel};

use crate::model::GptConfig;
use crate::runtime::GptModel;

pub use fsdp::plan::{available_memory, AvailableMemory, RankMemory, UnitPlanRow};

/// Plan `config` for the model `cfg` with `units` at `world` ranks, each with a batch of
/// `batch_per_rank` sequences of `seq` tokens (one micro-batch per step). With
/// [`FsdpConfig::activation_checkpointing`] every block is checkpointed, as in a run.
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
    let adamw = AdamWConfig::default().into();
    plan_with_optimizer(
        cfg,
        world,
        config,
        units,
        batch_per_rank,
        seq,
        micro_batches,
        &adamw,
    )
}

/// [`plan_accumulated`] of a run with the optimizer `optim` ([`fsdp::plan::plan_with_optimizer`]):
/// [`RankMemory::optimizer_state`] is its state
/// ([`OptimizerConfig::state_bytes_per_element`] per shard element), and under
/// AnyPrecisionAdamW the shards are held in the policy's `param_dtype` (no `f32` master
/// weights), as a run holds them.
///
/// ```
/// use fsdp::optim::{AdamWConfig, AnyPrecisionAdamWConfig, OptimizerConfig};
/// use fsdp::wrap::{plan_units, WrapOptions, WrapPolicy};
/// use fsdp_device::DType;
/// use fsdp_gpt::model::GptConfig;
/// use fsdp_gpt::plan::plan_with_optimizer;
/// use fsdp_gpt::runtime::{FsdpConfig, ShardingStrategy};
/// use fsdp_gpt::tree::gpt_module_tree;
///
/// let cfg = GptConfig::new(2, 2, 32, 16, 64)?;
/// let units = plan_units(
///     &gpt_module_tree(&cfg),
///     &WrapOptions::new(WrapPolicy::module_type(["Block"])),
/// )?;
/// let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
/// config.mixed_precision.param_dtype = DType::BF16;
/// let plan = |optim: OptimizerConfig| plan_with_optimizer(&cfg, 2, &config, &units, 2, 16, 1, &optim);
/// let adamw = plan(AdamWConfig::default().into())?;
/// let pure_bf16 = plan(AnyPrecisionAdamWConfig::default().into())?;
/// // Two bf16 moments and a bf16 compensation against two f32 moments.
/// assert_eq!(
///     pure_bf16.per_rank[0].optimizer_state * 8,
///     adamw.per_rank[0].optimizer_state * 6
/// );
/// # Ok::<(), fsdp::FsdpError>(())
/// ```
///
/// # Errors
/// As [`plan_accumulated`]; an invalid optimizer configuration, or AnyPrecisionAdamW with
/// `f16` parameters.
#[allow(clippy::too_many_arguments)]
pub fn plan_with_optimizer(
    cfg: &GptConfig,
    world: usize,
    config: &FsdpConfig,
    units: &UnitPlan,
    batch_per_rank: usize,
    seq: usize,
    micro_batches: usize,
    optim: &OptimizerConfig,
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
    let activations =
        span_activations(cfg, batch_per_rank, seq).ok_or_else(|| FsdpError::InvalidFsdpConfig {
            reason: format!(
                "the activations of {batch_per_rank} rows of {seq} tokens per rank overflow \
                 u64 bytes"
            ),
        })?;
    crate::runtime::check_plan(cfg, units)?;
    fsdp::plan::plan_with_optimizer(
        units,
        &model.spans(),
        &activations,
        world,
        config,
        micro_batches,
        optim,
    )
}

/// The bytes of one block's saved activations, one block's input (`rows·seq·n_embd` floats)
/// and the head's saved activations, for `rows` sequences of `seq` tokens; `None` on overflow.
fn saved_bytes(cfg: &GptConfig, rows: usize, seq: usize) -> Option<(u64, u64, u64)> {
    let (b, t, e, h, v) = (
        rows as u64,
        seq as u64,
        cfg.n_embd as u64,
        cfg.n_head as u64,
        cfg.vocab_size as u64,
    );
    let tokens = b.checked_mul(t)?;
    let te = tokens.checked_mul(e)?;
    // 16·tokens·e + 4·tokens + b·h·t·t floats per block: its input, ln_1's output, the qkv
    // projection (3), the heads' outputs, the residual x2, ln_2's output, the MLP's
    // pre-activation and GELU output (4 + 4), two LayerNorms' means and reciprocal standard
    // deviations, and the attention probabilities.
    let block = te
        .checked_mul(16)?
        .checked_add(tokens.checked_mul(4)?)?
        .checked_add(b.checked_mul(h)?.checked_mul(t)?.checked_mul(t)?)?;
    // 2·tokens·e + 2·tokens + tokens·v floats and tokens u32 for the head: its input, ln_f's
    // output, mean and reciprocal standard deviation, the softmax of the logits, the targets.
    let head = te
        .checked_mul(2)?
        .checked_add(tokens.checked_mul(3)?)?
        .checked_add(tokens.checked_mul(v)?)?;
    Some((
        block.checked_mul(4)?,
        te.checked_mul(4)?,
        head.checked_mul(4)?,
    ))
}

/// What each of the GPT's spans (the embedding, the blocks, the head: [`GptModel`]'s spans)
/// adds to and drops from its tape, for `rows` sequences of `seq` tokens per rank, as
/// [`GptModel`]'s forward and backward do it (measured by [`GptTape::bytes`]; the plan's dry
/// run applies these): the embedding's forward adds its output `x` (`I` bytes); a block's
/// forward moves its input into its saved activations and hands on its output (`+C`, its
/// saved activations), its backward drops them (`−C`), and a checkpointed block drops and
/// recomputes all of them but its input (`C − I`); the head's forward moves its input into its
/// saved activations (`+H − I`), its backward drops them and hands back the input's gradient
/// (`I − H`). `None` when a figure overflows `i64`.
///
/// [`GptTape::bytes`]: crate::runtime::GptTape::bytes
pub fn span_activations(cfg: &GptConfig, rows: usize, seq: usize) -> Option<Vec<SpanActivations>> {
    let (c, i, h) = saved_bytes(cfg, rows, seq)?;
    let (ci, ii, hi) = (
        i64::try_from(c).ok()?,
        i64::try_from(i).ok()?,
        i64::try_from(h).ok()?,
    );
    let mut spans = Vec::with_capacity(cfg.n_layer.checked_add(2)?);
    spans.push(SpanActivations {
        forward: ii,
        backward: 0,
        recomputable: None,
    });
    for _ in 0..cfg.n_layer {
        spans.push(SpanActivations {
            forward: ci,
            backward: -ci,
            recomputable: Some(c - i),
        });
    }
    spans.push(SpanActivations {
        forward: hi - ii,
        backward: ii - hi,
        recomputable: None,
    });
    Some(spans)
}

/// The peak of the GPT's activations (its tape) for `rows` sequences of `seq` tokens, without
/// activation checkpointing: every block's saved activations and the head's, at the end of
/// forward (`L·C + H`); `u64::MAX` when that overflows (see [`checked_activation_bytes`]).
pub fn activation_bytes(cfg: &GptConfig, rows: usize, seq: usize) -> u64 {
    checked_activation_bytes(cfg, rows, seq).unwrap_or(u64::MAX)
}

/// [`activation_bytes`], or `None` when the figure overflows `u64`.
pub fn checked_activation_bytes(cfg: &GptConfig, rows: usize, seq: usize) -> Option<u64> {
    peak_activation_bytes(cfg, rows, seq, false)
}

/// The peak of the GPT's activations (its tape) for `rows` sequences of `seq` tokens, in closed
/// form: without checkpointing `L·C + H` (every block's saved activations `C` and the head's
/// `H`, at the end of forward); with every block checkpointed `L·I + max(C, H)` (the blocks'
/// inputs `I`, plus the head's activations at the end of forward or one block's recomputed
/// activations in backward). The plan's dry run gives the same figure. `None` on overflow.
pub fn peak_activation_bytes(
    cfg: &GptConfig,
    rows: usize,
    seq: usize,
    checkpointed: bool,
) -> Option<u64> {
    let (c, i, h) = saved_bytes(cfg, rows, seq)?;
    let l = cfg.n_layer as u64;
    if checkpointed {
        l.checked_mul(i)?.checked_add(c.max(h))
    } else {
        l.checked_mul(c)?.checked_add(h)
    }
}
