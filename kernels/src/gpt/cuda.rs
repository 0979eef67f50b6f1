//! [`CudaOps`]: [`GptOps`] on one CUDA stream.

use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaSlice, CudaStream, CudaViewMut};
use fsdp_device::Stream;
use half::bf16;

use super::ops::GptOps;
use crate::gemm::{Blas, MatMul};
use crate::host::nn::HeadsLayout;
use crate::host::AdamWScalars;
use crate::{launch, KernelError};

/// [`GptOps`] on one CUDA stream: the layer kernels through [`launch`] and the products
/// through cuBLAS ([`Blas`], bound to the same stream), buffers `CudaSlice`s of the stream's
/// context. Every operation is enqueued on that one stream, so operations run in the order
/// they are called; only [`download`](GptOps::download) waits (for the stream, within the
/// [`Stream`]'s timeout).
pub struct CudaOps {
    stream: Stream,
    cuda: Arc<CudaStream>,
    blas: Blas,
    products: Products,
    /// The bf16 copies of a product's two operands ([`Products::Bf16`]), kept between products
    /// and grown as needed (operations run in stream order, so one pair serves every product).
    operands: Mutex<[Option<CudaSlice<bf16>>; 2]>,
}

/// How [`CudaOps`] multiplies matrices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Products {
    /// f32 operands, f32 sums (cuBLAS without TF32): the default.
    #[default]
    F32,
    /// Mixed precision as `torch.autocast(dtype=torch.bfloat16)` does for products: both
    /// operands rounded to bf16 (the cast kernel), bf16 tensor-core products with f32 sums and
    /// an f32 result; every other operation stays f32. The host twin is
    /// [`HostProducts::Bf16Operands`](super::HostProducts::Bf16Operands).
    Bf16,
}

fn copy_error(op: &'static str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::Driver {
        op,
        kernel: "gpt".into(),
        message: format!("{e:?}"),
    }
}

impl CudaOps {
    /// Operations on `stream`, a CUDA stream (`Stream::cuda`).
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] for a stream that is not a CUDA stream; as
    /// [`Blas::new`] (no cuBLAS, no handle).
    pub fn new(stream: Stream) -> Result<CudaOps, KernelError> {
        let cuda = stream
            .cuda_stream()
            .ok_or_else(|| KernelError::InvalidArgument {
                kernel: "gpt",
                reason: format!("stream `{}` is not a CUDA stream", stream.name()),
            })?
            .clone();
        let blas = Blas::new(cuda.clone())?;
        hold_pool_memory(&cuda, u64::MAX);
        Ok(CudaOps {
            stream,
            cuda,
            blas,
            products: Products::F32,
            operands: Mutex::new([None, None]),
        })
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

    /// `c = alpha·op(bf16(a))·op(bf16(b)) + beta·c`, the operands cast into the kept copies.
    fn gemm_bf16(
        &self,
        g: &MatMul,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let mut kept = self
            .operands
            .lock()
            .map_err(|_| copy_error("bf16 operands", "poisoned lock"))?;
        let [ka, kb] = &mut *kept;
        let va = cast_into(&self.cuda, ka, a)?;
        let vb = cast_into(&self.cuda, kb, b)?;
        self.blas.matmul::<bf16, f32>(g, &va, &vb, c)
    }
}

impl Drop for CudaOps {
    fn drop(&mut self) {
        // Give what the pool kept back to the driver, as its default does at every
        // synchronisation.
        hold_pool_memory(&self.cuda, 0);
    }
}

