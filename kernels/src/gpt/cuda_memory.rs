//! Where [`CudaOps`] takes device memory from: the process's caching allocator of the device
//! (`fsdp_allocator`'s [`CudaAllocator`], PyTorch's `backend:native`, the default) or the CUDA
//! driver's stream-ordered pool (`cuMemAllocAsync`, PyTorch's `backend:cudaMallocAsync`), as
//! PyTorch's allocator settings in the environment (`PYTORCH_ALLOC_CONF`,
//! `PYTORCH_CUDA_ALLOC_CONF`) choose.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, PoisonError};

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use fsdp_allocator::cuda::{CudaAllocator, CudaSource};
use fsdp_allocator::{
    alloc_conf_from_env, AllocError, AllocatorBackend, AllocatorConfig, MemoryStats,
};

use fsdp_device::{AccessMode, Buffer, DType};

use super::cuda::{copy_error, CudaBuf, CudaOps};
use super::memory::{bytes_of, Counted};
use crate::KernelError;

/// Where a [`CudaOps`] takes its buffers from.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum CudaMemory {
    /// A caching allocator over the device's memory (PyTorch's `backend:native`): blocks
    /// cached per stream, PyTorch's statistics (`memory_stats`, `num_alloc_retries`) and
    /// snapshots. A buffer freed goes back to its stream's pool at once; later work on that
    /// stream reuses it in stream order, as with the driver's pool.
    Caching(CudaAllocator),
    /// The CUDA driver's stream-ordered allocator on the device's default memory pool
    /// (`cuMemAllocAsync`/`cuMemFreeAsync`; PyTorch's `backend:cudaMallocAsync`), which keeps
    /// freed memory between steps (its release threshold raised while the operations live).
    Driver,
}

/// The process's caching allocators, one per device (as PyTorch's), made on first use.
static DEVICE_ALLOCATORS: Mutex<BTreeMap<usize, CudaAllocator>> = Mutex::new(BTreeMap::new());

impl CudaMemory {
    /// The memory PyTorch's allocator settings in the environment choose for GPU `ordinal`:
    /// [`CudaMemory::Driver`] under `backend:cudaMallocAsync`, else the device's caching
    /// allocator ([`device_allocator`](Self::device_allocator)).
    ///
    /// # Errors
    /// [`KernelError::Alloc`] for malformed settings (naming the variable's key and value) or
    /// a device the allocator cannot open.
    pub fn from_env(ordinal: usize) -> Result<CudaMemory, KernelError> {
        match alloc_conf_from_env()? {
            Some((var, text)) => CudaMemory::from_pytorch_conf(ordinal, &text).map_err(|e| {
                KernelError::InvalidArgument {
                    kernel: "gpt",
                    reason: format!("{var}=`{text}`: {e}"),
                }
            }),
            None => CudaMemory::from_pytorch_conf(ordinal, ""),
        }
    }

    /// The memory PyTorch's allocator settings `text` choose for GPU `ordinal` (as
    /// [`from_env`](Self::from_env) does with the environment's): the driver's pool under
    /// `backend:cudaMallocAsync`, else the device's caching allocator with those settings —
    /// made now, or the one the process made before, which must have the same settings.
    ///
    /// # Errors
    /// [`KernelError::Alloc`] for malformed settings (naming the key and value), a device the
    /// allocator cannot open, or the device's allocator made before with other settings.
    pub fn from_pytorch_conf(ordinal: usize, text: &str) -> Result<CudaMemory, KernelError> {
        let (config, backend) = AllocatorConfig::from_pytorch_conf_with_backend(text)?;
        if backend == AllocatorBackend::CudaMallocAsync {
            return Ok(CudaMemory::Driver);
        }
        CudaMemory::caching(ordinal, config)
    }

    /// The device's caching allocator with the settings `config`: made now, or the one the
    /// process made before, which must have the same settings.
    ///
    /// # Errors
    /// [`KernelError::Alloc`] for a device the allocator cannot open, or the device's
    /// allocator made before with other settings.
    pub fn caching(ordinal: usize, config: AllocatorConfig) -> Result<CudaMemory, KernelError> {
        let alloc = allocator_of(ordinal, || Ok(config))?;
        if *alloc.config() != config {
            let conf = |c: &AllocatorConfig| c.to_pytorch_conf().unwrap_or_default();
            return Err(AllocError::InvalidConfig(format!(
                "the caching allocator of cuda:{ordinal} was made with other settings (`{}`) \
                 than `{}`: a process has one allocator per device",
                conf(alloc.config()),
                conf(&config)
            ))
            .into());
        }
        Ok(CudaMemory::Caching(alloc))
    }

