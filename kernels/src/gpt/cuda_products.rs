//! [`CudaOps`]' bf16 and f16 products: the activations kept as bf16 or f16 operands
//! ([`CudaOperand`]) and the two kept copies that other operands are cast into
//! ([`Products::Bf16`](super::Products::Bf16), [`Products::F16`](super::Products::F16)), one
//! code for both 16-bit types ([`HalfType`]).

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use cudarc::driver::{CudaSlice, CudaViewMut, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use super::cuda::{copy_error, CudaBuf, CudaOps};
use super::memory::Counted;
use super::ops::Arg;
use super::products::Kept;
use crate::gemm::{BlasFloat, MatMul};
use crate::host::CastFloat;
use crate::{launch, KernelError};

/// How [`CudaOps`] multiplies matrices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Products {
    /// f32 operands, f32 sums (cuBLAS without TF32): the default.
    #[default]
    F32,
    /// Mixed precision as `torch.autocast(dtype=torch.bfloat16)` does for products: both
    /// operands rounded to bf16 (the cast kernel), bf16 tensor-core products with f32 sums and
    /// an f32 result; every other operation stays f32. The host twin is
    /// [`HostProducts::Bf16Operands`](super::HostProducts::Bf16Operands).
    Bf16,
    /// The same with f16 operands (`torch.autocast(dtype=torch.float16)`'s products): an
    /// operand past f16's range becomes infinite, so f16 products train with a grad scaler
    /// whose scale keeps the gradients' operands in range. The host twin is
    /// [`HostProducts::F16Operands`](super::HostProducts::F16Operands).
    F16,
}

impl Products {
    /// The dtype products round their operands to: bf16, f16, or `None` (f32 operands).
    pub fn half(self) -> Option<fsdp_device::DType> {
        match self {
            Products::F32 => None,
            Products::Bf16 => Some(fsdp_device::DType::BF16),
            Products::F16 => Some(fsdp_device::DType::F16),
        }
    }
}

/// An activation of [`CudaOps`] kept as an operand ([`GptOps::operand`](super::GptOps::operand)): in bf16 with
/// [`Products::Bf16`](super::Products::Bf16), in f16 with
/// [`Products::F16`](super::Products::F16), else the f32 buffer itself.
#[derive(Debug)]
pub enum CudaOperand {
    /// The f32 buffer (f32 products).
    F32(CudaBuf),
    /// Its bf16 rounding (bf16 products).
    Bf16(Counted<CudaSlice<bf16>>),
    /// Its f16 rounding (f16 products).
    F16(Counted<CudaSlice<f16>>),
}

impl CudaOperand {
    /// The values as `H`.
    fn half<H: HalfType>(&self) -> Result<&CudaSlice<H>, KernelError> {
        H::of(self).ok_or_else(|| KernelError::InvalidArgument {
            kernel: "gemm",
            reason: format!(
                "an operand of another type in a {} product",
                <H as BlasFloat>::NAME
            ),
        })
    }

    /// Its elements.
    pub(super) fn len(&self) -> usize {
        match self {
            CudaOperand::F32(b) => b.len(),
            CudaOperand::Bf16(b) => b.len(),
            CudaOperand::F16(b) => b.len(),
        }
    }
}

/// The 16-bit types products round their operands to: their [`CudaOperand`] and the
/// [`CudaOps`]' kept copies of that type.
pub(super) trait HalfType:
    CastFloat + BlasFloat + DeviceRepr + ValidAsZeroBits + Unpin + Send + Sync
{
    /// The operand's values, if of this type.
    fn of(op: &CudaOperand) -> Option<&CudaSlice<Self>>;
    /// An operand of these values.
    fn wrap(s: Counted<CudaSlice<Self>>) -> CudaOperand;
    /// The kept copies of this type.
    fn kept(ops: &CudaOps) -> &Mutex<[Kept<CudaSlice<Self>>; 2]>;
}

impl HalfType for bf16 {
    fn of(op: &CudaOperand) -> Option<&CudaSlice<bf16>> {
        match op {
            CudaOperand::Bf16(b) => Some(b),
            _ => None,
        }
    }
    fn wrap(s: Counted<CudaSlice<bf16>>) -> CudaOperand {
        CudaOperand::Bf16(s)
    }
    fn kept(ops: &CudaOps) -> &Mutex<[Kept<CudaSlice<bf16>>; 2]> {
        &ops.operands
    }
}

impl HalfType for f16 {
    fn of(op: &CudaOperand) -> Option<&CudaSlice<f16>> {
        match op {
            CudaOperand::F16(b) => Some(b),
            _ => None,
        }
    }
    fn wrap(s: Counted<CudaSlice<f16>>) -> CudaOperand {
        CudaOperand::F16(s)
    }
    fn kept(ops: &CudaOps) -> &Mutex<[Kept<CudaSlice<f16>>; 2]> {
        &ops.operands_f16
    }
}

/// An f32 product's operand.
pub(super) fn f32_arg(a: Arg<'_, CudaOps>) -> Result<&CudaSlice<f32>, KernelError> {
    match a {
        Arg::Buf(b) | Arg::Operand(CudaOperand::F32(b)) => Ok(b),
        Arg::Operand(_) => Err(KernelError::InvalidArgument {
            kernel: "gemm",
            reason: "a 16-bit operand in an f32 product".into(),
        }),
    }
}

