//! One transformer block's forward and backward, for [`GptPass`].

use super::ops::{Arg, GptOps};
use super::pass::{BlockActs, GptPass, Step};
use super::weights::{invalid, Block, Pair};
use super::written::Written;
use crate::gemm::MatMul;
use crate::host::nn::HeadsLayout;
use crate::KernelError;

impl<O: GptOps> GptPass<O> {
    pub(super) fn block_forward(
        &self,
        p: &Block<O::Buf>,
        s: Step,
        x: O::Buf,
    ) -> Result<(O::Buf, BlockActs<O>), KernelError> {
        let ops = &self.ops;
        let (e, n) = (self.dims.n_embd, s.n);
        // The activations that only products read (h1, q, k, v, y, h2, gelu's output) are
        // kept as operands: in bf16 under bf16 products, which round them anyway.
        let (h1, ln1_mean, ln1_rstd) = self.layernorm(&x, &p.ln_1, n)?;
        let qkv = self.linear(Arg::Operand(&h1), &p.c_attn, n, e, 3 * e)?;
        let mut parts = Vec::with_capacity(3);
        for part in 0..3 {
            let layout = self.heads(s, 3 * e, part * e);
            parts.push(ops.write_operand(Written::HeadsSplit(&qkv, layout))?);
        }
        drop(qkv);
        let (v, k, q) = (parts.pop(), parts.pop(), parts.pop());
        let (q, k, v) = match (q, k, v) {
            (Some(q), Some(k), Some(v)) => (q, k, v),
            _ => return Err(invalid("q, k and v were not all split".into())),
        };
        // Heads' outputs P·v (P = causal softmax(q·kᵀ/√hd)), back into token rows.
        let (yh, att) = self.attention_forward(s, &q, &k, &v)?;
        let y = ops.write_operand(Written::HeadsMerge(&yh, self.heads(s, e, 0)))?;
        drop(yh);
        // x2 = x + c_proj(y).
        let mut x2 = self.linear(Arg::Operand(&y), &p.attn_proj, n, e, e)?;
        ops.axpby(1.0, &x, 1.0, &mut x2)?;
        // out = x2 + c_proj(gelu(c_fc(ln_2(x2)))).
        let (h2, ln2_mean, ln2_rstd) = self.layernorm(&x2, &p.ln_2, n)?;
        let fc = self.linear(Arg::Operand(&h2), &p.c_fc, n, e, 4 * e)?;
        let g = ops.write_operand(Written::Gelu(&fc))?;
        let mut out = self.linear(Arg::Operand(&g), &p.mlp_proj, n, 4 * e, e)?;
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
    pub(super) fn heads(&self, s: Step, row: usize, offset: usize) -> HeadsLayout {
        HeadsLayout {
            b: s.rows,
            t: s.t,
            h: self.dims.n_head,
            d: self.dims.head_dim(),
            row,
            offset,
        }
    }

    /// The input gradient of `y = x·wᵀ + b` from `dy`, adding the weight's and bias's
    /// gradients into `gp`.
    #[allow(clippy::too_many_arguments)]
    fn linear_backward(
        ops: &O,
        p: &Pair<O::Buf>,
        gp: &mut Pair<O::Buf>,
        x: Arg<'_, O>,
        dy: &O::Buf,
        n: usize,
        inputs: usize,
        outputs: usize,
    ) -> Result<O::Buf, KernelError> {
        let gw = MatMul::linear_grad_weight(n, inputs, outputs, true);
        ops.gemm_args(&gw, Arg::Buf(dy), x, &mut gp.weight)?;
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
        a: &BlockActs<O>,
        dout: O::Buf,
    ) -> Result<O::Buf, KernelError> {
        let (ops, d) = (&self.ops, self.dims);
        let (e, hd, t, n) = (d.n_embd, d.head_dim(), s.t, s.n);
        let heads = |row: usize, offset: usize| HeadsLayout {
            b: s.rows,
            t,
            h: d.n_head,
            d: hd,
            row,
            offset,
        };
        // MLP: out = x2 + c_proj(gelu(c_fc(h2))).
        let dg = Self::linear_backward(
            ops,
            &p.mlp_proj,
            &mut gp.mlp_proj,
            op(&a.g),
            &dout,
            n,
            4 * e,
            e,
        )?;
        let mut dfc = ops.empty(n * 4 * e)?;
        ops.gelu_backward(&a.fc, &dg, &mut dfc)?;
        drop(dg);
        let dh2 = Self::linear_backward(ops, &p.c_fc, &mut gp.c_fc, op(&a.h2), &dfc, n, e, 4 * e)?;
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
        let dy = Self::linear_backward(
            ops,
            &p.attn_proj,
            &mut gp.attn_proj,
            op(&a.y),
            &dx2,
            n,
            e,
            e,
        )?;
        // The heads' output gradient: read by the products dP = dYh·vᵀ and dv = Pᵀ·dYh alone.
        let dyh = ops.write_operand(Written::HeadsSplit(&dy, heads(e, 0)))?;
        drop(dy);
        // dP = dYh·vᵀ, dv = Pᵀ·dYh, dS = scale·P⊙(dP − rowsum(P⊙dP)), dq = dS·k, dk = dSᵀ·q
        // (fused: rowsum(P⊙dP) = rowsum(dYh⊙y), from the merged output y).
        let [dq, dk, dv] =
            self.attention_backward(s, [&a.q, &a.k, &a.v, &a.y], a.att.as_ref(), dyh)?;
        let mut dqkv = ops.empty(n * 3 * e)?;
        for (part, dh) in [dq, dk, dv].iter().enumerate() {
            ops.heads_merge(dh, heads(3 * e, part * e), &mut dqkv)?;
        }
        let dh1 = Self::linear_backward(
            ops,
            &p.c_attn,
            &mut gp.c_attn,
            op(&a.h1),
            &dqkv,
            n,
            e,
            3 * e,
        )?;
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

/// A kept activation as a product's operand.
fn op<O: GptOps>(a: &O::Operand) -> Arg<'_, O> {
    Arg::Operand(a)
}
