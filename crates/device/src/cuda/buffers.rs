//! Device buffers and their async copies to and from pinned host buffers.

use cudarc::driver::result;

use super::{driver_error, CudaStorage, PinnedStorage};
use crate::buffer::byte_size;
use crate::reaper;
use crate::{AccessMode, Buffer, DType, Device, DeviceError, Event, Stream};

/// The CUDA stream behind `stream`, with its context bound to the calling thread.
fn bound_cuda(
    stream: &Stream,
    op: &'static str,
) -> Result<cudarc::driver::sys::CUstream, DeviceError> {
    let cu = stream
        .cuda_stream()
        .ok_or_else(|| DeviceError::Unsupported {
            op,
            device: format!(
                "`{}` ({}, not a CUDA stream)",
                stream.name(),
                stream.device()
            ),
        })?;
    cu.context()
        .bind_to_thread()
        .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
    Ok(cu.cu_stream())
}

/// The checks shared by both directions of a host copy: a device buffer, a pinned host buffer
/// of the same element type and length, a CUDA stream of the device buffer's device.
fn check_host_copy(
    device: &Buffer,
    host: &Buffer,
    stream: &Stream,
    what: &str,
) -> Result<(), DeviceError> {
    if !matches!(device.device(), Device::Cuda(_)) || device.stream_order().is_none() {
        return Err(DeviceError::InvalidArgument(format!(
            "{what}: the device side is a buffer on {}, not a stream-ordered CUDA buffer \
             (Buffer::cuda_zeros)",
            device.device()
        )));
    }
    if stream.device() != device.device() {
        return Err(DeviceError::InvalidArgument(format!(
            "{what}: a buffer on {} copied on stream `{}` of {}",
            device.device(),
            stream.name(),
            stream.device()
        )));
    }
    if host.device() != Device::Cpu || !host.is_page_locked() {
        return Err(DeviceError::InvalidArgument(format!(
            "{what}: the host side must be a pinned host buffer (Buffer::pinned_zeros), not a \
             {}buffer on {}",
            if host.device() == Device::Cpu {
                "pageable "
            } else {
                ""
            },
            host.device()
        )));
    }
    if host.dtype() != device.dtype() || host.len() != device.len() {
        return Err(DeviceError::InvalidArgument(format!(
            "{what}: {} elements of {} on {} vs {} elements of {} on the host",
            device.len(),
            device.dtype(),
            device.device(),
            host.len(),
            host.dtype()
        )));
    }
    Ok(())
}

impl Buffer {
    /// `len` zeroed elements of `dtype` in device memory ([`CudaStorage`]) on `stream`'s device;
    /// the zeroing (`cuMemsetD8Async`) is enqueued on `stream` and recorded as the buffer's
    /// first write, so every later use on any stream is ordered after it.
    ///
    /// # Errors
    /// [`DeviceError::Unsupported`] when `stream` is not a CUDA stream; the errors of
    /// [`CudaStorage::uninit`] and of the memset.
    pub fn cuda_zeros(dtype: DType, len: usize, stream: &Stream) -> Result<Buffer, DeviceError> {
        let bytes = byte_size(dtype, len)?;
        let cu = bound_cuda(stream, "Buffer::cuda_zeros")?;
        let Device::Cuda(ordinal) = stream.device() else {
            return Err(DeviceError::InvalidArgument(format!(
                "stream `{}` is a CUDA stream on {}",
                stream.name(),
                stream.device()
            )));
        };
        let buf = Buffer::from_storage(Box::new(CudaStorage::uninit(ordinal, bytes)?), dtype)?;
        let usage = buf.use_on(stream, AccessMode::Exclusive)?;
        if bytes > 0 {
            // SAFETY: `bytes` bytes of the live allocation at this address, written only by this
            // memset, ordered on `stream` by the buffer's StreamOrder.
            unsafe { result::memset_d8_async(usage.device_ptr(), 0, bytes, cu) }
                .map_err(|e| driver_error("cuMemsetD8Async", e))?;
        }
        usage.finish();
        Ok(buf)
    }

    /// `len` zeroed elements of `dtype` in page-locked host memory ([`PinnedStorage`]), read and
    /// written on the host like any host buffer and the host side of
    /// [`copy_to_host_async`](Buffer::copy_to_host_async) /
    /// [`copy_from_host_async`](Buffer::copy_from_host_async).
    ///
    /// # Errors
    /// The errors of [`PinnedStorage::zeroed`].
    pub fn pinned_zeros(dtype: DType, len: usize) -> Result<Buffer, DeviceError> {
        let bytes = byte_size(dtype, len)?;
        Buffer::from_storage(Box::new(PinnedStorage::zeroed(bytes)?), dtype)
    }

