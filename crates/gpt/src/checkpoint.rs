//! Full checkpoints of the reference GPT in safetensors ([`save_full`], [`load_full`]): the
//! whole model state with nanoGPT's parameter names and shapes, `f32` little-endian, so that
//! PyTorch reads it: `model.load_state_dict(safetensors.torch.load_file(path), strict=False)` or
//! `safetensors.torch.load_model(model, path)`. The tied `lm_head.weight` is **omitted**, as
//! `safetensors.torch.save_model` does for shared tensors: it is the same storage as
//! `transformer.wte.weight`, which the model re-ties on load. (A strict `load_state_dict` of the
//! plain dictionary needs `sd["lm_head.weight"] = sd["transformer.wte.weight"]` first.)
//! [`load_full`] accepts an `lm_head.weight` that equals `transformer.wte.weight`.
//!
//! Sharded checkpoints are the engine's ([`fsdp::checkpoint`]); files are written atomically
//! ([`fsdp::checkpoint::write_atomic`]).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use fsdp::checkpoint::{
    err, f32_bytes, load_sharded_checkpoint, parse, read_bytes, serialize_f32, tensor_f32,
    write_atomic, ShardedCheckpoint,
};
use fsdp::FsdpError;

use crate::model::{param_specs, GptConfig};

/// The name PyTorch's `state_dict` gives the tied output projection.
pub const LM_HEAD: &str = "lm_head.weight";
/// The token embedding `lm_head.weight` is tied to.
pub const WTE: &str = "transformer.wte.weight";

/// Checks `params` against the model: every parameter of `cfg` with its number of elements and
/// finite values, and nothing else except an `lm_head.weight` equal to `transformer.wte.weight`.
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
        check_finite(path, &s.name, v)?;
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
/// shape, `f32` little-endian, with metadata `format = pt` and the model sizes ([`SIZE_KEYS`],
/// read back by [`read_sizes`]). The tied `lm_head.weight` is omitted
/// (see the [module docs](self)); if `params` holds it, it must equal `transformer.wte.weight`.
///
/// The parameters are validated (names, sizes, and finite values: a NaN or an infinity is an
/// error naming the tensor, since [`load_full`] would refuse the file) before anything is
/// written, and the file is written atomically ([`write_atomic`]), so an existing file is
/// either replaced whole or left as it was.
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
    let mut metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    for (key, value) in SIZE_KEYS.into_iter().zip(sizes_of(cfg)) {
        metadata.insert(key.to_string(), value.to_string());
    }
    let bytes = serialize_f32(path, &tensors, Some(metadata))?;
    write_atomic(path, |w| w.write_all(&bytes))
}

/// The metadata keys under which [`save_full`] records the model sizes (decimal strings), in
/// [`GptConfig`]'s order: `n_layer`, `n_head`, `n_embd`, `block_size`, `vocab_size`.
pub const SIZE_KEYS: [&str; 5] = ["n_layer", "n_head", "n_embd", "block_size", "vocab_size"];

/// The sizes of `cfg` in [`SIZE_KEYS`] order.
fn sizes_of(cfg: &GptConfig) -> [usize; 5] {
    [
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.block_size,
        cfg.vocab_size,
    ]
}

/// The model sizes a full checkpoint holds, as far as they are known ([`read_sizes`]), in
/// [`SIZE_KEYS`] order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointSizes {
    /// `n_layer`, `n_head`, `n_embd`, `block_size`, `vocab_size`: each from the metadata, or
    /// inferred from the tensor shapes, or `None` when neither tells (`n_head` never can be
    /// inferred).
    pub sizes: [Option<usize>; 5],
    /// Which of them come from the metadata (the others were inferred from shapes).
    pub from_metadata: [bool; 5],
}

/// Largest safetensors header read (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100_000_000;

