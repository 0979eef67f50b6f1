//! The ring algorithms, written once over a [`Transport`].
//!
//! Segments are processed in segment-major order (for each segment: the N-1 ring steps), which
//! pipelines the steps of different segments across ranks so that moving and reducing overlap.
//! Every reduction has one order: the partial of chunk `c` starts at rank `c + 1` and travels the
//! ring, each rank computing `received ⊕ own` with the same kernels, the owner of the chunk
//! applying the final step. Results are therefore bitwise identical over every transport.

use fsdp_device::Element;

pub(crate) use super::chunks::Chunks;
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
    for g in 0..chunks.num_segs {
        let (off, len) = chunks.seg(r, g);
        let src = own.wrapping_add(off * esz);
        if n > 1 {
            // SAFETY: this rank's block, never written during the call.
            unsafe { t.send(src, len * esz)? };
        }
        // SAFETY: own block and its output place are valid for len elements; the output block
        // of this rank is written only here (the successor reads `own`, not this copy).
        unsafe { copy(src, at(r, off), len * esz) };
        for s in 0..n - 1 {
            let b = (r + n - s - 1) % n;
            let (off, len) = chunks.seg(b, g);
            let dst = at(b, off);
            // SAFETY: block `b` of this rank's output, written once here, then only read.
            unsafe {
                t.recv_copy(dst, len * esz)?;
                if s + 2 < n {
                    t.send(dst, len * esz)?;
                }
            }
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
    if n == 1 {
        // SAFETY: the single chunk is the whole input; own_out has room for it.
        unsafe { copy(input, own_out, chunks.lens[0] * esz) };
        return Ok(());
    }
    for g in 0..chunks.num_segs {
        let c0 = (r + n - 1) % n;
        let (off, len) = chunks.seg(c0, g);
        // SAFETY: our input chunk c0, only read.
        unsafe { t.send(at(c0, off), len * esz)? };
        for s in 0..n - 1 {
            let c = (r + 2 * n - s - 2) % n;
            let (off, len) = chunks.seg(c, g);
            let mine = at(c, off);
            if s + 2 == n {
                let dst = own_out.wrapping_add(off * esz);
                // SAFETY: the output segment is ours and never sent; in place it is exactly
                // `mine`.
                t.recv(len * esz, &mut |acc| unsafe {
                    finish::<T>(op, acc, mine, dst, len, n)
                })?;
            } else {
                // SAFETY: our input chunk is only read.
                unsafe { reduce_forward::<T>(t, op, mine, len)? };
            }
        }
    }
    t.drain()
}

/// A rank's place in a chain along the ring.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Link {
    /// Starts each segment (and is alone in a group of one).
    First,
    /// Receives each segment and passes it on.
    Middle,
    /// Ends each segment.
    Last,
}

/// Moves one segment of a chain: `(transport, link, address, elements)`.
type ChainStep<'a> =
    dyn FnMut(&mut dyn Transport, Link, *mut u8, usize) -> Result<(), DataError> + 'a;

/// A pipelined chain along the ring over `buf` (`total` elements of `esz` bytes, in segments of
/// `seg` elements): this rank is at position `pos` of `n`; `step(t, link, at, len)` moves one
/// segment (`len` elements at `at`).
fn chain(
    t: &mut dyn Transport,
    n: usize,
    pos: usize,
    buf: *mut u8,
    (total, seg, esz): (usize, usize, usize),
    step: &mut ChainStep<'_>,
) -> Result<(), DataError> {
    let link = if pos == 0 {
        Link::First
    } else if pos + 1 == n {
        Link::Last
    } else {
        Link::Middle
    };
    let chunks = Chunks::whole(total, seg);
    for g in 0..chunks.num_segs {
        let (off, len) = chunks.seg(0, g);
        step(t, link, buf.wrapping_add(off * esz), len)?;
    }
    t.drain()
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
    let (n, r) = (ctx.world, ctx.rank);
    let esz = std::mem::size_of::<T>();
    let pos = (r + n - root) % n;
    chain(
        t,
        n,
        pos,
        buf,
        (total, seg, esz),
        &mut |t, link, at, len| {
            // SAFETY: the root only reads its buffer; the others write each segment once, here,
            // before sending it on.
            unsafe {
                if link != Link::First {
                    t.recv_copy(at, len * esz)?;
                }
                if link != Link::Last && n > 1 {
                    t.send(at, len * esz)?;
                }
            }
            Ok(())
        },
    )
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
    let (n, r) = (ctx.world, ctx.rank);
    let esz = std::mem::size_of::<T>();
    let pos = (r + n - root - 1) % n;
    chain(
        t,
        n,
        pos,
        buf,
        (total, seg, esz),
        &mut |t, link, mine, len| match link {
            // SAFETY: a non-root rank's buffer, only read.
            Link::First if n > 1 => unsafe { t.send(mine, len * esz) },
            Link::First => Ok(()),
            // SAFETY: the root's own buffer, never sent.
            Link::Last => t.recv(len * esz, &mut |acc| unsafe {
                finish::<T>(op, acc, mine, mine, len, n)
            }),
            // SAFETY: a non-root rank's buffer, only read.
            Link::Middle => unsafe { reduce_forward::<T>(t, op, mine, len) },
        },
    )
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
