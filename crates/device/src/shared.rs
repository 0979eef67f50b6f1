//! Host memory that other processes of the host can map: [`SharedHostStorage`] (a sealed
//! `memfd`), and the process-wide table of live regions ([`region_of`]) through which a
//! transport finds whether a buffer it sends lies in one (NCCL's user-buffer registration, on
//! CPUs; `fsdp-collectives`' shared-memory transport is the reader).
//!
//! A region's first page is a header: a magic number, the region's identifier (unique in its
//! process) and a *live* word that the owner clears when it frees the region, so that peers
//! holding a mapping know to drop it ([`header_id`], [`header_live`]). The file is sealed
//! against shrinking and growing, so a peer's mapping can never fault. Peers open it as
//! `/proc/<pid>/fd/<fd>`, which needs the permission that `process_vm_readv` needs.

use std::collections::BTreeMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::{Device, DeviceError, Storage};

/// Bytes of a region before its data: the header (one page, so data is page-aligned).
pub const REGION_HEADER: usize = 4096;
const REGION_MAGIC: u64 = 0x6673_6470_7265_6731; // "fsdpreg1"

/// Where a segment of this process's memory lies in a [`SharedHostStorage`] region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedRegion {
    /// The descriptor number of the region's `memfd` in this process.
    pub fd: u32,
    /// The region's identifier (unique within this process).
    pub id: u64,
    /// The segment's offset from the region's data start.
    pub offset: u64,
}

/// This process's live regions: data start → (data end, fd, id).
static TABLE: Mutex<BTreeMap<usize, (usize, u32, u64)>> = Mutex::new(BTreeMap::new());

fn table() -> std::sync::MutexGuard<'static, BTreeMap<usize, (usize, u32, u64)>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The region holding the `bytes` bytes at `ptr`, if one of this process's live
/// [`SharedHostStorage`]s does.
pub fn region_of(ptr: *const u8, bytes: usize) -> Option<SharedRegion> {
    let p = ptr as usize;
    let t = table();
    let (&start, &(end, fd, id)) = t.range(..=p).next_back()?;
    (p.checked_add(bytes)? <= end).then_some(SharedRegion {
        fd,
        id,
        offset: (p - start) as u64,
    })
}

/// Host memory in a sealed `memfd` that processes of one host read in place through the
/// shared-memory transport of `fsdp-collectives` (see the [module](self) documentation). Use it
/// as the storage of the buffers a communicator on `shm` moves most (e.g. an
/// all-gather's input and output): such segments cross in one copy instead of a cross-memory
/// attach (which pins the peer's pages on every call) or two copies through the ring's slots.
/// Any transport accepts these buffers; to the others they are ordinary host memory.
///
/// ```
/// use fsdp_device::shared::SharedHostStorage;
/// use fsdp_device::{Buffer, DType, Device};
///
/// let buf = Buffer::from_storage(Box::new(SharedHostStorage::zeroed(4096 * 4)?), DType::F32)?;
/// assert_eq!((buf.device(), buf.len()), (Device::Cpu, 4096));
/// buf.copy_from_slice(&[1.5f32; 4096])?;
/// assert_eq!(buf.to_vec::<f32>()?[4095], 1.5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct SharedHostStorage {
    base: *mut u8,
    map_len: usize,
    len: usize,
    _fd: OwnedFd,
}

// SAFETY: the storage owns its mapping; its bytes are reached only through Buffer's access
// tickets (which serialise conflicting accesses) and, read-only, by peers under the
// transport's protocol (a segment is read only while the collective holds its guards).
unsafe impl Send for SharedHostStorage {}
// SAFETY: as above; `&SharedHostStorage` exposes only the address.
unsafe impl Sync for SharedHostStorage {}

