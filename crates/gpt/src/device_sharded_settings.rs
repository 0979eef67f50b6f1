//! What a [`ShardedDeviceTrainer`] is set to and reports of itself: its settings, strategy,
//! operations and collectives, the prefetch and non-finite limits, the bytes its collectives
//! moved, its memory and its shards' lengths.

use fsdp::ShardingStrategy;
use fsdp_kernels::gpt::{param_shapes, GptOps};

use crate::device_comm::{CommVolume, DeviceComm};
use crate::device_config::DeviceTrainConfig;
use crate::device_shard::{shard_len, Prefetch};
use crate::device_sharded::ShardedDeviceTrainer;

impl<O: GptOps, C: DeviceComm<O>> ShardedDeviceTrainer<O, C> {
    /// The settings.
    pub fn config(&self) -> &DeviceTrainConfig {
        &self.config
    }

    /// The sharding strategy.
    pub fn strategy(&self) -> ShardingStrategy {
        self.strategy
    }

    /// The operations.
    pub fn ops(&self) -> &O {
        self.pass.ops()
    }

    /// The collectives.
    pub fn comm(&self) -> &C {
        &self.comm
    }

    /// Skip at most `limit` non-finite steps, as
    /// [`DeviceTrainer::set_skip_nonfinite`](crate::device_train::DeviceTrainer::set_skip_nonfinite)
    /// (every rank decides the same: the loss and the norm are the ranks').
    pub fn set_skip_nonfinite(&mut self, limit: Option<u64>) {
        self.skip_nonfinite = limit;
    }

    /// Which all-gathers each pass issues ahead of their use (default [`Prefetch::default`]:
    /// backward on, forward off, as FSDP's defaults).
    pub fn set_prefetch(&mut self, prefetch: Prefetch) {
        self.prefetch = prefetch;
    }

    /// The bytes this rank's collectives have moved in the training steps so far (the units'
    /// all-gathers and reductions, each in the dtype it moved; not the scalars' all-reduce,
    /// nor the gathers of saving and checkpoints).
    pub fn comm_volume(&self) -> CommVolume {
        self.volume
    }

    /// Optimizer steps taken, as far as the outcomes read so far say.
    pub fn optimizer_steps(&self) -> u64 {
        self.known_steps
    }

    /// The device memory this rank's operations hold now, and their peak.
    pub fn memory(&self) -> fsdp_kernels::gpt::MemoryUse {
        self.ops().memory()
    }

    /// Elements of this rank's shard of each tensor, in
    /// [`param_shapes`] order.
    pub fn shard_lens(&self) -> Vec<usize> {
        param_shapes(&self.config.dims())
            .iter()
            .map(|(_, s)| shard_len(s.iter().product(), self.factor))
            .collect()
    }
}
