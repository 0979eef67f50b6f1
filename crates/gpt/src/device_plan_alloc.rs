//! What the caching allocator of a device run will report, predicted: [`plan_allocator`] runs
//! the one-rank trainer ([`DeviceTrainer`]) over [`MetaOps`] — operations that make the GPU
//! run's buffers, of its sizes and in its order, and compute nothing — with every counted
//! buffer mirrored into a caching allocator over a meta source
//! ([`MemoryCounter::mirror_into`](fsdp_kernels::gpt::MemoryCounter::mirror_into)) configured
//! as the run's (`--alloc-conf`, `PYTORCH_CUDA_ALLOC_CONF`). The allocator decides by the same
//! rules whatever its source, so its statistics are the GPU allocator's: the blocks handed out
//! (each buffer rounded to 512 bytes) and the segments reserved from the device. Scratch that
//! single kernels take from the driver's pool is not in either.
//! `tests/device_plan_alloc.rs` holds it equal to the host twins' buffers replayed through an
//! allocator; on a GPU `tests/gpu_device_train.rs` to the run's own statistics.

use std::collections::HashMap;
use std::fmt;

use fsdp_allocator::{AllocatorConfig, MemoryStats, MetaAllocator, MetaSource};
use fsdp_kernels::gpt::{param_shapes, MetaOps, Products};

use crate::device_config::{DeviceTrainConfig, DeviceTrainError};
use crate::device_plan_sharded::{run_process, run_threads, twin_products, ProcessRun};
use crate::device_train::DeviceTrainer;

/// Steps the prediction runs: the first grows the kept bf16 operand copies, the later ones
/// are the steady state.
pub const PLANNED_STEPS: usize = 3;

/// The caching allocator's statistics a device run will report, predicted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllocatorPlan {
    /// The most bytes handed out at once (PyTorch's `max_memory_allocated`): the counted
    /// buffers, each rounded up to the allocator's blocks.
    pub peak_allocated: u64,
    /// The most bytes reserved from the device at once (`max_memory_reserved`).
    pub peak_reserved: u64,
    /// Segments held at the end.
    pub segments: u64,
    /// Device allocations (`cuMemAlloc`, or expandable segments' mappings) made in all.
    pub device_allocations: u64,
}

impl fmt::Display for AllocatorPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
        write!(
            f,
            "caching allocator: peak allocated {} bytes ({}), peak reserved {} bytes ({})",
            self.peak_allocated,
            mib(self.peak_allocated),
            self.peak_reserved,
            mib(self.peak_reserved),
        )?;
        // Expandable segments are not counted as segments.
        if self.segments > 0 {
            write!(f, ", {} segments", self.segments)?;
        }
        write!(f, " after {PLANNED_STEPS} steps")
    }
}

/// The caching allocator's statistics after [`PLANNED_STEPS`] steps of a [`DeviceTrainer`] of
/// `config` with `products`, its allocator configured by `alloc` (see the [module](self)
/// documentation).
///
/// # Errors
/// The settings the trainer refuses; an allocator configuration out of range.
pub fn plan_allocator(
    config: &DeviceTrainConfig,
    products: Products,
    alloc: AllocatorConfig,
) -> Result<AllocatorPlan, DeviceTrainError> {
    config.validate()?;
    config.dims().validate()?;
    let ops = MetaOps::new(twin_products(products));
    ops.memory_counter().mirror_into(mirror_allocator(alloc)?);
    // The parameters' values are never read (meta operations take their lengths): zeros,
    // which the host maps only when touched.
    let params: HashMap<String, Vec<f32>> = param_shapes(&config.dims())
        .into_iter()
        .map(|(name, shape)| (name, vec![0.0; shape.iter().product()]))
        .collect();
    let mut trainer = DeviceTrainer::new(ops, *config, &params)?;
    drop(params);
    let tokens = vec![0u16; 2 * (config.cfg.block_size + 1)];
    for step in 0..PLANNED_STEPS {
        trainer.enqueue_step(&tokens, step)?;
    }
    trainer.flush()?;
    let stats = match trainer.ops().memory_counter().mirror_stats() {
        Some(s) => s.map_err(fsdp_kernels::KernelError::from)?,
        None => return Err(lost_mirror()),
    };
    Ok(AllocatorPlan::from_stats(&stats))
}

impl AllocatorPlan {
    /// The figures of an allocator's statistics.
    pub fn from_stats(stats: &MemoryStats) -> AllocatorPlan {
        AllocatorPlan {
            peak_allocated: stats.allocated_bytes.all.peak,
            peak_reserved: stats.reserved_bytes.all.peak,
            segments: stats.segment.all.current,
            device_allocations: stats.num_device_alloc,
        }
    }
}

