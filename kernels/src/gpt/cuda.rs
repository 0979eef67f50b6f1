//! [`CudaOps`]' [`GptOps`]: the layer kernels through [`launch`], the products through cuBLAS,
//! all on the operations' one stream.

use cudarc::driver::{CudaSlice, DeviceSlice};
use half::{bf16, f16};

pub(super) use super::cuda_ops::copy_error;
pub use super::cuda_ops::{CudaBuf, CudaIds, CudaOps};
use super::cuda_products::{f32_arg, written_half, CudaOperand, Products};
use super::cuda_step::{CudaMark, CudaScalars, CudaScalarsCopy, CudaStaging};
use super::fused_ops;
use super::memory::{MemoryEvent, MemoryUse};
use super::ops::{loss_rows, Arg, DecidedTensor, GptOps};
use super::written::Written;
use crate::gemm::MatMul;
use crate::host::attention::FusedAttention;
use crate::host::nn::HeadsLayout;
use crate::host::{AdamWChoice, AdamWScalars, AnyPrecision, AnyPrecisionChoice, StepRule};
use crate::{launch, KernelError};

impl GptOps for CudaOps {
    type Buf = CudaBuf;
    type Ids = CudaIds;
    type Scalars = CudaScalars;
    type ScalarsCopy = CudaScalarsCopy;
    type Staging = CudaStaging;
    type Mark = CudaMark;
    type Operand = CudaOperand;

    fn zeros(&self, len: usize) -> Result<CudaBuf, KernelError> {
        // SAFETY: zeroed.
        unsafe { self.device_slice::<f32>(len, true) }
    }

    fn empty(&self, len: usize) -> Result<CudaBuf, KernelError> {
        // SAFETY: device memory of `len` f32 whose bits are whatever the pool held; any bits
        // are an f32, and the host never sees them before an operation writes them (the
        // contract of `GptOps::empty`; `HostOps` fills with NaN so that its tests would show a
        // read before the write).
        unsafe { self.device_slice::<f32>(len, false) }
    }

    fn upload(&self, data: &[f32]) -> Result<CudaBuf, KernelError> {
        self.upload_slice(data)
    }

    fn upload_into(&self, data: &[f32], buf: &mut CudaBuf) -> Result<(), KernelError> {
        crate::host::same_len("upload_into", "buffer", data.len(), buf.len())?;
        self.cuda
            .memcpy_htod(data, &mut **buf)
            .map_err(|e| copy_error("cuMemcpyHtoDAsync", e))
    }

    fn upload_ids(&self, ids: &[u32]) -> Result<CudaIds, KernelError> {
        self.upload_slice(ids)
    }

    fn memory(&self) -> MemoryUse {
        self.memory.usage()
    }

    fn reset_peak(&self) {
        self.memory.reset_peak();
    }

    fn record_memory_history(&self, on: bool) {
        self.memory.record_history(on);
        if let Some(a) = self.memory_source.allocator() {
            // The device's allocator: its history holds every user's blocks (every rank that
            // is a thread of this process on the device), as PyTorch's does.
            if on != a.is_recording_history() {
                a.record_memory_history(on.then(fsdp_allocator::HistoryConfig::default));
            }
        }
    }

    fn allocator_snapshot(&self) -> Option<fsdp_allocator::Snapshot> {
        self.memory_source.allocator().map(|a| a.snapshot())
    }

    fn memory_history(&self) -> Vec<MemoryEvent> {
        self.memory.take_history()
    }

    fn memory_source(&self) -> Option<String> {
        Some(self.memory_source.to_string())
    }

    fn memory_report(&self) -> Option<String> {
        self.memory_summary()
    }

    fn download(&self, buf: &CudaBuf) -> Result<Vec<f32>, KernelError> {
        let v = self
            .cuda
            .clone_dtoh(&**buf)
            .map_err(|e| copy_error("cuMemcpyDtoHAsync", e))?;
        self.stream.synchronize()?;
        Ok(v)
    }

    fn buf_len(buf: &CudaBuf) -> usize {
        buf.len()
    }

    fn bf16_products(&self) -> bool {
        self.products() == Products::Bf16
    }

    fn fill_zero(&self, buf: &mut CudaBuf) -> Result<(), KernelError> {
        launch::memset(&self.cuda, buf, 0.0f32)
    }

    fn fill_zero_many(&self, bufs: &mut [&mut CudaBuf]) -> Result<(), KernelError> {
        let mut slices: Vec<&mut CudaSlice<f32>> = bufs.iter_mut().map(|b| &mut ***b).collect();
        launch::fill_zero_many(&self.cuda, &mut slices)
    }

