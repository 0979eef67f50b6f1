//! Where the shards' initial values come from (see [`ParamInit`]): each rank writes only its
//! own shard of every unit.

use std::collections::HashMap;
use std::path::Path;

use fsdp_device::Buffer;
use fsdp_flatparam::FlatParamLayout;

use super::comm_context::CommContext;
use crate::init::{fill_shard, InitRule};
use crate::FsdpError;

/// The initial values of the parameters.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub enum ParamInit<'a> {
    /// Every rank passes the full values by name (the same on every rank); each keeps its
    /// shard. Construction holds one unit's flat copy at a time outside the allocator.
    Full(&'a HashMap<String, Vec<f32>>),
    /// Sharded initialisation (FSDP2's meta-device init, ZeRO's `zero.Init`): each rank
    /// writes only its own shards, from the counter-based generator of [`crate::init`] keyed
    /// by (seed, parameter name, element index) with the initialiser `rule(name, shape)`
    /// gives each parameter. The same seed gives the same model at every world size; no
    /// rank ever holds more than its shards.
    Seeded {
        /// The seed.
        seed: u64,
        /// The initialiser of each parameter.
        rule: &'a InitRule<'a>,
    },
    /// PyTorch's `sync_module_states`: rank 0 passes the full values (`Some`), the other ranks
    /// `None`; each unit is broadcast from rank 0 in turn, so every rank starts equal and a
    /// rank other than 0 holds at most its shards plus one unit.
    SyncFromRank0(Option<&'a HashMap<String, Vec<f32>>>),
    /// A full safetensors checkpoint, streamed tensor piece by tensor piece into the shards:
    /// each rank reads only the bytes of its own shards (F32, BF16 or F16 tensors; other
    /// tensors in the file are ignored), so no rank holds the whole model, nor even a unit.
    Safetensors(&'a Path),
    /// Zeros everywhere (for loading a checkpoint next).
    Zeros,
    /// No values: the engine runs on the meta device (a dry run) and moves no data.
    Meta,
}

impl std::fmt::Debug for ParamInit<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParamInit::Full(m) => write!(f, "ParamInit::Full({} tensors)", m.len()),
            ParamInit::Seeded { seed, .. } => write!(f, "ParamInit::Seeded {{ seed: {seed} }}"),
            ParamInit::SyncFromRank0(m) => {
                write!(
                    f,
                    "ParamInit::SyncFromRank0({})",
                    if m.is_some() { "values" } else { "None" }
                )
            }
            ParamInit::Safetensors(p) => write!(f, "ParamInit::Safetensors({})", p.display()),
            ParamInit::Zeros => f.write_str("ParamInit::Zeros"),
            ParamInit::Meta => f.write_str("ParamInit::Meta"),
        }
    }
}

/// Write this rank's shard `shard_index` of `layout` into `shard`.
pub(crate) fn init_shard(
    init: &ParamInit<'_>,
    ctx: &CommContext,
    layout: &FlatParamLayout,
    shard_index: usize,
    shard: &Buffer,
) -> Result<(), FsdpError> {
    if ctx.is_meta() {
        return Ok(());
    }
    match init {
        ParamInit::Meta => Err(FsdpError::InvalidFsdpConfig {
            reason: "ParamInit::Meta needs a meta-device memory pool (a dry run)".into(),
        }),
        ParamInit::Zeros => ctx.fill(shard, 0.0),
        ParamInit::Full(values) => {
            let flat = flatten(layout, values)?;
            shard.copy_from_slice(layout.shard(&flat, shard_index)?)?;
            Ok(())
        }
        ParamInit::Seeded { seed, rule } => {
            let mut out = shard.write::<f32>()?;
            fill_shard(layout, shard_index, *seed, rule, &mut out)
        }
        ParamInit::SyncFromRank0(values) => {
            let world = ctx.groups.world();
            let full = ctx.alloc_local(layout.padded_numel())?;
            match (world.rank(), values) {
                (0, Some(values)) => full.copy_from_slice(&flatten(layout, values)?)?,
                (0, None) => {
                    return Err(FsdpError::InvalidFsdpConfig {
                        reason: "rank 0: sync_module_states needs rank 0's values".into(),
                    })
                }
                (r, Some(_)) => {
                    return Err(FsdpError::InvalidFsdpConfig {
                        reason: format!("rank {r}: sync_module_states takes values on rank 0 only"),
                    })
                }
                (_, None) => {}
            }
            if world.world_size() > 1 {
                world.broadcast(&full, 0)?.wait()?;
            }
            let flat = full.read::<f32>()?;
            shard.copy_from_slice(layout.shard(&flat, shard_index)?)?;
            Ok(())
        }
        ParamInit::Safetensors(path) => {
            let mut out = shard.write::<f32>()?;
            super::stream_load::read_shard(path, layout, shard_index, &mut out)
        }
    }
}

/// The unit's flat buffer from full values by name.
fn flatten(
    layout: &FlatParamLayout,
    values: &HashMap<String, Vec<f32>>,
) -> Result<Vec<f32>, FsdpError> {
    let mut parts = Vec::with_capacity(layout.num_params());
    for p in layout.params() {
        let v = values
            .get(p.name())
            .ok_or_else(|| FsdpError::UnknownParameter {
                name: p.name().to_string(),
            })?;
        if v.len() != p.numel() {
            return Err(FsdpError::ParameterLength {
                name: p.name().to_string(),
                expected: p.numel(),
                actual: v.len(),
            });
        }
        parts.push(v.as_slice());
    }
    Ok(layout.flatten(&parts)?)
}
