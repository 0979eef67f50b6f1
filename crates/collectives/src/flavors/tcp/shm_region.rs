//! Host memory that the shared-memory transport's peers read in place: [`SharedHostStorage`]
//! (NCCL's user-buffer registration, on CPUs).
//!
//! A buffer over a [`SharedHostStorage`] lives in a sealed `memfd` mapped into this process.
//! Every such region is entered in a process-wide table while it lives. When the transport
//! sends a segment that lies inside one, it publishes the region (this process's descriptor
//! number, the region's identifier and the offset) instead of an address for cross-memory
//! attach; the receiver maps the region once — it opens `/proc/<pid>/fd/<fd>`, which needs
//! the same permission as `process_vm_readv` — checks the identifier and the seals, and from
//! then on copies or reduces straight from the peer's memory: one user-space copy per hop, no
//! page pinning per call, no staging for reductions.
//!
//! The region's first page is a header: a magic number, the identifier and a *live* word that
//! the owner clears when it frees the region. Receivers drop their mappings of regions no longer
//! live at the start of each collective (the memory returns to the system once the last
//! mapping goes). The file is sealed against shrinking and growing, so a peer's mapping can
//! never fault.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use fsdp_device::{Device, DeviceError, Storage};

/// Bytes before a region's data: magic, identifier, live word (one page, so data is aligned).
const REGION_HEADER: usize = 4096;
const REGION_MAGIC: u64 = 0x6673_6470_7265_6731; // "fsdpreg1"

/// A region of this process, as the transport publishes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RegionRef {
    /// The descriptor number of its memfd in the owner's process.
    pub(super) fd: u32,
    /// Its identifier (unique within the owner's process).
    pub(super) id: u64,
    /// The segment's offset from the region's data start.
    pub(super) offset: u64,
}

/// Bytes this process has read in place from peers' regions.
static IN_PLACE: AtomicU64 = AtomicU64::new(0);

/// The bytes this process has received in place from its peers' [`SharedHostStorage`] buffers
/// through the shared-memory transport (all communicators, since the process started): how to
/// tell that the buffers registered as intended.
pub fn shared_bytes_received() -> u64 {
    IN_PLACE.load(Ordering::Relaxed)
}

/// This process's live regions: data start → (data end, fd, id).
static TABLE: Mutex<BTreeMap<usize, (usize, u32, u64)>> = Mutex::new(BTreeMap::new());

fn table() -> std::sync::MutexGuard<'static, BTreeMap<usize, (usize, u32, u64)>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The region holding `bytes` bytes at `ptr`, if one of this process's shared storages does.
pub(super) fn lookup(ptr: *const u8, bytes: usize) -> Option<RegionRef> {
    let p = ptr as usize;
    let t = table();
    let (&start, &(end, fd, id)) = t.range(..=p).next_back()?;
    (p.checked_add(bytes)? <= end).then_some(RegionRef {
        fd,
        id,
        offset: (p - start) as u64,
    })
}

/// Host memory in a sealed `memfd` that processes of one host read in place through the
/// shared-memory transport (see the [module](self) documentation). Use it as the storage of
/// the buffers a [`TcpCommunicator`](super::TcpCommunicator) on `shm` moves most (e.g. an
/// all-gather's input and output): such segments cross in one copy instead of a cross-memory
/// attach (which pins the peer's pages on every call) or two copies through the ring's slots.
/// Any transport accepts these buffers; to the others they are ordinary host memory.
///
/// ```
/// use fsdp_collectives::tcp::SharedHostStorage;
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
    /// [`DeviceError::OutOfMemory`] when the region cannot be created, sized, sealed or mapped
    /// (the system's reason is logged).
    pub fn zeroed(len: usize) -> Result<SharedHostStorage, DeviceError> {
        let oom = |what: &str| {
            tracing::warn!(
                bytes = len,
                error = %std::io::Error::last_os_error(),
                "shared host storage: {what} failed"
            );
            DeviceError::OutOfMemory { bytes: len }
        };
        let map_len = len
            .checked_add(REGION_HEADER)
            .ok_or(DeviceError::OutOfMemory { bytes: len })?;
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
    // reference only while the mapping lives (the owner or a peer's cached mapping).
    unsafe { &*base.add(off).cast::<AtomicU64>() }
}

fn header_u32(base: *mut u8, off: usize) -> &'static AtomicU32 {
    // SAFETY: as for `header_u64`, 4-aligned.
    unsafe { &*base.add(off).cast::<AtomicU32>() }
}

/// A peer's region mapped read-only into this process.
struct PeerRegion {
    base: *mut u8,
    map_len: usize,
}

