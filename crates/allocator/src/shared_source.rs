//! [`SharedHostSource`]: host memory that the other processes of the host can map, for the
//! buffers a shared-memory transport moves (NCCL's `ncclMemAlloc` and user-buffer
//! registration, on CPUs).

use std::collections::HashMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Mutex;
use std::time::Duration;

use fsdp_device::shared::SharedHostStorage;
use fsdp_device::{Device, DeviceError, Event, Storage, Stream};

use crate::source::{capacity_and_cpu_streams, Capacity};
use crate::{AllocError, CachingAllocator, MemorySource};

/// A caching allocator over [`SharedHostSource`].
pub type SharedHostAllocator = CachingAllocator<SharedHostSource>;

/// Host memory in sealed `memfd` regions ([`SharedHostStorage`], one per segment) with a
/// capacity limit; its streams and events are fsdp-device's CPU [`Stream`]s and [`Event`]s, as
/// for [`HostSource`](crate::HostSource). Every block of an allocator over it lies in a region
/// that `fsdp-collectives`' shared-memory transport lets its peers read in place (one copy per
/// hop instead of a cross-memory attach), and is ordinary host memory to everything else.
/// Expandable segments are not offered (a region has one fixed size).
///
/// ```
/// use fsdp_allocator::{AllocatorConfig, SharedHostAllocator, SharedHostSource};
/// use fsdp_device::{shared::region_of, DType, Stream};
///
/// # #[cfg(not(miri))] // Miri does not model memfd
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let alloc = SharedHostAllocator::new(SharedHostSource::new(64 << 20), AllocatorConfig::default())?;
/// let block = alloc.allocate(1 << 20, &Stream::cpu("compute"))?;
/// assert!(region_of(block.as_ptr(), block.size()).is_some());
/// let buf = block.into_buffer(DType::F32)?;
/// assert_eq!(buf.len(), 1 << 18);
/// # Ok(())
/// # }
/// # #[cfg(miri)]
/// # fn main() {}
/// ```
pub struct SharedHostSource {
    limit: Capacity,
    /// The live segments, by address.
    regions: Mutex<HashMap<usize, SharedHostStorage>>,
}

impl fmt::Debug for SharedHostSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.limit.debug(f, "SharedHostSource")
    }
}

impl SharedHostSource {
    /// A source that hands out at most `capacity` bytes at a time.
    pub fn new(capacity: usize) -> SharedHostSource {
        SharedHostSource {
            limit: Capacity::new(capacity),
            regions: Mutex::new(HashMap::new()),
        }
    }

    /// Bytes currently handed out.
    pub fn used(&self) -> usize {
        self.limit.used()
    }

    fn regions(&self) -> std::sync::MutexGuard<'_, HashMap<usize, SharedHostStorage>> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner())
    }
}

// SAFETY: each segment is the whole data range of a live SharedHostStorage (zeroed, page-aligned
// hence SEGMENT_ALIGN-aligned, mapped read-write) kept in `regions` until `free` drops it, so it
// is initialised host memory owned by the caller until then; the streams and events are those of
// `capacity_and_cpu_streams!`, as for HostSource (process-unique stream ids; an event completes
// only when its stream's work up to it has run).
unsafe impl MemorySource for SharedHostSource {
    capacity_and_cpu_streams!();

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>, AllocError> {
        self.limit.reserve(bytes)?;
        let storage = match SharedHostStorage::zeroed(bytes) {
            Ok(s) => s,
            Err(e) => {
                self.limit.unreserve(bytes);
                tracing::warn!(bytes, error = %e, "shared host segment");
                return Err(AllocError::SourceOutOfMemory { bytes });
            }
        };
        let Some(ptr) = NonNull::new(storage.as_ptr()) else {
            self.limit.unreserve(bytes);
            return Err(AllocError::SourceOutOfMemory { bytes });
        };
        self.regions().insert(ptr.as_ptr().addr(), storage);
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize) {
        // Dropping the storage unmaps the region and tells peers' mappings it is gone.
        if self.regions().remove(&ptr.as_ptr().addr()).is_some() {
            self.limit.unreserve(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::AllocatorConfig;
    use fsdp_device::shared::region_of;

    #[test]
    #[cfg_attr(miri, ignore = "Miri does not support memfd and file mappings")]
    fn blocks_lie_in_shared_regions_and_segments_return_to_the_system() {
        let src = SharedHostSource::new(64 << 20);
        let alloc = SharedHostAllocator::new(src, AllocatorConfig::default()).unwrap();
        let s = Stream::cpu("s");
        let a = alloc.allocate(3 << 20, &s).unwrap();
        let b = alloc.allocate(1000, &s).unwrap();
        for blk in [&a, &b] {
            assert!(region_of(blk.as_ptr(), blk.size()).is_some());
        }
        // Out of capacity: the source refuses (after the allocator's retry), naming the size.
        let e = alloc.allocate(60 << 20, &s).unwrap_err();
        assert!(e.to_string().contains("out of memory"), "{e}");
        let p = a.as_ptr();
        drop((a, b));
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.memory_stats().reserved_bytes.all.current, 0);
        assert!(
            region_of(p, 1).is_none(),
            "the region is gone with its segment"
        );
    }
}
