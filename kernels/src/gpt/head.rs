//! The head's logits, cross-entropy and their backward for [`GptPass`], over chunks of tokens
//! ([`Logits::Chunked`]) or all tokens at once ([`Logits::Whole`]).

use super::chunks::{chunk_items, parse_chunked, write_chunked};
use super::ops::{Arg, GptOps};
use super::pass::GptPass;
use crate::gemm::MatMul;
use crate::KernelError;

/// How the head holds its `tokens × vocabulary` logits (f32; the cross-entropy writes their
/// gradient over them).
///
/// Each token's logits, loss and input gradient are the same bits either way (each row is its
/// own products and its own cross-entropy); the tied weight's gradient `Σ dlogitsᵀ·hf` is
/// summed chunk by chunk (each chunk's product added to the sum so far), so it differs from
/// the sum over all tokens at once by the f32 rounding of that order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Logits {
    /// Every token's logits at once (`tokens × vocabulary` f32).
    Whole,
    /// The logits of chunks of tokens whose logits take at most `max_bytes` (at least one
    /// token a chunk): each chunk's logits, cross-entropy, input gradient and weight gradient
    /// before the next chunk's.
    Chunked {
        /// The most bytes of one chunk's logits.
        max_bytes: usize,
    },
}

impl Default for Logits {
    /// [`Logits::Chunked`] of [`Logits::CHUNK_BYTES`].
    fn default() -> Logits {
        Logits::Chunked {
            max_bytes: Logits::CHUNK_BYTES,
        }
    }
}

impl std::str::FromStr for Logits {
    type Err = String;

    /// `chunked` ([`Logits::default`]), `chunked:N` (chunks of at most N MiB of logits) or
    /// `whole`.
    fn from_str(s: &str) -> Result<Logits, String> {
        if let Some(max_bytes) = parse_chunked(s, Logits::CHUNK_BYTES) {
            return max_bytes.map(|max_bytes| Logits::Chunked { max_bytes });
        }
        match s {
            "whole" => Ok(Logits::Whole),
            _ => Err(format!(
                "unknown logits {s:?} (expected chunked, chunked:MiB or whole)"
            )),
        }
    }
}

impl std::fmt::Display for Logits {
    /// `whole`, or `chunked (N MiB)` (bytes when not whole MiB).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Logits::Whole => f.write_str("whole"),
            Logits::Chunked { max_bytes } => write_chunked(f, max_bytes),
        }
    }
}

impl Logits {
    /// The default chunk's bytes of logits: 256 MiB, 1334 tokens of GPT-2's 50304-entry
    /// vocabulary.
    pub const CHUNK_BYTES: usize = 256 << 20;

    /// The tokens of one chunk, out of `tokens`, for a vocabulary of `v` (all of them when
    /// whole).
    pub fn chunk_tokens(&self, v: usize, tokens: usize) -> usize {
        match *self {
            Logits::Whole => tokens,
            Logits::Chunked { max_bytes } => chunk_items(max_bytes, v, tokens),
        }
    }
}

/// The head's inputs: `ln_f`'s output `hf` (`[n, E]`), the tied `wte` (`[v, E]`), the targets
/// on the device, and a grad scaler's scalars.
pub(super) struct HeadInputs<'a, O: GptOps> {
    pub(super) hf: &'a O::Operand,
    pub(super) wte: &'a O::Buf,
    pub(super) targets: &'a O::Ids,
    pub(super) n: usize,
    /// A grad scaler's step scalars, whose loss scale multiplies the gradient's seed.
    pub(super) scale: Option<&'a O::Scalars>,
}

impl<O: GptOps> GptPass<O> {
    /// The logits `hf·wteᵀ`, the per-token cross-entropy into `losses` (`[n]`, scaled by
    /// `1/n` in the gradient) and their backward: returns `hf`'s gradient (`[n, E]`) and adds
    /// the tied head's term into `dwte`. Chunk by chunk when [`Logits::Chunked`].
    pub(super) fn head(
        &self,
        h: HeadInputs<'_, O>,
        losses: &mut O::Buf,
        dwte: &mut O::Buf,
    ) -> Result<O::Buf, KernelError> {
        let ops = &self.ops;
        let (e, v, n) = (self.dims.n_embd, self.dims.vocab_size, h.n);
        let dloss = (1.0 / n as f64) as f32;
        let mut dhf = ops.empty(n * e)?;
        let each = self.logits.chunk_tokens(v, n);
        for first in (0..n).step_by(each) {
            let rows = each.min(n - first);
            let mut logits = ops.empty(rows * v)?;
            let at = first * e;
            let g = MatMul::linear_forward(rows, e, v).at(at, 0, 0);
            ops.gemm_args(&g, Arg::Operand(h.hf), Arg::Buf(h.wte), &mut logits)?;
            // The logits' gradient, an operand of the two products below alone: with bf16
            // products written in bf16 by the cross-entropy itself (the logits then freed), else
            // over the logits.
            let (tg, sc) = (h.targets, h.scale);
            let dlogits =
                ops.cross_entropy_fused_operand(logits, tg, first, v, dloss, sc, losses)?;
            // dhf's rows, then the tied weight's term.
            let gi = MatMul::linear_grad_input(rows, e, v).at(0, 0, at);
            ops.gemm_args(&gi, Arg::Operand(&dlogits), Arg::Buf(h.wte), &mut dhf)?;
            let gw = MatMul::linear_grad_weight(rows, e, v, true).at(0, at, 0);
            ops.gemm_args(&gw, Arg::Operand(&dlogits), Arg::Operand(h.hf), dwte)?;
        }
        Ok(dhf)
    }
}
