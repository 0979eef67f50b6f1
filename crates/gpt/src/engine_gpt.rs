//! [`EngineGpt`]: the GPT's pass over device operations ([`GptPass`], the kernels or their
//! twins) sharded by the [`fsdp`] engine. The engine's hooks run around each of the GPT's units
//! ([`Units`]: the root and each block), as PyTorch FSDP's hooks run around each wrapped
//! module; the pass reads each unit's unsharded parameters and adds its gradients through
//! [`EngineViews`] (copies for the host twins, the buffers themselves on CUDA).
//!
//! ```
//! use fsdp::engine::{Fsdp, FsdpConfig, ParamInit, ShardingStrategy};
//! use fsdp::optim::AdamWConfig;
//! use fsdp_collectives::{ring, Communicator};
//! use fsdp_gpt::engine_gpt::EngineGpt;
//! use fsdp_gpt::model::{init_params, named_params, GptConfig};
//! use fsdp_gpt::tree::gpt_block_plan;
//! use fsdp_kernels::gpt::{GptPass, HostOps};
//!
//! let cfg = GptConfig::new(2, 2, 16, 8, 32).unwrap();
//! let params = named_params(&cfg, init_params(&cfg, 0)).unwrap();
//! let opt = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
//! let losses = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
//!     let config = FsdpConfig::new(ShardingStrategy::FullShard);
//!     let plan = gpt_block_plan(&cfg);
//!     let fsdp = Fsdp::new(Box::new(comm), &plan, ParamInit::Full(&params), config, opt).unwrap();
//!     let mut gpt = EngineGpt::new(fsdp, GptPass::new(HostOps::new(), cfg.dims()).unwrap()).unwrap();
//!     // This rank's 2 sequences of 8 tokens out of a global batch of 4.
//!     let ids: Vec<u32> = (0..16).map(|i| (i * 7 % 32) as u32).collect();
//!     gpt.step(&ids, &ids, 2, 8, 4 * 8).unwrap()
//! })
//! .unwrap();
//! assert_eq!(losses[0], losses[1]); // the global batch's mean loss, on every rank
//! ```

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};

use fsdp::{Fsdp, FsdpError};
use fsdp_device::Stream;
use fsdp_kernels::gpt::{param_shapes, Block, GptDims, GptOps, GptPass, Unit, Units, Weights};
use fsdp_kernels::host::{step_scalars_len, STEP_LOSS, STEP_SCALE};
use fsdp_kernels::KernelError;

use crate::data::Batch;
use crate::device_config::DeviceTrainError;
use crate::engine_views::EngineViews;
use crate::runtime::FsdpGpt;

/// What a training loop needs of a GPT on the engine, whichever computes it: the reference GPT
/// on the host ([`FsdpGpt`]) or the kernels' pass ([`EngineGpt`]). Everything else is the
/// engine's ([`Fsdp`], through `Deref`).
pub trait GptOnEngine: DerefMut<Target = Fsdp> {
    /// Forward and backward of this rank's part `batch` of a (micro-)batch of
    /// `global_tokens` tokens (the loss normaliser); returns this pass's share of the global
    /// loss, summed over ranks. Every rank must call it.
    ///
    /// # Errors
    /// An invalid batch, a failing collective, allocation or operation.
    fn forward_backward_batch(
        &mut self,
        batch: &Batch,
        global_tokens: usize,
    ) -> Result<f32, DeviceTrainError>;
}

impl GptOnEngine for FsdpGpt {
    fn forward_backward_batch(
        &mut self,
        batch: &Batch,
        global_tokens: usize,
    ) -> Result<f32, DeviceTrainError> {
        Ok(self.forward_backward(batch, global_tokens)?)
    }
}

impl<O: EngineViews> GptOnEngine for EngineGpt<O> {
    fn forward_backward_batch(
        &mut self,
        batch: &Batch,
        global_tokens: usize,
    ) -> Result<f32, DeviceTrainError> {
        let (rows, t) = (batch.shape.rows, batch.shape.seq_len);
        self.forward_backward(&batch.inputs, &batch.targets, rows, t, global_tokens)
    }
}

impl<O: EngineViews> Deref for EngineGpt<O> {
    type Target = Fsdp;
    fn deref(&self) -> &Fsdp {
        &self.fsdp
    }
}

impl<O: EngineViews> DerefMut for EngineGpt<O> {
    fn deref_mut(&mut self) -> &mut Fsdp {
        &mut self.fsdp
    }
}

