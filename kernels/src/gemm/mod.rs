//! Matrix products on the GPU through cuBLAS (`cublasGemmStridedBatchedEx`, cudarc's result
//! layer; a plain product is a batch of one), in the model's row-major terms ([`MatMul`]): a `Linear` layer's
//! forward product and both backward products, and batched products for attention.
//!
//! Inputs f32, bf16 or f16; output the input type, or f32 from 16-bit inputs; accumulation is
//! always f32 (`CUBLAS_COMPUTE_32F`, without TF32 and without 16-bit split-K reductions, so f32
//! products compare with the CPU's within f32 rounding). A 16-bit output that accumulates
//! (`beta ≠ 0`) is rounded twice: cuBLAS rounds `alpha·a·b` to the output type before adding
//! `beta·c`. cuBLAS is loaded at run time (cudarc's dynamic loading): [`Blas::new`] says so
//! when `libcublas` cannot be found. A [`Blas`] is bound to one stream; products are enqueued on
//! it and ordering against other streams is the caller's, as for [`launch`](crate::launch).

mod layout;

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result, sys};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use fsdp_device::DeviceError;

pub use layout::{ColMajorCall, MatMul};

use crate::KernelError;

/// Element types cuBLAS multiplies here.
pub trait BlasFloat: DeviceRepr + Copy + 'static {
    /// cuBLAS's name of the type.
    const DATA_TYPE: sys::cudaDataType_t;
    /// The type's name in errors.
    const NAME: &'static str;
}

impl BlasFloat for f32 {
    const DATA_TYPE: sys::cudaDataType_t = sys::cudaDataType_t::CUDA_R_32F;
    const NAME: &'static str = "f32";
}

impl BlasFloat for half::bf16 {
    const DATA_TYPE: sys::cudaDataType_t = sys::cudaDataType_t::CUDA_R_16BF;
    const NAME: &'static str = "bf16";
}

impl BlasFloat for half::f16 {
    const DATA_TYPE: sys::cudaDataType_t = sys::cudaDataType_t::CUDA_R_16F;
    const NAME: &'static str = "f16";
}

/// A cuBLAS handle bound to one CUDA stream.
pub struct Blas {
    handle: sys::cublasHandle_t,
    stream: Arc<CudaStream>,
}

// SAFETY: a cuBLAS handle may move between threads; it is used by one thread at a time since
// `Blas` is not `Sync` and every use takes `&self` of the single owner.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the handle was created in `new` and is destroyed once, here.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

fn blas_error(op: &'static str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::Driver {
        op,
        kernel: "gemm".into(),
        message: format!("{e:?}"),
    }
}

fn invalid(reason: String) -> KernelError {
    KernelError::InvalidArgument {
        kernel: "gemm",
        reason,
    }
}

