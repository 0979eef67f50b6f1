//! [`HostOps`]: [`GptOps`] on the host by the kernels' twins.

use std::sync::atomic::Ordering;

use super::fused_ops;
use super::memory::{Counted, MemoryEvent, MemoryUse};
use super::ops::{loss_rows, Arg, GptOps};
use super::products::{gemm_f32, gemm_f64_rounded, HostProducts};
use super::written::{self, Written};
use crate::gemm::MatMul;
use crate::host::attention::FusedAttention;
use crate::host::nn::{self, HeadsLayout};
use crate::host::{
    self, same_len, scaled_seed, AdamWChoice, AdamWScalars, AnyPrecision, AnyPrecisionChoice,
    StepRule, STEP_LOSS,
};
use crate::KernelError;
use fsdp_device::DType;

pub use super::host_twin::{HostBuf, HostIds, HostOperand, HostOps};

impl GptOps for HostOps {
    type Buf = HostBuf;
    type Ids = HostIds;
    type Scalars = Counted<Vec<f64>>;
    type ScalarsCopy = Vec<f64>;
    type Staging = Vec<f32>;
    type Mark = std::time::Instant;
    type Operand = HostOperand;

    fn zeros(&self, len: usize) -> Result<HostBuf, KernelError> {
        Ok(self.counted(vec![0.0; len]))
    }

    fn empty(&self, len: usize) -> Result<HostBuf, KernelError> {
        Ok(self.counted(vec![f32::NAN; len]))
    }

    fn upload(&self, data: &[f32]) -> Result<HostBuf, KernelError> {
        Ok(self.counted(data.to_vec()))
    }

    fn upload_ids(&self, ids: &[u32]) -> Result<HostIds, KernelError> {
        Ok(self.counted(ids.to_vec()))
    }

    fn upload_into(&self, data: &[f32], buf: &mut HostBuf) -> Result<(), KernelError> {
        same_len("upload_into", "buffer", data.len(), buf.len())?;
        buf.copy_from_slice(data);
        Ok(())
    }

    fn download(&self, buf: &HostBuf) -> Result<Vec<f32>, KernelError> {
        Ok(buf.to_vec())
    }

    fn memory(&self) -> MemoryUse {
        self.memory.usage()
    }

    fn reset_peak(&self) {
        self.memory.reset_peak();
    }

    fn record_memory_history(&self, on: bool) {
        self.memory.record_history(on);
    }

    fn memory_history(&self) -> Vec<MemoryEvent> {
        self.memory.take_history()
    }

    fn buf_len(buf: &HostBuf) -> usize {
        buf.len()
    }

    fn bf16_products(&self) -> bool {
        self.products == HostProducts::Bf16Operands
    }

    fn fill_zero(&self, buf: &mut HostBuf) -> Result<(), KernelError> {
        host::memset(buf, 0.0);
        Ok(())
    }

    fn gemm_args(
        &self,
        g: &MatMul,
        a: Arg<'_, Self>,
        b: Arg<'_, Self>,
        c: &mut HostBuf,
    ) -> Result<(), KernelError> {
        // Without bf16 products an operand is the buffer itself.
        fn values(x: Arg<'_, HostOps>) -> &[f32] {
            match x {
                Arg::Buf(b) => b,
                Arg::Operand(o) => o,
            }
        }
        match self.products {
            HostProducts::F32 => gemm_f32(g, values(a), values(b), c),
            HostProducts::F64Rounded => gemm_f64_rounded(g, values(a), values(b), c),
            HostProducts::Bf16Operands => self.gemm_half(DType::BF16, g, a, b, c),
            HostProducts::F16Operands => self.gemm_half(DType::F16, g, a, b, c),
        }
    }

    fn operand(&self, buf: HostBuf) -> Result<HostOperand, KernelError> {
        if self.products.half().is_none() {
            return Ok(buf);
        }
        let kept = self.rounded_operand(&buf);
        drop(buf);
        Ok(kept)
    }

    fn operand_len(op: &HostOperand) -> usize {
        op.len()
    }

