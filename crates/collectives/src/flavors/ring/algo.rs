//! The ring algorithms, run by each rank's communication-stream thread.
//!
//! Data moves by *pulling*: a rank publishes the address of a segment that is ready (in its input,
//! its output or one of its scratch slots) to its successor, which copies — or reduces — it into
//! memory the successor owns, then acknowledges. A rank therefore writes only its own buffers,
//! and each byte crosses between ranks exactly once (NCCL's P2P-read protocol, on threads).
//!
//! Segments are processed in segment-major order (for each segment: the N-1 ring steps), which
//! pipelines the steps of different segments across ranks so that moving and reducing overlap.
//! Reductions write partial sums into `slots` scratch slots; a slot is reused only after the
//! successor acknowledged reading it. With at least two slots this cannot deadlock: the rank
//! furthest behind can always progress (its predecessor has published what it needs, its
//! successor has consumed all but at most one of its slots).
//!
//! Safety protocol for published addresses (what makes the `unsafe` below sound):
//! 1. An address is published only after the board exchange, i.e. once every rank holds the
//!    access guards of its buffers for this collective, and it points into memory the publisher
//!    does not write again until the successor acknowledged it (inputs are never written; an
//!    output block or a slot is written once before it is published).
//! 2. A rank finishes (and releases its guards) only after every address it published was
//!    acknowledged, or — on failure — after its successor said it released them or left.
//! 3. Channel send/receive gives the happens-before edge between the publisher's writes and the
//!    successor's reads, and between the successor's reads and the acknowledgement.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;
use fsdp_device::Element;

use super::board::{Board, OpDesc};
use super::{Ack, Links, Msg, SendPtr};
pub(crate) use crate::flavors::common::Chunks;
use crate::op::{combine_in_place, combine_into};
use crate::ReduceOp;

/// How often a blocked rank checks whether the group was aborted.
const POLL: Duration = Duration::from_millis(20);

/// Why the data phase failed.
#[derive(Debug)]
pub(crate) enum DataError {
    Timeout { waiting_for: String },
    Departed { peer: usize },
    Aborted { reason: String },
    Protocol { reason: String },
}

/// One rank's view of the ring during one collective.
pub(crate) struct Ctx<'a> {
    pub rank: usize,
    pub world: usize,
    pub seq: u64,
    pub deadline: Instant,
    pub board: &'a Board,
    pub links: &'a Links,
    /// Scratch slots: `num_slots` slots of `slot_bytes` each.
    pub scratch: *mut u8,
    pub slot_bytes: usize,
    pub num_slots: usize,
    /// What every rank issued (from the board exchange).
    descs: Vec<OpDesc>,
    /// For each published, unacknowledged message: whether it occupies a slot.
    outstanding: VecDeque<bool>,
    free_slots: usize,
    next_slot: usize,
}