impl Blas {
    /// A handle whose products run on `stream`.
    ///
    /// # Errors
    /// [`KernelError::Device`] when `libcublas` cannot be loaded; [`KernelError::Driver`] when
    /// the handle cannot be created.
    pub fn new(stream: Arc<CudaStream>) -> Result<Blas, KernelError> {
        // SAFETY: only tries to dlopen the library by cudarc's names.
        if !unsafe { sys::is_culib_present() } {
            return Err(KernelError::Device(DeviceError::LibraryNotFound {
                library: "libcublas.so (cuBLAS)".into(),
                detail: "not on the loader path (PyTorch's CUDA wheels ship it under \
                         site-packages/nvidia/cu13/lib: put that folder on LD_LIBRARY_PATH)"
                    .into(),
            }));
        }
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| blas_error("cuCtxSetCurrent", e))?;
        let handle = result::create_handle().map_err(|e| blas_error("cublasCreate", e))?;
        let blas = Blas { handle, stream };
        // SAFETY: a live handle and the stream's own handle, which `blas` keeps alive.
        unsafe { result::set_stream(blas.handle, blas.stream.cu_stream() as sys::cudaStream_t) }
            .map_err(|e| blas_error("cublasSetStream", e))?;
        // f32 accumulation throughout: by default cuBLAS may add the split-K partial sums of
        // 16-bit products in 16 bits (PyTorch's `allow_bf16_reduced_precision_reduction`).
        // SAFETY: a live handle; the mode is cuBLAS's default math plus that one flag.
        unsafe {
            sys::cublasSetMathMode(
                blas.handle,
                sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
            )
        }
        .result()
        .map_err(|e| blas_error("cublasSetMathMode", e))?;
        Ok(blas)
    }

    /// The stream the products run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Enqueue `c = alpha·op(a)·op(b) + beta·c` as described by `g` (row-major, see
    /// [`MatMul`]), inputs of type `I`, output `O` (`I`, or f32 from a 16-bit `I`).
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] for an unsupported type pair, dimensions past cuBLAS's
    /// 32-bit sizes, or strides that make batches overlap in `c`; [`KernelError::Length`] for
    /// an operand shorter than the product needs; [`KernelError::Driver`] with cuBLAS's status.
    pub fn matmul<I: BlasFloat, O: BlasFloat>(
        &self,
        g: &MatMul,
        a: &impl DevicePtr<I>,
        b: &impl DevicePtr<I>,
        c: &mut impl DevicePtrMut<O>,
    ) -> Result<(), KernelError> {
        if O::NAME != I::NAME && O::NAME != "f32" {
            return Err(invalid(format!(
                "{} inputs give {} or f32 outputs, not {}",
                I::NAME,
                I::NAME,
                O::NAME
            )));
        }
        g.check_operands(a.len(), b.len(), c.len())?;
        if g.batch == 0 || g.m == 0 || g.n == 0 {
            return Ok(());
        }
        // cuBLAS runs in the thread's current context: the stream's (a thread that last
        // worked on another GPU would launch there).
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| blas_error("cuCtxSetCurrent", e))?;
        let call = g.cublas();
        let int = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| invalid(format!("{what} = {v} exceeds cuBLAS's 32 bits")))
        };
        let long = |v: usize, what: &str| {
            i64::try_from(v).map_err(|_| invalid(format!("{what} = {v} exceeds 64 bits")))
        };
        let (m, n, k) = (int(call.m, "m")?, int(call.n, "n")?, int(call.k, "k")?);
        let (lda, ldb, ldc) = (
            int(call.ld_first.max(1), "lda")?,
            int(call.ld_second.max(1), "ldb")?,
            int(call.ldc.max(1), "ldc")?,
        );
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (g.alpha, g.beta);
        let (pa, _ra) = a.device_ptr(&self.stream);
        let (pb, _rb) = b.device_ptr(&self.stream);
        let (pc, _rc) = c.device_ptr_mut(&self.stream);
        // The operands' offsets (elements, checked within the buffers above) in bytes.
        let at = |ptr: u64, offset: usize, size: usize| -> Result<_, KernelError> {
            let bytes = offset
                .checked_mul(size)
                .and_then(|b| u64::try_from(b).ok())
                .ok_or_else(|| invalid(format!("offset {offset} exceeds 64 bits")))?;
            Ok(ptr + bytes)
        };
        let pa = at(pa, g.offset_a, std::mem::size_of::<I>())?;
        let pb = at(pb, g.offset_b, std::mem::size_of::<I>())?;
        let pc = at(pc, g.offset_c, std::mem::size_of::<O>())?;
        // cuBLAS's first operand is the row-major B, its second the row-major A.
        let (first, second) = (pb as *const c_void, pa as *const c_void);
        let alpha_p = (&alpha as *const f32).cast::<c_void>();
        let beta_p = (&beta as *const f32).cast::<c_void>();
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        let (sa, sb, sc) = (
            long(call.stride_first, "stride of b")?,
            long(call.stride_second, "stride of a")?,
            long(call.stride_c, "stride of c")?,
        );
        let batch = int(call.batch, "batch")?;
        // One call for plain and batched products (a batch of one is a plain product).
        // SAFETY: the pointers are device memory of the stream's context holding at least the
        // extents checked above for these dimensions, leading dimensions, strides and batch;
        // alpha and beta are f32 host values, as CUBLAS_COMPUTE_32F reads them, alive for the
        // call.
        let done = unsafe {
            result::gemm_strided_batched_ex(
                self.handle,
                op(call.trans_first),
                op(call.trans_second),
                m,
                n,
                k,
                alpha_p,
                first,
                I::DATA_TYPE,
                lda,
                sa,
                second,
                I::DATA_TYPE,
                ldb,
                sb,
                beta_p,
                pc as *mut c_void,
                O::DATA_TYPE,
                ldc,
                sc,
                batch,
                compute,
                algo,
            )
        };
        done.map_err(|e| blas_error("cublasGemmStridedBatchedEx", e))
    }
}
