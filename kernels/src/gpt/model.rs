//! [`DeviceGpt`]: one training step's forward and backward over [`GptOps`].

use std::collections::HashMap;

use super::ops::GptOps;
use super::trace::Marks;
use super::weights::{invalid, Block, GptDims, Pair, Weights};
use crate::gemm::MatMul;
use crate::host::nn::HeadsLayout;
use crate::KernelError;

/// LayerNorm's epsilon (PyTorch's default, nanoGPT's).
const LN_EPS: f32 = 1e-5;

/// The GPT's parameters and gradients on a device, and its training step there.
pub struct DeviceGpt<O: GptOps> {
    ops: O,
    dims: GptDims,
    params: Weights<O::Buf>,
    grads: Weights<O::Buf>,
    checkpoint: bool,
    /// The marks of a traced step ([`set_tracing`](DeviceGpt::set_tracing)).
    pub(super) marks: Marks<O::Mark>,
}

/// What forward keeps of one block for backward: all its activations, or (activation
/// checkpointing) its input alone, from which backward runs the block's forward again.
enum Saved<B> {
    Acts(BlockActs<B>),
    Input(B),
}

/// The sizes of one step: `rows` sequences of `t` tokens, `n = rows·t`.
#[derive(Clone, Copy)]
struct Step {
    rows: usize,
    t: usize,
    n: usize,
}

/// A layer norm's output, mean and rstd.
type Normed<B> = (B, B, B);

/// What one block keeps from forward for backward.
struct BlockActs<B> {
    x: B,
    ln1_mean: B,
    ln1_rstd: B,
    h1: B,
    q: B,
    k: B,
    v: B,
    att: B,
    y: B,
    x2: B,
    ln2_mean: B,
    ln2_rstd: B,
    h2: B,
    fc: B,
    g: B,
}

