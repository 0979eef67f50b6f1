//! [`PeerCopy`]: one copy of a gather from peers' buffers, which
//! [`PeerOps::copy_from_peers`](super::PeerOps::copy_from_peers) enqueues many at a time — on
//! CUDA one `gather_segments` kernel for up to
//! [`GATHER_SEGMENTS`](crate::launch::GATHER_SEGMENTS) of them instead of a
//! `cuMemcpyDtoDAsync` (or a widening cast) each.

use cudarc::driver::DevicePtrMut;

use super::cuda::{CudaBuf, CudaOps};
use super::peer::{check_elements, PeerPtr};
use crate::launch::{gather_copies, GatherCopy};
use crate::KernelError;

/// One copy of [`PeerOps::copy_from_peers`](super::PeerOps::copy_from_peers): `len` elements
/// of the peer's memory `src` from element `src_offset` (f32, or bf16 widened exactly when
/// `widen`) into destination `dst` (an index into the call's destinations) from element
/// `dst_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCopy {
    /// The peer's memory.
    pub src: PeerPtr,
    /// The first element read.
    pub src_offset: usize,
    /// The destination's index in the call's destinations.
    pub dst: usize,
    /// The first element written.
    pub dst_offset: usize,
    /// Elements.
    pub len: usize,
    /// Whether `src` holds bf16 (widened), else f32 (copied).
    pub widen: bool,
}

/// Checks every copy against its source and its destination (of `dst_lens` elements), before
/// anything is enqueued.
pub(super) fn check_copies(copies: &[PeerCopy], dst_lens: &[usize]) -> Result<(), KernelError> {
    let k = "copy_from_peers";
    for c in copies {
        let Some(&size) = dst_lens.get(c.dst) else {
            return Err(KernelError::InvalidArgument {
                kernel: k,
                reason: format!("destination {} of {}", c.dst, dst_lens.len()),
            });
        };
        check_elements(k, "source", c.src_offset, c.len, c.src.len)?;
        check_elements(k, "destination", c.dst_offset, c.len, size)?;
    }
    Ok(())
}

/// [`CudaOps`]' copies: the destinations' addresses held for the launches, every copy as a
/// segment of `gather_segments`.
///
/// # Safety
/// As [`PeerOps::copy_from_peers`](super::PeerOps::copy_from_peers).
pub(super) unsafe fn cuda_copy_from_peers(
    ops: &CudaOps,
    copies: &[PeerCopy],
    dsts: &mut [&mut CudaBuf],
) -> Result<(), KernelError> {
    let lens: Vec<usize> = dsts.iter().map(|d| d.len()).collect();
    check_copies(copies, &lens)?;
    let stream = &ops.cuda;
    let (mut addrs, mut held) = (
        Vec::with_capacity(dsts.len()),
        Vec::with_capacity(dsts.len()),
    );
    for d in dsts.iter_mut() {
        let (addr, sync) = d.device_ptr_mut(stream);
        addrs.push(addr);
        held.push(sync);
    }
    let f32_bytes = std::mem::size_of::<f32>();
    let list: Vec<GatherCopy> = copies
        .iter()
        .map(|c| {
            let src_bytes = if c.widen { 2 } else { f32_bytes };
            GatherCopy {
                src: (c.src.addr + c.src_offset * src_bytes) as u64,
                dst: addrs[c.dst] + (c.dst_offset * f32_bytes) as u64,
                len: c.len,
                widen: c.widen,
            }
        })
        .collect();
    // SAFETY: every range was checked against its buffer; the destinations are this stream's
    // buffers, borrowed mutably for the call (their addresses held by `held` until the
    // launches are enqueued), and the caller's contract covers the peers' sources.
    let r = unsafe { gather_copies(stream, &list) };
    drop(held);
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::{GptOps, HostOps, PeerOps};
    use fsdp_device::DType;

    /// Pieces of two sources into two destinations, one widened from bf16; a bad copy anywhere
    /// in the list is refused before any is made.
    #[test]
    fn copies_land_where_they_say_and_bad_ones_touch_nothing() {
        let ops = HostOps::new();
        let a = ops.upload(&[1.0, 2.0, 3.0, 4.0]).unwrap();
        let half = ops.half(3).unwrap();
        let h = ops.half_ptr(&half);
        // SAFETY: `half` is live and written here only.
        unsafe {
            ops.cast_to_half_ptr(
                DType::BF16,
                &ops.upload(&[0.5, 1.5, 2.5]).unwrap(),
                0,
                h,
                0,
                3,
            )
        }
        .unwrap();
        let (mut x, mut y) = (ops.zeros(4).unwrap(), ops.zeros(3).unwrap());
        let src = ops.peer_ptr(&a);
        let copy = |src, src_offset, dst, dst_offset, len, widen| PeerCopy {
            src,
            src_offset,
            dst,
            dst_offset,
            len,
            widen,
        };
        let good = [copy(src, 1, 0, 0, 3, false), copy(h, 0, 1, 1, 2, true)];
        // SAFETY: `a` and `half` are live and unwritten during the copies.
        unsafe { ops.copy_from_peers(&good, &mut [&mut x, &mut y]) }.unwrap();
        assert_eq!(
            (x.to_vec(), y.to_vec()),
            (vec![2.0, 3.0, 4.0, 0.0], vec![0.0, 0.5, 1.5])
        );
        for bad in [
            copy(src, 2, 0, 0, 3, false), // past the source
            copy(src, 0, 1, 1, 3, false), // past the destination
            copy(src, 0, 2, 0, 1, false), // no destination 2
        ] {
            let (mut x, mut y) = (ops.zeros(4).unwrap(), ops.zeros(3).unwrap());
            // SAFETY: as above.
            let e = unsafe { ops.copy_from_peers(&[good[0], bad], &mut [&mut x, &mut y]) };
            assert!(e.is_err(), "{bad:?}");
            assert_eq!(
                x.to_vec(),
                vec![0.0; 4],
                "nothing copied before the refusal"
            );
        }
    }
}
