//! Fully sharded data parallel training of any model, composed from the collectives, allocator
//! and flatparam crates, shaped like PyTorch's FSDP2 with FSDP1's flat parameters.
//!
//! - [`engine`]: the engine — [`Fsdp`] (hooks `pre_forward` / `post_forward` / `pre_backward` /
//!   `post_backward` / `finalize_backward`, `no_sync`, `grad_norm`, `clip_grad_norm`,
//!   `optimizer_step`, `skip_step`, state dicts), its param groups and comm context, and the
//!   [`FsdpModel`] trait for models that let the engine drive them.
//! - [`wrap`] and [`units`]: a model's module tree and the wrap policies (module type, size,
//!   custom, ignored modules, tied parameters) that turn it into FSDP units.
//! - [`plan`]: the memory and communication plan of a configuration, from a dry run of the
//!   engine itself on the meta device.
//! - [`optim`]: AdamW and SGD over flat shards, parameter groups inside a shard and learning
//!   rate schedules.
//! - [`init`]: sharded initialisation from a counter-based generator (the same model at every
//!   world size).
//! - [`checkpoint`]: sharded checkpoints that load at another world size; [`trace`]: Chrome
//!   traces of compute, communication and memory.
//!
//! The crate knows no model: a model brings its parameter names and shapes (a [`wrap::Module`]
//! tree or a [`units::UnitPlan`]), reads its parameters through [`Params`] and writes its
//! gradients through [`Grads`]. See the [`engine`] module for an example.
#![forbid(unsafe_code)]

pub mod checkpoint;
pub mod engine;
mod error;
pub mod init;
pub mod optim;
pub mod plan;
pub mod trace;
pub mod units;
pub mod wrap;

pub use engine::{Fsdp, FsdpConfig, FsdpModel, Grads, ParamInit, Params, ShardingStrategy};
pub use error::{human_bytes, try_filled_vec, FsdpError};

/// The README's example ("Shard your own model"), run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
