//! Where [`ShardedUnits`](super::ShardedUnits) keeps the full tensors of its open units:
//! [`Slots`], one place per tensor, and the views of the span being computed — the root's
//! [`Weights`] or a block's [`Block`] — that the pass reads, assembled from the slots when the
//! span begins and taken apart when it ends. A tensor is in its slot, in a view, or not held.

use fsdp_kernels::gpt::{param_shapes, Block, GptDims, Pair, Unit, Weights};
use fsdp_kernels::KernelError;

use super::not_held;
use crate::device_config::DeviceTrainError;
use crate::device_units::UnitLayout;

/// The full tensors held (parameters, or gradients), by tensor and by view.
pub(super) struct Slots<B> {
    tensors: Vec<Option<B>>,
    root: Option<Weights<B>>,
    blocks: Vec<Option<Block<B>>>,
}

impl<B> Slots<B> {
    /// Nothing held, for a model of `tensors` tensors in `n_layer` blocks.
    pub(super) fn new(tensors: usize, n_layer: usize) -> Self {
        Slots {
            tensors: (0..tensors).map(|_| None).collect(),
            root: None,
            blocks: (0..n_layer).map(|_| None).collect(),
        }
    }

    /// Puts tensor `i` in its slot.
    pub(super) fn put(&mut self, i: usize, b: B) {
        self.tensors[i] = Some(b);
    }

    /// Takes tensor `i` from its slot (`None` when it is not there).
    pub(super) fn take(&mut self, i: usize) -> Option<B> {
        self.tensors.get_mut(i).and_then(Option::take)
    }

    /// The root's view, when assembled.
    pub(super) fn root(&self) -> Option<&Weights<B>> {
        self.root.as_ref()
    }

    /// The root's view, mutably.
    pub(super) fn root_mut(&mut self) -> Option<&mut Weights<B>> {
        self.root.as_mut()
    }

    /// Block `l`'s view, when assembled.
    pub(super) fn block(&self, l: usize) -> Option<&Block<B>> {
        self.blocks.get(l).and_then(Option::as_ref)
    }

    /// Block `l`'s view, mutably.
    pub(super) fn block_mut(&mut self, l: usize) -> Option<&mut Block<B>> {
        self.blocks.get_mut(l).and_then(Option::as_mut)
    }

    /// Moves the tensors `span` reads from their slots into its view (nothing when it is
    /// assembled already).
    ///
    /// # Errors
    /// A tensor of the span that is not held, named (`what`: parameters or gradients).
    pub(super) fn assemble(
        &mut self,
        layout: &UnitLayout,
        dims: &GptDims,
        span: Unit,
        what: &str,
    ) -> Result<(), DeviceTrainError> {
        let ids = layout.span_tensors(span);
        let assembled = match span {
            Unit::Root => self.root.is_some(),
            Unit::Block(l) => self.block(l).is_some(),
        };
        if assembled {
            return Ok(());
        }
        if let Some(&i) = ids.iter().find(|&&i| self.tensors[i].is_none()) {
            let name = &param_shapes(dims)[i].0;
            return Err(not_held(&format!("{what} `{name}` (for {span})")));
        }
        let mut next = ids.iter().map(|&i| self.tensors[i].take());
        let mut take = |_: &str, _: usize| {
            next.next()
                .flatten()
                .ok_or_else(|| KernelError::InvalidArgument {
                    kernel: "fsdp units",
                    reason: format!("{span} lacks a tensor"),
                })
        };
        match span {
            Unit::Root => self.root = Some(Weights::try_build_root(dims, &mut take)?),
            Unit::Block(l) => self.blocks[l] = Some(Block::try_build(dims.n_embd, &mut take)?),
        }
        Ok(())
    }

    /// Moves the tensors of `span`'s view back into their slots (nothing when it is not
    /// assembled).
    pub(super) fn disassemble(&mut self, layout: &UnitLayout, span: Unit) {
        let bufs: Vec<B> = match span {
            Unit::Root => match self.root.take() {
                Some(w) => root_bufs(w).into(),
                None => return,
            },
            Unit::Block(l) => match self.blocks.get_mut(l).and_then(Option::take) {
                Some(b) => block_bufs(b).into(),
                None => return,
            },
        };
        for (i, b) in layout.span_tensors(span).into_iter().zip(bufs) {
            self.tensors[i] = Some(b);
        }
    }
}

/// The root's tensors of `w` (`wte`, `wpe`, `ln_f.weight`, `ln_f.bias`), owned.
fn root_bufs<B>(w: Weights<B>) -> [B; 4] {
    let Weights {
        wte,
        wpe,
        ln_f: Pair { weight, bias },
        ..
    } = w;
    [wte, wpe, weight, bias]
}

/// A block's tensors, owned, in [`Block::bufs`] order.
fn block_bufs<B>(b: Block<B>) -> [B; 12] {
    let Block {
        ln_1,
        c_attn,
        attn_proj,
        ln_2,
        c_fc,
        mlp_proj,
    } = b;
    let [p0, p1, p2, p3, p4, p5] = [ln_1, c_attn, attn_proj, ln_2, c_fc, mlp_proj];
    [
        p0.weight, p0.bias, p1.weight, p1.bias, p2.weight, p2.bias, p3.weight, p3.bias, p4.weight,
        p4.bias, p5.weight, p5.bias,
    ]
}
