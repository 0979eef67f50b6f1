//! Checkpoints in the safetensors format.
//!
//! - **Full checkpoints** ([`save_full`], [`load_full`]): the whole model state with nanoGPT's
//!   parameter names and shapes, `f32` little-endian, so that PyTorch reads it:
//!   `model.load_state_dict(safetensors.torch.load_file(path), strict=False)` or
//!   `safetensors.torch.load_model(model, path)`. The tied `lm_head.weight` is **omitted**, as
//!   `safetensors.torch.save_model` does for shared tensors: it is the same storage as
//!   `transformer.wte.weight`, which the model re-ties on load. (A strict `load_state_dict` of
//!   the plain dictionary needs `sd["lm_head.weight"] = sd["transformer.wte.weight"]` first.)
//!   [`load_full`] accepts an `lm_head.weight` that equals `transformer.wte.weight`.
//! - **Sharded checkpoints**: a directory with one safetensors file per rank, each holding that
//!   rank's flat shards and the layout metadata, loadable at another world size.
//!
//! Every file is written atomically ([`write_atomic`]): to a temporary file in the same
//! directory, flushed and `fsync`ed, then renamed over the target, so a crash mid-save leaves the
//! previous file intact.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::model::{param_specs, GptConfig};
use crate::FsdpError;

/// The name PyTorch's `state_dict` gives the tied output projection.
pub const LM_HEAD: &str = "lm_head.weight";
/// The token embedding `lm_head.weight` is tied to.
pub const WTE: &str = "transformer.wte.weight";

fn err(path: &Path, reason: impl Into<String>) -> FsdpError {
    FsdpError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `path` atomically: `write` fills a temporary file in the same directory, which is then
/// flushed, `fsync`ed and renamed over `path` (and the directory `fsync`ed, where the platform
/// allows). If `write` or any step fails, the temporary file is removed and `path` keeps its
/// previous content.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<(), FsdpError> {
    let file_name = path
        .file_name()
        .ok_or_else(|| err(path, "the path names no file"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        file_name.to_string_lossy(),
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| -> io::Result<()> {
        let file = File::options().write(true).create_new(true).open(&tmp)?;
        let mut w = BufWriter::new(file);
        write(&mut w)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, path)?;
        // Make the rename durable. Opening a directory is not possible everywhere (Windows):
        // the rename itself is still atomic there.
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    result.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        err(path, format!("cannot write: {e}"))
    })
}

/// Little-endian bytes of `f32` values.
pub(crate) fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Converts an IEEE half-precision value to `f32` (exactly).
fn f16_to_f32(bits: u16) -> f32 {
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
pub(crate) fn tensor_f32(
    path: &Path,
    name: &str,
    view: &TensorView<'_>,
) -> Result<Vec<f32>, FsdpError> {
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

/// Reads and parses a safetensors file (the bytes stay owned by the caller).
pub(crate) fn read_bytes(path: &Path) -> Result<Vec<u8>, FsdpError> {
    fs::read(path).map_err(|e| err(path, format!("cannot read: {e}")))
}

pub(crate) fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>, FsdpError> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| err(path, format!("not a safetensors file ({e:?})")))
}

/// Serializes named `f32` tensors (with their shapes) and optional metadata into safetensors
/// bytes.
pub(crate) fn serialize_f32(
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
    safetensors::serialize(views, &metadata).map_err(|e| err(path, format!("{e:?}")))
}

/// Checks `params` against the model: every parameter of `cfg` with its number of elements, and
/// nothing else except an `lm_head.weight` equal to `transformer.wte.weight`.
fn check_params(
    path: &Path,
    cfg: &GptConfig,
    params: &HashMap<String, Vec<f32>>,
) -> Result<(), FsdpError> {
    let specs = param_specs(cfg);
    for s in &specs {
        let v = params
            .get(&s.name)
            .ok_or_else(|| err(path, format!("missing tensor `{}`", s.name)))?;
        if v.len() != s.numel() {
            return Err(err(
                path,
                format!(
                    "tensor `{}` has {} elements; its shape {:?} needs {}",
                    s.name,
                    v.len(),
                    s.shape,
                    s.numel()
                ),
            ));
        }
    }
    for (name, v) in params {
        if name == LM_HEAD {
            if params.get(WTE) != Some(v) {
                return Err(err(
                    path,
                    format!("tensor `{LM_HEAD}` differs from `{WTE}` (they are tied)"),
                ));
            }
        } else if !specs.iter().any(|s| &s.name == name) {
            return Err(err(
                path,
                format!("unexpected tensor `{name}`: not a parameter of the model"),
            ));
        }
    }
    Ok(())
}

