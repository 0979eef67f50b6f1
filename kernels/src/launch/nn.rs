//! Launch functions of the GPT's layers (`cu/nn.cu`), each bitwise equal to its twin in
//! [`host::nn`](crate::host::nn), whose documentation gives the formulas, the order of every
//! reduction and whether a backward writes or accumulates. Shapes are checked as the twins
//! check them, before anything is launched; device data (ids, targets) cannot be checked: an
//! id or target out of range gives NaN rows, as the twins.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::plan::{self, causal_softmax_backward_kernel, causal_softmax_forward_both_kernel};
use super::plan::{causal_softmax_forward_kernel, gelu_forward_kernel, layernorm_forward_kernel};
use super::{driver, enqueue};
use crate::host::nn::{check_ln_backward, check_ln_forward, rows_of, softmax_rows};
use crate::host::{same_len, CastFloat};
use crate::KernelError;

pub use super::plan::{per_column_tile, per_row, per_warp_row};

/// A column reduction's scratch of `len` f32 chunk sums (`plan::*_scratch`).
fn chunk_sums(
    stream: &Arc<CudaStream>,
    kernel: &'static str,
    len: usize,
) -> Result<CudaSlice<f32>, KernelError> {
    // SAFETY: uninitialised device memory, never read before written: the chunk kernel
    // (`bias_grad_f32`, `layernorm_backward_params_f32`) writes every entry — each chunk
    // and each column, both grid-stride — before `column_chunks_add_f32`, later on the same
    // stream, reads them. No fill: a memset a call saved.
    unsafe { stream.alloc::<f32>(len) }.map_err(|e| driver("cuMemAllocAsync", kernel, e))
}

/// Layer norm forward (see [`host::nn::layernorm_forward`](crate::host::nn::layernorm_forward)),
/// `y` written as `Y`: f32, or its bf16 or f16 rounding.
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<Y: CastFloat>(
    stream: &CudaStream,
    x: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    bias: &impl DevicePtr<f32>,
    eps: f32,
    y: &mut impl DevicePtrMut<Y>,
    mean: &mut impl DevicePtrMut<f32>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let k = layernorm_forward_kernel::<Y>()?;
    let c = weight.len();
    let n = check_ln_forward(k, x.len(), c, bias.len(), y.len(), mean.len(), rstd.len())?;
    if n == 0 {
        return Ok(());
    }
    let (xp, _x) = x.device_ptr(stream);
    let (wp, _w) = weight.device_ptr(stream);
    let (bp, _b) = bias.device_ptr(stream);
    let (yp, _y) = y.device_ptr_mut(stream);
    let (mp, _m) = mean.device_ptr_mut(stream);
    let (rp, _r) = rstd.device_ptr_mut(stream);
    let launches = plan::layernorm_forward::<Y>(xp, wp, bp, eps, yp, mp, rp, n, c)?;
    // SAFETY: `x` and `y` hold `n·c` elements, `weight` and `bias` `c`, `mean` and `rstd` `n`
    // (checked above), all held (`_x` … `_r`).
    unsafe { enqueue(stream, &launches) }
}

/// Layer norm backward, input part (accumulates into `dx`; see
/// [`host::nn::layernorm_backward_input`](crate::host::nn::layernorm_backward_input)).
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
pub fn layernorm_backward_input(
    stream: &CudaStream,
    dy: &impl DevicePtr<f32>,
    x: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    mean: &impl DevicePtr<f32>,
    rstd: &impl DevicePtr<f32>,
    dx: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let k = "layernorm_backward_input_f32";
    let c = weight.len();
    let n = check_ln_backward(k, dy.len(), x.len(), c, mean.len(), rstd.len())?;
    same_len(k, "dx", x.len(), dx.len())?;
    if n == 0 {
        return Ok(());
    }
    let (gp, _g) = dy.device_ptr(stream);
    let (xp, _x) = x.device_ptr(stream);
    let (wp, _w) = weight.device_ptr(stream);
    let (mp, _m) = mean.device_ptr(stream);
    let (rp, _r) = rstd.device_ptr(stream);
    let (dp, _d) = dx.device_ptr_mut(stream);
    let launches = plan::layernorm_backward_input(gp, xp, wp, mp, rp, dp, n, c)?;
    // SAFETY: `dy`, `x` and `dx` hold `n·c` f32, `weight` `c`, `mean` and `rstd` `n` (checked
    // above), all held.
    unsafe { enqueue(stream, &launches) }
}

