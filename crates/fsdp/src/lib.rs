//! Fully sharded data parallel training composed from the collectives, allocator and flatparam
//! crates.
//!
//! This crate holds so far the pieces that do not depend on the runtime:
//!
//! - [`model`]: the reference model, GPT-2 exactly as nanoGPT writes it (names, shapes,
//!   initialisation), with forward and backward on the host in `f32`, run in stages that match
//!   FSDP units (embedding, one stage per transformer block, head with the tied `lm_head`), and
//!   reading parameters / writing gradients through traits so they can live in flat buffers.
//! - [`optim`]: `torch.optim.AdamW` and `torch.optim.SGD` as element-wise functions over flat
//!   slices, so they work on any shard.
//! - [`data`]: `u16` token files (nanoGPT's `train.bin`), a synthetic learnable corpus and the
//!   batch rule with each rank's slice of the global batch.
//!
//! # Example
//!
//! A tiny GPT's forward and backward, and one AdamW step:
//!
//! ```
//! use fsdp::data::{get_batch, synthetic_corpus};
//! use fsdp::model::{forward_backward, init_params, named_params, zeros_like_params, GptConfig};
//! use fsdp::optim::{AdamWConfig, AdamWState};
//!
//! # fn main() -> Result<(), fsdp::FsdpError> {
//! let cfg = GptConfig::new(2, 2, 32, 16, 96)?;
//! let mut params = named_params(&cfg, init_params(&cfg, 0))?;
//! let mut grads = zeros_like_params(&cfg);
//!
//! let tokens = synthetic_corpus(10_000, 96, 1);
//! // Global batch 0: 8 rows of 16 tokens, all of it on rank 0 of 1.
//! let batch = get_batch(&tokens, 0, 8, 16, 0, 1)?;
//! let loss = forward_backward(&cfg, &params, &mut grads, &batch, 8 * 16)?;
//! assert!((loss - 96f32.ln()).abs() < 0.1); // about ln(vocab) at initialisation
//!
//! let opt = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
//! for (name, p) in params.iter_mut() {
//!     let mut state = AdamWState::new(p.len());
//!     state.step(&opt, p, &grads[name])?;
//! }
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

pub mod checkpoint;
pub mod data;
mod error;
pub mod model;
pub mod optim;
pub mod plan;
pub mod runtime;
pub mod trace;
pub mod units;
pub mod wrap;

pub use error::FsdpError;
