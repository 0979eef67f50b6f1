//! [`HostOps`]: the kernels' twins as the operations of one device, their buffers and how
//! they are made (their [`GptOps`] implementation is in `host_ops.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::memory::{bytes_of, Counted, MemoryCounter};
use super::ops::{Arg, GptOps};
use super::products::{gemm_f32, round_into, rounded_to, HostProducts, Kept};
use crate::gemm::MatMul;
use crate::KernelError;
use fsdp_device::DType;

/// A buffer of [`HostOps`]: a `Vec<f32>` counted in its operations' memory (4 bytes an
/// element, as on a device).
pub type HostBuf = Counted<Vec<f32>>;
/// Ids of [`HostOps`]: a `Vec<u32>` counted in its operations' memory.
pub type HostIds = Counted<Vec<u32>>;
/// An activation of [`HostOps`] kept as an operand ([`GptOps::operand`]): with
/// [`HostProducts::Bf16Operands`] its values rounded to bf16, counted at 2 bytes an element
/// (as [`CudaOps`](super::CudaOps) holds them in bf16), else the buffer itself.
pub type HostOperand = Counted<Vec<f32>>;

/// [`GptOps`] on the host: the kernels' twins and [`gemm_f32`] (or [`gemm_f64_rounded`](super::gemm_f64_rounded));
/// buffers are `Vec`s, counted in [`memory`](GptOps::memory) as a device's would be, and every
/// operation runs when called. With [`HostProducts::Bf16Operands`] it keeps the two operand
/// copies of the products between them as [`CudaOps`](super::CudaOps) does (grown when short,
/// the short one freed first), counted at bf16's 2 bytes an element (held widened to f32 for
/// the f32 product), so that its peak is the CUDA run's.
#[derive(Debug)]
pub struct HostOps {
    /// The matrix products.
    pub products: HostProducts,
    pub(super) memory: Arc<MemoryCounter>,
    pub(super) operands: Mutex<[Kept<Vec<f32>>; 2]>,
    pub(super) roundings: AtomicU64,
    /// [`with_nan_losses`](HostOps::with_nan_losses): the calls of `loss_accumulate`
    /// (counted from 0) that make the step's loss NaN.
    pub(super) nan_losses: Vec<u64>,
    pub(super) loss_calls: AtomicU64,
    /// [`with_overflow_at`](HostOps::with_overflow_at): the calls of the cross-entropy
    /// (counted from 0) whose gradient seed is infinite.
    pub(super) overflows: Vec<u64>,
    pub(super) seed_calls: AtomicU64,
}

impl Default for HostOps {
    fn default() -> HostOps {
        HostOps::with_products(HostProducts::default())
    }
}

impl HostOps {
    /// The counter of the buffers these operations make (e.g. to
    /// [mirror](MemoryCounter::mirror_into) them into a caching allocator).
    pub fn memory_counter(&self) -> &Arc<MemoryCounter> {
        &self.memory
    }

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
            nan_losses: Vec::new(),
            loss_calls: AtomicU64::new(0),
            overflows: Vec::new(),
            seed_calls: AtomicU64::new(0),
        }
    }

    /// The same operations, except that the [`loss_accumulate`](GptOps::loss_accumulate)
    /// calls numbered in `calls` (from 0: one a micro-batch) leave a NaN loss: a fault
    /// injected to test what training does with non-finite steps, which a GPT with finite
    /// weights does not produce on demand.
    pub fn with_nan_losses(mut self, calls: impl IntoIterator<Item = u64>) -> HostOps {
        self.nan_losses = calls.into_iter().collect();
        self
    }

    /// The same operations, except that the cross-entropy calls numbered in `calls` (from 0:
    /// one a micro-batch and chunk of logits) start the backward from an infinite gradient
    /// seed, so that every gradient of the micro-batch is non-finite as an overflow leaves it
    /// (the loss stays finite): a fault injected to test what a grad scaler does with an
    /// overflow, which f32 gradients of a small GPT do not produce on demand.
    pub fn with_overflow_at(mut self, calls: impl IntoIterator<Item = u64>) -> HostOps {
        self.overflows = calls.into_iter().collect();
        self
    }

    /// How many times a product's operand was rounded into a kept bf16 copy so far (with
    /// [`HostProducts::Bf16Operands`]): a product whose operand the copy already holds,
    /// unwritten since, does not round it again, as [`CudaOps`](super::CudaOps) does not cast
    /// it ([`CudaOps::operand_casts`](super::CudaOps::operand_casts)).
    pub fn operand_roundings(&self) -> u64 {
        self.roundings.load(Ordering::Relaxed)
    }

    pub(super) fn counted<T>(&self, v: Vec<T>) -> Counted<Vec<T>> {
        let bytes = bytes_of::<T>(v.len());
        Counted::new(v, bytes, &self.memory)
    }

    /// A new operand of `n` elements that `compute` writes in f32: with bf16 products its
    /// rounding ([`rounded_operand`](Self::rounded_operand); the device writes the rounding
    /// itself, so the f32 values are not counted), else the f32 buffer.
    pub(super) fn written(
        &self,
        n: usize,
        compute: impl FnOnce(&mut [f32]) -> Result<(), KernelError>,
    ) -> Result<HostOperand, KernelError> {
        if self.products.half().is_none() {
            let mut y = self.empty(n)?;
            compute(&mut y)?;
            return Ok(y);
        }
        let mut y = vec![0.0; n];
        compute(&mut y)?;
        Ok(self.rounded_operand(&y))
    }

    /// `v` rounded to the products' bf16 or f16 as a kept operand, counted at 2 bytes an
    /// element and as one rounding of an operand.
    pub(super) fn rounded_operand(&self, v: &[f32]) -> HostOperand {
        let rounded = rounded_to(self.products.half().unwrap_or(DType::BF16), v);
        let n = rounded.len();
        self.roundings.fetch_add(1, Ordering::Relaxed);
        Counted::new(rounded, bytes_of::<u16>(n), &self.memory)
    }

    /// [`gemm_half_operands`](super::gemm_half_operands) in `half` through the kept operand
    /// copies: the same rounded values, so the same bits.
    pub(super) fn gemm_half(
        &self,
        half: DType,
        g: &MatMul,
        a: Arg<'_, HostOps>,
        b: Arg<'_, HostOps>,
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
        // Each operand's part alone is rounded (a product may read part of a buffer).
        g.check_operands(a.len(), b.len(), c.len())?;
        let (ea, eb, _) = g.extents();
        // A kept operand is rounded already.
        let ra = match a {
            Arg::Buf(a) => round_into(half, &self.memory, ka, a, g.offset_a..ea, &self.roundings),
            Arg::Operand(a) => &a[g.offset_a..ea],
        };
        let rb = match b {
            Arg::Buf(b) => round_into(half, &self.memory, kb, b, g.offset_b..eb, &self.roundings),
            Arg::Operand(b) => &b[g.offset_b..eb],
        };
        gemm_f32(&g.operands_from_start(), ra, rb, c)
    }
}
