//! One transformer block's forward and backward, for [`GptPass`].

use super::ops::GptOps;
use super::pass::{BlockActs, GptPass, Step};
use super::weights::{invalid, Block, Pair};
use crate::gemm::MatMul;
use crate::host::nn::HeadsLayout;
use crate::KernelError;

impl<O: GptOps> GptPass<O> {
    pub(super) fn block_forward(
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
    pub(super) fn block_backward(
        &self,
        p: &Block<O::Buf>,
        gp: &mut Block<O::Buf>,
        s: Step,
        a: &BlockActs<O::Buf>,
        dout: O::Buf,
    ) -> Result<O::Buf, KernelError> {
        let (ops, d) = (&self.ops, self.dims);
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
