//! The ring algorithms on the host: the [`schedule`](super::schedule)s run over a
//! [`Transport`] with the host reduction kernels.
//!
//! Every reduction has one order: the partial of chunk `c` starts at rank `c + 1` and travels the
//! ring, each rank computing `received ⊕ own` with the same kernels, the owner of the chunk
//! applying the final step. Results are therefore bitwise identical over every transport.

use fsdp_device::Element;

pub(crate) use super::chunks::Chunks;
use super::schedule::{self, Step};
use super::{copy, Ctx, DataError, Transport};
use crate::op::{combine_in_place, combine_into};
use crate::ReduceOp;

/// The final step of a reduction chain: combine the received partial `acc` with `mine` into
/// `dst` with the final step over `n` ranks (in place when `dst` is `mine`).
///
/// # Safety
/// `acc` readable for `len` elements of `T`, aligned; `dst` this rank's own memory writable for
/// `len` elements; `mine` readable for `len` elements and, unless equal to `dst`, not written.
unsafe fn finish<T: Element>(
    op: ReduceOp,
    acc: *const u8,
    mine: *const u8,
    dst: *mut u8,
    len: usize,
    n: usize,
) {
    if len == 0 {
        return;
    }
    // SAFETY: guaranteed by the caller.
    unsafe {
        let acc = std::slice::from_raw_parts(acc.cast::<T>(), len);
        let d = std::slice::from_raw_parts_mut(dst.cast::<T>(), len);
        if std::ptr::eq(dst.cast_const(), mine) {
            combine_in_place(op, d, acc, Some(n));
        } else {
            let mine = std::slice::from_raw_parts(mine.cast::<T>(), len);
            combine_into(op, d, acc, mine, Some(n));
        }
    }
}

/// One reducing step of a chain: receive a partial, combine it with `mine` and send it on.
///
/// # Safety
/// `mine` readable for `len` elements and not written during the collective.
unsafe fn reduce_forward<T: Element>(
    t: &mut dyn Transport,
    op: ReduceOp,
    mine: *const u8,
    len: usize,
) -> Result<(), DataError> {
    let bytes = len * std::mem::size_of::<T>();
    t.recv_forward(bytes, &mut |acc, dst| {
        if len == 0 {
            return;
        }
        // SAFETY: the transport gives `len` received, aligned elements at `acc` and room for
        // `len` at `dst`; `mine` is only read (caller's contract).
        unsafe {
            let acc = std::slice::from_raw_parts(acc.cast::<T>(), len);
            let dst = std::slice::from_raw_parts_mut(dst.cast::<T>(), len);
            let mine = std::slice::from_raw_parts(mine.cast::<T>(), len);
            combine_into(op, dst, acc, mine, None);
        }
    })
}

/// A step that the schedule of this collective never yields.
fn foreign(what: &str) -> DataError {
    DataError::Protocol {
        reason: format!("schedule error: {what}"),
    }
}

/// Ring all-gather: block `c` of the output (at `chunks.start(c)`) receives rank `c`'s block.
/// This rank's block is read from `own` (which may be the output block itself).
///
/// # Safety
/// `own` must hold this rank's block and `out` the whole output, both valid under guards held
/// for the whole call; `own` is either disjoint from `out` or exactly this rank's block of it.
pub(crate) unsafe fn all_gather<T: Element>(
    t: &mut dyn Transport,
    ctx: Ctx,
    own: *const u8,
    out: *mut u8,
    chunks: &Chunks,
) -> Result<(), DataError> {
    let (n, r) = (ctx.world, ctx.rank);
    let esz = std::mem::size_of::<T>();
    let at = |c: usize, off: usize| out.wrapping_add((chunks.start(c) + off) * esz);
    for step in schedule::all_gather(n, r, chunks) {
        match step {
            // SAFETY: this rank's block, never written during the call.
            Step::Send { off, len, .. } => unsafe {
                t.send(own.wrapping_add(off * esz), len * esz)?
            },
            // SAFETY: own block and its output place are valid for len elements; the output
            // block of this rank is written only here (the successor reads `own`, not this
            // copy).
            Step::CopyOwn { off, len } => unsafe {
                copy(own.wrapping_add(off * esz), at(r, off), len * esz)
            },
            Step::RecvCopy {
                chunk,
                off,
                len,
                forward,
            } => {
                let dst = at(chunk, off);
                // SAFETY: block `chunk` of this rank's output, written once here, then only
                // read.
                unsafe {
                    t.recv_copy(dst, len * esz)?;
                    if forward {
                        t.send(dst, len * esz)?;
                    }
                }
            }
            Step::RecvReduce { .. } => return Err(foreign("all-gather does not reduce")),
        }
    }
    t.drain()
}

