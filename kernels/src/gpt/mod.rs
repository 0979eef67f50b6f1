//! The reference GPT's training step (forward and backward) over device operations: one model
//! code, [`DeviceGpt`], generic over [`GptOps`], the operations of one step on one device
//! (buffers, transfers, matrix products by [`MatMul`](crate::gemm::MatMul), the layer kernels
//! of `cu/nn.cu`).
//!
//! - [`HostOps`] runs every operation on the host: the kernels' twins
//!   ([`host::nn`](crate::host::nn), [`host::axpby`](crate::host::axpby)) and a plain f32
//!   matrix product ([`gemm_f32`]; or [`gemm_f64_rounded`], to see what the products' rounding
//!   alone changes). `DeviceGpt<HostOps>` is tested against the CPU reference GPT (`fsdp-gpt`:
//!   `tests/gpt_vs_reference.rs`).
//! - [`CudaOps`] runs them on one CUDA stream: the kernels through [`launch`](crate::launch)
//!   and the products through cuBLAS ([`Blas`](crate::gemm::Blas)), every operation enqueued on
//!   that one stream, so their order is the stream's. Every non-product kernel equals its twin
//!   bitwise, so `DeviceGpt<CudaOps>` differs from `DeviceGpt<HostOps>` only by the products'
//!   rounding (`tests/gpu_gpt.rs`).
//!
//! Both count the device memory they hold ([`GptOps::memory`], through [`Counted`] buffers):
//! the bytes live now and their peak, exact from the sizes allocated.
//!
//! The model is nanoGPT's GPT-2 (bias on, dropout 0, `lm_head` tied to `wte`), with its
//! parameter names and shapes ([`param_shapes`]): embeddings, `n_layer` blocks (`ln_1`,
//! `attn.c_attn` (q, k, v), causal attention, `attn.c_proj`, residual, `ln_2`, `mlp.c_fc`,
//! GELU, `mlp.c_proj`, residual), `ln_f`, logits `= x·wteᵀ`, and the mean cross-entropy over
//! the batch's tokens. Forward keeps what backward needs but the attention's `t × t`
//! probabilities, which backward computes again chunk by chunk by default ([`Attention`]);
//! backward gives every parameter's gradient, `wte`'s with the tied head's term.

mod attention;
mod block;
mod chunks;
mod cuda;
mod cuda_memory;
mod cuda_ops;
mod cuda_pool;
mod cuda_products;
mod cuda_step;
mod fused_ops;
mod head;
mod host_ops;
mod host_twin;
mod memory;
mod meta;
mod meta_peer;
mod model;
mod ops;
mod ops_args;
mod pass;
mod peer;
mod peer_cuda;
mod peer_gather;
mod peer_half;
mod peer_host;
mod products;
mod staging;
mod trace;
mod units;
mod weights;
mod written;

pub use attention::Attention;
pub use cuda::{CudaBuf, CudaIds, CudaOps};
pub use cuda_memory::{describe_stats, CudaMemory};
pub use cuda_products::{CudaOperand, Products};
pub use cuda_step::{CudaMark, CudaScalars, CudaScalarsCopy, CudaStaging};
pub use head::Logits;
pub use host_ops::{HostBuf, HostIds, HostOperand, HostOps};
pub use memory::{Counted, MemoryCounter, MemoryEvent, MemoryUse};
pub use meta::{MetaBuf, MetaCounted, MetaOps};
pub use model::DeviceGpt;
pub use ops::{Arg, DecidedTensor, GptOps};
pub use pass::GptPass;
pub use peer::{PeerOps, PeerPtr};
pub use peer_gather::PeerCopy;
pub use products::{
    gemm_bf16_operands, gemm_f32, gemm_f64_rounded, gemm_half_operands, HostProducts,
};
pub use staging::StagingOps;
pub use trace::SpanEnd;
pub use units::{Resident, Unit, Units, WithGrads};
pub use weights::{block_product_weights, param_shapes, Block, GptDims, Pair, Weights};
pub use written::Written;
