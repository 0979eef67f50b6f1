//! The blocks' causal self-attention, forward and backward, for [`GptPass`]: over every
//! (sequence, head) at once with the probabilities kept for backward
//! ([`Attention::Materialized`]), over chunks of them with nothing of `t × t` kept
//! ([`Attention::Chunked`]), or fused into tiles, nothing of `t × t` ever stored
//! ([`Attention::Fused`]).

use super::chunks::{chunk_items, parse_chunked, write_chunked};
use super::ops::{Arg, GptOps};
use super::pass::{GptPass, Step};
use super::weights::invalid;
use super::written::Written;
use crate::gemm::MatMul;
use crate::host::attention::FusedAttention;
use crate::KernelError;

/// How the blocks' attention holds its `t × t` scores and probabilities (each (sequence,
/// head) pair of a micro-batch has one `t × t` matrix of each, f32).
///
/// Both give the same bits on the kernels' twins: every (sequence, head) pair is its own
/// product and softmax, so splitting them into chunks changes no sum's order, and the
/// probabilities computed again in backward are those of forward (the same operations on the
/// same inputs). cuBLAS may choose another algorithm for a smaller batch, so on a GPU the two
/// agree within the products' rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Attention {
    /// Every pair at once; each block keeps its probabilities from forward for backward
    /// (`rows·heads·t²` f32 a block, PyTorch's "math" attention).
    Materialized,
    /// Pairs in chunks whose scores take at most `max_bytes` (at least one pair a chunk);
    /// forward keeps nothing of `t × t`, and backward computes each chunk's scores and
    /// probabilities again from `q` and `k` (flash attention's recomputation, with the
    /// products still cuBLAS's). A block holds one chunk's matrices at a time: three in
    /// backward (the probabilities, their gradient, the scores' gradient).
    Chunked {
        /// The most bytes of one chunk's scores.
        max_bytes: usize,
    },
    /// Flash attention: each pair's scores, softmax and products fused into tiles
    /// ([`GptOps::attention_fused_forward`]; on CUDA tensor cores, one kernel forward and
    /// three backward), nothing of `t × t` stored. Forward keeps each row's log-sum-exp
    /// (`rows·heads·t` f32 a block); backward computes the probabilities again tile by tile.
    /// It reads 16-bit operands: bf16 or f16 products only; on CUDA heads of 32 or 64 values
    /// (GPT-2's) and compute capability 8.0 or newer.
    Fused,
}

impl Default for Attention {
    /// [`Attention::Chunked`] of [`Attention::CHUNK_BYTES`].
    fn default() -> Attention {
        Attention::Chunked {
            max_bytes: Attention::CHUNK_BYTES,
        }
    }
}

impl std::str::FromStr for Attention {
    type Err = String;

    /// `chunked` ([`Attention::default`]), `chunked:N` (chunks of at most N MiB of scores),
    /// `materialized` or `fused`.
    fn from_str(s: &str) -> Result<Attention, String> {
        if let Some(max_bytes) = parse_chunked(s, Attention::CHUNK_BYTES) {
            return max_bytes.map(|max_bytes| Attention::Chunked { max_bytes });
        }
        match s {
            "materialized" => Ok(Attention::Materialized),
            "fused" => Ok(Attention::Fused),
            _ => Err(format!(
                "unknown attention {s:?} (expected chunked, chunked:MiB, materialized or fused)"
            )),
        }
    }
}

impl std::fmt::Display for Attention {
    /// `materialized`, `fused`, or `chunked (N MiB)` (bytes when not whole MiB).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Attention::Materialized => f.write_str("materialized"),
            Attention::Fused => f.write_str("fused"),
            Attention::Chunked { max_bytes } => write_chunked(f, max_bytes),
        }
    }
}

impl Attention {
    /// The default chunk's bytes of scores: 64 MiB, 16 (sequence, head) pairs at 1024 tokens.
    pub const CHUNK_BYTES: usize = 64 << 20;

    /// The (sequence, head) pairs of one chunk for sequences of `t` tokens, out of `pairs`
    /// (all of them when materialized or fused).
    pub fn chunk_pairs(&self, t: usize, pairs: usize) -> usize {
        match *self {
            Attention::Materialized | Attention::Fused => pairs,
            Attention::Chunked { max_bytes } => chunk_items(max_bytes, t.saturating_mul(t), pairs),
        }
    }

    /// Whether forward keeps the probabilities for backward.
    pub fn keeps_probabilities(&self) -> bool {
        *self == Attention::Materialized
    }

    /// Whether the attention reads 16-bit operands alone (bf16 or f16 products): fused.
    pub fn needs_half_products(&self) -> bool {
        *self == Attention::Fused
    }
}

