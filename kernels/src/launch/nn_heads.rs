//! Launch functions of the bias add and the attention heads' permutations
//! (`cu/nn_embed_heads.cu`), each bitwise equal to its twin in [`host::nn`](crate::host::nn).

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::enqueue;
use super::plan::{self, heads_merge_kernel, heads_split_kernel};
use crate::host::nn::{rows_of, HeadsLayout};
use crate::host::CastFloat;
use crate::KernelError;

/// Bias add over rows, `y[r, j] += bias[j]` (see
/// [`host::nn::bias_add`](crate::host::nn::bias_add)).
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
pub fn bias_add(
    stream: &CudaStream,
    y: &mut impl DevicePtrMut<f32>,
    bias: &impl DevicePtr<f32>,
) -> Result<(), KernelError> {
    let k = "bias_add_f32";
    let c = bias.len();
    let n = y.len();
    rows_of(k, "y", n, c)?;
    if n == 0 {
        return Ok(());
    }
    let (yp, _y) = y.device_ptr_mut(stream);
    let (bp, _b) = bias.device_ptr(stream);
    // SAFETY: `n` elements of y, a multiple of `c > 0`, and `c` of bias (checked above), both
    // held.
    unsafe { enqueue(stream, &plan::bias_add(yp, bp, n, c)) }
}

/// Attention heads out of token rows into dense `[b, h, t, d]` (see
/// [`host::nn::heads_split`](crate::host::nn::heads_split)), written as `D`: f32, or rounded
/// to bf16 or f16.
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
pub fn heads_split<D: CastFloat>(
    stream: &CudaStream,
    rows: &impl DevicePtr<f32>,
    l: HeadsLayout,
    out: &mut impl DevicePtrMut<D>,
) -> Result<(), KernelError> {
    let k = heads_split_kernel::<D>()?;
    l.check(k, rows.len(), out.len())?;
    if l.heads_len() == 0 {
        return Ok(());
    }
    let (sp, _s) = rows.device_ptr(stream);
    let (dp, _d) = out.device_ptr_mut(stream);
    let launches = plan::heads_split::<D>(sp, dp, l)?;
    // SAFETY: the rows side of b·t·row f32 and the heads side of b·h·t·d elements of `D`
    // (checked by `HeadsLayout::check`, with offset + h·d ≤ row), so every index is inside its
    // buffer; both held.
    unsafe { enqueue(stream, &launches) }
}

/// The inverse of [`heads_split`]: dense heads into their places in token rows (see
/// [`host::nn::heads_merge`](crate::host::nn::heads_merge)), written as `D`: f32, or rounded
/// to bf16 or f16.
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
pub fn heads_merge<D: CastFloat>(
    stream: &CudaStream,
    src: &impl DevicePtr<f32>,
    l: HeadsLayout,
    rows: &mut impl DevicePtrMut<D>,
) -> Result<(), KernelError> {
    let k = heads_merge_kernel::<D>()?;
    l.check(k, rows.len(), src.len())?;
    if l.heads_len() == 0 {
        return Ok(());
    }
    let (sp, _s) = src.device_ptr(stream);
    let (dp, _d) = rows.device_ptr_mut(stream);
    let launches = plan::heads_merge::<D>(sp, dp, l)?;
    // SAFETY: as in `heads_split`, the other way: b·h·t·d f32 read, their places in b·t·row
    // elements of `D` written; both held.
    unsafe { enqueue(stream, &launches) }
}