/// Reads the model sizes of a full checkpoint from its header only (the tensors are not read):
/// the metadata [`save_full`] writes ([`SIZE_KEYS`]) and, for the sizes it does not hold (files
/// of PyTorch or of older versions), what the shapes tell: `vocab_size` and `n_embd` from
/// `transformer.wte.weight`, `block_size` from `transformer.wpe.weight`, `n_layer` from the
/// highest block index `transformer.h.N.` plus one. `n_head` cannot be inferred.
///
/// # Errors
/// [`FsdpError::Checkpoint`] naming `path`: it cannot be read, it is not a safetensors file,
/// or a size in its metadata is not a positive integer.
pub fn read_sizes(path: &Path) -> Result<CheckpointSizes, FsdpError> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| err(path, format!("cannot read: {e}")))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|e| err(path, format!("not a safetensors file ({e})")))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        return Err(err(
            path,
            format!("not a safetensors file (a header of {n} bytes)"),
        ));
    }
    let mut header = Vec::new();
    file.take(n)
        .read_to_end(&mut header)
        .map_err(|e| err(path, format!("cannot read: {e}")))?;
    let header: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| err(path, format!("not a safetensors file (header: {e})")))?;
    let Some(header) = header.as_object() else {
        return Err(err(
            path,
            "not a safetensors file (its header is not a map)",
        ));
    };
    let mut out = CheckpointSizes::default();
    let metadata = header.get("__metadata__").and_then(|m| m.as_object());
    for (i, key) in SIZE_KEYS.iter().enumerate() {
        let Some(v) = metadata.and_then(|m| m.get(*key)) else {
            continue;
        };
        let size = v
            .as_str()
            .and_then(|s| s.parse::<usize>().ok())
            .filter(|&s| s > 0)
            .ok_or_else(|| {
                err(
                    path,
                    format!("metadata `{key}` is {v}, not a positive size"),
                )
            })?;
        out.sizes[i] = Some(size);
        out.from_metadata[i] = true;
    }
    let shape = |name: &str| -> Option<Vec<usize>> {
        let dims = header.get(name)?.get("shape")?.as_array()?;
        dims.iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect()
    };
    let mut inferred: [Option<usize>; 5] = [None; 5];
    if let Some([v, e]) = shape(WTE).as_deref() {
        inferred[4] = Some(*v);
        inferred[2] = Some(*e);
    }
    if let Some([b, _]) = shape("transformer.wpe.weight").as_deref() {
        inferred[3] = Some(*b);
    }
    inferred[0] = header
        .keys()
        .filter_map(|k| {
            let rest = k.strip_prefix("transformer.h.")?;
            rest.split_once('.')?.0.parse::<usize>().ok()
        })
        .max()
        .map(|n| n + 1);
    for (slot, guess) in out.sizes.iter_mut().zip(inferred) {
        if slot.is_none() {
            *slot = guess.filter(|&g| g > 0);
        }
    }
    Ok(out)
}

/// Reads a full checkpoint written by [`save_full`] or by PyTorch (`safetensors.torch`), e.g. the
/// golden `gpt_tiny_init.safetensors`.
///
/// Every parameter of `cfg` must be present with its exact shape; any other tensor is an error,
/// except `lm_head.weight` when it equals `transformer.wte.weight` (and nanoGPT's causal-mask
/// buffers `transformer.h.N.attn.bias` of shape `[1, 1, block_size, block_size]`, written by
/// nanoGPT without flash attention, which are skipped). Tensors may be F32, BF16 or F16 (converted
/// to `f32` exactly) and must hold finite values (a NaN or an infinity is an error, "tensor `X`
/// holds NaN or infinite values"). Errors name the file and the tensor at fault.
///
/// Each rank keeps only its shard by passing the returned map to
/// [`FsdpGpt::new`](crate::runtime::FsdpGpt::new) (or to [`fsdp::ParamInit::Full`]).
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
        let values = tensor_f32(path, &s.name, &view)?;
        check_finite(path, &s.name, &values)?;
        out.insert(s.name.clone(), values);
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

/// A tensor with a NaN or an infinity is an error naming it: training from it (or saving it)
/// would only spread them.
fn check_finite(path: &Path, name: &str, values: &[f32]) -> Result<(), FsdpError> {
    if values.iter().all(|x| x.is_finite()) {
        return Ok(());
    }
    Err(err(
        path,
        format!("tensor `{name}` holds NaN or infinite values"),
    ))
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

/// Reads a sharded checkpoint of the GPT `cfg` (see [`fsdp::checkpoint::load_sharded`]).
///
/// # Errors
/// An invalid configuration, and those of [`load_sharded_checkpoint`].
pub fn load_sharded(dir: &Path, cfg: &GptConfig) -> Result<HashMap<String, Vec<f32>>, FsdpError> {
    Ok(load_sharded_gpt(dir, cfg)?.params)
}

/// Reads a sharded checkpoint of the GPT `cfg` with its optimizer state (see
/// [`load_sharded_checkpoint`]).
///
/// # Errors
/// An invalid configuration, and those of [`load_sharded_checkpoint`].
pub fn load_sharded_gpt(dir: &Path, cfg: &GptConfig) -> Result<ShardedCheckpoint, FsdpError> {
    cfg.validate()?;
    load_sharded_checkpoint(dir, &param_specs(cfg))
}