    /// The process's caching allocator of GPU `ordinal`, shared by every thread and every
    /// [`CudaOps`] of the device; made on first use with the settings of the environment
    /// ([`AllocatorConfig::from_env`]: `expandable_segments`, `max_split_size_mb`, …).
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn device_allocator(ordinal: usize) -> Result<CudaAllocator, KernelError> {
        allocator_of(ordinal, || Ok(AllocatorConfig::from_env_with_backend()?.0))
    }

    /// The caching allocator, if this is one.
    pub fn allocator(&self) -> Option<&CudaAllocator> {
        match self {
            CudaMemory::Caching(a) => Some(a),
            CudaMemory::Driver => None,
        }
    }
}

/// The process's allocator of GPU `ordinal`, made with `config()` if there is none yet.
fn allocator_of(
    ordinal: usize,
    config: impl FnOnce() -> Result<AllocatorConfig, KernelError>,
) -> Result<CudaAllocator, KernelError> {
    let mut all = DEVICE_ALLOCATORS
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(a) = all.get(&ordinal) {
        return Ok(a.clone());
    }
    let alloc = CudaAllocator::new(CudaSource::new(ordinal)?, config()?)?;
    all.insert(ordinal, alloc.clone());
    Ok(alloc)
}

impl fmt::Display for CudaMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaMemory::Caching(a) => {
                let conf = a.config().to_pytorch_conf().unwrap_or_default();
                write!(f, "the caching allocator of {} (backend:native", a.device())?;
                if !conf.is_empty() {
                    write!(f, ",{conf}")?;
                }
                f.write_str(")")
            }
            CudaMemory::Driver => {
                f.write_str("the CUDA driver's stream-ordered pool (backend:cudaMallocAsync)")
            }
        }
    }
}

/// What the caching allocator says of its memory, for a run's summary: the peak of the bytes
/// handed out (rounded to its blocks) and of the bytes reserved from the device, and its
/// retries and failures.
pub fn describe_stats(stats: &MemoryStats) -> String {
    format!(
        "caching allocator: peak allocated {} bytes, peak reserved {} bytes, num_alloc_retries \
         {}, num_ooms {}",
        stats.allocated_bytes.all.peak,
        stats.reserved_bytes.all.peak,
        stats.num_alloc_retries,
        stats.num_ooms
    )
}

