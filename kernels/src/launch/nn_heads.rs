//! Launch functions of the bias add and the attention heads' permutations
//! (`cu/nn_embed_heads.cu`), each bitwise equal to its twin in [`host::nn`](crate::host::nn).

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

use super::nn::writing;
use super::{config, driver, function};
use crate::host::nn::{rows_of, HeadsLayout};
use crate::host::CastFloat;
use crate::{KernelError, Program};

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
    let f = function(stream, Program::Nn, k)?;
    let (yp, _y) = y.device_ptr_mut(stream);
    let (bp, _b) = bias.device_ptr(stream);
    let (n64, c32) = (n as u64, c as u32);
    let mut b = stream.launch_builder(&f);
    b.arg(&yp).arg(&bp).arg(&n64).arg(&c32);
    // SAFETY: (float* y [n], const float* b [c], u64 n, u32 c > 0), n a multiple of c.
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", k, e))?;
    Ok(())
}

fn heads(
    stream: &CudaStream,
    k: &'static str,
    src: u64,
    dst: u64,
    l: HeadsLayout,
) -> Result<(), KernelError> {
    let f = function(stream, Program::Nn, k)?;
    let a = [l.b, l.t, l.h, l.d, l.row, l.offset].map(|v| v as u32);
    let mut b = stream.launch_builder(&f);
    b.arg(&src).arg(&dst);
    for v in &a {
        b.arg(v);
    }
    // SAFETY: (const float* src, D* dst, u32 b, t, h, d, row, offset) with D the kernel's
    // (`writing`: the caller's destination type), the rows side
    // of b·t·row elements, the heads side of b·h·t·d, and offset + h·d ≤ row (checked by
    // `HeadsLayout::check`), so every index is inside its buffer.
    unsafe { b.launch(config(l.heads_len())) }.map_err(|e| driver("cuLaunchKernel", k, e))?;
    Ok(())
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
    let k = writing::<D>(["heads_split_f32", "heads_split_bf16", "heads_split_f16"])?;
    l.check(k, rows.len(), out.len())?;
    if l.heads_len() == 0 {
        return Ok(());
    }
    let (sp, _s) = rows.device_ptr(stream);
    let (dp, _d) = out.device_ptr_mut(stream);
    heads(stream, k, sp, dp, l)
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
    let k = writing::<D>(["heads_merge_f32", "heads_merge_bf16", "heads_merge_f16"])?;
    l.check(k, rows.len(), src.len())?;
    if l.heads_len() == 0 {
        return Ok(());
    }
    let (sp, _s) = src.device_ptr(stream);
    let (dp, _d) = rows.device_ptr_mut(stream);
    heads(stream, k, sp, dp, l)
}
