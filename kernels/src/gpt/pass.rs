//! [`GptPass`]: one forward and backward pass of the GPT over [`GptOps`], its parameters and
//! gradients given unit by unit by a [`Units`].

use fsdp_allocator::memory_context_with;
use std::sync::Mutex;

use super::attention::Attention;
use super::head::{HeadInputs, Logits};
use super::ops::{Arg, GptOps};
use super::trace::Marks;
use super::units::{Unit, Units};
use super::weights::{invalid, GptDims, Pair};
use crate::gemm::MatMul;
use crate::KernelError;

/// LayerNorm's epsilon (PyTorch's default, nanoGPT's).
const LN_EPS: f32 = 1e-5;

/// The GPT's forward and backward pass on one device, without its parameters: the operations,
/// the model's shape, activation checkpointing and tracing. [`DeviceGpt`](super::DeviceGpt)
/// runs it over the parameters it holds; a sharded trainer over parameters it gathers unit by
/// unit ([`Units`]).
pub struct GptPass<O: GptOps> {
    pub(super) ops: O,
    pub(super) dims: GptDims,
    pub(super) checkpoint: bool,
    /// How the attention holds its `t × t` matrices.
    pub(super) attention: Attention,
    /// How the head holds its logits.
    pub(super) logits: Logits,
    /// The marks of a traced step ([`set_tracing`](GptPass::set_tracing)).
    pub(super) marks: Marks<O::Mark>,
}

/// What forward keeps of one block for backward: all its activations, or (activation
/// checkpointing) its input alone, from which backward runs the block's forward again.
enum Saved<O: GptOps> {
    Acts(BlockActs<O>),
    Input(O::Buf),
}

/// The sizes of one step: `rows` sequences of `t` tokens, `n = rows·t`.
#[derive(Clone, Copy)]
pub(super) struct Step {
    pub(super) rows: usize,
    pub(super) t: usize,
    pub(super) n: usize,
}

/// A layer norm's output (an operand of products), mean and rstd.
pub(super) type Normed<O> = (
    <O as GptOps>::Operand,
    <O as GptOps>::Buf,
    <O as GptOps>::Buf,
);

/// What one block keeps from forward for backward: the activations that only products read
/// as operands ([`GptOps::operand`]), the others as buffers.
pub(super) struct BlockActs<O: GptOps> {
    pub(super) x: O::Buf,
    pub(super) ln1_mean: O::Buf,
    pub(super) ln1_rstd: O::Buf,
    pub(super) h1: O::Operand,
    pub(super) q: O::Operand,
    pub(super) k: O::Operand,
    pub(super) v: O::Operand,
    /// The probabilities when [`Attention::Materialized`]; the rows' log-sum-exp when
    /// [`Attention::Fused`].
    pub(super) att: Option<O::Buf>,
    pub(super) y: O::Operand,
    pub(super) x2: O::Buf,
    pub(super) ln2_mean: O::Buf,
    pub(super) ln2_rstd: O::Buf,
    pub(super) h2: O::Operand,
    pub(super) fc: O::Buf,
    pub(super) g: O::Operand,
}

impl<O: GptOps> GptPass<O> {
    /// The pass of the model `dims` on `ops`' device, without checkpointing or tracing.
    ///
    /// # Errors
    /// Invalid `dims`.
    pub fn new(ops: O, dims: GptDims) -> Result<GptPass<O>, KernelError> {
        dims.validate()?;
        Ok(GptPass {
            ops,
            dims,
            checkpoint: false,
            attention: Attention::default(),
            logits: Logits::default(),
            marks: Mutex::new(None),
        })
    }

