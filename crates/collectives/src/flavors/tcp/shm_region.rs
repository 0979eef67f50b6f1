//! The reader's side of [`SharedHostStorage`](fsdp_device::shared::SharedHostStorage) for the
//! shared-memory transport: peers' regions mapped in place.
//!
//! When the transport sends a segment that lies inside a region of its process
//! ([`region_of`](fsdp_device::shared::region_of)), it publishes the region (descriptor number,
//! identifier, offset) instead of an address for cross-memory attach. The receiver maps the
//! region once — it opens `/proc/<pid>/fd/<fd>`, which needs the same permission as
//! `process_vm_readv` — checks the identifier and the seals, and from then on copies or
//! reduces straight from the peer's memory: one user-space copy per hop, no page pinning per
//! call, no staging for reductions. Mappings of regions their owner has freed are dropped at
//! the start of each collective (the memory returns to the system once the last mapping goes).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use fsdp_device::shared::{header_id, header_live, SharedRegion, REGION_HEADER};

/// Bytes this process has read in place from peers' regions.
static IN_PLACE: AtomicU64 = AtomicU64::new(0);

/// The bytes this process has received in place from its peers'
/// [`SharedHostStorage`](fsdp_device::shared::SharedHostStorage) buffers through the
/// shared-memory transport (all communicators, since the process started): how to tell that
/// the buffers registered as intended.
pub fn shared_bytes_received() -> u64 {
    IN_PLACE.load(Ordering::Relaxed)
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
        r: SharedRegion,
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
        // SAFETY: every cached mapping is live (unmapped only when removed here) and starts
        // with a region's header page.
        self.maps.retain(|_, m| unsafe { header_live(m.base) });
    }
}

/// Map process `pid`'s region `r` read-only, checking what it is.
fn map_peer(pid: u32, r: SharedRegion) -> Result<PeerRegion, String> {
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
    // SAFETY: the mapping is live and at least REGION_HEADER bytes long (checked above).
    let id = unsafe { header_id(m.base) };
    if id != Some(r.id) {
        return Err(format!(
            "{path} holds shared buffer {id:?}, not {} (the descriptor was reused)",
            r.id
        ));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_device::shared::{region_of, SharedHostStorage};
    use fsdp_device::Storage;

    #[test]
    #[cfg_attr(miri, ignore = "Miri does not support memfd and file mappings")]
    fn a_peer_mapping_reads_the_owners_bytes_and_is_swept_after_the_owner_frees_it() {
        let s = SharedHostStorage::zeroed(8192).unwrap();
        // SAFETY: the storage's 8192 bytes are ours and nothing else touches them here.
        unsafe { std::ptr::write_bytes(s.as_ptr(), 0xab, 8192) };
        let r = region_of(s.as_ptr().wrapping_add(4096), 16).unwrap();
        let mut peers = PeerRegions::default();
        let p = peers.resolve(std::process::id(), r, 16).unwrap();
        // SAFETY: `resolve` checked the 16 bytes lie inside the mapping.
        assert_eq!(unsafe { std::slice::from_raw_parts(p, 16) }, &[0xab; 16]);
        let bad = SharedRegion {
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