/// The GPT's pass over device operations `O`, its parameters sharded by an [`Fsdp`] engine
/// whose plan wraps the root (`wte`, `wpe`, `ln_f`) and each block as units of their own (as
/// [`gpt_block_plan`](crate::tree::gpt_block_plan) does). See the [module](self) documentation.
/// Dereferences to the engine for everything else (`optimizer_step`, `clip_grad_norm`,
/// `save_sharded`, ...).
pub struct EngineGpt<O: EngineViews> {
    fsdp: Fsdp,
    pass: GptPass<O>,
    units: UnitMap,
}

/// The engine's unit of the GPT's root and of each block.
#[derive(Clone, Debug)]
struct UnitMap {
    root: usize,
    blocks: Vec<usize>,
}

impl UnitMap {
    fn of(&self, unit: Unit) -> usize {
        match unit {
            Unit::Root => self.root,
            Unit::Block(l) => self.blocks[l],
        }
    }
}

fn invalid_plan(reason: String) -> DeviceTrainError {
    DeviceTrainError::Fsdp(FsdpError::InvalidPlan { reason })
}

/// The engine's unit holding every parameter of `names` (all in one unit, else an error).
fn unit_of_all(fsdp: &Fsdp, what: &str, names: &[String]) -> Result<usize, DeviceTrainError> {
    let mut unit = None;
    for n in names {
        let u = fsdp.unit_of(n)?;
        match unit {
            None => unit = Some(u),
            Some(v) if v != u => {
                return Err(invalid_plan(format!(
                    "{what}'s parameters are in units {v} and {u}: the GPT's pass needs each of \
                     its units (the root, each block) in one unit of the engine"
                )))
            }
            Some(_) => {}
        }
    }
    unit.ok_or_else(|| invalid_plan(format!("{what} has no parameters")))
}

impl<O: EngineViews> EngineGpt<O> {
    /// The GPT `pass` on the engine `fsdp`, whose parameters must be the GPT's (names and
    /// shapes of [`param_shapes`]) in units that each hold the root or one block.
    ///
    /// # Errors
    /// [`FsdpError::InvalidPlan`] (in [`DeviceTrainError::Fsdp`]) naming a parameter missing
    /// or of another shape, or units that split or merge the GPT's units.
    pub fn new(fsdp: Fsdp, pass: GptPass<O>) -> Result<Self, DeviceTrainError> {
        let d = pass.dims();
        let want = param_shapes(&d);
        let have: HashMap<&str, &[usize]> = fsdp.named_shapes().collect();
        for (name, shape) in &want {
            match have.get(name.as_str()) {
                Some(s) if *s == shape.as_slice() => {}
                Some(s) => {
                    return Err(invalid_plan(format!(
                        "`{name}` has shape {s:?} in the engine, {shape:?} in the GPT"
                    )))
                }
                None => return Err(invalid_plan(format!("`{name}` is not in the engine"))),
            }
        }
        if have.len() != want.len() {
            return Err(invalid_plan(format!(
                "the engine holds {} parameters, the GPT has {}",
                have.len(),
                want.len()
            )));
        }
        let root_names = [
            "transformer.wte.weight",
            "transformer.wpe.weight",
            "transformer.ln_f.weight",
            "transformer.ln_f.bias",
        ]
        .map(String::from);
        let root = unit_of_all(&fsdp, "the root", &root_names)?;
        let mut blocks = Vec::with_capacity(d.n_layer);
        for l in 0..d.n_layer {
            let names: Vec<String> = want
                .iter()
                .filter(|(n, _)| n.starts_with(&format!("transformer.h.{l}.")))
                .map(|(n, _)| n.clone())
                .collect();
            blocks.push(unit_of_all(&fsdp, &format!("block {l}"), &names)?);
        }
        let mut seen = vec![root];
        for (l, &u) in blocks.iter().enumerate() {
            if seen.contains(&u) {
                return Err(invalid_plan(format!(
                    "block {l} shares unit {u} with another of the GPT's units: the GPT's pass \
                     needs the root and each block in units of their own (gpt_block_plan)"
                )));
            }
            seen.push(u);
        }
        Ok(EngineGpt {
            fsdp,
            pass,
            units: UnitMap { root, blocks },
        })
    }

    /// The engine.
    pub fn engine(&self) -> &Fsdp {
        &self.fsdp
    }

