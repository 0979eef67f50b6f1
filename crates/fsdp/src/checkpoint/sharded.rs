//! Sharded checkpoints: one safetensors file per rank with its shards and the layout as JSON,
//! reassembled into full tensors at any world size (see the [module docs](super)).
//!
//! This file holds the format's types and writes a rank's file; [`metadata`] encodes and decodes
//! the layout JSON, [`load`] reads the files back and reassembles them.

mod load;
mod metadata;

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use super::{err, f32_bytes, serialize_f32, write_atomic};
use crate::engine::OptimizerSetup;
use crate::FsdpError;

pub use load::{load_sharded, load_sharded_checkpoint, FullOptimizerState, ShardedCheckpoint};
use metadata::layout_json;

/// The metadata key under which each rank file of a sharded checkpoint stores its layout (JSON).
pub const LAYOUT_KEY: &str = "fsdp_layout";

/// File name of rank `rank`'s shards in a sharded checkpoint of `world` ranks.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("rank-{rank:05}-of-{world:05}.safetensors")
}

/// One parameter inside a unit's unsharded flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardParam {
    /// The parameter's name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its first element in the unsharded (padded) flat buffer.
    pub offset: usize,
}

/// The layout of one FSDP unit as a sharded checkpoint records it: enough to reassemble every
/// parameter from the unit's `factor` shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    /// The unit's index in the runtime.
    pub unit: usize,
    /// The sharding factor F (1: NO_SHARD, world 1, or the replicated ignored unit).
    pub factor: usize,
    /// Which of the F shards this file holds (the rank in the shard group).
    pub shard_index: usize,
    /// Elements of the unsharded flat buffer, padding included (`factor * shard_numel`).
    pub padded_numel: usize,
    /// Elements of one shard.
    pub shard_numel: usize,
    /// The parameters, in flat order.
    pub params: Vec<ShardParam>,
}

/// One unit's tensors in a rank file: kind (`param`, `exp_avg`, ...) and this rank's shard.
pub(crate) type UnitTensors = Vec<(&'static str, Vec<f32>)>;

/// What one rank contributes to a sharded checkpoint (built by
/// [`Fsdp::save_sharded`](crate::engine::Fsdp::save_sharded)).
#[derive(Debug, Clone)]
pub(crate) struct RankShards {
    pub rank: usize,
    pub world: usize,
    pub strategy: String,
    /// `adamw`, `sgd` or `none` (no state buffers).
    pub optimizer: &'static str,
    /// The optimizer's step count (the same for every unit).
    pub optimizer_step: u64,
    /// The runtime's count of optimizer steps.
    pub optimizer_steps: u64,
    /// Per unit: its layout and its tensors (`param`, `exp_avg`, `exp_avg_sq`,
    /// `momentum_buffer`), each `shard_numel` long.
    pub units: Vec<(ShardLayout, UnitTensors)>,
    /// The optimizer groups and learning-rate schedule.
    pub setup: OptimizerSetup,
}

/// Writes one rank's file of a sharded checkpoint into `dir` (created if needed), atomically.
pub(crate) fn write_rank_shards(dir: &Path, shards: &RankShards) -> Result<(), FsdpError> {
    fs::create_dir_all(dir).map_err(|e| err(dir, format!("cannot create directory: {e}")))?;
    let path = dir.join(shard_file_name(shards.rank, shards.world));
    let mut tensors = Vec::new();
    for (l, ts) in &shards.units {
        for (kind, values) in ts {
            tensors.push((
                format!("unit.{}.{kind}", l.unit),
                vec![values.len()],
                f32_bytes(values),
            ));
        }
    }
    let metadata = HashMap::from([
        ("format".to_string(), "fsdp-sharded".to_string()),
        (LAYOUT_KEY.to_string(), layout_json(shards).to_string()),
    ]);
    let bytes = serialize_f32(&path, &tensors, Some(metadata))?;
    write_atomic(&path, |w| w.write_all(&bytes))
}

#[cfg(test)]
mod tests;