impl<'a> Ctx<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rank: usize,
        world: usize,
        seq: u64,
        timeout: Duration,
        board: &'a Board,
        links: &'a Links,
        scratch: *mut u8,
        slot_bytes: usize,
        num_slots: usize,
        descs: Vec<OpDesc>,
    ) -> Ctx<'a> {
        Ctx {
            rank,
            world,
            seq,
            deadline: Instant::now() + timeout,
            board,
            links,
            scratch,
            slot_bytes,
            num_slots,
            descs,
            outstanding: VecDeque::new(),
            free_slots: num_slots,
            next_slot: 0,
        }
    }

    /// What every rank issued for this collective, by rank.
    pub fn exchanged_descs(&self) -> &[OpDesc] {
        &self.descs
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    /// A peer's endpoint is gone: report the abort that made it leave, if there was one.
    fn departed(&self, peer: usize) -> DataError {
        match self.board.aborted() {
            Some(reason) => DataError::Aborted { reason },
            None => DataError::Departed { peer },
        }
    }

    fn check_abort(&self, waiting_for: impl FnOnce() -> String) -> Result<(), DataError> {
        if let Some(reason) = self.board.aborted() {
            return Err(DataError::Aborted { reason });
        }
        if Instant::now() >= self.deadline {
            return Err(DataError::Timeout {
                waiting_for: waiting_for(),
            });
        }
        Ok(())
    }

    /// Publish `bytes` at `ptr` to the successor.
    fn send(&mut self, ptr: *const u8, bytes: usize, uses_slot: bool) -> Result<(), DataError> {
        let msg = Msg {
            seq: self.seq,
            ptr: SendPtr(ptr),
            bytes,
        };
        self.links
            .to_next
            .send(msg)
            .map_err(|_| self.departed(self.next()))?;
        self.outstanding.push_back(uses_slot);
        Ok(())
    }

    /// The next segment published by the predecessor: (address, bytes).
    fn recv(&mut self, expect_bytes: usize) -> Result<*const u8, DataError> {
        loop {
            let wait = POLL.min(self.deadline.saturating_duration_since(Instant::now()));
            match self.links.from_prev.recv_timeout(wait) {
                Ok(msg) => {
                    if msg.seq != self.seq || msg.bytes != expect_bytes {
                        return Err(DataError::Protocol {
                            reason: format!(
                                "expected {expect_bytes} bytes of collective #{} from rank {}, \
                                 got {} bytes of #{}",
                                self.seq,
                                self.prev(),
                                msg.bytes,
                                msg.seq
                            ),
                        });
                    }
                    return Ok(msg.ptr.0);
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.departed(self.prev())),
                Err(RecvTimeoutError::Timeout) => {
                    let prev = self.prev();
                    self.check_abort(|| format!("data from rank {prev}"))?
                }
            }
        }
    }

    /// Tell the predecessor its last segment has been read.
    fn ack_prev(&self) -> Result<(), DataError> {
        self.links
            .ack_to_prev
            .send(Ack::Done(self.seq))
            .map_err(|_| self.departed(self.prev()))
    }

    /// Wait for one acknowledgement from the successor.
    fn recv_ack(&mut self) -> Result<(), DataError> {
        loop {
            let wait = POLL.min(self.deadline.saturating_duration_since(Instant::now()));
            match self.links.acks_from_next.recv_timeout(wait) {
                Ok(Ack::Done(_)) => {
                    if let Some(true) = self.outstanding.pop_front() {
                        self.free_slots += 1;
                    }
                    return Ok(());
                }
                Ok(Ack::Released(_)) => {
                    return Err(DataError::Aborted {
                        reason: format!("rank {} gave up on collective #{}", self.next(), self.seq),
                    })
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.departed(self.next())),
                Err(RecvTimeoutError::Timeout) => {
                    let next = self.next();
                    self.check_abort(|| format!("rank {next} to read this rank's data"))?
                }
            }
        }
    }

    /// A free scratch slot (waiting for the successor to release one if needed).
    fn acquire_slot(&mut self) -> Result<*mut u8, DataError> {
        while self.free_slots == 0 {
            self.recv_ack()?;
        }
        self.free_slots -= 1;
        let slot = self.next_slot;
        self.next_slot = (self.next_slot + 1) % self.num_slots;
        Ok(self.scratch.wrapping_add(slot * self.slot_bytes))
    }

    /// Wait until the successor acknowledged everything this rank published.
    pub fn drain(&mut self) -> Result<(), DataError> {
        while !self.outstanding.is_empty() {
            self.recv_ack()?;
        }
        Ok(())
    }

    /// After a failure: tell the predecessor this rank no longer reads its memory, then wait until
    /// the successor no longer reads ours. Returns false if that could not be established within
    /// the timeout (the caller must then leak its buffers rather than free them).
    pub fn release(&mut self, grace: Duration) -> bool {
        let _ = self.links.ack_to_prev.send(Ack::Released(self.seq));
        let deadline = Instant::now() + grace;
        while !self.outstanding.is_empty() {
            let wait = deadline.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                return false;
            }
            match self.links.acks_from_next.recv_timeout(wait) {
                Ok(Ack::Done(_)) => {
                    self.outstanding.pop_front();
                }
                Ok(Ack::Released(_)) | Err(RecvTimeoutError::Disconnected) => return true,
                Err(RecvTimeoutError::Timeout) => return false,
            }
        }
        true
    }
}

