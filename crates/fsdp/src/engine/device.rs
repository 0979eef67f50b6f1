//! [`ComputeDevice`]: the engine on a device (its documentation).

use std::sync::Arc;
use std::time::Duration;

use fsdp_allocator::{AllocatorConfig, HostAllocator, HostSource, MemoryStats};
use fsdp_device::{Buffer, DType, Device, Stream};

use super::pool::{MemoryPool, OrderedPool};
use crate::FsdpError;

/// The longest buffer a dry run's device copies back to the host as values (zeros): the
/// decisions' scalars and shorter.
const DRY_RUN_READ_BACK: usize = 64;

/// Which implementation of the device's operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    HostTwin,
    /// A dry run's ([`ComputeDevice::dry_run`]): buffers of the meta device, operations that
    /// only allocate what CUDA's allocate.
    Meta,
    #[cfg(feature = "cuda")]
    Cuda,
}

/// Where the engine keeps its buffers and where the model computes: PyTorch FSDP's `device_id`
/// ([`Fsdp::new_on`](super::Fsdp::new_on)). Cheap to clone: clones share the memory and
/// streams.
///
/// The working set of a pass — the unsharded parameters and gradients — lives in the device's
/// memory and the model computes there. The shards, the gradient shards and the optimizer
/// state live there too, and the optimizer steps there (fused AdamW or SGD, each run of
/// parameter groups with its options), unless
/// [`FsdpConfig::offload_params`](super::FsdpConfig::offload_params) keeps them in host memory
/// (PyTorch's `CPUOffload(offload_params=True)`), where the optimizer steps as on the host:
///
/// - **unshard**: the shard (cast to `param_dtype`: on the device, or offloaded on the host and
///   copied to the device on its transfer stream) is all-gathered on the device into a buffer
///   of the device's caching allocator; an unsharded (`F = 1`) unit's parameters are the shard
///   itself (or its cast), offloaded a copy;
/// - **views**: the model reads the unsharded parameters and writes its gradients as device
///   [`Buffer`]s ([`Params::buffer`](super::Params::buffer),
///   [`Grads::grad_buffer`](super::Grads::grad_buffer)), in `param_dtype`, and issues its work
///   on the device's compute stream ([`Params::compute_stream`](super::Params::compute_stream));
/// - **reduce**: the `f32` gradient is zeroed on the device, rounded there to `param_dtype`
///   and cast to `reduce_dtype` when the policy says so, reduce-scattered (and all-reduced
///   over replicas) on the device, and added into the gradient shard there (offloaded: copied
///   to host memory at the end of backward and added there);
/// - **the optimizer side**: the step, zeroing, the gradient norm (one wait on the host for
///   the sums of squares) and clipping run on the device's compute stream; state dicts and
///   sharded checkpoints copy the shards and the optimizer state to host memory, and loading
///   an optimizer state copies it back.
///
/// Every buffer on the device is stream-ordered ([`Buffer::stream_ordered`]): work on it is
/// ordered by events across the compute stream, the transfer stream and the communicator's
/// stream, and its memory returns to the allocator only after the last work on it (held
/// references, never `record_stream`, whatever [`FsdpConfig::cross_stream`](super::FsdpConfig::cross_stream) says). The communicator must order such buffers
/// ([`Communicator::orders_stream_ordered_buffers`](fsdp_collectives::Communicator::orders_stream_ordered_buffers):
/// the ring backends and the CUDA ring) and live on the same device.
///
/// Two devices: `ComputeDevice::cuda` (feature `cuda`: the caching allocator on the GPU,
/// CUDA streams, `cuMemcpy*Async` through pinned staging buffers, the casts of `fsdp-kernels`),
/// and [`ComputeDevice::host_twin`], the same engine code on host memory ordered by streams
/// instead of access tickets, with CPU worker streams and each operation a stream task: the
/// reference every device run is tested against without a GPU.
///
/// The division of gradients by the data-parallel size
/// ([`GradientDivide::DataParallelSize`](super::GradientDivide)) runs on the device too: the
/// pre-multiplication or pre-division of the reduction's input, the post-division of its
/// result, each rounded to the reduce dtype as on the host.
///
/// So does the grad scaler's loss scaling of the unsharded gradients. With the shards on the
/// device its state lives there too: the unscaling of the gradient shards, the overflow check
/// and the decision to step or skip run there without the host waiting (the step count and
/// the scaler's numbers reach the host one step late, as PyTorch's fused optimizers take
/// `found_inf` on the GPU); offloaded, the unscaling and the check run on the host.
///
/// So does the optimizer side with the shards on the device: AdamW, SGD and AnyPrecisionAdamW
/// (on CUDA with one state dtype, f32 or bf16: the fused kernel's), the gradient norm and
/// clipping by it ([`Fsdp::clip_grad_norm_async`](super::Fsdp::clip_grad_norm_async) reads
/// nothing on the host).
///
/// Not on a device (refused by name when the engine is built): communicators that do not
/// order stream-ordered buffers, dry runs.
#[derive(Clone)]
pub struct ComputeDevice {
    pub(super) kind: Kind,
    pool: Arc<dyn MemoryPool>,
    compute: Stream,
    transfer: Stream,
    /// The host twin's latency: each operation first waits this long on its stream.
    latency: Option<Duration>,
    /// The caching allocator on the GPU (a handle to the pool's).
    #[cfg(feature = "cuda")]
    cuda_alloc: Option<fsdp_allocator::cuda::CudaAllocator>,
}

