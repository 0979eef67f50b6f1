//! The engine's options and the records it keeps: sharding strategies, prefetch policies,
//! cross-stream safety, [`FsdpConfig`] and the schedule of issued collectives.

use super::mixed_precision::{GradientDivide, MixedPrecisionPolicy};

/// How parameters, gradients and optimizer state are sharded (PyTorch's `ShardingStrategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShardingStrategy {
    /// ZeRO-3: shard over all ranks; parameters are freed after forward and after backward
    /// (except the root unit after forward).
    FullShard,
    /// ZeRO-2: shard over all ranks; parameters stay unsharded from forward until after backward.
    ShardGradOp,
    /// DDP: no sharding (`F = 1`), gradients are all-reduced.
    NoShard,
    /// `FullShard` inside a node (`ranks_per_node` ranks), replicated across nodes:
    /// reduce-scatter in the node, then all-reduce of the shard across nodes.
    HybridShard,
    /// `ShardGradOp` inside a node, replicated across nodes.
    HybridShardZero2,
}

impl ShardingStrategy {
    /// Every strategy, in declaration order.
    pub const ALL: [ShardingStrategy; 5] = [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ];

    /// Whether non-root units free their unsharded parameters after forward.
    pub fn reshard_after_forward(self) -> bool {
        matches!(
            self,
            ShardingStrategy::FullShard | ShardingStrategy::HybridShard
        )
    }

    /// Whether the strategy uses a `replicate × shard` mesh.
    pub fn is_hybrid(self) -> bool {
        matches!(
            self,
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2
        )
    }
}

/// When backward issues the next unit's all-gather (PyTorch's `BackwardPrefetch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BackwardPrefetch {
    /// Before computing the current unit's gradients (`BACKWARD_PRE`, the default).
    #[default]
    Pre,
    /// After the current unit's parameters are freed, before its reduce-scatter
    /// (`BACKWARD_POST`).
    Post,
    /// No prefetch: the all-gather is issued when the unit is needed.
    None,
}

/// How a buffer allocated on one stream and used on another is kept from being reused while
/// the other stream may still touch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CrossStreamSafety {
    /// Held references (as PyTorch's newer FSDP does with events): a collective keeps clones of
    /// its buffers (access tickets) until it has run, so the block returns to the allocator
    /// only after the last stream work on it. The default.
    #[default]
    HeldReferences,
    /// Held references plus `record_stream` on the other stream (PyTorch's FSDP1): at the free,
    /// the allocator also records an event on that stream and reuses the block only once the
    /// event completed, i.e. after all work issued on that stream before the free.
    RecordStream,
}

