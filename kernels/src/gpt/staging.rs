//! Copies between an operations' buffers and memory they do not own, given by address: a
//! communicator's staging buffers ([`StagingOps`]). A collective library such as NCCL runs on
//! its own buffers, so a unit's shards are packed into one of them (FSDP2's copy-in), the
//! collective runs, and the result is copied out ([`PeerOps::copy_from_peer`]).

use cudarc::driver::{result, DevicePtr};
use fsdp_device::{DType, Stream};

use super::cuda::{copy_error, CudaOps};
use super::host_ops::HostOps;
use super::memory::Counted;
use super::meta::{MetaCounted, MetaOps};
use super::ops::GptOps;
use super::peer::{check_elements, PeerOps, PeerPtr};
use crate::KernelError;

/// [`PeerOps`] that also write memory they do not own, given by address: the packing of a
/// unit's buffers into a communicator's staging buffer, in the operations' order.
pub trait StagingOps: PeerOps {
    /// The stream the operations are enqueued on, which a collective on another stream must
    /// be ordered after (and before the operations that read its result); `None` where every
    /// operation has finished when it returns (the host twins, the meta operations).
    fn device_stream(&self) -> Option<&Stream>;

    /// `value` (memory of `bytes` bytes that is not the operations' own, such as a
    /// communicator's staging buffer) counted in the operations' memory while it lives, so
    /// that [`GptOps::memory`]'s peak is the device's (never
    /// [mirrored](super::MemoryCounter::mirror_into) into an allocator's plan: it is not the
    /// operations' allocator's).
    fn count<T>(&self, value: T, bytes: u64) -> Counted<T>;

    /// Whether the operations touch no memory (the meta operations): their staging buffers
    /// then exist as sizes only (`fsdp_device::Buffer::meta`), for plans. Default `false`.
    fn is_meta(&self) -> bool {
        false
    }