    fn bias_add(&self, y: &mut HostBuf, bias: &HostBuf) -> Result<(), KernelError> {
        nn::bias_add(y, bias)
    }

    fn axpby(
        &self,
        alpha: f32,
        x: &HostBuf,
        beta: f32,
        y: &mut HostBuf,
    ) -> Result<(), KernelError> {
        host::axpby(alpha, x, beta, y)
    }

    fn layernorm_forward(
        &self,
        x: &HostBuf,
        weight: &HostBuf,
        bias: &HostBuf,
        eps: f32,
        y: &mut HostBuf,
        mean: &mut HostBuf,
        rstd: &mut HostBuf,
    ) -> Result<(), KernelError> {
        nn::layernorm_forward(x, weight, bias, eps, y, mean, rstd)
    }

    fn layernorm_backward_input(
        &self,
        dy: &HostBuf,
        x: &HostBuf,
        weight: &HostBuf,
        mean: &HostBuf,
        rstd: &HostBuf,
        dx: &mut HostBuf,
    ) -> Result<(), KernelError> {
        nn::layernorm_backward_input(dy, x, weight, mean, rstd, dx)
    }

    fn layernorm_backward_params(
        &self,
        dy: &HostBuf,
        x: &HostBuf,
        mean: &HostBuf,
        rstd: &HostBuf,
        dweight: &mut HostBuf,
        dbias: &mut HostBuf,
    ) -> Result<(), KernelError> {
        nn::layernorm_backward_params(dy, x, mean, rstd, dweight, dbias)
    }

    fn gelu_forward(&self, x: &HostBuf, y: &mut HostBuf) -> Result<(), KernelError> {
        nn::gelu_forward(x, y)
    }

    fn gelu_backward(
        &self,
        x: &HostBuf,
        dy: &HostBuf,
        dx: &mut HostBuf,
    ) -> Result<(), KernelError> {
        nn::gelu_backward(x, dy, dx)
    }

    fn causal_softmax_forward(
        &self,
        scores: &HostBuf,
        t: usize,
        scale: f32,
        probs: &mut HostBuf,
    ) -> Result<(), KernelError> {
        nn::causal_softmax_forward(scores, t, scale, probs)
    }

    fn causal_softmax_backward(
        &self,
        probs: &HostBuf,
        dprobs: &HostBuf,
        t: usize,
        scale: f32,
        dscores: &mut HostBuf,
    ) -> Result<(), KernelError> {
        nn::causal_softmax_backward(probs, dprobs, t, scale, dscores)
    }

    fn causal_softmax_forward_with_operand(
        &self,
        scores: &HostBuf,
        t: usize,
        scale: f32,
        probs: &mut HostBuf,
    ) -> Result<Option<HostOperand>, KernelError> {
        nn::causal_softmax_forward(scores, t, scale, probs)?;
        Ok(self
            .products
            .half()
            .is_some()
            .then(|| self.rounded_operand(probs)))
    }

    fn write_operand(&self, w: Written<'_, HostOps>) -> Result<HostOperand, KernelError> {
        self.written(w.result_len()?, |y| written::host_f32(&w, y))
    }

    fn layernorm_forward_operand(
        &self,
        x: &HostBuf,
        weight: &HostBuf,
        bias: &HostBuf,
        eps: f32,
        mean: &mut HostBuf,
        rstd: &mut HostBuf,
    ) -> Result<HostOperand, KernelError> {
        self.written(x.len(), |y| {
            nn::layernorm_forward(x, weight, bias, eps, y, mean, rstd)
        })
    }

    fn cross_entropy_fused_in_place(
        &self,
        logits: &mut HostBuf,
        targets: &HostIds,
        first: usize,
        v: usize,
        dloss: f32,
        scale: Option<&Self::Scalars>,
        losses: &mut HostBuf,
    ) -> Result<(), KernelError> {
        let rows = loss_rows(logits.len(), v, first, targets.len(), losses.len())?;
        let (targets, losses) = (&targets[rows.clone()], &mut losses[rows]);
        let mut dloss = scaled_seed("cross_entropy_fused_f32", dloss, scale.map(|s| &s[..]))?;
        if self
            .overflows
            .contains(&self.seed_calls.fetch_add(1, Ordering::Relaxed))
        {
            dloss = f32::INFINITY;
        }
        nn::cross_entropy_fused_in_place(logits, targets, v, dloss, losses)
    }

