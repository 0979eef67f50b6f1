//! The CUDA memory source (feature `cuda`): segments from `cuMemAlloc`/`cuMemFree`, record-stream
//! events from the device's event pool ([`PooledEvent`]), through cudarc with the driver loaded
//! at run time, in the process's one context per device ([`fsdp_device::cuda::context`]).
//!
//! Pools are keyed by the `CUstream` handle. The driver reuses the handle of a destroyed stream
//! for a new one, so the source holds an `Arc` of every stream from its first use by the
//! allocator until a release of cached memory ([`CachingAllocator::empty_cache`],
//! [`CachingAllocator::release_completed`], the out-of-memory retry) finds that it owns no
//! segment and no pending record-stream event: a stream that owns memory is never destroyed, so
//! no new stream can take its key (and its cached blocks, which its queued work may still use).
//! Streams of [`fsdp_device::Stream::cuda`] are passed as `stream.cuda_stream().unwrap()`.
//!
//! ```no_run
//! use fsdp_allocator::cuda::{CudaAllocator, CudaSource};
//! use fsdp_allocator::AllocatorConfig;
//!
//! match CudaSource::new(0) {
//!     Err(e) => println!("skipped: {e}"),
//!     Ok(source) => {
//!         let stream = fsdp_device::Stream::cuda(0, "compute").unwrap();
//!         let stream = stream.cuda_stream().unwrap().clone();
//!         let alloc = CudaAllocator::new(source, AllocatorConfig::default()).unwrap();
//!         let block = alloc.allocate(1 << 20, &stream).unwrap();
//!         println!("{block:?}");
//!     }
//! }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUresult;
use cudarc::driver::{result, CudaContext, CudaStream, DriverError};
use fsdp_device::cuda::PooledEvent;
use fsdp_device::Device;

use crate::{AllocError, Block, CachingAllocator, MemorySource, SEGMENT_ALIGN};

mod vmm;

/// A caching allocator over CUDA device memory.
pub type CudaAllocator = CachingAllocator<CudaSource>;
/// A block of CUDA device memory.
pub type CudaBlock = Block<CudaSource>;

/// Whether the CUDA driver library can be loaded (no CUDA call is made).
pub fn driver_present() -> bool {
    // SAFETY: this only tries to open the driver's shared library by its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn source_err(op: &'static str) -> impl Fn(DriverError) -> AllocError {
    move |e| AllocError::Source {
        op,
        message: format!("{e:?}"),
    }
}

/// Device memory of one GPU, in the process's context of that GPU.
pub struct CudaSource {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    total: usize,
    /// The physical pages of expandable segments.
    pages: vmm::Pages,
    /// The streams seen by the allocator, by key, kept alive while they own memory.
    streams: Mutex<HashMap<u64, Arc<CudaStream>>>,
}

impl fmt::Debug for CudaSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaSource")
            .field("ordinal", &self.ordinal)
            .field("total", &self.total)
            .finish()
    }
}

impl CudaSource {
    /// The source of GPU `ordinal`. Fails with [`AllocError::NoDevice`] (never panics) when the
    /// driver library is missing, no GPU is present, or the ordinal is out of range.
    pub fn new(ordinal: usize) -> Result<CudaSource, AllocError> {
        if !driver_present() {
            return Err(AllocError::NoDevice(
                "no CUDA driver (libcuda) could be loaded".to_string(),
            ));
        }
        // The device layer reports a missing driver symbol (a cudarc panic) as an error too.
        let ctx = fsdp_device::cuda::context(ordinal)
            .map_err(|e| AllocError::NoDevice(format!("cuda:{ordinal}: {e}")))?;
        let total = ctx.total_mem().map_err(source_err("cuDeviceTotalMem"))?;
        ctx.bind_to_thread()
            .map_err(source_err("cuCtxSetCurrent"))?;
        let pages = vmm::Pages::new(ordinal);
        Ok(CudaSource {
            ctx,
            ordinal,
            total,
            pages,
            streams: Mutex::new(HashMap::new()),
        })
    }

