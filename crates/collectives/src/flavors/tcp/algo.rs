//! The ring algorithms over sockets, run by each rank's communication-stream thread.
//!
//! They are the ring backend's algorithms step for step — same chunks, same segment-major order,
//! and above all the same reduction order: the partial of chunk `c` starts at rank `c + 1` and
//! travels the ring, each rank computing `received ⊕ own` with the same kernels, the owner of the
//! chunk applying the final step. Results are therefore bitwise identical to the ring backend's.
//! The difference is that segments are copied through the sockets instead of read in place.

use std::time::Instant;

use fsdp_device::Element;

use super::link::{Links, RecvFail, SendFail};
use super::wire::{Header, Payload, KIND_DATA, KIND_DESC};
use crate::flavors::common::{Chunks, OpDesc};
use crate::op::{combine_in_place, combine_into};
use crate::ReduceOp;

/// Why the data phase (or the description exchange) failed.
#[derive(Debug)]
pub(crate) enum DataError {
    Timeout { waiting_for: String },
    Departed { peer: usize, why: String },
    Aborted { reason: String },
    Protocol { reason: String },
}

/// One rank's view of the ring during one collective.
pub(crate) struct Ctx<'a> {
    pub rank: usize,
    pub world: usize,
    pub seq: u64,
    pub deadline: Instant,
    links: Option<&'a Links>,
}

impl<'a> Ctx<'a> {
    pub fn new(
        rank: usize,
        world: usize,
        seq: u64,
        deadline: Instant,
        links: Option<&'a Links>,
    ) -> Ctx<'a> {
        Ctx {
            rank,
            world,
            seq,
            deadline,
            links,
        }
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn links(&self) -> Result<&'a Links, DataError> {
        self.links.ok_or_else(|| DataError::Protocol {
            reason: "a group of one rank has no peers to talk to".into(),
        })
    }

    fn send_frame(&self, kind: u8, origin: usize, bytes: &[u8]) -> Result<(), DataError> {
        let header = Header {
            kind,
            seq: self.seq,
            origin: origin as u32,
            len: bytes.len() as u64,
        };
        let links = self.links()?;
        // A peer's abort notice may be waiting: report it rather than what it caused here.
        if let Some(reason) = links.aborted() {
            return Err(DataError::Aborted { reason });
        }
        links
            .out()
            .send(&header, bytes, self.deadline)
            .map_err(|f| match f {
                SendFail::NoTime => DataError::Timeout {
                    waiting_for: format!(
                        "time to send to rank {}: the collective's time ran out before",
                        self.next()
                    ),
                },
                SendFail::Timeout => DataError::Timeout {
                    waiting_for: format!(
                        "rank {} to take this rank's data (its socket stayed full)",
                        self.next()
                    ),
                },
                SendFail::Departed(why) => DataError::Departed {
                    peer: self.next(),
                    why,
                },
            })
    }

    fn recv_frame(
        &self,
        kind: u8,
        waiting_for: impl FnOnce() -> String,
    ) -> Result<(Header, Payload), DataError> {
        let (h, p) = self.links()?.recv(self.deadline).map_err(|f| match f {
            RecvFail::Timeout => match self.links.and_then(Links::aborted) {
                Some(reason) => DataError::Aborted { reason },
                None => DataError::Timeout {
                    waiting_for: waiting_for(),
                },
            },
            RecvFail::Closed(why) => DataError::Departed {
                peer: self.prev(),
                why,
            },
            RecvFail::Aborted(reason) => DataError::Aborted { reason },
        })?;
        if h.kind != kind || h.seq != self.seq {
            return Err(DataError::Protocol {
                reason: format!(
                    "expected a {} frame of collective #{} from rank {}, got a {} frame of #{}",
                    kind_name(kind),
                    self.seq,
                    self.prev(),
                    kind_name(h.kind),
                    h.seq
                ),
            });
        }
        Ok((h, p))
    }

    /// Send a segment to the successor.
    fn send(&self, bytes: &[u8]) -> Result<(), DataError> {
        self.send_frame(KIND_DATA, self.rank, bytes)
    }

    /// The predecessor's next segment, which must be `expect` bytes long.
    fn recv(&self, expect: usize) -> Result<Payload, DataError> {
        let prev = self.prev();
        let (_, p) = self.recv_frame(KIND_DATA, || format!("data from rank {prev}"))?;
        if p.len() != expect {
            return Err(DataError::Protocol {
                reason: format!(
                    "expected {expect} bytes of collective #{} from rank {prev}, got {}",
                    self.seq,
                    p.len()
                ),
            });
        }
        Ok(p)
    }

    /// Pass every rank's description around the ring; returns them by rank. Each rank sends its
    /// own before waiting for any, so a rank that never arrives is the one every waiting rank
    /// misses first.
    pub fn exchange(&self, own: &OpDesc) -> Result<Vec<OpDesc>, DataError> {
        let (n, r) = (self.world, self.rank);
        let mut descs: Vec<Option<OpDesc>> = vec![None; n];
        descs[r] = Some(own.clone());
        if n > 1 {
            self.send_frame(KIND_DESC, r, &super::wire::encode_desc(own))?;
        }
        for s in 1..n {
            let origin = (r + n - s) % n;
            let (h, p) = self.recv_frame(KIND_DESC, || {
                format!("rank [{origin}] did not reach this collective")
            })?;
            if h.origin as usize != origin {
                return Err(DataError::Protocol {
                    reason: format!(
                        "expected the description of rank {origin}, got one of rank {}",
                        h.origin
                    ),
                });
            }
            let d =
                super::wire::decode_desc(p.as_bytes()).map_err(|reason| DataError::Protocol {
                    reason: format!("description of rank {origin}: {reason}"),
                })?;
            descs[origin] = Some(d);
            if s + 1 < n {
                self.send_frame(KIND_DESC, origin, p.as_bytes())?;
            }
        }
        Ok(descs.into_iter().map(|d| d.expect("filled")).collect())
    }
}