impl CudaOps {
    /// `len` elements of `T` on the operations' stream, counted in their memory: zeros when
    /// `zeroed`, else whatever bits the memory held.
    ///
    /// # Safety
    /// Without `zeroed`, the caller writes every element before anything reads it (any bits
    /// must be a valid `T`, as for every `DeviceRepr` number).
    pub(super) unsafe fn device_slice<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        zeroed: bool,
    ) -> Result<Counted<CudaSlice<T>>, KernelError> {
        let bytes = bytes_of::<T>(len);
        match &self.memory_source {
            CudaMemory::Driver => {
                let slice = if zeroed {
                    self.cuda.alloc_zeros::<T>(len)
                } else {
                    // SAFETY: the caller's contract.
                    unsafe { self.cuda.alloc::<T>(len) }
                }
                .map_err(|e| copy_error("cuMemAllocAsync", e))?;
                Ok(Counted::new(slice, bytes, &self.memory))
            }
            CudaMemory::Caching(alloc) => {
                let block = alloc.allocate(bytes as usize, &self.cuda)?;
                // SAFETY: the block is device memory of this stream's context (the allocator's
                // source is the process's context of the stream's device) of at least `bytes`
                // bytes, aligned for any `T` (512 bytes), owned by `block` until it drops. The
                // slice never frees it: the release leaks the slice (cudarc's drop would
                // `cuMemFreeAsync` the address) before the block goes back to the allocator,
                // and nothing fallible runs before the `Counted` owns both.
                let slice = unsafe { self.cuda.upgrade_device_ptr::<T>(block.addr(), len) };
                let mut counted = Counted::with_release(
                    slice,
                    bytes,
                    &self.memory,
                    move |slice: CudaSlice<T>| {
                        // Work enqueued before this point on the stream still runs on the
                        // block, and the block returns to this stream's pool, so only later
                        // work on the same stream can reuse it (users on other streams are
                        // ordered before by events, as they are before a `cuMemFreeAsync`).
                        let _ = slice.leak();
                        drop(block);
                    },
                );
                if zeroed {
                    self.cuda
                        .memset_zeros(&mut *counted)
                        .map_err(|e| copy_error("cuMemsetD8Async", e))?;
                }
                Ok(counted)
            }
        }
    }

    /// `data` copied into a new buffer of the operations' stream, counted in their memory.
    pub(super) fn upload_slice<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        data: &[T],
    ) -> Result<Counted<CudaSlice<T>>, KernelError> {
        // SAFETY: the copy below writes every element before anything can read one.
        let mut b = unsafe { self.device_slice::<T>(data.len(), false) }?;
        self.cuda
            .memcpy_htod(data, &mut *b)
            .map_err(|e| copy_error("cuMemcpyHtoDAsync", e))?;
        Ok(b)
    }

    /// A stream-ordered `f32` CUDA buffer of another owner (an FSDP engine's unsharded
    /// parameter or gradient, [`fsdp_device::Buffer::use_on`]) as a buffer of these
    /// operations, without a copy. The operations' stream first waits for the buffer's
    /// conflicting work (`mode`: [`AccessMode::Shared`] to read it,
    /// [`AccessMode::Exclusive`] to write it); the use is recorded in the buffer's stream order
    /// when the view is dropped, after every operation issued on it by then, so the owner
    /// frees or reuses the memory only after them. The view is not counted in
    /// [`memory`](super::GptOps::memory): its owner counts it.
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] for a buffer that is not a stream-ordered `f32` buffer
    /// of the operations' device; the stream order's errors.
    pub fn view(&self, buf: &Buffer, mode: AccessMode) -> Result<CudaBuf, KernelError> {
        self.view_as::<f32>(buf, DType::F32, mode)
    }

    /// A stream-ordered `f64` CUDA buffer of another owner (an FSDP engine's step loss) as the
    /// operations' step scalars, to write (`loss_accumulate`), without a copy, as
    /// [`view`](Self::view) sees an `f32` one.
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] for a buffer that is not a stream-ordered `f64` buffer
    /// of the operations' device; the stream order's errors.
    pub fn scalars_view(&self, buf: &Buffer) -> Result<super::CudaScalars, KernelError> {
        self.view_as::<f64>(buf, DType::F64, AccessMode::Exclusive)
    }

    /// [`view`](Self::view) of a buffer of `T`, which is `dtype`.
    fn view_as<T: DeviceRepr>(
        &self,
        buf: &Buffer,
        dtype: DType,
        mode: AccessMode,
    ) -> Result<Counted<CudaSlice<T>>, KernelError> {
        if buf.dtype() != dtype
            || buf.device() != self.stream.device()
            || buf.stream_order().is_none()
        {
            return Err(KernelError::InvalidArgument {
                kernel: "gpt",
                reason: format!(
                    "a view needs a stream-ordered {dtype} buffer of {}, not a{} {} buffer on {}",
                    self.stream.device(),
                    if buf.stream_order().is_some() {
                        ""
                    } else {
                        "n unordered"
                    },
                    buf.dtype(),
                    buf.device()
                ),
            });
        }
        let used = buf.use_on(&self.stream, mode)?;
        // SAFETY: `used` holds a clone of the buffer, so its memory — `buf.len()` elements of
        // `T` (its dtype, checked above) on this stream's device — lives until the release
        // below has recorded the use; this stream waited for the buffer's conflicting work.
        // The slice never frees the address: the release leaks it before recording the use.
        let slice = unsafe {
            self.cuda
                .upgrade_device_ptr::<T>(used.device_ptr(), buf.len())
        };
        Ok(Counted::borrowed(slice, &self.memory, move |slice| {
            let _ = slice.leak();
            used.finish();
        }))
    }

    /// Where the operations take their buffers from.
    pub fn memory_source(&self) -> &CudaMemory {
        &self.memory_source
    }
}