    /// The context (the one of [`fsdp_device::cuda::context`]): streams for the allocator come
    /// from `context().new_stream()` or [`fsdp_device::Stream::cuda`].
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// How many streams the source keeps alive now (those that owned memory at the last
    /// release of cached memory, and those seen since).
    pub fn streams_held(&self) -> usize {
        self.streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

// SAFETY: segments come from cuMemAlloc, checked to be SEGMENT_ALIGN-aligned (CUDA documents
// 256 bytes; `allocate` refuses a pointer that is not), and are owned by the caller until
// cuMemFree; cuMemFree waits for the device's pending work on them; stream keys are the CUstream
// handles, distinct for live streams, and every stream that owns memory is kept alive (in
// `streams`, from `validate_stream`, which the allocator calls before using a stream's key) so
// its key is not reused; CUDA events complete only after the work recorded before them. Expandable segments: cuMemAddressReserve ranges
// (granularity-aligned) that overlap nothing else, whose chunks are device memory once
// cuMemMap and cuMemSetAccess succeeded, and are unmapped only once every stream that owns
// memory finished the work queued before (`quiesce`: a freed block's stream may still run it).
unsafe impl MemorySource for CudaSource {
    type Stream = Arc<CudaStream>;
    type Event = PooledEvent;

    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn total_memory(&self) -> usize {
        self.total
    }

    fn free_memory(&self) -> usize {
        self.ctx.mem_get_info().map(|(free, _)| free).unwrap_or(0)
    }

    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>, AllocError> {
        self.ctx
            .bind_to_thread()
            .map_err(source_err("cuCtxSetCurrent"))?;
        // SAFETY: the context is current on this thread; the memory is device memory that this
        // crate never reads on the host.
        match unsafe { result::malloc_sync(bytes) } {
            Ok(dptr) if dptr as usize % SEGMENT_ALIGN != 0 => {
                // SAFETY: just allocated above, not handed out.
                if let Err(e) = unsafe { result::free_sync(dptr) } {
                    tracing::error!("cuda:{}: cuMemFree failed: {e:?}", self.ordinal);
                }
                Err(AllocError::Source {
                    op: "cuMemAlloc",
                    message: format!(
                        "cuda:{}: cuMemAlloc returned {dptr:#x}, not aligned to the {SEGMENT_ALIGN} \
                         bytes the allocator's blocks assume",
                        self.ordinal
                    ),
                })
            }
            Ok(dptr) => NonNull::new(std::ptr::without_provenance_mut::<u8>(dptr as usize))
                .ok_or(AllocError::SourceOutOfMemory { bytes }),
            Err(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
                Err(AllocError::SourceOutOfMemory { bytes })
            }
            Err(e) => Err(source_err("cuMemAlloc")(e)),
        }
    }

    unsafe fn free(&self, ptr: NonNull<u8>, _bytes: usize) {
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::error!("cuMemFree: could not bind the context: {e:?}; leaking the segment");
            return;
        }
        // SAFETY: by the caller's contract the pointer came from `allocate` (cuMemAlloc) and is
        // freed once.
        if let Err(e) = unsafe { result::free_sync(ptr.as_ptr().addr() as u64) } {
            tracing::error!("cuMemFree failed: {e:?}");
        }
    }

    fn supports_expandable_segments(&self) -> bool {
        self.pages.supported()
    }

    fn reserve_address_range(&self, bytes: usize) -> Result<NonNull<u8>, AllocError> {
        self.ctx
            .bind_to_thread()
            .map_err(source_err("cuCtxSetCurrent"))?;
        self.pages.reserve(bytes)
    }

    unsafe fn map_range(
        &self,
        base: NonNull<u8>,
        offset: usize,
        bytes: usize,
    ) -> Result<(), AllocError> {
        self.ctx
            .bind_to_thread()
            .map_err(source_err("cuCtxSetCurrent"))?;
        // SAFETY: forwarded from the caller (pages of 2 or 20 MiB: whole chunks).
        unsafe { self.pages.map(base, offset, bytes) }
    }

    unsafe fn unmap_range(&self, base: NonNull<u8>, offset: usize, bytes: usize) {
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::error!("cuMemUnmap: could not bind the context: {e:?}; leaking pages");
            return;
        }
        // A free block's stream may still run work queued on it before it was freed (unlike
        // cuMemFree, cuMemUnmap does not wait for the device): wait for every stream that owns
        // memory first, as PyTorch's expandable segments synchronise their stream.
        if let Err(e) = self.quiesce(fsdp_device::DEFAULT_TIMEOUT) {
            tracing::error!("cuMemUnmap: the streams did not finish ({e}); leaking pages");
            return;
        }
        // SAFETY: forwarded from the caller; no work queued before this call still runs.
        unsafe { self.pages.unmap(base, offset, bytes) }
    }