    /// Copy this device buffer into the pinned host buffer `dst` on `stream`
    /// (`cuMemcpyDtoHAsync`): the copy waits (on the GPU) for the last write of this buffer and
    /// is recorded as a read of it. `dst` stays under an exclusive access ticket, taken now
    /// (waiting up to the stream's timeout for earlier host access to finish), until the copy's
    /// event completes, so `dst.read()` after this call sees the copied data and nothing on the
    /// host touches `dst` during the copy. Returns the copy's event.
    ///
    /// # Errors
    /// [`DeviceError::InvalidArgument`] for a non-CUDA source, a stream of another device, a
    /// `dst` that is not pinned or differs in element type or length;
    /// [`DeviceError::Timeout`] when `dst` stays busy; [`DeviceError::Cuda`] when the copy fails.
    pub(crate) fn cuda_copy_to_host_async(
        &self,
        dst: &Buffer,
        stream: &Stream,
    ) -> Result<Event, DeviceError> {
        check_host_copy(self, dst, stream, "copy_to_host_async")?;
        let guard = dst
            .access(AccessMode::Exclusive)
            .acquire(stream.timeout())?;
        let usage = self.use_on(stream, AccessMode::Shared)?;
        let cu = bound_cuda(stream, "copy_to_host_async")?;
        let bytes = self.byte_len();
        if bytes > 0 {
            // SAFETY: the exclusive guard covers `bytes` bytes of live pinned memory and is held
            // until the copy's event completes (release_after below); nothing else writes them.
            let host = unsafe { std::slice::from_raw_parts_mut(guard.as_ptr(), bytes) };
            // SAFETY: the source is `bytes` bytes of this buffer's live device allocation, kept
            // until the recorded read completes; the copy is ordered after its last write.
            unsafe { result::memcpy_dtoh_async(host, usage.device_ptr(), cu) }
                .map_err(|e| driver_error("cuMemcpyDtoHAsync", e))?;
        }
        let event = usage.finish();
        reaper::release_after(vec![event.clone()], Box::new(guard));
        Ok(event)
    }

    /// Copy the pinned host buffer `src` into this device buffer on `stream`
    /// (`cuMemcpyHtoDAsync`): the copy waits for the last write and the reads since of this
    /// buffer and is recorded as its write. `src` stays under a shared access ticket until the
    /// copy's event completes, so host writes to it issued after this call wait for the copy.
    /// Returns the copy's event.
    ///
    /// # Errors
    /// As [`copy_to_host_async`](Buffer::copy_to_host_async).
    pub(crate) fn cuda_copy_from_host_async(
        &self,
        src: &Buffer,
        stream: &Stream,
    ) -> Result<Event, DeviceError> {
        check_host_copy(self, src, stream, "copy_from_host_async")?;
        let guard = src.access(AccessMode::Shared).acquire(stream.timeout())?;
        let usage = self.use_on(stream, AccessMode::Exclusive)?;
        let cu = bound_cuda(stream, "copy_from_host_async")?;
        let bytes = self.byte_len();
        if bytes > 0 {
            // SAFETY: the shared guard covers `bytes` bytes of live pinned memory, excludes host
            // writers and is held until the copy's event completes.
            let host = unsafe { std::slice::from_raw_parts(guard.as_ptr().cast_const(), bytes) };
            // SAFETY: the destination is `bytes` bytes of this buffer's live device allocation,
            // ordered after its earlier uses; freed only after the recorded write completes.
            unsafe { result::memcpy_htod_async(usage.device_ptr(), host, cu) }
                .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))?;
        }
        let event = usage.finish();
        reaper::release_after(vec![event.clone()], Box::new(guard));
        Ok(event)
    }

    /// [`zero_async`](Buffer::zero_async) of a CUDA buffer (`cuMemsetD8Async`), ordered after
    /// its earlier uses and recorded as its write.
    pub(crate) fn cuda_zero_async(&self, stream: &Stream) -> Result<Event, DeviceError> {
        let usage = self.use_on(stream, AccessMode::Exclusive)?;
        let cu = bound_cuda(stream, "zero_async")?;
        let bytes = self.byte_len();
        if bytes > 0 {
            // SAFETY: `bytes` bytes of this buffer's live device allocation, ordered on `stream`
            // after its earlier uses and kept until the recorded write completes.
            unsafe { result::memset_d8_async(usage.device_ptr(), 0, bytes, cu) }
                .map_err(|e| driver_error("cuMemsetD8Async", e))?;
        }
        Ok(usage.finish())
    }

    /// [`copy_from_device_async`](Buffer::copy_from_device_async) of CUDA buffers
    /// (`cuMemcpyDtoDAsync`), once it checked them.
    pub(crate) fn cuda_copy_from_device_async(
        &self,
        src: &Buffer,
        stream: &Stream,
    ) -> Result<Event, DeviceError> {
        let read = src.use_on(stream, AccessMode::Shared)?;
        let write = self.use_on(stream, AccessMode::Exclusive)?;
        let cu = bound_cuda(stream, "copy_from_device_async")?;
        if self.byte_len() > 0 {
            // SAFETY: both ranges are live allocations of this device of byte_len bytes, do not
            // overlap, and are ordered on `stream` by their stream orders.
            unsafe {
                result::memcpy_dtod_async(
                    write.device_ptr(),
                    read.device_ptr(),
                    self.byte_len(),
                    cu,
                )
            }
            .map_err(|e| driver_error("cuMemcpyDtoDAsync", e))?;
        }
        read.finish();
        Ok(write.finish())
    }
}
