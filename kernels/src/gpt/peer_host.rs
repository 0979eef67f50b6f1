//! [`PeerOps`] for [`HostOps`]: peers' host buffers read by address, folded on the calling
//! thread (its operations finish before they return, so its events are reached when
//! recorded).

use fsdp_device::DType;
use half::{bf16, f16};

use super::host_ops::HostOps;
use super::memory::Counted;
use super::peer::{check_range, check_sources, PeerOps, PeerPtr};
use super::peer_half::{half_type, host_cast_to_half, host_widen_half, Half16};
use crate::host::{KernelFloat, ReduceKind};
use crate::KernelError;

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
