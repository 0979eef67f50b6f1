//! Where a pass's parameters come from and where its gradients go, unit by unit: the
//! [`Units`] trait that [`GptPass::forward_backward`](super::GptPass::forward_backward) calls
//! around each unit, as PyTorch FSDP's hooks (`pre_forward`, `post_forward`, `pre_backward`,
//! `post_backward`) run around each wrapped module.
//!
//! The GPT's units are FSDP's usual wrapping of it: the root (`wte`, which the tied head reads
//! too, `wpe` and `ln_f`) and each transformer block. [`Resident`] serves a model that holds all
//! its parameters and gradients (what [`DeviceGpt`](super::DeviceGpt) does: every hook does
//! nothing); a sharded trainer gathers a unit's parameters in its `pre_forward` and
//! `pre_backward`, frees them in `post_forward` (FSDP's `reshard_after_forward`) and
//! `post_backward`, and reduce-scatters the unit's gradients in `post_backward`.

use super::ops::GptOps;
use super::weights::{invalid, Block, Weights};
use crate::KernelError;

/// A unit's parameters (read) and its gradients (added to), borrowed together.
pub type WithGrads<'a, T> = (&'a T, &'a mut T);

/// One unit of the GPT.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    /// `transformer.wte` (also the tied `lm_head`), `transformer.wpe` and `transformer.ln_f`.
    Root,
    /// `transformer.h.{i}`.
    Block(usize),
}

impl std::fmt::Display for Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unit::Root => write!(f, "the root"),
            Unit::Block(i) => write!(f, "block {i}"),
        }
    }
}

/// The parameters and gradients of a forward/backward pass, unit by unit: the hooks
/// [`GptPass::forward_backward`](super::GptPass::forward_backward) calls around each unit, as
/// PyTorch FSDP's hooks run around each wrapped module. [`Resident`] serves a model that holds
/// all its parameters and gradients (every hook does nothing); a sharded trainer gathers a
/// unit's parameters in its `pre_forward` and `pre_backward`, frees them in `post_forward`
/// (FSDP's `reshard_after_forward`) and `post_backward`, and reduce-scatters the unit's
/// gradients in `post_backward`.
///
/// The pass calls, in this order: `pre_forward(Root)`; for each block `pre_forward(Block(i))`,
/// its forward, `post_forward(Block(i))`; the head's forward, `post_forward(Root)`;
/// `pre_backward(Root)` and the head's backward; for each block from the last
/// `pre_backward(Block(i))`, its backward (its forward again first under activation
/// checkpointing), `post_backward(Block(i))`; the embeddings' backward and
/// `post_backward(Root)`. Parameters are read only between a unit's `pre_forward` and
/// `post_forward`, or its `pre_backward` and `post_backward`; gradients are written only
/// between its `pre_backward` and `post_backward`, and every backward operation adds to them
/// (never overwrites): a trainer hands zeros at a step's first `pre_backward`, and under
/// gradient accumulation the sum so far.
pub trait Units<O: GptOps> {
    /// The error of the hooks (a collective's, say); the operations' errors convert into it.
    type Error: From<KernelError>;

    /// Whether a traced pass ([`GptPass::set_tracing`](super::GptPass::set_tracing)) marks
    /// the end of the hooks that do work as parts of their own: `pre_forward` and a block's
    /// `pre_backward` (unsharding), `post_backward` (reducing the gradients). Default: no.
    fn traced(&self) -> bool {
        false
    }

    /// Before the unit's first forward operation.
    ///
    /// # Errors
    /// The hook's.
    fn pre_forward(&mut self, ops: &O, unit: Unit) -> Result<(), Self::Error>;
    /// After the unit's last forward operation.
    ///
    /// # Errors
    /// The hook's.
    fn post_forward(&mut self, ops: &O, unit: Unit) -> Result<(), Self::Error>;
    /// Before the unit's first backward operation: its parameters readable and its
    /// gradients zero.
    ///
    /// # Errors
    /// The hook's.
    fn pre_backward(&mut self, ops: &O, unit: Unit) -> Result<(), Self::Error>;
    /// After the unit's last backward operation: its gradients are complete.
    ///
    /// # Errors
    /// The hook's.
    fn post_backward(&mut self, ops: &O, unit: Unit) -> Result<(), Self::Error>;

    /// The root's parameters (`wte`, `wpe`, `ln_f`; its `blocks` are not read).
    ///
    /// # Errors
    /// When they are not held now (outside the hooks' windows).
    fn root(&self) -> Result<&Weights<O::Buf>, Self::Error>;
    /// Block `layer`'s parameters.
    ///
    /// # Errors
    /// When they are not held now.
    fn block(&self, layer: usize) -> Result<&Block<O::Buf>, Self::Error>;
    /// The root's parameters and its gradients (the same fields), the gradients to add to.
    ///
    /// # Errors
    /// When they are not held now.
    fn root_grads(&mut self) -> Result<WithGrads<'_, Weights<O::Buf>>, Self::Error>;
    /// Block `layer`'s parameters and its gradients, the gradients to add to.
    ///
    /// # Errors
    /// When they are not held now.
    fn block_grads(&mut self, layer: usize) -> Result<WithGrads<'_, Block<O::Buf>>, Self::Error>;
}

/// Every parameter and gradient held throughout: the hooks do nothing. The gradients are
/// added to as they are (zero them before the pass).
pub struct Resident<'a, B> {
    /// The parameters.
    pub params: &'a Weights<B>,
    /// The gradients.
    pub grads: &'a mut Weights<B>,
}

fn no_block(layer: usize, blocks: usize) -> KernelError {
    invalid(format!("block {layer} of a model of {blocks} blocks"))
}

impl<O: GptOps> Units<O> for Resident<'_, O::Buf> {
    type Error = KernelError;

    fn pre_forward(&mut self, _: &O, _: Unit) -> Result<(), KernelError> {
        Ok(())
    }
    fn post_forward(&mut self, _: &O, _: Unit) -> Result<(), KernelError> {
        Ok(())
    }
    fn pre_backward(&mut self, _: &O, _: Unit) -> Result<(), KernelError> {
        Ok(())
    }
    fn post_backward(&mut self, _: &O, _: Unit) -> Result<(), KernelError> {
        Ok(())
    }
    fn root(&self) -> Result<&Weights<O::Buf>, KernelError> {
        Ok(self.params)
    }
    fn block(&self, layer: usize) -> Result<&Block<O::Buf>, KernelError> {
        let n = self.params.blocks.len();
        self.params
            .blocks
            .get(layer)
            .ok_or_else(|| no_block(layer, n))
    }
    fn root_grads(&mut self) -> Result<WithGrads<'_, Weights<O::Buf>>, KernelError> {
        Ok((self.params, self.grads))
    }
    fn block_grads(&mut self, layer: usize) -> Result<WithGrads<'_, Block<O::Buf>>, KernelError> {
        let n = self.params.blocks.len();
        match (
            self.params.blocks.get(layer),
            self.grads.blocks.get_mut(layer),
        ) {
            (Some(p), Some(g)) => Ok((p, g)),
            _ => Err(no_block(layer, n)),
        }
    }
}
