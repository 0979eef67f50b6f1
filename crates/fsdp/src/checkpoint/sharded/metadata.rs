//! The layout metadata of a rank file as JSON: written with the file ([`layout_json`]) and read
//! back and checked ([`parse_rank_file`]), the optimizer setup included.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;

use super::{RankShards, ShardLayout, ShardParam, LAYOUT_KEY};
use crate::checkpoint::{err, read_bytes};
use crate::engine::OptimizerSetup;
use crate::optim::{LrSchedule, ParamGroupOptions};
use crate::FsdpError;

/// Version of the sharded layout format.
const FORMAT_VERSION: u64 = 1;

/// The optimizer setup as JSON.
fn setup_json(s: &OptimizerSetup) -> serde_json::Value {
    use serde_json::json;
    let schedule = match s.lr_schedule {
        LrSchedule::Constant => json!({ "kind": "constant" }),
        LrSchedule::Cosine {
            warmup_iters,
            lr_decay_iters,
            min_lr,
        } => json!({
            "kind": "cosine",
            "warmup_iters": warmup_iters,
            "lr_decay_iters": lr_decay_iters,
            "min_lr": min_lr,
        }),
    };
    let group_of: BTreeMap<&String, &usize> = s.group_of.iter().collect();
    json!({
        "groups": s.groups.iter().map(|g| json!({
            "weight_decay": g.weight_decay,
            "lr_scale": g.lr_scale,
        })).collect::<Vec<_>>(),
        "group_of": group_of,
        "lr_schedule": schedule,
    })
}

fn get_f64(path: &Path, v: &serde_json::Value, key: &str) -> Result<f64, FsdpError> {
    v.get(key)
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| err(path, format!("layout metadata: missing or invalid `{key}`")))
}

/// The optimizer setup read back from JSON.
fn parse_setup(path: &Path, v: &serde_json::Value) -> Result<OptimizerSetup, FsdpError> {
    let mut groups = Vec::new();
    for g in get_array(path, v, "groups")? {
        groups.push(ParamGroupOptions {
            weight_decay: match g.get("weight_decay") {
                Some(serde_json::Value::Null) | None => None,
                Some(_) => Some(get_f64(path, g, "weight_decay")?),
            },
            lr_scale: get_f64(path, g, "lr_scale")?,
        });
    }
    let mut group_of = HashMap::new();
    if let Some(m) = v.get("group_of").and_then(serde_json::Value::as_object) {
        for (name, i) in m {
            let i = i
                .as_u64()
                .and_then(|i| usize::try_from(i).ok())
                .ok_or_else(|| err(path, format!("layout metadata: invalid group of `{name}`")))?;
            group_of.insert(name.clone(), i);
        }
    }
    let sched = v
        .get("lr_schedule")
        .ok_or_else(|| err(path, "layout metadata: missing `lr_schedule`"))?;
    let lr_schedule = match get_str(path, sched, "kind")? {
        "constant" => LrSchedule::Constant,
        "cosine" => LrSchedule::Cosine {
            warmup_iters: get_u64(path, sched, "warmup_iters")?,
            lr_decay_iters: get_u64(path, sched, "lr_decay_iters")?,
            min_lr: get_f64(path, sched, "min_lr")?,
        },
        other => {
            return Err(err(
                path,
                format!("layout metadata: unknown learning-rate schedule `{other}`"),
            ))
        }
    };
    Ok(OptimizerSetup {
        groups,
        group_of,
        lr_schedule,
    })
}

