//! The shared-memory transport of the ring engine, for ranks that are processes of one host
//! (NCCL's SHM transport, on CPUs).
//!
//! Rank 0 of the group creates a file under `/dev/shm` named after itself (pid, clock) and the
//! group — so two jobs, or two groups of one job, never share one — and publishes its path in
//! the store; every rank maps it, and once all have, rank 0 unlinks the name (the mapping lives
//! until the last rank unmaps it; a rank that fails during set-up removes the file on drop).
//!
//! Layout: a header (abort flag and reason), then one channel per rank `r` for `r → r+1`: a
//! `head` counter (messages published, written by `r`), a `tail` counter (messages consumed,
//! written by `r+1`), the writer's pid and departure flag, and `SLOTS` slots of a header and
//! `slot_bytes` of data. Waits spin briefly, then sleep on the counter with `futex`, waking every
//! `POLL` to check the deadline, the abort flag and whether the peer's process still lives.
//!
//! Data moves either inline (copied into the slot, copied out: two copies per hop) or — when the
//! kernel allows cross-memory attach — by address: the sender publishes where the segment lies in
//! its own memory and the receiver copies it straight into its buffer with `process_vm_readv`
//! (one copy per hop, the thread ring's pull protocol across processes). Partial sums of
//! reductions are always computed straight into the sender's slot, so the receiver reduces from
//! shared memory without a copy. A segment inside a
//! [`SharedHostStorage`](fsdp_device::shared::SharedHostStorage) buffer crosses by
//! region instead: the receiver maps the sender's region once and copies (or reduces) straight
//! from it — one user-space copy, no page pinning per call, no staging (see
//! [`shm_region`](super::shm_region)).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::shm_map::*;
use super::shm_region::PeerRegions;
use crate::flavors::desc::OpDesc;
use crate::flavors::engine::{exchange_around_ring, Control, DataError, Transport};
use fsdp_device::shared::{region_of, SharedRegion};

#[path = "shm_connect.rs"]
mod connect;
pub(crate) use connect::connect;

/// Abort control of a shared-memory group: the flag and reason live in the mapping.
pub(crate) struct ShmControl {
    map: Arc<Mapping>,
    rank: usize,
}

impl Control for ShmControl {
    fn aborted(&self) -> Option<String> {
        self.map.aborted()
    }

    fn abort(&self, _seq: u64, reason: String) {
        if self.map.abort(&reason) {
            tracing::warn!(rank = self.rank, %reason, "shm communicator aborted");
        }
    }
}

/// One rank's shared-memory transport.
pub(crate) struct Shm {
    map: Arc<Mapping>,
    rank: usize,
    world: usize,
    /// Send by address: cross-memory attach works and this rank's reader could pull from it.
    cma: bool,
    seq: u64,
    deadline: Instant,
    /// Staging for data sent by address but needed in memory (reductions).
    staging: Vec<u64>,
    /// The predecessor's shared regions mapped here.
    peers: PeerRegions,
}

impl Drop for Shm {
    fn drop(&mut self) {
        self.map.departed(self.rank).store(1, Ordering::Release);
        futex_wake(self.map.tail(self.prev()));
        futex_wake(self.map.head(self.rank));
    }
}

/// What a wait is for.
enum Wait {
    /// The predecessor to publish (reader side).
    Data,
    /// The successor to consume (writer side).
    Room,
}