/// A caching allocator of `alloc`'s settings over a meta source of unbounded memory, for a
/// planning run's buffers to be mirrored into.
///
/// # Errors
/// Settings out of range.
pub(crate) fn mirror_allocator(alloc: AllocatorConfig) -> Result<MetaAllocator, DeviceTrainError> {
    let source = MetaSource::new(usize::MAX / 2);
    Ok(MetaAllocator::new(source, alloc).map_err(fsdp_kernels::KernelError::from)?)
}

/// The mirror set is gone: an error rather than a panic.
fn lost_mirror() -> DeviceTrainError {
    fsdp_kernels::KernelError::InvalidArgument {
        kernel: "plan",
        reason: "the planning operations lost their allocator".into(),
    }
    .into()
}

/// The caching allocator that `world` ranks as threads on one device share, predicted. Each
/// rank allocates on its own stream, whose pools no other rank's requests reach, so each
/// rank's requests are mirrored into an allocator of their own ([`plan_sharded_allocator`]).
/// Without a release of cached memory (no out-of-memory retry, no `empty_cache`, no garbage
/// collection threshold) the reserved bytes only grow, so the device's peak reserved is the
/// sum of the ranks'; its peak allocated depends on how the ranks' steps interleave: at most
/// the sum of theirs.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardedAllocatorPlan {
    /// Each rank's allocator, as if alone.
    pub ranks: Vec<AllocatorPlan>,
}

impl ShardedAllocatorPlan {
    /// The device's peak reserved bytes: the ranks' sum.
    pub fn peak_reserved(&self) -> u64 {
        self.ranks.iter().map(|r| r.peak_reserved).sum()
    }

    /// The most the device's allocated bytes can reach: the sum of the ranks' peaks.
    pub fn peak_allocated_at_most(&self) -> u64 {
        self.ranks.iter().map(|r| r.peak_allocated).sum()
    }
}

impl fmt::Display for ShardedAllocatorPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
        let n = self.ranks.len();
        write!(
            f,
            "caching allocator (one for the {n} ranks, each on its own stream's pools): peak \
             reserved {} bytes ({}), peak allocated at most {} bytes ({}) after {PLANNED_STEPS} \
             steps",
            self.peak_reserved(),
            mib(self.peak_reserved()),
            self.peak_allocated_at_most(),
            mib(self.peak_allocated_at_most())
        )
    }
}

/// The caching allocator of `world` ranks as threads on one device training `config` sharded
/// by `strategy` (a hybrid one in nodes of `ranks_per_node`) with `products`, its settings
/// `alloc`: the sharded trainer over [`MetaOps`] for [`PLANNED_STEPS`] steps, each rank's
/// buffers mirrored into an allocator of its own (see [`ShardedAllocatorPlan`]).
///
/// # Errors
/// As [`plan_sharded_memory`](crate::device_plan_sharded::plan_sharded_memory); settings out
/// of range.
pub fn plan_sharded_allocator(
    config: &DeviceTrainConfig,
    products: Products,
    world: usize,
    strategy: fsdp::ShardingStrategy,
    ranks_per_node: Option<usize>,
    alloc: AllocatorConfig,
) -> Result<ShardedAllocatorPlan, DeviceTrainError> {
    let ranks = run_threads(
        config,
        products,
        world,
        strategy,
        ranks_per_node,
        PLANNED_STEPS,
        Some(alloc),
    )?;
    let mut plans = Vec::with_capacity(ranks.len());
    for r in ranks {
        match r.stats {
            Some(s) => plans.push(AllocatorPlan::from_stats(&s)),
            None => return Err(lost_mirror()),
        }
    }
    Ok(ShardedAllocatorPlan { ranks: plans })
}

/// The caching allocator of one rank of ranks as processes (`fsdp launch … train --device
/// cuda`, a GPU and an allocator each) training `config` sharded as `how` says (the world,
/// the strategy, the ranks of a node, the prefetch) with `products`, its settings `alloc`:
/// rank 0 over dry-run collectives and [`MetaOps`] for [`PLANNED_STEPS`] steps, its buffers
/// mirrored (the collectives' staging buffers, which come from the communicator, are not).
///
/// # Errors
/// As [`plan_process_memory`](crate::device_plan_sharded::plan_process_memory); settings out
/// of range.
pub fn plan_process_allocator(
    config: &DeviceTrainConfig,
    products: Products,
    how: ProcessRun,
    alloc: AllocatorConfig,
) -> Result<AllocatorPlan, DeviceTrainError> {
    match run_process(config, products, how, PLANNED_STEPS, Some(alloc))?.stats {
        Some(stats) => Ok(AllocatorPlan::from_stats(&stats)),
        None => Err(lost_mirror()),
    }
}