impl SharedHostStorage {
    /// `len` zeroed bytes in a new sealed `memfd` region.
    ///
    /// # Errors
    /// [`DeviceError::SharedMemory`] naming the step (creating, sizing, sealing or mapping
    /// the region) that failed and the system's reason.
    pub fn zeroed(len: usize) -> Result<SharedHostStorage, DeviceError> {
        let oom = |what: &'static str| DeviceError::SharedMemory {
            bytes: len,
            what,
            reason: std::io::Error::last_os_error().to_string(),
        };
        let map_len = len
            .checked_add(REGION_HEADER)
            .ok_or(DeviceError::SharedMemory {
                bytes: len,
                what: "sizing",
                reason: "the size overflows usize".into(),
            })?;
        // SAFETY: a NUL-terminated name and valid flags.
        let raw = unsafe {
            libc::memfd_create(
                c"fsdp-shared-buffer".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(oom("memfd_create"));
        }
        // SAFETY: `raw` is a descriptor we just created and own alone.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sizing and sealing our own memfd.
        let sized = unsafe { libc::ftruncate(raw, map_len as libc::off_t) } == 0
            && unsafe {
                libc::fcntl(
                    raw,
                    libc::F_ADD_SEALS,
                    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
                )
            } == 0;
        if !sized {
            return Err(oom("sizing and sealing the memfd"));
        }
        // SAFETY: mapping `map_len` bytes of a file of exactly that size.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                raw,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(oom("mmap"));
        }
        let base: *mut u8 = base.cast();
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let s = SharedHostStorage {
            base,
            map_len,
            len,
            _fd: fd,
        };
        header_u64(base, 8).store(id, Ordering::Relaxed);
        header_u32(base, 16).store(1, Ordering::Relaxed);
        header_u64(base, 0).store(REGION_MAGIC, Ordering::Release);
        let start = base as usize + REGION_HEADER;
        table().insert(start, (start + len, raw as u32, id));
        Ok(s)
    }
}

impl Drop for SharedHostStorage {
    fn drop(&mut self) {
        let start = self.base as usize + REGION_HEADER;
        table().remove(&start);
        header_u32(self.base, 16).store(0, Ordering::Release);
        // SAFETY: the mapping made in `zeroed`, unmapped once; the descriptor closes after.
        unsafe { libc::munmap(self.base.cast(), self.map_len) };
    }
}

// SAFETY: the data bytes (after the header page) are mapped read-write for the storage's whole
// life, page-aligned, and used by nothing else of this process.
unsafe impl Storage for SharedHostStorage {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn byte_len(&self) -> usize {
        self.len
    }
    fn as_ptr(&self) -> *mut u8 {
        self.base.wrapping_add(REGION_HEADER)
    }
}

fn header_u64(base: *mut u8, off: usize) -> &'static AtomicU64 {
    // SAFETY: `off` is 8-aligned inside the header page of a live mapping; callers use the
    // reference only while the mapping lives.
    unsafe { &*base.add(off).cast::<AtomicU64>() }
}

fn header_u32(base: *mut u8, off: usize) -> &'static AtomicU32 {
    // SAFETY: as for `header_u64`, 4-aligned.
    unsafe { &*base.add(off).cast::<AtomicU32>() }
}

/// The identifier of the region whose mapping (of at least [`REGION_HEADER`] bytes) starts at
/// `base`, or `None` when the mapping is not a region of this crate.
///
/// # Safety
/// `base` is the start of a live, readable mapping of at least [`REGION_HEADER`] bytes.
pub unsafe fn header_id(base: *const u8) -> Option<u64> {
    let b = base.cast_mut();
    (header_u64(b, 0).load(Ordering::Acquire) == REGION_MAGIC)
        .then(|| header_u64(b, 8).load(Ordering::Relaxed))
}

/// Whether the region whose mapping starts at `base` is still live (its owner has not freed
/// it).
///
/// # Safety
/// As for [`header_id`].
pub unsafe fn header_live(base: *const u8) -> bool {
    header_u32(base.cast_mut(), 16).load(Ordering::Acquire) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "Miri does not support memfd and file mappings")]
    fn a_region_is_found_by_any_address_inside_it_and_forgotten_when_freed() {
        let s = SharedHostStorage::zeroed(1 << 16).unwrap();
        let p = s.as_ptr();
        let r = region_of(p.wrapping_add(100), 200).unwrap();
        assert_eq!(r.offset, 100);
        assert!(
            region_of(p.wrapping_add((1 << 16) - 8), 16).is_none(),
            "runs past the end"
        );
        assert!(
            region_of(p.wrapping_sub(8), 8).is_none(),
            "before the start"
        );
        let base = p.wrapping_sub(REGION_HEADER);
        // SAFETY: the region's mapping starts one header before its data and is live.
        let (id, live) = unsafe { (header_id(base), header_live(base)) };
        assert_eq!((id, live), (Some(r.id), true));
        drop(s);
        assert!(region_of(p, 8).is_none());
    }
}
