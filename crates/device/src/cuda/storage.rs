//! Device memory ([`CudaStorage`]) and page-locked host memory ([`PinnedStorage`]).

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result, sys, CudaContext, DriverError};

use super::{context, current_context, driver_error};
use crate::block_cache::{size_class, BlockCache, BlockCacheStats};
use crate::reaper;
use crate::{Device, DeviceError, Storage, StreamOrder};

/// The address given to empty allocations: aligned, never dereferenced, never freed.
const EMPTY_ADDR: usize = 256;

/// How long an allocation that found the device full waits for deferred frees before retrying.
const OOM_RETRY_WAIT: Duration = Duration::from_secs(10);

fn bind(ctx: &CudaContext) -> Result<(), DeviceError> {
    ctx.bind_to_thread()
        .map_err(|e| driver_error("cuCtxSetCurrent", e))
}

/// A `cuMemAlloc` allocation; `cuMemFree` on drop (which only happens once the work that used
/// it has completed, see [`CudaStorage`]).
struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: allocated by malloc_sync in CudaStorage::zeroed, freed once (the value owns
            // it); dropped only after the events of every use recorded in the storage's
            // StreamOrder completed (CudaStorage's Drop), so no queued work touches it.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
        // A context that cannot be bound leaks the memory rather than freeing it elsewhere.
    }
}

/// Device memory on the process's context of one device (`cuMemAlloc` through cudarc's result
/// layer: a plain allocation that any stream of the context may use, unlike `cuMemAllocAsync`
/// whose pool ties it to stream order). It is stream-ordered: its [`StreamOrder`] records the
/// events of the last write and the reads since, and buffers over it are used on streams
/// through [`Buffer::use_on`](crate::Buffer::use_on).
///
/// Dropping it does not free memory that queued GPU work still uses: the allocation is handed
/// to a reaper thread that frees it once every event recorded in the order has completed
/// (queried, never waited for in the driver; no `cuCtxSynchronize`). Work issued on the memory
/// without [`Buffer::use_on`](crate::Buffer::use_on) is not recorded and therefore not waited for.
pub struct CudaStorage {
    alloc: Option<DeviceAlloc>,
    addr: usize,
    len: usize,
    ordinal: usize,
    order: Arc<StreamOrder>,
}