impl Ctx<'_> {
    /// One receiving step of a copy (all-gather, broadcast): copy the predecessor's next
    /// segment into `dst`, publish `dst` to the successor if `forward`, acknowledge.
    ///
    /// # Safety
    /// `dst` must be this rank's own memory, valid for `bytes` bytes under its guard, not
    /// published before this call and not written again during the collective once forwarded.
    unsafe fn recv_copy(
        &mut self,
        dst: *mut u8,
        bytes: usize,
        forward: bool,
    ) -> Result<(), DataError> {
        let p = self.recv(bytes)?;
        // SAFETY: `p` was published by the predecessor for exactly these bytes and stays
        // unwritten until we acknowledge; `dst` is ours and unpublished (caller's contract).
        unsafe { copy(p, dst, bytes) };
        if forward {
            self.send(dst, bytes, false)?;
        }
        self.ack_prev()
    }

    /// One receiving step of a reduction (reduce-scatter, reduce): combine the predecessor's
    /// next partial with `len` elements of this rank's `mine`, either into a free scratch slot
    /// that is then published (`last == None`), or — the last step — into `last.0` followed by
    /// the final step over `last.1` ranks; then acknowledge.
    ///
    /// # Safety
    /// `mine` must hold `len` elements this rank only reads during the collective, or exactly
    /// coincide with `last.0`; `last.0` must be this rank's own, never-published memory valid
    /// for `len` elements.
    unsafe fn recv_reduce<T: Element>(
        &mut self,
        op: ReduceOp,
        mine: *const u8,
        len: usize,
        last: Option<(*mut u8, usize)>,
    ) -> Result<(), DataError> {
        let bytes = len * std::mem::size_of::<T>();
        let p = self.recv(bytes)?;
        // SAFETY: the predecessor published `len` elements at `p` and leaves them unwritten
        // until acknowledged; T-aligned because every segment offset is a whole number of
        // elements from an aligned base.
        let acc = unsafe { std::slice::from_raw_parts(p as *const T, len) };
        match last {
            None => {
                let slot = self.acquire_slot()?;
                // SAFETY: the slot is ours and acknowledged by the successor (not being read);
                // `mine` is only read (caller's contract).
                unsafe {
                    let dst = std::slice::from_raw_parts_mut(slot as *mut T, len);
                    let mine = std::slice::from_raw_parts(mine as *const T, len);
                    combine_into(op, dst, acc, mine, None);
                }
                self.send(slot, bytes, true)?;
            }
            Some((dst_ptr, n)) => {
                // SAFETY: this rank's own segment, never published during this collective; in
                // place it coincides with `mine` exactly (caller's contract).
                unsafe {
                    let dst = std::slice::from_raw_parts_mut(dst_ptr as *mut T, len);
                    if std::ptr::eq(dst_ptr, mine) {
                        combine_in_place(op, dst, acc, Some(n));
                    } else {
                        let mine = std::slice::from_raw_parts(mine as *const T, len);
                        combine_into(op, dst, acc, mine, Some(n));
                    }
                }
            }
        }
        self.ack_prev()
    }
}

/// Copy `bytes` from `src` to `dst`.
///
/// # Safety
/// `src` must be readable and `dst` writable for `bytes` bytes, without overlap, and nothing may
/// write `src` or access `dst` concurrently.
unsafe fn copy(src: *const u8, dst: *mut u8, bytes: usize) {
    if bytes > 0 && !std::ptr::eq(src, dst) {
        // SAFETY: guaranteed by the caller.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) }
    }
}

/// Ring all-gather: block `c` of the output (at `chunks.start(c)`) receives rank `c`'s block.
/// This rank's block is read from `own` (which may be the output block itself).
///
/// # Safety
/// `own` must hold this rank's block and `out` the whole output, both valid under guards held
/// for the whole call per the module's protocol; `own` is either disjoint from `out` or exactly
/// this rank's block of it.
pub(crate) unsafe fn all_gather<T: Element>(
    ctx: &mut Ctx<'_>,
    own: *const u8,
    out: *mut u8,
    chunks: &Chunks,
) -> Result<(), DataError> {
    let (n, r) = (ctx.world, ctx.rank);
    let esz = std::mem::size_of::<T>();
    let at = |c: usize, off: usize| out.wrapping_add((chunks.start(c) + off) * esz);
    for g in 0..chunks.num_segs {
        let (off, len) = chunks.seg(r, g);
        let src = own.wrapping_add(off * esz);
        if n > 1 {
            ctx.send(src, len * esz, false)?;
        }
        // SAFETY: own block and its output place are valid for len elements; the output block of
        // this rank is written only here and read by the successor only after it is published
        // below (it is not published: the successor reads `own`), so no one else touches it.
        unsafe { copy(src, at(r, off), len * esz) };
        for s in 0..n - 1 {
            let b = (r + n - s - 1) % n;
            let (off, len) = chunks.seg(b, g);
            // SAFETY: block `b` of this rank's output, written once here, then only read.
            unsafe { ctx.recv_copy(at(b, off), len * esz, s + 2 < n)? };
        }
    }
    ctx.drain()
}