    fn gemm_args(
        &self,
        g: &MatMul,
        a: Arg<'_, Self>,
        b: Arg<'_, Self>,
        c: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        match self.products {
            Products::F32 => self.blas.matmul::<f32, f32>(g, f32_arg(a)?, f32_arg(b)?, c),
            Products::Bf16 => self.gemm_half::<bf16>(g, a, b, c),
            Products::F16 => self.gemm_half::<f16>(g, a, b, c),
        }
    }

    fn operand(&self, buf: CudaBuf) -> Result<CudaOperand, KernelError> {
        match self.products {
            Products::F32 => Ok(CudaOperand::F32(buf)),
            Products::Bf16 => self.operand_as::<bf16>(buf),
            Products::F16 => self.operand_as::<f16>(buf),
        }
    }

    fn operand_len(op: &CudaOperand) -> usize {
        op.len()
    }

    fn bias_add(&self, y: &mut CudaBuf, bias: &CudaBuf) -> Result<(), KernelError> {
        launch::bias_add(&self.cuda, y, bias)
    }

    fn axpby(
        &self,
        alpha: f32,
        x: &CudaBuf,
        beta: f32,
        y: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::axpby::<f32>(&self.cuda, alpha, x, beta, y)
    }

    fn layernorm_forward(
        &self,
        x: &CudaBuf,
        weight: &CudaBuf,
        bias: &CudaBuf,
        eps: f32,
        y: &mut CudaBuf,
        mean: &mut CudaBuf,
        rstd: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::layernorm_forward(&self.cuda, x, weight, bias, eps, y, mean, rstd)
    }

    fn layernorm_backward_input(
        &self,
        dy: &CudaBuf,
        x: &CudaBuf,
        weight: &CudaBuf,
        mean: &CudaBuf,
        rstd: &CudaBuf,
        dx: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::layernorm_backward_input(&self.cuda, dy, x, weight, mean, rstd, dx)
    }

    fn layernorm_backward_params(
        &self,
        dy: &CudaBuf,
        x: &CudaBuf,
        mean: &CudaBuf,
        rstd: &CudaBuf,
        dweight: &mut CudaBuf,
        dbias: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::layernorm_backward_params(&self.cuda, dy, x, mean, rstd, dweight, dbias)
    }

    fn gelu_forward(&self, x: &CudaBuf, y: &mut CudaBuf) -> Result<(), KernelError> {
        launch::gelu_forward(&self.cuda, x, y)
    }

    fn gelu_backward(
        &self,
        x: &CudaBuf,
        dy: &CudaBuf,
        dx: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::gelu_backward(&self.cuda, x, dy, dx)
    }

    fn causal_softmax_forward(
        &self,
        scores: &CudaBuf,
        t: usize,
        scale: f32,
        probs: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::causal_softmax_forward(&self.cuda, scores, t, scale, probs)
    }

    fn causal_softmax_backward(
        &self,
        probs: &CudaBuf,
        dprobs: &CudaBuf,
        t: usize,
        scale: f32,
        dscores: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::causal_softmax_backward(&self.cuda, probs, dprobs, t, scale, dscores)
    }

    fn causal_softmax_forward_with_operand(
        &self,
        scores: &CudaBuf,
        t: usize,
        scale: f32,
        probs: &mut CudaBuf,
    ) -> Result<Option<CudaOperand>, KernelError> {
        if self.products == Products::F32 {
            launch::causal_softmax_forward(&self.cuda, scores, t, scale, probs)?;
            return Ok(None);
        }
        let rounded = written_half!(self, scores.len(), |r| {
            launch::causal_softmax_forward_both(&self.cuda, scores, t, scale, probs, r)
        })?;
        Ok(Some(rounded))
    }

    fn write_operand(&self, w: Written<'_, CudaOps>) -> Result<CudaOperand, KernelError> {
        let n = w.result_len()?;
        if self.products == Products::F32 {
            let mut y = self.empty(n)?;
            self.launch_written(&w, &mut y)?;
            return Ok(CudaOperand::F32(y));
        }
        written_half!(self, n, |y| self.launch_written(&w, y))
    }