    /// The engine, to step, clip, checkpoint or configure it.
    pub fn engine_mut(&mut self) -> &mut Fsdp {
        &mut self.fsdp
    }

    /// The GPT's pass (its operations, activation checkpointing, attention and logits).
    pub fn pass(&self) -> &GptPass<O> {
        &self.pass
    }

    /// The GPT's pass, to configure it.
    pub fn pass_mut(&mut self) -> &mut GptPass<O> {
        &mut self.pass
    }

    /// Forward and backward of this rank's `rows` sequences of `t` tokens (`inputs` and
    /// `targets` row after row), part of a (micro-)batch of `global_tokens` tokens over all
    /// ranks and micro-batches: the gradients of the mean loss over those tokens are reduced
    /// and **added** into the gradient shards (kept unsharded inside
    /// [`Fsdp::no_sync`]). Returns this pass's share of the global loss, summed over ranks
    /// (the host reads this rank's losses: one wait). Every rank must call it.
    ///
    /// # Errors
    /// An invalid batch or `global_tokens` of 0; a failing collective, copy or operation.
    /// After an error the engine's pass is aborted ([`Fsdp::abort_pass`]).
    pub fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        global_tokens: usize,
    ) -> Result<f32, DeviceTrainError> {
        let r = self.forward_backward_inner(inputs, targets, rows, t, global_tokens);
        if r.is_err() {
            self.fsdp.abort_pass();
        }
        r
    }

    fn forward_backward_inner(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        global_tokens: usize,
    ) -> Result<f32, DeviceTrainError> {
        let losses = self.pass_losses(inputs, targets, rows, t, global_tokens)?;
        let ops = self.pass.ops();
        let sum: f64 = ops.download(&losses)?.iter().map(|&l| f64::from(l)).sum();
        Ok(self
            .fsdp
            .all_reduce_loss((sum / global_tokens as f64) as f32)?)
    }

    /// [`forward_backward`](Self::forward_backward) without the host waiting for the loss:
    /// this rank's share of the global loss is computed on the device and copied to host
    /// memory while the host goes on; read it with [`wait_loss`](Self::wait_loss) (one step
    /// late, as `fsdp train --device` reads its outcomes). It is this rank's share only: sum
    /// the ranks' shares ([`Fsdp::all_reduce_loss`]) for the global loss.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward).
    pub fn forward_backward_pending(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        global_tokens: usize,
    ) -> Result<PendingLoss<O>, DeviceTrainError> {
        let r = self
            .pass_losses(inputs, targets, rows, t, global_tokens)
            .and_then(|losses| {
                let ops = self.pass.ops();
                let mut scalars = ops.scalars(&[0.0; step_scalars_len(0)])?;
                ops.loss_accumulate(&losses, 1, true, &mut scalars)?;
                Ok(PendingLoss {
                    copy: ops.copy_scalars(&scalars)?,
                    share: (rows * t) as f64 / global_tokens as f64,
                })
            });
        if r.is_err() {
            self.fsdp.abort_pass();
        }
        r
    }

    /// This rank's share of the loss of a
    /// [`forward_backward_pending`](Self::forward_backward_pending), once it has arrived (the host waits for the pass's
    /// work on the device, not for work issued after it).
    ///
    /// # Errors
    /// A failed copy or an earlier failure on the device; a wait past its timeout.
    pub fn wait_loss(&self, pending: PendingLoss<O>) -> Result<f32, DeviceTrainError> {
        let v = self.pass.ops().wait_scalars(pending.copy)?;
        Ok((v[STEP_LOSS] * pending.share) as f32)
    }

    /// One pass, the engine's reductions finished: the per-token losses on the device.
    fn pass_losses(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        global_tokens: usize,
    ) -> Result<O::Buf, DeviceTrainError> {
        if global_tokens == 0 {
            return Err(DeviceTrainError::Fsdp(FsdpError::InvalidShape {
                reason: "global_tokens of 0: the loss is a mean over them".into(),
            }));
        }
        let ops = self.pass.ops();
        // The pass's gradient is of this rank's mean loss over its rows·t tokens; scaled by
        // rows·t / global_tokens it is of its share of the global mean (1: unscaled).
        let scale = (rows * t) as f64 / global_tokens as f64;
        let scalars = if scale == 1.0 {
            None
        } else {
            let mut v = vec![0.0; step_scalars_len(0)];
            v[STEP_SCALE] = scale;
            Some(ops.scalars(&v)?)
        };
        let stream = self
            .fsdp
            .compute_device()
            .map(|d| d.compute_stream().clone());
        let mut units = EngineUnits::new(&mut self.fsdp, &self.units, self.pass.dims(), stream);
        let losses = self.pass.forward_backward_scaled(
            &mut units,
            inputs,
            targets,
            rows,
            t,
            scalars.as_ref(),
        )?;
        drop(units);
        self.fsdp.finalize_backward()?;
        Ok(losses)
    }

    /// One training step: [`forward_backward`](Self::forward_backward) of this rank's part of
    /// a global batch of `global_tokens` tokens, then [`Fsdp::optimizer_step`]. Returns the
    /// global batch's mean loss, the same on every rank. Every rank must call it.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward) and [`Fsdp::optimizer_step`].
    pub fn step(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        global_tokens: usize,
    ) -> Result<f32, DeviceTrainError> {
        let loss = self.forward_backward(inputs, targets, rows, t, global_tokens)?;
        self.fsdp.optimizer_step()?;
        Ok(loss)
    }
}