impl Shm {
    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    /// Wait until `ready(value)` holds for `word`, checking abort, deadline and the peer.
    fn wait(
        &self,
        word: &AtomicU32,
        ready: impl Fn(u32) -> bool,
        what: Wait,
        waiting_for: impl Fn() -> String,
    ) -> std::result::Result<(), DataError> {
        let mut spins = 0u32;
        loop {
            let v = word.load(Ordering::Acquire);
            if ready(v) {
                return Ok(());
            }
            if spins < 200 {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            if let Some(reason) = self.map.aborted() {
                return Err(DataError::Aborted { reason });
            }
            let peer = match what {
                Wait::Data => self.prev(),
                Wait::Room => self.next(),
            };
            if self.map.departed(peer).load(Ordering::Acquire) != 0
                || !alive(self.map.pid(peer).load(Ordering::Acquire))
            {
                // The peer may have done what we wait for and then left (the last reader of a
                // run acknowledges its final segment and exits): look once more.
                if ready(word.load(Ordering::Acquire)) {
                    return Ok(());
                }
                return Err(DataError::Departed {
                    peer,
                    why: "its process left the shared-memory ring".into(),
                });
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(DataError::Timeout {
                    waiting_for: waiting_for(),
                });
            }
            futex_wait(word, v, POLL.min(left));
        }
    }

    /// Wait for a free slot of this rank's channel; its index and data pointer.
    fn claim(&self) -> std::result::Result<(u32, usize, *mut u8), DataError> {
        let r = self.rank;
        let head = self.map.head(r).load(Ordering::Relaxed);
        let next = self.next();
        self.wait(
            self.map.tail(r),
            |tail| head.wrapping_sub(tail) < SLOTS as u32,
            Wait::Room,
            || format!("rank {next} to read this rank's data"),
        )?;
        let (h, data) = self.map.slot(r, head as usize % SLOTS);
        Ok((head, h, data))
    }

    fn publish(&self, head: u32, h: usize, kind: u32, origin: usize, len: usize, addr: u64) {
        self.publish_region(head, h, kind, origin, len, addr, None);
    }

    #[allow(clippy::too_many_arguments)]
    fn publish_region(
        &self,
        head: u32,
        h: usize,
        kind: u32,
        origin: usize,
        len: usize,
        addr: u64,
        region: Option<SharedRegion>,
    ) {
        if let Some(r) = region {
            self.map.u32_at(h + 32).store(r.fd, Ordering::Relaxed);
            self.map.u64_at(h + 40).store(r.id, Ordering::Relaxed);
            self.map.u64_at(h + 48).store(r.offset, Ordering::Relaxed);
        }
        self.map.u64_at(h).store(self.seq, Ordering::Relaxed);
        self.map.u32_at(h + 8).store(kind, Ordering::Relaxed);
        self.map
            .u32_at(h + 12)
            .store(origin as u32, Ordering::Relaxed);
        self.map.u64_at(h + 16).store(len as u64, Ordering::Relaxed);
        self.map.u64_at(h + 24).store(addr, Ordering::Relaxed);
        let w = self.map.head(self.rank);
        w.store(head.wrapping_add(1), Ordering::Release);
        futex_wake(w);
    }

    /// Wait for the predecessor's next message: (slot header offset, data, kind, origin, len,
    /// addr). The slot stays the reader's until [`consume`](Self::consume).
    #[allow(clippy::type_complexity)]
    fn peek(
        &self,
        kind: u32,
        waiting_for: impl Fn() -> String,
    ) -> std::result::Result<(*mut u8, u32, usize, usize, u64, usize), DataError> {
        let p = self.prev();
        let tail = self.map.tail(p).load(Ordering::Relaxed);
        self.wait(
            self.map.head(p),
            |head| head != tail,
            Wait::Data,
            waiting_for,
        )?;
        let (h, data) = self.map.slot(p, tail as usize % SLOTS);
        let seq = self.map.u64_at(h).load(Ordering::Relaxed);
        let k = self.map.u32_at(h + 8).load(Ordering::Relaxed);
        let origin = self.map.u32_at(h + 12).load(Ordering::Relaxed) as usize;
        let len = self.map.u64_at(h + 16).load(Ordering::Relaxed) as usize;
        let addr = self.map.u64_at(h + 24).load(Ordering::Relaxed);
        let data_kind = k == KIND_INLINE || k == KIND_REMOTE || k == KIND_REGION;
        if seq != self.seq || (k != kind && !(kind == KIND_INLINE && data_kind)) {
            return Err(DataError::Protocol {
                reason: format!(
                    "expected a message of kind {kind} of collective #{} from rank {p}, got kind \
                     {k} of #{seq}",
                    self.seq
                ),
            });
        }
        Ok((data, k, origin, len, addr, h))
    }

    /// Where the remote segment of a `KIND_REMOTE` or `KIND_REGION` message (slot header `h`,
    /// sender's address `addr`) can be read in place: its region mapped here, or `None` when
    /// it must be pulled by cross-memory attach.
    fn in_place(
        &mut self,
        kind: u32,
        h: usize,
        addr: u64,
        bytes: usize,
    ) -> std::result::Result<Option<*const u8>, DataError> {
        if kind != KIND_REGION {
            return Ok(None);
        }
        let r = SharedRegion {
            fd: self.map.u32_at(h + 32).load(Ordering::Relaxed),
            id: self.map.u64_at(h + 40).load(Ordering::Relaxed),
            offset: self.map.u64_at(h + 48).load(Ordering::Relaxed),
        };
        let prev = self.prev();
        let pid = self.map.pid(prev).load(Ordering::Acquire);
        match self.peers.resolve(pid, r, bytes) {
            Ok(p) => Ok(Some(p)),
            // Fall back to cross-memory attach where this rank could pull from its writer.
            Err(why) if self.map.reader_pulls(prev).load(Ordering::Acquire) == 1 => {
                tracing::debug!(rank = self.rank, %why, addr, "shared buffer not mapped: pulling");
                Ok(None)
            }
            Err(why) => Err(DataError::Departed {
                peer: prev,
                why: format!("its shared buffer could not be mapped: {why}"),
            }),
        }
    }

    fn consume(&self) {
        let w = self.map.tail(self.prev());
        w.store(w.load(Ordering::Relaxed).wrapping_add(1), Ordering::Release);
        futex_wake(w);
    }

    fn check_len(&self, len: usize, expect: usize) -> std::result::Result<(), DataError> {
        if len != expect {
            return Err(DataError::Protocol {
                reason: format!(
                    "expected {expect} bytes of collective #{} from rank {}, got {len}",
                    self.seq,
                    self.prev()
                ),
            });
        }
        Ok(())
    }

    /// Bring a remote segment into local memory at `dst`.
    fn pull(&self, addr: u64, dst: *mut u8, bytes: usize) -> std::result::Result<(), DataError> {
        let pid = self.map.pid(self.prev()).load(Ordering::Acquire);
        if peers_deny_cma(pid) {
            return Err(DataError::Departed {
                peer: self.prev(),
                why: "process_vm_readv refused (FSDP_SHM_CMA=deny-peers)".into(),
            });
        }
        let mut done = 0;
        while done < bytes {
            // SAFETY: `dst` is writable for `bytes` (callers pass their own memory or staging).
            let n = unsafe {
                vm_read(
                    pid,
                    (addr as usize + done) as *const u8,
                    dst.wrapping_add(done),
                    bytes - done,
                )
            };
            if n <= 0 {
                return Err(DataError::Departed {
                    peer: self.prev(),
                    why: format!(
                        "process_vm_readv failed: {}",
                        std::io::Error::last_os_error()
                    ),
                });
            }
            done += n as usize;
        }
        Ok(())
    }

    fn max_inline(&self) -> usize {
        self.map.slot_bytes
    }
}

impl Transport for Shm {
    fn exchange(
        &mut self,
        seq: u64,
        own: &OpDesc,
        deadline: Instant,
    ) -> std::result::Result<Vec<OpDesc>, DataError> {
        self.seq = seq;
        self.deadline = deadline;
        let this = &*self;
        exchange_around_ring(
            self.rank,
            self.world,
            own,
            &mut |origin, bytes| {
                if bytes.len() > this.max_inline() {
                    return Err(DataError::Protocol {
                        reason: format!("a description of {} bytes", bytes.len()),
                    });
                }
                let (head, h, data) = this.claim()?;
                // SAFETY: the claimed slot is ours until published; room checked above.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), data, bytes.len()) };
                this.publish(head, h, KIND_DESC, origin, bytes.len(), 0);
                Ok(())
            },
            &mut |origin| {
                let (data, _, got, len, _, _) = this.peek(KIND_DESC, || {
                    format!("rank [{origin}] did not reach this collective")
                })?;
                // SAFETY: the published slot holds `len` bytes until consumed.
                let v = unsafe { std::slice::from_raw_parts(data, len.min(this.max_inline())) }
                    .to_vec();
                this.consume();
                Ok((got, v))
            },
        )
    }