/// Sets the release threshold of the device's default memory pool, which serves cudarc's
/// stream-ordered allocations (`cuMemAllocAsync`). The step allocates its activations afresh
/// and frees them as it goes; with the driver's default threshold (0) the pool returns all of
/// that memory to the driver at each step's synchronisation and maps it again in the next
/// step. `u64::MAX` keeps it, as PyTorch's caching allocator keeps its segments; 0 (on drop)
/// releases what is unused and restores the default. Best effort: a device without memory pools
/// allocates synchronously and has nothing to keep.
fn hold_pool_memory(cuda: &CudaStream, threshold: u64) {
    let dev = cuda.context().cu_device();
    let mut value = threshold;
    // SAFETY: a device of a live context; the release threshold attribute takes a u64, which
    // `value` is, alive for the call.
    let _ = unsafe {
        result::device::get_default_mem_pool(dev).and_then(|pool| {
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast(),
            )?;
            if threshold == 0 {
                result::mem_pool::trim_to(pool, 0)?;
            }
            Ok(())
        })
    };
}

/// `src` rounded to bf16 into the front of `kept` (replaced by a larger copy when short).
fn cast_into<'a>(
    cuda: &Arc<CudaStream>,
    kept: &'a mut Option<CudaSlice<bf16>>,
    src: &CudaSlice<f32>,
) -> Result<CudaViewMut<'a, bf16>, KernelError> {
    let n = src.len();
    let copy = match kept.take() {
        Some(k) if k.len() >= n => kept.insert(k),
        old => {
            drop(old); // free the short copy before allocating the larger one
            let fresh = cuda
                .alloc_zeros::<bf16>(n)
                .map_err(|e| copy_error("cuMemAllocAsync", e))?;
            kept.insert(fresh)
        }
    };
    let mut view = copy.slice_mut(..n);
    launch::cast::<f32, bf16>(cuda, src, &mut view)?;
    Ok(view)
}

impl GptOps for CudaOps {
    type Buf = CudaSlice<f32>;
    type Ids = CudaSlice<u32>;

    fn zeros(&self, len: usize) -> Result<CudaSlice<f32>, KernelError> {
        self.cuda
            .alloc_zeros::<f32>(len)
            .map_err(|e| copy_error("cuMemAllocAsync", e))
    }

    fn upload(&self, data: &[f32]) -> Result<CudaSlice<f32>, KernelError> {
        self.cuda
            .clone_htod(data)
            .map_err(|e| copy_error("cuMemcpyHtoDAsync", e))
    }

    fn upload_ids(&self, ids: &[u32]) -> Result<CudaSlice<u32>, KernelError> {
        self.cuda
            .clone_htod(ids)
            .map_err(|e| copy_error("cuMemcpyHtoDAsync", e))
    }

    fn download(&self, buf: &CudaSlice<f32>) -> Result<Vec<f32>, KernelError> {
        let v = self
            .cuda
            .clone_dtoh(buf)
            .map_err(|e| copy_error("cuMemcpyDtoHAsync", e))?;
        self.stream.synchronize()?;
        Ok(v)
    }

    fn buf_len(buf: &CudaSlice<f32>) -> usize {
        buf.len()
    }

    fn fill_zero(&self, buf: &mut CudaSlice<f32>) -> Result<(), KernelError> {
        launch::memset(&self.cuda, buf, 0.0f32)
    }

    fn gemm(
        &self,
        g: &MatMul,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        match self.products {
            Products::F32 => self.blas.matmul::<f32, f32>(g, a, b, c),
            Products::Bf16 => self.gemm_bf16(g, a, b, c),
        }
    }

    fn bias_add(&self, y: &mut CudaSlice<f32>, bias: &CudaSlice<f32>) -> Result<(), KernelError> {
        launch::bias_add(&self.cuda, y, bias)
    }

    fn axpby(
        &self,
        alpha: f32,
        x: &CudaSlice<f32>,
        beta: f32,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::axpby::<f32>(&self.cuda, alpha, x, beta, y)
    }

    fn layernorm_forward(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        eps: f32,
        y: &mut CudaSlice<f32>,
        mean: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::layernorm_forward(&self.cuda, x, weight, bias, eps, y, mean, rstd)
    }