/// Layer norm backward, parameter part (accumulates; see
/// [`host::nn::layernorm_backward_params`](crate::host::nn::layernorm_backward_params)).
///
/// # Errors
/// Shape errors as the twin; allocation, compile, load and launch failures.
pub fn layernorm_backward_params(
    stream: &Arc<CudaStream>,
    dy: &impl DevicePtr<f32>,
    x: &impl DevicePtr<f32>,
    mean: &impl DevicePtr<f32>,
    rstd: &impl DevicePtr<f32>,
    dweight: &mut impl DevicePtrMut<f32>,
    dbias: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let k = "layernorm_backward_params_f32";
    let c = dweight.len();
    let n = check_ln_backward(k, dy.len(), x.len(), c, mean.len(), rstd.len())?;
    same_len(k, "dbias", c, dbias.len())?;
    if n == 0 {
        return Ok(());
    }
    let len = plan::layernorm_backward_params_scratch(n, c)?;
    // Freed in stream order when dropped, after the kernels that use them.
    let mut pw = chunk_sums(stream, k, len)?;
    let mut pb = chunk_sums(stream, k, len)?;
    let (gp, _g) = dy.device_ptr(stream);
    let (xp, _x) = x.device_ptr(stream);
    let (mp, _m) = mean.device_ptr(stream);
    let (rp, _r) = rstd.device_ptr(stream);
    let (pwp, _pw) = pw.device_ptr_mut(stream);
    let (pbp, _pb) = pb.device_ptr_mut(stream);
    let (dwp, _dw) = dweight.device_ptr_mut(stream);
    let (dbp, _db) = dbias.device_ptr_mut(stream);
    let launches = plan::layernorm_backward_params(gp, xp, mp, rp, pwp, pbp, dwp, dbp, n, c)?;
    // SAFETY: `dy` and `x` hold `n·c` f32, `mean` and `rstd` `n`, `dweight` and `dbias` `c`
    // (checked above), the scratches `len` each (the plan's chunks × `c`); all held.
    unsafe { enqueue(stream, &launches) }
}

/// Exact GELU forward (see [`host::nn::gelu_forward`](crate::host::nn::gelu_forward)), `y`
/// written as `Y`: f32, or its bf16 or f16 rounding.
///
/// # Errors
/// [`KernelError::Length`]; compile, load and launch failures.
pub fn gelu_forward<Y: CastFloat>(
    stream: &CudaStream,
    x: &impl DevicePtr<f32>,
    y: &mut impl DevicePtrMut<Y>,
) -> Result<(), KernelError> {
    let k = gelu_forward_kernel::<Y>()?;
    let n = x.len();
    same_len(k, "y", n, y.len())?;
    if n == 0 {
        return Ok(());
    }
    let (xp, _x) = x.device_ptr(stream);
    let (yp, _y) = y.device_ptr_mut(stream);
    let launches = plan::gelu_forward::<Y>(xp, yp, n)?;
    // SAFETY: `x` and `y` hold `n` elements each (checked above), both held.
    unsafe { enqueue(stream, &launches) }
}

/// GELU backward, written into `dx` (see
/// [`host::nn::gelu_backward`](crate::host::nn::gelu_backward)).
///
/// # Errors
/// [`KernelError::Length`]; compile, load and launch failures.
pub fn gelu_backward(
    stream: &CudaStream,
    x: &impl DevicePtr<f32>,
    dy: &impl DevicePtr<f32>,
    dx: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let k = "gelu_backward_f32";
    let n = x.len();
    same_len(k, "dy", n, dy.len())?;
    same_len(k, "dx", n, dx.len())?;
    if n == 0 {
        return Ok(());
    }
    let (xp, _x) = x.device_ptr(stream);
    let (gp, _g) = dy.device_ptr(stream);
    let (dp, _d) = dx.device_ptr_mut(stream);
    // SAFETY: `x`, `dy` and `dx` hold `n` f32 each (checked above), all held.
    unsafe { enqueue(stream, &plan::gelu_backward(xp, gp, dp, n)) }
}

/// Causal softmax forward over `t × t` score matrices (see
/// [`host::nn::causal_softmax_forward`](crate::host::nn::causal_softmax_forward)), the
/// probabilities written as `P`: f32, or their bf16 or f16 rounding.
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
pub fn causal_softmax_forward<P: CastFloat>(
    stream: &CudaStream,
    scores: &impl DevicePtr<f32>,
    t: usize,
    scale: f32,
    probs: &mut impl DevicePtrMut<P>,
) -> Result<(), KernelError> {
    let k = causal_softmax_forward_kernel::<P>()?;
    let rows = softmax_rows(k, scores.len(), t)?;
    same_len(k, "probs", scores.len(), probs.len())?;
    if rows == 0 {
        return Ok(());
    }
    let (sp, _s) = scores.device_ptr(stream);
    let (pp, _p) = probs.device_ptr_mut(stream);
    let launches = plan::causal_softmax_forward::<P>(sp, t, scale, pp, rows)?;
    // SAFETY: `scores` and `probs` hold the `rows` rows of `t` (checked above), both held.
    unsafe { enqueue(stream, &launches) }
}