    fn begin(&mut self, seq: u64, deadline: Instant) {
        self.seq = seq;
        self.deadline = deadline;
        self.peers.sweep();
    }

    unsafe fn send(&mut self, src: *const u8, bytes: usize) -> std::result::Result<(), DataError> {
        let (head, h, data) = self.claim()?;
        if let Some(r) = region_of(src, bytes).filter(|_| bytes > 0) {
            self.publish_region(head, h, KIND_REGION, self.rank, bytes, src as u64, Some(r));
        } else if self.cma && bytes > 0 {
            self.publish(head, h, KIND_REMOTE, self.rank, bytes, src as u64);
        } else {
            // SAFETY: `src` readable (caller's contract); the slot holds segment_bytes.
            unsafe { crate::flavors::engine::copy(src, data, bytes) };
            self.publish(head, h, KIND_INLINE, self.rank, bytes, 0);
        }
        Ok(())
    }

    fn recv(
        &mut self,
        bytes: usize,
        f: &mut dyn FnMut(*const u8),
    ) -> std::result::Result<(), DataError> {
        let prev = self.prev();
        let (data, kind, _, len, addr, h) =
            self.peek(KIND_INLINE, || format!("data from rank {prev}"))?;
        self.check_len(len, bytes)?;
        if let Some(p) = self.in_place(kind, h, addr, bytes)? {
            f(p);
            self.consume();
            return Ok(());
        }
        if kind != KIND_INLINE {
            let mut staging = std::mem::take(&mut self.staging);
            staging.resize(bytes.div_ceil(8), 0);
            let r = self.pull(addr, staging.as_mut_ptr().cast(), bytes);
            self.consume();
            if r.is_ok() {
                f(staging.as_ptr().cast());
            }
            self.staging = staging;
            return r;
        }
        f(data);
        self.consume();
        Ok(())
    }

