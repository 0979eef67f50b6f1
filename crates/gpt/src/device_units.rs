//! Which tensors a sharded device pass gathers, frees and reduces together: the FSDP units of
//! a wrap policy ([`DeviceWrap`]) laid over the hooks of the GPT's pass.
//!
//! The pass ([`GptPass`](fsdp_kernels::gpt::GptPass)) calls its hooks around two kinds of
//! spans: the root's (`pre_forward(Root)` before the embeddings, `post_forward(Root)` after the
//! head, and the same in backward), which encloses every block's, and each block's. A unit of
//! the plan is opened (gathered) at the hook of the first span that reads one of its tensors
//! and closed (resharded in forward, reduced in backward) at the hook of the last, as the
//! engine opens and closes a unit around its spans: a unit holding any of the root's tensors
//! (`wte`, `wpe`, `ln_f`) spans the whole pass; a unit inside block `i` (the block, or a layer
//! of it) spans block `i`; the root unit of a plan that leaves blocks unwrapped holds their
//! tensors from its first span to its last.
//!
//! Because every tensor is sharded alone, the units change only when tensors are gathered and
//! freed and how the collectives group them: the training is the same bit for bit under any
//! plan.

use std::collections::HashMap;

use fsdp::wrap::{plan_units, WrapOptions, WrapPolicy};
use fsdp::FsdpError;
use fsdp_kernels::gpt::{block_product_weights, param_shapes, Unit};

use crate::model::GptConfig;
use crate::runtime::check_plan;
use crate::tree::gpt_module_tree;

/// How a sharded device run chooses its FSDP units (`fsdp train --wrap`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceWrap {
    /// The root (`wte` with the tied head, `wpe`, `ln_f`) and each transformer block: FSDP's
    /// usual wrapping of a transformer (`ModuleWrapPolicy({Block})`).
    #[default]
    Block,
    /// PyTorch's `size_based_auto_wrap_policy` with this `min_num_params`
    /// ([`WrapPolicy::Size`]): the layers, blocks or nothing but the root, by size.
    Size {
        /// The threshold of unwrapped elements for a new unit.
        min_num_params: usize,
    },
}

impl DeviceWrap {
    /// The engine's wrap policy of the same choice.
    pub fn policy(self) -> WrapPolicy {
        match self {
            DeviceWrap::Block => WrapPolicy::module_type(["Block"]),
            DeviceWrap::Size { min_num_params } => WrapPolicy::size(min_num_params),
        }
    }

    /// The units it makes of the model `cfg` as a sharded device pass holds them, in the
    /// plan's order.
    ///
    /// # Errors
    /// The wrap policy's (a tied parameter split from its tie).
    pub fn units(self, cfg: &GptConfig) -> Result<Vec<DeviceUnit>, FsdpError> {
        let layout = UnitLayout::new(cfg, self)?;
        Ok(layout
            .units
            .iter()
            .map(|u| DeviceUnit {
                name: u.name.clone(),
                elements: u.tensors.iter().map(|&i| layout.numels[i]).sum(),
                blocks: match u.forward {
                    (Unit::Block(a), Unit::Block(b)) => Some((a, b)),
                    _ => None,
                },
            })
            .collect())
    }
}

/// One unit of a sharded device pass ([`DeviceWrap::units`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceUnit {
    /// Its module path (`""`: the root).
    pub name: String,
    /// Its parameters' elements.
    pub elements: usize,
    /// The first and last block whose span holds it unsharded, or `None` when it holds one
    /// of the root's tensors and so spans the whole pass.
    pub blocks: Option<(usize, usize)>,
}

impl std::fmt::Display for DeviceUnit {
    /// `name  elements  span`, the span `the whole pass`, `block i` or `blocks i-j`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = if self.name.is_empty() {
            "(root)"
        } else {
            &self.name
        };
        let span = match self.blocks {
            None => "the whole pass".to_string(),
            Some((a, b)) if a == b => format!("block {a}"),
            Some((a, b)) => format!("blocks {a}-{b}"),
        };
        write!(f, "{name:<32} {:>12}  {span}", self.elements)
    }
}

/// One unit on the pass's hooks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UnitSpan {
    /// The unit's module path (`""`: the root).
    pub(crate) name: String,
    /// Its tensors, as indices of [`param_shapes`], ascending (the collectives' order).
    pub(crate) tensors: Vec<usize>,
    /// Where forward opens and closes it.
    pub(crate) forward: (Unit, Unit),
    /// Where backward opens and closes it.
    pub(crate) backward: (Unit, Unit),
}

