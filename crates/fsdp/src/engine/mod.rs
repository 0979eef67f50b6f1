//! The FSDP engine: sharded data-parallel training of any model over a communicator, shaped
//! like PyTorch's FSDP2 (`torch/distributed/fsdp/_fully_shard/`) with FSDP1's flat parameters.
//!
//! - [`CommContext`] (one per rank): the [`ProcessGroups`] (shard and replicate groups), the
//!   compute and communication streams, the caching allocator ([`MemoryPool`]), the all-gather
//!   limiter, pending reductions, the recorded schedule and trace.
//! - [`ParamGroup`] (one per unit): the unit's flat parameter ([`fsdp_flatparam::FlatParamLayout`])
//!   — shard, gradient shard, optimizer state — with `unshard`, `wait_for_unshard`, `reshard`;
//!   the gradient reduction is one function over a group (FSDP2's `foreach_reduce`).
//! - [`Fsdp`] (the engine): built from a [`UnitPlan`](crate::units::UnitPlan) (or a module
//!   tree and a wrap policy, [`Fsdp::from_module`]) and the parameters' initial values
//!   ([`ParamInit`]). Hooks for a hand-written loop: [`Fsdp::pre_forward`],
//!   [`Fsdp::post_forward`], [`Fsdp::pre_backward`], [`Fsdp::post_backward`],
//!   [`Fsdp::finalize_backward`], with [`Fsdp::param_views`] / [`Fsdp::grad_views`] to read the
//!   unsharded parameters and write the gradients; or a model implementing [`FsdpModel`] and
//!   [`Fsdp::forward_backward`] (or [`Fsdp::forward_backward_async`], whose loss a device sums
//!   without the host waiting). Then [`Fsdp::no_sync`], [`Fsdp::grad_norm`],
//!   [`Fsdp::clip_grad_norm`] (or [`Fsdp::clip_grad_norm_async`], whose [`DeviceScalar`] a device
//!   computes without the host waiting), [`Fsdp::optimizer_step`] (AdamW, SGD or
//!   AnyPrecisionAdamW on the shards) or
//!   [`Fsdp::skip_step`] — or [`Fsdp::optimizer_step_if_finite`], which skips a step whose loss
//!   or norm is not finite (decided on a device without the host waiting, each
//!   [`StepOutcome`] read one step late), [`Fsdp::full_state_dict`] and sharded checkpoints
//!   ([`Fsdp::save_sharded`]). Dynamic loss scaling for fp16 ([`GradScaler`], PyTorch's
//!   `ShardedGradScaler`): [`Fsdp::set_grad_scaler`].
//!
//! Prefetching follows the recorded execution order, not the definition order: backward
//! prefetch ([`BackwardPrefetch`]) takes the next unit of the reversed post-forward order of the
//! first pass; forward prefetch the next unit of the pre-forward order. In the first pass,
//! before an order is recorded, forward prefetch follows the definition order (the plan's
//! unit order). All-gathers run on the shard group's stream, the gradient reductions after
//! them in issue order; a reduce-scatter's unsharded gradient is released when the host waits
//! for a collective issued after it (or at [`Fsdp::finalize_backward`]), so memory is the same
//! whatever the backend and is predicted exactly by a dry run ([`crate::plan`]).
//!
//! Mixed precision ([`MixedPrecisionPolicy`] in [`FsdpConfig::mixed_precision`], per unit with
//! [`Fsdp::set_mixed_precision`]): shards cast to `param_dtype` before the all-gather, gradients
//! rounded to it and reduced in `reduce_dtype`, `f32` master weights — or none under
//! AnyPrecisionAdamW, whose shards are stored in `param_dtype`. The exact definition, and the
//! division by the data-parallel size ([`GradientDivide`]), are in [`mixed_precision`]
//! (its module documentation).
//!
//! Activation checkpointing ([`checkpointing`]): per unit
//! ([`Fsdp::set_activation_checkpointing`], or every unit with
//! [`FsdpConfig::activation_checkpointing`]), the driven model's spans keep only their input in
//! forward and are recomputed right before their backward from the parameters already
//! unsharded for it (no extra collective: the same schedule, bitwise the same results). The
//! model's tape is counted ([`FsdpModel::tape_bytes`], [`Fsdp::activation_stats`]: current and
//! peak activation bytes and the peak of allocated plus activation bytes) and predicted by the
//! plan from per-span declarations ([`SpanActivations`]).
//!
//! # Example
//!
//! A two-layer linear model `y = w2 · (w1 · x)` on scalars, each layer a unit, trained with
//! `FULL_SHARD` on two ranks (threads):
//!
//! ```
//! use std::collections::HashMap;
//! use fsdp::engine::{Fsdp, FsdpConfig, FsdpModel, ParamInit, ShardingStrategy, Span};
//! use fsdp::optim::SgdConfig;
//! use fsdp::units::{ParamSpec, UnitPlan, UnitSpec};
//! use fsdp::{FsdpError, Grads, Params};
//! use fsdp_collectives::{ring, Communicator};
//!
//! struct Chain;
//! #[derive(Default)]
//! struct Tape { h: f32, y: f32, dy: f32 }
//! impl FsdpModel for Chain {
//!     type Batch = (f32, f32); // (x, target)
//!     type Tape = Tape;
//!     fn spans(&self) -> Vec<Span> { vec![Span::new("l1", ["w1"]), Span::new("l2", ["w2"])] }
//!     fn forward(&self, s: usize, p: &dyn Params, b: &(f32, f32), t: &mut Tape) -> Result<(), FsdpError> {
//!         if s == 0 { t.h = p.param("w1")?[0] * b.0 } else { t.y = p.param("w2")?[0] * t.h }
//!         Ok(())
//!     }
//!     fn loss(&self, _: &Tape) -> Result<f32, FsdpError> { Ok(0.0) }
//!     fn backward(&self, s: usize, p: &dyn Params, g: &mut dyn Grads, b: &(f32, f32), t: &mut Tape) -> Result<(), FsdpError> {
//!         if s == 1 { t.dy = t.y - b.1; g.grad_mut("w2")?[0] += t.dy * t.h; t.dy *= p.param("w2")?[0] }
//!         else { g.grad_mut("w1")?[0] += t.dy * b.0 }
//!         Ok(())
//!     }
//! }
//!
//! let unit = |n: &str| UnitSpec { name: n.into(), params: vec![ParamSpec::new(n, vec![1])] };
//! let plan = UnitPlan { units: vec![unit("w1"), unit("w2")], ignored: vec![] };
//! let init = HashMap::from([("w1".to_string(), vec![1.0f32]), ("w2".to_string(), vec![1.0])]);
//! let w = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
//!     let config = FsdpConfig::new(ShardingStrategy::FullShard);
//!     let opt = SgdConfig::with_momentum(0.1, 0.0);
//!     let mut fsdp = Fsdp::new(Box::new(comm), &plan, ParamInit::Full(&init), config, opt).unwrap();
//!     fsdp.step(&Chain, &(1.0, 2.0)).unwrap(); // x = 1, target 2 on both ranks: gradients sum to -2
//!     fsdp.full_state_dict().unwrap()
//! })
//! .unwrap();
//! assert!((w[0]["w1"][0] - 1.2).abs() < 1e-6); // 1 - 0.1 · (-2)
//! assert_eq!(w[0], w[1]);
//! ```

