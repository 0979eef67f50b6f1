//! The engine's hooks around the GPT's units for [`EngineGpt`](crate::engine_gpt::EngineGpt):
//! which of the engine's units holds the GPT's root and each block ([`UnitMap`]), and the
//! [`Units`] the GPT's pass calls ([`EngineUnits`]), which run the engine's hooks and hold the
//! views of the units unsharded now.

use std::collections::HashMap;

use fsdp::{Fsdp, FsdpError};
use fsdp_device::Stream;
use fsdp_kernels::gpt::{param_shapes, Block, GptDims, GptOps, Unit, Units, Weights};
use fsdp_kernels::KernelError;

use crate::device_config::DeviceTrainError;
use crate::engine_views::EngineViews;

/// The engine's unit of the GPT's root and of each block.
#[derive(Clone, Debug)]
pub(crate) struct UnitMap {
    root: usize,
    blocks: Vec<usize>,
}

impl UnitMap {
    /// The units of `fsdp` that hold the GPT `d`'s: its parameters (names and shapes of
    /// [`param_shapes`]) in units that each hold the root or one block.
    ///
    /// # Errors
    /// [`FsdpError::InvalidPlan`] naming a parameter missing or of another shape, or units
    /// that split or merge the GPT's units.
    pub(crate) fn new(fsdp: &Fsdp, d: &GptDims) -> Result<UnitMap, DeviceTrainError> {
        let want = param_shapes(d);
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
        let root = unit_of_all(fsdp, "the root", &root_names)?;
        let mut blocks = Vec::with_capacity(d.n_layer);
        for l in 0..d.n_layer {
            let names: Vec<String> = want
                .iter()
                .filter(|(n, _)| n.starts_with(&format!("transformer.h.{l}.")))
                .map(|(n, _)| n.clone())
                .collect();
            blocks.push(unit_of_all(fsdp, &format!("block {l}"), &names)?);
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
        Ok(UnitMap { root, blocks })
    }

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

/// The engine's hooks around the GPT's units, and the views of the units unsharded now.
pub(crate) struct EngineUnits<'a, O: GptOps> {
    fsdp: &'a mut Fsdp,
    map: &'a UnitMap,
    dims: GptDims,
    stream: Option<Stream>,
    /// Whether the pass marks the ends of the hooks' work (a traced pass).
    traced: bool,
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
    pub(crate) fn new(
        fsdp: &'a mut Fsdp,
        map: &'a UnitMap,
        dims: GptDims,
        stream: Option<Stream>,
        traced: bool,
    ) -> Self {
        let n = dims.n_layer;
        EngineUnits {
            fsdp,
            map,
            dims,
            stream,
            traced,
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

    fn traced(&self) -> bool {
        self.traced
    }

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
