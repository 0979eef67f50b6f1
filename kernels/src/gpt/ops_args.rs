//! What [`GptOps`](super::GptOps)' methods take beside buffers: a product's operands
//! ([`Arg`]), a tensor of a step's optimizer ([`DecidedTensor`]), and the checks of rows and
//! slots the implementations share.

use super::ops::GptOps;
use crate::KernelError;

/// One tensor of [`GptOps::adamw_decided_many`] and [`GptOps::anyprecision_decided_many`]:
/// the parameter, its gradient, both moments, `AnyPrecisionAdamW`'s compensation and whether
/// its scalar set is the one with weight decay.
pub struct DecidedTensor<'a, B> {
    /// The parameter, updated.
    pub param: &'a mut B,
    /// Its gradient.
    pub grad: &'a B,
    /// The first moment, updated.
    pub exp_avg: &'a mut B,
    /// The second moment, updated.
    pub exp_avg_sq: &'a mut B,
    /// `AnyPrecisionAdamW`'s Kahan compensation, updated (`None` for AdamW and without
    /// Kahan summation).
    pub compensation: Option<&'a mut B>,
    /// Whether weight decay applies (`choices[1]`, else `choices[0]`).
    pub decay: bool,
}

/// `values` into the slots `at..` of host scalars (the twins' and the meta operations'
/// [`GptOps::write_scalars`]), checked to lie within them.
pub(super) fn write_slots(
    scalars: &mut [f64],
    at: usize,
    values: &[f64],
) -> Result<(), KernelError> {
    let end = scalar_slots(scalars.len(), at, values.len())?;
    scalars[at..end].copy_from_slice(values);
    Ok(())
}

/// The end of slots `at..at + n` of a scalar buffer of `len`, checked to lie within it.
pub(super) fn scalar_slots(len: usize, at: usize, n: usize) -> Result<usize, KernelError> {
    at.checked_add(n)
        .filter(|&end| end <= len)
        .ok_or_else(|| KernelError::InvalidArgument {
            kernel: "write_scalars",
            reason: format!("slots {at}..{at}+{n} of a scalar buffer of {len}"),
        })
}

/// The rows `first..first + logits / v` of a chunk's cross-entropy
/// ([`GptOps::cross_entropy_fused_in_place`]), checked within `targets` and `losses`.
pub(super) fn loss_rows(
    logits: usize,
    v: usize,
    first: usize,
    targets: usize,
    losses: usize,
) -> Result<std::ops::Range<usize>, KernelError> {
    let rows = logits.checked_div(v).unwrap_or(0);
    let end = first.saturating_add(rows);
    for (what, have) in [("targets", targets), ("losses", losses)] {
        if end > have {
            return Err(KernelError::Length {
                kernel: "cross_entropy_fused_in_place",
                what,
                expected: end,
                actual: have,
            });
        }
    }
    Ok(first..end)
}

/// One operand of a product ([`GptOps::gemm_args`]): an f32 buffer, or an activation kept as
/// an operand ([`GptOps::operand`]).
pub enum Arg<'a, O: GptOps + ?Sized> {
    /// An f32 buffer.
    Buf(&'a O::Buf),
    /// An activation kept as an operand.
    Operand(&'a O::Operand),
}

impl<O: GptOps + ?Sized> Clone for Arg<'_, O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<O: GptOps + ?Sized> Copy for Arg<'_, O> {}

impl<O: GptOps + ?Sized> Arg<'_, O> {
    /// Elements of the operand.
    pub fn len(&self) -> usize {
        match self {
            Arg::Buf(b) => O::buf_len(b),
            Arg::Operand(o) => O::operand_len(o),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
