//! The 16-bit side of [`PeerOps`](super::PeerOps) for the host twins and CUDA: buffers of
//! 16-bit elements ([`PeerOps::Half`](super::PeerOps::Half)) and the casts between the
//! operations' f32 buffers and bf16 or f16 memory given by address, which a reduction in bf16
//! or f16 (FSDP's `reduce_dtype`) packs its inputs with and reads its results back through.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use fsdp_device::DType;
use half::bf16;

use super::cuda::CudaOps;
use super::host_ops::HostOps;
use super::memory::{bytes_of, Counted};
use super::peer::{check_elements, PeerPtr};
use crate::host::CastFloat;
use crate::launch::cast_raw;
use crate::KernelError;

/// The two 16-bit types of [`PeerOps::Half`](super::PeerOps::Half) memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Half16 {
    Bf16,
    F16,
}

/// `dtype` as a 16-bit type of half memory.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a dtype other than bf16 or f16.
pub(super) fn half_type(dtype: DType) -> Result<Half16, KernelError> {
    match dtype {
        DType::BF16 => Ok(Half16::Bf16),
        DType::F16 => Ok(Half16::F16),
        other => Err(KernelError::InvalidArgument {
            kernel: "cast",
            reason: format!("16-bit memory of {other}: bf16 or f16 only"),
        }),
    }
}

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
    /// `len` 16-bit elements counted in the operations' memory, NaN until written (as
    /// [`GptOps::empty`](super::GptOps::empty) fills), so that a read before the write shows.
    pub(super) fn new_half(&self, len: usize) -> Counted<Vec<bf16>> {
        Counted::new(vec![bf16::NAN; len], bytes_of::<bf16>(len), &self.memory)
    }
}

/// The host twins' cast of `src[src_offset..][..len]` into the `H` (bf16 or f16) memory `dst`.
///
/// # Safety
/// `dst` is a live host allocation of `dst.len` 16-bit elements with exposed provenance, that
/// nothing else accesses during the call.
pub(super) unsafe fn host_cast_to_half<H: CastFloat>(
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
            std::ptr::with_exposed_provenance_mut::<H>(dst.addr).add(dst_offset),
            len,
        )
    };
    crate::host::cast(&src[src_offset..src_offset + len], to)
}

/// The host twins' widening of the `H` (bf16 or f16) memory `src` into
/// `dst[dst_offset..][..len]`.
///
/// # Safety
/// `src` is a live host allocation of `src.len` 16-bit elements with exposed provenance, that
/// no one writes during the call.
pub(super) unsafe fn host_widen_half<H: CastFloat>(
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
            std::ptr::with_exposed_provenance::<H>(src.addr).add(src_offset),
            len,
        )
    };
    crate::host::cast(from, &mut dst[dst_offset..dst_offset + len])
}

impl CudaOps {
    /// `len` 16-bit elements from the operations' memory, unwritten.
    pub(super) fn new_half(&self, len: usize) -> Result<Counted<CudaSlice<bf16>>, KernelError> {
        // SAFETY: every user writes a half (a cast or a reduction) before reading it; any
        // bits are a valid bf16.
        unsafe { self.device_slice::<bf16>(len, false) }
    }

    /// Enqueues the cast of `src[src_offset..][..len]` into the `H` (bf16 or f16) device
    /// memory `dst`.
    ///
    /// # Safety
    /// As [`PeerOps::cast_to_half_ptr`](super::PeerOps::cast_to_half_ptr).
    pub(super) unsafe fn cast_to_half_at<H: CastFloat>(
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
        let to = (dst.addr + dst_offset * size_of::<H>()) as u64;
        // SAFETY: ranges checked; `src` is this stream's buffer, borrowed for the call; the
        // caller's contract covers `dst`.
        unsafe { cast_raw::<f32, H>(&self.cuda, from, to, len) }
    }

