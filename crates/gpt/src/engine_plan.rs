//! The device memory of the GPT trained through the engine on a device (`fsdp train --device
//! cuda --engine`, [`EngineGpt`]), predicted by a dry run of the two together: the engine of
//! rank 0 on the device path run dry ([`fsdp::plan::dry_run_engine_on_device`]: a dry-run
//! communicator, the device's buffers in a caching allocator over the meta device, operations
//! that only allocate), driven by the GPT's pass over the meta operations ([`MetaOps`]: the
//! buffers the kernels make and free, in order, without computing), whose buffers are mirrored
//! into the same allocator — as on CUDA, where the kernels take their buffers from the
//! engine's caching allocator. Two steps of [`EngineGpt::train_step`] (the second with the
//! execution order recorded in the first), as `fsdp train` runs them (one for a run of one
//! step).
//!
//! The engine's code decides what the device holds, so the plan cannot drift from it: the
//! shards, the gradient shards and the optimizer state (AdamW's two moments per shard element,
//! SGD's momentum) throughout, unless offloaded (CPU offload: then the shards' staging copies
//! while gathered, and the reduced gradients until the end of backward); the step's loss
//! during a step; the decisions' state; the norm's scalars. The kernels' buffers are predicted
//! exactly, and so are the engine's when the device keeps up with the host; the engine's
//! buffers return to the allocator when the device has run their work (held references, never
//! `record_stream`), so a device that runs behind the host holds a reduction's input beyond
//! the moment the plan frees it: at most the largest unit's unsharded gradient more
//! ([`EngineMemoryPlan::lag_margin`]). The host twins show both (`tests/engine_plan.rs`).
//!
//! The same dry run gives the rank's host memory ([`EngineMemoryPlan::host_peak`]): the
//! engine's host caching allocator's reserved peak (exactly the host twins') and the optimizer
//! state, which the engine builds on the host before it places it (with one moment's copy while
//! it places them; `fsdp train --engine` admits the host on it).

use fsdp::engine::FsdpConfig;
use fsdp::optim::OptimizerConfig;
use fsdp::units::UnitPlan;
use fsdp_kernels::gpt::{Attention, GptOps, GptPass, HostProducts, Logits, MetaOps};

use crate::data::Batch;
use crate::device_config::DeviceTrainError;
use crate::engine_gpt::EngineGpt;
use crate::model::{BatchShape, GptConfig};

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
    /// The engine's configuration (offloaded shards too).
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
    /// Clipping of the gradients' norm (`--grad-clip`).
    pub grad_clip: Option<f64>,
    /// The steps run dry: 2 (a run's peak: the second step prefetches in the order the first
    /// recorded), or 1 for a run of one step, whose peak is the first step's.
    pub steps: usize,
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
    /// The peak of the segments of the engine's buffers alone: the bytes the host twin's
    /// caching allocator reserves (one pool per stream, segments rounded up).
    pub engine_reserved: u64,
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
    /// The host memory of the rank's engine at its peak: its host caching allocator's reserved
    /// peak (the shards and gradient shards as built before they are placed, kept in its
    /// cache; offloaded ones throughout) and the optimizer state, built in host memory (then
    /// placed on the device and freed there, unless offloaded) — while it is placed, with one
    /// moment's copy more (the largest unit's shard in f32, a bound). Not counted: the pinned
    /// staging of the device's copies, and on the host twin its device's memory and the
    /// kernels' buffers (the other figures).
    pub host_peak: u64,
    /// The optimizer state as the engine builds it in host memory (part of `host_peak`; with
    /// the shards on the device it moves there, into `optimizer_state`).
    pub host_state: u64,
}

/// What one dry run measured.
struct DryRun {
    /// The allocator's peak.
    peak: u64,
    /// The allocator's reserved peak.
    reserved: u64,
    /// The kernels' count's peak.
    activations: u64,
    /// The shards and gradient shards.
    sharded: u64,
    /// The optimizer state.
    optimizer_state: u64,
    /// The largest unit's unsharded gradient, as the allocator rounds it.
    largest_gradient: u64,
    /// The host's peak (see [`EngineMemoryPlan::host_peak`]).
    host: u64,
    /// The optimizer state built in host memory.
    host_state: u64,
}