/// Writes the full model state to `path`: every parameter of `cfg` under nanoGPT's name and
/// shape, `f32` little-endian, with metadata `format = pt`. The tied `lm_head.weight` is omitted
/// (see the [module docs](self)); if `params` holds it, it must equal `transformer.wte.weight`.
///
/// The parameters are validated (names and sizes) before anything is written, and the file is
/// written atomically ([`write_atomic`]).
pub fn save_full(
    path: &Path,
    cfg: &GptConfig,
    params: &HashMap<String, Vec<f32>>,
) -> Result<(), FsdpError> {
    cfg.validate()?;
    check_params(path, cfg, params)?;
    let tensors: Vec<_> = param_specs(cfg)
        .into_iter()
        .map(|s| {
            let bytes = f32_bytes(&params[&s.name]);
            (s.name, s.shape, bytes)
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = serialize_f32(path, &tensors, Some(metadata))?;
    write_atomic(path, |w| w.write_all(&bytes))
}

/// Reads a full checkpoint written by [`save_full`] or by PyTorch (`safetensors.torch`), e.g. the
/// golden `gpt_tiny_init.safetensors`.
///
/// Every parameter of `cfg` must be present with its exact shape; any other tensor is an error,
/// except `lm_head.weight` when it equals `transformer.wte.weight` (and nanoGPT's causal-mask
/// buffers `transformer.h.N.attn.bias` of shape `[1, 1, block_size, block_size]`, written by
/// nanoGPT without flash attention, which are skipped). Tensors may be F32, BF16 or F16 (converted
/// to `f32` exactly). Errors name the file and the tensor at fault.
///
/// Each rank keeps only its shard by passing the returned map to
/// [`FsdpGpt::new`](crate::runtime::FsdpGpt::new).
pub fn load_full(path: &Path, cfg: &GptConfig) -> Result<HashMap<String, Vec<f32>>, FsdpError> {
    cfg.validate()?;
    let bytes = read_bytes(path)?;
    let st = parse(path, &bytes)?;
    let specs = param_specs(cfg);
    let mut out = HashMap::with_capacity(specs.len());
    for s in &specs {
        let view = st
            .tensor(&s.name)
            .map_err(|_| err(path, format!("missing tensor `{}`", s.name)))?;
        if view.shape() != s.shape.as_slice() {
            return Err(err(
                path,
                format!(
                    "tensor `{}` has shape {:?}, expected {:?}",
                    s.name,
                    view.shape(),
                    s.shape
                ),
            ));
        }
        out.insert(s.name.clone(), tensor_f32(path, &s.name, &view)?);
    }
    // Report unexpected names in a stable (sorted) order.
    let names: BTreeMap<&String, ()> = st.names().into_iter().map(|n| (n, ())).collect();
    for name in names.keys() {
        let name = name.as_str();
        if out.contains_key(name) {
            continue;
        }
        let view = st.tensor(name).map_err(|e| err(path, format!("{e:?}")))?;
        if name == LM_HEAD {
            let wte = &specs[0];
            if view.shape() != wte.shape.as_slice() {
                return Err(err(
                    path,
                    format!(
                        "tensor `{LM_HEAD}` has shape {:?}, expected {:?} (tied to `{WTE}`)",
                        view.shape(),
                        wte.shape
                    ),
                ));
            }
            let v = tensor_f32(path, name, &view)?;
            if out.get(WTE) != Some(&v) {
                return Err(err(
                    path,
                    format!(
                        "tensor `{LM_HEAD}` differs from `{WTE}`; this model ties them, untied \
                         weights are not supported"
                    ),
                ));
            }
        } else if is_mask_buffer(cfg, name, view.shape()) {
            // nanoGPT's non-flash causal mask: a buffer, not a parameter.
        } else {
            return Err(err(
                path,
                format!("unexpected tensor `{name}`: not a parameter of the model"),
            ));
        }
    }
    Ok(out)
}

fn is_mask_buffer(cfg: &GptConfig, name: &str, shape: &[usize]) -> bool {
    let Some(rest) = name.strip_prefix("transformer.h.") else {
        return false;
    };
    let Some(layer) = rest.strip_suffix(".attn.bias") else {
        return false;
    };
    layer.parse::<usize>().is_ok_and(|l| l < cfg.n_layer)
        && shape == [1, 1, cfg.block_size, cfg.block_size]
}
