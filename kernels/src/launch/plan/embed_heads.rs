//! The launches of the embeddings, the bias add and the attention heads' permutations
//! (`cu/nn_embed_heads.cu`, `bias_add_f32` of `cu/nn.cu`): one element-wise launch each.

use super::{config, writing, KernelLaunch, Param};
use crate::host::nn::HeadsLayout;
use crate::host::CastFloat;
use crate::{KernelError, Program};

/// [`launch::embedding_forward`](crate::launch::embedding_forward): reads `n` ids at `ids`,
/// `vocab·c` f32 of `wte` and the first `t·c` of `wpe`; writes `n·c` f32 at `x`.
#[allow(clippy::too_many_arguments)]
pub fn embedding_forward(
    ids: u64,
    wte: u64,
    wpe: u64,
    x: u64,
    n: usize,
    c: usize,
    t: usize,
    vocab: usize,
) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // `embedding_forward_f32(const u32* ids, const float* wte, const float* wpe, float* x,
    // u64 n, u32 c, u32 t, u32 vocab)`.
    vec![KernelLaunch::new(
        Program::Nn,
        "embedding_forward_f32",
        config(n * c),
        vec![
            Param::Ptr(ids),
            Param::Ptr(wte),
            Param::Ptr(wpe),
            Param::Ptr(x),
            Param::U64(n as u64),
            Param::U32(c as u32),
            Param::U32(t as u32),
            Param::U32(vocab as u32),
        ],
    )]
}

/// [`launch::embedding_backward_tokens`](crate::launch::embedding_backward_tokens): reads `n`
/// ids at `ids` and `n·c` f32 of `dx`; accumulates into the `vocab·c` f32 of `dwte` (one
/// thread per element of `dwte`).
pub fn embedding_backward_tokens(
    ids: u64,
    dx: u64,
    dwte: u64,
    n: usize,
    c: usize,
    vocab: usize,
) -> Vec<KernelLaunch> {
    if n == 0 || vocab == 0 {
        return Vec::new();
    }
    // `embedding_backward_tokens_f32(const u32* ids, const float* dx, float* dwte, u32 n,
    // u32 c, u32 vocab)`.
    vec![KernelLaunch::new(
        Program::Nn,
        "embedding_backward_tokens_f32",
        config(vocab * c),
        vec![
            Param::Ptr(ids),
            Param::Ptr(dx),
            Param::Ptr(dwte),
            Param::U32(n as u32),
            Param::U32(c as u32),
            Param::U32(vocab as u32),
        ],
    )]
}

/// [`launch::embedding_backward_tokens_host_ids`](crate::launch::embedding_backward_tokens_host_ids)
/// on the tokens grouped by id (`host::nn::group_by_id`, uploaded by the launcher): reads the
/// `distinct` ids at `ids`, their `distinct + 1` offsets at `offsets` into the tokens at
/// `tokens` and the tokens' rows of `dx` (`c` f32 each); accumulates into the ids' rows of
/// `dwte`, one thread per (distinct id, column).
#[allow(clippy::too_many_arguments)]
pub fn embedding_backward_tokens_host_ids(
    ids: u64,
    offsets: u64,
    tokens: u64,
    dx: u64,
    dwte: u64,
    distinct: usize,
    c: usize,
) -> Vec<KernelLaunch> {
    if distinct == 0 {
        return Vec::new();
    }
    // `embedding_backward_tokens_grouped_f32(const u32* ids, const u32* offsets,
    // const u32* tokens, const float* dx, float* dwte, u32 distinct, u32 c)`.
    vec![KernelLaunch::new(
        Program::Nn,
        "embedding_backward_tokens_grouped_f32",
        config(distinct * c),
        vec![
            Param::Ptr(ids),
            Param::Ptr(offsets),
            Param::Ptr(tokens),
            Param::Ptr(dx),
            Param::Ptr(dwte),
            Param::U32(distinct as u32),
            Param::U32(c as u32),
        ],
    )]
}