    /// Activation checkpointing of every block (PyTorch's `checkpoint_wrapper` around each
    /// block; `fsdp train --activation-checkpointing`): forward keeps only each block's input,
    /// and backward runs the block's forward again just before its backward. The gradients
    /// are the same bit for bit (the same operations on the same inputs give the same
    /// activations), for one more forward of each block; the activations of one block are held
    /// at a time instead of all of them.
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.checkpoint = on;
    }

    /// Whether the pass checkpoints activations
    /// ([`set_activation_checkpointing`](Self::set_activation_checkpointing)).
    pub fn activation_checkpointing(&self) -> bool {
        self.checkpoint
    }

    /// How the blocks' attention holds its `t × t` scores and probabilities (default:
    /// [`Attention::Chunked`] of [`Attention::CHUNK_BYTES`]). Both give the same bits on the
    /// twins.
    pub fn set_attention(&mut self, attention: Attention) {
        self.attention = attention;
    }

    /// How the blocks' attention holds its matrices ([`set_attention`](Self::set_attention)).
    pub fn attention(&self) -> Attention {
        self.attention
    }

    /// How the head holds its `tokens × vocabulary` logits (default: [`Logits::Chunked`] of
    /// [`Logits::CHUNK_BYTES`]). Each token's loss and gradient are the same bits either way;
    /// the tied weight's gradient is summed chunk by chunk.
    pub fn set_logits(&mut self, logits: Logits) {
        self.logits = logits;
    }

    /// How the head holds its logits ([`set_logits`](Self::set_logits)).
    pub fn logits(&self) -> Logits {
        self.logits
    }

    /// The operations.
    pub fn ops(&self) -> &O {
        &self.ops
    }

    /// The model's shape.
    pub fn dims(&self) -> GptDims {
        self.dims
    }

    /// Checks a pass's batch before any work: `rows` sequences of `t` tokens, ids below the
    /// vocabulary.
    pub(super) fn check_batch(
        &self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
    ) -> Result<Step, KernelError> {
        let d = self.dims;
        if t == 0 || t > d.block_size || rows == 0 {
            return Err(invalid(format!(
                "{rows} sequences of {t} tokens: both must be positive, t at most {}",
                d.block_size
            )));
        }
        let n = rows * t;
        for (what, ids) in [("inputs", inputs), ("targets", targets)] {
            if ids.len() != n {
                return Err(invalid(format!(
                    "{what} has {} ids, expected {rows}×{t}",
                    ids.len()
                )));
            }
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= d.vocab_size) {
                return Err(invalid(format!(
                    "{what} holds id {bad}, not below vocab_size {}",
                    d.vocab_size
                )));
            }
        }
        Ok(Step { rows, t, n })
    }

    /// One forward and backward pass on `rows` sequences of `t` tokens (`inputs` and
    /// `targets` row after row), its parameters and gradients given by `units` (whose hooks
    /// it calls as [`Units`] says): returns the `rows·t` per-token losses on the device (their
    /// mean is the pass's loss), and adds every parameter's gradient of that mean to the
    /// gradients `units` gives.
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] for `t` of 0 or past `block_size`, lengths other than
    /// `rows·t`, or an id or target not below `vocab_size` (checked before any work);
    /// operation failures; the hooks' errors.
    pub fn forward_backward<U: Units<O> + ?Sized>(
        &self,
        units: &mut U,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
    ) -> Result<O::Buf, U::Error> {
        self.forward_backward_scaled(units, inputs, targets, rows, t, None)
    }

    /// [`forward_backward`](Self::forward_backward) of the loss times a grad scaler's loss
    /// scale, read on the device from the step's scalars `scale`
    /// ([`STEP_SCALE`](crate::host::STEP_SCALE)) when given: the cross-entropy's gradient seed
    /// is multiplied by it, so every gradient added is the scaled loss's (exactly the scale
    /// times the unscaled one for a power-of-two scale, unless a value overflows). The losses
    /// returned are unscaled.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward); a scalar buffer too short.
    pub fn forward_backward_scaled<U: Units<O> + ?Sized>(
        &self,
        units: &mut U,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        scale: Option<&O::Scalars>,
    ) -> Result<O::Buf, U::Error> {
        let s = self.check_batch(inputs, targets, rows, t)?;
        let (d, n) = (self.dims, s.n);
        let e = d.n_embd;
        let ops = &self.ops;
        // Embeddings. Each part names itself to the caching allocator's recorded history
        // (a frame of its allocations' stacks; nothing is built while no allocator records).
        let part = memory_context_with(|| "embedding forward".into());
        units.pre_forward(ops, Unit::Root)?;
        self.hook_mark(units, false, || "unshard the root".into())?;
        let ids = ops.upload_ids(inputs)?;
        let mut x = ops.empty(n * e)?;
        let root = units.root()?;
        ops.embedding_forward(&ids, &root.wte, &root.wpe, t, e, &mut x)?;
        self.trace_mark(false, || "embedding forward".into())?;
        drop(part);
        // Blocks (with checkpointing each keeps its input; the rest is dropped here).
        let mut saved = Vec::with_capacity(d.n_layer);
        for layer in 0..d.n_layer {
            let _part = memory_context_with(|| format!("forward block {layer}"));
            units.pre_forward(ops, Unit::Block(layer))?;
            self.hook_mark(units, false, || format!("unshard block {layer}"))?;
            let (out, a) = self.block_forward(units.block(layer)?, s, x)?;
            units.post_forward(ops, Unit::Block(layer))?;
            self.trace_mark(false, || format!("forward block {layer}"))?;
            saved.push(if self.checkpoint {
                Saved::Input(a.x)
            } else {
                Saved::Acts(a)
            });
            x = out;
        }
        // Head: ln_f, then the logits = hf·wteᵀ, the cross-entropy (mean over the n tokens)
        // and their backward chunk by chunk (the root's forward ends and its backward starts
        // before the first chunk: each chunk's backward follows its forward), then ln_f's
        // backward.
        let part = memory_context_with(|| "head".into());
        let root = units.root()?;
        let (hf, mean, rstd) = self.layernorm(&x, &root.ln_f, n)?;
        let tg = ops.upload_ids(targets)?;
        let mut losses = ops.empty(n)?;
        self.trace_mark(false, || "head forward (ln_f)".into())?;
        units.post_forward(ops, Unit::Root)?;
        units.pre_backward(ops, Unit::Root)?;
        let (root, grads) = units.root_grads()?;
        let head = HeadInputs {
            hf: &hf,
            wte: &root.wte,
            targets: &tg,
            n,
            scale,
        };
        let dhf = self.head(head, &mut losses, &mut grads.wte)?;
        self.trace_mark(true, || {
            "head (logits, cross-entropy and their backward)".into()
        })?;
        let mut dx = ops.zeros(n * e)?;
        ops.layernorm_backward_input(&dhf, &x, &root.ln_f.weight, &mean, &rstd, &mut dx)?;
        let gl = &mut grads.ln_f;
        ops.layernorm_backward_params(&dhf, &x, &mean, &rstd, &mut gl.weight, &mut gl.bias)?;
        self.trace_mark(true, || "head backward (ln_f)".into())?;
        drop(part);
        // Blocks backward, last first, each block's activations freed after its backward
        // (recomputed first from its input under checkpointing, the output dropped).
        while let Some(kept) = saved.pop() {
            let layer = saved.len();
            let _part = memory_context_with(|| format!("backward block {layer}"));
            units.pre_backward(ops, Unit::Block(layer))?;
            self.hook_mark(units, true, || {
                format!("unshard block {layer} for backward")
            })?;
            let a = match kept {
                Saved::Acts(a) => a,
                Saved::Input(input) => self.block_forward(units.block(layer)?, s, input)?.1,
            };
            let (bp, gp) = units.block_grads(layer)?;
            dx = self.block_backward(bp, gp, s, &a, dx)?;
            drop(a);
            let again = if self.checkpoint {
                " (its forward again first)"
            } else {
                ""
            };
            self.trace_mark(true, || format!("backward block {layer}{again}"))?;
            units.post_backward(ops, Unit::Block(layer))?;
            self.hook_mark(units, true, || format!("reduce block {layer}'s gradients"))?;
        }
        // Embeddings backward.
        let _part = memory_context_with(|| "embedding backward".into());
        let (_, grads) = units.root_grads()?;
        ops.embedding_backward_tokens(inputs, &dx, e, &mut grads.wte)?;
        ops.embedding_backward_positions(&dx, t, e, &mut grads.wpe)?;
        drop(dx);
        self.trace_mark(true, || "embedding backward".into())?;
        units.post_backward(ops, Unit::Root)?;
        self.hook_mark(units, true, || "reduce the root's gradients".into())?;
        Ok(losses)
    }

    /// `y = ln(x)` over `n` rows, with its mean and rstd: `y` as an operand (only products
    /// read a layer norm's output in the GPT).
    pub(super) fn layernorm(
        &self,
        x: &O::Buf,
        p: &Pair<O::Buf>,
        n: usize,
    ) -> Result<Normed<O>, KernelError> {
        let ops = &self.ops;
        let (mut mean, mut rstd) = (ops.empty(n)?, ops.empty(n)?);
        let y =
            ops.layernorm_forward_operand(x, &p.weight, &p.bias, LN_EPS, &mut mean, &mut rstd)?;
        Ok((y, mean, rstd))
    }

    /// `y = x·wᵀ + b` for `x: [n, inputs]`, `w: [outputs, inputs]`.
    pub(super) fn linear(
        &self,
        x: Arg<'_, O>,
        p: &Pair<O::Buf>,
        n: usize,
        inputs: usize,
        outputs: usize,
    ) -> Result<O::Buf, KernelError> {
        let mut y = self.ops.empty(n * outputs)?;
        let g = MatMul::linear_forward(n, inputs, outputs);
        self.ops.gemm_args(&g, x, Arg::Buf(&p.weight), &mut y)?;
        self.ops.bias_add(&mut y, &p.bias)?;
        Ok(y)
    }
}
