//! The launches of the layers' kernels (`cu/nn.cu`; `bias_grad_f32` of `cu/nn_embed_heads.cu`;
//! all of `Program::Nn`): the layer norms, GELU and the two column reductions (the layer
//! norm's parameter gradients and the bias gradient, each a chunk kernel chained with
//! `column_chunks_add_f32`), and the grids of the layers' kernels.

use cudarc::driver::LaunchConfig;

use super::{config, KernelLaunch, Param};
use crate::host::nn::{NN_BLOCK, NN_COL_CHUNK, NN_COL_GROUPS, NN_WARP};
use crate::host::CastFloat;
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

/// Of a layer's kernels `[f32, bf16, f16]`, the one that writes its result as `P`: the bf16
/// and f16 kernels store the f32 kernel's values rounded as [`cast`](super::cast) rounds (for
/// results only products read).
pub(crate) fn writing<P: CastFloat>(
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

/// The layer norm forward kernel writing `y` as `Y`.
pub(crate) fn layernorm_forward_kernel<Y: CastFloat>() -> Result<&'static str, KernelError> {
    writing::<Y>([
        "layernorm_forward_f32",
        "layernorm_forward_bf16",
        "layernorm_forward_f16",
    ])
}

/// The GELU forward kernel writing `y` as `Y`.
pub(crate) fn gelu_forward_kernel<Y: CastFloat>() -> Result<&'static str, KernelError> {
    writing::<Y>(["gelu_forward_f32", "gelu_forward_bf16", "gelu_forward_f16"])
}

/// The chunks of [`NN_COL_CHUNK`] rows of a column reduction over `rows` rows, checked to fit
/// the kernels' `u32`.
fn column_chunks(kernel: &'static str, rows: usize) -> Result<u32, KernelError> {
    let chunks = rows.div_ceil(NN_COL_CHUNK);
    u32::try_from(chunks).map_err(|_| KernelError::InvalidArgument {
        kernel,
        reason: format!("{rows} rows are more than 2^32 chunks"),
    })
}

/// The f32 length of a column reduction's scratch over `rows` rows of `columns`: one sum per
/// chunk of [`NN_COL_CHUNK`] rows and column.
fn chunk_scratch(kernel: &'static str, rows: usize, columns: usize) -> Result<usize, KernelError> {
    Ok((column_chunks(kernel, rows)? as usize).saturating_mul(columns))
}

/// The f32 length of [`bias_grad`]'s scratch over `rows` rows of `columns` (the chunk sums).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for more than 2^32 chunks.
pub fn bias_grad_scratch(rows: usize, columns: usize) -> Result<usize, KernelError> {
    chunk_scratch("bias_grad_f32", rows, columns)
}

/// The f32 length of each of [`layernorm_backward_params`]'s two scratches (the weight's and
/// the bias's chunk sums) over `rows` rows of `columns`.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for more than 2^32 chunks.
pub fn layernorm_backward_params_scratch(
    rows: usize,
    columns: usize,
) -> Result<usize, KernelError> {
    chunk_scratch("layernorm_backward_params_f32", rows, columns)
}

/// The last step of a column reduction: `acc[j] += part[0, j], part[1, j], …` in chunk order,
/// `part` holding `chunks` rows of `columns`, on the element-wise grid of `columns`.
fn column_chunks_add(part: u64, acc: u64, chunks: u32, columns: usize) -> KernelLaunch {
    // `column_chunks_add_f32(const float* part, float* acc, u32 chunks, u32 c)`.
    KernelLaunch::new(
        Program::Nn,
        "column_chunks_add_f32",
        config(columns),
        vec![
            Param::Ptr(part),
            Param::Ptr(acc),
            Param::U32(chunks),
            Param::U32(columns as u32),
        ],
    )
}

/// [`launch::layernorm_forward`](crate::launch::layernorm_forward) over `n` rows of `c`: reads
/// `x` (`n·c` f32), `weight` and `bias` (`c`); writes `y` (`n·c` of `Y`), `mean` and `rstd`
/// (`n` f32). One block per row.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a `Y` other than f32, bf16 and f16, or more rows than
/// the grid holds ([`per_row`]).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<Y: CastFloat>(
    x: u64,
    weight: u64,
    bias: u64,
    eps: f32,
    y: u64,
    mean: u64,
    rstd: u64,
    n: usize,
    c: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let k = layernorm_forward_kernel::<Y>()?;
    if n == 0 {
        return Ok(Vec::new());
    }
    // `layernorm_forward_<Y>(const float* x, const float* w, const float* b, Y* y,
    // float* mean, float* rstd, u32 c, float eps)`.
    Ok(vec![KernelLaunch::new(
        Program::Nn,
        k,
        per_row(k, n)?,
        vec![
            Param::Ptr(x),
            Param::Ptr(weight),
            Param::Ptr(bias),
            Param::Ptr(y),
            Param::Ptr(mean),
            Param::Ptr(rstd),
            Param::U32(c as u32),
            Param::F32(eps),
        ],
    )])
}

