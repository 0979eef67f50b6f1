//! A per-stream caching allocator with record-stream and retry statistics, generic over its
//! memory source.
//!
//! [`CachingAllocator`] follows PyTorch's CUDA caching allocator:
//! - Sizes round up to [`MIN_BLOCK_SIZE`] (512 B). Requests of at most [`SMALL_SIZE`] (1 MiB)
//!   come from the small pool, carved from [`SMALL_BUFFER`] (2 MiB) segments; larger ones from
//!   the large pool, in [`LARGE_BUFFER`] (20 MiB) segments below [`MIN_LARGE_ALLOC`] (10 MiB) and
//!   otherwise in segments of the request rounded up to [`ROUND_LARGE`] (2 MiB).
//! - A request is served by the smallest cached free block of the *same stream* that fits (among
//!   equal sizes, the one of the oldest segment, then the lowest address in it — not the lowest
//!   address overall as in PyTorch, so that no decision depends on where the source placed its
//!   segments: a [`MetaAllocator`] makes exactly the decisions of a [`HostAllocator`]); the
//!   block is split when the rest is worth keeping (small pool: at least 512 B; large pool: more
//!   than 1 MiB), and freed blocks merge with free neighbours of their segment.
//! - [`Block::record_stream`]: a block used on other streams returns to its pool only once events
//!   recorded on those streams at the free have completed (checked at later allocations). Until
//!   then it is *active* but not *allocated* in the [`MemoryStats`].
//! - When the source (or the [`MemoryLimit`]) refuses a new segment, the allocator waits for the
//!   pending events, gives every cached whole segment back and retries once
//!   (`num_alloc_retries`); if that fails too the request fails with
//!   [`AllocError::OutOfMemory`] (`num_ooms`), whose message reads like PyTorch's.
//! - `max_split_size`: blocks at least that large are not split and serve only requests of at
//!   least that size.
//!
//! Memory sources: [`HostSource`] (real host memory with a capacity, with
//! [`fsdp_device::Stream`]s and [`fsdp_device::Event`]s), [`MetaSource`] (no memory: fake
//! addresses under a capacity, for [`Device::Meta`](fsdp_device::Device::Meta) — the same
//! decisions and statistics as a `HostSource` of that capacity, without the bytes), and with the
//! `cuda` feature `cuda::CudaSource` (`cuMemAlloc`/`cuMemFree` and CUDA events, loaded at run
//! time).
//!
//! ```
//! use fsdp_allocator::{AllocatorConfig, HostAllocator, HostSource};
//! use fsdp_device::{DType, Stream};
//!
//! let alloc = HostAllocator::new(HostSource::new(256 << 20), AllocatorConfig::default())?;
//! let comm = Stream::cpu("comm");
//! let compute = Stream::cpu("compute");
//!
//! // A 3 MiB request on the communication stream: a 20 MiB large-pool segment, split.
//! let block = alloc.allocate(3 << 20, &comm)?;
//! let addr = block.addr();
//! // The compute stream reads it; free it at once, as the CPU runs ahead.
//! block.record_stream(&compute)?;
//! drop(block);
//! let stats = alloc.memory_stats();
//! assert_eq!(stats.allocated_bytes.all.current, 0);
//! // Until compute's work issued before the free has run, the bytes stay active.
//! compute.synchronize()?;
//! let again = alloc.allocate(3 << 20, &comm)?; // from the cache, once the event completed
//! assert_eq!(again.addr(), addr);
//! assert_eq!(alloc.memory_stats().reserved_bytes.all.current, 20 << 20);
//!
//! // Blocks back fsdp-device buffers.
//! let buf = again.into_buffer(DType::F32)?;
//! buf.write::<f32>()?[0] = 1.5;
//! assert_eq!(buf.to_vec::<f32>()?[0], 1.5);
//! drop(buf);
//!
//! alloc.empty_cache()?;
//! assert_eq!(alloc.memory_stats().reserved_bytes.all.current, 0);
//! println!("{}", alloc.snapshot().to_json()?);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod allocator;
mod conf;
mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod history;
mod pickle;
#[cfg(target_os = "linux")]
mod shared_source;
mod snapshot;
mod source;
mod stats;
mod vmm;

