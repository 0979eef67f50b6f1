//! Sharded checkpoints: one safetensors file per rank with its shards and the layout as JSON,
//! reassembled into full tensors at any world size (see the [module docs](super)).

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;

use super::{err, f32_bytes, parse, read_bytes, serialize_f32, tensor_f32, write_atomic};
use crate::engine::OptimizerSetup;
use crate::optim::{LrSchedule, ParamGroupOptions};
use crate::units::ParamSpec;
use crate::FsdpError;

/// The metadata key under which each rank file of a sharded checkpoint stores its layout (JSON).
pub const LAYOUT_KEY: &str = "fsdp_layout";

/// Version of the sharded layout format.
const FORMAT_VERSION: u64 = 1;

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

fn layout_json(s: &RankShards) -> serde_json::Value {
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

/// The optimizer state of a sharded checkpoint, reassembled per parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct FullOptimizerState {
    /// `adamw` or `sgd`.
    pub optimizer: String,
    /// The optimizer's step count (bias correction of AdamW).
    pub step: u64,
    /// The runtime's count of optimizer steps.
    pub optimizer_steps: u64,
    /// The optimizer groups and the learning-rate schedule (its position is
    /// `optimizer_steps`).
    pub setup: OptimizerSetup,
    /// Buffer kind (`exp_avg`, `exp_avg_sq`, `momentum_buffer`) → parameter name → values.
    pub buffers: HashMap<String, HashMap<String, Vec<f32>>>,
}

/// A sharded checkpoint reassembled into full tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardedCheckpoint {
    /// The world size it was written at.
    pub world_size: usize,
    /// The strategy it was written with (`Debug` name).
    pub strategy: String,
    /// Every parameter of the model, full.
    pub params: HashMap<String, Vec<f32>>,
    /// The optimizer state, when one was saved (`None` for an optimizer with no state).
    pub optimizer: Option<FullOptimizerState>,
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

struct ParsedUnit {
    layout: ShardLayout,
    tensors: Vec<String>,
}

struct ParsedFile {
    path: PathBuf,
    bytes: Vec<u8>,
    world: usize,
    strategy: String,
    optimizer: String,
    optimizer_step: u64,
    optimizer_steps: u64,
    setup: OptimizerSetup,
    units: Vec<ParsedUnit>,
}

