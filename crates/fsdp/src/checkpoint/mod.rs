//! Checkpoints in the safetensors format.
//!
//! - **Sharded checkpoints** ([`Fsdp::save_sharded`](crate::engine::Fsdp::save_sharded),
//!   [`load_sharded`], [`load_sharded_checkpoint`]): a directory with one safetensors file per
//!   rank, `rank-RRRRR-of-WWWWW.safetensors` ([`shard_file_name`]), holding that rank's flat
//!   shard of every FSDP unit (`unit.U.param`) and its optimizer state shards (`unit.U.exp_avg`,
//!   `unit.U.exp_avg_sq` for AdamW, `unit.U.momentum_buffer` for SGD with momentum, and for
//!   AnyPrecisionAdamW its moments and `unit.U.compensation` written exactly as f32), with the
//!   layout as JSON under the metadata key [`LAYOUT_KEY`] (world size, strategy, optimizer step,
//!   and per unit its [`ShardLayout`]: sharding factor F, which shard the file holds, padded and
//!   shard sizes, each parameter's name, shape and flat offset). Every rank writes its file,
//!   replicas included (NO_SHARD, hybrid strategies), so each file is self-contained; loading
//!   uses the lowest rank's copy of each shard. [`load_sharded`] reassembles the full tensors from
//!   any world size's files and [`Fsdp::new`](crate::engine::Fsdp::new) reshards them for the new
//!   world; [`Fsdp::load_optimizer_state`](crate::engine::Fsdp::load_optimizer_state) then
//!   restores the optimizer state, so training resumes where it stopped.
//! - **Periodic checkpoints** ([`CheckpointDir`]): one directory of `step-K` checkpoints, each
//!   complete or absent — the ranks write into `step-K.tmp`, one process commits it by renaming
//!   it to `step-K`, and older ones are removed only after that ([`dir`] describes the protocol).
//! - **Building blocks for full checkpoints** of a model: [`write_atomic`], [`serialize_f32`],
//!   [`read_bytes`], [`parse`] and [`tensor_f32`] (F32, BF16 and F16 tensors read as `f32`).
//!
//! - **Output files** that never damage what is there: [`check_output_path`] says before any
//!   work starts whether a path may be written ([`OutputKind`]: absent, a regular file, or for
//!   streams a character device or a FIFO; a directory, a block device or a socket is an
//!   error), [`write_atomic`] replaces a regular file atomically and [`write_output`] also
//!   writes into a stream directly. Symbolic links are followed ([`resolve_output_path`]) and
//!   stay links.
//!
//! Every file is written atomically ([`write_atomic`]): to a temporary file
//! `.NAME.fsdp-tmp.PID.N` in the same directory, flushed and `fsync`ed, then renamed over the
//! target, so a crash mid-save leaves the previous file intact; the temporaries that dead
//! writers left behind are removed by the next write of the same file
//! ([`remove_stale_temporaries`]).

pub mod dir;
mod full;
mod output;
mod sharded;

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::FsdpError;

pub use dir::{step_dir_name, CheckpointDir, Committed, STAGING_SUFFIX};
pub use full::{write_full_checkpoint, FullAdamW, FullAnyPrecision, FullParam, FullState};
pub use output::{
    check_output_path, remove_stale_temporaries, resolve_output_path, write_atomic, write_output,
    OutputKind, PROBE_MARKER, TEMPORARY_MARKER,
};
pub use sharded::{
    load_sharded, load_sharded_checkpoint, shard_file_name, FullOptimizerState, ShardLayout,
    ShardParam, ShardedCheckpoint, LAYOUT_KEY,
};
pub(crate) use sharded::{write_rank_shards, RankShards};

/// A [`FsdpError::Checkpoint`] naming `path`.
pub fn err(path: &Path, reason: impl Into<String>) -> FsdpError {
    FsdpError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Little-endian bytes of `f32` values.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Converts an IEEE half-precision value to `f32` (exactly).
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits >> 15) << 31;
    let exp = u32::from((bits >> 10) & 0x1f);
    let man = u32::from(bits & 0x3ff);
    let out = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: m · 2^-24.
            let v = m as f32 * f32::from_bits(0x3380_0000); // 2^-24
            return if sign != 0 { -v } else { v };
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(out)
}

/// A tensor's values as `f32`: F32 as is, BF16 and F16 converted exactly.
pub fn tensor_f32(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, FsdpError> {
    let data = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        other => {
            return Err(err(
                path,
                format!("tensor `{name}` has dtype {other:?}; expected F32, BF16 or F16"),
            ))
        }
    })
}

/// Reads a file's bytes (errors name the file).
pub fn read_bytes(path: &Path) -> Result<Vec<u8>, FsdpError> {
    fs::read(path).map_err(|e| err(path, format!("cannot read: {e}")))
}

/// Parses safetensors bytes read from `path` (the bytes stay owned by the caller).
pub fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>, FsdpError> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| err(path, format!("not a safetensors file ({e:?})")))
}

/// Serializes named `f32` tensors (with their shapes) and optional metadata into safetensors
/// bytes.
pub fn serialize_f32(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<u8>)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>, FsdpError> {
    let views = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|v| (name.as_str(), v))
                .map_err(|e| err(path, format!("tensor `{name}`: {e:?}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut bytes =
        safetensors::serialize(views, &metadata).map_err(|e| err(path, format!("{e:?}")))?;
    if let Some(m) = &metadata {
        sort_metadata(&mut bytes, m);
    }
    Ok(bytes)
}

/// Rewrites the metadata map in a serialized safetensors file in key order. safetensors writes
/// it in `HashMap` order, which differs from run to run, so the same tensors and metadata would
/// give different bytes. The sorted map has the same entries, hence the same length: it
/// replaces the original in place, and nothing else in the file moves.
fn sort_metadata(bytes: &mut [u8], metadata: &HashMap<String, String>) {
    const KEY: &[u8] = b"\"__metadata__\":";
    let sorted: std::collections::BTreeMap<&String, &String> = metadata.iter().collect();
    let Ok(json) = serde_json::to_string(&sorted) else {
        return;
    };
    let Some(len) = bytes
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .and_then(|b| usize::try_from(u64::from_le_bytes(b)).ok())
    else {
        return;
    };
    let Some(header) = bytes.get_mut(8..8usize.saturating_add(len)) else {
        return;
    };
    let Some(pos) = header.windows(KEY.len()).position(|w| w == KEY) else {
        return;
    };
    let (start, end) = (pos + KEY.len(), pos + KEY.len() + json.len());
    // Replace only what is exactly the same map.
    let same = header
        .get(start..end)
        .and_then(|m| serde_json::from_slice::<HashMap<String, String>>(m).ok())
        .is_some_and(|m| m == *metadata);
    if same {
        header[start..end].copy_from_slice(json.as_bytes());
    }
}
