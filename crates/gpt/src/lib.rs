//! The reference model of the workspace, GPT-2 exactly as nanoGPT writes it (names, shapes,
//! initialisation), trained with the [`fsdp`] engine — written only against its public API —
//! and the `fsdp` command-line program (`train`, `plan`, `launch`).
//!
//! - [`model`]: forward and backward on the host in `f32`, in stages (embedding, one per
//!   transformer block, head with the tied `lm_head`), reading parameters and writing gradients
//!   through [`fsdp::Params`] / [`fsdp::Grads`].
//! - [`runtime`]: [`runtime::GptModel`] (the model as an [`fsdp::FsdpModel`]) and
//!   [`runtime::FsdpGpt`] (one rank's engine with the model).
//! - [`tree`]: the module tree ([`tree::gpt_module_tree`]) the wrap policies run on, and the
//!   block plan.
//! - [`data`]: `u16` token files, a synthetic corpus and the batch rule.
//! - [`checkpoint`]: full checkpoints PyTorch reads; [`plan`]: the memory plan of a training
//!   configuration, with the GPT's activations.
//!
//! # Example
//!
//! A tiny GPT's forward and backward, and one AdamW step:
//!
//! ```
//! use fsdp_gpt::data::{get_batch, synthetic_corpus};
//! use fsdp_gpt::model::{forward_backward, init_params, named_params, zeros_like_params, GptConfig};
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
// No unsafe code but in `device_peer`, whose collectives read the peers' buffers by address
// (`PeerOps`' unsafe copies and reductions), ordered by its protocol of events.
#![deny(unsafe_code)]

pub mod checkpoint;
pub mod data;
pub mod device_bench;
pub mod device_comm;
mod device_config;
mod device_optim;
#[allow(unsafe_code)]
pub mod device_peer;
pub mod device_plan;
pub mod device_plan_alloc;
pub mod device_plan_sharded;
mod device_shard;
pub mod device_sharded;
mod device_sharded_settings;
mod device_sharded_state;
mod device_snapshot;
#[allow(unsafe_code)]
pub mod device_staged;
mod device_state;
mod device_step;
mod device_trace;
pub mod device_train;
pub mod device_units;
pub mod engine_gpt;
pub mod engine_plan;
pub mod engine_step;
mod engine_units;
pub mod engine_views;
pub mod init;
pub mod model;
pub mod plan;
pub mod runtime;
pub mod tree;

/// The README's examples, run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
