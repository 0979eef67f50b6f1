//! CUDA C kernels compiled at run time by NVRTC, each with a host twin (the same arithmetic in
//! Rust).
//!
//! - Kernels: casts between f32, bf16 and f16 (round to nearest even), axpby, memset, the
//!   ring's reductions (sum, avg, min, max, product for f32, f64, bf16, f16, with
//!   `fsdp_device::Element`'s arithmetic), fused AdamW (f32 master, f32 or bf16 moments) and
//!   SGD on flat shards (`torch.optim`'s formulas as `fsdp::optim` computes them), and the sum
//!   of squares of a gradient shard for the global norm.
//! - The GPT's layers besides matrix products, f32 ([`host::nn`], [`launch`]): layer norm,
//!   exact GELU, causal softmax, cross-entropy fused with its backward, embeddings and the bias
//!   gradient, each forward and backward, in fixed orders (deterministic, no float atomics);
//!   the bias add and the attention heads' permutations (`heads_split`, `heads_merge`).
//! - [`programs`]: the CUDA C sources (`src/cu/*.cu`, included in the binary), compiled to PTX
//!   by NVRTC with `--fmad=false` and IEEE division, square root and denormals, so that results
//!   equal the host twins bitwise. NVRTC is found by
//!   [`fsdp_device::cuda::libs::load_nvrtc`] (loader path, `FSDP_NVRTC_LIB`, or a Python
//!   package's `site-packages`). The 16-bit conversions are the sources' own functions (the
//!   NVRTC wheel has no `cuda_bf16.h`).
//! - [`host`]: the twins, tested here against independent references (`half`,
//!   `fsdp_device::Element`, `fsdp::optim`).
//! - [`gemm`]: matrix products through cuBLAS in the model's row-major terms (a `Linear`
//!   layer's forward and both backward products, attention's batched products), f32, bf16 or
//!   f16 inputs with f32 accumulation; the row-major to column-major mapping is tested on the
//!   host against both definitions.
//! - [`gpt`]: the reference GPT's training step (forward and backward) over device
//!   operations ([`gpt::GptOps`]): [`gpt::DeviceGpt`] on the host through the twins
//!   ([`gpt::HostOps`]) or on one CUDA stream through the kernels and cuBLAS
//!   ([`gpt::CudaOps`]).
//! - [`launch`]: safe launch functions over a cudarc `CudaStream` and device slices; modules
//!   are compiled once per compute capability and loaded once per context.
//!
//! ```
//! use fsdp_kernels::host::{self, ReduceKind};
//! let (acc, x) = ([1.0f32, 5.0], [2.0f32, -1.0]);
//! let mut out = [0.0f32; 2];
//! host::reduce(ReduceKind::Avg, &mut out, &acc, &x, Some(2)).unwrap();
//! assert_eq!(out, [1.5, 2.0]);
//! ```

mod error;
pub mod gemm;
pub mod gpt;
pub mod host;
pub mod launch;
pub mod programs;

pub use error::KernelError;
pub use programs::{compile, compile_ptx, compile_source, nvrtc_version, Program};

/// The README's examples, run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
