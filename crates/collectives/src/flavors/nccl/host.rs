//! Host ↔ device copies of a communicator: through pinned staging memory with asynchronous
//! copies on the NCCL stream (defect 1 of issue 15: never a synchronous copy from pageable
//! memory on the legacy stream, which does not order with NCCL's non-blocking stream).

use std::time::Instant;

use cudarc::driver::result as cu;
use fsdp_device::cuda::PooledEvent;
use fsdp_device::{AccessMode, Buffer, Device, Element};

use super::validate::wait_host;
use super::NcclCommunicator;
use crate::{CollectiveError, Result};

/// Pinned (page-locked) host memory, freed on drop. A communicator keeps its largest staging
/// buffer for the next copy: `cuMemHostAlloc`/`cuMemFreeHost` may synchronise the device, which
/// must not happen per copy while collectives are in flight.
pub(crate) struct Pinned {
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: the memory is owned by this value; it is only touched by the thread that holds the
// communicator's staging lock (or owns the value).
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(bytes: usize) -> std::result::Result<Pinned, cu::DriverError> {
        // SAFETY: the communicator's context is current (bound by the caller); freed in Drop.
        let ptr = unsafe { cu::malloc_host(bytes, 0) }?.cast::<u8>();
        Ok(Pinned { ptr, bytes })
    }

