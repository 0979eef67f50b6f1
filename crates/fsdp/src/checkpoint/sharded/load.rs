//! Reading a sharded checkpoint back: every rank file found, checked against the others, and
//! each unit's shards reassembled into the full parameters and optimizer state.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use super::metadata::parse_rank_file;
use super::shard_file_name;
use crate::checkpoint::{err, parse, tensor_f32};
use crate::engine::OptimizerSetup;
use crate::units::ParamSpec;
use crate::FsdpError;

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