    unsafe fn release_address_range(&self, base: NonNull<u8>, bytes: usize) {
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::error!("cuMemAddressFree: could not bind the context: {e:?}");
            return;
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.pages.release(base, bytes) }
    }

    fn stream_key(stream: &Arc<CudaStream>) -> u64 {
        stream.cu_stream().addr() as u64
    }

    fn validate_stream(&self, stream: &Arc<CudaStream>) -> Result<(), AllocError> {
        if **stream.context() == *self.ctx {
            // Hold the stream from its first use on: its key may own memory from here on.
            self.streams
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(Self::stream_key(stream))
                .or_insert_with(|| stream.clone());
            Ok(())
        } else {
            Err(AllocError::InvalidArgument(format!(
                "a stream of CUDA device {} used with the allocator of device {}",
                stream.context().ordinal(),
                self.ordinal
            )))
        }
    }

    fn record_event(&self, stream: &Arc<CudaStream>) -> Result<PooledEvent, AllocError> {
        let event = PooledEvent::acquire(&self.ctx).map_err(|e| AllocError::Source {
            op: "cuEventCreate",
            message: format!("cuda:{}: {e}", self.ordinal),
        })?;
        event
            .event()
            .record(stream)
            .map_err(source_err("cuEventRecord"))?;
        Ok(event)
    }

    fn query_event(&self, event: &PooledEvent) -> Result<bool, AllocError> {
        event
            .event()
            .try_is_complete()
            .map_err(source_err("cuEventQuery"))
    }

    fn retain_streams(&self, owns: &dyn Fn(u64) -> bool) {
        // Dropped outside the lock: cuStreamDestroy may take a while.
        let released: Vec<Arc<CudaStream>> = {
            let mut streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
            let gone: Vec<u64> = streams.keys().copied().filter(|&k| !owns(k)).collect();
            gone.iter().filter_map(|k| streams.remove(k)).collect()
        };
        drop(released);
    }

    fn synchronize_event(&self, event: &PooledEvent, timeout: Duration) -> Result<(), AllocError> {
        self.wait_event(event, timeout)
    }
}

impl CudaSource {
    /// Wait, up to `timeout` in all, for the work queued so far on every stream the source
    /// holds (each stream that owns memory): an event recorded on each, polled.
    fn quiesce(&self, timeout: Duration) -> Result<(), AllocError> {
        let streams: Vec<Arc<CudaStream>> = self
            .streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        let deadline = Instant::now() + timeout;
        for s in &streams {
            let event = self.record_event(s)?;
            self.wait_event(&event, deadline.saturating_duration_since(Instant::now()))?;
        }
        Ok(())
    }

    /// Poll `event` until it completes or `timeout` passes.
    fn wait_event(&self, event: &PooledEvent, timeout: Duration) -> Result<(), AllocError> {
        // cuEventSynchronize has no timeout: poll, backing off from spinning to short sleeps.
        let start = Instant::now();
        let mut pause = Duration::from_micros(1);
        loop {
            if self.query_event(event)? {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(AllocError::Timeout {
                    what: "a CUDA record-stream event".to_string(),
                    waited,
                });
            }
            std::thread::sleep(pause.min(timeout - waited));
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}