/// This rank's share of a pass's loss on its way to the host
/// ([`EngineGpt::forward_backward_pending`]).
pub struct PendingLoss<O: GptOps> {
    copy: O::ScalarsCopy,
    /// The pass's tokens over the global batch's.
    share: f64,
}

/// The engine's hooks around the GPT's units, and the views of the units unsharded now.
struct EngineUnits<'a, O: GptOps> {
    fsdp: &'a mut Fsdp,
    map: &'a UnitMap,
    dims: GptDims,
    stream: Option<Stream>,
    root: Option<Weights<O::Buf>>,
    root_grads: Option<Weights<O::Buf>>,
    blocks: Vec<Option<Block<O::Buf>>>,
    block_grads: Vec<Option<Block<O::Buf>>>,
}

/// What is not held now.
fn not_held(what: String) -> DeviceTrainError {
    DeviceTrainError::Fsdp(FsdpError::InvalidFsdpConfig {
        reason: format!("{what} is not unsharded now: the GPT's pass read it outside its hooks"),
    })
}

impl<'a, O: EngineViews> EngineUnits<'a, O> {
    fn new(fsdp: &'a mut Fsdp, map: &'a UnitMap, dims: GptDims, stream: Option<Stream>) -> Self {
        let n = dims.n_layer;
        EngineUnits {
            fsdp,
            map,
            dims,
            stream,
            root: None,
            root_grads: None,
            blocks: (0..n).map(|_| None).collect(),
            block_grads: (0..n).map(|_| None).collect(),
        }
    }

    /// The names and lengths of `unit`'s parameters.
    fn names(&self, unit: Unit) -> Vec<(String, usize)> {
        let prefix = match unit {
            Unit::Root => None,
            Unit::Block(l) => Some(format!("transformer.h.{l}.")),
        };
        param_shapes(&self.dims)
            .into_iter()
            .filter(|(n, _)| match &prefix {
                Some(p) => n.starts_with(p.as_str()),
                None => !n.starts_with("transformer.h."),
            })
            .map(|(n, s)| (n, s.iter().product()))
            .collect()
    }

    /// Views of `unit`'s parameters (`grads`: its gradients) by name.
    fn view(
        &mut self,
        ops: &O,
        unit: Unit,
        grads: bool,
    ) -> Result<HashMap<String, O::Buf>, DeviceTrainError> {
        let u = self.map.of(unit);
        let names = self.names(unit);
        let stream = self.stream.as_ref();
        let mut out = HashMap::with_capacity(names.len());
        if grads {
            let mut views = self.fsdp.grad_views(&[u])?;
            for (n, len) in names {
                let b = ops.grad_view(&mut views, stream, &n, len)?;
                out.insert(n, b);
            }
        } else {
            let views = self.fsdp.param_views(&[u])?;
            for (n, len) in names {
                let b = ops.param_view(&views, stream, &n, len)?;
                out.insert(n, b);
            }
        }
        Ok(out)
    }