impl std::fmt::Debug for ComputeDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComputeDevice")
            .field("kind", &self.kind)
            .field("device", &self.device())
            .finish()
    }
}

impl ComputeDevice {
    /// The host twin of a device: host memory of a caching allocator of `capacity` bytes with
    /// the options `config`, made stream-ordered, and two CPU worker streams (compute and
    /// transfer) on which every operation runs as a task. The same engine code as on a GPU,
    /// with the host's arithmetic: a run on it gives the host engine's bits.
    ///
    /// # Errors
    /// An invalid allocator configuration.
    pub fn host_twin(capacity: usize, config: AllocatorConfig) -> Result<Self, FsdpError> {
        let alloc = HostAllocator::new(HostSource::new(capacity), config)?;
        Ok(ComputeDevice {
            kind: Kind::HostTwin,
            pool: Arc::new(OrderedPool::new(alloc)),
            compute: Stream::cpu("device compute"),
            transfer: Stream::cpu("device transfer"),
            latency: None,
            #[cfg(feature = "cuda")]
            cuda_alloc: None,
        })
    }

    /// [`host_twin`](Self::host_twin) whose every operation first waits `latency` on its
    /// stream, as a GPU's work runs long after it was issued: work that is not ordered after
    /// it (a missing event) then sees the old data, and a test shows it.
    ///
    /// # Errors
    /// As [`host_twin`](Self::host_twin).
    pub fn host_twin_with_latency(
        capacity: usize,
        config: AllocatorConfig,
        latency: Duration,
    ) -> Result<Self, FsdpError> {
        let mut dev = ComputeDevice::host_twin(capacity, config)?;
        dev.latency = Some(latency);
        Ok(dev)
    }

    /// The device of a dry run (`fsdp::plan`'s plans of the engine on a device): the memory of
    /// `pool` (meta buffers: sizes, no bytes) and inline streams; its operations move no data
    /// and allocate the temporaries the CUDA device's allocate, so that the engine's buffers
    /// on it are those on a GPU whose work keeps up with the host. What it copies to the host
    /// reads as zeros.
    pub(crate) fn dry_run(pool: Arc<dyn MemoryPool>) -> Self {
        ComputeDevice {
            kind: Kind::Meta,
            pool,
            compute: Stream::inline("dry-run compute"),
            transfer: Stream::inline("dry-run transfer"),
            latency: None,
            #[cfg(feature = "cuda")]
            cuda_alloc: None,
        }
    }

    /// Whether this is a dry run's device ([`dry_run`](Self::dry_run)).
    pub(crate) fn is_dry_run(&self) -> bool {
        self.kind == Kind::Meta
    }

    /// Whether `b` is one of this device's buffers (stream-ordered; a dry run's are on the
    /// meta device) rather than host memory.
    pub(crate) fn holds(&self, b: &Buffer) -> bool {
        b.stream_order().is_some() || (self.kind == Kind::Meta && b.device() == Device::Meta)
    }

    /// The host twin's latency before an operation on `stream`.
    pub(super) fn delay(&self, stream: &Stream) -> Result<(), FsdpError> {
        if let Some(d) = self.latency {
            stream.enqueue(move || std::thread::sleep(d))?;
        }
        Ok(())
    }

    /// GPU `ordinal`: a caching allocator of its memory with the options `config` (PyTorch's
    /// `PYTORCH_CUDA_ALLOC_CONF`), made stream-ordered, and two CUDA streams (compute and
    /// transfer).
    ///
    /// # Errors
    /// No CUDA driver or device ([`fsdp_allocator::AllocError::NoDevice`]), an invalid
    /// configuration, a stream that cannot be created.
    #[cfg(feature = "cuda")]
    pub fn cuda(ordinal: usize, config: AllocatorConfig) -> Result<Self, FsdpError> {
        ComputeDevice::cuda_with_timeout(ordinal, config, fsdp_device::DEFAULT_TIMEOUT)
    }

