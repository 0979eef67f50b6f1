//! Host virtual memory for expandable segments: an address range reserved with
//! `mmap(PROT_NONE)`, pages committed with `mprotect(PROT_READ | PROT_WRITE)` and given back
//! with `madvise(MADV_DONTNEED)` then `mprotect(PROT_NONE)`, the range released with `munmap`.

use std::ptr::NonNull;

use crate::AllocError;

fn os_error(op: &'static str) -> AllocError {
    AllocError::Source {
        op,
        message: std::io::Error::last_os_error().to_string(),
    }
}

/// Reserve `bytes` of address space (no memory behind it: `PROT_NONE`, `MAP_NORESERVE`).
pub(crate) fn reserve(bytes: usize) -> Result<NonNull<u8>, AllocError> {
    if bytes == 0 {
        return Err(AllocError::InvalidArgument(
            "an address range of 0 bytes".to_string(),
        ));
    }
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no
    // existing memory.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(AllocError::SourceOutOfMemory { bytes });
    }
    NonNull::new(p.cast::<u8>()).ok_or(AllocError::SourceOutOfMemory { bytes })
}

/// Make `offset..offset + bytes` of the range at `base` readable and writable; the pages
/// read as zeros until written.
///
/// # Safety
/// The pages lie in a range from [`reserve`] that is still reserved.
pub(crate) unsafe fn commit(
    base: NonNull<u8>,
    offset: usize,
    bytes: usize,
) -> Result<(), AllocError> {
    // SAFETY: by the caller's contract the pages belong to our own reserved mapping.
    let rc = unsafe {
        libc::mprotect(
            base.as_ptr().add(offset).cast(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
        )
    };
    if rc == 0 {
        Ok(())
    } else if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOMEM) {
        Err(AllocError::SourceOutOfMemory { bytes })
    } else {
        Err(os_error("mprotect"))
    }
}

/// Give the memory of committed pages back to the kernel (they read as zeros if committed
/// again) and make them inaccessible.
///
/// # Safety
/// The pages were committed by [`commit`] and nothing uses them any more.
pub(crate) unsafe fn decommit(base: NonNull<u8>, offset: usize, bytes: usize) {
    // SAFETY: by the caller's contract the pages are ours and unused.
    unsafe {
        let p = base.as_ptr().add(offset).cast();
        if libc::madvise(p, bytes, libc::MADV_DONTNEED) != 0 {
            tracing::error!("madvise: {}", std::io::Error::last_os_error());
        }
        if libc::mprotect(p, bytes, libc::PROT_NONE) != 0 {
            tracing::error!("mprotect: {}", std::io::Error::last_os_error());
        }
    }
}

/// Release a range from [`reserve`].
///
/// # Safety
/// `base` and `bytes` come from one `reserve` call, and nothing uses the range any more.
pub(crate) unsafe fn release(base: NonNull<u8>, bytes: usize) {
    // SAFETY: by the caller's contract the mapping is ours, whole, and unused.
    if unsafe { libc::munmap(base.as_ptr().cast(), bytes) } != 0 {
        tracing::error!("munmap: {}", std::io::Error::last_os_error());
    }
}