impl<O: GptOps> DeviceGpt<O> {
    /// The model `dims` on `ops`' device with `params` (nanoGPT's names and shapes, see
    /// [`param_shapes`](super::param_shapes)) uploaded and zero gradients.
    ///
    /// # Errors
    /// Invalid `dims`, a parameter missing or of the wrong length; allocation and copy
    /// failures.
    pub fn new(
        ops: O,
        dims: GptDims,
        params: &HashMap<String, Vec<f32>>,
    ) -> Result<DeviceGpt<O>, KernelError> {
        dims.validate()?;
        let p = Weights::try_build(&dims, |name, len| match params.get(name) {
            None => Err(invalid(format!("parameter `{name}` is missing"))),
            Some(v) if v.len() != len => Err(invalid(format!(
                "parameter `{name}` has {} elements, expected {len}",
                v.len()
            ))),
            Some(v) => ops.upload(v),
        })?;
        let grads = Weights::try_build(&dims, |_, len| ops.zeros(len))?;
        Ok(DeviceGpt {
            ops,
            dims,
            params: p,
            grads,
            checkpoint: false,
            marks: Marks::default(),
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

    /// Whether [`step`](Self::step) checkpoints activations
    /// ([`set_activation_checkpointing`](Self::set_activation_checkpointing)).
    pub fn activation_checkpointing(&self) -> bool {
        self.checkpoint
    }

    /// The operations.
    pub fn ops(&self) -> &O {
        &self.ops
    }

    /// The model's shape.
    pub fn dims(&self) -> GptDims {
        self.dims
    }

    /// The parameters (device buffers).
    pub fn params(&self) -> &Weights<O::Buf> {
        &self.params
    }

    /// The gradients of the last [`step`](Self::step) (device buffers).
    pub fn grads(&self) -> &Weights<O::Buf> {
        &self.grads
    }

    /// The operations, the parameters (mutable: an optimizer updates them in place) and the
    /// gradients of the last [`step`](Self::step) (mutable: clipping may scale them in place;
    /// the next step overwrites them), at once.
    pub fn parts_mut(&mut self) -> (&O, &mut Weights<O::Buf>, &mut Weights<O::Buf>) {
        (&self.ops, &mut self.params, &mut self.grads)
    }

    /// Every parameter on the host, by name, in [`param_shapes`](super::param_shapes) order.
    ///
    /// # Errors
    /// Copy failures.
    pub fn download_params(&self) -> Result<Vec<(String, Vec<f32>)>, KernelError> {
        self.params
            .named()
            .into_iter()
            .map(|(name, b)| Ok((name, self.ops.download(b)?)))
            .collect()
    }

    /// Every gradient on the host, by name, in [`param_shapes`](super::param_shapes) order.
    ///
    /// # Errors
    /// Copy failures.
    pub fn download_grads(&self) -> Result<Vec<(String, Vec<f32>)>, KernelError> {
        self.grads
            .named()
            .into_iter()
            .map(|(name, b)| Ok((name, self.ops.download(b)?)))
            .collect()
    }

    /// One training step's forward and backward on `rows` sequences of `t` tokens (`inputs`
    /// and `targets` row after row): returns the mean cross-entropy over the `rows·t` tokens
    /// (summed on the host in f64: this waits for the device) and leaves every parameter's
    /// gradient (of that mean) in [`grads`](Self::grads), overwriting the previous step's.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward); a copy failure.
    pub fn step(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
    ) -> Result<f32, KernelError> {
        let n = rows * t;
        let losses = self.forward_backward(inputs, targets, rows, t)?;
        let losses = self.ops.download(&losses)?;
        let total: f64 = losses.iter().map(|&l| f64::from(l)).sum();
        Ok((total / n as f64) as f32)
    }

    /// [`step`](Self::step) without waiting: enqueues the forward and backward and returns
    /// the `rows·t` per-token losses on the device (whose mean is the step's loss:
    /// [`GptOps::loss_accumulate`] sums them there).
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] for `t` of 0 or past `block_size`, lengths other than
    /// `rows·t`, or an id or target not below `vocab_size` (checked before any work);
    /// operation failures.
    pub fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
    ) -> Result<O::Buf, KernelError> {
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
        let s = Step { rows, t, n };
        for g in self.grads.all_mut() {
            self.ops.fill_zero(g)?;
        }
        let (e, v) = (d.n_embd, d.vocab_size);
        let ops = &self.ops;
        // Embeddings.
        let ids = ops.upload_ids(inputs)?;
        let mut x = ops.empty(n * e)?;
        ops.embedding_forward(&ids, &self.params.wte, &self.params.wpe, t, e, &mut x)?;
        self.trace_mark(false, || "embedding forward".into())?;
        // Blocks (with checkpointing each keeps its input; the rest is dropped here).
        let mut saved = Vec::with_capacity(d.n_layer);
        for (layer, bp) in self.params.blocks.iter().enumerate() {
            let (out, a) = self.block_forward(bp, s, x)?;
            self.trace_mark(false, || format!("forward block {layer}"))?;
            saved.push(if self.checkpoint {
                Saved::Input(a.x)
            } else {
                Saved::Acts(a)
            });
            x = out;
        }
        // Head: ln_f, logits = hf·wteᵀ, cross-entropy (mean over the n tokens).
        let lnf = &self.params.ln_f;
        let (hf, mean, rstd) = self.layernorm(&x, lnf, n)?;
        let mut dlogits = ops.empty(n * v)?;
        ops.gemm(
            &MatMul::linear_forward(n, e, v),
            &hf,
            &self.params.wte,
            &mut dlogits,
        )?;
        // The logits' gradient written over the logits: the head holds one n × v buffer.
        let tg = ops.upload_ids(targets)?;
        let mut losses = ops.empty(n)?;
        let dloss = (1.0 / n as f64) as f32;
        ops.cross_entropy_fused_in_place(&mut dlogits, &tg, v, dloss, &mut losses)?;
        self.trace_mark(false, || {
            "head forward (ln_f, logits, cross-entropy)".into()
        })?;
        // Head backward: the tied lm_head's term of wte's gradient, then ln_f.
        let gw = MatMul::linear_grad_weight(n, e, v, true);
        ops.gemm(&gw, &dlogits, &hf, &mut self.grads.wte)?;
        let mut dhf = ops.empty(n * e)?;
        let gi = MatMul::linear_grad_input(n, e, v);
        ops.gemm(&gi, &dlogits, &self.params.wte, &mut dhf)?;
        drop(dlogits);
        let mut dx = ops.zeros(n * e)?;
        ops.layernorm_backward_input(&dhf, &x, &lnf.weight, &mean, &rstd, &mut dx)?;
        let gl = &mut self.grads.ln_f;
        ops.layernorm_backward_params(&dhf, &x, &mean, &rstd, &mut gl.weight, &mut gl.bias)?;
        self.trace_mark(true, || "head backward".into())?;
        // Blocks backward, last first, each block's activations freed after its backward
        // (recomputed first from its input under checkpointing, the output dropped).
        while let Some(kept) = saved.pop() {
            let layer = saved.len();
            let a = match kept {
                Saved::Acts(a) => a,
                Saved::Input(input) => self.block_forward(&self.params.blocks[layer], s, input)?.1,
            };
            dx = Self::block_backward(
                ops,
                &self.params.blocks[layer],
                &mut self.grads.blocks[layer],
                d,
                s,
                &a,
                dx,
            )?;
            let again = if self.checkpoint {
                " (its forward again first)"
            } else {
                ""
            };
            self.trace_mark(true, || format!("backward block {layer}{again}"))?;
        }
        // Embeddings backward.
        ops.embedding_backward_tokens(inputs, &dx, e, &mut self.grads.wte)?;
        ops.embedding_backward_positions(&dx, t, e, &mut self.grads.wpe)?;
        self.trace_mark(true, || "embedding backward".into())?;
        Ok(losses)
    }

    /// `y = ln(x)` over `n` rows, with its mean and rstd.
    fn layernorm(
        &self,
        x: &O::Buf,
        p: &Pair<O::Buf>,
        n: usize,
    ) -> Result<Normed<O::Buf>, KernelError> {
        let ops = &self.ops;
        let (mut y, mut mean, mut rstd) = (
            ops.empty(n * self.dims.n_embd)?,
            ops.empty(n)?,
            ops.empty(n)?,
        );
        ops.layernorm_forward(x, &p.weight, &p.bias, LN_EPS, &mut y, &mut mean, &mut rstd)?;
        Ok((y, mean, rstd))
    }

    /// `y = x·wᵀ + b` for `x: [n, inputs]`, `w: [outputs, inputs]`.
    fn linear(
        &self,
        x: &O::Buf,
        p: &Pair<O::Buf>,
        n: usize,
        inputs: usize,
        outputs: usize,
    ) -> Result<O::Buf, KernelError> {
        let mut y = self.ops.empty(n * outputs)?;
        let g = MatMul::linear_forward(n, inputs, outputs);
        self.ops.gemm(&g, x, &p.weight, &mut y)?;
        self.ops.bias_add(&mut y, &p.bias)?;
        Ok(y)
    }

    fn block_forward(
        &self,
        p: &Block<O::Buf>,
        s: Step,
        x: O::Buf,
    ) -> Result<(O::Buf, BlockActs<O::Buf>), KernelError> {
        let ops = &self.ops;
        let (e, hd, t, n) = (self.dims.n_embd, self.dims.head_dim(), s.t, s.n);
        let bh = s.rows * self.dims.n_head;
        let (h1, ln1_mean, ln1_rstd) = self.layernorm(&x, &p.ln_1, n)?;
        let qkv = self.linear(&h1, &p.c_attn, n, e, 3 * e)?;
        let mut parts = Vec::with_capacity(3);
        for part in 0..3 {
            let mut h = ops.empty(n * e)?;
            ops.heads_split(&qkv, self.heads(s, 3 * e, part * e), &mut h)?;
            parts.push(h);
        }
        drop(qkv);
        let (v, k, q) = (parts.pop(), parts.pop(), parts.pop());
        let (q, k, v) = match (q, k, v) {
            (Some(q), Some(k), Some(v)) => (q, k, v),
            _ => return Err(invalid("q, k and v were not all split".into())),
        };
        // Scores S = q·kᵀ per (sequence, head); P = causal softmax of S/√hd.
        let mut sc = ops.empty(bh * t * t)?;
        let g = MatMul::new(t, t, hd, false, true).batched(bh, t * hd, t * hd, t * t);
        ops.gemm(&g, &q, &k, &mut sc)?;
        let mut att = ops.empty(bh * t * t)?;
        ops.causal_softmax_forward(&sc, t, self.scale(), &mut att)?;
        drop(sc);
        // Heads' outputs P·v, back into token rows.
        let mut yh = ops.empty(n * e)?;
        let g = MatMul::new(t, hd, t, false, false).batched(bh, t * t, t * hd, t * hd);
        ops.gemm(&g, &att, &v, &mut yh)?;
        let mut y = ops.empty(n * e)?;
        ops.heads_merge(&yh, self.heads(s, e, 0), &mut y)?;
        drop(yh);
        // x2 = x + c_proj(y).
        let mut x2 = self.linear(&y, &p.attn_proj, n, e, e)?;
        ops.axpby(1.0, &x, 1.0, &mut x2)?;
        // out = x2 + c_proj(gelu(c_fc(ln_2(x2)))).
        let (h2, ln2_mean, ln2_rstd) = self.layernorm(&x2, &p.ln_2, n)?;
        let fc = self.linear(&h2, &p.c_fc, n, e, 4 * e)?;
        let mut g = ops.empty(n * 4 * e)?;
        ops.gelu_forward(&fc, &mut g)?;
        let mut out = self.linear(&g, &p.mlp_proj, n, 4 * e, e)?;
        ops.axpby(1.0, &x2, 1.0, &mut out)?;
        let acts = BlockActs {
            x,
            ln1_mean,
            ln1_rstd,
            h1,
            q,
            k,
            v,
            att,
            y,
            x2,
            ln2_mean,
            ln2_rstd,
            h2,
            fc,
            g,
        };
        Ok((out, acts))
    }

    /// The heads of `s` in rows of `row` elements from column `offset`.
    fn heads(&self, s: Step, row: usize, offset: usize) -> HeadsLayout {
        HeadsLayout {
            b: s.rows,
            t: s.t,
            h: self.dims.n_head,
            d: self.dims.head_dim(),
            row,
            offset,
        }
    }

    /// The scores' scale, `1/√head_dim`.
    fn scale(&self) -> f32 {
        (1.0 / (self.dims.head_dim() as f64).sqrt()) as f32
    }

    /// The input gradient of `y = x·wᵀ + b` from `dy`, adding the weight's and bias's
    /// gradients into `gp`.
    #[allow(clippy::too_many_arguments)]
    fn linear_backward(
        ops: &O,
        p: &Pair<O::Buf>,
        gp: &mut Pair<O::Buf>,
        x: &O::Buf,
        dy: &O::Buf,
        n: usize,
        inputs: usize,
        outputs: usize,
    ) -> Result<O::Buf, KernelError> {
        let gw = MatMul::linear_grad_weight(n, inputs, outputs, true);
        ops.gemm(&gw, dy, x, &mut gp.weight)?;
        ops.bias_grad(dy, &mut gp.bias)?;
        let mut dx = ops.empty(n * inputs)?;
        ops.gemm(
            &MatMul::linear_grad_input(n, inputs, outputs),
            dy,
            &p.weight,
            &mut dx,
        )?;
        Ok(dx)
    }

    /// One block's backward from `dout` (the gradient of its output, consumed): adds its
    /// parameters' gradients into `gp` and returns the gradient of its input.
    fn block_backward(
        ops: &O,
        p: &Block<O::Buf>,
        gp: &mut Block<O::Buf>,
        d: GptDims,
        s: Step,
        a: &BlockActs<O::Buf>,
        dout: O::Buf,
    ) -> Result<O::Buf, KernelError> {
        let (e, hd, t, n) = (d.n_embd, d.head_dim(), s.t, s.n);
        let bh = s.rows * d.n_head;
        let heads = |row: usize, offset: usize| HeadsLayout {
            b: s.rows,
            t,
            h: d.n_head,
            d: hd,
            row,
            offset,
        };
        // MLP: out = x2 + c_proj(gelu(c_fc(h2))).
        let dg =
            Self::linear_backward(ops, &p.mlp_proj, &mut gp.mlp_proj, &a.g, &dout, n, 4 * e, e)?;
        let mut dfc = ops.empty(n * 4 * e)?;
        ops.gelu_backward(&a.fc, &dg, &mut dfc)?;
        drop(dg);
        let dh2 = Self::linear_backward(ops, &p.c_fc, &mut gp.c_fc, &a.h2, &dfc, n, e, 4 * e)?;
        drop(dfc);
        let mut dx2 = dout;
        ops.layernorm_backward_input(
            &dh2,
            &a.x2,
            &p.ln_2.weight,
            &a.ln2_mean,
            &a.ln2_rstd,
            &mut dx2,
        )?;
        let g2 = &mut gp.ln_2;
        ops.layernorm_backward_params(
            &dh2,
            &a.x2,
            &a.ln2_mean,
            &a.ln2_rstd,
            &mut g2.weight,
            &mut g2.bias,
        )?;
        drop(dh2);
        // Attention: x2 = x + c_proj(merge(P·v)).
        let dy = Self::linear_backward(ops, &p.attn_proj, &mut gp.attn_proj, &a.y, &dx2, n, e, e)?;
        let mut dyh = ops.empty(n * e)?;
        ops.heads_split(&dy, heads(e, 0), &mut dyh)?;
        drop(dy);
        let per =
            |m, nn, k, ta, tb, sa, sb, sc| MatMul::new(m, nn, k, ta, tb).batched(bh, sa, sb, sc);
        // dP = dYh·vᵀ, dv = Pᵀ·dYh.
        let mut dp = ops.empty(bh * t * t)?;
        ops.gemm(
            &per(t, t, hd, false, true, t * hd, t * hd, t * t),
            &dyh,
            &a.v,
            &mut dp,
        )?;
        let mut dv = ops.empty(n * e)?;
        ops.gemm(
            &per(t, hd, t, true, false, t * t, t * hd, t * hd),
            &a.att,
            &dyh,
            &mut dv,
        )?;
        drop(dyh);
        // dS (of the unscaled scores) = scale·P⊙(dP − rowsum(P⊙dP)).
        let scale = (1.0 / (hd as f64).sqrt()) as f32;
        let mut ds = ops.empty(bh * t * t)?;
        ops.causal_softmax_backward(&a.att, &dp, t, scale, &mut ds)?;
        drop(dp);
        // dq = dS·k, dk = dSᵀ·q.
        let mut dq = ops.empty(n * e)?;
        ops.gemm(
            &per(t, hd, t, false, false, t * t, t * hd, t * hd),
            &ds,
            &a.k,
            &mut dq,
        )?;
        let mut dk = ops.empty(n * e)?;
        ops.gemm(
            &per(t, hd, t, true, false, t * t, t * hd, t * hd),
            &ds,
            &a.q,
            &mut dk,
        )?;
        drop(ds);
        let mut dqkv = ops.empty(n * 3 * e)?;
        for (part, dh) in [dq, dk, dv].iter().enumerate() {
            ops.heads_merge(dh, heads(3 * e, part * e), &mut dqkv)?;
        }
        let dh1 = Self::linear_backward(ops, &p.c_attn, &mut gp.c_attn, &a.h1, &dqkv, n, e, 3 * e)?;
        drop(dqkv);
        let mut dx = dx2;
        ops.layernorm_backward_input(
            &dh1,
            &a.x,
            &p.ln_1.weight,
            &a.ln1_mean,
            &a.ln1_rstd,
            &mut dx,
        )?;
        let g1 = &mut gp.ln_1;
        ops.layernorm_backward_params(
            &dh1,
            &a.x,
            &a.ln1_mean,
            &a.ln1_rstd,
            &mut g1.weight,
            &mut g1.bias,
        )?;
        Ok(dx)
    }
}