    fn layernorm_forward_operand(
        &self,
        x: &CudaBuf,
        weight: &CudaBuf,
        bias: &CudaBuf,
        eps: f32,
        mean: &mut CudaBuf,
        rstd: &mut CudaBuf,
    ) -> Result<CudaOperand, KernelError> {
        if self.products == Products::F32 {
            let mut y = self.empty(x.len())?;
            launch::layernorm_forward(&self.cuda, x, weight, bias, eps, &mut y, mean, rstd)?;
            return Ok(CudaOperand::F32(y));
        }
        written_half!(self, x.len(), |y| {
            launch::layernorm_forward(&self.cuda, x, weight, bias, eps, y, mean, rstd)
        })
    }

    fn cross_entropy_fused_in_place(
        &self,
        logits: &mut CudaBuf,
        targets: &CudaIds,
        first: usize,
        v: usize,
        dloss: f32,
        scale: Option<&CudaScalars>,
        losses: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        let rows = loss_rows(logits.len(), v, first, targets.len(), losses.len())?;
        let targets = targets.slice(rows.clone());
        let mut losses = losses.slice_mut(rows);
        let scale = scale.map(|s| &**s);
        let stream = &self.cuda;
        launch::cross_entropy_fused_in_place(stream, logits, &targets, v, dloss, scale, &mut losses)
    }

    fn cross_entropy_fused_operand(
        &self,
        mut logits: CudaBuf,
        targets: &CudaIds,
        first: usize,
        v: usize,
        dloss: f32,
        scale: Option<&CudaScalars>,
        losses: &mut CudaBuf,
    ) -> Result<CudaOperand, KernelError> {
        if self.products == Products::F32 {
            let (l, t) = (&mut logits, targets);
            self.cross_entropy_fused_in_place(l, t, first, v, dloss, scale, losses)?;
            return Ok(CudaOperand::F32(logits));
        }
        let rows = loss_rows(logits.len(), v, first, targets.len(), losses.len())?;
        let targets = targets.slice(rows.clone());
        let mut losses = losses.slice_mut(rows);
        let scale = scale.map(|s| &**s);
        let d = written_half!(self, logits.len(), |d| {
            let (l, t, ls) = (&logits, &targets, &mut losses);
            launch::cross_entropy_fused(&self.cuda, l, t, v, dloss, scale, ls, d)
        })?;
        drop(logits);
        Ok(d)
    }

    fn embedding_forward(
        &self,
        ids: &CudaIds,
        wte: &CudaBuf,
        wpe: &CudaBuf,
        t: usize,
        c: usize,
        x: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::embedding_forward(&self.cuda, ids, wte, wpe, t, c, x)
    }

    fn embedding_backward_tokens(
        &self,
        ids: &[u32],
        dx: &CudaBuf,
        c: usize,
        dwte: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::embedding_backward_tokens_host_ids(&self.cuda, ids, dx, c, dwte)
    }

    fn embedding_backward_positions(
        &self,
        dx: &CudaBuf,
        t: usize,
        c: usize,
        dwpe: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::embedding_backward_positions(&self.cuda, dx, t, c, dwpe)
    }

    fn bias_grad(&self, dy: &CudaBuf, dbias: &mut CudaBuf) -> Result<(), KernelError> {
        launch::bias_grad(&self.cuda, dy, dbias)
    }

    fn heads_split(
        &self,
        rows: &CudaBuf,
        layout: HeadsLayout,
        heads: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::heads_split(&self.cuda, rows, layout, heads)
    }

    fn heads_merge(
        &self,
        heads: &CudaBuf,
        layout: HeadsLayout,
        rows: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::heads_merge(&self.cuda, heads, layout, rows)
    }

    fn attention_fused_forward(
        &self,
        a: &FusedAttention,
        qkv: [&CudaOperand; 3],
        y: &mut CudaBuf,
        lse: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        fused_ops::cuda_forward(self, a, qkv, y, lse)
    }

    fn attention_fused_backward(
        &self,
        a: &FusedAttention,
        layout: HeadsLayout,
        ins: [&CudaOperand; 5],
        lse: &CudaBuf,
        grads: [&mut CudaBuf; 3],
    ) -> Result<(), KernelError> {
        fused_ops::cuda_backward(self, a, layout, ins, lse, grads)
    }

    fn adamw(
        &self,
        s: &AdamWScalars,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        exp_avg: &mut CudaBuf,
        exp_avg_sq: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::adamw::<f32>(&self.cuda, s, param, grad, exp_avg, exp_avg_sq)
    }