/// Plan `run`'s device memory.
///
/// # Errors
/// An invalid configuration or plan (the engine's errors), a batch the pass refuses.
pub fn plan_engine_memory(run: &EnginePlanRun<'_>) -> Result<EngineMemoryPlan, DeviceTrainError> {
    let together = dry_run(run, true)?;
    let engine_alone = dry_run(run, false)?;
    Ok(EngineMemoryPlan {
        peak_allocated: together.peak,
        engine_peak: engine_alone.peak,
        engine_reserved: engine_alone.reserved,
        activations_peak: together.activations,
        sharded_state: together.sharded,
        optimizer_state: together.optimizer_state,
        lag_margin: together.largest_gradient,
        host_peak: together.host,
        host_state: together.host_state,
    })
}

/// Two steps of the GPT on the engine's device path run dry (`train_step`, as `fsdp train`
/// runs them), the kernels' buffers in the device's allocator when `together`.
fn dry_run(run: &EnginePlanRun<'_>, together: bool) -> Result<DryRun, DeviceTrainError> {
    let fsdp::plan::DeviceDryRun {
        fsdp,
        device: alloc,
        host,
    } = fsdp::plan::dry_run_engine_on_device(run.units, run.world, &run.config, &run.optim)?;
    // The optimizer's state, built in host memory: then on the device (placed by the engine),
    // or still in host memory with offloaded shards.
    let host_state: u64 = fsdp
        .param_groups()
        .iter()
        .map(|g| (g.layout().shard_numel() * run.optim.state_bytes_per_element()) as u64)
        .sum();
    // Placing the state on the device copies each moment into a host buffer first, one at a
    // time, while the moments not yet placed are held: at most the largest unit's shard in f32.
    let placement_copy = match (run.config.offload_params, host_state) {
        (true, _) | (_, 0) => 0,
        _ => fsdp
            .param_groups()
            .iter()
            .map(|g| (g.layout().shard_numel() * 4) as u64)
            .max()
            .unwrap_or(0),
    };
    let optimizer_state = if run.config.offload_params {
        0
    } else {
        host_state
    };
    // The shards and gradient shards on the device (none offloaded).
    let sharded = alloc.memory_stats().allocated_bytes.all.current - optimizer_state;
    let largest_gradient = fsdp
        .param_groups()
        .iter()
        .map(|g| {
            let bytes = g.layout().padded_numel() * 4;
            run.config.allocator.round_size(bytes).unwrap_or(usize::MAX)
        })
        .max()
        .unwrap_or(0) as u64;
    let meta = |e: fsdp_allocator::AllocError| DeviceTrainError::Fsdp(e.into());
    let ops = MetaOps::new(run.products).with_copied_views(run.copied_views);
    if together {
        ops.memory_counter().mirror_into(alloc.clone());
    }
    let mut pass = GptPass::new(ops, run.cfg.dims())?;
    pass.set_activation_checkpointing(run.activation_checkpointing);
    pass.set_attention(run.attention);
    pass.set_logits(run.logits);
    let mut gpt = EngineGpt::new(fsdp, pass)?;
    let t = run.cfg.block_size;
    let batch = Batch {
        inputs: vec![0; run.rows * t],
        targets: vec![0; run.rows * t],
        shape: BatchShape {
            rows: run.rows,
            seq_len: t,
        },
    };
    let batches = vec![batch; run.micro_batches];
    let global = run.rows * t * run.world * run.micro_batches;
    for _ in 0..run.steps.clamp(1, 2) {
        gpt.train_step(&batches, global, run.grad_clip)?;
    }
    gpt.flush_steps()?;
    if let Some(Err(e)) = gpt.pass().ops().memory_counter().mirror_stats() {
        return Err(meta(e));
    }
    let stats = alloc.memory_stats();
    let (peak, reserved) = (
        stats.allocated_bytes.all.peak,
        stats.reserved_bytes.all.peak,
    );
    let activations = gpt.pass().ops().memory().peak;
    let host = host.memory_stats().reserved_bytes.all.peak + host_state + placement_copy;
    Ok(DryRun {
        peak,
        reserved,
        activations,
        sharded,
        optimizer_state,
        largest_gradient,
        host,
        host_state,
    })
}
