//! Flat parameters: pad, shard and view a unit's parameters as one evenly sharded buffer.
//!
//! This is the core data structure of fully sharded data parallelism (FSDP). The parameters of
//! one FSDP unit are concatenated into one 1-D **flat parameter**, padded at the end so that its
//! length is a multiple of the world size, and cut into equal contiguous **shards**: rank `r`
//! keeps shard `r`. Before the unit computes, an all-gather of the shards rebuilds the
//! **unsharded** flat buffer, and the original parameters are **views** into it — no copy. The
//! backward pass writes gradients through disjoint mutable views straight into a flat gradient
//! buffer of the same layout, which is then reduce-scattered as it is.
//!
//! - [`FlatParamLayout`] is pure metadata, built with [`FlatParamLayout::builder`] from the
//!   parameters' names and shapes (in order), tied parameters ([aliases], which take no space),
//!   the world size and an optional per-parameter alignment. It knows every offset, the padded
//!   length, the shard length and, for every parameter and rank, the [`ShardParamInfo`] (the
//!   piece of the parameter in that shard) that sharded optimizers and checkpoints need. It also
//!   gives element and byte ranges, so device code can build its own views.
//! - On host slices of any [`Element`](fsdp_device::Element) type (`f32`, `f64`, `bf16`, `f16`):
//!   [flatten](FlatParamLayout::flatten), [shard](FlatParamLayout::shard), [read-only
//!   views](FlatParamLayout::views) and [mutable views](FlatParamLayout::views_mut) of the
//!   unsharded buffer, [views of a shard's pieces](FlatParamLayout::shard_views),
//!   [gather](FlatParamLayout::gather_param) and [scatter](FlatParamLayout::scatter_param) of one
//!   parameter across shards.
//! - On [`fsdp_device::Buffer`]s (any device): [per-parameter](FlatParamLayout::buffer_views) and
//!   [per-shard](FlatParamLayout::shard_buffer) buffers sharing the flat buffer's storage.
//! - [`cast_into`] / [`cast_buffer`]: cast a shard between element types (round to nearest even)
//!   for mixed precision.
//!
//! The vocabulary follows PyTorch's `FlatParameter` (`_ShardParamInfo`, `_SharedParamInfo`,
//! `_shard_numel_padded`), except that index ranges here are half-open.
//!
//! # Example
//!
//! A two-layer MLP (4 → 8 → 2) laid out for 3 ranks, sharded, gathered back and viewed:
//!
//! ```
//! use fsdp_flatparam::{FlatParamLayout, ShardParamInfo};
//!
//! let layout = FlatParamLayout::builder(3)
//!     .param("fc1.weight", &[8, 4])
//!     .param("fc1.bias", &[8])
//!     .param("fc2.weight", &[2, 8])
//!     .param("fc2.bias", &[2])
//!     .build()?;
//! assert_eq!(layout.unpadded_numel(), 58);
//! assert_eq!(layout.padded_numel(), 60); // 2 elements of padding at the end
//! assert_eq!(layout.shard_numel(), 20); // the same on every rank
//!
//! // Some initial values, one vector per parameter.
//! let params: Vec<Vec<f32>> = layout
//!     .params()
//!     .iter()
//!     .map(|p| (0..p.numel()).map(|i| (100 * p.offset() + i) as f32).collect())
//!     .collect();
//!
//! // Flatten, and let every rank keep its shard only.
//! let flat = layout.flatten(&params)?;
//! let shards: Vec<Vec<f32>> = layout.shards(&flat)?.into_iter().map(<[f32]>::to_vec).collect();
//! drop(flat);
//!
//! // Rank 1 holds the end of fc1.weight and all of fc1.bias.
//! assert_eq!(
//!     layout.shard_param_info(0, 1)?,
//!     ShardParamInfo {
//!         in_shard: true,
//!         offset_in_shard: 0,
//!         numel_in_shard: 12,
//!         intra_param_start_idx: 20,
//!         intra_param_end_idx: 32,
//!     }
//! );
//! let pieces = layout.shard_views(&shards[1], 1)?;
//! assert_eq!(pieces.iter().map(|v| v.name()).collect::<Vec<_>>(), ["fc1.weight", "fc1.bias"]);
//!
//! // Gather back (what an all-gather does): concatenate the shards in rank order…
//! let mut unsharded = vec![0.0f32; layout.padded_numel()];
//! layout.unshard_into(&shards, &mut unsharded)?;
//! // …and view the parameters inside it, without copying.
//! let views = layout.views(&unsharded)?;
//! for (view, original) in views.iter().zip(&params) {
//!     assert_eq!(&view[..], &original[..]);
//! }
//! assert_eq!(views[2].name(), "fc2.weight");
//! assert_eq!(views[2].shape(), &[2, 8]);
//! // One parameter can also be reassembled from the shards alone.
//! assert_eq!(layout.gather_param(0, &shards)?, params[0]);
//!
//! // Backward writes gradients straight into a flat gradient buffer, ready to reduce-scatter.
//! let mut grad = vec![0.0f32; layout.padded_numel()];
//! for mut g in layout.views_mut(&mut grad)? {
//!     g.fill(1.0);
//! }
//! assert_eq!(&grad[56..], &[1.0, 1.0, 0.0, 0.0]); // fc2.bias, then padding left at zero
//! # Ok::<(), fsdp_flatparam::FlatParamError>(())
//! ```
//!
//! [aliases]: FlatParamLayoutBuilder::alias
#![forbid(unsafe_code)]

mod buffers;
mod cast;
mod error;
mod layout;
mod ops;
mod view;

pub use buffers::cast_buffer;
pub use cast::{cast, cast_into};
pub use error::{FlatParamError, Result};
pub use layout::{
    FlatParamLayout, FlatParamLayoutBuilder, ParamInfo, Segment, SegmentKind, ShardParamInfo,
    SharedParamInfo,
};
pub use view::{ParamView, ParamViewMut, ShardParamView, ShardParamViewMut};

/// The README's examples, run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
