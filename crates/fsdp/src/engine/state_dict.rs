//! Sharded checkpoints of the engine: every rank writes its own shards and the layout, and a
//! checkpoint written at one world size loads at another (see [`crate::checkpoint`]).

use std::collections::HashMap;
use std::path::Path;

use fsdp_collectives::ReduceOp;

use super::comm_context::internal;
use super::fsdp::Fsdp;
use super::mixed_precision::load_exact;
use crate::checkpoint::{
    write_rank_shards, FullOptimizerState, RankShards, ShardLayout, ShardParam,
};
use crate::optim::{AdamWState, AnyPrecisionAdamWState, OptimizerState, PrecisionVec};
use crate::{try_filled_vec, FsdpError};

/// A copy of `src`, allocated fallibly ([`FsdpError::HostOutOfMemory`] naming `what` when the
/// memory cannot be had): the shard-sized copies a checkpoint is written from.
fn try_copy(src: &[f32], what: &str) -> Result<Vec<f32>, FsdpError> {
    let mut v = try_filled_vec(src.len(), 0.0, what)?;
    v.copy_from_slice(src);
    Ok(v)
}

/// How a unit is named in messages.
fn unit_name(name: &str) -> &str {
    if name.is_empty() {
        "(root)"
    } else {
        name
    }
}

impl Fsdp {
    /// Writes a sharded checkpoint into `dir` (created if needed). **Collective**: every rank
    /// calls it; each writes `rank-RRRRR-of-WWWWW.safetensors` atomically, holding its shard of
    /// every unit's flat parameter (`unit.U.param`), its optimizer state shards
    /// (`unit.U.exp_avg` and `unit.U.exp_avg_sq` for AdamW, `unit.U.momentum_buffer` for SGD
    /// with momentum) and, as JSON under the metadata key
    /// [`LAYOUT_KEY`](crate::checkpoint::LAYOUT_KEY), the layout: world size, strategy,
    /// optimizer step, and per unit the sharding factor F, which shard the file holds, the
    /// padded and shard sizes and every parameter's name, shape and flat offset.
    ///
    /// With replicated shards (NO_SHARD, the hybrid strategies' replicas, ignored parameters),
    /// every rank still writes its copy, so each file is self-contained;
    /// [`load_sharded`](crate::checkpoint::load_sharded) uses the lowest rank's copy.
    ///
    /// With a grad scaler ([`Fsdp::set_grad_scaler`]), rank 0 also writes its state into
    /// [`GRAD_SCALER_FILE`](super::GRAD_SCALER_FILE) (read back by
    /// [`load_grad_scaler_state`](super::load_grad_scaler_state)); without, it removes a stale
    /// one.
    ///
    /// Call it between steps (gradients are not saved). The ranks agree on the outcome: if any
    /// rank fails to write, every rank returns an error (that rank's with the cause).
    pub fn save_sharded(&self, dir: &Path) -> Result<(), FsdpError> {
        let result = self
            .write_shards(dir)
            .and_then(|()| self.write_grad_scaler_state(dir));
        // Agree on success, so no rank goes on believing a partial checkpoint was written.
        let flag = fsdp_device::Buffer::from_slice(&[if result.is_ok() { 0f32 } else { 1.0 }])?;
        let world = self.ctx.groups.world();
        let flag = self.ctx.collective_to_host(world, &flag, 1, true, |_, f| {
            Ok(world.all_reduce(f, ReduceOp::Sum)?)
        })?;
        let failed = flag.to_vec::<f32>()?[0];
        result?;
        if failed > 0.0 {
            return Err(FsdpError::Checkpoint {
                path: dir.to_path_buf(),
                reason: format!("{failed} rank(s) could not write their shards"),
            });
        }
        Ok(())
    }

