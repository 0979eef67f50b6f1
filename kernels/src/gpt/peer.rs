//! Ranks as threads over one device reading each other's buffers: [`PeerOps`], what a
//! collective between such ranks needs beyond [`GptOps`] — a buffer's address, events that
//! order one rank's stream after another's, a copy from a peer's buffer and a reduction of
//! peers' buffers (the collectives' kernels, `launch::reduce_raw`) — for
//! [`HostOps`](super::HostOps) (host memory; its operations finish before they return, so its
//! events are reached when recorded) and [`CudaOps`](super::CudaOps) (device memory of one
//! CUDA context, CUDA events, `cuMemcpyDtoDAsync`). Here the trait and the range checks its
//! implementations share; the implementations are in `peer_host.rs` and `peer_cuda.rs`.

use fsdp_device::DType;

use super::ops::GptOps;
use super::peer_gather::{check_copies, PeerCopy};
use crate::host::ReduceKind;
use crate::KernelError;

/// A buffer's memory as a peer reads it: its address and length in elements (host or device
/// address, as its operations' buffers are).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerPtr {
    /// The first element's address.
    pub addr: usize,
    /// Elements.
    pub len: usize,
}

/// The operations of ranks that are threads over one device, reading each other's buffers:
/// a buffer's address, events that order one rank's stream after another's, a copy from a
/// peer's buffer and a reduction of peers' buffers (the collectives' kernels,
/// `launch::reduce_raw`). For [`HostOps`](super::HostOps) (host memory; its operations
/// finish before they return, so its events are reached when recorded) and
/// [`CudaOps`](super::CudaOps) (device memory of one CUDA context, CUDA events,
/// `cuMemcpyDtoDAsync`).
pub trait PeerOps: GptOps<Scalars: Send> {
    /// A point in one rank's stream that another rank's stream can wait for.
    type Event: Clone + Send + Sync;

    /// The address of `buf`'s memory, to hand to peers.
    fn peer_ptr(&self, buf: &Self::Buf) -> PeerPtr;

    /// The address of a step's scalars (f64), to hand to peers.
    fn scalars_ptr(&self, scalars: &Self::Scalars) -> PeerPtr;

    /// Records an event after the work enqueued so far.
    ///
    /// # Errors
    /// Driver failures.
    fn record_event(&self) -> Result<Self::Event, KernelError>;

    /// Makes the work enqueued from now on wait for `event` (on the device: the host does not
    /// wait).
    ///
    /// # Errors
    /// Driver failures.
    fn wait_event(&self, event: &Self::Event) -> Result<(), KernelError>;