    fn layernorm_backward_input(
        &self,
        dy: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        mean: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        dx: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::layernorm_backward_input(&self.cuda, dy, x, weight, mean, rstd, dx)
    }

    fn layernorm_backward_params(
        &self,
        dy: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        mean: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        dweight: &mut CudaSlice<f32>,
        dbias: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::layernorm_backward_params(&self.cuda, dy, x, mean, rstd, dweight, dbias)
    }

    fn gelu_forward(&self, x: &CudaSlice<f32>, y: &mut CudaSlice<f32>) -> Result<(), KernelError> {
        launch::gelu_forward(&self.cuda, x, y)
    }

    fn gelu_backward(
        &self,
        x: &CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        dx: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::gelu_backward(&self.cuda, x, dy, dx)
    }

    fn causal_softmax_forward(
        &self,
        scores: &CudaSlice<f32>,
        t: usize,
        scale: f32,
        probs: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::causal_softmax_forward(&self.cuda, scores, t, scale, probs)
    }

    fn causal_softmax_backward(
        &self,
        probs: &CudaSlice<f32>,
        dprobs: &CudaSlice<f32>,
        t: usize,
        scale: f32,
        dscores: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::causal_softmax_backward(&self.cuda, probs, dprobs, t, scale, dscores)
    }

    fn cross_entropy_fused(
        &self,
        logits: &CudaSlice<f32>,
        targets: &CudaSlice<u32>,
        v: usize,
        dloss: f32,
        losses: &mut CudaSlice<f32>,
        dlogits: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::cross_entropy_fused(&self.cuda, logits, targets, v, dloss, losses, dlogits)
    }

    fn embedding_forward(
        &self,
        ids: &CudaSlice<u32>,
        wte: &CudaSlice<f32>,
        wpe: &CudaSlice<f32>,
        t: usize,
        c: usize,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::embedding_forward(&self.cuda, ids, wte, wpe, t, c, x)
    }

    fn embedding_backward_tokens(
        &self,
        ids: &[u32],
        dx: &CudaSlice<f32>,
        c: usize,
        dwte: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::embedding_backward_tokens_host_ids(&self.cuda, ids, dx, c, dwte)
    }

    fn embedding_backward_positions(
        &self,
        dx: &CudaSlice<f32>,
        t: usize,
        c: usize,
        dwpe: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::embedding_backward_positions(&self.cuda, dx, t, c, dwpe)
    }

    fn bias_grad(
        &self,
        dy: &CudaSlice<f32>,
        dbias: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::bias_grad(&self.cuda, dy, dbias)
    }

    fn heads_split(
        &self,
        rows: &CudaSlice<f32>,
        layout: HeadsLayout,
        heads: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::heads_split(&self.cuda, rows, layout, heads)
    }

    fn heads_merge(
        &self,
        heads: &CudaSlice<f32>,
        layout: HeadsLayout,
        rows: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::heads_merge(&self.cuda, heads, layout, rows)
    }

    fn adamw(
        &self,
        s: &AdamWScalars,
        param: &mut CudaSlice<f32>,
        grad: &CudaSlice<f32>,
        exp_avg: &mut CudaSlice<f32>,
        exp_avg_sq: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        launch::adamw::<f32>(&self.cuda, s, param, grad, exp_avg, exp_avg_sq)
    }

    fn sum_of_squares(&self, x: &CudaSlice<f32>) -> Result<f64, KernelError> {
        let mut out = self
            .cuda
            .alloc_zeros::<f64>(1)
            .map_err(|e| copy_error("cuMemAllocAsync", e))?;
        launch::sum_of_squares(&self.cuda, x, &mut out)?;
        let v = self
            .cuda
            .clone_dtoh(&out)
            .map_err(|e| copy_error("cuMemcpyDtoHAsync", e))?;
        self.stream.synchronize()?;
        v.first()
            .copied()
            .ok_or_else(|| copy_error("cuMemcpyDtoHAsync", "no element copied back"))
    }
}
