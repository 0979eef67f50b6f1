//! The bf16 side of [`PeerOps`](super::PeerOps) for the host twins and CUDA: buffers of bf16
//! elements ([`PeerOps::Half`](super::PeerOps::Half)) and the casts between the operations'
//! f32 buffers and bf16 memory given by address, which a reduction in bf16 (FSDP's
//! `reduce_dtype`) packs its inputs with and reads its results back through.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::cuda::CudaOps;
use super::host_ops::HostOps;
use super::memory::{bytes_of, Counted};
use super::peer::PeerPtr;
use crate::launch::cast_raw;
use crate::KernelError;

/// Checks that `offset .. offset + len` lies within `size` elements.
pub(super) fn check_cast(
    what: &'static str,
    offset: usize,
    len: usize,
    size: usize,
) -> Result<(), KernelError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(KernelError::InvalidArgument {
            kernel: "cast",
            reason: format!("{what}: elements {offset}..+{len} outside its {size}"),
        }),
    }
}

impl HostOps {
    /// `len` bf16 elements counted in the operations' memory, NaN until written (as
    /// [`GptOps::empty`](super::GptOps::empty) fills), so that a read before the write shows.
    pub(super) fn new_half(&self, len: usize) -> Counted<Vec<bf16>> {
        Counted::new(vec![bf16::NAN; len], bytes_of::<bf16>(len), &self.memory)
    }
}

/// The host twins' cast of `src[src_offset..][..len]` into the bf16 memory `dst`.
///
/// # Safety
/// `dst` is a live host allocation of `dst.len` bf16 elements with exposed provenance, that
/// nothing else accesses during the call.
pub(super) unsafe fn host_cast_to_bf16(
    src: &[f32],
    src_offset: usize,
    dst: PeerPtr,
    dst_offset: usize,
    len: usize,
) -> Result<(), KernelError> {
    check_cast("source", src_offset, len, src.len())?;
    check_cast("destination", dst_offset, len, dst.len)?;
    // SAFETY: the caller's contract; the range was checked above.
    let to = unsafe {
        std::slice::from_raw_parts_mut(
            std::ptr::with_exposed_provenance_mut::<bf16>(dst.addr).add(dst_offset),
            len,
        )
    };
    crate::host::cast(&src[src_offset..src_offset + len], to)
}

/// The host twins' widening of the bf16 memory `src` into `dst[dst_offset..][..len]`.
///
/// # Safety
/// `src` is a live host allocation of `src.len` bf16 elements with exposed provenance, that no
/// one writes during the call.
pub(super) unsafe fn host_widen_bf16(
    src: PeerPtr,
    src_offset: usize,
    dst: &mut [f32],
    dst_offset: usize,
    len: usize,
) -> Result<(), KernelError> {
    check_cast("source", src_offset, len, src.len)?;
    check_cast("destination", dst_offset, len, dst.len())?;
    // SAFETY: the caller's contract; the range was checked above.
    let from = unsafe {
        std::slice::from_raw_parts(
            std::ptr::with_exposed_provenance::<bf16>(src.addr).add(src_offset),
            len,
        )
    };
    crate::host::cast(from, &mut dst[dst_offset..dst_offset + len])
}

impl CudaOps {
    /// `len` bf16 elements from the operations' memory, unwritten.
    pub(super) fn new_half(&self, len: usize) -> Result<Counted<CudaSlice<bf16>>, KernelError> {
        // SAFETY: every user writes a half (a cast or a reduction) before reading it; any
        // bits are a valid bf16.
        unsafe { self.device_slice::<bf16>(len, false) }
    }

    /// Enqueues the cast of `src[src_offset..][..len]` into the bf16 device memory `dst`.
    ///
    /// # Safety
    /// As [`PeerOps::cast_to_bf16_ptr`](super::PeerOps::cast_to_bf16_ptr).
    pub(super) unsafe fn cast_to_bf16_at(
        &self,
        src: &CudaSlice<f32>,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check_cast("source", src_offset, len, src.len())?;
        check_cast("destination", dst_offset, len, dst.len)?;
        let (from, _sync) = src.device_ptr(&self.cuda);
        let from = from + (src_offset * size_of::<f32>()) as u64;
        let to = (dst.addr + dst_offset * size_of::<bf16>()) as u64;
        // SAFETY: ranges checked; `src` is this stream's buffer, borrowed for the call; the
        // caller's contract covers `dst`.
        unsafe { cast_raw::<f32, bf16>(&self.cuda, from, to, len) }
    }

    /// Enqueues the widening of the bf16 device memory `src` into `dst[dst_offset..][..len]`.
    ///
    /// # Safety
    /// As [`PeerOps::widen_bf16_ptr`](super::PeerOps::widen_bf16_ptr).
    pub(super) unsafe fn widen_bf16_at(
        &self,
        src: PeerPtr,
        src_offset: usize,
        dst: &mut CudaSlice<f32>,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check_cast("source", src_offset, len, src.len)?;
        check_cast("destination", dst_offset, len, dst.len())?;
        let (to, _sync) = dst.device_ptr_mut(&self.cuda);
        let to = to + (dst_offset * size_of::<f32>()) as u64;
        let from = (src.addr + src_offset * size_of::<bf16>()) as u64;
        // SAFETY: ranges checked; `dst` is this stream's buffer, borrowed mutably for the
        // call; the caller's contract covers `src`.
        unsafe { cast_raw::<bf16, f32>(&self.cuda, from, to, len) }
    }
}
