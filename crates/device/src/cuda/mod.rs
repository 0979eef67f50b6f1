//! CUDA streams and events (cargo feature `cuda`), over cudarc.
//!
//! - [`context`]: one `CudaContext` (the device's primary context) per device per process,
//!   shared by every stream, event and kernel module of the process, with cudarc's event
//!   tracking disabled: the runtime orders work itself with [`Stream`]/[`Event`](crate::Event), and cudarc's
//!   tracking would record an event per slice use and synchronise the whole context when the
//!   first stream is created (a deadlock while a peer thread's NCCL kernel spins).
//! - [`Stream::cuda`]: a non-blocking CUDA stream behind the same [`Stream`] type as the CPU
//!   streams. [`Event::record`](crate::Event::record) on it records a CUDA event taken from a per-device pool (as
//!   PyTorch's `CUDAEvent` pool: no `cuEventCreate`/`cuEventDestroy` per record),
//!   [`Stream::wait_event`] between CUDA streams is `cuStreamWaitEvent` (GPU-side, the host does
//!   not block), and every host wait (`synchronize`) polls `cuEventQuery` up to a timeout
//!   instead of blocking in `cuEventSynchronize` without one.
//! - Device buffers ([`CudaStorage`], [`Buffer::cuda_zeros`](crate::Buffer::cuda_zeros)) are
//!   stream-ordered: each storage's [`StreamOrder`](crate::StreamOrder) keeps the events of its
//!   last write and of the reads since, work on them is issued through
//!   [`Buffer::use_on`](crate::Buffer::use_on) (the stream waits on the GPU for the conflicting
//!   events, an event is recorded after the work), and dropping one frees the memory only once
//!   those events completed (a reaper thread queries them). Host access is an explicit async
//!   copy into page-locked memory ([`PinnedStorage`], [`Buffer::pinned_zeros`](crate::Buffer::pinned_zeros),
//!   [`Buffer::copy_to_host_async`](crate::Buffer::copy_to_host_async)), which holds an access
//!   ticket on the pinned buffer until the copy's event completes, so the host's `read()` of it
//!   waits for the copy. Freed pinned memory is kept for reuse by size class (as PyTorch's
//!   `CachingHostAllocator`: `cuMemFreeHost` synchronises the device), so a steady state
//!   allocates none ([`pinned_cache_stats`], [`empty_pinned_cache`]).
//! - [`libs`]: finds NVRTC and NCCL in Python packages' `site-packages` when they are not on the
//!   loader path.
//!
//! Because event tracking is off, a cudarc `CudaSlice` allocated through these contexts does
//! not order itself across streams: make the consuming stream [`wait_event`](Stream::wait_event)
//! on an event recorded after the producing work, and keep the slice alive until the last work
//! that uses it has completed.

mod buffers;
mod events;
pub mod libs;
mod storage;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use crate::block_cache::BlockCacheStats;
pub use crate::reaper::{pending_releases, wait_for_releases};
pub use cudarc::driver::{CudaContext, CudaStream};
pub(crate) use events::CudaPoint;
pub use events::{pooled_events, PooledEvent};
pub use storage::{empty_pinned_cache, pinned_cache_stats, CudaStorage, PinnedStorage};

use crate::{Device, DeviceError, Stream, DEFAULT_TIMEOUT};

/// The process's contexts, by device ordinal.
static CONTEXTS: Mutex<Vec<Option<Arc<CudaContext>>>> = Mutex::new(Vec::new());

pub(crate) fn driver_error(op: &'static str, e: impl std::fmt::Debug) -> DeviceError {
    DeviceError::Cuda {
        op,
        message: format!("{e:?}"),
    }
}

/// Whether the CUDA driver library can be loaded and how many devices it sees; the error says
/// why not (no `libcuda.so`, no device, a driver error). Tests print it when they skip.
///
/// # Errors
/// [`DeviceError::LibraryNotFound`] without a driver, [`DeviceError::Cuda`] when it fails or
/// sees no device.
pub fn device_count() -> Result<usize, DeviceError> {
    // SAFETY: only tries to dlopen the driver library by its names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(DeviceError::LibraryNotFound {
            library: "libcuda.so (the CUDA driver)".into(),
            detail: "not on the loader path".into(),
        });
    }
    let n = catch_unwind(|| {
        cudarc::driver::result::init()?;
        CudaContext::device_count()
    })
    .map_err(|_| driver_error("cuInit", "panicked while loading the driver"))?
    .map_err(|e| driver_error("cuDeviceGetCount", e))?;
    if n <= 0 {
        return Err(driver_error("cuDeviceGetCount", "no CUDA device"));
    }
    Ok(n as usize)
}

/// The context bound to the calling thread when it is one of [`context`]'s, else device 0's:
/// where page-locked host memory is allocated (portable, so any device copies through it),
/// without creating a context on device 0 in a process whose work is on another device.
///
/// # Errors
/// As [`context`].
pub(crate) fn current_context() -> Result<Arc<CudaContext>, DeviceError> {
    if let Ok(Some(cur)) = cudarc::driver::result::ctx::get_current() {
        let all = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ctx) = all.iter().flatten().find(|c| c.cu_ctx() == cur) {
            return Ok(ctx.clone());
        }
    }
    context(0)
}

/// The process's context on device `ordinal` (its primary context), created on first use with
/// event tracking disabled. Every caller gets the same `Arc`.
///
/// # Errors
/// As [`device_count`]; [`DeviceError::InvalidArgument`] for an ordinal past the last device.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>, DeviceError> {
    let mut all = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(Some(ctx)) = all.get(ordinal) {
        return Ok(ctx.clone());
    }
    let count = device_count()?;
    if ordinal >= count {
        return Err(DeviceError::InvalidArgument(format!(
            "cuda:{ordinal} does not exist ({count} CUDA devices)"
        )));
    }
    let ctx = catch_unwind(AssertUnwindSafe(|| CudaContext::new(ordinal)))
        .map_err(|_| driver_error("cuDevicePrimaryCtxRetain", "panicked"))?
        .map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
    // SAFETY: the context was just created, so no slice of it exists whose tracking could be
    // left half-on; from here on the runtime orders cross-stream work with events (module docs).
    unsafe { ctx.disable_event_tracking() };
    if all.len() <= ordinal {
        all.resize(ordinal + 1, None);
    }
    all[ordinal] = Some(ctx.clone());
    Ok(ctx)
}

impl Stream {
    /// A new non-blocking CUDA stream on device `ordinal` with the [`DEFAULT_TIMEOUT`] for host
    /// waits.
    ///
    /// # Errors
    /// As [`context`]; [`DeviceError::Cuda`] when the stream cannot be created.
    pub fn cuda(ordinal: usize, name: impl Into<String>) -> Result<Stream, DeviceError> {
        Stream::cuda_with_timeout(ordinal, name, DEFAULT_TIMEOUT)
    }

    /// A new non-blocking CUDA stream whose host waits (`synchronize`, waits on CPU events) are
    /// bounded by `timeout`.
    ///
    /// # Errors
    /// As [`Stream::cuda`].
    pub fn cuda_with_timeout(
        ordinal: usize,
        name: impl Into<String>,
        timeout: Duration,
    ) -> Result<Stream, DeviceError> {
        let ctx = context(ordinal)?;
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("cuStreamCreate", e))?;
        Ok(Stream::from_cuda(
            name.into(),
            Device::Cuda(ordinal),
            timeout,
            stream,
        ))
    }
}