/// [`causal_softmax_forward`] into f32 `probs` and, in the same pass, their bf16 or f16
/// rounding `H` into `rounded` (as [`cast`](super::cast) rounds): the probabilities a
/// backward reads in f32 and a product reads.
///
/// # Errors
/// Shape errors as the twin; `H` f32; compile, load and launch failures.
pub fn causal_softmax_forward_both<H: CastFloat>(
    stream: &CudaStream,
    scores: &impl DevicePtr<f32>,
    t: usize,
    scale: f32,
    probs: &mut impl DevicePtrMut<f32>,
    rounded: &mut impl DevicePtrMut<H>,
) -> Result<(), KernelError> {
    let k = causal_softmax_forward_both_kernel::<H>()?;
    let rows = softmax_rows(k, scores.len(), t)?;
    same_len(k, "probs", scores.len(), probs.len())?;
    same_len(k, "rounded", scores.len(), rounded.len())?;
    if rows == 0 {
        return Ok(());
    }
    let (sp, _s) = scores.device_ptr(stream);
    let (pp, _p) = probs.device_ptr_mut(stream);
    let (bp, _b) = rounded.device_ptr_mut(stream);
    let launches = plan::causal_softmax_forward_both::<H>(sp, t, scale, pp, bp, rows)?;
    // SAFETY: `scores`, `probs` and `rounded` hold the `rows` rows of `t` (checked above),
    // all held.
    unsafe { enqueue(stream, &launches) }
}

/// Causal softmax backward, written into `dscores` (see
/// [`host::nn::causal_softmax_backward`](crate::host::nn::causal_softmax_backward)) as `D`:
/// f32, or its bf16 or f16 rounding.
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
pub fn causal_softmax_backward<D: CastFloat>(
    stream: &CudaStream,
    probs: &impl DevicePtr<f32>,
    dprobs: &impl DevicePtr<f32>,
    t: usize,
    scale: f32,
    dscores: &mut impl DevicePtrMut<D>,
) -> Result<(), KernelError> {
    let k = causal_softmax_backward_kernel::<D>()?;
    let rows = softmax_rows(k, probs.len(), t)?;
    same_len(k, "dprobs", probs.len(), dprobs.len())?;
    same_len(k, "dscores", probs.len(), dscores.len())?;
    if rows == 0 {
        return Ok(());
    }
    let (pp, _p) = probs.device_ptr(stream);
    let (gp, _g) = dprobs.device_ptr(stream);
    let (dp, _d) = dscores.device_ptr_mut(stream);
    let launches = plan::causal_softmax_backward::<D>(pp, gp, t, scale, dp, rows)?;
    // SAFETY: `probs`, `dprobs` and `dscores` hold the `rows` rows of `t` (checked above),
    // all held.
    unsafe { enqueue(stream, &launches) }
}

/// Bias gradient, the column sums of `dy` accumulated into `dbias` in row order (see
/// [`host::nn::bias_grad`](crate::host::nn::bias_grad)).
///
/// # Errors
/// Shape errors as the twin; allocation, compile, load and launch failures.
pub fn bias_grad(
    stream: &Arc<CudaStream>,
    dy: &impl DevicePtr<f32>,
    dbias: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let k = "bias_grad_f32";
    let c = dbias.len();
    let n = rows_of(k, "dy", dy.len(), c)?;
    if n == 0 {
        return Ok(());
    }
    let len = plan::bias_grad_scratch(n, c)?;
    // Freed in stream order when dropped, after the kernels that use it.
    let mut part = chunk_sums(stream, k, len)?;
    let (gp, _g) = dy.device_ptr(stream);
    let (pp, _p) = part.device_ptr_mut(stream);
    let (dp, _d) = dbias.device_ptr_mut(stream);
    let launches = plan::bias_grad(gp, pp, dp, n, c)?;
    // SAFETY: `dy` holds `n·c` f32 and `dbias` `c` (checked above), the scratch `len` (the
    // plan's chunks × `c`); all held.
    unsafe { enqueue(stream, &launches) }
}
