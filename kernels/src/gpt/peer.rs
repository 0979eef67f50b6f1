//! Ranks as threads over one device reading each other's buffers: [`PeerOps`], what a
//! collective between such ranks needs beyond [`GptOps`] — a buffer's address, events that
//! order one rank's stream after another's, a copy from a peer's buffer and a reduction of
//! peers' buffers (the collectives' kernels, `launch::reduce_raw`) — for
//! [`HostOps`] (host memory; its operations finish before they return, so its events are
//! reached when recorded) and [`CudaOps`] (device memory of one CUDA context, CUDA events,
//! `cuMemcpyDtoDAsync`).

use cudarc::driver::{result, CudaSlice, DevicePtr, DevicePtrMut};
use fsdp_device::DType;
use half::{bf16, f16};

use super::cuda::{copy_error, CudaBuf, CudaOps};
use super::host_ops::HostOps;
use super::memory::Counted;
use super::ops::GptOps;
use super::peer_gather::{check_copies, cuda_copy_from_peers, PeerCopy};
use super::peer_half::{half_type, host_cast_to_half, host_widen_half, Half16};
use crate::host::{KernelFloat, ReduceKind};
use crate::launch::reduce_raw;
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
/// `launch::reduce_raw`). For [`HostOps`] (host memory; its operations finish before they
/// return, so its events are reached when recorded) and [`CudaOps`] (device memory of one
/// CUDA context, CUDA events, `cuMemcpyDtoDAsync`).
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
fn check_sources(
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

/// The host twins' fold of `srcs` into `dst`.
///
/// # Safety
/// Every source is a live host buffer of `T` valid for its range, unwritten during the call
/// and not overlapping `dst`.
unsafe fn host_fold<T: KernelFloat>(
    op: ReduceKind,
    srcs: &[(PeerPtr, usize)],
    dst: &mut [T],
) -> Result<(), KernelError> {
    let len = dst.len();
    let view = |(p, o): (PeerPtr, usize)| -> &[T] {
        // SAFETY: the caller's contract; the range was checked by `check_sources`.
        unsafe {
            std::slice::from_raw_parts(std::ptr::with_exposed_provenance::<T>(p.addr).add(o), len)
        }
    };
    let n = srcs.len();
    let finish = |k: usize| (k + 1 == n).then_some(n as u32);
    if n == 1 {
        dst.copy_from_slice(view(srcs[0]));
        return Ok(());
    }
    crate::host::reduce(op, dst, view(srcs[0]), view(srcs[1]), finish(1))?;
    for (k, s) in srcs.iter().enumerate().skip(2) {
        crate::host::reduce_in_place(op, dst, view(*s), finish(k))?;
    }
    Ok(())
}

/// [`CudaOps`]' fold of `srcs` into the device memory at `dst` (`len` elements of `T`).
///
/// # Safety
/// As [`PeerOps::reduce_from_peers`]; `dst` is a device address of `stream`'s context valid
/// for `len` elements.
unsafe fn cuda_fold<T: KernelFloat>(
    stream: &cudarc::driver::CudaStream,
    op: ReduceKind,
    srcs: &[(PeerPtr, usize)],
    dst: u64,
    len: usize,
) -> Result<(), KernelError> {
    if len == 0 {
        return Ok(());
    }
    // The raw calls below use the thread's current context: this stream's.
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| copy_error("cuCtxSetCurrent", e))?;
    let f = std::mem::size_of::<T>();
    let at = |(p, o): (PeerPtr, usize)| (p.addr + o * f) as u64;
    let n = srcs.len();
    let finish = |k: usize| (k + 1 == n).then_some(n as u32);
    if n == 1 {
        // SAFETY: the caller's contract (both ranges valid, ordered by events).
        return unsafe { result::memcpy_dtod_async(dst, at(srcs[0]), len * f, stream.cu_stream()) }
            .map_err(|e| copy_error("cuMemcpyDtoDAsync", e));
    }
    // SAFETY: as above; `dst` equals `acc` in the later steps (element-wise, allowed).
    unsafe {
        reduce_raw::<T>(stream, op, dst, at(srcs[0]), at(srcs[1]), len, finish(1))?;
        for (k, s) in srcs.iter().enumerate().skip(2) {
            reduce_raw::<T>(stream, op, dst, dst, at(*s), len, finish(k))?;
        }
    }
    Ok(())
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
fn check_range(
    what: &'static str,
    offset: usize,
    len: usize,
    size: usize,
) -> Result<(), KernelError> {
    check_elements("copy_from_peer", what, offset, len, size)
}

impl PeerOps for HostOps {
    type Event = ();

    type Half = Counted<Vec<bf16>>;

    fn half(&self, len: usize) -> Result<Self::Half, KernelError> {
        Ok(self.new_half(len))
    }

    fn half_ptr(&self, half: &Self::Half) -> PeerPtr {
        PeerPtr {
            addr: half.as_ptr().expose_provenance(),
            len: half.len(),
        }
    }

    unsafe fn cast_to_half_ptr(
        &self,
        half: DType,
        src: &Self::Buf,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        // SAFETY: the caller's contract.
        unsafe {
            match half_type(half)? {
                Half16::Bf16 => host_cast_to_half::<bf16>(src, src_offset, dst, dst_offset, len),
                Half16::F16 => host_cast_to_half::<f16>(src, src_offset, dst, dst_offset, len),
            }
        }
    }

    unsafe fn widen_half_ptr(
        &self,
        half: DType,
        src: PeerPtr,
        src_offset: usize,
        dst: &mut Self::Buf,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        // SAFETY: the caller's contract.
        unsafe {
            match half_type(half)? {
                Half16::Bf16 => host_widen_half::<bf16>(src, src_offset, dst, dst_offset, len),
                Half16::F16 => host_widen_half::<f16>(src, src_offset, dst, dst_offset, len),
            }
        }
    }

    unsafe fn reduce_half_from_peers(
        &self,
        half: DType,
        op: ReduceKind,
        srcs: &[(PeerPtr, usize)],
        dst: &mut Self::Half,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        let kind = half_type(half)?;
        check_sources(srcs, dst_offset, len, dst.len())?;
        let dst = &mut dst[dst_offset..dst_offset + len];
        // SAFETY: the caller's contract; ranges checked.
        unsafe {
            match kind {
                Half16::Bf16 => host_fold::<bf16>(op, srcs, dst),
                // The same 16-bit memory viewed as f16 (both are plain 16-bit values).
                Half16::F16 => host_fold::<f16>(op, srcs, bytemuck::cast_slice_mut(dst)),
            }
        }
    }

    fn peer_ptr(&self, buf: &Self::Buf) -> PeerPtr {
        PeerPtr {
            // Exposed, so that a peer's read by address keeps the buffer's provenance.
            addr: buf.as_ptr().expose_provenance(),
            len: buf.len(),
        }
    }

    fn scalars_ptr(&self, scalars: &Self::Scalars) -> PeerPtr {
        PeerPtr {
            addr: scalars.as_ptr().expose_provenance(),
            len: scalars.len(),
        }
    }

    unsafe fn reduce_from_peers(
        &self,
        op: ReduceKind,
        srcs: &[(PeerPtr, usize)],
        dst: &mut Self::Buf,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check_sources(srcs, dst_offset, len, dst.len())?;
        // SAFETY: the caller's contract; ranges checked.
        unsafe { host_fold::<f32>(op, srcs, &mut dst[dst_offset..dst_offset + len]) }
    }

    unsafe fn reduce_scalars_from_peers(
        &self,
        op: ReduceKind,
        srcs: &[(PeerPtr, usize)],
        dst: &mut Self::Scalars,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check_sources(srcs, dst_offset, len, dst.len())?;
        // SAFETY: the caller's contract; ranges checked.
        unsafe { host_fold::<f64>(op, srcs, &mut dst[dst_offset..dst_offset + len]) }
    }

    fn record_event(&self) -> Result<(), KernelError> {
        Ok(())
    }

    fn wait_event(&self, _: &()) -> Result<(), KernelError> {
        Ok(())
    }

    unsafe fn copy_from_peer(
        &self,
        src: PeerPtr,
        src_offset: usize,
        dst: &mut Self::Buf,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check_range("source", src_offset, len, src.len)?;
        check_range("destination", dst_offset, len, dst.len())?;
        // SAFETY: the caller guarantees `src` is a live host buffer of `src.len` f32 that no
        // one writes while this copy reads it; the range was checked above.
        let from =
            unsafe { std::slice::from_raw_parts((src.addr as *const f32).add(src_offset), len) };
        dst[dst_offset..dst_offset + len].copy_from_slice(from);
        Ok(())
    }
}

impl PeerOps for CudaOps {
    type Event = fsdp_device::Event;

    type Half = Counted<CudaSlice<bf16>>;

    fn half(&self, len: usize) -> Result<Self::Half, KernelError> {
        self.new_half(len)
    }

    fn half_ptr(&self, half: &Self::Half) -> PeerPtr {
        let (addr, _sync) = half.device_ptr(&self.cuda);
        PeerPtr {
            addr: addr as usize,
            len: half.len(),
        }
    }

    unsafe fn cast_to_half_ptr(
        &self,
        half: DType,
        src: &Self::Buf,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        // SAFETY: the caller's contract.
        unsafe {
            match half_type(half)? {
                Half16::Bf16 => self.cast_to_half_at::<bf16>(src, src_offset, dst, dst_offset, len),
                Half16::F16 => self.cast_to_half_at::<f16>(src, src_offset, dst, dst_offset, len),
            }
        }
    }

    unsafe fn widen_half_ptr(
        &self,
        half: DType,
        src: PeerPtr,
        src_offset: usize,
        dst: &mut Self::Buf,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        // SAFETY: the caller's contract.
        unsafe {
            match half_type(half)? {
                Half16::Bf16 => self.widen_half_at::<bf16>(src, src_offset, dst, dst_offset, len),
                Half16::F16 => self.widen_half_at::<f16>(src, src_offset, dst, dst_offset, len),
            }
        }
    }

    unsafe fn reduce_half_from_peers(
        &self,
        half: DType,
        op: ReduceKind,
        srcs: &[(PeerPtr, usize)],
        dst: &mut Self::Half,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        let kind = half_type(half)?;
        check_sources(srcs, dst_offset, len, dst.len())?;
        let (d, _sync) = dst.device_ptr_mut(&self.cuda);
        let d = d + (dst_offset * std::mem::size_of::<bf16>()) as u64;
        // SAFETY: the caller's contract; ranges checked; `d` is this stream's half, 16-bit
        // elements of either type.
        unsafe {
            match kind {
                Half16::Bf16 => cuda_fold::<bf16>(&self.cuda, op, srcs, d, len),
                Half16::F16 => cuda_fold::<f16>(&self.cuda, op, srcs, d, len),
            }
        }
    }

    fn peer_ptr(&self, buf: &Self::Buf) -> PeerPtr {
        let (addr, _sync) = buf.device_ptr(&self.cuda);
        PeerPtr {
            addr: addr as usize,
            len: buf.len(),
        }
    }

    fn scalars_ptr(&self, scalars: &Self::Scalars) -> PeerPtr {
        let (addr, _sync) = scalars.device_ptr(&self.cuda);
        PeerPtr {
            addr: addr as usize,
            len: scalars.len(),
        }
    }

    unsafe fn reduce_from_peers(
        &self,
        op: ReduceKind,
        srcs: &[(PeerPtr, usize)],
        dst: &mut Self::Buf,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check_sources(srcs, dst_offset, len, dst.len())?;
        let (d, _sync) = dst.device_ptr_mut(&self.cuda);
        let d = d + (dst_offset * std::mem::size_of::<f32>()) as u64;
        // SAFETY: the caller's contract; ranges checked; `d` is this stream's buffer.
        unsafe { cuda_fold::<f32>(&self.cuda, op, srcs, d, len) }
    }

    unsafe fn reduce_scalars_from_peers(
        &self,
        op: ReduceKind,
        srcs: &[(PeerPtr, usize)],
        dst: &mut Self::Scalars,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check_sources(srcs, dst_offset, len, dst.len())?;
        let (d, _sync) = dst.device_ptr_mut(&self.cuda);
        let d = d + (dst_offset * std::mem::size_of::<f64>()) as u64;
        // SAFETY: the caller's contract; ranges checked; `d` is this stream's scalars.
        unsafe { cuda_fold::<f64>(&self.cuda, op, srcs, d, len) }
    }

    fn record_event(&self) -> Result<fsdp_device::Event, KernelError> {
        Ok(self.stream().record_event())
    }

    fn wait_event(&self, event: &fsdp_device::Event) -> Result<(), KernelError> {
        Ok(self.stream().wait_event(event)?)
    }

    unsafe fn copy_from_peer(
        &self,
        src: PeerPtr,
        src_offset: usize,
        dst: &mut Self::Buf,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check_range("source", src_offset, len, src.len)?;
        check_range("destination", dst_offset, len, dst.len())?;
        let f = std::mem::size_of::<f32>();
        let (to, _sync) = dst.device_ptr_mut(&self.cuda);
        let to = to + (dst_offset * f) as u64;
        let from = (src.addr + src_offset * f) as u64;
        // SAFETY: both ranges were checked against their buffers; `dst` is this stream's
        // buffer, borrowed mutably for the call, and the caller guarantees that `src` is a
        // live device buffer of this context that stays allocated and unwritten until the
        // copy has run on this stream.
        unsafe { self.dtod(to, from, len * f) }
    }

    unsafe fn copy_from_peers(
        &self,
        copies: &[PeerCopy],
        dsts: &mut [&mut CudaBuf],
    ) -> Result<(), KernelError> {
        // SAFETY: the caller's contract.
        unsafe { cuda_copy_from_peers(self, copies, dsts) }
    }
}

#[cfg(test)]
#[path = "peer_tests.rs"]
mod tests;
