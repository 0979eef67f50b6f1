//! [`MetaOps`]: [`GptOps`] (and [`PeerOps`](super::PeerOps), in `meta_peer.rs`) that
//! allocate and count every buffer as the host twins and `CudaOps` do, and compute nothing — PyTorch's meta device for the GPT's step. A
//! pass or a trainer run over them makes exactly the allocations and frees, in the same order,
//! that the real operations make, so their counted peak is the real run's: the memory plan of
//! configurations too varied to replay by hand (sharded training), at no cost.
//!
//! Buffers hold a length and no values; every operation checks nothing and leaves its outputs
//! "written" (their [`Counted`] version renewed, as a real write renews it, so that the kept
//! bf16 operand copies of [`HostProducts::Bf16Operands`] are refilled exactly when the host
//! twins refill theirs). Reading values back gives zeros; staging memory is refused.

use std::sync::{Arc, Mutex};

use super::memory::{bytes_of, Counted, MemoryCounter, MemoryEvent, MemoryUse};
use super::ops::{loss_rows, Arg, GptOps};
use super::products::HostProducts;
use super::products::Kept;
use super::written::Written;
use crate::gemm::MatMul;
use crate::host::attention::FusedAttention;
use crate::host::nn::HeadsLayout;
use crate::host::{AdamWChoice, AdamWScalars, AnyPrecision, AnyPrecisionChoice, StepRule};
use crate::KernelError;

/// A buffer of [`MetaOps`]: its length only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MetaBuf {
    pub(super) len: usize,
}

/// A counted [`MetaBuf`].
pub type MetaCounted = Counted<MetaBuf>;

/// Operations that count memory and compute nothing: PyTorch's meta device for the GPT's
/// step. A pass or a trainer run over them makes exactly the allocations and frees, in the
/// same order, that the host twins and `CudaOps` make, so their counted peak is the real
/// run's. Buffers hold a length and no values; every operation leaves its outputs "written"
/// (their [`Counted`] version renewed, as a real write renews it, so that the kept bf16
/// operand copies of [`HostProducts::Bf16Operands`] are refilled exactly when the host twins
/// refill theirs). Reading values back gives zeros; staging memory is refused.
#[derive(Debug)]
pub struct MetaOps {
    products: HostProducts,
    pub(super) memory: Arc<MemoryCounter>,
    operands: Mutex<[Kept<MetaBuf>; 2]>,
    /// [`view`](MetaOps::view)s are counted copies (the host twins'), not uncounted views.
    copied_views: bool,
}

impl MetaOps {
    /// The operations of a run whose products are `products` (bf16 operands keep two counted
    /// copies, as the host twins and `CudaOps` do).
    pub fn new(products: HostProducts) -> MetaOps {
        MetaOps {
            products,
            memory: MemoryCounter::new(),
            operands: Mutex::new([Kept::default(), Kept::default()]),
            copied_views: false,
        }
    }

    /// These operations with [`view`](MetaOps::view)s counted as copies (`true`: the host
    /// twins see an engine's buffers through counted copies) or not (`false`, the default:
    /// `CudaOps` sees them in place).
    pub fn with_copied_views(mut self, copied: bool) -> MetaOps {
        self.copied_views = copied;
        self
    }

    /// The counter of the buffers these operations make (e.g. to
    /// [mirror](MemoryCounter::mirror_into) them into a caching allocator).
    pub fn memory_counter(&self) -> &Arc<MemoryCounter> {
        &self.memory
    }

    /// A buffer of `len` f32 elements of another owner (an FSDP engine's unsharded parameter
    /// or gradient) as these operations' buffer: not counted in [`memory`](GptOps::memory), its
    /// owner counts it (as `CudaOps::view`) — or, [`with_copied_views`](Self::with_copied_views),
    /// a counted copy (as the host twins').
    pub fn view(&self, len: usize) -> MetaCounted {
        if self.copied_views {
            return self.buf(len);
        }
        Counted::borrowed(MetaBuf { len }, &self.memory, |_| {})
    }

    pub(super) fn counted(&self, len: usize, elem_bytes: fn(usize) -> u64) -> MetaCounted {
        Counted::new(MetaBuf { len }, elem_bytes(len), &self.memory)
    }