    /// [`cuda`](Self::cuda) whose streams bound their host waits by `timeout` (a program's
    /// `--timeout`) instead of [`DEFAULT_TIMEOUT`](fsdp_device::DEFAULT_TIMEOUT).
    ///
    /// # Errors
    /// As [`cuda`](Self::cuda).
    #[cfg(feature = "cuda")]
    pub fn cuda_with_timeout(
        ordinal: usize,
        config: AllocatorConfig,
        timeout: Duration,
    ) -> Result<Self, FsdpError> {
        use fsdp_allocator::cuda::{CudaAllocator, CudaSource};
        let alloc = CudaAllocator::new(CudaSource::new(ordinal)?, config)?;
        Ok(ComputeDevice {
            kind: Kind::Cuda,
            pool: Arc::new(OrderedPool::new(alloc.clone())),
            compute: Stream::cuda_with_timeout(ordinal, "device compute", timeout)?,
            transfer: Stream::cuda_with_timeout(ordinal, "device transfer", timeout)?,
            latency: None,
            cuda_alloc: Some(alloc),
        })
    }

    /// The device of its memory and streams.
    pub fn device(&self) -> Device {
        self.pool.device()
    }

    /// On a GPU, the caching allocator the engine's buffers come from (a handle to it), for a
    /// model that takes its own buffers (activations) from the same memory, so that one
    /// allocator's statistics count them all: e.g. `fsdp-kernels`' `CudaOps::with_memory`.
    /// `None` on the host twin.
    #[cfg(feature = "cuda")]
    pub fn cuda_allocator(&self) -> Option<&fsdp_allocator::cuda::CudaAllocator> {
        self.cuda_alloc.as_ref()
    }

    /// The stream the model's work is issued on.
    pub fn compute_stream(&self) -> &Stream {
        &self.compute
    }

    /// The stream of the copies between host and device.
    pub fn transfer_stream(&self) -> &Stream {
        &self.transfer
    }

    /// The device allocator's statistics (PyTorch's `torch.cuda.memory_stats()`).
    pub fn memory_stats(&self) -> MemoryStats {
        self.pool.memory_stats()
    }

    /// A stream-ordered buffer of `numel` elements of `dtype` on the device, allocated on
    /// `stream` (its contents are undefined until written).
    ///
    /// # Errors
    /// Out of memory, an invalid size.
    pub fn alloc(&self, dtype: DType, numel: usize, stream: &Stream) -> Result<Buffer, FsdpError> {
        self.pool.allocate(dtype, numel, stream, None)
    }