impl<O: GptOps> GptPass<O> {
    /// The causal attention of `q`, `k`, `v` (each `[pairs, t, hd]`) into `[pairs, t, hd]`,
    /// and what backward needs kept: the probabilities when [`Attention::Materialized`], the
    /// rows' log-sum-exp when [`Attention::Fused`].
    pub(super) fn attention_forward(
        &self,
        s: Step,
        q: &O::Operand,
        k: &O::Operand,
        v: &O::Operand,
    ) -> Result<(O::Buf, Option<O::Buf>), KernelError> {
        let (ops, hd, t) = (&self.ops, self.dims.head_dim(), s.t);
        let ne = s.n * self.dims.n_embd;
        if self.attention == Attention::Fused {
            let a = self.fused(s);
            let (mut yh, mut lse) = (ops.empty(a.len())?, ops.empty(a.rows())?);
            ops.attention_fused_forward(&a, [q, k, v], &mut yh, &mut lse)?;
            return Ok((yh, Some(lse)));
        }
        if self.attention.keeps_probabilities() {
            // Kept in f32 for backward; the product casts them into its kept copy, which
            // backward's `dv` product needs at this size anyway (a rounding written beside
            // them would add its bytes to the peak).
            let pairs = s.rows * self.dims.n_head;
            let sc = self.scores(s, q, k, 0, pairs)?;
            let mut att = ops.empty(pairs * t * t)?;
            ops.causal_softmax_forward(&sc, t, self.scale(), &mut att)?;
            drop(sc);
            let mut yh = ops.empty(ne)?;
            let g = heads_product(t, hd, pairs, 0, false);
            ops.gemm_args(&g, Arg::Buf(&att), Arg::Operand(v), &mut yh)?;
            return Ok((yh, Some(att)));
        }
        let mut yh = ops.empty(ne)?;
        for (first, count) in self.chunks(s) {
            // Only the product reads these probabilities: written as its operand.
            let sc = self.scores(s, q, k, first, count)?;
            let att = ops.write_operand(Written::CausalSoftmax {
                scores: &sc,
                t,
                scale: self.scale(),
            })?;
            drop(sc);
            let g = heads_product(t, hd, count, first * t * hd, false);
            ops.gemm_args(&g, Arg::Operand(&att), Arg::Operand(v), &mut yh)?;
        }
        Ok((yh, None))
    }

    /// The gradients `[dq, dk, dv]` (each `[pairs, t, hd]`) from the heads' output gradient
    /// `dyh` (consumed), with what forward kept, `att`: the probabilities when materialized
    /// (else computed again, chunk by chunk), the rows' log-sum-exp when fused (which also
    /// reads forward's output `y`, the projection's operand).
    pub(super) fn attention_backward(
        &self,
        s: Step,
        [q, k, v, y]: [&O::Operand; 4],
        att: Option<&O::Buf>,
        dyh: O::Operand,
    ) -> Result<[O::Buf; 3], KernelError> {
        let (ops, hd, t) = (&self.ops, self.dims.head_dim(), s.t);
        let ne = s.n * self.dims.n_embd;
        if self.attention == Attention::Fused {
            let lse = att.ok_or_else(|| {
                invalid("the fused attention's backward without forward's log-sum-exp".into())
            })?;
            let layout = self.heads(s, self.dims.n_embd, 0);
            let a = FusedAttention::of(&layout, self.scale());
            let (mut dq, mut dk, mut dv) = (ops.empty(ne)?, ops.empty(ne)?, ops.empty(ne)?);
            let grads = [&mut dq, &mut dk, &mut dv];
            ops.attention_fused_backward(&a, layout, [q, k, v, y, &dyh], lse, grads)?;
            return Ok([dq, dk, dv]);
        }
        if let Some(att) = att {
            let pairs = O::buf_len(att) / (t * t);
            let dp = self.dprobs(s, &dyh, v, 0, pairs)?;
            let mut dv = ops.empty(ne)?;
            let g = heads_product(t, hd, pairs, 0, true);
            ops.gemm_args(&g, Arg::Buf(att), Arg::Operand(&dyh), &mut dv)?;
            drop(dyh);
            let ds = self.dscores(att, dp, t)?;
            let mut dq = ops.empty(ne)?;
            let g = heads_product(t, hd, pairs, 0, false);
            ops.gemm_args(&g, Arg::Operand(&ds), Arg::Operand(k), &mut dq)?;
            let mut dk = ops.empty(ne)?;
            let g = heads_product(t, hd, pairs, 0, true);
            ops.gemm_args(&g, Arg::Operand(&ds), Arg::Operand(q), &mut dk)?;
            return Ok([dq, dk, dv]);
        }
        let (mut dq, mut dk, mut dv) = (ops.empty(ne)?, ops.empty(ne)?, ops.empty(ne)?);
        for (first, count) in self.chunks(s) {
            let at = first * t * hd;
            let (att, rounded) = self.probabilities(s, q, k, first, count)?;
            let dp = self.dprobs(s, &dyh, v, first, count)?;
            let g = heads_product(t, hd, count, at, true);
            ops.gemm_args(&g, probs_arg(&att, &rounded), Arg::Operand(&dyh), &mut dv)?;
            drop(rounded);
            let ds = self.dscores(&att, dp, t)?;
            drop(att);
            let g = heads_product(t, hd, count, at, false);
            ops.gemm_args(&g, Arg::Operand(&ds), Arg::Operand(k), &mut dq)?;
            let g = heads_product(t, hd, count, at, true);
            ops.gemm_args(&g, Arg::Operand(&ds), Arg::Operand(q), &mut dk)?;
        }
        Ok([dq, dk, dv])
    }

