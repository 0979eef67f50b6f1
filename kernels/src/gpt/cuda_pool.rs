//! [`CudaOps`] and the device's memory pool: what the pool holds, and keeping freed memory in
//! it between steps.

use cudarc::driver::{result, sys, CudaStream};

use super::cuda::CudaOps;
use super::memory::MemoryUse;

impl CudaOps {
    /// The device's default memory pool (which serves these operations' allocations, and any
    /// other stream-ordered allocation of the device) as the driver reports it: the bytes in use
    /// now (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`) and their high-water mark
    /// (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`, since these operations were made or since
    /// [`reset_pool_peak`](Self::reset_pool_peak)). It includes what [`GptOps::memory`](super::GptOps::memory) does
    /// not count (scratch of single operations) and the pool's rounding of each allocation.
    /// `None` where the device has no memory pools or the driver refuses the query.
    pub fn pool_memory(&self) -> Option<MemoryUse> {
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

    /// Starts the pool's high-water mark again from the bytes in use now (best effort: nothing
    /// where the device has no memory pools).
    pub fn reset_pool_peak(&self) {
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
        // Give what the pool kept back to the driver, as its default does at every
        // synchronisation.
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