    /// Enqueues a copy of `len` elements of a peer's memory `src` from element `src_offset`
    /// into `dst` from element `dst_offset`.
    ///
    /// # Safety
    /// `src` must be the address of a live buffer of these operations' kind (from
    /// [`peer_ptr`](Self::peer_ptr) on the same device), and stay allocated and unwritten
    /// until this copy has run: the caller orders the copy after the peer's writes (waiting
    /// for an event the peer recorded after them) and the peer's later writes and its free
    /// after the copy (the peer waits for an event recorded after it).
    ///
    /// # Errors
    /// Ranges outside `src` or `dst` (checked before anything is enqueued); driver failures.
    unsafe fn copy_from_peer(
        &self,
        src: PeerPtr,
        src_offset: usize,
        dst: &mut Self::Buf,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError>;

    /// Enqueues `dst[dst_offset..][..len] = s₀ ⊕ s₁ ⊕ … ⊕ sₖ` over the sources `srcs` (each
    /// a peer's memory and the element its range starts at), folded left to right with the
    /// collectives' arithmetic ([`reduce_one`](crate::host::reduce_one): 16-bit types aside, one
    /// rounding per operation; an average is the sum divided by `srcs.len()` at the last
    /// step). One source is copied.
    ///
    /// # Safety
    /// As [`copy_from_peer`](Self::copy_from_peer), for every source; no source overlaps
    /// `dst`.
    ///
    /// # Errors
    /// No source; ranges outside a source or `dst`; driver failures.
    unsafe fn reduce_from_peers(
        &self,
        op: ReduceKind,
        srcs: &[(PeerPtr, usize)],
        dst: &mut Self::Buf,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError>;

    /// A buffer of 16-bit elements in the operations' memory, counted in it: the inputs and
    /// results of a reduction in bf16 or f16 (FSDP's `reduce_dtype`), and a shard posted in
    /// bf16 for an all-gather. Which of the two types it holds is its user's: the casts and
    /// the reduction below are told.
    type Half: Send;

    /// `len` 16-bit elements, whose values are unspecified until written.
    ///
    /// # Errors
    /// Allocation failures.
    fn half(&self, len: usize) -> Result<Self::Half, KernelError>;

    /// The address of `half`'s memory (16-bit elements), to hand to peers or to write into
    /// with [`cast_to_half_ptr`](Self::cast_to_half_ptr).
    fn half_ptr(&self, half: &Self::Half) -> PeerPtr;

    /// Enqueues `len` elements of `src` from element `src_offset`, each rounded to the nearest
    /// `half` (bf16 or f16; ties to even: the cast kernel), into the 16-bit memory `dst` from
    /// element `dst_offset`.
    ///
    /// # Safety
    /// `dst` must be memory of these operations' kind valid for `dst.len` 16-bit elements (a
    /// [`half_ptr`](Self::half_ptr), or a communicator's staging buffer), that nothing else
    /// reads or writes until the cast has run in the operations' order.
    ///
    /// # Errors
    /// A `half` other than bf16 or f16; ranges outside `src` or `dst` (checked before anything
    /// is enqueued); launch failures.
    unsafe fn cast_to_half_ptr(
        &self,
        half: DType,
        src: &Self::Buf,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError>;

    /// Enqueues `len` elements of `half` (bf16 or f16) of the memory `src` from element
    /// `src_offset`, widened (exactly), into `dst` from element `dst_offset`.
    ///
    /// # Safety
    /// `src` must be memory of these operations' kind valid for `src.len` 16-bit elements,
    /// live and unwritten until the copy has run (ordered as for
    /// [`copy_from_peer`](Self::copy_from_peer)).
    ///
    /// # Errors
    /// A `half` other than bf16 or f16; ranges outside `src` or `dst`; launch failures.
    unsafe fn widen_half_ptr(
        &self,
        half: DType,
        src: PeerPtr,
        src_offset: usize,
        dst: &mut Self::Buf,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError>;

    /// Enqueues every copy of `copies` into its destination `dsts[copy.dst]`: each as
    /// [`copy_from_peer`](Self::copy_from_peer) does, or
    /// [`widen_half_ptr`](Self::widen_half_ptr) from bf16 when `widen` — on CUDA in as few launches as
    /// the copies allow (one kernel for up to
    /// [`GATHER_SEGMENTS`](crate::launch::GATHER_SEGMENTS), instead of one copy each).
    ///
    /// # Safety
    /// As [`copy_from_peer`](Self::copy_from_peer) for every copy; no two copies write the
    /// same elements.
    ///
    /// # Errors
    /// A destination index outside `dsts`; ranges outside a source or a destination (every
    /// copy checked before anything is enqueued); driver failures.
    unsafe fn copy_from_peers(
        &self,
        copies: &[PeerCopy],
        dsts: &mut [&mut Self::Buf],
    ) -> Result<(), KernelError> {
        let lens: Vec<usize> = dsts.iter().map(|d| Self::buf_len(d)).collect();
        check_copies(copies, &lens)?;
        for c in copies {
            let dst = &mut *dsts[c.dst];
            // SAFETY: the caller's contract; ranges checked above.
            unsafe {
                if c.widen {
                    self.widen_half_ptr(DType::BF16, c.src, c.src_offset, dst, c.dst_offset, c.len)?
                } else {
                    self.copy_from_peer(c.src, c.src_offset, dst, c.dst_offset, c.len)?
                }
            }
        }
        Ok(())
    }

    /// [`reduce_from_peers`](Self::reduce_from_peers) over memory of `half` (bf16 or f16;
    /// addresses from [`half_ptr`](Self::half_ptr)) into `dst`: in f32, rounded to `half`
    /// after every operation, as the collectives reduce 16-bit types.
    ///
    /// # Safety
    /// As [`reduce_from_peers`](Self::reduce_from_peers).
    ///
    /// # Errors
    /// As [`reduce_from_peers`](Self::reduce_from_peers); a `half` other than bf16 or f16.
    unsafe fn reduce_half_from_peers(
        &self,
        half: DType,
        op: ReduceKind,
        srcs: &[(PeerPtr, usize)],
        dst: &mut Self::Half,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError>;

    /// [`reduce_from_peers`](Self::reduce_from_peers) over step scalars (f64, addresses from
    /// [`scalars_ptr`](Self::scalars_ptr)) into `dst`'s slots `dst_offset..+len`.
    ///
    /// # Safety
    /// As [`reduce_from_peers`](Self::reduce_from_peers).
    ///
    /// # Errors
    /// As [`reduce_from_peers`](Self::reduce_from_peers).
    unsafe fn reduce_scalars_from_peers(
        &self,
        op: ReduceKind,
        srcs: &[(PeerPtr, usize)],
        dst: &mut Self::Scalars,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError>;
}

/// Checks a reduction's sources and destination range.
pub(super) fn check_sources(
    srcs: &[(PeerPtr, usize)],
    dst_offset: usize,
    len: usize,
    dst_len: usize,
) -> Result<(), KernelError> {
    if srcs.is_empty() {
        return Err(KernelError::InvalidArgument {
            kernel: "reduce_from_peers",
            reason: "no source".into(),
        });
    }
    for (p, o) in srcs {
        check_range("source", *o, len, p.len)?;
    }
    check_range("destination", dst_offset, len, dst_len)
}

/// Checks that `offset .. offset + len` lies within `size` elements of `what` (an operation
/// `kernel`'s source or destination).
pub(super) fn check_elements(
    kernel: &'static str,
    what: &'static str,
    offset: usize,
    len: usize,
    size: usize,
) -> Result<(), KernelError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(KernelError::InvalidArgument {
            kernel,
            reason: format!("{what}: elements {offset}..+{len} outside its {size}"),
        }),
    }
}

/// [`check_elements`] of a copy from a peer.
pub(super) fn check_range(
    what: &'static str,
    offset: usize,
    len: usize,
    size: usize,
) -> Result<(), KernelError> {
    check_elements("copy_from_peer", what, offset, len, size)
}

#[cfg(test)]
#[path = "peer_tests.rs"]
mod tests;