/// [`launch::layernorm_backward_input`](crate::launch::layernorm_backward_input) over `n` rows
/// of `c`: reads `dy` and `x` (`n·c` f32), `weight` (`c`), `mean` and `rstd` (`n`);
/// accumulates into `dx` (`n·c`). One block per row.
///
/// # Errors
/// More rows than the grid holds ([`per_row`]).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_input(
    dy: u64,
    x: u64,
    weight: u64,
    mean: u64,
    rstd: u64,
    dx: u64,
    n: usize,
    c: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let k = "layernorm_backward_input_f32";
    if n == 0 {
        return Ok(Vec::new());
    }
    // `layernorm_backward_input_f32(const float* dy, const float* x, const float* w,
    // const float* mean, const float* rstd, float* dx, u32 c)`.
    Ok(vec![KernelLaunch::new(
        Program::Nn,
        k,
        per_row(k, n)?,
        vec![
            Param::Ptr(dy),
            Param::Ptr(x),
            Param::Ptr(weight),
            Param::Ptr(mean),
            Param::Ptr(rstd),
            Param::Ptr(dx),
            Param::U32(c as u32),
        ],
    )])
}

/// [`launch::layernorm_backward_params`](crate::launch::layernorm_backward_params) over `n`
/// rows of `c`: reads `dy` and `x` (`n·c` f32), `mean` and `rstd` (`n`); writes the chunk sums
/// `pw` and `pb` (each [`layernorm_backward_params_scratch`] f32), then reads them to
/// accumulate into `dweight` and `dbias` (`c`): the chunk kernel on [`per_column_tile`], then
/// `column_chunks_add_f32` for the weight and for the bias.
///
/// # Errors
/// As [`layernorm_backward_params_scratch`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_params(
    dy: u64,
    x: u64,
    mean: u64,
    rstd: u64,
    pw: u64,
    pb: u64,
    dweight: u64,
    dbias: u64,
    n: usize,
    c: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let k = "layernorm_backward_params_f32";
    if n == 0 {
        return Ok(Vec::new());
    }
    let chunks = column_chunks(k, n)?;
    Ok(vec![
        // `layernorm_backward_params_f32(const float* dy, const float* x, const float* mean,
        // const float* rstd, float* pw, float* pb, u32 n, u32 c)`: blocks of 32 columns ×
        // NN_COL_GROUPS row groups, grid-stride over tiles and chunks.
        KernelLaunch::new(
            Program::Nn,
            k,
            per_column_tile(c, n),
            vec![
                Param::Ptr(dy),
                Param::Ptr(x),
                Param::Ptr(mean),
                Param::Ptr(rstd),
                Param::Ptr(pw),
                Param::Ptr(pb),
                Param::U32(n as u32),
                Param::U32(c as u32),
            ],
        ),
        column_chunks_add(pw, dweight, chunks, c),
        column_chunks_add(pb, dbias, chunks, c),
    ])
}

/// [`launch::gelu_forward`](crate::launch::gelu_forward) over `n` elements: reads `x` (f32),
/// writes `y` (as `Y`).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a `Y` other than f32, bf16 and f16.
pub fn gelu_forward<Y: CastFloat>(
    x: u64,
    y: u64,
    n: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let k = gelu_forward_kernel::<Y>()?;
    if n == 0 {
        return Ok(Vec::new());
    }
    // `gelu_forward_<Y>(const float* x, Y* y, u64 n)`.
    Ok(vec![KernelLaunch::new(
        Program::Nn,
        k,
        config(n),
        vec![Param::Ptr(x), Param::Ptr(y), Param::U64(n as u64)],
    )])
}

/// [`launch::gelu_backward`](crate::launch::gelu_backward) over `n` elements: reads `x` and
/// `dy`, writes `dx` (all f32).
pub fn gelu_backward(x: u64, dy: u64, dx: u64, n: usize) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // `gelu_backward_f32(const float* x, const float* dy, float* dx, u64 n)`.
    vec![KernelLaunch::new(
        Program::Nn,
        "gelu_backward_f32",
        config(n),
        vec![
            Param::Ptr(x),
            Param::Ptr(dy),
            Param::Ptr(dx),
            Param::U64(n as u64),
        ],
    )]
}

/// [`launch::bias_grad`](crate::launch::bias_grad) over `n` rows of `c`: reads `dy` (`n·c`
/// f32), writes the chunk sums `part` ([`bias_grad_scratch`] f32), then reads them to
/// accumulate into `dbias` (`c`): `bias_grad_f32` on [`per_column_tile`], then
/// `column_chunks_add_f32`.
///
/// # Errors
/// As [`bias_grad_scratch`].
pub fn bias_grad(
    dy: u64,
    part: u64,
    dbias: u64,
    n: usize,
    c: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let k = "bias_grad_f32";
    if n == 0 {
        return Ok(Vec::new());
    }
    let chunks = column_chunks(k, n)?;
    Ok(vec![
        // `bias_grad_f32(const float* dy, float* part, u32 n, u32 c)`: blocks of 32 columns ×
        // NN_COL_GROUPS row groups, grid-stride over tiles and chunks.
        KernelLaunch::new(
            Program::Nn,
            k,
            per_column_tile(c, n),
            vec![
                Param::Ptr(dy),
                Param::Ptr(part),
                Param::U32(n as u32),
                Param::U32(c as u32),
            ],
        ),
        column_chunks_add(part, dbias, chunks, c),
    ])
}
