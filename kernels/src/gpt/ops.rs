//! [`GptOps`], the device operations of one GPT training step (implemented on the host by
//! [`HostOps`](super::HostOps), on CUDA by [`CudaOps`](super::CudaOps)).

use super::memory::{MemoryEvent, MemoryUse};
pub(super) use super::ops_args::{loss_rows, scalar_slots};
pub use super::ops_args::{Arg, DecidedTensor};
use super::written::Written;
use crate::gemm::MatMul;
use crate::host::attention::FusedAttention;
use crate::host::nn::HeadsLayout;
use crate::host::{AdamWChoice, AdamWScalars, AnyPrecision, AnyPrecisionChoice, StepRule};
use crate::KernelError;

/// The operations of one GPT training step on one device, f32. Each kernel operation has the
/// semantics of its twin in [`host::nn`](crate::host::nn) (whose documentation says whether it
/// writes or accumulates); the implementation decides where buffers live and when work runs
/// (a device's operations may be asynchronous: only [`download`](GptOps::download) waits).
pub trait GptOps {
    /// An f32 buffer on the device.
    type Buf;
    /// A u32 buffer (token ids, targets) on the device.
    type Ids;
    /// An f64 buffer on the device: the scalars of a training step decided on the device (its
    /// loss, gradient norm, clipping, whether AdamW runs, the optimizer step count), laid out
    /// as [`host::step`](crate::host::STEP_LOSS)'s `STEP_*` constants say.
    type Scalars;
    /// A copy of [`Scalars`](GptOps::Scalars) on its way to the host
    /// ([`copy_scalars`](GptOps::copy_scalars)), read by [`wait_scalars`](GptOps::wait_scalars).
    type ScalarsCopy;
    /// Host memory the device copies into and out of without the host waiting (page-locked
    /// on a GPU): CPU offload's staging of gradients and parameters.
    type Staging;
    /// A point of the device's timeline: an event recorded with timing on a GPU, the host's
    /// clock on the twins (`--trace`).
    type Mark;
    /// An activation kept only as an operand of later products ([`operand`](GptOps::operand)):
    /// with bf16 products its bf16 rounding (2 bytes an element: what every product would
    /// round it to), else the f32 buffer itself.
    type Operand;