    /// A new device buffer holding the host buffer `host`'s elements, copied on `stream` after
    /// the host work issued on `host` before the call (on CUDA through a pinned staging buffer
    /// filled on the host).
    ///
    /// # Errors
    /// A buffer that is not in host memory, out of memory, a failing copy.
    pub fn copy_from_host(&self, host: &Buffer, stream: &Stream) -> Result<Buffer, FsdpError> {
        let dst = self.alloc(host.dtype(), host.len(), stream)?;
        match self.kind {
            Kind::Meta => {}
            Kind::HostTwin => {
                self.delay(stream)?;
                dst.copy_from_host_async(host, stream)?;
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => {
                let pinned = Buffer::pinned_zeros(host.dtype(), host.len())?;
                copy_host(host, &pinned)?;
                dst.copy_from_host_async(&pinned, stream)?;
            }
        }
        Ok(dst)
    }

    /// A new host buffer that receives the device buffer `dev`'s elements, copied on `stream`
    /// after the work on `dev` that conflicts with a read: host reads of it wait for the copy
    /// (on CUDA it is pinned).
    ///
    /// # Errors
    /// A buffer that is not on this device, a failing copy.
    pub fn copy_to_host(&self, dev: &Buffer, stream: &Stream) -> Result<Buffer, FsdpError> {
        Ok(self.copy_to_host_event(dev, stream)?.0)
    }

    /// [`copy_to_host`](Self::copy_to_host), with the copy's event.
    pub(crate) fn copy_to_host_event(
        &self,
        dev: &Buffer,
        stream: &Stream,
    ) -> Result<(Buffer, fsdp_device::Event), FsdpError> {
        let out = match self.kind {
            Kind::Meta => {
                // Scalars, which the engine reads (a norm, a loss, a decision), as host zeros;
                // anything larger (reduced gradients, which a dry run never reads) as a meta
                // buffer: a plan allocates nothing in proportion to the model.
                let out = if dev.len() <= DRY_RUN_READ_BACK {
                    Buffer::zeros(dev.dtype(), dev.len())?
                } else {
                    Buffer::meta(dev.dtype(), dev.len())?
                };
                return Ok((out, stream.record_event()));
            }
            Kind::HostTwin => Buffer::zeros(dev.dtype(), dev.len())?,
            #[cfg(feature = "cuda")]
            Kind::Cuda => Buffer::pinned_zeros(dev.dtype(), dev.len())?,
        };
        self.delay(stream)?;
        let copied = dev.copy_to_host_async(&out, stream)?;
        Ok((out, copied))
    }

    /// Zero the device buffer `buf` on `stream`.
    ///
    /// # Errors
    /// A buffer that is not on this device, a failing memset.
    pub fn zero(&self, buf: &Buffer, stream: &Stream) -> Result<(), FsdpError> {
        if self.kind == Kind::Meta {
            return Ok(());
        }
        self.delay(stream)?;
        buf.zero_async(stream)?;
        Ok(())
    }

    /// Write into `dst` (of the reduce dtype) the `f32` gradient `src` rounded to `param` and
    /// then to `dst`'s dtype, on `stream` (FSDP's mixed-precision reduction input, without a
    /// division): the chain of casts `f32 → param → dst`, without the identities.
    pub(crate) fn round_into(
        &self,
        src: &Buffer,
        dst: &Buffer,
        param: DType,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        if src.dtype() != DType::F32 || src.len() != dst.len() {
            return Err(super::comm_context::internal(
                "a reduction input of another length or from a gradient that is not f32",
            ));
        }
        let r = dst.dtype();
        if param != DType::F32 && param != r {
            let tmp = self.alloc(param, src.len(), stream)?;
            self.cast(src, &tmp, stream)?;
            return self.cast(&tmp, dst, stream);
        }
        if r == DType::F32 {
            return self.copy(src, dst, stream);
        }
        self.cast(src, dst, stream)
    }

    /// Copy the device buffer `src` into `dst` (same type and length) on `stream`.
    pub(crate) fn copy(
        &self,
        src: &Buffer,
        dst: &Buffer,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        if self.kind != Kind::Meta {
            self.delay(stream)?;
            dst.copy_from_device_async(src, stream)?;
        }
        Ok(())
    }

    /// Cast `src` into `dst` (distinct element types) on `stream`.
    pub(crate) fn cast(
        &self,
        src: &Buffer,
        dst: &Buffer,
        stream: &Stream,
    ) -> Result<(), FsdpError> {
        match self.kind {
            Kind::Meta => {}
            Kind::HostTwin => {
                self.delay(stream)?;
                dst.cast_from_async(src, stream)?;
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda => {
                fsdp_kernels::launch::cast_buffer(src, dst, stream).map_err(|e| {
                    FsdpError::Device(fsdp_device::DeviceError::Cuda {
                        op: "cast kernel",
                        message: e.to_string(),
                    })
                })?;
            }
        }
        Ok(())
    }

    /// The sticky error of the device's streams, if a task or the device failed.
    ///
    /// # Errors
    /// That error.
    pub fn check(&self) -> Result<(), FsdpError> {
        for s in [&self.compute, &self.transfer] {
            if let Some(e) = s.error() {
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Wait on the host for everything issued on the device's streams (each up to its
    /// timeout), then report their errors.
    ///
    /// # Errors
    /// A stream that failed or did not finish within its timeout.
    pub fn synchronize(&self) -> Result<(), FsdpError> {
        self.compute.synchronize()?;
        self.transfer.synchronize()?;
        self.check()
    }
}

/// Copy the host buffer `src` into the host buffer `dst` (same type and length) on the host,
/// after the work issued on either.
#[cfg(feature = "cuda")]
fn copy_host(src: &Buffer, dst: &Buffer) -> Result<(), FsdpError> {
    fn run<T: fsdp_device::Element>(src: &Buffer, dst: &Buffer) -> Result<(), FsdpError> {
        dst.write::<T>()?.copy_from_slice(&src.read::<T>()?);
        Ok(())
    }
    match src.dtype() {
        DType::F32 => run::<f32>(src, dst),
        DType::BF16 => run::<half::bf16>(src, dst),
        DType::F16 => run::<half::f16>(src, dst),
        DType::F64 => run::<f64>(src, dst),
    }
}