pub(super) fn layout_json(s: &RankShards) -> serde_json::Value {
    use serde_json::json;
    json!({
        "format_version": FORMAT_VERSION,
        "rank": s.rank,
        "world_size": s.world,
        "strategy": s.strategy,
        "optimizer": s.optimizer,
        "optimizer_step": s.optimizer_step,
        "optimizer_steps": s.optimizer_steps,
        "optimizer_setup": setup_json(&s.setup),
        "units": s.units.iter().map(|(l, tensors)| json!({
            "unit": l.unit,
            "factor": l.factor,
            "shard_index": l.shard_index,
            "padded_numel": l.padded_numel,
            "shard_numel": l.shard_numel,
            "tensors": tensors.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            "params": l.params.iter().map(|p| json!({
                "name": p.name, "shape": p.shape, "offset": p.offset,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

fn get_u64(path: &Path, v: &serde_json::Value, key: &str) -> Result<u64, FsdpError> {
    v.get(key)
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| err(path, format!("layout metadata: missing or invalid `{key}`")))
}

fn get_usize(path: &Path, v: &serde_json::Value, key: &str) -> Result<usize, FsdpError> {
    let x = get_u64(path, v, key)?;
    usize::try_from(x).map_err(|_| err(path, format!("layout metadata: `{key}` is too large")))
}

fn get_str<'a>(path: &Path, v: &'a serde_json::Value, key: &str) -> Result<&'a str, FsdpError> {
    v.get(key)
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| err(path, format!("layout metadata: missing or invalid `{key}`")))
}

fn get_array<'a>(
    path: &Path,
    v: &'a serde_json::Value,
    key: &str,
) -> Result<&'a Vec<serde_json::Value>, FsdpError> {
    v.get(key)
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| err(path, format!("layout metadata: missing or invalid `{key}`")))
}

pub(super) struct ParsedUnit {
    pub(super) layout: ShardLayout,
    pub(super) tensors: Vec<String>,
}

pub(super) struct ParsedFile {
    pub(super) path: PathBuf,
    pub(super) bytes: Vec<u8>,
    pub(super) world: usize,
    pub(super) strategy: String,
    pub(super) optimizer: String,
    pub(super) optimizer_step: u64,
    pub(super) optimizer_steps: u64,
    pub(super) setup: OptimizerSetup,
    pub(super) units: Vec<ParsedUnit>,
}

pub(super) fn parse_rank_file(
    path: &Path,
    rank: usize,
    world: usize,
) -> Result<ParsedFile, FsdpError> {
    let bytes = read_bytes(path)?;
    let (_, meta) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| err(path, format!("not a safetensors file ({e:?})")))?;
    let text = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get(LAYOUT_KEY))
        .ok_or_else(|| {
            err(
                path,
                format!("no `{LAYOUT_KEY}` metadata: not a sharded checkpoint"),
            )
        })?;
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| err(path, format!("layout metadata is not valid JSON: {e}")))?;
    let version = get_u64(path, &v, "format_version")?;
    if version != FORMAT_VERSION {
        return Err(err(
            path,
            format!("layout format version {version}, this build reads {FORMAT_VERSION}"),
        ));
    }
    let (r, w) = (
        get_usize(path, &v, "rank")?,
        get_usize(path, &v, "world_size")?,
    );
    if (r, w) != (rank, world) {
        return Err(err(
            path,
            format!("the file says rank {r} of {w}, its name says rank {rank} of {world}"),
        ));
    }
    let mut units = Vec::new();
    for u in get_array(path, &v, "units")? {
        let mut params = Vec::new();
        for p in get_array(path, u, "params")? {
            let shape = get_array(path, p, "shape")?
                .iter()
                .map(|d| {
                    d.as_u64()
                        .and_then(|d| usize::try_from(d).ok())
                        .ok_or_else(|| err(path, "layout metadata: invalid shape"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            params.push(ShardParam {
                name: get_str(path, p, "name")?.to_string(),
                shape,
                offset: get_usize(path, p, "offset")?,
            });
        }
        let tensors = get_array(path, u, "tensors")?
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| err(path, "layout metadata: invalid tensor kind"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let layout = ShardLayout {
            unit: get_usize(path, u, "unit")?,
            factor: get_usize(path, u, "factor")?,
            shard_index: get_usize(path, u, "shard_index")?,
            padded_numel: get_usize(path, u, "padded_numel")?,
            shard_numel: get_usize(path, u, "shard_numel")?,
            params,
        };
        if layout.factor == 0
            || layout.shard_index >= layout.factor
            || layout.factor.checked_mul(layout.shard_numel) != Some(layout.padded_numel)
        {
            return Err(err(
                path,
                format!("layout metadata of unit {} is inconsistent", layout.unit),
            ));
        }
        for p in &layout.params {
            let end = p
                .shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .and_then(|n| n.checked_add(p.offset));
            if end.is_none_or(|e| e > layout.padded_numel) {
                return Err(err(
                    path,
                    format!(
                        "parameter `{}` lies outside unit {}'s flat buffer",
                        p.name, layout.unit
                    ),
                ));
            }
        }
        units.push(ParsedUnit { layout, tensors });
    }
    Ok(ParsedFile {
        path: path.to_path_buf(),
        world,
        strategy: get_str(path, &v, "strategy")?.to_string(),
        optimizer: get_str(path, &v, "optimizer")?.to_string(),
        optimizer_step: get_u64(path, &v, "optimizer_step")?,
        optimizer_steps: get_u64(path, &v, "optimizer_steps")?,
        // Checkpoints from before optimizer groups: one group, constant learning rate.
        setup: match v.get("optimizer_setup") {
            Some(s) => parse_setup(path, s)?,
            None => OptimizerSetup::default(),
        },
        units,
        bytes,
    })
}