    /// Enqueues the widening of the `H` (bf16 or f16) device memory `src` into
    /// `dst[dst_offset..][..len]`.
    ///
    /// # Safety
    /// As [`PeerOps::widen_half_ptr`](super::PeerOps::widen_half_ptr).
    pub(super) unsafe fn widen_half_at<H: CastFloat>(
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
        let from = (src.addr + src_offset * size_of::<H>()) as u64;
        // SAFETY: ranges checked; `dst` is this stream's buffer, borrowed mutably for the
        // call; the caller's contract covers `src`.
        unsafe { cast_raw::<H, f32>(&self.cuda, from, to, len) }
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
                unsafe {
                    ops.cast_to_half_ptr(DType::BF16, b, 0, ops.half_ptr(&h), 0, 3)
                        .unwrap()
                };
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
                    ops.reduce_half_from_peers(DType::BF16, ReduceKind::Avg, &srcs, &mut out, 1, 3)
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
                    ops.widen_half_ptr(DType::BF16, ops.half_ptr(&out), 1, &mut wide, 0, 3)
                        .unwrap()
                };
                let want: Vec<f32> = out[1..].iter().map(|h| h.to_f32()).collect();
                assert_eq!(ops.download(&wide).unwrap(), want);
                // SAFETY: `out` is this thread's; refused before anything is touched.
                unsafe {
                    ops.zero_ptr(ops.half_ptr(&out), 2, 2, fsdp_device::DType::BF16)
                        .unwrap();
                    let e = ops.widen_half_ptr(DType::BF16, ops.half_ptr(&out), 2, &mut wide, 0, 3);
                    assert!(e.unwrap_err().to_string().contains("outside"));
                    let e = ops.cast_to_half_ptr(DType::BF16, &wide, 1, ops.half_ptr(&out), 0, 3);
                    assert!(e.unwrap_err().to_string().contains("outside"));
                }
                assert_eq!(out[2..], [bf16::ZERO, bf16::ZERO]);
                assert_eq!(out[1], third(4.0), "the zeros stop at their range");
            });
        });
    }

    /// The f16 side through the same 16-bit memory: each value rounded to f16 (1 + 2⁻⁸ is one,
    /// unlike in bf16), the halves folded in rank order with f16's rounding after every
    /// addition and after the division, and widened; a dtype other than bf16 or f16 refused.
    #[test]
    fn host_peers_reduce_in_f16_by_address() {
        use half::f16;
        let ops = HostOps::new();
        let values = [
            [1.0 + 1.0 / 256.0, 3.0, 0.1],
            [1.0, 3.0, 0.1],
            [2.0, -3.0, 1e-3],
        ];
        let bufs: Vec<_> = values.iter().map(|v| ops.upload(v).unwrap()).collect();
        let halves: Vec<_> = bufs
            .iter()
            .map(|b| {
                let h = ops.half(3).unwrap();
                // SAFETY: `h` is this thread's, live, and untouched during the cast.
                unsafe {
                    ops.cast_to_half_ptr(DType::F16, b, 0, ops.half_ptr(&h), 0, 3)
                        .unwrap()
                };
                h
            })
            .collect();
        let srcs: Vec<_> = halves.iter().map(|h| (ops.half_ptr(h), 0)).collect();
        let mut out = ops.half(3).unwrap();
        let mut wide = ops.zeros(3).unwrap();
        // SAFETY: the halves and `out` are this thread's, live and otherwise untouched.
        unsafe {
            ops.reduce_half_from_peers(DType::F16, ReduceKind::Avg, &srcs, &mut out, 0, 3)
                .unwrap();
            ops.widen_half_ptr(DType::F16, ops.half_ptr(&out), 0, &mut wide, 0, 3)
                .unwrap();
        }
        let h = |x: f32| f16::from_f32(x).to_f32();
        let want: Vec<f32> = (0..3)
            .map(|j| {
                let sum = h(h(h(values[0][j]) + h(values[1][j])) + h(values[2][j]));
                h(sum / 3.0)
            })
            .collect();
        assert_eq!(ops.download(&wide).unwrap(), want);
        assert_ne!(want[0], h(4.0 / 3.0), "1 + 2⁻⁸ kept its 2⁻⁸ in f16");
        // SAFETY: refused before anything is touched.
        let e = unsafe { ops.cast_to_half_ptr(DType::F32, &bufs[0], 0, ops.half_ptr(&out), 0, 3) };
        assert!(e.unwrap_err().to_string().contains("bf16 or f16 only"));
    }
}
