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
use crate::device_plan_sharded::twin_products;
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
    let source = MetaSource::new(usize::MAX / 2);
    let meta = MetaAllocator::new(source, alloc).map_err(fsdp_kernels::KernelError::from)?;
    ops.memory_counter().mirror_into(meta);
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
        None => unreachable_mirror()?,
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

/// The mirror set above is gone: an error rather than a panic.
fn unreachable_mirror() -> Result<MemoryStats, DeviceTrainError> {
    Err(fsdp_kernels::KernelError::InvalidArgument {
        kernel: "plan",
        reason: "the planning operations lost their allocator".into(),
    }
    .into())
}