    fn write_shards(&self, dir: &Path) -> Result<(), FsdpError> {
        let mut optimizer = "none";
        let mut optimizer_step = 0;
        let mut units = Vec::with_capacity(self.groups.len());
        for (u, unit) in self.groups.iter().enumerate() {
            let l = &unit.layout;
            let layout = ShardLayout {
                unit: u,
                factor: unit.factor,
                shard_index: unit.shard_index,
                padded_numel: l.padded_numel(),
                shard_numel: l.shard_numel(),
                params: l
                    .params()
                    .iter()
                    .map(|p| ShardParam {
                        name: p.name().to_string(),
                        shape: p.shape().to_vec(),
                        offset: p.offset(),
                    })
                    .collect(),
            };
            // Shard-sized copies, allocated fallibly.
            let copy = |kind: &str, src: &[f32]| {
                let what = format!(
                    "the `{kind}` shard of unit {} written to a checkpoint",
                    unit_name(&unit.name)
                );
                try_copy(src, &what)
            };
            let mut param = try_filled_vec(unit.shard.len(), 0.0, "a parameter shard")?;
            load_exact(&self.ctx.host_copy(&unit.shard)?, &mut param)?;
            let mut tensors = vec![("param", param)];
            match self.host_optim_state(unit)?.as_ref() {
                OptimizerState::AdamW(s) => {
                    optimizer = "adamw";
                    optimizer_step = s.step;
                    tensors.push(("exp_avg", copy("exp_avg", &s.exp_avg)?));
                    tensors.push(("exp_avg_sq", copy("exp_avg_sq", &s.exp_avg_sq)?));
                }
                OptimizerState::Sgd {
                    step,
                    momentum_buffer,
                } => {
                    optimizer = "sgd";
                    optimizer_step = *step;
                    if !momentum_buffer.is_empty() {
                        tensors
                            .push(("momentum_buffer", copy("momentum_buffer", momentum_buffer)?));
                    }
                }
                OptimizerState::AnyPrecisionAdamW(s) => {
                    // The states are written as f32, exactly (every state dtype widens
                    // exactly); loading rounds nothing.
                    optimizer = "anyprecision_adamw";
                    optimizer_step = s.step;
                    tensors.push(("exp_avg", s.exp_avg.to_f32_vec()));
                    tensors.push(("exp_avg_sq", s.exp_avg_sq.to_f32_vec()));
                    if let Some(c) = &s.compensation {
                        tensors.push(("compensation", c.to_f32_vec()));
                    }
                }
                #[allow(unreachable_patterns)]
                _ => {
                    return Err(FsdpError::Checkpoint {
                        path: dir.to_path_buf(),
                        reason: "this optimizer's state cannot be checkpointed".into(),
                    })
                }
            }
            units.push((layout, tensors));
        }
        write_rank_shards(
            dir,
            &RankShards {
                rank: self.rank(),
                world: self.world_size(),
                strategy: format!("{:?}", self.ctx.config.strategy),
                optimizer,
                optimizer_step,
                optimizer_steps: self.optimizer_steps + self.unread_steps()?,
                units,
                setup: self.setup.clone(),
            },
        )
    }