    /// The first `len` bytes (at most the allocation).
    fn bytes(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: `self.bytes` bytes of pinned memory owned by this value; `len` is clamped.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len.min(self.bytes)) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host` in `new`; no copy is in flight (the copies are
        // waited for, and a copy that did not finish leaks the staging with `mem::forget`).
        let _ = unsafe { cu::free_host(self.ptr.cast()) };
    }
}

impl NcclCommunicator {
    fn invalid(&self, op: &'static str, reason: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            rank: self.rank,
            op,
            reason,
        }
    }

    fn driver(&self, op: &'static str) -> impl Fn(cu::DriverError) -> CollectiveError + '_ {
        move |e| CollectiveError::Backend {
            rank: self.rank,
            backend: "nccl",
            op,
            reason: format!("cuda:{}: CUDA driver error {e:?}", self.ordinal),
        }
    }

    fn check_host_copy<T: Element>(
        &self,
        op: &'static str,
        buf: &Buffer,
        len: usize,
    ) -> Result<()> {
        let dev = Device::Cuda(self.ordinal);
        if buf.device() != dev {
            return Err(self.invalid(op, format!("buffer on {}, expected {dev}", buf.device())));
        }
        if buf.dtype() != T::DTYPE {
            return Err(self.invalid(
                op,
                format!("buffer of {}, host data of {}", buf.dtype(), T::DTYPE),
            ));
        }
        if buf.len() != len {
            return Err(self.invalid(
                op,
                format!("buffer of {} elements, host data of {len}", buf.len()),
            ));
        }
        if self.comm.abort_reason().is_some() {
            return Err(self.comm.aborted_error());
        }
        self.ctx
            .bind_to_thread()
            .map_err(self.driver("cuCtxSetCurrent"))
    }

    /// Enqueue a copy between `buf` and `staging` on the NCCL stream (after the current stream's
    /// work, the collectives issued before and, for a stream-ordered buffer, the work on it
    /// that conflicts), then wait for it on the host, bounded by the timeout; on success the
    /// current stream is ordered after it too.
    fn staged_copy(
        &self,
        op: &'static str,
        buf: &Buffer,
        staging: &mut Pinned,
        len: usize,
        upload: bool,
    ) -> Result<()> {
        let rank = self.rank;
        self.order_after_current()?;
        let mode = if upload {
            AccessMode::Exclusive
        } else {
            AccessMode::Shared
        };
        // A stream-ordered buffer: the NCCL stream waits (on the GPU) for the work on it that
        // conflicts with the copy, and the copy becomes its newest use (as a collective).
        let order = buf.stream_order();
        if let Some(o) = &order {
            o.before(&self.stream, mode)
                .map_err(|source| CollectiveError::Device { rank, source })?;
        }
        let g = buf
            .access(mode)
            .acquire(self.opts.timeout)
            .map_err(|source| CollectiveError::Device { rank, source })?;
        let dptr = g.as_ptr() as u64;
        let s = self.cuda.cu_stream();
        let copied = if upload {
            // SAFETY: `dptr` is device memory of this context of `staging.bytes` bytes (the
            // length and type were checked); the pinned source lives until the copy completed.
            unsafe { cu::memcpy_htod_async(dptr, staging.bytes(len), s) }
        } else {
            // SAFETY: as above, in the other direction.
            unsafe { cu::memcpy_dtoh_async(staging.bytes(len), dptr, s) }
        };
        drop(g);
        if let Some(o) = order {
            o.after(&self.stream, mode);
        }
        copied.map_err(self.driver(if upload {
            "cuMemcpyHtoDAsync"
        } else {
            "cuMemcpyDtoHAsync"
        }))?;
        let ev = PooledEvent::acquire(&self.ctx)
            .map_err(|source| CollectiveError::Device { rank, source })?;
        ev.event()
            .record(&self.cuda)
            .map_err(self.driver("cuEventRecord"))?;
        let deadline = Instant::now() + self.opts.timeout;
        wait_host(
            &self.comm,
            ev.event(),
            op,
            u64::MAX,
            deadline,
            self.opts.timeout,
        )?;
        let current = self.current_stream();
        if current != self.stream {
            current
                .wait_event(&self.stream.record_event())
                .map_err(|source| CollectiveError::Device { rank, source })?;
        }
        Ok(())
    }

    /// The cached staging buffer, grown to at least `len` bytes (at least 1 MiB, doubling). A
    /// smaller one it replaces is kept until the communicator is dropped: `cuMemFreeHost` may
    /// synchronise the device, which must not happen while a peer's collective waits for us.
    fn staging(&self, len: usize) -> Result<Pinned> {
        let mut slot = super::comm::lock(&self.staging);
        match slot.0.take() {
            Some(p) if p.bytes >= len => Ok(p),
            old => {
                let grown = old.as_ref().map_or(0, |p| p.bytes.saturating_mul(2));
                if let Some(p) = old {
                    slot.1.push(p);
                }
                Pinned::new(len.max(grown).max(1 << 20)).map_err(self.driver("cuMemHostAlloc"))
            }
        }
    }

    /// Give the staging buffer back for the next copy; after a failed copy it is leaked (the
    /// copy may still use it).
    fn keep_staging(&self, staging: Pinned, ok: bool) {
        if ok {
            super::comm::lock(&self.staging).0 = Some(staging);
        } else {
            std::mem::forget(staging);
        }
    }

    /// Copy `data` into the device buffer `buf`, after the work of the current stream and the
    /// collectives issued before; returns when the copy has completed on the GPU (bounded by
    /// the timeout).
    pub fn copy_from_host<T: Element>(&self, buf: &Buffer, data: &[T]) -> Result<()> {
        self.check_host_copy::<T>("copy_from_host", buf, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let len = std::mem::size_of_val(data);
        let mut staging = self.staging(len)?;
        // SAFETY: `T` is plain data (`Element: Pod`), so its bytes may be read as `u8`.
        let src = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), len) };
        staging.bytes(len).copy_from_slice(src);
        let r = self.staged_copy("copy_from_host", buf, &mut staging, len, true);
        self.keep_staging(staging, r.is_ok());
        r
    }

    /// Copy the device buffer `buf` to the host, after the work of the current stream and the
    /// collectives issued before.
    pub fn copy_to_host<T: Element>(&self, buf: &Buffer) -> Result<Vec<T>> {
        self.check_host_copy::<T>("copy_to_host", buf, buf.len())?;
        let mut out = vec![T::default(); buf.len()];
        if out.is_empty() {
            return Ok(out);
        }
        let len = std::mem::size_of_val(out.as_slice());
        let mut staging = self.staging(len)?;
        let r = self.staged_copy("copy_to_host", buf, &mut staging, len, false);
        if r.is_ok() {
            // SAFETY: `T` is plain data (`Element: Pod`): any bytes are a valid `T`; `out` has
            // exactly `len` bytes.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), len) };
            dst.copy_from_slice(staging.bytes(len));
        }
        self.keep_staging(staging, r.is_ok());
        r.map(|()| out)
    }
}
