//! The shared-memory transport's mapping: the file under `/dev/shm` (created, mapped, unlinked),
//! its layout (header with the abort flag and reason, one channel per rank with head and tail
//! counters, the writer's pid and departure flag, and slots), futex waits and wake-ups, and
//! cross-memory attach (`process_vm_readv`).

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::{CollectiveError, Result};

pub(super) const MAGIC: u64 = 0x6673_6470_5f73_686d; // "fsdp_shm"
pub(super) const SLOTS: usize = 4;
pub(super) const POLL: Duration = Duration::from_millis(20);
pub(super) const HEADER: usize = 4096;
pub(super) const REASON_MAX: usize = 2048;
pub(super) const SLOT_HEADER: usize = 64;
pub(super) const CHANNEL_HEADER: usize = 256;

pub(super) const KIND_DESC: u32 = 1;
pub(super) const KIND_INLINE: u32 = 2;
pub(super) const KIND_REMOTE: u32 = 3;
pub(super) const KIND_REGION: u32 = 4;

/// A mapped shared file.
pub(crate) struct Mapping {
    base: *mut u8,
    len: usize,
    world: usize,
    pub(super) slot_bytes: usize,
    /// The file's path while it still has a name (rank 0 until every rank mapped it).
    pub(super) path: Option<PathBuf>,
}

// SAFETY: the mapping is plain shared memory; every shared field is accessed through atomics or
// under the slot protocol (a slot is written only by its channel's writer while it is free, read
// only by the reader while it is published).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base` and `len` are the mapping made in `map`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

pub(super) fn io_err(rank: usize, what: &str, e: std::io::Error) -> CollectiveError {
    CollectiveError::Backend {
        rank,
        backend: "shm",
        op: "connect",
        reason: format!("{what}: {e}"),
    }
}

impl Mapping {
    pub(super) fn size(world: usize, slot_bytes: usize) -> usize {
        HEADER + world * (CHANNEL_HEADER + SLOTS * (SLOT_HEADER + slot_bytes))
    }

    pub(super) fn map(
        file: &File,
        world: usize,
        slot_bytes: usize,
        rank: usize,
    ) -> Result<Mapping> {
        use std::os::fd::AsRawFd;
        let len = Mapping::size(world, slot_bytes);
        // SAFETY: mapping a file we opened read-write, of at least `len` bytes.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io_err(rank, "mmap", std::io::Error::last_os_error()));
        }
        Ok(Mapping {
            base: base.cast(),
            len,
            world,
            slot_bytes,
            path: None,
        })
    }

    pub(super) fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: in bounds and 4-aligned (every offset used is); shared memory accessed only
        // atomically at these offsets.
        unsafe { &*self.base.add(off).cast::<AtomicU32>() }
    }

    pub(super) fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: as for `u32_at`, 8-aligned.
        unsafe { &*self.base.add(off).cast::<AtomicU64>() }
    }

    pub(super) fn channel(&self, r: usize) -> usize {
        HEADER + r * (CHANNEL_HEADER + SLOTS * (SLOT_HEADER + self.slot_bytes))
    }

    pub(super) fn head(&self, r: usize) -> &AtomicU32 {
        self.u32_at(self.channel(r))
    }

    pub(super) fn tail(&self, r: usize) -> &AtomicU32 {
        self.u32_at(self.channel(r) + 64)
    }

    pub(super) fn pid(&self, r: usize) -> &AtomicU32 {
        self.u32_at(self.channel(r) + 128)
    }

    pub(super) fn departed(&self, r: usize) -> &AtomicU32 {
        self.u32_at(self.channel(r) + 132)
    }

    /// The address of [`PROBE`] in the writer's process (for its reader's pull test).
    pub(super) fn probe(&self, r: usize) -> &AtomicU64 {
        self.u64_at(self.channel(r) + 136)
    }

    /// Set by channel `r`'s reader: 1 if it can pull from the writer's memory by cross-memory
    /// attach (so the writer may send by address), 0 if not.
    pub(super) fn reader_pulls(&self, r: usize) -> &AtomicU32 {
        self.u32_at(self.channel(r) + 144)
    }

    /// Slot `i` of channel `r`: (header, data).
    pub(super) fn slot(&self, r: usize, i: usize) -> (usize, *mut u8) {
        let h = self.channel(r) + CHANNEL_HEADER + i * (SLOT_HEADER + self.slot_bytes);
        (h, self.base.wrapping_add(h + SLOT_HEADER))
    }

    pub(super) fn aborted(&self) -> Option<String> {
        let flag = self.u32_at(8);
        let mut spins = 0;
        loop {
            match flag.load(Ordering::Acquire) {
                0 => return None,
                2 => break,
                _ if spins > 1000 => return Some("aborted".into()),
                _ => {
                    spins += 1;
                    std::thread::yield_now();
                }
            }
        }
        let n = (self.u32_at(12).load(Ordering::Acquire) as usize).min(REASON_MAX);
        // SAFETY: the reason was written before the flag turned 2 and is never written again.
        let bytes = unsafe { std::slice::from_raw_parts(self.base.add(16), n) };
        Some(String::from_utf8_lossy(bytes).into_owned())
    }

    pub(super) fn abort(&self, reason: &str) -> bool {
        let flag = self.u32_at(8);
        if flag
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        let b = reason.as_bytes();
        let n = b.len().min(REASON_MAX);
        // SAFETY: only the winner of the flag writes the reason, once.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.base.add(16), n) };
        self.u32_at(12).store(n as u32, Ordering::Release);
        flag.store(2, Ordering::Release);
        for r in 0..self.world {
            futex_wake(self.head(r));
            futex_wake(self.tail(r));
        }
        true
    }
}

pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 of shared memory (no PRIVATE flag: the word is
    // shared between processes).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

pub(super) fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

pub(super) fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    pid == 0 || unsafe { libc::kill(pid as libc::pid_t, 0) } == 0 || {
        std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
}

/// What a reader pulls from its writer's process at set-up to learn whether cross-memory
/// attach reaches it (Yama's `ptrace_scope` 1, the default of several distributions, lets a
/// process attach only to its descendants: ranks are siblings).
pub(super) static PROBE: u64 = 0x6673_6470_7072_6f62; // "fsdpprob"

/// `FSDP_SHM_CMA=deny-peers`: cross-memory attach works on this process's own memory but not
/// on its peers' (as under Yama's `ptrace_scope` 1), to test the fallback.
pub(super) fn peers_deny_cma(pid: u32) -> bool {
    pid != std::process::id() && std::env::var("FSDP_SHM_CMA").is_ok_and(|v| v == "deny-peers")
}

/// Whether this process can pull from process `pid`, whose [`PROBE`] lies at `addr`.
pub(super) fn can_pull(pid: u32, addr: u64) -> bool {
    if peers_deny_cma(pid) {
        return false;
    }
    let mut got = [0u8; 8];
    // SAFETY: `got` is a local array of 8 bytes; the kernel checks the remote range.
    let n = unsafe { vm_read(pid, addr as usize as *const u8, got.as_mut_ptr(), 8) };
    n == 8 && u64::from_ne_bytes(got) == PROBE
}

/// Whether cross-memory attach works here (a read of our own memory through the syscall).
pub(super) fn cma_works() -> bool {
    if std::env::var("FSDP_SHM_CMA").is_ok_and(|v| v == "0") {
        return false;
    }
    let src = [7u8; 8];
    let mut dst = [0u8; 8];
    // SAFETY: both iovecs describe local arrays of 8 bytes.
    let n = unsafe { vm_read(std::process::id(), src.as_ptr(), dst.as_mut_ptr(), 8) };
    n == 8 && dst == src
}

/// Copy `bytes` from `remote` in process `pid` to local `dst`; the bytes copied (or -1).
///
/// # Safety
/// `dst` writable for `bytes` bytes.
pub(super) unsafe fn vm_read(pid: u32, remote: *const u8, dst: *mut u8, bytes: usize) -> isize {
    let local = libc::iovec {
        iov_base: dst.cast(),
        iov_len: bytes,
    };
    let remote = libc::iovec {
        iov_base: remote.cast_mut().cast(),
        iov_len: bytes,
    };
    // SAFETY: the local iovec is writable (caller's contract); the kernel checks the remote one.
    unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) }
}