pub use allocator::{Block, CachingAllocator, SharedBlock};
pub use conf::{alloc_conf_from_env, AllocatorBackend, ALLOC_CONF_ENV_VARS};
pub use config::{AllocatorConfig, MemoryLimit, ROUNDUP_POWER2_INTERVALS};
pub use error::AllocError;
pub use history::{
    memory_context, memory_context_with, Frame, HistoryConfig, MemoryContextGuard, TraceAction,
    TraceEntry,
};
pub use pickle::{to_pickle, PyValue};
#[cfg(target_os = "linux")]
pub use shared_source::{SharedHostAllocator, SharedHostSource};
pub use snapshot::{BlockSnapshot, BlockState, SegmentSnapshot, Snapshot};
pub use source::{HostSource, MemorySource, MetaSource, SEGMENT_ALIGN};
pub use stats::{MemoryStats, PoolKind, Stat, StatArray};

/// A caching allocator over host memory.
pub type HostAllocator = CachingAllocator<HostSource>;
/// A block of host memory.
pub type HostBlock = Block<HostSource>;
/// A caching allocator over no memory ([`fsdp_device::Device::Meta`]): real statistics, fake
/// addresses.
pub type MetaAllocator = CachingAllocator<MetaSource>;
/// A block of a [`MetaAllocator`]: its buffers are meta buffers.
pub type MetaBlock = Block<MetaSource>;

/// Every size rounds up to a multiple of this (and at least this).
pub const MIN_BLOCK_SIZE: usize = 512;
/// The largest request served by the small pool.
pub const SMALL_SIZE: usize = 1 << 20;
/// Size of the small pool's segments.
pub const SMALL_BUFFER: usize = 2 << 20;
/// Size of the large pool's segments for requests below [`MIN_LARGE_ALLOC`].
pub const LARGE_BUFFER: usize = 20 << 20;
/// Requests of at least this size get a segment of their own size (rounded to
/// [`ROUND_LARGE`]).
pub const MIN_LARGE_ALLOC: usize = 10 << 20;
/// Rounding of large segments.
pub const ROUND_LARGE: usize = 2 << 20;

/// A request's size after rounding: at least [`MIN_BLOCK_SIZE`], a multiple of it. `None` if it
/// overflows.
pub fn round_size(size: usize) -> Option<usize> {
    if size < MIN_BLOCK_SIZE {
        Some(MIN_BLOCK_SIZE)
    } else {
        size.checked_next_multiple_of(MIN_BLOCK_SIZE)
    }
}

/// The size of the segment obtained for a rounded request that no cached block serves. `None`
/// if it overflows.
pub fn allocation_size(rounded: usize) -> Option<usize> {
    if rounded <= SMALL_SIZE {
        Some(SMALL_BUFFER)
    } else if rounded < MIN_LARGE_ALLOC {
        Some(LARGE_BUFFER)
    } else {
        rounded.checked_next_multiple_of(ROUND_LARGE)
    }
}

/// A byte count as PyTorch prints it: `"512 bytes"`, `"1.50 KiB"`, `"20.00 MiB"`, `"1.25 GiB"`.
pub fn format_size(bytes: usize) -> String {
    const KIB: f64 = 1024.0;
    if bytes <= 1024 {
        format!("{bytes} bytes")
    } else if bytes <= 1 << 20 {
        format!("{:.2} KiB", bytes as f64 / KIB)
    } else if bytes <= 1 << 30 {
        format!("{:.2} MiB", bytes as f64 / (KIB * KIB))
    } else {
        format!("{:.2} GiB", bytes as f64 / (KIB * KIB * KIB))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_follows_pytorch() {
        assert_eq!(round_size(0), Some(512));
        assert_eq!(round_size(1), Some(512));
        assert_eq!(round_size(512), Some(512));
        assert_eq!(round_size(513), Some(1024));
        assert_eq!(round_size(usize::MAX), None);
        assert_eq!(allocation_size(512), Some(SMALL_BUFFER));
        assert_eq!(allocation_size(1 << 20), Some(SMALL_BUFFER));
        assert_eq!(allocation_size((1 << 20) + 512), Some(LARGE_BUFFER));
        assert_eq!(allocation_size((10 << 20) - 512), Some(LARGE_BUFFER));
        assert_eq!(allocation_size(10 << 20), Some(10 << 20));
        assert_eq!(allocation_size((10 << 20) + 512), Some(12 << 20));
        assert_eq!(allocation_size(usize::MAX - 511), None);
        assert_eq!(PoolKind::for_size(1 << 20), PoolKind::Small);
        assert_eq!(PoolKind::for_size((1 << 20) + 512), PoolKind::Large);
    }

    #[test]
    fn sizes_print_like_pytorch() {
        assert_eq!(format_size(0), "0 bytes");
        assert_eq!(format_size(1024), "1024 bytes");
        assert_eq!(format_size(1536), "1.50 KiB");
        assert_eq!(format_size(20 << 20), "20.00 MiB");
        assert_eq!(format_size(5 << 29), "2.50 GiB");
    }
}

/// The README's examples, run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