impl UnitSpan {
    /// Whether it is the plan's root unit (which FSDP does not reshard after forward).
    pub(crate) fn is_root(&self) -> bool {
        self.name.is_empty()
    }
}

impl std::fmt::Display for UnitSpan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_root() {
            write!(f, "the root unit")
        } else {
            write!(f, "unit `{}`", self.name)
        }
    }
}

/// The units of a plan laid over the pass's hooks (see the [module](self) documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UnitLayout {
    pub(crate) units: Vec<UnitSpan>,
    /// Each tensor's elements, in [`param_shapes`] order.
    pub(crate) numels: Vec<usize>,
    /// Each tensor's span and its position there (the root's `wte`, `wpe`, `ln_f.weight`,
    /// `ln_f.bias`; a block's in [`Block::bufs`](fsdp_kernels::gpt::Block::bufs) order).
    places: Vec<(Unit, usize)>,
    n_layer: usize,
}

impl UnitLayout {
    /// The units `wrap` makes of the model `cfg`.
    ///
    /// # Errors
    /// The wrap policy's (a tied parameter split from its tie); a plan with ignored
    /// parameters (the device trains every parameter).
    pub(crate) fn new(cfg: &GptConfig, wrap: DeviceWrap) -> Result<Self, FsdpError> {
        let plan = plan_units(&gpt_module_tree(cfg), &WrapOptions::new(wrap.policy()))?;
        if let Some(p) = plan.ignored.first() {
            return Err(FsdpError::InvalidPlan {
                reason: format!("the device trains every parameter; `{}` is ignored", p.name),
            });
        }
        // Every parameter exactly once, with its shape: the engine's checks of a plan.
        plan.validate()?;
        check_plan(cfg, &plan)?;
        let dims = cfg.dims();
        let shapes = param_shapes(&dims);
        let index: HashMap<&str, usize> = shapes
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.as_str(), i))
            .collect();
        let n_layer = dims.n_layer;
        let places: Vec<(Unit, usize)> = (0..shapes.len())
            .map(|i| match i {
                0 | 1 => (Unit::Root, i),
                i if i < 2 + 12 * n_layer => (Unit::Block((i - 2) / 12), (i - 2) % 12),
                i => (Unit::Root, i - 12 * n_layer),
            })
            .collect();
        let mut units = Vec::with_capacity(plan.units.len());
        for u in &plan.units {
            let mut tensors = u
                .params
                .iter()
                .map(|p| {
                    index
                        .get(p.name.as_str())
                        .copied()
                        .ok_or_else(|| FsdpError::InvalidPlan {
                            reason: format!("`{}` is not a parameter of the GPT", p.name),
                        })
                })
                .collect::<Result<Vec<usize>, _>>()?;
            tensors.sort_unstable();
            let blocks = || tensors.iter().filter_map(|&i| block_of(places[i].0));
            let (forward, backward) = if tensors.iter().any(|&i| places[i].0 == Unit::Root) {
                ((Unit::Root, Unit::Root), (Unit::Root, Unit::Root))
            } else {
                let (Some(first), Some(last)) = (blocks().min(), blocks().max()) else {
                    continue; // A unit of no parameter: nothing to gather.
                };
                (
                    (Unit::Block(first), Unit::Block(last)),
                    (Unit::Block(last), Unit::Block(first)),
                )
            };
            units.push(UnitSpan {
                name: u.name.clone(),
                tensors,
                forward,
                backward,
            });
        }
        Ok(UnitLayout {
            units,
            numels: shapes.iter().map(|(_, s)| s.iter().product()).collect(),
            places,
            n_layer,
        })
    }

    /// The tensor at position `pos` of the span `span` (the inverse of its place).
    pub(crate) fn tensor_at(&self, span: Unit, pos: usize) -> usize {
        match span {
            Unit::Root if pos < 2 => pos,
            Unit::Root => pos + 12 * self.n_layer,
            Unit::Block(l) => 2 + 12 * l + pos,
        }
    }

    /// The tensors the span `span` reads, in its order.
    pub(crate) fn span_tensors(&self, span: Unit) -> Vec<usize> {
        let n = if span == Unit::Root { 4 } else { 12 };
        (0..n).map(|p| self.tensor_at(span, p)).collect()
    }

    /// Whether tensor `i` is a weight that only matrix products read (a block's linear
    /// layers').
    pub(crate) fn product_weight(&self, i: usize) -> bool {
        match self.places[i] {
            (Unit::Block(_), pos) => block_product_weights()[pos],
            (Unit::Root, _) => false,
        }
    }

    /// The units forward opens at `span`'s `pre_forward`, in the plan's order.
    pub(crate) fn forward_opens(&self, span: Unit) -> impl Iterator<Item = usize> + '_ {
        self.where_(move |u| u.forward.0 == span)
    }

    /// The units forward closes at `span`'s `post_forward`.
    pub(crate) fn forward_closes(&self, span: Unit) -> impl Iterator<Item = usize> + '_ {
        self.where_(move |u| u.forward.1 == span)
    }

    /// The units backward opens at `span`'s `pre_backward`.
    pub(crate) fn backward_opens(&self, span: Unit) -> impl Iterator<Item = usize> + '_ {
        self.where_(move |u| u.backward.0 == span)
    }

    /// The units backward closes (reduces) at `span`'s `post_backward`.
    pub(crate) fn backward_closes(&self, span: Unit) -> impl Iterator<Item = usize> + '_ {
        self.where_(move |u| u.backward.1 == span)
    }

    fn where_<'s>(
        &'s self,
        f: impl Fn(&UnitSpan) -> bool + 's,
    ) -> impl Iterator<Item = usize> + 's {
        self.units
            .iter()
            .enumerate()
            .filter(move |(_, u)| f(u))
            .map(|(i, _)| i)
    }
}