/// Ring reduce-scatter: chunk `c` of `input` is reduced over all ranks; this rank's chunk lands
/// in `own_out` (which may be its chunk of `input`, for in-place operation).
///
/// # Safety
/// As for [`all_gather`]; `input` holds every chunk, `own_out` has room for this rank's chunk.
pub(crate) unsafe fn reduce_scatter<T: Element>(
    t: &mut dyn Transport,
    ctx: Ctx,
    op: ReduceOp,
    input: *mut u8,
    own_out: *mut u8,
    chunks: &Chunks,
) -> Result<(), DataError> {
    let (n, r) = (ctx.world, ctx.rank);
    let esz = std::mem::size_of::<T>();
    let at = |c: usize, off: usize| input.wrapping_add((chunks.start(c) + off) * esz);
    for step in schedule::reduce_scatter(n, r, chunks) {
        match step {
            // SAFETY: our input chunk, only read.
            Step::Send { chunk, off, len } => unsafe { t.send(at(chunk, off), len * esz)? },
            // SAFETY: a group of one: the single chunk of the input into own_out, which has
            // room for it.
            Step::CopyOwn { off, len } => unsafe {
                copy(at(r, off), own_out.wrapping_add(off * esz), len * esz)
            },
            Step::RecvReduce {
                chunk,
                off,
                len,
                last,
            } => {
                let mine = at(chunk, off);
                if last {
                    let dst = own_out.wrapping_add(off * esz);
                    // SAFETY: the output segment is ours and never sent; in place it is
                    // exactly `mine`.
                    t.recv(len * esz, &mut |acc| unsafe {
                        finish::<T>(op, acc, mine, dst, len, n)
                    })?;
                } else {
                    // SAFETY: our input chunk is only read.
                    unsafe { reduce_forward::<T>(t, op, mine, len)? };
                }
            }
            Step::RecvCopy { .. } => return Err(foreign("reduce-scatter does not copy")),
        }
    }
    if n > 1 {
        t.drain()
    } else {
        Ok(())
    }
}

/// Pipelined chain broadcast from `root` along the ring.
///
/// # Safety
/// `buf` valid for `total` elements under this rank's guard for the whole call (only read on the
/// root).
pub(crate) unsafe fn broadcast<T: Element>(
    t: &mut dyn Transport,
    ctx: Ctx,
    buf: *mut u8,
    total: usize,
    root: usize,
    seg: usize,
) -> Result<(), DataError> {
    let esz = std::mem::size_of::<T>();
    for step in schedule::broadcast(ctx.world, ctx.rank, root, total, seg) {
        match step {
            // SAFETY: the root only reads its buffer.
            Step::Send { off, len, .. } => unsafe {
                t.send(buf.wrapping_add(off * esz), len * esz)?
            },
            Step::RecvCopy {
                off, len, forward, ..
            } => {
                let at = buf.wrapping_add(off * esz);
                // SAFETY: a non-root rank writes each segment of its buffer once, here, before
                // sending it on.
                unsafe {
                    t.recv_copy(at, len * esz)?;
                    if forward {
                        t.send(at, len * esz)?;
                    }
                }
            }
            Step::CopyOwn { .. } | Step::RecvReduce { .. } => {
                return Err(foreign("broadcast only sends and copies"))
            }
        }
    }
    t.drain()
}

/// Pipelined chain reduce into `root`: the chain starts at `root + 1` and ends at `root`.
///
/// # Safety
/// `buf` valid for `total` elements under this rank's guard for the whole call (only written on
/// the root).
pub(crate) unsafe fn reduce<T: Element>(
    t: &mut dyn Transport,
    ctx: Ctx,
    op: ReduceOp,
    buf: *mut u8,
    total: usize,
    root: usize,
    seg: usize,
) -> Result<(), DataError> {
    let (n, esz) = (ctx.world, std::mem::size_of::<T>());
    for step in schedule::reduce(n, ctx.rank, root, total, seg) {
        match step {
            // SAFETY: a non-root rank's buffer, only read.
            Step::Send { off, len, .. } => unsafe {
                t.send(buf.wrapping_add(off * esz), len * esz)?
            },
            Step::RecvReduce { off, len, last, .. } => {
                let mine = buf.wrapping_add(off * esz);
                if last {
                    // SAFETY: the root's own buffer, never sent.
                    t.recv(len * esz, &mut |acc| unsafe {
                        finish::<T>(op, acc, mine, mine, len, n)
                    })?;
                } else {
                    // SAFETY: a non-root rank's buffer, only read.
                    unsafe { reduce_forward::<T>(t, op, mine, len)? };
                }
            }
            Step::CopyOwn { .. } | Step::RecvCopy { .. } => {
                return Err(foreign("reduce only sends and reduces"))
            }
        }
    }
    t.drain()
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