/// Ring reduce-scatter: chunk `c` of `input` is reduced over all ranks; this rank's chunk lands
/// in `own_out` (which may be its chunk of `input`, for in-place operation).
///
/// # Safety
/// As for [`all_gather`]; `input` holds every chunk, `own_out` has room for this rank's chunk.
pub(crate) unsafe fn reduce_scatter<T: Element>(
    ctx: &mut Ctx<'_>,
    op: ReduceOp,
    input: *mut u8,
    own_out: *mut u8,
    chunks: &Chunks,
) -> Result<(), DataError> {
    let (n, r) = (ctx.world, ctx.rank);
    let esz = std::mem::size_of::<T>();
    let at = |c: usize, off: usize| input.wrapping_add((chunks.start(c) + off) * esz);
    if n == 1 {
        let (_, len) = (0, chunks.lens[0]);
        // SAFETY: the single chunk is the whole input; own_out has room for it.
        unsafe { copy(input, own_out, len * esz) };
        return Ok(());
    }
    for g in 0..chunks.num_segs {
        let c0 = (r + n - 1) % n;
        let (off, len) = chunks.seg(c0, g);
        ctx.send(at(c0, off), len * esz, false)?;
        for s in 0..n - 1 {
            let c = (r + 2 * n - s - 2) % n;
            let (off, len) = chunks.seg(c, g);
            let last = (s + 2 == n).then(|| (own_out.wrapping_add(off * esz), n));
            // SAFETY: our input chunk is only read (or, in place, is exactly the output
            // segment); the output segment is ours and never published.
            unsafe { ctx.recv_reduce::<T>(op, at(c, off), len, last)? };
        }
    }
    ctx.drain()
}

/// Pipelined chain broadcast from `root` along the ring.
///
/// # Safety
/// `buf` valid for `total` elements under this rank's guard for the whole call.
pub(crate) unsafe fn broadcast<T: Element>(
    ctx: &mut Ctx<'_>,
    buf: *mut u8,
    total: usize,
    root: usize,
    seg: usize,
) -> Result<(), DataError> {
    let (n, r) = (ctx.world, ctx.rank);
    let esz = std::mem::size_of::<T>();
    let pos = (r + n - root) % n;
    let chunks = Chunks::whole(total, seg);
    for g in 0..chunks.num_segs {
        let (off, len) = chunks.seg(0, g);
        let at = buf.wrapping_add(off * esz);
        if pos == 0 {
            if n > 1 {
                ctx.send(at, len * esz, false)?;
            }
        } else {
            // SAFETY: this rank's own buffer segment, written once here, then only read.
            unsafe { ctx.recv_copy(at, len * esz, pos + 1 < n)? };
        }
    }
    ctx.drain()
}

/// Pipelined chain reduce into `root`: the chain starts at `root + 1` and ends at `root`.
///
/// # Safety
/// `buf` valid for `total` elements under this rank's guard for the whole call.
pub(crate) unsafe fn reduce<T: Element>(
    ctx: &mut Ctx<'_>,
    op: ReduceOp,
    buf: *mut u8,
    total: usize,
    root: usize,
    seg: usize,
) -> Result<(), DataError> {
    let (n, r) = (ctx.world, ctx.rank);
    let esz = std::mem::size_of::<T>();
    let pos = (r + n - root - 1) % n;
    let chunks = Chunks::whole(total, seg);
    for g in 0..chunks.num_segs {
        let (off, len) = chunks.seg(0, g);
        let mine_ptr = buf.wrapping_add(off * esz);
        if pos == 0 {
            if n > 1 {
                ctx.send(mine_ptr, len * esz, false)?;
            }
            continue;
        }
        let last = (pos + 1 == n).then_some((mine_ptr, n));
        // SAFETY: non-root ranks only read their buffer; the root's is its own, never published.
        unsafe { ctx.recv_reduce::<T>(op, mine_ptr, len, last)? };
    }
    ctx.drain()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_chunks_cover_everything() {
        let c = Chunks::balanced(3, 10, 2);
        assert_eq!(c.lens, vec![3, 3, 4]);
        assert_eq!(c.starts, vec![0, 3, 6]);
        assert_eq!(c.num_segs, 2);
        assert_eq!(c.seg(0, 1), (2, 1));
        assert_eq!(c.seg(2, 1), (2, 2));
        let e = Chunks::equal(2, 0, 4);
        assert_eq!(e.num_segs, 0);
    }
}
