//! The optimizers' CUDA source run on the host (`common::emulator`: `cu/optim.cu` and
//! `cu/any_precision.cu` as NVRTC compiles them, a block's threads as host threads), each kernel
//! launched as its launcher launches it — the launcher's plan (`launch::plan`: `optim.rs`,
//! `step.rs`, `foreach.rs`) on the buffers' emulated addresses, the same kernels, grids and
//! parameters (`buffers.rs` and `step_buffers.rs` reach the same launchers) — against its twin
//! bitwise (`host/optim.rs`, `host/step.rs`, `host/any_precision.rs`):
//!
//! - `adamw_f32` and `adamw_bf16_state` over several steps (the moments carried over), with and
//!   without weight decay and on both branches of torch.lerp;
//! - `sgd_f32` with every flag the launcher's scalars encode (momentum, its first step,
//!   Nesterov, weight decay) and dampening, several steps (the buffer carried over; left alone
//!   without momentum);
//! - `adamw_decided_f32` and `sgd_decided_f32` over a run of decisions: applied or not (then
//!   nothing changes), either choice (and a choice past them: the last), clipped, unscaled;
//! - `anyprecision_decided_f32` and `anyprecision_decided_bf16_state` with parameters of f32 or
//!   bf16 values, state of f32 or bf16 packed two to an f32 element (odd lengths: the unused
//!   half stays), with Kahan summation and without (the launcher's null compensation), a set
//!   with and one without weight decay;
//! - `adamw_decided_many`, `anyprecision_decided_many_f32` and
//!   `anyprecision_decided_many_bf16_state` over tensors of different lengths (empty, one
//!   element, around a block, longer than the blocks along x take in one pass), every other
//!   one with weight decay, their lists and choices passed by value as the plans lay them out
//!   — each tensor bitwise its one-tensor twin.
//!
//! Every buffer has a guard element past its end that must stay, and the step's scalars are only
//! read. What this cannot check is the hardware itself: `tests/gpu.rs` and `tests/gpu_step.rs`
//! do, on a GPU (AdamW there within 1 ulp, 0 expected; here bitwise).

mod adamw_sgd;
mod any_precision;
#[path = "../common/mod.rs"]
mod common;
mod helpers;