    /// Enqueues a copy of `len` elements of `src` from element `src_offset` into the memory
    /// `dst` (f32) from element `dst_offset`.
    ///
    /// # Safety
    /// `dst` must be memory of these operations' kind (a host address for the host twins, a
    /// device address of the stream's context for CUDA) valid for `dst.len` f32 elements, that
    /// nothing else reads or writes until the copy has run in the operations' order.
    ///
    /// # Errors
    /// Ranges outside `src` or `dst` (checked before anything is enqueued); driver failures.
    unsafe fn copy_to_ptr(
        &self,
        src: &Self::Buf,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError>;

    /// Enqueues zeros into `len` elements of `dtype` (f32, or bf16 for a reduction in bf16)
    /// of the memory `dst` (elements of that type) from element `offset`.
    ///
    /// # Safety
    /// As [`copy_to_ptr`](Self::copy_to_ptr), with `dst` valid for `dst.len` elements of
    /// `dtype`.
    ///
    /// # Errors
    /// A range outside `dst`; driver failures.
    unsafe fn zero_ptr(
        &self,
        dst: PeerPtr,
        offset: usize,
        len: usize,
        dtype: DType,
    ) -> Result<(), KernelError>;

    /// [`copy_to_ptr`](Self::copy_to_ptr) from a step's scalars (f64) into f64 memory.
    ///
    /// # Safety
    /// As [`copy_to_ptr`](Self::copy_to_ptr), with `dst` valid for `dst.len` f64 elements.
    ///
    /// # Errors
    /// As [`copy_to_ptr`](Self::copy_to_ptr).
    unsafe fn copy_scalars_to_ptr(
        &self,
        src: &Self::Scalars,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError>;
}

/// [`check_elements`] of a copy to memory given by address.
fn check(what: &'static str, offset: usize, len: usize, size: usize) -> Result<(), KernelError> {
    check_elements("copy_to_ptr", what, offset, len, size)
}

/// The host twins' copy of `src[src_offset..][..len]` to the memory `dst`.
///
/// # Safety
/// `dst` is a live host allocation of `dst.len` elements of `T` with exposed provenance, that
/// nothing else accesses during the call and that does not overlap `src`.
unsafe fn host_copy<T: Copy>(
    src: &[T],
    src_offset: usize,
    dst: PeerPtr,
    dst_offset: usize,
    len: usize,
) -> Result<(), KernelError> {
    check("source", src_offset, len, src.len())?;
    check("destination", dst_offset, len, dst.len)?;
    // SAFETY: the caller's contract; the range was checked above.
    let to = unsafe {
        std::slice::from_raw_parts_mut(
            std::ptr::with_exposed_provenance_mut::<T>(dst.addr).add(dst_offset),
            len,
        )
    };
    to.copy_from_slice(&src[src_offset..src_offset + len]);
    Ok(())
}

impl StagingOps for HostOps {
    fn count<T>(&self, value: T, bytes: u64) -> Counted<T> {
        Counted::outside_mirror(value, bytes, &self.memory)
    }

    fn device_stream(&self) -> Option<&Stream> {
        None
    }

    unsafe fn copy_to_ptr(
        &self,
        src: &Self::Buf,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        // SAFETY: the caller's contract.
        unsafe { host_copy::<f32>(src, src_offset, dst, dst_offset, len) }
    }

    unsafe fn zero_ptr(
        &self,
        dst: PeerPtr,
        offset: usize,
        len: usize,
        dtype: DType,
    ) -> Result<(), KernelError> {
        check("destination", offset, len, dst.len)?;
        let bytes = dtype.size_in_bytes();
        // SAFETY: the caller's contract (`dst` holds `dst.len` elements of `bytes` bytes);
        // the range was checked above; zero bytes are zeros of every float type.
        unsafe {
            std::ptr::with_exposed_provenance_mut::<u8>(dst.addr)
                .add(offset * bytes)
                .write_bytes(0, len * bytes)
        };
        Ok(())
    }

    unsafe fn copy_scalars_to_ptr(
        &self,
        src: &Self::Scalars,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        // SAFETY: the caller's contract.
        unsafe { host_copy::<f64>(src, src_offset, dst, dst_offset, len) }
    }
}

impl CudaOps {
    /// Enqueues a copy of `bytes` bytes from the device address `from` to `to` on the stream.
    ///
    /// # Safety
    /// Both ranges are device memory of the stream's context, valid and unaccessed by anyone
    /// else until the copy has run on the stream, and do not overlap.
    pub(super) unsafe fn dtod(&self, to: u64, from: u64, bytes: usize) -> Result<(), KernelError> {
        if bytes == 0 {
            return Ok(());
        }
        // The raw copy uses the thread's current context: this stream's.
        self.cuda
            .context()
            .bind_to_thread()
            .map_err(|e| copy_error("cuCtxSetCurrent", e))?;
        // SAFETY: the caller's contract.
        unsafe { result::memcpy_dtod_async(to, from, bytes, self.cuda.cu_stream()) }
            .map_err(|e| copy_error("cuMemcpyDtoDAsync", e))
    }
}

impl StagingOps for CudaOps {
    fn count<T>(&self, value: T, bytes: u64) -> Counted<T> {
        Counted::outside_mirror(value, bytes, &self.memory)
    }

    fn device_stream(&self) -> Option<&Stream> {
        Some(self.stream())
    }

    unsafe fn copy_to_ptr(
        &self,
        src: &Self::Buf,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check("source", src_offset, len, src.len())?;
        check("destination", dst_offset, len, dst.len)?;
        let f = std::mem::size_of::<f32>();
        let (from, _sync) = src.device_ptr(&self.cuda);
        // SAFETY: ranges checked; `src` is this stream's buffer, borrowed for the call; the
        // caller's contract covers `dst`.
        unsafe {
            self.dtod(
                (dst.addr + dst_offset * f) as u64,
                from + (src_offset * f) as u64,
                len * f,
            )
        }
    }

    unsafe fn zero_ptr(
        &self,
        dst: PeerPtr,
        offset: usize,
        len: usize,
        dtype: DType,
    ) -> Result<(), KernelError> {
        check("destination", offset, len, dst.len)?;
        if len == 0 {
            return Ok(());
        }
        let f = dtype.size_in_bytes();
        self.cuda
            .context()
            .bind_to_thread()
            .map_err(|e| copy_error("cuCtxSetCurrent", e))?;
        // SAFETY: the range was checked; the caller's contract covers `dst`.
        unsafe {
            result::memset_d8_async(
                (dst.addr + offset * f) as u64,
                0,
                len * f,
                self.cuda.cu_stream(),
            )
        }
        .map_err(|e| copy_error("cuMemsetD8Async", e))
    }

    unsafe fn copy_scalars_to_ptr(
        &self,
        src: &Self::Scalars,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check("source", src_offset, len, src.len())?;
        check("destination", dst_offset, len, dst.len)?;
        let f = std::mem::size_of::<f64>();
        let (from, _sync) = src.device_ptr(&self.cuda);
        // SAFETY: as in `copy_to_ptr`.
        unsafe {
            self.dtod(
                (dst.addr + dst_offset * f) as u64,
                from + (src_offset * f) as u64,
                len * f,
            )
        }
    }
}

impl StagingOps for MetaOps {
    fn count<T>(&self, value: T, bytes: u64) -> Counted<T> {
        Counted::outside_mirror(value, bytes, &self.memory)
    }

    fn device_stream(&self) -> Option<&Stream> {
        None
    }

    fn is_meta(&self) -> bool {
        true
    }

    unsafe fn copy_to_ptr(
        &self,
        src: &MetaCounted,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check("source", src_offset, len, MetaOps::buf_len(src))?;
        check("destination", dst_offset, len, dst.len)
    }

    unsafe fn zero_ptr(
        &self,
        dst: PeerPtr,
        offset: usize,
        len: usize,
        _: DType,
    ) -> Result<(), KernelError> {
        check("destination", offset, len, dst.len)
    }

    unsafe fn copy_scalars_to_ptr(
        &self,
        src: &Counted<Vec<f64>>,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        check("source", src_offset, len, src.len())?;
        check("destination", dst_offset, len, dst.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::GptOps;

    /// The host twins write memory they do not own by address: a copy, zeros and a scalars'
    /// copy land in the named ranges and nowhere else, and ranges outside either side are
    /// refused before anything is written. (Under Miri: the raw writes stay in the target.)
    #[test]
    fn host_twins_copy_and_zero_by_address() {
        let ops = HostOps::new();
        let src = ops.upload(&[1.0, 2.0, 3.0]).unwrap();
        let mut target = vec![-1.0f32; 5];
        let dst = PeerPtr {
            addr: target.as_mut_ptr().expose_provenance(),
            len: target.len(),
        };
        // SAFETY: `target` lives and is untouched during the calls.
        unsafe {
            ops.copy_to_ptr(&src, 1, dst, 2, 2).unwrap();
            ops.zero_ptr(dst, 0, 1, DType::F32).unwrap();
            assert!(ops.copy_to_ptr(&src, 2, dst, 0, 2).is_err());
            let e = ops.zero_ptr(dst, 4, 2, DType::F32).unwrap_err().to_string();
            assert!(e.contains("outside"), "{e}");
        }
        assert_eq!(target, [0.0, -1.0, 2.0, 3.0, -1.0]);
        let scalars = ops.scalars(&[5.0, 6.0, 7.0]).unwrap();
        let mut t64 = vec![0.0f64; 2];
        let d64 = PeerPtr {
            addr: t64.as_mut_ptr().expose_provenance(),
            len: 2,
        };
        // SAFETY: as above.
        unsafe {
            ops.copy_scalars_to_ptr(&scalars, 1, d64, 0, 2).unwrap();
            assert!(ops.copy_scalars_to_ptr(&scalars, 0, d64, 1, 2).is_err());
        }
        assert_eq!(t64, [6.0, 7.0]);
        let meta = MetaOps::new(crate::gpt::HostProducts::F32);
        let m = meta.zeros(3).unwrap();
        // SAFETY: the meta operations touch no memory.
        unsafe {
            meta.copy_to_ptr(&m, 0, dst, 0, 3).unwrap();
            assert!(meta.zero_ptr(dst, 5, 1, DType::F32).is_err());
        }
    }
}
