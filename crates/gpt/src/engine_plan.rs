//! The device memory of the GPT trained through the engine on a device (`fsdp train --device
//! cuda --engine`, [`EngineGpt`]), predicted by a dry run of the two together: the engine of
//! rank 0 over a dry-run communicator with its buffers in a caching allocator over the meta
//! device ([`fsdp::plan::dry_run_engine`]), driven by the GPT's pass over the meta operations
//! ([`MetaOps`]: the buffers the kernels make and free, in order, without computing), whose
//! buffers are mirrored into the same allocator — as on CUDA, where the kernels take their
//! buffers from the engine's caching allocator. Two steps of `micro_batches` passes each (the
//! second with the execution order recorded in the first), then the optimizer step.
//!
//! On the device the shards, the gradient shards and the optimizer state (AdamW's two moments
//! per shard element, SGD's momentum) are held throughout (offloaded shards are not planned);
//! so is the step's
//! loss ([`EngineGpt::step_loss`]) during a step. The end of a step (the norm, the decision,
//! the optimizer) allocates a few scalars while the unsharded buffers are gone, below the
//! peak. The kernels' buffers are predicted exactly, and so are the engine's when the device
//! keeps up with the host; the engine's buffers return to the allocator when the device has
//! run their work (held references, never `record_stream`), so a device that runs behind the
//! host holds a reduction's input beyond the moment the plan frees it: at most the largest
//! unit's unsharded gradient more ([`EngineMemoryPlan::lag_margin`]). The host twins show
//! both (`tests/engine_plan.rs`).

use fsdp::engine::FsdpConfig;
use fsdp::optim::OptimizerConfig;
use fsdp::units::UnitPlan;
use fsdp::FsdpError;
use fsdp_device::Stream;
use fsdp_kernels::gpt::{Attention, GptOps, GptPass, HostProducts, Logits, MetaOps};
use fsdp_kernels::host::step_scalars_len;

use crate::device_config::DeviceTrainError;
use crate::engine_gpt::EngineGpt;
use crate::model::GptConfig;

/// What the plan runs: the model, its units, the engine's world and configuration, and the
/// pass's options.
#[derive(Clone, Copy, Debug)]
pub struct EnginePlanRun<'a> {
    /// The model.
    pub cfg: GptConfig,
    /// The engine's units (the root and each block, as `gpt_block_plan`).
    pub units: &'a UnitPlan,
    /// Ranks.
    pub world: usize,
    /// The engine's configuration (not offloaded).
    pub config: FsdpConfig,
    /// The optimizer (its state's bytes per shard element).
    pub optim: OptimizerConfig,
    /// Rows of a micro-batch on each rank.
    pub rows: usize,
    /// Micro-batches per optimizer step.
    pub micro_batches: usize,
    /// The products' operands.
    pub products: HostProducts,
    /// Activation checkpointing of every block.
    pub activation_checkpointing: bool,
    /// The attention kernel.
    pub attention: Attention,
    /// The head's logits.
    pub logits: Logits,
    /// The kernels see the engine's buffers through counted copies (the host twins), not in
    /// place (CUDA).
    pub copied_views: bool,
}

/// The predicted device memory of one rank, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineMemoryPlan {
    /// The peak of the allocator's bytes, the engine's buffers and the kernels' together (one
    /// caching allocator on CUDA).
    pub peak_allocated: u64,
    /// The peak of the engine's buffers alone (the host twin's allocator).
    pub engine_peak: u64,
    /// The peak of the kernels' buffers alone (their operations' count).
    pub activations_peak: u64,
    /// The shards and gradient shards, held throughout.
    pub sharded_state: u64,
    /// The optimizer state, held throughout.
    pub optimizer_state: u64,
    /// What a device that runs behind the host may hold beyond the plan: the largest unit's
    /// unsharded gradient (a reduction's input is returned to the allocator once the device
    /// has run the reduction, not when the host lets it go; the plan frees it then).
    pub lag_margin: u64,
}

/// What one dry run measured.
struct DryRun {
    /// The allocator's peak.
    peak: u64,
    /// The kernels' count's peak.
    activations: u64,
    /// The shards and gradient shards.
    sharded: u64,
    /// The optimizer state.
    optimizer_state: u64,
    /// The largest unit's unsharded gradient, as the allocator rounds it.
    largest_gradient: u64,
}