fn block_of(span: Unit) -> Option<usize> {
    match span {
        Unit::Block(l) => Some(l),
        Unit::Root => None,
    }
}

/// The items of `all` (every tensor, in [`param_shapes`] order) at the ascending indices
/// `ids`.
pub(crate) fn pick<T>(all: Vec<T>, ids: &[usize]) -> Vec<T> {
    all.into_iter()
        .enumerate()
        .filter(|(i, _)| ids.binary_search(i).is_ok())
        .map(|(_, t)| t)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The small GPT of `tests/wrap.rs`' hand-computed examples.
    fn small() -> GptConfig {
        GptConfig::new(2, 2, 8, 4, 16).unwrap()
    }

    fn layout(wrap: DeviceWrap) -> UnitLayout {
        UnitLayout::new(&small(), wrap).unwrap()
    }

    #[test]
    fn the_block_policy_is_the_root_and_each_block() {
        let l = layout(DeviceWrap::Block);
        let names: Vec<&str> = l.units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["", "transformer.h.0", "transformer.h.1"]);
        assert_eq!(l.units[0].tensors, [0, 1, 26, 27]);
        assert_eq!(l.units[0].forward, (Unit::Root, Unit::Root));
        assert_eq!(l.units[2].tensors, (14..26).collect::<Vec<_>>());
        assert_eq!(l.units[2].backward, (Unit::Block(1), Unit::Block(1)));
        assert_eq!(l.span_tensors(Unit::Root), [0, 1, 26, 27]);
        assert_eq!(l.span_tensors(Unit::Block(1)), l.units[2].tensors);
        assert!(l.product_weight(2 + 2) && !l.product_weight(2 + 3) && !l.product_weight(0));
    }

    #[test]
    fn size_policies_open_units_where_their_tensors_are_read() {
        // Size 500 (`tests/wrap.rs` works it out): each block's `mlp` (552 elements) is a unit,
        // the rest of the blocks (320 each) goes to the root.
        let l = layout(DeviceWrap::Size {
            min_num_params: 500,
        });
        let names: Vec<&str> = l.units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["", "transformer.h.0.mlp", "transformer.h.1.mlp"]);
        assert_eq!(l.units[1].forward, (Unit::Block(0), Unit::Block(0)));
        // The root holds both blocks' remainders: the whole pass.
        assert_eq!(l.units[0].tensors.len(), 4 + 2 * 8);
        assert_eq!(l.forward_closes(Unit::Root).collect::<Vec<_>>(), [0]);
        assert_eq!(l.backward_opens(Unit::Block(1)).collect::<Vec<_>>(), [2]);
        // Nothing but the root: one unit of every tensor.
        let l = layout(DeviceWrap::Size {
            min_num_params: 1_000_000,
        });
        assert_eq!(l.units.len(), 1);
        assert_eq!(l.units[0].tensors, (0..28).collect::<Vec<_>>());
    }

    #[test]
    fn a_split_tie_is_the_policys_error() {
        let wrap = DeviceWrap::Size {
            min_num_params: 128,
        };
        let e = UnitLayout::new(&small(), wrap).unwrap_err().to_string();
        assert!(e.contains("lm_head.weight"), "{e}");
    }
}
