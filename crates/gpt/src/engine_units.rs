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
    /// The engine's unit and the parameters (names, elements, in [`param_shapes`] order) of
    /// the root, then of each block.
    units: Vec<(usize, Vec<(String, usize)>)>,
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
        let mut names: Vec<Vec<(String, usize)>> = vec![Vec::new(); d.n_layer + 1];
        for (name, shape) in want {
            let at = name
                .strip_prefix("transformer.h.")
                .and_then(|rest| rest.split('.').next()?.parse::<usize>().ok())
                .map_or(0, |l| l + 1);
            names[at].push((name, shape.iter().product()));
        }
        let mut units: Vec<(usize, Vec<(String, usize)>)> = Vec::with_capacity(names.len());
        for (i, names) in names.into_iter().enumerate() {
            let what = match i {
                0 => "the root".to_string(),
                i => format!("block {}", i - 1),
            };
            let u = unit_of_all(fsdp, &what, &names)?;
            if units.iter().any(|(v, _)| *v == u) {
                return Err(invalid_plan(format!(
                    "{what} shares unit {u} with another of the GPT's units: the GPT's pass \
                     needs the root and each block in units of their own (gpt_block_plan)"
                )));
            }
            units.push((u, names));
        }
        Ok(UnitMap { units })
    }

    fn at(&self, unit: Unit) -> &(usize, Vec<(String, usize)>) {
        match unit {
            Unit::Root => &self.units[0],
            Unit::Block(l) => &self.units[l + 1],
        }
    }

    /// The engine's unit holding the GPT's `unit`.
    fn of(&self, unit: Unit) -> usize {
        self.at(unit).0
    }

    /// The names and elements of `unit`'s parameters, in [`param_shapes`] order.
    fn names(&self, unit: Unit) -> &[(String, usize)] {
        &self.at(unit).1
    }
}

fn invalid_plan(reason: String) -> DeviceTrainError {
    DeviceTrainError::Fsdp(FsdpError::InvalidPlan { reason })
}

/// The engine's unit holding every parameter of `names` (all in one unit, else an error).
fn unit_of_all(
    fsdp: &Fsdp,
    what: &str,
    names: &[(String, usize)],
) -> Result<usize, DeviceTrainError> {
    let mut unit = None;
    for (n, _) in names {
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

    /// Views of `unit`'s parameters (`grads`: its gradients) by name.
    fn view(
        &mut self,
        ops: &O,
        unit: Unit,
        grads: bool,
    ) -> Result<HashMap<String, O::Buf>, DeviceTrainError> {
        let map = self.map;
        let (u, names) = (map.of(unit), map.names(unit));
        let stream = self.stream.as_ref();
        let mut out = HashMap::with_capacity(names.len());
        if grads {
            let mut views = self.fsdp.grad_views(&[u])?;
            for (n, len) in names {
                let b = ops.grad_view(&mut views, stream, n, *len)?;
                out.insert(n.clone(), b);
            }
        } else {
            let views = self.fsdp.param_views(&[u])?;
            for (n, len) in names {
                let b = ops.param_view(&views, stream, n, *len)?;
                out.insert(n.clone(), b);
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
        let map = self.map;
        let names = map.names(unit);
        let mut views = self.fsdp.grad_views(&[map.of(unit)])?;
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
