//! Launch functions of the GPT's layers (`cu/nn.cu`), each bitwise equal to its twin in
//! [`host::nn`](crate::host::nn), whose documentation gives the formulas, the order of every
//! reduction and whether a backward writes or accumulates. Shapes are checked as the twins
//! check them, before anything is launched; device data (ids, targets) cannot be checked: an
//! id or target out of range gives NaN rows, as the twins.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{config, driver, function};
use crate::host::nn::{
    check_ln_backward, check_ln_forward, rows_of, softmax_rows, NN_BLOCK, NN_COL_CHUNK,
    NN_COL_GROUPS, NN_WARP,
};
use crate::host::{same_len, CastFloat};
use crate::{KernelError, Program};

/// One block of [`NN_BLOCK`] threads per row (the layer norms, the cross-entropy).
///
/// # Errors
/// More rows than the grid's 2^31 − 1 blocks.
pub fn per_row(kernel: &'static str, rows: usize) -> Result<LaunchConfig, KernelError> {
    let grid = u32::try_from(rows)
        .ok()
        .filter(|&g| g <= i32::MAX as u32)
        .ok_or_else(|| KernelError::InvalidArgument {
            kernel,
            reason: format!("{rows} rows exceed the grid's 2^31 - 1 blocks"),
        })?;
    Ok(LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (NN_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// One warp of [`NN_WARP`] lanes per row, `NN_BLOCK / NN_WARP` rows a block (the causal
/// softmaxes).
///
/// # Errors
/// As [`per_row`].
pub fn per_warp_row(kernel: &'static str, rows: usize) -> Result<LaunchConfig, KernelError> {
    let mut cfg = per_row(kernel, rows.div_ceil(NN_BLOCK / NN_WARP))?;
    cfg.block_dim = (NN_BLOCK as u32, 1, 1);
    Ok(cfg)
}

/// A column reduction's blocks: 32 columns × [`NN_COL_GROUPS`] row groups each, one block per
/// 32 columns and chunk of [`NN_COL_CHUNK`] rows (the kernels loop over tiles and chunks past
/// the grid's limits).
pub fn per_column_tile(columns: usize, rows: usize) -> LaunchConfig {
    let tiles = columns.div_ceil(32).clamp(1, 1 << 16) as u32;
    let chunks = rows.div_ceil(NN_COL_CHUNK).clamp(1, u16::MAX as usize) as u32;
    LaunchConfig {
        grid_dim: (tiles, chunks, 1),
        block_dim: (32, NN_COL_GROUPS as u32, 1),
        shared_mem_bytes: 0,
    }
}

/// The scratch of a column reduction over `rows` rows of `columns`: one sum per chunk and
/// column, and the number of chunks.
fn chunk_sums(
    stream: &Arc<CudaStream>,
    kernel: &'static str,
    rows: usize,
    columns: usize,
) -> Result<(CudaSlice<f32>, u32), KernelError> {
    let chunks = rows.div_ceil(NN_COL_CHUNK);
    let c32 = u32::try_from(chunks).map_err(|_| KernelError::InvalidArgument {
        kernel,
        reason: format!("{rows} rows are more than 2^32 chunks"),
    })?;
    // SAFETY: uninitialised device memory, never read before written: the chunk kernel
    // (`bias_grad_f32`, `layernorm_backward_params_f32`) writes every entry — each chunk below
    // `chunks` and each column below `columns`, both grid-stride — before `add_chunks`, later
    // on the same stream, reads them. No fill: a memset a call saved.
    let part = unsafe { stream.alloc::<f32>(chunks.saturating_mul(columns)) }
        .map_err(|e| driver("cuMemAllocAsync", kernel, e))?;
    Ok((part, c32))
}

/// `acc[j] += part[0, j], part[1, j], …` in chunk order: the last step of a column reduction.
fn add_chunks(
    stream: &Arc<CudaStream>,
    part: &CudaSlice<f32>,
    chunks: u32,
    acc: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let k = "column_chunks_add_f32";
    let c = acc.len();
    let f = function(stream, Program::Nn, k)?;
    let (pp, _p) = part.device_ptr(stream);
    let (ap, _a) = acc.device_ptr_mut(stream);
    let c32 = c as u32;
    let mut b = stream.launch_builder(&f);
    b.arg(&pp).arg(&ap).arg(&chunks).arg(&c32);
    // SAFETY: (const float* part [chunks·c], float* acc [c], u32 chunks, u32 c): `part` holds
    // `chunks` rows of `c` (chunk_sums made it so), `acc` is `c` long.
    launched(k, unsafe { b.launch(config(c)) })
}

pub(super) fn launched<T>(
    kernel: &'static str,
    r: Result<T, cudarc::driver::DriverError>,
) -> Result<(), KernelError> {
    r.map(drop).map_err(|e| driver("cuLaunchKernel", kernel, e))
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
    let k = writing::<Y>([
        "layernorm_forward_f32",
        "layernorm_forward_bf16",
        "layernorm_forward_f16",
    ])?;
    let c = weight.len();
    let n = check_ln_forward(k, x.len(), c, bias.len(), y.len(), mean.len(), rstd.len())?;
    if n == 0 {
        return Ok(());
    }
    let cfg = per_row(k, n)?;
    let f = function(stream, Program::Nn, k)?;
    let (xp, _x) = x.device_ptr(stream);
    let (wp, _w) = weight.device_ptr(stream);
    let (bp, _b) = bias.device_ptr(stream);
    let (yp, _y) = y.device_ptr_mut(stream);
    let (mp, _m) = mean.device_ptr_mut(stream);
    let (rp, _r) = rstd.device_ptr_mut(stream);
    let c32 = c as u32;
    let mut b = stream.launch_builder(&f);
    b.arg(&xp)
        .arg(&wp)
        .arg(&bp)
        .arg(&yp)
        .arg(&mp)
        .arg(&rp)
        .arg(&c32)
        .arg(&eps);
    // SAFETY: (const float* x [n·c], w [c], b [c], Y* y [n·c], float* mean [n], rstd [n],
    // u32 c, float eps) with Y the kernel's (`writing`), one block per row of the `n` checked
    // above.
    launched(k, unsafe { b.launch(cfg) })
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
    let cfg = per_row(k, n)?;
    let f = function(stream, Program::Nn, k)?;
    let (gp, _g) = dy.device_ptr(stream);
    let (xp, _x) = x.device_ptr(stream);
    let (wp, _w) = weight.device_ptr(stream);
    let (mp, _m) = mean.device_ptr(stream);
    let (rp, _r) = rstd.device_ptr(stream);
    let (dp, _d) = dx.device_ptr_mut(stream);
    let c32 = c as u32;
    let mut b = stream.launch_builder(&f);
    b.arg(&gp)
        .arg(&xp)
        .arg(&wp)
        .arg(&mp)
        .arg(&rp)
        .arg(&dp)
        .arg(&c32);
    // SAFETY: (const float* dy [n·c], x [n·c], w [c], mean [n], rstd [n], float* dx [n·c],
    // u32 c), one block per row.
    launched(k, unsafe { b.launch(cfg) })
}

/// Layer norm backward, parameter part (accumulates; see
/// [`host::nn::layernorm_backward_params`](crate::host::nn::layernorm_backward_params)).
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
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
    let f = function(stream, Program::Nn, k)?;
    let (mut pw, chunks) = chunk_sums(stream, k, n, c)?;
    let (mut pb, _) = chunk_sums(stream, k, n, c)?;
    {
        let (gp, _g) = dy.device_ptr(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (mp, _m) = mean.device_ptr(stream);
        let (rp, _r) = rstd.device_ptr(stream);
        let (wp, _w) = pw.device_ptr_mut(stream);
        let (bp, _b) = pb.device_ptr_mut(stream);
        let (n32, c32) = (n as u32, c as u32);
        let mut b = stream.launch_builder(&f);
        b.arg(&gp)
            .arg(&xp)
            .arg(&mp)
            .arg(&rp)
            .arg(&wp)
            .arg(&bp)
            .arg(&n32)
            .arg(&c32);
        // SAFETY: (const float* dy [n·c], x [n·c], mean [n], rstd [n], float* pw [chunks·c],
        // pb [chunks·c], u32 n, u32 c), blocks of 32 columns × NN_COL_GROUPS row groups
        // (grid-stride over tiles and chunks of NN_COL_CHUNK rows).
        launched(k, unsafe { b.launch(per_column_tile(c, n)) })?;
    }
    add_chunks(stream, &pw, chunks, dweight)?;
    add_chunks(stream, &pb, chunks, dbias)
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
    let k = writing::<Y>(["gelu_forward_f32", "gelu_forward_bf16", "gelu_forward_f16"])?;
    let n = x.len();
    same_len(k, "y", n, y.len())?;
    if n == 0 {
        return Ok(());
    }
    let f = function(stream, Program::Nn, k)?;
    let (xp, _x) = x.device_ptr(stream);
    let (yp, _y) = y.device_ptr_mut(stream);
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&xp).arg(&yp).arg(&n64);
    // SAFETY: (const float* x, Y* y, u64 n) with Y the kernel's (`writing`), both of `n`
    // elements.
    launched(k, unsafe { b.launch(config(n)) })
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
    let f = function(stream, Program::Nn, k)?;
    let (xp, _x) = x.device_ptr(stream);
    let (gp, _g) = dy.device_ptr(stream);
    let (dp, _d) = dx.device_ptr_mut(stream);
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&xp).arg(&gp).arg(&dp).arg(&n64);
    // SAFETY: (const float* x, const float* dy, float* dx, u64 n), all of `n` elements.
    launched(k, unsafe { b.launch(config(n)) })
}

/// Of a layer's kernels `[f32, bf16, f16]`, the one that writes its result as `P`: the bf16
/// and f16 kernels store the f32 kernel's values rounded as [`cast`](super::cast) rounds (for
/// results only products read).
pub(super) fn writing<P: CastFloat>(
    [f32, bf16, f16]: [&'static str; 3],
) -> Result<&'static str, KernelError> {
    match P::NAME {
        "f32" => Ok(f32),
        "bf16" => Ok(bf16),
        "f16" => Ok(f16),
        other => Err(KernelError::InvalidArgument {
            kernel: f32,
            reason: format!("no {other} results (f32, bf16 or f16)"),
        }),
    }
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
    let k = writing::<P>([
        "causal_softmax_forward_f32",
        "causal_softmax_forward_bf16",
        "causal_softmax_forward_f16",
    ])?;
    let rows = softmax_rows(k, scores.len(), t)?;
    same_len(k, "probs", scores.len(), probs.len())?;
    if rows == 0 {
        return Ok(());
    }
    let cfg = per_warp_row(k, rows)?;
    let f = function(stream, Program::Nn, k)?;
    let (sp, _s) = scores.device_ptr(stream);
    let (pp, _p) = probs.device_ptr_mut(stream);
    let (t32, rows64) = (t as u32, rows as u64);
    let mut b = stream.launch_builder(&f);
    b.arg(&sp).arg(&pp).arg(&t32).arg(&scale).arg(&rows64);
    // SAFETY: (const float* s, P* p, u32 t, float scale, u64 rows) with P the kernel's (f32, bf16
    // or f16, `writing`), one warp on each of the `rows` rows of `t` elements of both
    // (warps past the last row return).
    launched(k, unsafe { b.launch(cfg) })
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
    let k = writing::<H>([
        "causal_softmax_forward_both_f32 (none: f32 results are the probabilities)",
        "causal_softmax_forward_both_bf16",
        "causal_softmax_forward_both_f16",
    ])?;
    if H::NAME == "f32" {
        return Err(KernelError::InvalidArgument {
            kernel: k,
            reason: "the rounding written beside the f32 probabilities is bf16 or f16".into(),
        });
    }
    let rows = softmax_rows(k, scores.len(), t)?;
    same_len(k, "probs", scores.len(), probs.len())?;
    same_len(k, "rounded", scores.len(), rounded.len())?;
    if rows == 0 {
        return Ok(());
    }
    let cfg = per_warp_row(k, rows)?;
    let f = function(stream, Program::Nn, k)?;
    let (sp, _s) = scores.device_ptr(stream);
    let (pp, _p) = probs.device_ptr_mut(stream);
    let (bp, _b) = rounded.device_ptr_mut(stream);
    let (t32, rows64) = (t as u32, rows as u64);
    let mut b = stream.launch_builder(&f);
    b.arg(&sp)
        .arg(&pp)
        .arg(&bp)
        .arg(&t32)
        .arg(&scale)
        .arg(&rows64);
    // SAFETY: (const float* s, float* p, H* pb, u32 t, float scale, u64 rows), one warp on
    // each of the `rows` rows of `t` elements of all three (warps past the last row return).
    launched(k, unsafe { b.launch(cfg) })
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
    let k = writing::<D>([
        "causal_softmax_backward_f32",
        "causal_softmax_backward_bf16",
        "causal_softmax_backward_f16",
    ])?;
    let rows = softmax_rows(k, probs.len(), t)?;
    same_len(k, "dprobs", probs.len(), dprobs.len())?;
    same_len(k, "dscores", probs.len(), dscores.len())?;
    if rows == 0 {
        return Ok(());
    }
    let cfg = per_warp_row(k, rows)?;
    let f = function(stream, Program::Nn, k)?;
    let (pp, _p) = probs.device_ptr(stream);
    let (gp, _g) = dprobs.device_ptr(stream);
    let (dp, _d) = dscores.device_ptr_mut(stream);
    let (t32, rows64) = (t as u32, rows as u64);
    let mut b = stream.launch_builder(&f);
    b.arg(&pp)
        .arg(&gp)
        .arg(&dp)
        .arg(&t32)
        .arg(&scale)
        .arg(&rows64);
    // SAFETY: (const float* p, const float* dp, D* ds, u32 t, float scale, u64 rows) with D the
    // kernel's (`writing`), one warp on each of the `rows` rows of `t` elements of each
    // (warps past the last return).
    launched(k, unsafe { b.launch(cfg) })
}

/// Bias gradient, the column sums of `dy` accumulated into `dbias` in row order (see
/// [`host::nn::bias_grad`](crate::host::nn::bias_grad)).
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
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
    let f = function(stream, Program::Nn, k)?;
    let (mut part, chunks) = chunk_sums(stream, k, n, c)?;
    {
        let (gp, _g) = dy.device_ptr(stream);
        let (pp, _p) = part.device_ptr_mut(stream);
        let (n32, c32) = (n as u32, c as u32);
        let mut b = stream.launch_builder(&f);
        b.arg(&gp).arg(&pp).arg(&n32).arg(&c32);
        // SAFETY: (const float* dy [n·c], float* part [chunks·c], u32 n, u32 c), blocks of 32
        // columns × NN_COL_GROUPS row groups (grid-stride over tiles and chunks).
        launched(k, unsafe { b.launch(per_column_tile(c, n)) })?;
    }
    add_chunks(stream, &part, chunks, dbias)
}
