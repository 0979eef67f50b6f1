//! Expandable segments on CUDA: the driver's virtual memory management API
//! (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`,
//! `cuMemRelease`, `cuMemAddressFree`) through cudarc's driver sys layer. Memory is mapped in
//! chunks of the device's allocation granularity, one physical allocation each, so that any
//! whole page the allocator unmaps is a set of whole chunks.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Mutex;

use cudarc::driver::sys::{
    self, CUmemAccessDesc, CUmemAccess_flags, CUmemAllocationGranularity_flags,
    CUmemAllocationHandleType, CUmemAllocationProp, CUmemAllocationType,
    CUmemGenericAllocationHandle, CUmemLocation, CUmemLocationType, CUresult,
};

use crate::AllocError;

fn check(op: &'static str, r: CUresult) -> Result<(), AllocError> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(AllocError::Source {
            op,
            message: format!("{e:?}"),
        }),
    }
}

/// [`check`], with the device out of memory as [`AllocError::SourceOutOfMemory`] for `bytes`
/// (which the allocator answers by freeing its cache and retrying).
fn check_mem(op: &'static str, r: CUresult, bytes: usize) -> Result<(), AllocError> {
    match r {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(AllocError::SourceOutOfMemory { bytes }),
        r => check(op, r),
    }
}

fn location(ordinal: usize) -> CUmemLocation {
    CUmemLocation {
        type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as i32,
    }
}

fn prop(ordinal: usize) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: CUmemAllocationHandleType(0),
        location: location(ordinal),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The physical chunks mapped into reserved ranges of one device.
pub(super) struct Pages {
    ordinal: usize,
    /// The allocation granularity (0: the device has no virtual memory management).
    granularity: usize,
    /// Chunk address → its physical allocation.
    chunks: Mutex<BTreeMap<u64, CUmemGenericAllocationHandle>>,
}

impl Pages {
    /// The pages of device `ordinal`, whose context is current on this thread. The
    /// granularity must divide the allocator's smallest page (2 MiB), else expandable
    /// segments are not offered.
    pub(super) fn new(ordinal: usize) -> Pages {
        let mut granularity = 0usize;
        let p = prop(ordinal);
        // SAFETY: plain query writing one usize; `p` is a valid property struct.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &p,
                CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        if r != CUresult::CUDA_SUCCESS || granularity == 0 || crate::SMALL_BUFFER % granularity != 0
        {
            granularity = 0;
        }
        Pages {
            ordinal,
            granularity,
            chunks: Mutex::new(BTreeMap::new()),
        }
    }

    pub(super) fn supported(&self) -> bool {
        self.granularity > 0
    }

    pub(super) fn reserve(&self, bytes: usize) -> Result<NonNull<u8>, AllocError> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: reserves address space only; writes the base to `ptr`.
        let r = unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, 0, 0, 0) };
        match r {
            CUresult::CUDA_SUCCESS => NonNull::new(std::ptr::without_provenance_mut(ptr as usize))
                .ok_or(AllocError::SourceOutOfMemory { bytes }),
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(AllocError::SourceOutOfMemory { bytes }),
            e => check("cuMemAddressReserve", e).map(|_| NonNull::dangling()),
        }
    }

    /// Map `bytes` at `base + offset`, chunk by chunk; on failure nothing stays mapped.
    ///
    /// # Safety
    /// The range lies in a reserved range, unmapped, aligned to the granularity.
    pub(super) unsafe fn map(
        &self,
        base: NonNull<u8>,
        offset: usize,
        bytes: usize,
    ) -> Result<(), AllocError> {
        let start = (base.as_ptr().addr() + offset) as u64;
        let g = self.granularity as u64;
        let p = prop(self.ordinal);
        let access = CUmemAccessDesc {
            location: location(self.ordinal),
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mut done = 0u64;
        let mut result = Ok(());
        while done < bytes as u64 {
            let at = start + done;
            let mut handle: CUmemGenericAllocationHandle = 0;
            // SAFETY: creates a physical allocation of one chunk.
            let r = unsafe { sys::cuMemCreate(&mut handle, g as usize, &p, 0) };
            if r != CUresult::CUDA_SUCCESS {
                result = if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    Err(AllocError::SourceOutOfMemory { bytes })
                } else {
                    check("cuMemCreate", r)
                };
                break;
            }
            // SAFETY: `at` is a granularity-aligned, unmapped chunk of our reserved range (the
            // caller's contract); the handle is a fresh allocation of that size.
            let mapped = unsafe {
                check_mem(
                    "cuMemMap",
                    sys::cuMemMap(at, g as usize, 0, handle, 0),
                    bytes,
                )
                .and_then(|_| {
                    check_mem(
                        "cuMemSetAccess",
                        sys::cuMemSetAccess(at, g as usize, &access, 1),
                        bytes,
                    )
                })
            };
            if let Err(e) = mapped {
                // SAFETY: the handle is ours; unmapping a chunk that failed to map is harmless.
                unsafe {
                    let _ = sys::cuMemUnmap(at, g as usize);
                    let _ = sys::cuMemRelease(handle);
                }
                result = Err(e);
                break;
            }
            self.chunks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(at, handle);
            done += g;
        }
        if result.is_err() && done > 0 {
            // SAFETY: exactly these chunks were mapped above.
            unsafe { self.unmap(base, offset, done as usize) };
        }
        result
    }

    /// Unmap and free the chunks of `bytes` at `base + offset`.
    ///
    /// # Safety
    /// The chunks were mapped by [`map`](Self::map) and no stream uses them.
    pub(super) unsafe fn unmap(&self, base: NonNull<u8>, offset: usize, bytes: usize) {
        let start = (base.as_ptr().addr() + offset) as u64;
        let mut chunks = self
            .chunks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let handles: Vec<(u64, CUmemGenericAllocationHandle)> = chunks
            .range(start..start + bytes as u64)
            .map(|(a, h)| (*a, *h))
            .collect();
        for (at, handle) in handles {
            chunks.remove(&at);
            // SAFETY: the chunk was mapped with this handle, and nothing uses it.
            unsafe {
                if let Err(e) = check("cuMemUnmap", sys::cuMemUnmap(at, self.granularity)) {
                    tracing::error!("{e}");
                }
                if let Err(e) = check("cuMemRelease", sys::cuMemRelease(handle)) {
                    tracing::error!("{e}");
                }
            }
        }
    }

    /// Free a reserved range.
    ///
    /// # Safety
    /// It came from [`reserve`](Self::reserve) with `bytes`, and nothing of it is mapped.
    pub(super) unsafe fn release(&self, base: NonNull<u8>, bytes: usize) {
        // SAFETY: by the caller's contract.
        let r = unsafe { sys::cuMemAddressFree(base.as_ptr().addr() as u64, bytes) };
        if let Err(e) = check("cuMemAddressFree", r) {
            tracing::error!("{e}");
        }
    }
}
