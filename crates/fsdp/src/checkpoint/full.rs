//! A checkpoint written from whole tensors by a trainer without the engine (the device
//! trainer of `fsdp-gpt`): the sharded format of one rank (world 1) whose one unit, of factor
//! 1, holds every parameter back to back. [`load_sharded_checkpoint`](super::load_sharded_checkpoint)
//! reads it as any other, so the engine resumes from it at any world size, and such a trainer
//! resumes from the engine's checkpoints through the same loader.

use std::collections::HashMap;
use std::path::Path;

use super::sharded::{write_rank_shards, RankShards, ShardLayout, ShardParam};
use crate::engine::OptimizerSetup;
use crate::FsdpError;

/// One parameter of a [`FullState`]: its name, shape and values.
#[derive(Debug, Clone, Copy)]
pub struct FullParam<'a> {
    /// The parameter's name.
    pub name: &'a str,
    /// Its shape.
    pub shape: &'a [usize],
    /// Its values (as many as the shape's product).
    pub values: &'a [f32],
}

/// The optimizer state of a [`FullState`], by parameter name: AdamW's, or `AnyPrecisionAdamW`'s
/// (its states widened to f32, exactly, as the engine writes them).
#[derive(Debug, Clone, Copy)]
pub struct FullAdamW<'a> {
    /// AdamW's step count (its bias correction's).
    pub step: u64,
    /// Optimizer steps taken (the schedule's position).
    pub optimizer_steps: u64,
    /// First moments.
    pub exp_avg: &'a HashMap<String, Vec<f32>>,
    /// Second moments.
    pub exp_avg_sq: &'a HashMap<String, Vec<f32>>,
    /// `AnyPrecisionAdamW`'s state (`None`: AdamW's).
    pub any_precision: Option<FullAnyPrecision<'a>>,
}

/// What `AnyPrecisionAdamW` adds to a [`FullAdamW`]: its Kahan compensation, if it uses one.
#[derive(Debug, Clone, Copy)]
pub struct FullAnyPrecision<'a> {
    /// The compensation buffers (`None`: without Kahan summation).
    pub compensation: Option<&'a HashMap<String, Vec<f32>>>,
}

/// A whole model's training state, as [`write_full_checkpoint`] writes it.
#[derive(Debug, Clone)]
pub struct FullState<'a> {
    /// Every parameter, in the order of the unit's flat buffer.
    pub params: Vec<FullParam<'a>>,
    /// AdamW's state (`None`: no optimizer state).
    pub adamw: Option<FullAdamW<'a>>,
    /// The optimizer groups and the learning-rate schedule.
    pub setup: OptimizerSetup,
}

/// Writes `state` into `dir` (created if needed) as the one rank file of a world-1 sharded
/// checkpoint, atomically: one unit of factor 1 holding every parameter back to back, which
/// [`load_sharded_checkpoint`](super::load_sharded_checkpoint) reads as any other.
///
/// # Errors
/// [`FsdpError::Checkpoint`] for a parameter whose values do not fill its shape, a moment
/// missing or mis-sized, a size that overflows, or a failed write.
pub fn write_full_checkpoint(dir: &Path, state: &FullState<'_>) -> Result<(), FsdpError> {
    let bad = |reason: String| FsdpError::Checkpoint {
        path: dir.to_path_buf(),
        reason,
    };
    let mut params = Vec::with_capacity(state.params.len());
    let mut offset = 0usize;
    for p in &state.params {
        let numel = p
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad(format!("the shape of `{}` overflows", p.name)))?;
        if numel != p.values.len() {
            return Err(bad(format!(
                "`{}` has {} values for its shape {:?}",
                p.name,
                p.values.len(),
                p.shape
            )));
        }
        params.push(ShardParam {
            name: p.name.to_string(),
            shape: p.shape.to_vec(),
            offset,
        });
        offset = offset
            .checked_add(numel)
            .ok_or_else(|| bad("the parameters' total size overflows".into()))?;
    }
    let params_flat = concat(dir, "param", &state.params, offset, |p| Some(p.values))?;
    let mut tensors = vec![("param", params_flat)];
    let (optimizer, step, steps) = match &state.adamw {
        Some(a) => {
            let compensation = a.any_precision.and_then(|x| x.compensation);
            let buffers = [("exp_avg", a.exp_avg), ("exp_avg_sq", a.exp_avg_sq)]
                .into_iter()
                .chain(compensation.map(|c| ("compensation", c)));
            for (kind, map) in buffers {
                let v = concat(dir, kind, &state.params, offset, |p| {
                    map.get(p.name).map(Vec::as_slice)
                })?;
                tensors.push((kind, v));
            }
            let name = match a.any_precision {
                Some(_) => "anyprecision_adamw",
                None => "adamw",
            };
            (name, a.step, a.optimizer_steps)
        }
        None => ("none", 0, 0),
    };
    let shards = RankShards {
        rank: 0,
        world: 1,
        strategy: "NoShard".into(),
        optimizer,
        optimizer_step: step,
        optimizer_steps: steps,
        units: vec![(
            ShardLayout {
                unit: 0,
                factor: 1,
                shard_index: 0,
                padded_numel: offset,
                shard_numel: offset,
                params,
            },
            tensors,
        )],
        setup: state.setup.clone(),
    };
    write_rank_shards(dir, &shards)
}