fn kind_name(kind: u8) -> &'static str {
    match kind {
        KIND_DATA => "data",
        KIND_DESC => "description",
        super::wire::KIND_ABORT => "abort",
        _ => "unknown",
    }
}

/// `bytes` bytes at `p`.
///
/// # Safety
/// `p` must be valid for reads of `bytes` bytes for `'a`, with no concurrent writer.
unsafe fn bytes_at<'a>(p: *const u8, bytes: usize) -> &'a [u8] {
    if bytes == 0 {
        return &[];
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts(p, bytes) }
}

/// Copy `src` to `dst` (nothing if they are the same place).
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes, not overlapping `src` unless equal, with
/// no concurrent access.
unsafe fn copy_to(src: &[u8], dst: *mut u8) {
    if !src.is_empty() && !std::ptr::eq(src.as_ptr(), dst) {
        // SAFETY: guaranteed by the caller.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
    }
}

/// Combine a received partial with this rank's `mine`: into `tmp` and send it on (`last ==
/// None`), or — the last step of the chain — into `last.0` with the final step over `last.1`
/// ranks.
///
/// # Safety
/// `mine` must be valid for reads of `acc.len()` elements and, unless it is exactly `last.0`, not
/// written during the call; `last.0` must be valid for writes of `acc.len()` elements and owned
/// by this rank.
unsafe fn reduce_step<T: Element>(
    ctx: &Ctx<'_>,
    op: ReduceOp,
    acc: &[T],
    mine: *const u8,
    tmp: &mut Vec<T>,
    last: Option<(*mut u8, usize)>,
) -> Result<(), DataError> {
    let len = acc.len();
    match last {
        None => {
            tmp.clear();
            tmp.resize(len, T::default());
            // SAFETY: `mine` is readable for len elements and not written (caller's contract);
            // its alignment is T's (every offset is a whole number of elements from an aligned
            // buffer start).
            let mine = unsafe { std::slice::from_raw_parts(mine.cast::<T>(), len) };
            combine_into(op, tmp, acc, mine, None);
            // SAFETY: tmp holds len initialised elements; T is plain old data.
            let bytes = unsafe {
                std::slice::from_raw_parts(tmp.as_ptr().cast::<u8>(), std::mem::size_of_val(&**tmp))
            };
            ctx.send(bytes)
        }
        Some((dst_ptr, n)) => {
            if len == 0 {
                return Ok(());
            }
            // SAFETY: this rank's own memory, valid for len elements (caller's contract); in
            // place it coincides exactly with `mine`, which is then not read separately.
            unsafe {
                let dst = std::slice::from_raw_parts_mut(dst_ptr.cast::<T>(), len);
                if std::ptr::eq(dst_ptr.cast_const(), mine) {
                    combine_in_place(op, dst, acc, Some(n));
                } else {
                    let mine = std::slice::from_raw_parts(mine.cast::<T>(), len);
                    combine_into(op, dst, acc, mine, Some(n));
                }
            }
            Ok(())
        }
    }
}

