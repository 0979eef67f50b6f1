//! [`CudaOps`]: the operations of one CUDA stream, their buffers and how they are made
//! (their [`GptOps`](super::GptOps) implementation is in `cuda.rs`).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use fsdp_device::Stream;
use half::{bf16, f16};

use super::cuda_memory::CudaMemory;
use super::cuda_pool::hold_pool_memory;
use super::cuda_products::Products;
use super::cuda_step::PinnedPool;
use super::memory::{Counted, MemoryCounter};
use super::products::Kept;
use super::written::Written;
use crate::gemm::Blas;
use crate::host::CastFloat;
use crate::{launch, KernelError};

/// [`GptOps`](super::GptOps) on one CUDA stream: the layer kernels through [`launch`] and the products
/// through cuBLAS ([`Blas`], bound to the same stream), buffers `CudaSlice`s of the stream's
/// context taken from the device's caching allocator or the driver's pool ([`CudaMemory`]).
/// Every operation is enqueued on that one stream, so operations run in the order they are
/// called; only [`download`](super::GptOps::download) waits (for the stream, within the
/// [`Stream`]'s timeout).
pub struct CudaOps {
    pub(super) stream: Stream,
    pub(super) cuda: Arc<CudaStream>,
    pub(super) blas: Blas,
    pub(super) products: Products,
    /// The bf16 copies of a product's two operands ([`Products::Bf16`]), kept between products
    /// and grown as needed (operations run in stream order, so one pair serves every product).
    pub(super) operands: Mutex<[Kept<CudaSlice<bf16>>; 2]>,
    /// The f16 copies of a product's two operands ([`Products::F16`]).
    pub(super) operands_f16: Mutex<[Kept<CudaSlice<f16>>; 2]>,
    pub(super) casts: AtomicU64,
    /// The bytes of the buffers handed out and kept ([`GptOps::memory`]).
    pub(super) memory: Arc<MemoryCounter>,
    /// Page-locked buffers for [`GptOps::copy_scalars`].
    pub(super) pinned: PinnedPool,
    /// Where the buffers come from.
    pub(super) memory_source: CudaMemory,
}

/// A buffer of [`CudaOps`]: a `CudaSlice<f32>` counted in its operations' memory; it is a
/// `DevicePtr`, so the kernels and cuBLAS take it as they take the slice.
pub type CudaBuf = Counted<CudaSlice<f32>>;

/// Ids of [`CudaOps`]: a `CudaSlice<u32>` counted in its operations' memory.
pub type CudaIds = Counted<CudaSlice<u32>>;

impl<T> DeviceSlice<T> for Counted<CudaSlice<T>> {
    fn len(&self) -> usize {
        DeviceSlice::len(&**self)
    }
    fn stream(&self) -> &Arc<CudaStream> {
        DeviceSlice::stream(&**self)
    }
}

impl<T> DevicePtr<T> for Counted<CudaSlice<T>> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (**self).device_ptr(stream)
    }
}

impl<T> DevicePtrMut<T> for Counted<CudaSlice<T>> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (**self).device_ptr_mut(stream)
    }
}

pub(super) fn copy_error(op: &'static str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::Driver {
        op,
        kernel: "gpt".into(),
        message: format!("{e:?}"),
    }
}

impl CudaOps {
    /// Operations on `stream`, a CUDA stream (`Stream::cuda`), with the memory PyTorch's
    /// allocator settings in the environment choose ([`CudaMemory::from_env`]: the device's
    /// caching allocator unless `backend:cudaMallocAsync`).
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] for a stream that is not a CUDA stream; as
    /// [`CudaMemory::from_env`] (malformed settings); as [`Blas::new`] (no cuBLAS, no handle).
    pub fn new(stream: Stream) -> Result<CudaOps, KernelError> {
        let memory = match stream.device() {
            fsdp_device::Device::Cuda(n) => CudaMemory::from_env(n)?,
            _ => CudaMemory::Driver,
        };
        CudaOps::with_memory(stream, memory)
    }

    /// Operations on `stream` whose buffers come from `memory` (a caching allocator of the
    /// stream's device, or the driver's pool).
    ///
    /// # Errors
    /// As [`new`](Self::new); [`KernelError::InvalidArgument`] for an allocator of another
    /// device than the stream's.
    pub fn with_memory(stream: Stream, memory: CudaMemory) -> Result<CudaOps, KernelError> {
        if let Some(a) = memory.allocator() {
            if a.device() != stream.device() {
                return Err(KernelError::InvalidArgument {
                    kernel: "gpt",
                    reason: format!(
                        "the caching allocator is of {}, the stream `{}` of {}",
                        a.device(),
                        stream.name(),
                        stream.device()
                    ),
                });
            }
        }
        let cuda = stream
            .cuda_stream()
            .ok_or_else(|| KernelError::InvalidArgument {
                kernel: "gpt",
                reason: format!("stream `{}` is not a CUDA stream", stream.name()),
            })?
            .clone();
        let blas = Blas::new(cuda.clone())?;
        hold_pool_memory(&cuda, u64::MAX);
        let ops = CudaOps {
            stream,
            cuda,
            blas,
            products: Products::F32,
            operands: Mutex::new([Kept::default(), Kept::default()]),
            operands_f16: Mutex::new([Kept::default(), Kept::default()]),
            casts: AtomicU64::new(0),
            memory: MemoryCounter::new(),
            pinned: PinnedPool::default(),
            memory_source: memory,
        };
        ops.reset_pool_peak();
        Ok(ops)
    }

    /// The same operations with products computed as `products` says.
    pub fn with_products(mut self, products: Products) -> CudaOps {
        self.products = products;
        self
    }

    /// How products are computed.
    pub fn products(&self) -> Products {
        self.products
    }

    /// The stream every operation is enqueued on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The kernel of `w` writing its result into `y` as `P` (f32, bf16 or f16).
    pub(super) fn launch_written<P: CastFloat>(
        &self,
        w: &Written<'_, CudaOps>,
        y: &mut impl DevicePtrMut<P>,
    ) -> Result<(), KernelError> {
        let s = &self.cuda;
        match *w {
            Written::Gelu(x) => launch::gelu_forward(s, x, y),
            Written::HeadsSplit(rows, l) => launch::heads_split(s, rows, l, y),
            Written::HeadsMerge(heads, l) => launch::heads_merge(s, heads, l, y),
            Written::CausalSoftmax { scores, t, scale } => {
                launch::causal_softmax_forward(s, scores, t, scale, y)
            }
            Written::CausalSoftmaxBackward {
                probs,
                dprobs,
                t,
                scale,
            } => launch::causal_softmax_backward(s, probs, dprobs, t, scale, y),
        }
    }
}