/// Plan `run`'s device memory.
///
/// # Errors
/// An invalid configuration or plan (the engine's errors), a batch the pass refuses;
/// [`FsdpError::InvalidFsdpConfig`] for offloaded shards (not planned: the device then holds
/// the shards' staging copies, which the dry run on the host does not make).
pub fn plan_engine_memory(run: &EnginePlanRun<'_>) -> Result<EngineMemoryPlan, DeviceTrainError> {
    if run.config.offload_params {
        return Err(DeviceTrainError::Fsdp(FsdpError::InvalidFsdpConfig {
            reason: "the plan of the engine on a device does not cover offloaded shards (CPU \
                     offload): the device holds their staging copies instead"
                .into(),
        }));
    }
    let together = dry_run(run, true)?;
    let engine_alone = dry_run(run, false)?;
    Ok(EngineMemoryPlan {
        peak_allocated: together.peak,
        engine_peak: engine_alone.peak,
        activations_peak: together.activations,
        sharded_state: together.sharded,
        optimizer_state: together.optimizer_state,
        lag_margin: together.largest_gradient,
    })
}

/// Two steps of the GPT on the dry-run engine, the kernels' buffers in its allocator when
/// `together`.
fn dry_run(run: &EnginePlanRun<'_>, together: bool) -> Result<DryRun, DeviceTrainError> {
    let (fsdp, alloc) = fsdp::plan::dry_run_engine(run.units, run.world, &run.config, &run.optim)?;
    let sharded = alloc.memory_stats().allocated_bytes.all.current;
    let largest_gradient = fsdp
        .param_groups()
        .iter()
        .map(|g| {
            let bytes = g.layout().padded_numel() * 4;
            run.config.allocator.round_size(bytes).unwrap_or(usize::MAX)
        })
        .max()
        .unwrap_or(0) as u64;
    let stream = Stream::inline("plan");
    let meta = |e: fsdp_allocator::AllocError| DeviceTrainError::Fsdp(e.into());
    // On the device the optimizer's moments, per unit, as the engine places them.
    let mut held = Vec::new();
    let mut optimizer_state = 0u64;
    let moments = run.optim.state_bytes_per_element() / 4;
    for g in fsdp.param_groups() {
        let bytes = g.layout().shard_numel() * 4;
        for _ in 0..moments {
            held.push(alloc.allocate(bytes, &stream).map_err(meta)?);
            optimizer_state += bytes as u64;
        }
    }
    let ops = MetaOps::new(run.products).with_copied_views(run.copied_views);
    if together {
        ops.memory_counter().mirror_into(alloc.clone());
    }
    let mut pass = GptPass::new(ops, run.cfg.dims())?;
    pass.set_activation_checkpointing(run.activation_checkpointing);
    pass.set_attention(run.attention);
    pass.set_logits(run.logits);
    let units = fsdp.param_groups().len();
    let mut gpt = EngineGpt::new(fsdp, pass)?;
    // The state of the steps decided on the device (the non-finite rule's), held throughout.
    let scalars = step_scalars_len(0) * 8;
    held.push(alloc.allocate(scalars, &stream).map_err(meta)?);
    let t = run.cfg.block_size;
    let ids = vec![0u32; run.rows * t];
    let global = run.rows * t * run.world * run.micro_batches;
    for _ in 0..2 {
        // The step's loss, held through the step.
        let loss = alloc
            .allocate(step_scalars_len(0) * 8, &stream)
            .map_err(meta)?;
        for m in 0..run.micro_batches {
            let before = gpt.set_no_sync(m + 1 < run.micro_batches);
            let r = gpt.forward_backward(&ids, &ids, run.rows, t, global);
            gpt.set_no_sync(before);
            r?;
        }
        // The end of the step on the device: the sums of squares (two accumulators and one
        // per unit), the norm and clipping coefficient, the loss summed over the world and
        // the decision's zeros — all at once, as when the device lags the host (an upper
        // bound: their frees wait for their work).
        let end: Vec<_> = (0..units + 5)
            .map(|_| alloc.allocate(8, &stream))
            .collect::<Result<_, _>>()
            .map_err(meta)?;
        drop(end);
        gpt.optimizer_step()?;
        drop(loss);
    }
    if let Some(Err(e)) = gpt.pass().ops().memory_counter().mirror_stats() {
        return Err(meta(e));
    }
    let peak = alloc.memory_stats().allocated_bytes.all.peak;
    let activations = gpt.pass().ops().memory().peak;
    drop(held);
    Ok(DryRun {
        peak,
        activations,
        sharded,
        optimizer_state,
        largest_gradient,
    })
}