fn parse_rank_file(path: &Path, rank: usize, world: usize) -> Result<ParsedFile, FsdpError> {
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

/// Reads a sharded checkpoint written by
/// [`Fsdp::save_sharded`](crate::engine::Fsdp::save_sharded) at any world size and
/// reassembles every parameter of `specs`: [`Fsdp::new`](crate::engine::Fsdp::new) then
/// reshards them for the new world.
///
/// Equivalent to `load_sharded_checkpoint(dir, specs)?.params`.
pub fn load_sharded(
    dir: &Path,
    specs: &[ParamSpec],
) -> Result<HashMap<String, Vec<f32>>, FsdpError> {
    Ok(load_sharded_checkpoint(dir, specs)?.params)
}

/// Reads a sharded checkpoint and reassembles the parameters and the optimizer state.
///
/// The directory must hold exactly the `rank-RRRRR-of-WWWWW.safetensors` files of one world size
/// W, ranks 0 to W − 1 (other files are ignored). Every unit's layout must agree between the
/// files, each of its F shards must be present in some file (with replicated shards — NO_SHARD or
/// hybrid strategies — the lowest rank's copy is used), and the reassembled parameters must be
/// exactly the model's: errors name the missing, mis-shaped or unexpected tensor and the file or
/// directory.
pub fn load_sharded_checkpoint(
    dir: &Path,
    specs: &[ParamSpec],
) -> Result<ShardedCheckpoint, FsdpError> {
    let entries = fs::read_dir(dir).map_err(|e| err(dir, format!("cannot read directory: {e}")))?;
    let mut found: BTreeMap<usize, (usize, PathBuf)> = BTreeMap::new();
    let mut worlds = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| err(dir, format!("cannot read directory: {e}")))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name
            .strip_prefix("rank-")
            .and_then(|r| r.strip_suffix(".safetensors"))
        else {
            continue;
        };
        let Some((r, w)) = rest.split_once("-of-") else {
            continue;
        };
        let (Ok(r), Ok(w)) = (r.parse::<usize>(), w.parse::<usize>()) else {
            continue;
        };
        if !worlds.contains(&w) {
            worlds.push(w);
        }
        found.insert(r, (w, entry.path()));
    }
    worlds.sort_unstable();
    let world = match worlds.as_slice() {
        [] => {
            return Err(err(
                dir,
                "no `rank-*-of-*.safetensors` file: not a sharded checkpoint",
            ))
        }
        [w] => *w,
        ws => {
            return Err(err(
                dir,
                format!(
                    "files of several world sizes {ws:?}: save each checkpoint into its own \
                     directory"
                ),
            ))
        }
    };
    let mut files = Vec::with_capacity(world);
    for rank in 0..world {
        let (_, path) = found.get(&rank).ok_or_else(|| {
            err(
                dir,
                format!("missing file `{}`", shard_file_name(rank, world)),
            )
        })?;
        files.push(parse_rank_file(path, rank, world)?);
    }
    if let Some(r) = found.keys().find(|r| **r >= world) {
        return Err(err(
            dir,
            format!("unexpected file of rank {r} in a world of {world}"),
        ));
    }

    // Every file must describe the same units.
    let first = &files[0];
    for f in &files[1..] {
        let same = f.units.len() == first.units.len()
            && f.units.iter().zip(&first.units).all(|(a, b)| {
                a.layout.unit == b.layout.unit
                    && a.layout.factor == b.layout.factor
                    && a.layout.padded_numel == b.layout.padded_numel
                    && a.layout.params == b.layout.params
                    && a.tensors == b.tensors
            })
            && (f.optimizer.as_str(), f.optimizer_step)
                == (first.optimizer.as_str(), first.optimizer_step);
        if !same {
            return Err(err(
                &f.path,
                format!("its layout differs from `{}`'s", first.path.display()),
            ));
        }
    }
    let parsed = files
        .iter()
        .map(|f| parse(&f.path, &f.bytes))
        .collect::<Result<Vec<_>, _>>()?;

    let mut params: HashMap<String, Vec<f32>> = HashMap::new();
    let mut buffers: HashMap<String, HashMap<String, Vec<f32>>> = HashMap::new();
    for (ui, unit) in first.units.iter().enumerate() {
        let l = &unit.layout;
        for kind in &unit.tensors {
            // Sized by the file: reserved fallibly, so that a corrupt or crafted layout is an
            // error rather than an abort (the shards' shapes are checked below).
            let mut flat: Vec<f32> = Vec::new();
            flat.try_reserve_exact(l.padded_numel).map_err(|_| {
                err(
                    &first.path,
                    format!(
                        "unit {} says {} elements ({} bytes), which cannot be allocated",
                        l.unit,
                        l.padded_numel,
                        (l.padded_numel as u128) * 4
                    ),
                )
            })?;
            for s in 0..l.factor {
                let (fi, file) = files
                    .iter()
                    .enumerate()
                    .find(|(_, f)| f.units[ui].layout.shard_index == s)
                    .ok_or_else(|| {
                        err(
                            dir,
                            format!("shard {s} of {} of unit {} is in no file", l.factor, l.unit),
                        )
                    })?;
                let key = format!("unit.{}.{kind}", l.unit);
                let view = parsed[fi]
                    .tensor(&key)
                    .map_err(|_| err(&file.path, format!("missing tensor `{key}`")))?;
                if view.shape() != [l.shard_numel] {
                    return Err(err(
                        &file.path,
                        format!(
                            "tensor `{key}` has shape {:?}, expected [{}]",
                            view.shape(),
                            l.shard_numel
                        ),
                    ));
                }
                flat.extend(tensor_f32(&file.path, &key, &view)?);
            }
            let target = if kind == "param" {
                &mut params
            } else {
                buffers.entry(kind.clone()).or_default()
            };
            for p in &l.params {
                let n: usize = p.shape.iter().product();
                if target
                    .insert(p.name.clone(), flat[p.offset..p.offset + n].to_vec())
                    .is_some()
                {
                    return Err(err(dir, format!("tensor `{}` is in two units", p.name)));
                }
            }
        }
    }
    // Exactly the model's parameters, with their shapes.
    let shapes: HashMap<&str, &Vec<usize>> = first
        .units
        .iter()
        .flat_map(|u| u.layout.params.iter().map(|p| (p.name.as_str(), &p.shape)))
        .collect();
    for s in specs {
        match shapes.get(s.name.as_str()) {
            None => return Err(err(dir, format!("missing tensor `{}`", s.name))),
            Some(shape) if **shape != s.shape => {
                return Err(err(
                    dir,
                    format!(
                        "tensor `{}` has shape {shape:?}, expected {:?}",
                        s.name, s.shape
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    let mut names: Vec<&&str> = shapes.keys().collect();
    names.sort();
    if let Some(extra) = names
        .into_iter()
        .find(|n| !specs.iter().any(|s| s.name == ***n))
    {
        return Err(err(
            dir,
            format!("unexpected tensor `{extra}`: not a parameter of the model"),
        ));
    }
    let optimizer = (!buffers.is_empty()).then(|| FullOptimizerState {
        optimizer: first.optimizer.clone(),
        step: first.optimizer_step,
        optimizer_steps: first.optimizer_steps,
        setup: first.setup.clone(),
        buffers,
    });
    Ok(ShardedCheckpoint {
        world_size: first.world,
        strategy: first.strategy.clone(),
        params,
        optimizer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-rank checkpoint in a fresh directory whose only unit has `layout` and a `param`
    /// tensor of `values`.
    fn crafted(test: &str, layout: ShardLayout, values: Vec<f32>) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fsdp-sharded-{test}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let shards = RankShards {
            rank: 0,
            world: 1,
            strategy: "FULL_SHARD".into(),
            optimizer: "none",
            optimizer_step: 0,
            optimizer_steps: 0,
            units: vec![(layout, vec![("param", values)])],
            setup: OptimizerSetup::default(),
        };
        write_rank_shards(&dir, &shards).unwrap();
        dir
    }

    fn w_spec() -> Vec<ParamSpec> {
        vec![ParamSpec::new("w", vec![4])]
    }

    #[test]
    fn a_huge_layout_is_an_error_naming_the_file_not_an_abort() {
        // 2^61 elements: 2^63 bytes, more than any allocation may hold.
        let huge = 1usize << 61;
        let layout = ShardLayout {
            unit: 0,
            factor: 1,
            shard_index: 0,
            padded_numel: huge,
            shard_numel: huge,
            params: vec![ShardParam {
                name: "w".into(),
                shape: vec![4],
                offset: 0,
            }],
        };
        let dir = crafted("huge", layout, vec![1.0; 4]);
        let e = load_sharded_checkpoint(&dir, &w_spec()).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("rank-00000-of-00001.safetensors"), "{msg}");
        assert!(msg.contains("cannot be allocated"), "{msg}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_parameter_shape_that_overflows_is_an_error() {
        let layout = ShardLayout {
            unit: 0,
            factor: 1,
            shard_index: 0,
            padded_numel: 4,
            shard_numel: 4,
            params: vec![ShardParam {
                name: "w".into(),
                shape: vec![1 << 40, 1 << 40],
                offset: 0,
            }],
        };
        let dir = crafted("overflow", layout, vec![1.0; 4]);
        let e = load_sharded_checkpoint(&dir, &w_spec()).unwrap_err();
        assert!(e.to_string().contains("lies outside"), "{e}");
        let _ = fs::remove_dir_all(&dir);
    }
}
