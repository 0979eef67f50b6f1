//! [`CudaOps`] and the memory its buffers come from ([`CudaMemory`]): what the caching
//! allocator or the driver's pool holds, and keeping freed memory in the driver's pool between
//! steps.

use cudarc::driver::{result, sys, CudaStream};

use super::cuda::CudaOps;
use super::cuda_memory::{describe_stats, CudaMemory};
use super::memory::MemoryUse;

impl CudaOps {
    /// The memory the operations' buffers come from, as it reports it: the bytes in use now
    /// and their high-water mark since these operations were made or since
    /// [`reset_pool_peak`](Self::reset_pool_peak). It includes the rounding of each buffer and
    /// what [`GptOps::memory`](super::GptOps::memory) does not count, and it is the device's,
    /// shared by every user of the same allocator (ranks that are threads on one GPU).
    ///
    /// - The caching allocator ([`CudaMemory::Caching`]): its `allocated_bytes` (blocks
    ///   handed out, rounded to 512 bytes; PyTorch's `memory_allocated` and
    ///   `max_memory_allocated`).
    /// - The driver's pool ([`CudaMemory::Driver`]): the device's default memory pool
    ///   (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT` and `CU_MEMPOOL_ATTR_USED_MEM_HIGH`), which also
    ///   holds the scratch of single operations; `None` where the device has no memory pools
    ///   or the driver refuses the query.
    pub fn pool_memory(&self) -> Option<MemoryUse> {
        if let CudaMemory::Caching(a) = &self.memory_source {
            let s = a.memory_stats().allocated_bytes.all;
            return Some(MemoryUse {
                allocated: s.current,
                peak: s.peak,
            });
        }
        self.driver_pool_memory()
    }

    /// [`pool_memory`](Self::pool_memory) in words: the caching allocator's peaks, retries and
    /// failures ([`describe_stats`]), or the driver's pool's high-water mark.
    pub fn memory_summary(&self) -> Option<String> {
        match &self.memory_source {
            CudaMemory::Caching(a) => Some(describe_stats(&a.memory_stats())),
            CudaMemory::Driver => self
                .driver_pool_memory()
                .map(|p| format!("the driver's pool: high-water mark {} bytes", p.peak)),
        }
    }

    fn driver_pool_memory(&self) -> Option<MemoryUse> {
        let dev = self.cuda.context().cu_device();
        let read = |attr| {
            let mut v = 0u64;
            // SAFETY: a device of a live context; both attributes are read into a u64 (the
            // driver's cuuint64_t), alive for the call.
            unsafe {
                let pool = result::device::get_default_mem_pool(dev).ok()?;
                result::mem_pool::get_attribute(pool, attr, (&mut v as *mut u64).cast()).ok()?;
            }
            Some(v)
        };
        Some(MemoryUse {
            allocated: read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            peak: read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        })
    }

    /// Starts the high-water mark of [`pool_memory`](Self::pool_memory) again from the bytes
    /// in use now (the caching allocator's peak statistics, as PyTorch's
    /// `reset_peak_memory_stats`; for the driver's pool best effort: nothing where the device
    /// has no memory pools).
    pub fn reset_pool_peak(&self) {
        if let CudaMemory::Caching(a) = &self.memory_source {
            a.reset_peak_stats();
            return;
        }
        let dev = self.cuda.context().cu_device();
        let mut zero = 0u64;
        // SAFETY: a device of a live context; USED_MEM_HIGH is set from a u64 (only 0 is
        // allowed: it resets the mark), alive for the call.
        let _ = unsafe {
            result::device::get_default_mem_pool(dev).and_then(|pool| {
                result::mem_pool::set_attribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&mut zero as *mut u64).cast(),
                )
            })
        };
    }
}

impl Drop for CudaOps {
    fn drop(&mut self) {
        // Give what the driver's pool kept back to the driver, as its default does at every
        // synchronisation (the caching allocator keeps its cache, as PyTorch's does).
        hold_pool_memory(&self.cuda, 0);
    }
}

/// Sets the release threshold of the device's default memory pool, which serves cudarc's
/// stream-ordered allocations (`cuMemAllocAsync`). The step allocates its activations afresh
/// and frees them as it goes; with the driver's default threshold (0) the pool returns all of
/// that memory to the driver at each step's synchronisation and maps it again in the next
/// step. `u64::MAX` keeps it, as PyTorch's caching allocator keeps its segments; 0 (on drop)
/// releases what is unused and restores the default. Best effort: a device without memory pools
/// allocates synchronously and has nothing to keep.
pub(super) fn hold_pool_memory(cuda: &CudaStream, threshold: u64) {
    let dev = cuda.context().cu_device();
    let mut value = threshold;
    // SAFETY: a device of a live context; the release threshold attribute takes a u64, which
    // `value` is, alive for the call.
    let _ = unsafe {
        result::device::get_default_mem_pool(dev).and_then(|pool| {
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast(),
            )?;
            if threshold == 0 {
                result::mem_pool::trim_to(pool, 0)?;
            }
            Ok(())
        })
    };
}
