//! The engine's view of a caching allocator: any [`CachingAllocator`] whose memory source uses
//! the CPU streams of `fsdp_device` (host memory, or the meta source of a dry run), behind one
//! object-safe trait so that the engine is not generic over the source.

use std::sync::Arc;

use fsdp_allocator::{
    CachingAllocator, HistoryConfig, HostAllocator, HostSource, MemorySource, MemoryStats, Snapshot,
};
use fsdp_collectives::Communicator;
use fsdp_device::{Buffer, DType, Device, Stream};

use super::config::FsdpConfig;
use crate::FsdpError;

/// Where the engine's shards and unsharded buffers come from (PyTorch's per-device caching
/// allocator). Implemented for every [`CachingAllocator`] over a source whose streams are
/// [`fsdp_device::Stream`]s.
pub trait MemoryPool: Send + Sync {
    /// The device the memory lives on ([`Device::Meta`] in a dry run: sizes without bytes).
    fn device(&self) -> Device;

    /// A buffer of `numel` elements of `dtype` allocated on `stream`; when `also_on` is given,
    /// the block is also recorded on that stream (`record_stream`), so that after its free the
    /// memory is reused only once the work issued there before the free has completed.
    ///
    /// # Errors
    /// Out of memory (after the allocator's retry) or an invalid size.
    fn allocate(
        &self,
        dtype: DType,
        numel: usize,
        stream: &Stream,
        also_on: Option<&Stream>,
    ) -> Result<Buffer, FsdpError>;

    /// The allocator's statistics (PyTorch's `memory_stats()`).
    fn memory_stats(&self) -> MemoryStats;

    /// Reset the peak statistics.
    fn reset_peak_stats(&self);

    /// Start (`Some`) or stop (`None`) recording the allocator's memory history (see
    /// [`CachingAllocator::record_memory_history`]). Pools without one ignore it.
    fn record_memory_history(&self, config: Option<HistoryConfig>) {
        let _ = config;
    }

    /// The allocator's segments, blocks and recorded history, if it has them.
    fn snapshot(&self) -> Option<Snapshot> {
        None
    }
}

impl<S> MemoryPool for CachingAllocator<S>
where
    S: MemorySource<Stream = Stream>,
{
    fn device(&self) -> Device {
        CachingAllocator::device(self)
    }

    fn allocate(
        &self,
        dtype: DType,
        numel: usize,
        stream: &Stream,
        also_on: Option<&Stream>,
    ) -> Result<Buffer, FsdpError> {
        let bytes = byte_len(dtype, numel)?;
        let block = CachingAllocator::allocate(self, bytes, stream)?;
        if let Some(other) = also_on {
            block.record_stream(other)?;
        }
        Ok(block.into_buffer(dtype)?)
    }

    fn memory_stats(&self) -> MemoryStats {
        CachingAllocator::memory_stats(self)
    }

    fn reset_peak_stats(&self) {
        CachingAllocator::reset_peak_stats(self);
    }

    fn record_memory_history(&self, config: Option<HistoryConfig>) {
        CachingAllocator::record_memory_history(self, config);
    }

    fn snapshot(&self) -> Option<Snapshot> {
        Some(CachingAllocator::snapshot(self))
    }
}

/// The bytes of `numel` elements of `dtype`; an overflow is an error naming both.
fn byte_len(dtype: DType, numel: usize) -> Result<usize, FsdpError> {
    numel
        .checked_mul(dtype.size_in_bytes())
        .ok_or_else(|| FsdpError::InvalidFsdpConfig {
            reason: format!("a buffer of {numel} elements of {dtype} overflows usize"),
        })
}

/// A caching allocator whose buffers are stream-ordered
/// ([`Block::into_ordered_buffer`](fsdp_allocator::Block::into_ordered_buffer)): the memory of a
/// [`ComputeDevice`](super::ComputeDevice). A block returns to the allocator only after the last
/// work issued on it (held references), so `also_on` needs no `record_stream`.
pub(crate) struct OrderedPool<S: MemorySource>(CachingAllocator<S>);

impl<S: MemorySource> OrderedPool<S> {
    pub(crate) fn new(alloc: CachingAllocator<S>) -> Self {
        OrderedPool(alloc)
    }
}

/// The allocator's stream behind one of `fsdp_device`'s.
pub(crate) trait SourceStream: MemorySource {
    /// `stream` as the source's stream.
    fn source_stream(stream: &Stream) -> Result<Self::Stream, FsdpError>;
}

impl SourceStream for HostSource {
    fn source_stream(stream: &Stream) -> Result<Stream, FsdpError> {
        Ok(stream.clone())
    }
}

#[cfg(feature = "cuda")]
impl SourceStream for fsdp_allocator::cuda::CudaSource {
    fn source_stream(stream: &Stream) -> Result<Arc<fsdp_device::cuda::CudaStream>, FsdpError> {
        stream
            .cuda_stream()
            .cloned()
            .ok_or_else(|| FsdpError::InvalidFsdpConfig {
                reason: format!(
                    "device memory allocated on stream `{}` of {}, not a CUDA stream",
                    stream.name(),
                    stream.device()
                ),
            })
    }
}

impl<S: SourceStream> MemoryPool for OrderedPool<S> {
    fn device(&self) -> Device {
        self.0.device()
    }

    fn allocate(
        &self,
        dtype: DType,
        numel: usize,
        stream: &Stream,
        also_on: Option<&Stream>,
    ) -> Result<Buffer, FsdpError> {
        let _ = also_on;
        let bytes = byte_len(dtype, numel)?;
        let block = self.0.allocate(bytes, &S::source_stream(stream)?)?;
        Ok(block.into_ordered_buffer(dtype)?)
    }

    fn memory_stats(&self) -> MemoryStats {
        self.0.memory_stats()
    }

    fn reset_peak_stats(&self) {
        self.0.reset_peak_stats();
    }

    fn record_memory_history(&self, config: Option<HistoryConfig>) {
        self.0.record_memory_history(config);
    }

    fn snapshot(&self) -> Option<Snapshot> {
        Some(self.0.snapshot())
    }
}

/// The rank's host caching allocator for [`Fsdp::new`](super::Fsdp::new): over shared host memory
/// ([`SharedHostSource`](fsdp_allocator::SharedHostSource)) when the communicator's peers read
/// it in place (the shared-memory transport) and expandable segments are not asked for (a
/// shared region has one fixed size), else over private host memory.
pub(crate) fn host_pool(
    comm: &dyn Communicator,
    config: &FsdpConfig,
) -> Result<Arc<dyn MemoryPool>, FsdpError> {
    #[cfg(target_os = "linux")]
    if comm.prefers_shared_host_memory() && !config.allocator.expandable_segments {
        let source = fsdp_allocator::SharedHostSource::new(config.memory_capacity);
        return Ok(Arc::new(fsdp_allocator::SharedHostAllocator::new(
            source,
            config.allocator,
        )?));
    }
    let _ = comm;
    let pool = HostAllocator::new(HostSource::new(config.memory_capacity), config.allocator)?;
    Ok(Arc::new(pool))
}