    /// Loads optimizer state reassembled from a sharded checkpoint
    /// ([`load_sharded_checkpoint`](crate::checkpoint::load_sharded_checkpoint)), keeping this
    /// rank's shard of every buffer: with the parameters passed to [`Fsdp::new`], training
    /// resumes exactly where the checkpoint left it, at any world size. Local (no collective).
    ///
    /// # Errors
    /// [`FsdpError::Checkpoint`] when the state belongs to another optimizer or misses a
    /// parameter's buffer; this rank's state is then unchanged.
    pub fn load_optimizer_state(&mut self, state: &FullOptimizerState) -> Result<(), FsdpError> {
        // The steps a device scaler counted so far are folded in before they are replaced.
        self.absorb_scaler(0)?;
        let bad = |reason: String| FsdpError::Checkpoint {
            path: "<optimizer state>".into(),
            reason,
        };
        let mut new_states = Vec::with_capacity(self.groups.len());
        for unit in &self.groups {
            let l = &unit.layout;
            let rank = unit.shard_index;
            let shard_of = |kind: &str| -> Result<Vec<f32>, FsdpError> {
                let map = state
                    .buffers
                    .get(kind)
                    .ok_or_else(|| bad(format!("no `{kind}` buffers")))?;
                let values = l
                    .params()
                    .iter()
                    .map(|p| {
                        map.get(p.name())
                            .filter(|v| v.len() == p.numel())
                            .ok_or_else(|| {
                                bad(format!(
                                    "`{kind}` of `{}` is missing or mis-sized",
                                    p.name()
                                ))
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                // Only this rank's shard is built, allocated fallibly; never the unit's
                // unsharded buffer.
                let what = format!(
                    "the `{kind}` state loaded for unit {}",
                    unit_name(&unit.name)
                );
                let mut shard = try_filled_vec(l.shard_numel(), 0.0, &what)?;
                l.flatten_shard_into::<f32, _>(&values, rank, &mut shard)?;
                Ok(shard)
            };
            let new = match (&unit.optim_state, state.optimizer.as_str()) {
                (OptimizerState::AdamW(_), "adamw") => OptimizerState::AdamW(AdamWState {
                    step: state.step,
                    exp_avg: shard_of("exp_avg")?,
                    exp_avg_sq: shard_of("exp_avg_sq")?,
                }),
                (
                    OptimizerState::Sgd {
                        momentum_buffer, ..
                    },
                    "sgd",
                ) => OptimizerState::Sgd {
                    step: state.step,
                    momentum_buffer: if momentum_buffer.is_empty() && unit.device_moments.is_empty()
                    {
                        Vec::new()
                    } else {
                        shard_of("momentum_buffer")?
                    },
                },
                (OptimizerState::AnyPrecisionAdamW(cur), "anyprecision_adamw") => {
                    let typed = |kind: &str, dtype| -> Result<PrecisionVec, FsdpError> {
                        PrecisionVec::from_f32(dtype, &shard_of(kind)?)
                    };
                    OptimizerState::AnyPrecisionAdamW(AnyPrecisionAdamWState {
                        step: state.step,
                        exp_avg: typed("exp_avg", cur.exp_avg.dtype())?,
                        exp_avg_sq: typed("exp_avg_sq", cur.exp_avg_sq.dtype())?,
                        compensation: match &cur.compensation {
                            Some(c) => Some(typed("compensation", c.dtype())?),
                            None => None,
                        },
                    })
                }
                (_, other) => {
                    return Err(bad(format!(
                        "the checkpoint holds `{other}` state, not this runtime's optimizer's"
                    )))
                }
            };
            new_states.push(new);
        }
        self.apply_setup(state.setup.clone())?;
        for (unit, s) in self.groups.iter_mut().zip(new_states) {
            unit.optim_state = s;
        }
        self.place_loaded_moments()?;
        self.optimizer_steps = state.optimizer_steps;
        // A device scaler's count starts again from the loaded one.
        self.place_scaler()
    }
}

impl Fsdp {
    /// The full parameters by name, gathered from the shards (a collective: every rank must
    /// call it). PyTorch's `FULL_STATE_DICT` of the parameters.
    ///
    /// # Errors
    /// A failing collective.
    pub fn full_state_dict(&self) -> Result<HashMap<String, Vec<f32>>, FsdpError> {
        let mut out = HashMap::new();
        for g in &self.groups {
            let full = if g.factor == 1 {
                self.ctx.host_copy(&g.shard)?
            } else {
                let group = self
                    .ctx
                    .groups
                    .shard()
                    .ok_or_else(|| internal("a sharded unit without a shard group"))?;
                let n = g.layout.padded_numel();
                self.ctx
                    .collective_to_host(group, &g.shard, n, false, |s, full| {
                        Ok(group.all_gather_base(s, full)?)
                    })?
            };
            let mut flat = crate::try_filled_vec(full.len(), 0.0f32, "the full state dict")?;
            load_exact(&full, &mut flat)?;
            for p in g.layout.params() {
                out.insert(p.name().to_string(), flat[p.range()].to_vec());
            }
        }
        Ok(out)
    }
}