    unsafe fn recv_copy(
        &mut self,
        dst: *mut u8,
        bytes: usize,
    ) -> std::result::Result<(), DataError> {
        let prev = self.prev();
        let (data, kind, _, len, addr, h) =
            self.peek(KIND_INLINE, || format!("data from rank {prev}"))?;
        self.check_len(len, bytes)?;
        let r = if let Some(p) = self.in_place(kind, h, addr, bytes)? {
            // SAFETY: `p` holds the `bytes` published bytes (checked by `in_place`); `dst` is
            // ours (caller's contract).
            unsafe { crate::flavors::engine::copy(p, dst, bytes) };
            Ok(())
        } else if kind != KIND_INLINE {
            self.pull(addr, dst, bytes)
        } else {
            // SAFETY: the slot holds `bytes` published bytes; `dst` is ours.
            unsafe { crate::flavors::engine::copy(data, dst, bytes) };
            Ok(())
        };
        self.consume();
        r
    }

    fn recv_forward(
        &mut self,
        bytes: usize,
        f: &mut dyn FnMut(*const u8, *mut u8),
    ) -> std::result::Result<(), DataError> {
        let prev = self.prev();
        let (data, kind, _, len, addr, h) =
            self.peek(KIND_INLINE, || format!("data from rank {prev}"))?;
        self.check_len(len, bytes)?;
        let acc: *const u8 = if let Some(p) = self.in_place(kind, h, addr, bytes)? {
            p
        } else if kind != KIND_INLINE {
            let mut staging = std::mem::take(&mut self.staging);
            staging.resize(bytes.div_ceil(8), 0);
            let r = self.pull(addr, staging.as_mut_ptr().cast(), bytes);
            let p = staging.as_ptr().cast();
            self.staging = staging;
            r?;
            p
        } else {
            data
        };
        let (head, h, out) = self.claim()?;
        f(acc, out);
        self.publish(head, h, KIND_INLINE, self.rank, bytes, 0);
        self.consume();
        Ok(())
    }

    fn drain(&mut self) -> std::result::Result<(), DataError> {
        let r = self.rank;
        let head = self.map.head(r).load(Ordering::Relaxed);
        let next = self.next();
        self.wait(
            self.map.tail(r),
            |tail| tail == head,
            Wait::Room,
            || format!("rank {next} to read this rank's data"),
        )
    }

    fn reads_shared_regions(&self) -> bool {
        true
    }

    fn release(&mut self, _grace: Duration) -> bool {
        // A reader of this rank's memory (process_vm_readv) only ever writes its own memory:
        // freeing ours under it cannot corrupt anything of ours.
        true
    }
}