pub mod checkpointing;
mod comm_context;
mod config;
mod decided_step;
mod device;
mod device_kernels;
mod device_optim;
mod device_scalar;
mod device_shards;
mod fsdp;
mod grad_norm;
mod grad_scaler;
mod host_compute;
mod loss_scaling;
mod materialize;
pub mod mixed_precision;
mod model;
mod optim_groups;
mod order;
mod param_group;
mod pool;
mod reduce;
mod scaler_device;
mod state_dict;
mod stream_load;
mod train;
mod views;

pub use checkpointing::{ActivationStats, SpanActivations};
pub use comm_context::{CommContext, ProcessGroups};
pub use config::{
    BackwardPrefetch, CrossStreamSafety, FsdpConfig, Phase, ScheduleEvent, ScheduleKind,
    ShardingStrategy,
};
pub use decided_step::StepOutcome;
pub use device::ComputeDevice;
pub use device_scalar::DeviceScalar;
pub use fsdp::Fsdp;
pub use grad_scaler::{
    load_grad_scaler_state, save_grad_scaler_state, GradScaler, GradScalerConfig, GradScalerState,
    GRAD_SCALER_FILE,
};
pub use host_compute::{copy_from_host_f32, copy_from_host_f64, copy_to_host_f32, HostCompute};
pub use materialize::ParamInit;
pub use mixed_precision::{
    divide_factors, round_slice, round_to, DivideFactors, GradientDivide, MixedPrecisionPolicy,
};
pub use model::{FsdpModel, Span};
pub use optim_groups::OptimizerSetup;
pub use param_group::{GroupDtypes, ParamGroup};
pub use pool::MemoryPool;
pub use views::{GradViews, Grads, ParamId, ParamViews, Params};