/// Ring all-gather: block `c` of the output receives rank `c`'s block; this rank's block is read
/// from `own` (which may be the output block itself).
///
/// # Safety
/// `own` must hold this rank's block and `out` the whole output, valid under this rank's guards
/// for the whole call; `own` is either disjoint from `out` or exactly this rank's block of it.
pub(crate) unsafe fn all_gather<T: Element>(
    ctx: &Ctx<'_>,
    own: *const u8,
    out: *mut u8,
    chunks: &Chunks,
) -> Result<(), DataError> {
    let (n, r) = (ctx.world, ctx.rank);
    let esz = std::mem::size_of::<T>();
    let at = |c: usize, off: usize| out.wrapping_add((chunks.start(c) + off) * esz);
    for g in 0..chunks.num_segs {
        let (off, len) = chunks.seg(r, g);
        // SAFETY: this rank's block, readable for len elements (caller's contract).
        let src = unsafe { bytes_at(own.wrapping_add(off * esz), len * esz) };
        if n > 1 {
            ctx.send(src)?;
        }
        // SAFETY: this rank's output block, written only here.
        unsafe { copy_to(src, at(r, off)) };
        for s in 0..n - 1 {
            let b = (r + n - s - 1) % n;
            let (off, len) = chunks.seg(b, g);
            let p = ctx.recv(len * esz)?;
            // SAFETY: block b of this rank's output, exclusively ours; p is a private copy.
            unsafe { copy_to(p.as_bytes(), at(b, off)) };
            if s + 2 < n {
                ctx.send(p.as_bytes())?;
            }
        }
    }
    Ok(())
}

/// Ring reduce-scatter: chunk `c` of `input` is reduced over all ranks; this rank's chunk lands
/// in `own_out` (which may be its chunk of `input`).
///
/// # Safety
/// As for [`all_gather`]; `input` holds every chunk, `own_out` has room for this rank's chunk.
pub(crate) unsafe fn reduce_scatter<T: Element>(
    ctx: &Ctx<'_>,
    op: ReduceOp,
    input: *mut u8,
    own_out: *mut u8,
    chunks: &Chunks,
) -> Result<(), DataError> {
    let (n, r) = (ctx.world, ctx.rank);
    let esz = std::mem::size_of::<T>();
    let at = |c: usize, off: usize| input.wrapping_add((chunks.start(c) + off) * esz);
    if n == 1 {
        // SAFETY: the single chunk is the whole input; own_out has room for it.
        unsafe { copy_to(bytes_at(input, chunks.lens[0] * esz), own_out) };
        return Ok(());
    }
    let mut tmp = Vec::new();
    for g in 0..chunks.num_segs {
        let c0 = (r + n - 1) % n;
        let (off, len) = chunks.seg(c0, g);
        // SAFETY: our input chunk c0, only read.
        ctx.send(unsafe { bytes_at(at(c0, off), len * esz) })?;
        for s in 0..n - 1 {
            let c = (r + 2 * n - s - 2) % n;
            let (off, len) = chunks.seg(c, g);
            let p = ctx.recv(len * esz)?;
            let last = (s + 2 == n).then(|| (own_out.wrapping_add(off * esz), n));
            // SAFETY: our input chunk is only read (or, in place, is exactly the output
            // segment); the output segment is ours.
            unsafe { reduce_step::<T>(ctx, op, p.as_elems::<T>(), at(c, off), &mut tmp, last)? };
        }
    }
    Ok(())
}

/// Pipelined chain broadcast from `root` along the ring.
///
/// # Safety
/// `buf` valid for `total` elements under this rank's guard for the whole call (only read on the
/// root).
pub(crate) unsafe fn broadcast<T: Element>(
    ctx: &Ctx<'_>,
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
                // SAFETY: the root's buffer, only read.
                ctx.send(unsafe { bytes_at(at, len * esz) })?;
            }
        } else {
            let p = ctx.recv(len * esz)?;
            // SAFETY: this rank's own buffer segment.
            unsafe { copy_to(p.as_bytes(), at) };
            if pos + 1 < n {
                ctx.send(p.as_bytes())?;
            }
        }
    }
    Ok(())
}

/// Pipelined chain reduce into `root`: the chain starts at `root + 1` and ends at `root`.
///
/// # Safety
/// `buf` valid for `total` elements under this rank's guard for the whole call (only written on
/// the root).
pub(crate) unsafe fn reduce<T: Element>(
    ctx: &Ctx<'_>,
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
    let mut tmp = Vec::new();
    for g in 0..chunks.num_segs {
        let (off, len) = chunks.seg(0, g);
        let mine = buf.wrapping_add(off * esz);
        if pos == 0 {
            if n > 1 {
                // SAFETY: a non-root rank's buffer, only read.
                ctx.send(unsafe { bytes_at(mine, len * esz) })?;
            }
            continue;
        }
        let p = ctx.recv(len * esz)?;
        let last = (pos + 1 == n).then_some((mine, n));
        // SAFETY: non-root ranks only read their buffer; the root's is its own.
        unsafe { reduce_step::<T>(ctx, op, p.as_elems::<T>(), mine, &mut tmp, last)? };
    }
    Ok(())
}
