//! Streaming a full safetensors checkpoint into one rank's shards: the header is parsed, then
//! only the bytes of the parameter pieces that lie in the rank's shard are read, in chunks, so
//! no rank ever holds the whole model or a whole unit.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use fsdp_flatparam::FlatParamLayout;

use crate::checkpoint::{err, f16_to_f32};
use crate::FsdpError;

/// Elements read per chunk.
const CHUNK: usize = 1 << 18;

/// The safetensors header's bound (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// Write shard `shard_index` of `layout` from the full checkpoint at `path` into `out`.
pub(crate) fn read_shard(
    path: &Path,
    layout: &FlatParamLayout,
    shard_index: usize,
    out: &mut [f32],
) -> Result<(), FsdpError> {
    let io = |what: &str, e: std::io::Error| err(path, format!("cannot {what}: {e}"));
    let mut f = File::open(path).map_err(|e| io("open", e))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|e| io("read the header", e))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        return Err(err(
            path,
            format!("header of {n} bytes: not a safetensors file"),
        ));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .map_err(|e| io("read the header", e))?;
    let header: serde_json::Value = serde_json::from_slice(&header).map_err(|e| {
        err(
            path,
            format!("header is not JSON ({e}): not a safetensors file"),
        )
    })?;
    let data_start = 8 + n;
    if out.len() != layout.shard_numel() {
        return Err(FsdpError::InvalidShape {
            reason: format!(
                "a shard buffer of {} elements, the layout's shards have {}",
                out.len(),
                layout.shard_numel()
            ),
        });
    }
    // Every parameter's entry is checked on every rank, not only those with a piece in this
    // rank's shard, so that a missing or mis-shaped tensor fails on every rank alike (a rank
    // that constructed would otherwise wait in its first collective for the ones that failed).
    let mut entries = Vec::with_capacity(layout.num_params());
    for p in layout.params() {
        let t = header
            .get(p.name())
            .ok_or_else(|| err(path, format!("missing tensor `{}`", p.name())))?;
        let shape: Option<Vec<usize>> = t.get("shape").and_then(|s| {
            s.as_array()?
                .iter()
                .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                .collect()
        });
        if shape.as_deref() != Some(p.shape()) {
            return Err(err(
                path,
                match &shape {
                    Some(shape) => format!(
                        "tensor `{}` has shape {shape:?}, expected {:?}",
                        p.name(),
                        p.shape()
                    ),
                    None => format!("tensor `{}` has no valid shape", p.name()),
                },
            ));
        }
        let dtype = t.get("dtype").and_then(|d| d.as_str()).unwrap_or("");
        let size: u64 = match dtype {
            "F32" => 4,
            "BF16" | "F16" => 2,
            other => {
                return Err(err(
                    path,
                    format!(
                        "tensor `{}` has dtype {other}; expected F32, BF16 or F16",
                        p.name()
                    ),
                ))
            }
        };
        let offsets: Option<Vec<u64>> = t
            .get("data_offsets")
            .and_then(|o| o.as_array()?.iter().map(|x| x.as_u64()).collect());
        let begin = match offsets.as_deref() {
            Some([b, e]) if e.checked_sub(*b) == Some(p.numel() as u64 * size) => *b,
            _ => {
                return Err(err(
                    path,
                    format!("tensor `{}` has invalid data offsets", p.name()),
                ))
            }
        };
        entries.push((dtype, size, begin));
    }
    out.fill(0.0);
    let mut bytes = Vec::new();
    let pieces = layout.shard_param_infos(shard_index)?;
    for ((p, info), &(dtype, size, begin)) in layout.params().iter().zip(&pieces).zip(&entries) {
        if !info.in_shard {
            continue;
        }
        let dst = &mut out[info.shard_range()];
        let first = info.intra_param_start_idx as u64;
        for (c, chunk) in dst.chunks_mut(CHUNK).enumerate() {
            let at = data_start + begin + (first + (c * CHUNK) as u64) * size;
            f.seek(SeekFrom::Start(at)).map_err(|e| io("seek", e))?;
            bytes.resize(chunk.len() * size as usize, 0);
            f.read_exact(&mut bytes)
                .map_err(|e| io(&format!("read tensor `{}`", p.name()), e))?;
            match dtype {
                "F32" => {
                    for (x, b) in chunk.iter_mut().zip(bytes.chunks_exact(4)) {
                        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
                "BF16" => {
                    for (x, b) in chunk.iter_mut().zip(bytes.chunks_exact(2)) {
                        *x = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                    }
                }
                _ => {
                    for (x, b) in chunk.iter_mut().zip(bytes.chunks_exact(2)) {
                        *x = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                    }
                }
            }
        }
    }
    Ok(())
}