impl CudaOps {
    /// `c = alpha·op(H(a))·op(H(b)) + beta·c`, the operands cast into the kept copies.
    pub(super) fn gemm_half<H: HalfType>(
        &self,
        g: &MatMul,
        a: Arg<'_, CudaOps>,
        b: Arg<'_, CudaOps>,
        c: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let mut kept = H::kept(self)
            .lock()
            .map_err(|_| copy_error("16-bit operands", "poisoned lock"))?;
        let [ka, kb] = &mut *kept;
        // Each operand's part alone is cast (a product may read part of a buffer); a kept
        // operand is rounded already.
        g.check_operands(a.len(), b.len(), c.len())?;
        let (ea, eb, _) = g.extents();
        let (ca, cb);
        let va = match a {
            Arg::Buf(a) => {
                ca = self.cast_into(ka, a, g.offset_a..ea)?;
                ca.as_view()
            }
            Arg::Operand(a) => a.half::<H>()?.slice(g.offset_a..ea),
        };
        let vb = match b {
            Arg::Buf(b) => {
                cb = self.cast_into(kb, b, g.offset_b..eb)?;
                cb.as_view()
            }
            Arg::Operand(b) => b.half::<H>()?.slice(g.offset_b..eb),
        };
        self.blas
            .matmul::<H, f32>(&g.operands_from_start(), &va, &vb, c)
    }
}

impl CudaOps {
    /// `src[range]` rounded to `H` into the front of `kept` (replaced by a larger copy when
    /// short), unless `kept` holds it already (the same part of the same buffer, unwritten
    /// since: see [`operand_casts`](CudaOps::operand_casts)).
    fn cast_into<'a, H: HalfType>(
        &self,
        kept: &'a mut Kept<CudaSlice<H>>,
        src: &CudaBuf,
        range: std::ops::Range<usize>,
    ) -> Result<CudaViewMut<'a, H>, KernelError> {
        let n = range.len();
        let part = src.slice(range.clone());
        let cast = kept.refill(
            src.stamp(),
            range,
            |c: &CudaSlice<H>| c.len(),
            // SAFETY: zeroed.
            |n| unsafe { self.device_slice::<H>(n, true) },
            |copy| launch::cast::<f32, H>(&self.cuda, &part, &mut copy.slice_mut(..n)),
        )?;
        if cast {
            self.casts.fetch_add(1, Ordering::Relaxed);
        }
        match &mut kept.copy {
            Some(copy) => Ok(copy.slice_mut(..n)),
            None => Err(copy_error("16-bit operands", "no kept copy")),
        }
    }

    /// How many times a product's operand was cast into a kept bf16 or f16 copy so far (with
    /// [`Products::Bf16`](super::Products::Bf16) or [`Products::F16`](super::Products::F16)). Each of the two operand positions keeps its copy and the stamp of
    /// the buffer it was cast from; a product whose operand is that buffer, unwritten since
    /// (every write borrows it mutably, which renews the stamp), uses the copy as it is. The
    /// backward's `dY` of a linear layer, the attention's `dS` and the head's `dlogits` each
    /// feed two products in a row, so each is cast once. [`HostOps`](super::HostOps) counts
    /// the same ([`HostOps::operand_roundings`](super::HostOps::operand_roundings)).
    pub fn operand_casts(&self) -> u64 {
        self.casts.load(Ordering::Relaxed)
    }
}

impl CudaOps {
    /// A new `H` operand of `n` elements that `write` (a kernel writing every element) fills,
    /// counted as one rounding of an operand: a result only products read, written in bf16 or
    /// f16 by its own kernel.
    pub(super) fn written_as<H: HalfType>(
        &self,
        n: usize,
        write: impl FnOnce(&mut Counted<CudaSlice<H>>) -> Result<(), KernelError>,
    ) -> Result<CudaOperand, KernelError> {
        // SAFETY: device memory of `n` H whose bits are whatever the pool held; any bits are
        // an H, and `write` writes every element before anything reads it.
        let mut y = unsafe { self.device_slice::<H>(n, false) }?;
        write(&mut y)?;
        self.casts.fetch_add(1, Ordering::Relaxed);
        Ok(H::wrap(y))
    }

    /// `buf` rounded to `H` (the cast kernel) as a kept operand, `buf` freed.
    pub(super) fn operand_as<H: HalfType>(&self, buf: CudaBuf) -> Result<CudaOperand, KernelError> {
        self.written_as::<H>(buf.len(), |kept| {
            launch::cast::<f32, H>(&self.cuda, &*buf, &mut **kept)
        })
    }
}

/// `$ops.written_as` in the 16-bit type of `$ops`' products (bf16 unless f16), with the same
/// writer `|$y| $body` for either type: a result only products read, written rounded.
macro_rules! written_half {
    ($ops:expr, $n:expr, |$y:ident| $body:expr) => {
        match $ops.products {
            $crate::gpt::Products::F16 => $ops.written_as::<half::f16>($n, |$y| $body),
            _ => $ops.written_as::<half::bf16>($n, |$y| $body),
        }
    };
}
pub(super) use written_half;
