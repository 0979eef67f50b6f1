//! The bf16 side of [`PeerOps`](super::PeerOps) for the host twins and CUDA: buffers of bf16
//! elements ([`PeerOps::Half`](super::PeerOps::Half)) and the casts between the operations'
//! f32 buffers and bf16 memory given by address, which a reduction in bf16 (FSDP's
//! `reduce_dtype`) packs its inputs with and reads its results back through.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::cuda::CudaOps;
use super::host_ops::HostOps;
use super::memory::{bytes_of, Counted};
use super::peer::{check_elements, PeerPtr};
use crate::launch::cast_raw;
use crate::KernelError;

/// [`check_elements`] of a cast.
pub(super) fn check_cast(
    what: &'static str,
    offset: usize,
    len: usize,
    size: usize,
) -> Result<(), KernelError> {
    check_elements("cast", what, offset, len, size)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::{GptOps, PeerOps, StagingOps};
    use crate::host::ReduceKind;

    /// The bf16 side: each thread rounds its buffer into a half of its own by address, a peer
    /// reduces the halves in rank order with bf16's rounding after every operation (an average
    /// divided at the last step) and widens the result; zeros of bf16 by address; ranges
    /// outside a buffer refused before anything is touched. (Under Miri: every access by
    /// address stays in a live buffer.)
    #[test]
    fn host_peers_reduce_in_bf16_by_address() {
        let ops = HostOps::new();
        // 1 + 2⁻⁸ is not a bf16 (ties to 1); 3.0 and 0.1's roundings are exact sums.
        let values = [
            [1.0 + 1.0 / 256.0, 3.0, 0.1],
            [1.0, 3.0, 0.1],
            [2.0, -3.0, 0.1],
        ];
        let bufs: Vec<_> = values.iter().map(|v| ops.upload(v).unwrap()).collect();
        let halves: Vec<_> = bufs
            .iter()
            .map(|b| {
                let h = ops.half(3).unwrap();
                // SAFETY: `h` is this thread's, live, and untouched during the cast.
                unsafe { ops.cast_to_bf16_ptr(b, 0, ops.half_ptr(&h), 0, 3).unwrap() };
                h
            })
            .collect();
        let ptrs: Vec<PeerPtr> = halves.iter().map(|h| ops.half_ptr(h)).collect();
        std::thread::scope(|s| {
            s.spawn(|| {
                let ops = HostOps::new();
                let mut out = ops.half(4).unwrap();
                let srcs: Vec<_> = ptrs.iter().map(|&p| (p, 0)).collect();
                // SAFETY: the halves live and are unwritten until the scope ends; `out` is
                // this thread's.
                unsafe {
                    ops.reduce_bf16_from_peers(ReduceKind::Avg, &srcs, &mut out, 1, 3)
                        .unwrap()
                };
                let b = |x: f32| bf16::from_f32(x);
                let third = |x: f32| b(x / 3.0);
                let tenth = b(0.1).to_f32();
                let sum_tenths = b(b(tenth + tenth).to_f32() + tenth).to_f32();
                assert_eq!(out[1..], [third(4.0), third(3.0), third(sum_tenths)]);
                let mut wide = ops.zeros(3).unwrap();
                // SAFETY: `out` is this thread's, written above.
                unsafe {
                    ops.widen_bf16_ptr(ops.half_ptr(&out), 1, &mut wide, 0, 3)
                        .unwrap()
                };
                let want: Vec<f32> = out[1..].iter().map(|h| h.to_f32()).collect();
                assert_eq!(ops.download(&wide).unwrap(), want);
                // SAFETY: `out` is this thread's; refused before anything is touched.
                unsafe {
                    ops.zero_ptr(ops.half_ptr(&out), 2, 2, fsdp_device::DType::BF16)
                        .unwrap();
                    let e = ops.widen_bf16_ptr(ops.half_ptr(&out), 2, &mut wide, 0, 3);
                    assert!(e.unwrap_err().to_string().contains("outside"));
                    let e = ops.cast_to_bf16_ptr(&wide, 1, ops.half_ptr(&out), 0, 3);
                    assert!(e.unwrap_err().to_string().contains("outside"));
                }
                assert_eq!(out[2..], [bf16::ZERO, bf16::ZERO]);
                assert_eq!(out[1], third(4.0), "the zeros stop at their range");
            });
        });
    }
}