/// [`launch::embedding_backward_positions`](crate::launch::embedding_backward_positions):
/// reads `n·c` f32 of `dx`; accumulates into the first `t·c` f32 of `dwpe` (one thread per
/// element of them).
pub fn embedding_backward_positions(
    dx: u64,
    dwpe: u64,
    n: usize,
    c: usize,
    t: usize,
) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // `embedding_backward_positions_f32(const float* dx, float* dwpe, u32 n, u32 c, u32 t)`.
    vec![KernelLaunch::new(
        Program::Nn,
        "embedding_backward_positions_f32",
        config(t * c),
        vec![
            Param::Ptr(dx),
            Param::Ptr(dwpe),
            Param::U32(n as u32),
            Param::U32(c as u32),
            Param::U32(t as u32),
        ],
    )]
}

/// [`launch::bias_add`](crate::launch::bias_add): `y[k] += bias[k mod c]` over the `n` f32
/// of `y` (a multiple of `c`), reading the `c` f32 of `bias`.
pub fn bias_add(y: u64, bias: u64, n: usize, c: usize) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // `bias_add_f32(float* y, const float* b, u64 n, u32 c)`.
    vec![KernelLaunch::new(
        Program::Nn,
        "bias_add_f32",
        config(n),
        vec![
            Param::Ptr(y),
            Param::Ptr(bias),
            Param::U64(n as u64),
            Param::U32(c as u32),
        ],
    )]
}

/// The heads split kernel writing `D`.
pub(crate) fn heads_split_kernel<D: CastFloat>() -> Result<&'static str, KernelError> {
    writing::<D>(["heads_split_f32", "heads_split_bf16", "heads_split_f16"])
}

/// The heads merge kernel writing `D`.
pub(crate) fn heads_merge_kernel<D: CastFloat>() -> Result<&'static str, KernelError> {
    writing::<D>(["heads_merge_f32", "heads_merge_bf16", "heads_merge_f16"])
}

/// One heads kernel from `src` (f32) to `dst` (`D`), one thread per element of the dense side.
fn heads(k: &'static str, src: u64, dst: u64, l: HeadsLayout) -> Vec<KernelLaunch> {
    if l.heads_len() == 0 {
        return Vec::new();
    }
    let mut params = vec![Param::Ptr(src), Param::Ptr(dst)];
    params.extend([l.b, l.t, l.h, l.d, l.row, l.offset].map(|v| Param::U32(v as u32)));
    // `heads_<split|merge>_<D>(const float* src, D* dst, u32 b, u32 t, u32 h, u32 d, u32 row,
    // u32 offset)`.
    vec![KernelLaunch::new(
        Program::Nn,
        k,
        config(l.heads_len()),
        params,
    )]
}

/// [`launch::heads_split`](crate::launch::heads_split): reads the `l.rows_len()` f32 token
/// rows at `rows`; writes the `l.heads_len()` elements (`D`) of the dense heads at `out`.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a `D` other than f32, bf16 and f16 (none implements
/// [`CastFloat`]).
pub fn heads_split<D: CastFloat>(
    rows: u64,
    out: u64,
    l: HeadsLayout,
) -> Result<Vec<KernelLaunch>, KernelError> {
    Ok(heads(heads_split_kernel::<D>()?, rows, out, l))
}

/// [`launch::heads_merge`](crate::launch::heads_merge): reads the `l.heads_len()` f32 of the
/// dense heads at `src`; writes their places (`D`) in the `l.rows_len()` elements of the token
/// rows at `rows` (the other columns untouched).
///
/// # Errors
/// As [`heads_split`].
pub fn heads_merge<D: CastFloat>(
    src: u64,
    rows: u64,
    l: HeadsLayout,
) -> Result<Vec<KernelLaunch>, KernelError> {
    Ok(heads(heads_merge_kernel::<D>()?, src, rows, l))
}