    fn cross_entropy_fused_operand(
        &self,
        mut logits: HostBuf,
        targets: &HostIds,
        first: usize,
        v: usize,
        dloss: f32,
        scale: Option<&Self::Scalars>,
        losses: &mut HostBuf,
    ) -> Result<HostOperand, KernelError> {
        self.cross_entropy_fused_in_place(&mut logits, targets, first, v, dloss, scale, losses)?;
        if self.products.half().is_none() {
            return Ok(logits);
        }
        // The device writes the rounded gradient beside the logits, then frees them.
        let kept = self.rounded_operand(&logits);
        drop(logits);
        Ok(kept)
    }

    fn embedding_forward(
        &self,
        ids: &HostIds,
        wte: &HostBuf,
        wpe: &HostBuf,
        t: usize,
        c: usize,
        x: &mut HostBuf,
    ) -> Result<(), KernelError> {
        nn::embedding_forward(ids, wte, wpe, t, c, x)
    }

    fn embedding_backward_tokens(
        &self,
        ids: &[u32],
        dx: &HostBuf,
        c: usize,
        dwte: &mut HostBuf,
    ) -> Result<(), KernelError> {
        let k = "embedding_backward_tokens_f32";
        same_len(k, "dx", ids.len() * c, dx.len())?;
        let vocab = dwte.len() / c.max(1);
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(KernelError::InvalidArgument {
                kernel: k,
                reason: format!("token id {bad} is not below the vocabulary's {vocab}"),
            });
        }
        nn::embedding_backward_tokens(ids, dx, c, dwte)
    }

    fn embedding_backward_positions(
        &self,
        dx: &HostBuf,
        t: usize,
        c: usize,
        dwpe: &mut HostBuf,
    ) -> Result<(), KernelError> {
        nn::embedding_backward_positions(dx, t, c, dwpe)
    }

    fn bias_grad(&self, dy: &HostBuf, dbias: &mut HostBuf) -> Result<(), KernelError> {
        nn::bias_grad(dy, dbias)
    }

    fn heads_split(
        &self,
        rows: &HostBuf,
        layout: HeadsLayout,
        heads: &mut HostBuf,
    ) -> Result<(), KernelError> {
        nn::heads_split(rows, layout, heads)
    }

    fn heads_merge(
        &self,
        heads: &HostBuf,
        layout: HeadsLayout,
        rows: &mut HostBuf,
    ) -> Result<(), KernelError> {
        nn::heads_merge(heads, layout, rows)
    }

    fn attention_fused_forward(
        &self,
        a: &FusedAttention,
        qkv: [&HostOperand; 3],
        y: &mut HostBuf,
        lse: &mut HostBuf,
    ) -> Result<(), KernelError> {
        fused_ops::host_forward(self, a, qkv, y, lse)
    }

    fn attention_fused_backward(
        &self,
        a: &FusedAttention,
        layout: HeadsLayout,
        ins: [&HostOperand; 5],
        lse: &HostBuf,
        grads: [&mut HostBuf; 3],
    ) -> Result<(), KernelError> {
        fused_ops::host_backward(self, a, layout, ins, lse, grads)
    }

    fn adamw(
        &self,
        s: &AdamWScalars,
        param: &mut HostBuf,
        grad: &HostBuf,
        exp_avg: &mut HostBuf,
        exp_avg_sq: &mut HostBuf,
    ) -> Result<(), KernelError> {
        host::adamw::<f32>(s, param, grad, exp_avg, exp_avg_sq)
    }

    fn sum_of_squares(&self, x: &HostBuf) -> Result<f64, KernelError> {
        Ok(host::sum_of_squares(x))
    }

    fn scalars(&self, values: &[f64]) -> Result<Counted<Vec<f64>>, KernelError> {
        Ok(self.counted(values.to_vec()))
    }

    fn write_scalars(
        &self,
        scalars: &mut Counted<Vec<f64>>,
        at: usize,
        values: &[f64],
    ) -> Result<(), KernelError> {
        super::ops_args::write_slots(scalars, at, values)
    }

    fn loss_accumulate(
        &self,
        losses: &HostBuf,
        accum: u32,
        first: bool,
        scalars: &mut Counted<Vec<f64>>,
    ) -> Result<(), KernelError> {
        host::loss_accumulate(losses, accum, first, scalars)?;
        let call = self.loss_calls.fetch_add(1, Ordering::Relaxed);
        if self.nan_losses.contains(&call) {
            scalars[STEP_LOSS] = f64::NAN;
        }
        Ok(())
    }

    fn sum_of_squares_at(
        &self,
        x: &HostBuf,
        scalars: &mut Counted<Vec<f64>>,
        slot: usize,
    ) -> Result<(), KernelError> {
        let len = scalars.len();
        let out = scalars
            .get_mut(slot)
            .ok_or_else(|| KernelError::InvalidArgument {
                kernel: "sum_of_squares",
                reason: format!("slot {slot} of {len} scalars"),
            })?;
        *out = host::sum_of_squares(x);
        Ok(())
    }

    fn step_decide(
        &self,
        rule: &StepRule,
        scalars: &mut Counted<Vec<f64>>,
    ) -> Result<(), KernelError> {
        host::step_decide(rule, scalars)
    }

    fn adamw_decided(
        &self,
        choice: &AdamWChoice,
        scalars: &Counted<Vec<f64>>,
        param: &mut HostBuf,
        grad: &HostBuf,
        exp_avg: &mut HostBuf,
        exp_avg_sq: &mut HostBuf,
    ) -> Result<(), KernelError> {
        host::adamw_decided(choice, scalars, param, grad, exp_avg, exp_avg_sq)
    }

    fn anyprecision_decided(
        &self,
        choice: &AnyPrecisionChoice,
        kind: AnyPrecision,
        scalars: &Counted<Vec<f64>>,
        param: &mut HostBuf,
        grad: &HostBuf,
        exp_avg: &mut HostBuf,
        exp_avg_sq: &mut HostBuf,
        compensation: Option<&mut HostBuf>,
    ) -> Result<(), KernelError> {
        host::anyprecision_decided(
            choice,
            kind,
            scalars,
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            compensation.map(|c| &mut c[..]),
        )
    }

    fn copy_scalars(&self, scalars: &Counted<Vec<f64>>) -> Result<Vec<f64>, KernelError> {
        Ok(scalars.to_vec())
    }

    fn wait_scalars(&self, copy: Vec<f64>) -> Result<Vec<f64>, KernelError> {
        Ok(copy)
    }

    fn staging(&self, len: usize) -> Result<Vec<f32>, KernelError> {
        Ok(vec![0.0; len])
    }

    fn copy_out(&self, buf: &HostBuf, dst: &mut Vec<f32>) -> Result<(), KernelError> {
        same_len("copy_out", "staging", buf.len(), dst.len())?;
        dst.copy_from_slice(buf);
        Ok(())
    }

    fn copy_in(&self, src: &mut Vec<f32>, buf: &mut HostBuf) -> Result<(), KernelError> {
        same_len("copy_in", "buffer", src.len(), buf.len())?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn staged<'a>(&self, s: &'a Vec<f32>) -> Result<&'a [f32], KernelError> {
        Ok(s)
    }

    fn staged_mut<'a>(&self, s: &'a mut Vec<f32>) -> Result<&'a mut [f32], KernelError> {
        Ok(s)
    }

    fn mark(&self) -> Result<std::time::Instant, KernelError> {
        Ok(std::time::Instant::now())
    }

    fn elapsed_us(
        &self,
        from: &std::time::Instant,
        to: &std::time::Instant,
    ) -> Result<f64, KernelError> {
        Ok(to.saturating_duration_since(*from).as_secs_f64() * 1e6)
    }
}