impl CudaStorage {
    /// `bytes` bytes of uninitialised device memory on device `ordinal` (zeroed by
    /// [`Buffer::cuda_zeros`](crate::Buffer::cuda_zeros), which orders the memset). When the
    /// device is full and frees are pending, waits for them (up to 10 s) and retries once.
    ///
    /// # Errors
    /// As [`context`]; [`DeviceError::Cuda`] when `cuMemAlloc` fails (out of memory included).
    pub fn uninit(ordinal: usize, bytes: usize) -> Result<CudaStorage, DeviceError> {
        let ctx = context(ordinal)?;
        let order = Arc::new(StreamOrder::new());
        if bytes == 0 {
            return Ok(CudaStorage {
                alloc: None,
                addr: EMPTY_ADDR,
                len: 0,
                ordinal,
                order,
            });
        }
        bind(&ctx)?;
        let alloc = || -> Result<sys::CUdeviceptr, DriverError> {
            // SAFETY: a plain allocation in the bound context; its bytes are only read after a
            // write ordered by the StreamOrder (or are the caller's uninitialised bytes).
            unsafe { result::malloc_sync(bytes) }
        };
        let ptr = match alloc() {
            Ok(p) => p,
            Err(e)
                if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY
                    && reaper::pending_releases() > 0 =>
            {
                let _ = reaper::wait_for_releases(OOM_RETRY_WAIT);
                bind(&ctx)?;
                alloc().map_err(|e| driver_error("cuMemAlloc", e))?
            }
            Err(e) => return Err(driver_error("cuMemAlloc", e)),
        };
        let alloc = DeviceAlloc { ctx, ptr };
        if ptr % 256 != 0 {
            return Err(DeviceError::InvalidArgument(format!(
                "cuMemAlloc on cuda:{ordinal} returned {ptr:#x}, not aligned to 256 bytes"
            )));
        }
        Ok(CudaStorage {
            addr: ptr as usize,
            alloc: Some(alloc),
            len: bytes,
            ordinal,
            order,
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        if let Some(alloc) = self.alloc.take() {
            reaper::release_after(self.order.events(), Box::new(alloc));
        }
    }
}

// SAFETY: the allocation is owned, fixed and 256-aligned (checked), and lives until every use
// recorded in the order has completed (Drop above); the address is a device address, which this
// crate never dereferences on the host (host access refuses CUDA buffers).
unsafe impl Storage for CudaStorage {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }
    fn byte_len(&self) -> usize {
        self.len
    }
    fn as_ptr(&self) -> *mut u8 {
        std::ptr::without_provenance_mut(self.addr)
    }
    fn stream_order(&self) -> Option<Arc<StreamOrder>> {
        Some(self.order.clone())
    }
}

/// Page-locked host memory (`cuMemHostAlloc`, portable: pinned for every context), zeroed, on
/// [`Device::Cpu`]: host code reads and writes it through the usual access tickets, and the
/// async copies of device buffers ([`Buffer::copy_to_host_async`](crate::Buffer::copy_to_host_async))
/// hold a ticket on it until their event completes. Allocated by size class (the next power
/// of two, at least 512 bytes) and, once dropped, kept for the next allocation of its class
/// instead of freed ([`pinned_cache_stats`], [`empty_pinned_cache`]).
pub struct PinnedStorage {
    ptr: *mut u8,
    len: usize,
    /// The block's size class (bytes allocated).
    class: usize,
    ctx: Option<Arc<CudaContext>>,
}

/// A freed page-locked block, held by [`PINNED`] for reuse.
struct PinnedBlock {
    ptr: *mut u8,
    ctx: Arc<CudaContext>,
}

// SAFETY: a cached block is an owned allocation that nothing else references until the cache
// hands it to one new `PinnedStorage`.
unsafe impl Send for PinnedBlock {}

/// Freed page-locked blocks of the process by size class.
static PINNED: BlockCache<PinnedBlock> = BlockCache::new();

/// What the cache of freed page-locked memory did so far (blocks allocated, requests served by
/// a freed block) and holds now.
pub fn pinned_cache_stats() -> BlockCacheStats {
    PINNED.stats()
}

/// Free every cached page-locked block (`cuMemFreeHost`, which synchronises the device):
/// PyTorch's `torch._C._host_emptyCache()`. Buffers in use are not affected.
///
/// # Errors
/// [`DeviceError::Cuda`] for the first block that cannot be freed (the others are freed).
pub fn empty_pinned_cache() -> Result<(), DeviceError> {
    let mut first = None;
    for (_, block) in PINNED.drain() {
        let freed = bind(&block.ctx).and_then(|()| {
            // SAFETY: allocated by malloc_host in `PinnedStorage::zeroed`, taken out of the
            // cache (so referenced by nothing), freed once.
            unsafe { result::free_host(block.ptr.cast()) }
                .map_err(|e| driver_error("cuMemFreeHost", e))
        });
        if let Err(e) = freed {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

// SAFETY: PinnedStorage owns its allocation; the bytes are only touched through Buffer's access
// tickets (host) or by copies that hold such a ticket until they complete.
unsafe impl Send for PinnedStorage {}
// SAFETY: as above; &PinnedStorage only exposes the address.
unsafe impl Sync for PinnedStorage {}

impl PinnedStorage {
    /// `bytes` zeroed bytes of page-locked memory, allocated in the context of device 0 (the
    /// portable flag makes them pinned for every device's context).
    ///
    /// # Errors
    /// As [`context`]; [`DeviceError::Cuda`] when `cuMemHostAlloc` fails.
    pub fn zeroed(bytes: usize) -> Result<PinnedStorage, DeviceError> {
        if bytes == 0 {
            return Ok(PinnedStorage {
                ptr: std::ptr::without_provenance_mut(EMPTY_ADDR),
                len: 0,
                class: 0,
                ctx: None,
            });
        }
        let class = size_class(bytes).ok_or_else(|| {
            DeviceError::InvalidArgument(format!("{bytes} bytes of page-locked memory"))
        })?;
        let (raw, ctx) = match PINNED.take(class) {
            Some(block) => (block.ptr, block.ctx),
            None => {
                // The thread's context (the device it works on), not device 0's: a process on
                // another GPU would otherwise create a context on GPU 0 for its pinned memory.
                let ctx = current_context()?;
                bind(&ctx)?;
                // SAFETY: a plain page-locked allocation in the bound context, zeroed below
                // before use.
                let raw = unsafe { result::malloc_host(class, sys::CU_MEMHOSTALLOC_PORTABLE) }
                    .map_err(|e| driver_error("cuMemHostAlloc", e))?
                    .cast::<u8>();
                (raw, ctx)
            }
        };
        if raw.is_null() || raw.addr() % 64 != 0 {
            if !raw.is_null() {
                // SAFETY: allocated by malloc_host above (a cached block passed this check
                // when it was allocated), referenced by nothing, freed once.
                let _ = unsafe { result::free_host(raw.cast()) };
            }
            return Err(DeviceError::InvalidArgument(format!(
                "cuMemHostAlloc returned {raw:p}, not aligned to 64 bytes"
            )));
        }
        let storage = PinnedStorage {
            ptr: raw,
            len: bytes,
            class,
            ctx: Some(ctx),
        };
        // SAFETY: `bytes` (≤ `class`) writable bytes owned here: just allocated, or a cached
        // block that nothing else references.
        unsafe { std::ptr::write_bytes(raw, 0, bytes) };
        Ok(storage)
    }
}

impl Drop for PinnedStorage {
    fn drop(&mut self) {
        // The storage is dropped only when no buffer, ticket or guard of it is left, and
        // copies hold a guard until their event completed: the block is free for reuse.
        if let Some(ctx) = self.ctx.take() {
            PINNED.put(self.class, PinnedBlock { ptr: self.ptr, ctx });
        }
    }
}

// SAFETY: the allocation is owned, fixed, 64-aligned (checked) host memory that lives until
// drop.
unsafe impl Storage for PinnedStorage {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn byte_len(&self) -> usize {
        self.len
    }
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn is_page_locked(&self) -> bool {
        true
    }
}
