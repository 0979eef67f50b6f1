//! The memory a [`Buffer`](crate::Buffer) views: the [`Storage`] trait, host memory
//! ([`HostStorage`]) and storage on [`Device::Meta`] ([`MetaStorage`]). Device memory (feature
//! `cuda`) is in `cuda`.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::{Device, DeviceError, StreamOrder};

/// Alignment of host storage created by this crate (one cache line).
pub const HOST_ALIGN: usize = 64;

/// Memory that a [`Buffer`](crate::Buffer) views.
///
/// # Safety
/// Implementors guarantee that [`as_ptr`](Storage::as_ptr) returns the same address for the whole
/// life of the value, that the `byte_len` bytes from it stay valid (allocated and not used by
/// anything else) until the value is dropped, and that the address is aligned to at least 8 bytes.
/// For [`Device::Cpu`] the address is a host pointer; for a CUDA device, a device pointer; for
/// [`Device::Meta`] the address is only an identifier: no bytes exist behind it and it is never
/// dereferenced (host access refuses buffers that are not on the CPU, and code that touches a
/// buffer's memory through an [`AccessGuard`](crate::AccessGuard) checks its device first).
pub unsafe trait Storage: Send + Sync + 'static {
    /// Where the memory lives.
    fn device(&self) -> Device;
    /// Size in bytes.
    fn byte_len(&self) -> usize;
    /// The base address.
    fn as_ptr(&self) -> *mut u8;
    /// The [`StreamOrder`] of a stream-ordered storage (device memory): buffers over it are used
    /// on streams through [`Buffer::use_on`](crate::Buffer::use_on) instead of access tickets. `None` (the default) for
    /// storage ordered by access tickets.
    fn stream_order(&self) -> Option<Arc<StreamOrder>> {
        None
    }
    /// Whether the memory is page-locked host memory that asynchronous device copies may use
    /// (`PinnedStorage` of the `cuda` feature). Default `false`.
    fn is_page_locked(&self) -> bool {
        false
    }
}

/// Zero-initialised host memory aligned to [`HOST_ALIGN`].
pub struct HostStorage {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: HostStorage owns its allocation exclusively; the pointer is only dereferenced through
// Buffer's access tickets, which serialise conflicting accesses across threads.
unsafe impl Send for HostStorage {}
// SAFETY: as above; &HostStorage only exposes the address, never a reference to the bytes.
unsafe impl Sync for HostStorage {}

impl HostStorage {
    /// Allocate `len` zeroed bytes.
    pub fn zeroed(len: usize) -> Result<HostStorage, DeviceError> {
        if len == 0 {
            // A dangling but aligned address: nothing is ever read or written through it.
            let ptr =
                NonNull::new(HOST_ALIGN as *mut u8).ok_or(DeviceError::OutOfMemory { bytes: 0 })?;
            return Ok(HostStorage { ptr, len: 0 });
        }
        let layout = std::alloc::Layout::from_size_align(len, HOST_ALIGN)
            .map_err(|_| DeviceError::OutOfMemory { bytes: len })?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(DeviceError::OutOfMemory { bytes: len })?;
        Ok(HostStorage { ptr, len })
    }
}

impl Drop for HostStorage {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with exactly this layout, freed once.
            unsafe {
                std::alloc::dealloc(
                    self.ptr.as_ptr(),
                    std::alloc::Layout::from_size_align_unchecked(self.len, HOST_ALIGN),
                )
            }
        }
    }
}

// SAFETY: the allocation is owned, fixed, HOST_ALIGN-aligned and lives until drop.
unsafe impl Storage for HostStorage {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn byte_len(&self) -> usize {
        self.len
    }
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

/// Storage on [`Device::Meta`]: a size and no bytes, like the storage of PyTorch's meta tensors.
/// Buffers over it have shapes, lengths, slices and access tickets, but their elements cannot
/// be read or written (host access is a [`DeviceError::Unsupported`]).
///
/// ```
/// use fsdp_device::{Buffer, DType, Device, DeviceError};
/// let buf = Buffer::meta(DType::F32, 1 << 40).unwrap(); // 4 TiB, and no memory
/// assert_eq!((buf.device(), buf.byte_len()), (Device::Meta, 4 << 40));
/// assert!(matches!(buf.to_vec::<f32>(), Err(DeviceError::Unsupported { .. })));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetaStorage {
    len: usize,
}

impl MetaStorage {
    /// Storage of `byte_len` bytes that do not exist.
    pub fn new(byte_len: usize) -> MetaStorage {
        MetaStorage { len: byte_len }
    }
}

// SAFETY: for Device::Meta the trait asks only for a fixed, aligned address: `as_ptr` is always
// HOST_ALIGN (a dangling, well-aligned address without provenance, like `NonNull::dangling`),
// which identifies no memory and is never dereferenced — Buffer's host access refuses meta
// buffers, and the backends that touch memory through guards check the device first.
unsafe impl Storage for MetaStorage {
    fn device(&self) -> Device {
        Device::Meta
    }
    fn byte_len(&self) -> usize {
        self.len
    }
    fn as_ptr(&self) -> *mut u8 {
        std::ptr::without_provenance_mut(HOST_ALIGN)
    }
}