    /// The chunks of a step's (sequence, head) pairs: `(first, count)`, the largest first.
    fn chunks(&self, s: Step) -> impl Iterator<Item = (usize, usize)> {
        let pairs = s.rows * self.dims.n_head;
        let each = self.attention.chunk_pairs(s.t, pairs);
        (0..pairs)
            .step_by(each)
            .map(move |first| (first, each.min(pairs - first)))
    }

    /// `P = causal softmax(q·kᵀ/√hd)` of `count` pairs from pair `first`, `[count, t, t]`, and
    /// with bf16 products its rounding for the product that reads it (written in the same
    /// pass: [`GptOps::causal_softmax_forward_with_operand`]): a chunk's, in backward.
    fn probabilities(
        &self,
        s: Step,
        q: &O::Operand,
        k: &O::Operand,
        first: usize,
        count: usize,
    ) -> Result<(O::Buf, Option<O::Operand>), KernelError> {
        let sc = self.scores(s, q, k, first, count)?;
        let mut att = self.ops.empty(count * s.t * s.t)?;
        let rounded =
            self.ops
                .causal_softmax_forward_with_operand(&sc, s.t, self.scale(), &mut att)?;
        Ok((att, rounded))
    }

    /// The scores `q·kᵀ` (unscaled) of `count` pairs from pair `first`, `[count, t, t]`.
    fn scores(
        &self,
        s: Step,
        q: &O::Operand,
        k: &O::Operand,
        first: usize,
        count: usize,
    ) -> Result<O::Buf, KernelError> {
        let t = s.t;
        let mut sc = self.ops.empty(count * t * t)?;
        let g = self.scores_product(t, first, count);
        self.ops
            .gemm_args(&g, Arg::Operand(q), Arg::Operand(k), &mut sc)?;
        Ok(sc)
    }

    /// `dP = dYh·vᵀ` of `count` pairs from pair `first`, `[count, t, t]`.
    fn dprobs(
        &self,
        s: Step,
        dyh: &O::Operand,
        v: &O::Operand,
        first: usize,
        count: usize,
    ) -> Result<O::Buf, KernelError> {
        let mut dp = self.ops.empty(count * s.t * s.t)?;
        let g = self.scores_product(s.t, first, count);
        self.ops
            .gemm_args(&g, Arg::Operand(dyh), Arg::Operand(v), &mut dp)?;
        Ok(dp)
    }

    /// `A·Bᵀ` of `count` pairs from pair `first` (`A`, `B` `[pairs, t, hd]`) into
    /// `[count, t, t]`: the scores `q·kᵀ`, the probabilities' gradient `dYh·vᵀ`.
    fn scores_product(&self, t: usize, first: usize, count: usize) -> MatMul {
        let hd = self.dims.head_dim();
        let at = first * t * hd;
        MatMul::new(t, t, hd, false, true)
            .batched(count, t * hd, t * hd, t * t)
            .at(at, at, 0)
    }

    /// `dS = scale·P⊙(dP − rowsum(P⊙dP))` (of the unscaled scores), `dP` consumed: an operand
    /// of the products `dq` and `dk` alone read.
    fn dscores(&self, att: &O::Buf, dp: O::Buf, t: usize) -> Result<O::Operand, KernelError> {
        self.ops.write_operand(Written::CausalSoftmaxBackward {
            probs: att,
            dprobs: &dp,
            t,
            scale: self.scale(),
        })
    }

    /// The fused attention of a step's heads.
    fn fused(&self, s: Step) -> FusedAttention {
        FusedAttention::of(&self.heads(s, self.dims.n_embd, 0), self.scale())
    }

    /// The scores' scale, `1/√head_dim`.
    pub(super) fn scale(&self) -> f32 {
        (1.0 / (self.dims.head_dim() as f64).sqrt()) as f32
    }
}

/// The probabilities as a product reads them: their rounding when one was written, else the
/// buffer.
fn probs_arg<'a, O: GptOps>(att: &'a O::Buf, rounded: &'a Option<O::Operand>) -> Arg<'a, O> {
    match rounded {
        Some(r) => Arg::Operand(r),
        None => Arg::Buf(att),
    }
}

/// `M·X` of `count` pairs, `M` `[count, t, t]` (transposed when `trans`) and `X`, the result
/// `[pairs, t, hd]` read and written from element `at`: the heads' outputs `P·v`, and in
/// backward `dv = Pᵀ·dYh`, `dq = dS·k`, `dk = dSᵀ·q`.
fn heads_product(t: usize, hd: usize, count: usize, at: usize, trans: bool) -> MatMul {
    MatMul::new(t, hd, t, trans, false)
        .batched(count, t * t, t * hd, t * hd)
        .at(0, at, at)
}
