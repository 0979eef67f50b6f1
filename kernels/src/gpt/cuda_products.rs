//! [`CudaOps`]' bf16 products: the activations kept as bf16 operands ([`CudaOperand`]) and
//! the two kept bf16 copies that other operands are cast into ([`Products::Bf16`](super::Products::Bf16)).

use std::sync::atomic::Ordering;

use cudarc::driver::{CudaSlice, CudaViewMut};
use half::bf16;

use super::cuda::{copy_error, CudaBuf, CudaOps};
use super::memory::Counted;
use super::ops::Arg;
use super::products::Kept;
use crate::gemm::MatMul;
use crate::{launch, KernelError};

/// An activation of [`CudaOps`] kept as an operand ([`GptOps::operand`](super::GptOps::operand)): in bf16 with
/// [`Products::Bf16`](super::Products::Bf16), else the f32 buffer itself.
#[derive(Debug)]
pub enum CudaOperand {
    /// The f32 buffer (f32 products).
    F32(CudaBuf),
    /// Its bf16 rounding (bf16 products).
    Bf16(Counted<CudaSlice<bf16>>),
}

impl CudaOperand {
    /// The bf16 values.
    fn bf16(&self) -> Result<&CudaSlice<bf16>, KernelError> {
        match self {
            CudaOperand::Bf16(b) => Ok(b),
            CudaOperand::F32(_) => Err(KernelError::InvalidArgument {
                kernel: "gemm",
                reason: "an f32 operand in a bf16 product".into(),
            }),
        }
    }
}

/// An f32 product's operand.
pub(super) fn f32_arg(a: Arg<'_, CudaOps>) -> Result<&CudaSlice<f32>, KernelError> {
    match a {
        Arg::Buf(b) | Arg::Operand(CudaOperand::F32(b)) => Ok(b),
        Arg::Operand(CudaOperand::Bf16(_)) => Err(KernelError::InvalidArgument {
            kernel: "gemm",
            reason: "a bf16 operand in an f32 product".into(),
        }),
    }
}

impl CudaOps {
    /// `c = alpha·op(bf16(a))·op(bf16(b)) + beta·c`, the operands cast into the kept copies.
    pub(super) fn gemm_bf16(
        &self,
        g: &MatMul,
        a: Arg<'_, CudaOps>,
        b: Arg<'_, CudaOps>,
        c: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let mut kept = self
            .operands
            .lock()
            .map_err(|_| copy_error("bf16 operands", "poisoned lock"))?;
        let [ka, kb] = &mut *kept;
        // Each operand's part alone is cast (a product may read part of a buffer); a kept
        // operand is bf16 already.
        g.check_operands(a.len(), b.len(), c.len())?;
        let (ea, eb, _) = g.extents();
        let (ca, cb);
        let va = match a {
            Arg::Buf(a) => {
                ca = self.cast_into(ka, a, g.offset_a..ea)?;
                ca.as_view()
            }
            Arg::Operand(a) => a.bf16()?.slice(g.offset_a..ea),
        };
        let vb = match b {
            Arg::Buf(b) => {
                cb = self.cast_into(kb, b, g.offset_b..eb)?;
                cb.as_view()
            }
            Arg::Operand(b) => b.bf16()?.slice(g.offset_b..eb),
        };
        self.blas
            .matmul::<bf16, f32>(&g.operands_from_start(), &va, &vb, c)
    }
}

impl CudaOps {
    /// `src[range]` rounded to bf16 into the front of `kept` (replaced by a larger copy when
    /// short), unless `kept` holds it already (the same part of the same buffer, unwritten
    /// since: see [`operand_casts`](CudaOps::operand_casts)).
    fn cast_into<'a>(
        &self,
        kept: &'a mut Kept<CudaSlice<bf16>>,
        src: &CudaBuf,
        range: std::ops::Range<usize>,
    ) -> Result<CudaViewMut<'a, bf16>, KernelError> {
        let n = range.len();
        let part = src.slice(range.clone());
        let cast = kept.refill(
            src.stamp(),
            range,
            |c: &CudaSlice<bf16>| c.len(),
            // SAFETY: zeroed.
            |n| unsafe { self.device_slice::<bf16>(n, true) },
            |copy| launch::cast::<f32, bf16>(&self.cuda, &part, &mut copy.slice_mut(..n)),
        )?;
        if cast {
            self.casts.fetch_add(1, Ordering::Relaxed);
        }
        match &mut kept.copy {
            Some(copy) => Ok(copy.slice_mut(..n)),
            None => Err(copy_error("bf16 operands", "no kept copy")),
        }
    }

    /// How many times a product's operand was cast into a kept bf16 copy so far (with
    /// [`Products::Bf16`](super::Products::Bf16)). Each of the two operand positions keeps its copy and the stamp of
    /// the buffer it was cast from; a product whose operand is that buffer, unwritten since
    /// (every write borrows it mutably, which renews the stamp), uses the copy as it is. The
    /// backward's `dY` of a linear layer, the attention's `dS` and the head's `dlogits` each
    /// feed two products in a row, so each is cast once. [`HostOps`](super::HostOps) counts
    /// the same ([`HostOps::operand_roundings`](super::HostOps::operand_roundings)).
    pub fn operand_casts(&self) -> u64 {
        self.casts.load(Ordering::Relaxed)
    }
}