/// `pick(p)` of every parameter back to back (`total` elements), each as long as the
/// parameter.
fn concat<'a>(
    dir: &Path,
    kind: &str,
    params: &[FullParam<'a>],
    total: usize,
    pick: impl Fn(&FullParam<'a>) -> Option<&'a [f32]>,
) -> Result<Vec<f32>, FsdpError> {
    let bad = |reason: String| FsdpError::Checkpoint {
        path: dir.to_path_buf(),
        reason,
    };
    let mut v = Vec::new();
    v.try_reserve_exact(total).map_err(|_| {
        bad(format!(
            "no memory for the `{kind}` buffer ({total} elements)"
        ))
    })?;
    for p in params {
        match pick(p) {
            Some(x) if x.len() == p.values.len() => v.extend_from_slice(x),
            _ => {
                return Err(bad(format!(
                    "`{kind}` of `{}` is missing or mis-sized",
                    p.name
                )))
            }
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::load_sharded_checkpoint;
    use crate::optim::{decay_2d_only, LrSchedule};
    use crate::units::ParamSpec;

    /// Written whole, read back by the sharded loader: every parameter, both moments, the
    /// step counts and the setup.
    #[test]
    fn a_full_checkpoint_loads_as_a_sharded_one() {
        let dir = std::env::temp_dir().join(format!("fsdp-full-ckpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let shapes: [(&str, Vec<usize>); 3] = [("w", vec![3, 4]), ("b", vec![4]), ("s", vec![])];
        let values: Vec<Vec<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(i, (_, s))| {
                (0..s.iter().product())
                    .map(|j| (i * 100 + j) as f32)
                    .collect()
            })
            .collect();
        let moment = |k: f32| -> HashMap<String, Vec<f32>> {
            shapes
                .iter()
                .zip(&values)
                .map(|((n, _), v)| (n.to_string(), v.iter().map(|x| x * k).collect()))
                .collect()
        };
        let (m, v) = (moment(0.5), moment(0.25));
        let setup = OptimizerSetup {
            groups: decay_2d_only(0.1),
            group_of: HashMap::from([("b".to_string(), 1), ("s".to_string(), 1)]),
            lr_schedule: LrSchedule::Cosine {
                warmup_iters: 2,
                lr_decay_iters: 9,
                min_lr: 1e-4,
            },
        };
        let state = FullState {
            params: shapes
                .iter()
                .zip(&values)
                .map(|((name, shape), v)| FullParam {
                    name,
                    shape,
                    values: v,
                })
                .collect(),
            adamw: Some(FullAdamW {
                step: 7,
                optimizer_steps: 7,
                exp_avg: &m,
                exp_avg_sq: &v,
                any_precision: None,
            }),
            setup: setup.clone(),
        };
        write_full_checkpoint(&dir, &state).unwrap();
        let specs: Vec<ParamSpec> = shapes
            .iter()
            .map(|(n, s)| ParamSpec::new(*n, s.clone()))
            .collect();
        let ck = load_sharded_checkpoint(&dir, &specs).unwrap();
        assert_eq!(ck.world_size, 1);
        for ((name, _), want) in shapes.iter().zip(&values) {
            assert_eq!(&ck.params[*name], want);
        }
        let o = ck.optimizer.unwrap();
        assert_eq!(
            (o.optimizer.as_str(), o.step, o.optimizer_steps),
            ("adamw", 7, 7)
        );
        assert_eq!(o.buffers["exp_avg"], m);
        assert_eq!(o.buffers["exp_avg_sq"], v);
        assert_eq!(o.setup, setup);
        // A moment missing is an error naming it; nothing is written.
        let mut short = m.clone();
        short.remove("b");
        let bad = FullState {
            adamw: Some(FullAdamW {
                exp_avg: &short,
                ..state.adamw.unwrap()
            }),
            ..state.clone()
        };
        let other = dir.join("other");
        let e = write_full_checkpoint(&other, &bad).unwrap_err();
        assert!(e.to_string().contains("`exp_avg` of `b`"), "{e}");
        assert!(!other
            .join(crate::checkpoint::shard_file_name(0, 1))
            .exists());
        // AnyPrecisionAdamW's state: its name and the compensation read back.
        let c = moment(0.125);
        let any = FullState {
            adamw: Some(FullAdamW {
                any_precision: Some(FullAnyPrecision {
                    compensation: Some(&c),
                }),
                ..state.adamw.unwrap()
            }),
            ..state.clone()
        };
        let dir2 = dir.join("any");
        write_full_checkpoint(&dir2, &any).unwrap();
        let o = load_sharded_checkpoint(&dir2, &specs)
            .unwrap()
            .optimizer
            .unwrap();
        assert_eq!(o.optimizer, "anyprecision_adamw");
        assert_eq!(o.buffers["compensation"], c);
        assert_eq!(o.buffers["exp_avg_sq"], v);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
