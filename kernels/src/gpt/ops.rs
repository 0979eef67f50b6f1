//! [`GptOps`], the device operations of one GPT training step, and [`HostOps`], their host
//! implementation by the kernels' twins.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::memory::{bytes_of, Counted, MemoryCounter, MemoryUse};
use super::products::{gemm_f32, gemm_f64_rounded, round_into, Kept};
use crate::gemm::MatMul;
use crate::host::nn::{self, HeadsLayout};
use crate::host::{self, same_len, AdamWScalars};
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

    /// A buffer of `len` zeros.
    ///
    /// # Errors
    /// An allocation failure.
    fn zeros(&self, len: usize) -> Result<Self::Buf, KernelError>;
    /// A buffer of `len` elements whose values are unspecified until written: the output of
    /// an operation that writes all of it (a product with `beta = 0`, a layer's forward, a
    /// backward that **writes**), never of one that accumulates. It costs no fill on a device;
    /// [`HostOps`] fills it with NaN, so that a read before the first write shows in every
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
    /// Sets every element of `buf` to 0.
    ///
    /// # Errors
    /// A launch failure.
    fn fill_zero(&self, buf: &mut Self::Buf) -> Result<(), KernelError>;
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
    ) -> Result<(), KernelError>;
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
    /// [`host::nn::cross_entropy_fused_in_place`](crate::host::nn::cross_entropy_fused_in_place):
    /// writes `losses`, and the logits' gradient over `logits`.
    ///
    /// # Errors
    /// Shape errors; launch failures.
    fn cross_entropy_fused_in_place(
        &self,
        logits: &mut Self::Buf,
        targets: &Self::Ids,
        v: usize,
        dloss: f32,
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
}

/// How [`HostOps`] multiplies matrices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostProducts {
    /// [`gemm_f32`]: f32, left to right (the default).
    #[default]
    F32,
    /// [`gemm_f64_rounded`]: accumulated in f64, rounded once.
    F64Rounded,
    /// [`gemm_bf16_operands`](super::gemm_bf16_operands): both operands rounded to bf16 (as
    /// the cast kernel rounds), products summed in f32 ([`gemm_f32`]'s order) — what
    /// [`CudaOps`](super::CudaOps) with
    /// [`Products::Bf16`](super::Products::Bf16) computes, in another summation order.
    Bf16Operands,
}

/// A buffer of [`HostOps`]: a `Vec<f32>` counted in its operations' memory (4 bytes an
/// element, as on a device).
pub type HostBuf = Counted<Vec<f32>>;
/// Ids of [`HostOps`]: a `Vec<u32>` counted in its operations' memory.
pub type HostIds = Counted<Vec<u32>>;

/// [`GptOps`] on the host: the kernels' twins and [`gemm_f32`] (or [`gemm_f64_rounded`]);
/// buffers are `Vec`s, counted in [`memory`](GptOps::memory) as a device's would be, and every
/// operation runs when called. With [`HostProducts::Bf16Operands`] it keeps the two operand
/// copies of the products between them as [`CudaOps`](super::CudaOps) does (grown when short,
/// the short one freed first), counted at bf16's 2 bytes an element (held widened to f32 for
/// the f32 product), so that its peak is the CUDA run's.
#[derive(Debug)]
pub struct HostOps {
    /// The matrix products.
    pub products: HostProducts,
    memory: Arc<MemoryCounter>,
    operands: Mutex<[Kept<Vec<f32>>; 2]>,
    roundings: AtomicU64,
}

impl Default for HostOps {
    fn default() -> HostOps {
        HostOps::with_products(HostProducts::default())
    }
}

impl HostOps {
    /// The twins and f32 products ([`gemm_f32`]).
    pub fn new() -> HostOps {
        HostOps::default()
    }

    /// The twins and the products of `products`.
    pub fn with_products(products: HostProducts) -> HostOps {
        HostOps {
            products,
            memory: MemoryCounter::new(),
            operands: Mutex::new([Kept::default(), Kept::default()]),
            roundings: AtomicU64::new(0),
        }
    }

    /// How many times a product's operand was rounded into a kept bf16 copy so far (with
    /// [`HostProducts::Bf16Operands`]): a product whose operand the copy already holds,
    /// unwritten since, does not round it again, as [`CudaOps`](super::CudaOps) does not cast
    /// it ([`CudaOps::operand_casts`](super::CudaOps::operand_casts)).
    pub fn operand_roundings(&self) -> u64 {
        self.roundings.load(Ordering::Relaxed)
    }

    fn counted<T>(&self, v: Vec<T>) -> Counted<Vec<T>> {
        let bytes = bytes_of::<T>(v.len());
        Counted::new(v, bytes, &self.memory)
    }

    /// [`gemm_bf16_operands`](super::gemm_bf16_operands) through the kept operand copies: the
    /// same rounded values, so the same bits.
    fn gemm_bf16(
        &self,
        g: &MatMul,
        a: &HostBuf,
        b: &HostBuf,
        c: &mut [f32],
    ) -> Result<(), KernelError> {
        let mut kept = self
            .operands
            .lock()
            .map_err(|_| KernelError::InvalidArgument {
                kernel: "gemm_bf16_operands",
                reason: "the kept operands' lock is poisoned".into(),
            })?;
        let [ka, kb] = &mut *kept;
        let ra = round_into(&self.memory, ka, a, &self.roundings);
        let rb = round_into(&self.memory, kb, b, &self.roundings);
        gemm_f32(g, ra, rb, c)
    }
}

impl GptOps for HostOps {
    type Buf = HostBuf;
    type Ids = HostIds;

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

    fn buf_len(buf: &HostBuf) -> usize {
        buf.len()
    }

    fn fill_zero(&self, buf: &mut HostBuf) -> Result<(), KernelError> {
        host::memset(buf, 0.0);
        Ok(())
    }

    fn gemm(
        &self,
        g: &MatMul,
        a: &HostBuf,
        b: &HostBuf,
        c: &mut HostBuf,
    ) -> Result<(), KernelError> {
        match self.products {
            HostProducts::F32 => gemm_f32(g, a, b, c),
            HostProducts::F64Rounded => gemm_f64_rounded(g, a, b, c),
            HostProducts::Bf16Operands => self.gemm_bf16(g, a, b, c),
        }
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

    fn cross_entropy_fused_in_place(
        &self,
        logits: &mut HostBuf,
        targets: &HostIds,
        v: usize,
        dloss: f32,
        losses: &mut HostBuf,
    ) -> Result<(), KernelError> {
        nn::cross_entropy_fused_in_place(logits, targets, v, dloss, losses)
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
}