    fn sum_of_squares(&self, x: &CudaBuf) -> Result<f64, KernelError> {
        let mut out = self
            .cuda
            .alloc_zeros::<f64>(1)
            .map_err(|e| copy_error("cuMemAllocAsync", e))?;
        launch::sum_of_squares(&self.cuda, x, &mut out)?;
        let v = self
            .cuda
            .clone_dtoh(&out)
            .map_err(|e| copy_error("cuMemcpyDtoHAsync", e))?;
        self.stream.synchronize()?;
        v.first()
            .copied()
            .ok_or_else(|| copy_error("cuMemcpyDtoHAsync", "no element copied back"))
    }

    fn scalars(&self, values: &[f64]) -> Result<CudaScalars, KernelError> {
        self.upload_scalars(values)
    }

    fn write_scalars(
        &self,
        scalars: &mut CudaScalars,
        at: usize,
        values: &[f64],
    ) -> Result<(), KernelError> {
        self.write_scalars_at(scalars, at, values)
    }

    fn loss_accumulate(
        &self,
        losses: &CudaBuf,
        accum: u32,
        first: bool,
        scalars: &mut CudaScalars,
    ) -> Result<(), KernelError> {
        launch::loss_accumulate(&self.cuda, losses, accum, first, scalars)
    }

    fn sum_of_squares_at(
        &self,
        x: &CudaBuf,
        scalars: &mut CudaScalars,
        slot: usize,
    ) -> Result<(), KernelError> {
        self.sum_of_squares_into(x, scalars, slot)
    }

    fn sum_of_squares_many(
        &self,
        xs: &[&CudaBuf],
        scalars: &mut CudaScalars,
        first: usize,
    ) -> Result<(), KernelError> {
        self.sum_of_squares_many_into(xs, scalars, first)
    }

    fn step_decide(&self, rule: &StepRule, scalars: &mut CudaScalars) -> Result<(), KernelError> {
        launch::step_decide(&self.cuda, rule, scalars)
    }

    fn adamw_decided(
        &self,
        choice: &AdamWChoice,
        scalars: &CudaScalars,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        exp_avg: &mut CudaBuf,
        exp_avg_sq: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        launch::adamw_decided(
            &self.cuda, choice, scalars, param, grad, exp_avg, exp_avg_sq,
        )
    }

    fn adamw_decided_many(
        &self,
        choices: &[AdamWChoice; 2],
        scalars: &CudaScalars,
        tensors: &mut [DecidedTensor<'_, CudaBuf>],
    ) -> Result<(), KernelError> {
        self.adamw_many(choices, scalars, tensors)
    }

    fn anyprecision_decided_many(
        &self,
        choices: &[AnyPrecisionChoice; 2],
        kind: AnyPrecision,
        scalars: &CudaScalars,
        tensors: &mut [DecidedTensor<'_, CudaBuf>],
    ) -> Result<(), KernelError> {
        self.anyprecision_many(choices, kind, scalars, tensors)
    }

    fn anyprecision_decided(
        &self,
        choice: &AnyPrecisionChoice,
        kind: AnyPrecision,
        scalars: &CudaScalars,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        exp_avg: &mut CudaBuf,
        exp_avg_sq: &mut CudaBuf,
        compensation: Option<&mut CudaBuf>,
    ) -> Result<(), KernelError> {
        launch::anyprecision_decided(
            &self.cuda,
            choice,
            kind,
            scalars,
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            compensation,
        )
    }

    fn copy_scalars(&self, scalars: &CudaScalars) -> Result<CudaScalarsCopy, KernelError> {
        self.start_scalars_copy(scalars)
    }

    fn wait_scalars(&self, copy: CudaScalarsCopy) -> Result<Vec<f64>, KernelError> {
        self.finish_scalars_copy(copy)
    }

    fn staging(&self, len: usize) -> Result<CudaStaging, KernelError> {
        self.new_staging(len)
    }

    fn copy_out(&self, buf: &CudaBuf, dst: &mut CudaStaging) -> Result<(), KernelError> {
        self.staging_copy_out(buf, dst)
    }

    fn copy_in(&self, src: &mut CudaStaging, buf: &mut CudaBuf) -> Result<(), KernelError> {
        self.staging_copy_in(src, buf)
    }

    fn staged<'a>(&self, s: &'a CudaStaging) -> Result<&'a [f32], KernelError> {
        s.values()
    }

    fn staged_mut<'a>(&self, s: &'a mut CudaStaging) -> Result<&'a mut [f32], KernelError> {
        s.values_mut()
    }

    fn mark(&self) -> Result<CudaMark, KernelError> {
        self.new_mark()
    }

    fn elapsed_us(&self, from: &CudaMark, to: &CudaMark) -> Result<f64, KernelError> {
        from.elapsed_us(to)
    }
}
