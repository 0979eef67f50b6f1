//! The model, FSDP configuration and unit plan shared by `fsdp train` and `fsdp plan`, checked.

use fsdp::engine::MixedPrecisionPolicy;
use fsdp::units::UnitPlan;
use fsdp::wrap::{plan_units, WrapOptions, WrapPolicy};
use fsdp_allocator::{alloc_conf_from_env, AllocatorBackend, AllocatorConfig};
use fsdp_gpt::model::GptConfig;
use fsdp_gpt::runtime::FsdpConfig;
use fsdp_gpt::tree::gpt_module_tree;

use crate::args::{strategy_name, ModelArgs, Wrap};
use crate::{fail, CliError};

/// The model configuration, the FSDP configuration and the unit plan, validated.
pub(crate) struct Setup {
    pub(crate) cfg: GptConfig,
    pub(crate) config: FsdpConfig,
    pub(crate) plan: UnitPlan,
}

/// Ranks when none are given and no launcher says otherwise.
pub(crate) const DEFAULT_RANKS: usize = 4;

/// The model, the engine's configuration and its units for `m` at `world` ranks. `on_device`:
/// for `--device cuda` (whose memory the allocator settings may give to the driver's pool,
/// `backend:cudaMallocAsync`), else for the engine (which refuses that backend).
pub(crate) fn setup(m: &ModelArgs, world: usize, on_device: bool) -> Result<Setup, CliError> {
    if world == 0 {
        return Err(fail("--ranks must be at least 1"));
    }
    if m.vocab_size > usize::from(u16::MAX) + 1 {
        return Err(fail(format!(
            "--vocab-size {} is larger than 65536 (tokens are u16)",
            m.vocab_size
        )));
    }
    let cfg = GptConfig::new(m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size)?;
    let mut config = FsdpConfig::new(m.strategy);
    config.backward_prefetch = m.backward_prefetch;
    config.forward_prefetch = m.forward_prefetch;
    config.limit_all_gathers = m.limit_all_gathers.0;
    config.mixed_precision = MixedPrecisionPolicy::new(m.param_dtype, m.reduce_dtype);
    config.activation_checkpointing = m.activation_checkpointing;
    config.allocator = allocator_settings(m, on_device)?.0;
    // Under a launcher the hybrid strategies shard inside each node: the ranks per node are
    // the launcher's LOCAL_WORLD_SIZE (torchrun, `fsdp launch`) or mpirun's local size.
    let ranks_per_node = match (m.strategy.is_hybrid(), m.ranks_per_node) {
        (true, None) => crate::admission::local_ranks().filter(|&n| n > 0 && n < world),
        (_, n) => n,
    };
    if m.ranks_per_node.is_none() {
        if let Some(n) = ranks_per_node {
            if world % n != 0 {
                return Err(fail(format!(
                    "{world} ranks are not divisible by the launcher's {n} ranks per node \
                     (LOCAL_WORLD_SIZE): give --ranks-per-node"
                )));
            }
        }
    }
    match (m.strategy.is_hybrid(), ranks_per_node) {
        (true, Some(0)) => return Err(fail("--ranks-per-node must be at least 1")),
        (true, Some(n)) if world % n != 0 => {
            return Err(fail(format!(
                "--ranks {world} is not divisible by --ranks-per-node {n}"
            )))
        }
        (true, n) => config.ranks_per_node = n,
        (false, Some(_)) => {
            return Err(fail(format!(
                "--ranks-per-node applies only to hybrid strategies, not {}",
                strategy_name(m.strategy)
            )))
        }
        (false, None) => {}
    }
    let policy = match m.wrap {
        Wrap::Block => WrapPolicy::module_type(["Block"]),
        Wrap::Size(n) => WrapPolicy::size(n),
    };
    let plan = plan_units(&gpt_module_tree(&cfg), &WrapOptions::new(policy))?;
    Ok(Setup { cfg, config, plan })
}

/// The caching allocator's options and the backend they name: `--alloc-conf`, else the
/// PyTorch environment variable; `backend:cudaMallocAsync` (the driver's pool) only
/// `on_device`. Errors name where the text came from.
pub(crate) fn allocator_settings(
    m: &ModelArgs,
    on_device: bool,
) -> Result<(AllocatorConfig, AllocatorBackend), CliError> {
    let (origin, text) = match &m.alloc_conf {
        Some(text) => (String::new(), text.clone()),
        None => match alloc_conf_from_env().map_err(|e| fail(format!("--alloc-conf: {e}")))? {
            Some((var, text)) => (format!(" (from {var})"), text),
            None => return Ok((AllocatorConfig::default(), AllocatorBackend::Native)),
        },
    };
    let (config, backend) = AllocatorConfig::from_pytorch_conf_with_backend(&text)
        .map_err(|e| fail(format!("--alloc-conf{origin} `{text}`: {e}")))?;
    if backend == AllocatorBackend::CudaMallocAsync && !on_device {
        return Err(fail(format!(
            "--alloc-conf{origin} `{text}`: backend:cudaMallocAsync (the CUDA driver's \
             allocator) is for --device cuda; the sharded engine's memory is the caching \
             allocator (backend:native)"
        )));
    }
    Ok((config, backend))
}

/// Rows per micro-batch (all ranks) for `batch_size` rows in `grad_accum` micro-batches on
/// `world` ranks.
pub(crate) fn micro_batch(
    batch_size: usize,
    grad_accum: usize,
    world: usize,
) -> Result<usize, CliError> {
    if batch_size == 0 {
        return Err(fail("--batch-size must be at least 1"));
    }
    if grad_accum == 0 {
        return Err(fail("--grad-accum must be at least 1"));
    }
    if batch_size % grad_accum != 0 {
        return Err(fail(format!(
            "--batch-size {batch_size} is not divisible by --grad-accum {grad_accum}"
        )));
    }
    let micro = batch_size / grad_accum;
    if micro % world != 0 {
        return Err(fail(format!(
            "--batch-size {batch_size} ({micro} rows per micro-batch) is not divisible by \
             --ranks {world}"
        )));
    }
    Ok(micro)
}