/// Options of the runtime (PyTorch's `FullyShardedDataParallel` arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FsdpConfig {
    /// The sharding strategy.
    pub strategy: ShardingStrategy,
    /// Backward prefetch; default [`BackwardPrefetch::Pre`].
    pub backward_prefetch: BackwardPrefetch,
    /// Explicit forward prefetch (the next unit of the order recorded in the first step is
    /// all-gathered before the current unit computes); default off.
    pub forward_prefetch: bool,
    /// At most this many all-gathered unsharded buffers of units that will be freed in the
    /// current pass may be alive at once: a prefetch that would exceed it is not issued (the
    /// unit is gathered when needed). `None` disables the limiter. Default `Some(2)`.
    pub limit_all_gathers: Option<usize>,
    /// Ranks per node for the hybrid strategies (the shard group size); `None` means one node
    /// of all ranks. Ignored by the other strategies.
    pub ranks_per_node: Option<usize>,
    /// Capacity in bytes of the rank's host memory source behind its caching allocator.
    /// Default 4 GiB (reserved lazily, segment by segment).
    pub memory_capacity: usize,
    /// Cross-stream lifetime protection of unsharded buffers; default
    /// [`CrossStreamSafety::HeldReferences`].
    pub cross_stream: CrossStreamSafety,
    /// Record a timeline trace (compute and communication spans, allocator counters; see
    /// [`crate::trace`] and [`Fsdp::trace_events`](super::Fsdp::trace_events)). Default off (then nothing is recorded).
    pub trace: bool,
    /// Activation checkpointing of every unit: spans of the model driven by
    /// [`Fsdp::forward_backward`](super::Fsdp::forward_backward) that it can recompute keep only
    /// their input in forward and are recomputed right before their backward, with no extra
    /// collective (override per unit with
    /// [`Fsdp::set_activation_checkpointing`](super::Fsdp::set_activation_checkpointing); see
    /// [`checkpointing`](super::checkpointing)). Default off.
    pub activation_checkpointing: bool,
    /// The mixed-precision policy of every unit (override per unit with
    /// [`Fsdp::set_mixed_precision`](super::Fsdp::set_mixed_precision)); default full `f32`.
    pub mixed_precision: MixedPrecisionPolicy,
    /// Who divides the summed gradients by the data-parallel size; default
    /// [`GradientDivide::Model`] (the model's loss is normalised over the global batch).
    pub gradient_divide: GradientDivide,
    /// Align every parameter in its flat parameter as PyTorch does with `use_orig_params`:
    /// to 16 bytes of the unsharded dtype, the `param_dtype` of
    /// [`mixed_precision`](Self::mixed_precision) (4 elements for `f32`, 8 for `bf16`), with
    /// the flat parameter padded to a multiple of the shard group size
    /// ([`FlatParamLayoutBuilder::align_bytes`](fsdp_flatparam::FlatParamLayoutBuilder::align_bytes)).
    /// Default off.
    pub use_orig_params: bool,
    /// The options of the rank's caching allocator (PyTorch's `PYTORCH_CUDA_ALLOC_CONF`:
    /// `max_split_size`, `roundup_power2_divisions`, `garbage_collection_threshold`,
    /// `expandable_segments`; read one with
    /// [`AllocatorConfig::from_pytorch_conf`](fsdp_allocator::AllocatorConfig::from_pytorch_conf)).
    /// Used by [`Fsdp::new`](super::Fsdp::new) and the dry run of [`crate::plan`]; an engine
    /// built with [`Fsdp::with_parts`](super::Fsdp::with_parts) uses the pool it is given.
    /// Default: the allocator's defaults.
    pub allocator: fsdp_allocator::AllocatorConfig,
    /// On a device ([`Fsdp::new_on`](super::Fsdp::new_on)): keep the shards, the gradient
    /// shards and the optimizer state in host memory, where the optimizer steps (PyTorch's
    /// `CPUOffload(offload_params=True)`, FSDP2's `CPUOffloadPolicy`); the device then holds
    /// only the working set of a pass. Off (the default): they live on the device and the
    /// optimizer steps there. Nothing changes on the host engine.
    pub offload_params: bool,
}

impl FsdpConfig {
    /// The defaults with `strategy`.
    pub fn new(strategy: ShardingStrategy) -> Self {
        FsdpConfig {
            strategy,
            backward_prefetch: BackwardPrefetch::Pre,
            forward_prefetch: false,
            limit_all_gathers: Some(2),
            ranks_per_node: None,
            memory_capacity: 4 << 30,
            cross_stream: CrossStreamSafety::HeldReferences,
            trace: false,
            activation_checkpointing: false,
            mixed_precision: MixedPrecisionPolicy::default(),
            gradient_divide: GradientDivide::Model,
            use_orig_params: false,
            allocator: fsdp_allocator::AllocatorConfig::default(),
            offload_params: false,
        }
    }
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig::new(ShardingStrategy::FullShard)
    }
}

/// The kind of a recorded schedule event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// An all-gather of the unit's parameters was issued.
    AllGather,
    /// The unit's unsharded parameters were freed (resharded).
    Free,
    /// A reduce-scatter of the unit's gradient was issued.
    ReduceScatter,
    /// An all-reduce of the unit's gradient (shard) was issued.
    AllReduce,
}

/// Forward or backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The forward pass.
    Forward,
    /// The backward pass.
    Backward,
}

/// One issued collective or free, in issue order (see [`Fsdp::schedule`](super::Fsdp::schedule)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScheduleEvent {
    /// The forward/backward pass (micro-batch) it belongs to, counted from 1.
    pub step: u64,
    /// The pass it was issued in.
    pub phase: Phase,
    /// The unit's index in the plan.
    pub unit: usize,
    /// What was issued.
    pub kind: ScheduleKind,
    /// Whether an all-gather was a prefetch (issued ahead of the stage that needs it).
    pub prefetch: bool,
    /// All-gathered buffers counted by the limiter that are alive after this event.
    pub in_flight: usize,
}