    fn buf(&self, len: usize) -> MetaCounted {
        self.counted(len, bytes_of::<f32>)
    }

    /// An operand of `len` elements written as such (bf16 with bf16 products, else f32).
    fn new_operand(&self, len: usize) -> MetaCounted {
        if self.products.half().is_some() {
            self.counted(len, bytes_of::<u16>)
        } else {
            self.buf(len)
        }
    }
}

/// Marks `bufs` written (a real write renews a buffer's version).
pub(super) fn write(bufs: &mut [&mut MetaCounted]) {
    for b in bufs {
        let _: &mut MetaBuf = b;
    }
}

impl GptOps for MetaOps {
    type Buf = MetaCounted;
    type Ids = MetaCounted;
    type Scalars = Counted<Vec<f64>>;
    type ScalarsCopy = Vec<f64>;
    /// Host memory, zeros: CPU offload's host side is real in a plan, as in the run.
    type Staging = Vec<f32>;
    type Mark = ();
    type Operand = MetaCounted;

    fn zeros(&self, len: usize) -> Result<MetaCounted, KernelError> {
        Ok(self.buf(len))
    }
    fn empty(&self, len: usize) -> Result<MetaCounted, KernelError> {
        Ok(self.buf(len))
    }
    fn upload(&self, data: &[f32]) -> Result<MetaCounted, KernelError> {
        Ok(self.buf(data.len()))
    }
    fn upload_ids(&self, ids: &[u32]) -> Result<MetaCounted, KernelError> {
        Ok(self.counted(ids.len(), bytes_of::<u32>))
    }
    fn upload_into(&self, _: &[f32], buf: &mut MetaCounted) -> Result<(), KernelError> {
        write(&mut [buf]);
        Ok(())
    }
    fn download(&self, buf: &MetaCounted) -> Result<Vec<f32>, KernelError> {
        Ok(vec![0.0; buf.len])
    }
    fn buf_len(buf: &MetaCounted) -> usize {
        buf.len
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
    fn bf16_products(&self) -> bool {
        self.products == HostProducts::Bf16Operands
    }
    fn fill_zero(&self, buf: &mut MetaCounted) -> Result<(), KernelError> {
        write(&mut [buf]);
        Ok(())
    }
    fn gemm_args(
        &self,
        g: &MatMul,
        a: Arg<'_, Self>,
        b: Arg<'_, Self>,
        c: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        if self.products.half().is_some() {
            let mut kept = self
                .operands
                .lock()
                .map_err(|_| KernelError::InvalidArgument {
                    kernel: "meta gemm",
                    reason: "the kept operands' lock is poisoned".into(),
                })?;
            let [ka, kb] = &mut *kept;
            g.check_operands(a.len(), b.len(), c.len)?;
            let (ea, eb, _) = g.extents();
            // A kept operand is rounded already; a buffer is rounded into the kept copy.
            for (k, src, range) in [(ka, a, g.offset_a..ea), (kb, b, g.offset_b..eb)] {
                let Arg::Buf(src) = src else { continue };
                k.refill(
                    src.stamp(),
                    range,
                    |m: &MetaBuf| m.len,
                    |n| Ok::<_, KernelError>(self.counted(n, bytes_of::<u16>)),
                    |_| Ok(()),
                )?;
            }
        }
        write(&mut [c]);
        Ok(())
    }
    fn operand(&self, buf: MetaCounted) -> Result<MetaCounted, KernelError> {
        if self.products.half().is_none() {
            return Ok(buf);
        }
        let kept = self.new_operand(buf.len);
        drop(buf);
        Ok(kept)
    }
    fn operand_len(op: &MetaCounted) -> usize {
        op.len
    }
    fn bias_add(&self, y: &mut MetaCounted, _: &MetaCounted) -> Result<(), KernelError> {
        write(&mut [y]);
        Ok(())
    }
    fn axpby(
        &self,
        _: f32,
        _: &MetaCounted,
        _: f32,
        y: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [y]);
        Ok(())
    }
    fn layernorm_forward(
        &self,
        _: &MetaCounted,
        _: &MetaCounted,
        _: &MetaCounted,
        _: f32,
        y: &mut MetaCounted,
        mean: &mut MetaCounted,
        rstd: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [y, mean, rstd]);
        Ok(())
    }
    fn layernorm_backward_input(
        &self,
        _: &MetaCounted,
        _: &MetaCounted,
        _: &MetaCounted,
        _: &MetaCounted,
        _: &MetaCounted,
        dx: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [dx]);
        Ok(())
    }
    fn layernorm_backward_params(
        &self,
        _: &MetaCounted,
        _: &MetaCounted,
        _: &MetaCounted,
        _: &MetaCounted,
        dweight: &mut MetaCounted,
        dbias: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [dweight, dbias]);
        Ok(())
    }
    fn gelu_forward(&self, _: &MetaCounted, y: &mut MetaCounted) -> Result<(), KernelError> {
        write(&mut [y]);
        Ok(())
    }
    fn gelu_backward(
        &self,
        _: &MetaCounted,
        _: &MetaCounted,
        dx: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [dx]);
        Ok(())
    }
    fn causal_softmax_forward(
        &self,
        _: &MetaCounted,
        _: usize,
        _: f32,
        probs: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [probs]);
        Ok(())
    }
    fn causal_softmax_backward(
        &self,
        _: &MetaCounted,
        _: &MetaCounted,
        _: usize,
        _: f32,
        dscores: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [dscores]);
        Ok(())
    }
    fn causal_softmax_forward_with_operand(
        &self,
        _: &MetaCounted,
        _: usize,
        _: f32,
        probs: &mut MetaCounted,
    ) -> Result<Option<MetaCounted>, KernelError> {
        write(&mut [probs]);
        Ok(self
            .products
            .half()
            .is_some()
            .then(|| self.new_operand(probs.len)))
    }
    fn write_operand(&self, w: Written<'_, MetaOps>) -> Result<MetaCounted, KernelError> {
        Ok(self.new_operand(w.result_len()?))
    }
    fn layernorm_forward_operand(
        &self,
        x: &MetaCounted,
        _: &MetaCounted,
        _: &MetaCounted,
        _: f32,
        mean: &mut MetaCounted,
        rstd: &mut MetaCounted,
    ) -> Result<MetaCounted, KernelError> {
        let y = self.new_operand(x.len);
        write(&mut [mean, rstd]);
        Ok(y)
    }
    fn cross_entropy_fused_in_place(
        &self,
        logits: &mut MetaCounted,
        targets: &MetaCounted,
        first: usize,
        v: usize,
        _: f32,
        _: Option<&Self::Scalars>,
        losses: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        loss_rows(logits.len, v, first, targets.len, losses.len)?;
        write(&mut [logits, losses]);
        Ok(())
    }
    fn cross_entropy_fused_operand(
        &self,
        mut logits: MetaCounted,
        targets: &MetaCounted,
        first: usize,
        v: usize,
        dloss: f32,
        scale: Option<&Self::Scalars>,
        losses: &mut MetaCounted,
    ) -> Result<MetaCounted, KernelError> {
        self.cross_entropy_fused_in_place(&mut logits, targets, first, v, dloss, scale, losses)?;
        if self.products.half().is_none() {
            return Ok(logits);
        }
        let kept = self.new_operand(logits.len);
        drop(logits);
        Ok(kept)
    }
    fn embedding_forward(
        &self,
        _: &MetaCounted,
        _: &MetaCounted,
        _: &MetaCounted,
        _: usize,
        _: usize,
        x: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [x]);
        Ok(())
    }
    fn embedding_backward_tokens(
        &self,
        _: &[u32],
        _: &MetaCounted,
        _: usize,
        dwte: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [dwte]);
        Ok(())
    }
    fn embedding_backward_positions(
        &self,
        _: &MetaCounted,
        _: usize,
        _: usize,
        dwpe: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [dwpe]);
        Ok(())
    }
    fn bias_grad(&self, _: &MetaCounted, dbias: &mut MetaCounted) -> Result<(), KernelError> {
        write(&mut [dbias]);
        Ok(())
    }
    fn heads_split(
        &self,
        _: &MetaCounted,
        _: HeadsLayout,
        heads: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [heads]);
        Ok(())
    }
    fn adamw(
        &self,
        _: &AdamWScalars,
        param: &mut MetaCounted,
        _: &MetaCounted,
        exp_avg: &mut MetaCounted,
        exp_avg_sq: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [param, exp_avg, exp_avg_sq]);
        Ok(())
    }
    fn sum_of_squares(&self, _: &MetaCounted) -> Result<f64, KernelError> {
        Ok(0.0)
    }
    fn scalars(&self, values: &[f64]) -> Result<Counted<Vec<f64>>, KernelError> {
        let v = values.to_vec();
        Ok(Counted::new(v, bytes_of::<f64>(values.len()), &self.memory))
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
        _: &MetaCounted,
        _: u32,
        _: bool,
        scalars: &mut Counted<Vec<f64>>,
    ) -> Result<(), KernelError> {
        let _: &mut Vec<f64> = scalars;
        Ok(())
    }
    fn sum_of_squares_at(
        &self,
        _: &MetaCounted,
        scalars: &mut Counted<Vec<f64>>,
        _: usize,
    ) -> Result<(), KernelError> {
        let _: &mut Vec<f64> = scalars;
        Ok(())
    }
    fn step_decide(
        &self,
        _: &StepRule,
        scalars: &mut Counted<Vec<f64>>,
    ) -> Result<(), KernelError> {
        let _: &mut Vec<f64> = scalars;
        Ok(())
    }
    fn adamw_decided(
        &self,
        _: &AdamWChoice,
        _: &Counted<Vec<f64>>,
        param: &mut MetaCounted,
        _: &MetaCounted,
        exp_avg: &mut MetaCounted,
        exp_avg_sq: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [param, exp_avg, exp_avg_sq]);
        Ok(())
    }
    fn anyprecision_decided(
        &self,
        _: &AnyPrecisionChoice,
        _: AnyPrecision,
        _: &Counted<Vec<f64>>,
        param: &mut MetaCounted,
        _: &MetaCounted,
        exp_avg: &mut MetaCounted,
        exp_avg_sq: &mut MetaCounted,
        compensation: Option<&mut MetaCounted>,
    ) -> Result<(), KernelError> {
        write(&mut [param, exp_avg, exp_avg_sq]);
        if let Some(c) = compensation {
            write(&mut [c]);
        }
        Ok(())
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
    fn copy_out(&self, buf: &MetaCounted, dst: &mut Vec<f32>) -> Result<(), KernelError> {
        crate::host::same_len("copy_out", "staging", buf.len, dst.len())
    }
    fn copy_in(&self, src: &mut Vec<f32>, buf: &mut MetaCounted) -> Result<(), KernelError> {
        crate::host::same_len("copy_in", "buffer", src.len(), buf.len)?;
        write(&mut [buf]);
        Ok(())
    }
    fn staged<'a>(&self, s: &'a Vec<f32>) -> Result<&'a [f32], KernelError> {
        Ok(s)
    }
    fn staged_mut<'a>(&self, s: &'a mut Vec<f32>) -> Result<&'a mut [f32], KernelError> {
        Ok(s)
    }
    fn mark(&self) -> Result<(), KernelError> {
        Ok(())
    }
    fn elapsed_us(&self, _: &(), _: &()) -> Result<f64, KernelError> {
        Ok(0.0)
    }
    fn heads_merge(
        &self,
        _: &MetaCounted,
        _: HeadsLayout,
        rows: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [rows]);
        Ok(())
    }
    fn attention_fused_forward(
        &self,
        _: &FusedAttention,
        _: [&MetaCounted; 3],
        y: &mut MetaCounted,
        lse: &mut MetaCounted,
    ) -> Result<(), KernelError> {
        write(&mut [y, lse]);
        Ok(())
    }
    fn attention_fused_backward(
        &self,
        _: &FusedAttention,
        _: HeadsLayout,
        _: [&MetaCounted; 5],
        _: &MetaCounted,
        [dq, dk, dv]: [&mut MetaCounted; 3],
    ) -> Result<(), KernelError> {
        write(&mut [dq, dk, dv]);
        Ok(())
    }
}