impl Drop for PeerRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `PeerRegions::map`, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.map_len) };
    }
}

/// The peers' regions this rank has mapped, by (pid, identifier).
#[derive(Default)]
pub(super) struct PeerRegions {
    maps: HashMap<(u32, u64), PeerRegion>,
}

// SAFETY: the mappings are read-only views of shared memory owned by this value.
unsafe impl Send for PeerRegions {}

impl PeerRegions {
    /// The address, in this process, of `bytes` bytes of process `pid`'s region `r`.
    pub(super) fn resolve(
        &mut self,
        pid: u32,
        r: RegionRef,
        bytes: usize,
    ) -> Result<*const u8, String> {
        let m = match self.maps.entry((pid, r.id)) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(map_peer(pid, r)?),
        };
        let end = (r.offset as usize)
            .checked_add(bytes)
            .filter(|&e| e <= m.map_len - REGION_HEADER)
            .ok_or_else(|| {
                format!(
                    "{bytes} bytes at offset {} run past the end of its shared buffer {} ({} bytes)",
                    r.offset,
                    r.id,
                    m.map_len - REGION_HEADER
                )
            })?;
        IN_PLACE.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(m.base.wrapping_add(REGION_HEADER + end - bytes))
    }

    /// Unmap the regions their owners have freed.
    pub(super) fn sweep(&mut self) {
        self.maps
            .retain(|_, m| header_u32(m.base, 16).load(Ordering::Acquire) != 0);
    }
}

/// Map process `pid`'s region `r` read-only, checking what it is.
fn map_peer(pid: u32, r: RegionRef) -> Result<PeerRegion, String> {
    let path = format!("/proc/{pid}/fd/{}", r.fd);
    let file = std::fs::File::open(&path).map_err(|e| format!("opening {path}: {e}"))?;
    let fd = file.as_raw_fd();
    let map_len = file.metadata().map_err(|e| format!("{path}: {e}"))?.len() as usize;
    // SAFETY: querying the seals of a descriptor we hold.
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 || map_len < REGION_HEADER {
        return Err(format!(
            "{path} is not a sealed shared buffer of this library"
        ));
    }
    // SAFETY: a read-only shared mapping of a file sealed against shrinking, of its full size.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(format!(
            "mapping {path}: {}",
            std::io::Error::last_os_error()
        ));
    }
    let m = PeerRegion {
        base: base.cast(),
        map_len,
    };
    let (magic, id) = (
        header_u64(m.base, 0).load(Ordering::Acquire),
        header_u64(m.base, 8).load(Ordering::Relaxed),
    );
    if magic != REGION_MAGIC || id != r.id {
        return Err(format!(
            "{path} holds shared buffer {id}, not {} (the descriptor was reused)",
            r.id
        ));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "Miri does not support memfd and file mappings")]
    fn a_region_is_found_by_any_address_inside_it_and_forgotten_when_freed() {
        let s = SharedHostStorage::zeroed(1 << 16).unwrap();
        let p = s.as_ptr();
        let r = lookup(p.wrapping_add(100), 200).unwrap();
        assert_eq!(r.offset, 100);
        assert!(
            lookup(p.wrapping_add((1 << 16) - 8), 16).is_none(),
            "runs past the end"
        );
        assert!(lookup(p.wrapping_sub(8), 8).is_none(), "before the start");
        drop(s);
        assert!(lookup(p, 8).is_none());
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri does not support memfd and file mappings")]
    fn a_peer_mapping_reads_the_owners_bytes_and_is_swept_after_the_owner_frees_it() {
        let s = SharedHostStorage::zeroed(8192).unwrap();
        // SAFETY: the storage's 8192 bytes are ours and nothing else touches them here.
        unsafe { std::ptr::write_bytes(s.as_ptr(), 0xab, 8192) };
        let r = lookup(s.as_ptr().wrapping_add(4096), 16).unwrap();
        let mut peers = PeerRegions::default();
        let p = peers.resolve(std::process::id(), r, 16).unwrap();
        // SAFETY: `resolve` checked the 16 bytes lie inside the mapping.
        assert_eq!(unsafe { std::slice::from_raw_parts(p, 16) }, &[0xab; 16]);
        let bad = RegionRef {
            id: r.id + 1000,
            ..r
        };
        let e = peers.resolve(std::process::id(), bad, 16).unwrap_err();
        assert!(e.contains("not"), "{e}");
        let e = peers.resolve(std::process::id(), r, 8192).unwrap_err();
        assert!(e.contains("past the end"), "{e}");
        drop(s);
        peers.sweep();
        assert!(peers.maps.is_empty());
    }
}