    /// A buffer of `len` zeros.
    ///
    /// # Errors
    /// An allocation failure.
    fn zeros(&self, len: usize) -> Result<Self::Buf, KernelError>;
    /// A buffer of `len` elements whose values are unspecified until written: the output of
    /// an operation that writes all of it (a product with `beta = 0`, a layer's forward, a
    /// backward that **writes**), never of one that accumulates. It costs no fill on a device;
    /// [`HostOps`](super::HostOps) fills it with NaN, so that a read before the first write shows in every
    /// result its twin tests compare.
    ///
    /// # Errors
    /// An allocation failure.
    fn empty(&self, len: usize) -> Result<Self::Buf, KernelError>;
    /// A buffer holding `data`.
    ///
    /// # Errors
    /// An allocation or copy failure.
    fn upload(&self, data: &[f32]) -> Result<Self::Buf, KernelError>;
    /// An id buffer holding `ids`.
    ///
    /// # Errors
    /// An allocation or copy failure.
    fn upload_ids(&self, ids: &[u32]) -> Result<Self::Ids, KernelError>;
    /// Copy `data` into `buf`, of the same length (no allocation: CPU offload's upload of the
    /// updated parameters).
    ///
    /// # Errors
    /// [`KernelError::Length`] when the lengths differ; a copy failure.
    fn upload_into(&self, data: &[f32], buf: &mut Self::Buf) -> Result<(), KernelError>;
    /// The buffer's values on the host, once every operation enqueued before has finished.
    ///
    /// # Errors
    /// A copy failure or an earlier asynchronous failure; a wait past the device's timeout.
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>, KernelError>;
    /// Elements of `buf`.
    fn buf_len(buf: &Self::Buf) -> usize;
    /// The bytes of device memory these operations hold now and the most they held at once
    /// (since they were made, or since [`reset_peak`](GptOps::reset_peak)): every
    /// [`Buf`](GptOps::Buf) and [`Ids`](GptOps::Ids) they handed out and that is still alive,
    /// and the buffers they keep themselves (the bf16 operands of mixed-precision products).
    /// Scratch that one operation allocates and frees within itself is not counted.
    fn memory(&self) -> MemoryUse;
    /// Starts the peak of [`memory`](GptOps::memory) again from the bytes held now.
    fn reset_peak(&self);
    /// Record every buffer made and dropped from now on (`true`), or stop (`false`)
    /// ([`MemoryCounter::record_history`](super::MemoryCounter::record_history)).
    fn record_memory_history(&self, on: bool);
    /// The buffers made and dropped since recording began or since the last call.
    fn memory_history(&self) -> Vec<MemoryEvent>;
    /// Where the buffers come from, in words, for a run's first lines (`None`, the default:
    /// nothing to say, as on the host twins).
    fn memory_source(&self) -> Option<String> {
        None
    }
    /// What that memory reports of itself, for a run's summary (`None`, the default: nothing
    /// beyond [`memory`](GptOps::memory)).
    fn memory_report(&self) -> Option<String> {
        None
    }
    /// The snapshot of the allocator the buffers come from, where they come from one (the
    /// caching allocator on CUDA): its segments and blocks now, and the history it recorded
    /// while [`record_memory_history`](GptOps::record_memory_history) was on, in PyTorch's
    /// form (`torch.cuda.memory._snapshot`). `None`, the default, elsewhere.
    fn allocator_snapshot(&self) -> Option<fsdp_allocator::Snapshot> {
        None
    }
    /// Sets every element of `buf` to 0.
    ///
    /// # Errors
    /// A launch failure.
    fn fill_zero(&self, buf: &mut Self::Buf) -> Result<(), KernelError>;
    /// [`fill_zero`](GptOps::fill_zero) of each of `bufs` (on CUDA one launch per
    /// [`ZERO_SEGMENTS`](crate::launch::ZERO_SEGMENTS) buffers instead of a memset each).
    ///
    /// # Errors
    /// A launch failure.
    fn fill_zero_many(&self, bufs: &mut [&mut Self::Buf]) -> Result<(), KernelError> {
        for b in bufs {
            self.fill_zero(b)?;
        }
        Ok(())
    }
    /// Whether every matrix product reads its operands rounded to bf16 (bf16 products:
    /// [`Products::Bf16`](super::Products::Bf16), the host twins'
    /// [`HostProducts::Bf16Operands`](super::HostProducts::Bf16Operands)), so that a tensor
    /// only products read may be handed over as its bf16 rounding without changing a bit.
    fn bf16_products(&self) -> bool;
    /// `c = alpha·op(a)·op(b) + beta·c` as `g` describes (row-major, possibly batched).
    ///
    /// # Errors
    /// Operands shorter than `g` needs; a library failure.
    fn gemm(
        &self,
        g: &MatMul,
        a: &Self::Buf,
        b: &Self::Buf,
        c: &mut Self::Buf,
    ) -> Result<(), KernelError> {
        self.gemm_args(g, Arg::Buf(a), Arg::Buf(b), c)
    }
    /// [`gemm`](GptOps::gemm) of operands that are buffers or activations kept as operands
    /// ([`operand`](GptOps::operand)): a kept operand is multiplied as it is (with bf16
    /// products: already rounded, not cast again), a buffer as [`gemm`](GptOps::gemm) does.
    ///
    /// # Errors
    /// Operands shorter than `g` needs; a library failure.
    fn gemm_args(
        &self,
        g: &MatMul,
        a: Arg<'_, Self>,
        b: Arg<'_, Self>,
        c: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// `buf` (consumed) kept as an operand of later products only: with bf16 products rounded
    /// to bf16 once (a cast, counted with the products' casts), its f32 buffer freed; else
    /// the buffer itself. The products of it give the bits they give of `buf`.
    ///
    /// # Errors
    /// An allocation or launch failure.
    fn operand(&self, buf: Self::Buf) -> Result<Self::Operand, KernelError>;
    /// Elements of an operand.
    fn operand_len(op: &Self::Operand) -> usize;
    /// `y[r, j] += bias[j]` ([`host::nn::bias_add`](crate::host::nn::bias_add)).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn bias_add(&self, y: &mut Self::Buf, bias: &Self::Buf) -> Result<(), KernelError>;
    /// `y = alpha·x + beta·y` ([`host::axpby`](crate::host::axpby)): the residual adds.
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn axpby(
        &self,
        alpha: f32,
        x: &Self::Buf,
        beta: f32,
        y: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`host::nn::layernorm_forward`](crate::host::nn::layernorm_forward).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_forward(
        &self,
        x: &Self::Buf,
        weight: &Self::Buf,
        bias: &Self::Buf,
        eps: f32,
        y: &mut Self::Buf,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`host::nn::layernorm_backward_input`](crate::host::nn::layernorm_backward_input)
    /// (accumulates).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn layernorm_backward_input(
        &self,
        dy: &Self::Buf,
        x: &Self::Buf,
        weight: &Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`host::nn::layernorm_backward_params`](crate::host::nn::layernorm_backward_params)
    /// (accumulates).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn layernorm_backward_params(
        &self,
        dy: &Self::Buf,
        x: &Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        dweight: &mut Self::Buf,
        dbias: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`host::nn::gelu_forward`](crate::host::nn::gelu_forward).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn gelu_forward(&self, x: &Self::Buf, y: &mut Self::Buf) -> Result<(), KernelError>;
    /// [`host::nn::gelu_backward`](crate::host::nn::gelu_backward) (writes).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn gelu_backward(
        &self,
        x: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`host::nn::causal_softmax_forward`](crate::host::nn::causal_softmax_forward).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn causal_softmax_forward(
        &self,
        scores: &Self::Buf,
        t: usize,
        scale: f32,
        probs: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`host::nn::causal_softmax_backward`](crate::host::nn::causal_softmax_backward)
    /// (writes).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn causal_softmax_backward(
        &self,
        probs: &Self::Buf,
        dprobs: &Self::Buf,
        t: usize,
        scale: f32,
        dscores: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`causal_softmax_forward`](GptOps::causal_softmax_forward) into `probs` (f32, for a
    /// backward) and, with bf16 products, their bf16 rounding as a new operand of a product
    /// written in the same pass (counted as one rounding of an operand); `None` under f32
    /// products, where `probs` is read as it is.
    ///
    /// # Errors
    /// Shape errors; allocation and launch failures.
    fn causal_softmax_forward_with_operand(
        &self,
        scores: &Self::Buf,
        t: usize,
        scale: f32,
        probs: &mut Self::Buf,
    ) -> Result<Option<Self::Operand>, KernelError>;
    /// A layer's result that only products read, written as a new operand by the layer's
    /// own kernel, as [`operand`](GptOps::operand) of its f32 result gives: with bf16 products
    /// the kernel stores the bf16 rounding itself (no f32 buffer and no cast; counted as one
    /// rounding of an operand), else an f32 buffer.
    ///
    /// # Errors
    /// The operation's shape errors; allocation and launch failures.
    fn write_operand(&self, w: Written<'_, Self>) -> Result<Self::Operand, KernelError>;
    /// [`layernorm_forward`](GptOps::layernorm_forward) whose output only products read: `y`
    /// written as a new operand as [`write_operand`](GptOps::write_operand) writes, the
    /// statistics into `mean` and `rstd`.
    ///
    /// # Errors
    /// As [`layernorm_forward`](GptOps::layernorm_forward); allocation failures.
    fn layernorm_forward_operand(
        &self,
        x: &Self::Buf,
        weight: &Self::Buf,
        bias: &Self::Buf,
        eps: f32,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
    ) -> Result<Self::Operand, KernelError>;
    /// [`cross_entropy_fused_in_place`](GptOps::cross_entropy_fused_in_place) whose gradient
    /// only products read: `logits` (consumed) becomes the gradient as an operand, as
    /// [`operand`](GptOps::operand) of it gives. With bf16 products the kernel writes the
    /// gradient's bf16 rounding into a new buffer (no cast; counted as one rounding of an
    /// operand) and the logits are freed; else the gradient is written over the logits.
    ///
    /// # Errors
    /// As [`cross_entropy_fused_in_place`](GptOps::cross_entropy_fused_in_place); allocation
    /// failures.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_fused_operand(
        &self,
        logits: Self::Buf,
        targets: &Self::Ids,
        first: usize,
        v: usize,
        dloss: f32,
        scale: Option<&Self::Scalars>,
        losses: &mut Self::Buf,
    ) -> Result<Self::Operand, KernelError>;
    /// [`host::nn::cross_entropy_fused_in_place`](crate::host::nn::cross_entropy_fused_in_place):
    /// writes `losses`, and the logits' gradient over `logits`. `logits` holds the rows
    /// `first..first + r` of the tokens (`r = len / v`: a chunk of them,
    /// [`Logits::Chunked`](super::Logits)), whose targets and losses are those rows of
    /// `targets` and `losses`.
    /// With a grad scaler's step scalars `scale`, the gradient's seed `dloss` is multiplied by
    /// their loss scale ([`STEP_SCALE`](crate::host::STEP_SCALE), rounded to f32) on the
    /// device, so that the backward is that of the scaled loss without the host knowing the
    /// scale (the decision of the step before updated it).
    ///
    /// # Errors
    /// Rows past `targets` or `losses`; shape errors; launch failures.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_fused_in_place(
        &self,
        logits: &mut Self::Buf,
        targets: &Self::Ids,
        first: usize,
        v: usize,
        dloss: f32,
        scale: Option<&Self::Scalars>,
        losses: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`host::nn::embedding_forward`](crate::host::nn::embedding_forward).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    #[allow(clippy::too_many_arguments)]
    fn embedding_forward(
        &self,
        ids: &Self::Ids,
        wte: &Self::Buf,
        wpe: &Self::Buf,
        t: usize,
        c: usize,
        x: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`host::nn::embedding_backward_tokens`](crate::host::nn::embedding_backward_tokens)
    /// (accumulates), the ids on the host (the data loader has them).
    ///
    /// # Errors
    /// Shape errors, an id out of `dwte`'s rows; copy and launch failures.
    fn embedding_backward_tokens(
        &self,
        ids: &[u32],
        dx: &Self::Buf,
        c: usize,
        dwte: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`host::nn::embedding_backward_positions`](crate::host::nn::embedding_backward_positions)
    /// (accumulates).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn embedding_backward_positions(
        &self,
        dx: &Self::Buf,
        t: usize,
        c: usize,
        dwpe: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`host::nn::bias_grad`](crate::host::nn::bias_grad) (accumulates).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn bias_grad(&self, dy: &Self::Buf, dbias: &mut Self::Buf) -> Result<(), KernelError>;
    /// [`host::nn::heads_split`](crate::host::nn::heads_split): token rows to `[b, h, t, d]`
    /// (q, k or v out of `qkv`; the backward of [`heads_merge`](GptOps::heads_merge)).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn heads_split(
        &self,
        rows: &Self::Buf,
        layout: HeadsLayout,
        heads: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// One fused AdamW step on one parameter tensor ([`host::adamw`](crate::host::adamw),
    /// f32 moments; the scalars of the step from [`AdamWScalars::new`]).
    ///
    /// # Errors
    /// Lengths that differ; launch failures.
    fn adamw(
        &self,
        s: &AdamWScalars,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        exp_avg: &mut Self::Buf,
        exp_avg_sq: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// The sum of squares of `x` in f64 ([`host::sum_of_squares`](crate::host::sum_of_squares)),
    /// on the host: waits for every operation enqueued before.
    ///
    /// # Errors
    /// Allocation, launch and copy failures; a wait past the device's timeout.
    fn sum_of_squares(&self, x: &Self::Buf) -> Result<f64, KernelError>;
    /// `y = c·y` (gradient clipping), as [`axpby`](GptOps::axpby)`(c, y, 0, zeros)` into a new
    /// buffer that replaces `y`: each element `c·y + 0·0`, so exactly `c·y` rounded once.
    ///
    /// # Errors
    /// Allocation and launch failures.
    fn scale(&self, c: f32, y: &mut Self::Buf) -> Result<(), KernelError> {
        let mut out = self.zeros(Self::buf_len(y))?;
        self.axpby(c, y, 0.0, &mut out)?;
        *y = out;
        Ok(())
    }
    /// A scalar buffer holding `values` on the device, counted in [`memory`](GptOps::memory)
    /// as a buffer is.
    ///
    /// # Errors
    /// An allocation or copy failure.
    fn scalars(&self, values: &[f64]) -> Result<Self::Scalars, KernelError>;
    /// Writes `values` into `scalars` from slot `at` on (in stream order: work enqueued
    /// before reads the old values, work after the new).
    ///
    /// # Errors
    /// Slots past the buffer; a copy failure.
    fn write_scalars(
        &self,
        scalars: &mut Self::Scalars,
        at: usize,
        values: &[f64],
    ) -> Result<(), KernelError>;
    /// One micro-batch's per-token `losses` (one of `accum`) into the step's loss in
    /// `scalars` ([`host::loss_accumulate`](crate::host::loss_accumulate); `first` starts it
    /// from 0). Nothing waits.
    ///
    /// # Errors
    /// No losses, `accum` of 0, a short scalar buffer; launch failures.
    fn loss_accumulate(
        &self,
        losses: &Self::Buf,
        accum: u32,
        first: bool,
        scalars: &mut Self::Scalars,
    ) -> Result<(), KernelError>;
    /// The sum of squares of `x` in f64 ([`host::sum_of_squares`](crate::host::sum_of_squares))
    /// into `scalars[slot]`, on the device: nothing waits.
    ///
    /// # Errors
    /// A slot past the buffer; allocation and launch failures.
    fn sum_of_squares_at(
        &self,
        x: &Self::Buf,
        scalars: &mut Self::Scalars,
        slot: usize,
    ) -> Result<(), KernelError>;
    /// [`sum_of_squares_at`](GptOps::sum_of_squares_at) of each of `xs` into slots
    /// `first..first + xs.len()`: the same values (on CUDA two launches per
    /// [`SQUARES_TENSORS`](crate::launch::SQUARES_TENSORS) tensors instead of two each).
    ///
    /// # Errors
    /// Slots past the buffer; allocation and launch failures.
    fn sum_of_squares_many(
        &self,
        xs: &[&Self::Buf],
        scalars: &mut Self::Scalars,
        first: usize,
    ) -> Result<(), KernelError> {
        for (i, x) in xs.iter().enumerate() {
            self.sum_of_squares_at(x, scalars, first + i)?;
        }
        Ok(())
    }
    /// The step's decision by `rule` ([`host::step_decide`](crate::host::step_decide)), on
    /// the device.
    ///
    /// # Errors
    /// A scalar buffer too short for the rule's tensors; launch failures.
    fn step_decide(&self, rule: &StepRule, scalars: &mut Self::Scalars) -> Result<(), KernelError>;
    /// AdamW on one tensor as the decision in `scalars` says
    /// ([`host::adamw_decided`](crate::host::adamw_decided): nothing when not applied, the
    /// chosen scalar set, the clipped gradient), f32 moments.
    ///
    /// # Errors
    /// Lengths that differ; launch failures.
    #[allow(clippy::too_many_arguments)]
    fn adamw_decided(
        &self,
        choice: &AdamWChoice,
        scalars: &Self::Scalars,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        exp_avg: &mut Self::Buf,
        exp_avg_sq: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// [`adamw_decided`](GptOps::adamw_decided) on each of `tensors` with
    /// `choices[usize::from(decay)]`: the same values (on CUDA one launch per
    /// [`ADAMW_TENSORS`](crate::launch::ADAMW_TENSORS) tensors instead of one each).
    ///
    /// # Errors
    /// As [`adamw_decided`](GptOps::adamw_decided).
    fn adamw_decided_many(
        &self,
        choices: &[AdamWChoice; 2],
        scalars: &Self::Scalars,
        tensors: &mut [DecidedTensor<'_, Self::Buf>],
    ) -> Result<(), KernelError> {
        for t in tensors {
            let choice = &choices[usize::from(t.decay)];
            self.adamw_decided(choice, scalars, t.param, t.grad, t.exp_avg, t.exp_avg_sq)?;
        }
        Ok(())
    }
    /// [`anyprecision_decided`](GptOps::anyprecision_decided) of `kind` on each of
    /// `tensors` with `choices[usize::from(decay)]`: the same values (on CUDA one launch per
    /// [`ANYPRECISION_TENSORS`](crate::launch::ANYPRECISION_TENSORS) tensors).
    ///
    /// # Errors
    /// As [`anyprecision_decided`](GptOps::anyprecision_decided).
    fn anyprecision_decided_many(
        &self,
        choices: &[AnyPrecisionChoice; 2],
        kind: AnyPrecision,
        scalars: &Self::Scalars,
        tensors: &mut [DecidedTensor<'_, Self::Buf>],
    ) -> Result<(), KernelError> {
        for t in tensors {
            let choice = &choices[usize::from(t.decay)];
            let (p, g, m, v) = (&mut *t.param, t.grad, &mut *t.exp_avg, &mut *t.exp_avg_sq);
            let c = t.compensation.as_deref_mut();
            self.anyprecision_decided(choice, kind, scalars, p, g, m, v, c)?;
        }
        Ok(())
    }
    /// torchdistx's `AnyPrecisionAdamW` on one tensor as the decision in `scalars` says
    /// ([`host::anyprecision_decided`](crate::host::anyprecision_decided)): the parameter
    /// rounded to `kind.param`, the state buffers of
    /// [`state_len`](crate::host::state_len) elements in `kind.state`, the compensation
    /// required with Kahan summation.
    ///
    /// # Errors
    /// Lengths that differ; a bad dtype or missing compensation; launch failures.
    #[allow(clippy::too_many_arguments)]
    fn anyprecision_decided(
        &self,
        choice: &AnyPrecisionChoice,
        kind: AnyPrecision,
        scalars: &Self::Scalars,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        exp_avg: &mut Self::Buf,
        exp_avg_sq: &mut Self::Buf,
        compensation: Option<&mut Self::Buf>,
    ) -> Result<(), KernelError>;
    /// Starts copying `scalars` to the host once the operations enqueued before have run,
    /// without waiting for them.
    ///
    /// # Errors
    /// Allocation and copy failures.
    fn copy_scalars(&self, scalars: &Self::Scalars) -> Result<Self::ScalarsCopy, KernelError>;
    /// The values of a [`copy_scalars`](GptOps::copy_scalars), once it has arrived: waits for
    /// the operations enqueued before the copy, not after it.
    ///
    /// # Errors
    /// A copy failure or an earlier asynchronous failure; a wait past the device's timeout.
    fn wait_scalars(&self, copy: Self::ScalarsCopy) -> Result<Vec<f64>, KernelError>;
    /// `len` f32 of [`Staging`](GptOps::Staging) host memory, zeros.
    ///
    /// # Errors
    /// An allocation failure.
    fn staging(&self, len: usize) -> Result<Self::Staging, KernelError>;
    /// Starts copying `buf` into `dst` (of the same length) once the operations enqueued
    /// before have run; nothing waits.
    ///
    /// # Errors
    /// [`KernelError::Length`] when the lengths differ; a copy failure.
    fn copy_out(&self, buf: &Self::Buf, dst: &mut Self::Staging) -> Result<(), KernelError>;
    /// Starts copying `src`'s values into `buf` (of the same length), ordered before the
    /// operations enqueued after; nothing waits.
    ///
    /// # Errors
    /// [`KernelError::Length`] when the lengths differ; a copy failure.
    fn copy_in(&self, src: &mut Self::Staging, buf: &mut Self::Buf) -> Result<(), KernelError>;
    /// `s`'s values on the host, once the last copy into or out of it has finished (waiting for
    /// that copy only).
    ///
    /// # Errors
    /// A copy failure; a wait past the device's timeout.
    fn staged<'a>(&self, s: &'a Self::Staging) -> Result<&'a [f32], KernelError>;
    /// `s`'s values to write on the host, once the last copy into or out of it has finished.
    ///
    /// # Errors
    /// A copy failure; a wait past the device's timeout.
    fn staged_mut<'a>(&self, s: &'a mut Self::Staging) -> Result<&'a mut [f32], KernelError>;
    /// Records a [`Mark`](GptOps::Mark) after the operations enqueued so far; nothing waits.
    ///
    /// # Errors
    /// An event failure.
    fn mark(&self) -> Result<Self::Mark, KernelError>;
    /// Microseconds of the device's timeline from `from` to `to`, both already reached (a
    /// wait for a later point has returned): never waits.
    ///
    /// # Errors
    /// A mark not reached yet; an event failure.
    fn elapsed_us(&self, from: &Self::Mark, to: &Self::Mark) -> Result<f64, KernelError>;
    /// [`host::nn::heads_merge`](crate::host::nn::heads_merge): `[b, h, t, d]` into token rows
    /// (the heads' outputs into `[b·t, E]`; `dq`, `dk`, `dv` into `dqkv`: the backward of
    /// [`heads_split`](GptOps::heads_split)).
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn heads_merge(
        &self,
        heads: &Self::Buf,
        layout: HeadsLayout,
        rows: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// Fused causal attention's forward
    /// ([`host::attention::flash_forward`](crate::host::attention::flash_forward)): writes
    /// `y` (`[pairs, t, d]`) and `lse` (`[pairs·t]`, kept for backward) from the operands
    /// `qkv = [q, k, v]`, which must be bf16 or f16 (16-bit products).
    ///
    /// # Errors
    /// Shape errors; f32 operands; on CUDA what its kernels do not take
    /// ([`launch::flash_forward`](crate::launch::flash_forward)); launch failures.
    fn attention_fused_forward(
        &self,
        a: &FusedAttention,
        qkv: [&Self::Operand; 3],
        y: &mut Self::Buf,
        lse: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// Fused causal attention's backward
    /// ([`host::attention::flash_backward`](crate::host::attention::flash_backward)): writes
    /// `grads = [dq, dk, dv]` from `ins = [q, k, v, y, dout]`: the heads' output gradient
    /// `dout` (an operand `[pairs, t, d]`), forward's output `y` as the projection's operand
    /// (token rows as `layout` places the heads), and from forward's `lse`.
    ///
    /// # Errors
    /// As [`attention_fused_forward`](GptOps::attention_fused_forward).
    fn attention_fused_backward(
        &self,
        a: &FusedAttention,
        layout: HeadsLayout,
        ins: [&Self::Operand; 5],
        lse: &Self::Buf,
        grads: [&mut Self::Buf; 3],
    ) -> Result<(), KernelError>;
}
