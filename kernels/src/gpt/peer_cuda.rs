//! [`PeerOps`] for [`CudaOps`]: peers' device memory of one CUDA context read by address,
//! ordered by CUDA events, copied with `cuMemcpyDtoDAsync` and folded by the collectives'
//! reduction kernel (`launch::reduce_raw`).

use cudarc::driver::{result, CudaSlice, DevicePtr, DevicePtrMut};
use fsdp_device::DType;
use half::{bf16, f16};

use super::cuda::{copy_error, CudaBuf, CudaOps};
use super::memory::Counted;
use super::peer::{check_range, check_sources, PeerOps, PeerPtr};
use super::peer_gather::{cuda_copy_from_peers, PeerCopy};
use super::peer_half::{half_type, Half16};
use crate::host::{KernelFloat, ReduceKind};
use crate::launch::reduce_raw;
use crate::KernelError;

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