    /// Hold views of `unit`'s parameters (`grads`: its gradients).
    fn hold(&mut self, ops: &O, unit: Unit, grads: bool) -> Result<(), DeviceTrainError> {
        let mut m = self.view(ops, unit, grads)?;
        let mut get = |name: &str, _: usize| -> Result<O::Buf, KernelError> {
            m.remove(name).ok_or_else(|| KernelError::InvalidArgument {
                kernel: "gpt",
                reason: format!("`{name}` was not viewed"),
            })
        };
        match unit {
            Unit::Root => {
                let w = Weights::try_build_root(&self.dims, &mut get)?;
                *(if grads {
                    &mut self.root_grads
                } else {
                    &mut self.root
                }) = Some(w);
            }
            Unit::Block(l) => {
                let prefix = format!("transformer.h.{l}.");
                let b =
                    Block::try_build(self.dims.n_embd, |s, len| get(&format!("{prefix}{s}"), len))?;
                *(if grads {
                    &mut self.block_grads[l]
                } else {
                    &mut self.blocks[l]
                }) = Some(b);
            }
        }
        Ok(())
    }

    /// Hand `unit`'s gradients back to the engine and drop its views.
    fn release(&mut self, ops: &O, unit: Unit) -> Result<(), DeviceTrainError> {
        let bufs: Vec<O::Buf> = match unit {
            Unit::Root => {
                self.root = None;
                let g = self
                    .root_grads
                    .take()
                    .ok_or_else(|| not_held(unit.to_string()))?;
                let Weights { wte, wpe, ln_f, .. } = g;
                vec![wte, wpe, ln_f.weight, ln_f.bias]
            }
            Unit::Block(l) => {
                self.blocks[l] = None;
                let g = self.block_grads[l]
                    .take()
                    .ok_or_else(|| not_held(unit.to_string()))?;
                let mut v = Vec::with_capacity(12);
                for p in [g.ln_1, g.c_attn, g.attn_proj, g.ln_2, g.c_fc, g.mlp_proj] {
                    v.push(p.weight);
                    v.push(p.bias);
                }
                v
            }
        };
        let names = self.names(unit);
        let mut views = self.fsdp.grad_views(&[self.map.of(unit)])?;
        for ((n, _), b) in names.iter().zip(bufs) {
            ops.grad_return(&mut views, self.stream.as_ref(), n, b)?;
        }
        Ok(())
    }
}

impl<O: EngineViews> Units<O> for EngineUnits<'_, O> {
    type Error = DeviceTrainError;

    fn pre_forward(&mut self, ops: &O, unit: Unit) -> Result<(), DeviceTrainError> {
        self.fsdp.pre_forward(self.map.of(unit))?;
        self.hold(ops, unit, false)
    }

    fn post_forward(&mut self, _: &O, unit: Unit) -> Result<(), DeviceTrainError> {
        match unit {
            Unit::Root => self.root = None,
            Unit::Block(l) => self.blocks[l] = None,
        }
        Ok(self.fsdp.post_forward(self.map.of(unit))?)
    }

    fn pre_backward(&mut self, ops: &O, unit: Unit) -> Result<(), DeviceTrainError> {
        self.fsdp.pre_backward(self.map.of(unit))?;
        self.hold(ops, unit, false)?;
        self.hold(ops, unit, true)
    }

    fn post_backward(&mut self, ops: &O, unit: Unit) -> Result<(), DeviceTrainError> {
        self.release(ops, unit)?;
        Ok(self.fsdp.post_backward(self.map.of(unit))?)
    }

    fn root(&self) -> Result<&Weights<O::Buf>, DeviceTrainError> {
        self.root
            .as_ref()
            .ok_or_else(|| not_held("the root".into()))
    }

    fn block(&self, layer: usize) -> Result<&Block<O::Buf>, DeviceTrainError> {
        self.blocks
            .get(layer)
            .and_then(Option::as_ref)
            .ok_or_else(|| not_held(format!("block {layer}")))
    }

    fn root_grads(&mut self) -> Result<(&Weights<O::Buf>, &mut Weights<O::Buf>), DeviceTrainError> {
        match (self.root.as_ref(), self.root_grads.as_mut()) {
            (Some(p), Some(g)) => Ok((p, g)),
            _ => Err(not_held("the root's gradient".into())),
        }
    }

    fn block_grads(
        &mut self,
        layer: usize,
    ) -> Result<(&Block<O::Buf>, &mut Block<O::Buf>), DeviceTrainError> {
        match (
            self.blocks.get(layer).and_then(Option::as_ref),
            self.block_grads.get_mut(layer).and_then(Option::as_mut),
        ) {
            (Some(p), Some(g)) => Ok((p, g)),
            _ => Err(not_held(format!("block {layer}'s gradient"))),
        }
    }
}
