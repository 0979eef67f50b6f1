//! Twins of `cu/nn.cu`: the GPT's layers besides matrix products (f32), with the kernels'
//! arithmetic in the kernels' order, so that a GPU result equals them bitwise.
//!
//! Reductions over a row run as the kernels' blocks do: "thread" `t` of [`NN_BLOCK`] folds
//! elements `t, t + NN_BLOCK, …` in order, then a tree halves the partials; the causal
//! softmax's rows run in one warp each, the same with [`NN_WARP`] lanes. The layer norm's
//! and the biases' parameter gradients are column reductions over chunks of [`NN_COL_CHUNK`]
//! rows: in a chunk, row group `g` of [`NN_COL_GROUPS`] folds rows `g, g + NN_COL_GROUPS, …`
//! of a column in order from zero, the group partials are folded in order into the chunk's
//! sum, and the chunk sums are added in order to the gradient's current value. The embeddings'
//! gradients fold their tokens in order into the gradient's current value. Deterministic, no
//! atomics. Backward functions say whether they accumulate (`+=`) or write.

pub use super::nn_heads::{bias_add, heads_merge, heads_split, HeadsLayout};
pub(crate) use super::nn_loss::check_cross_entropy;
pub use super::nn_loss::{cross_entropy_fused, cross_entropy_fused_in_place};
use super::nn_math::{exp, max_of, normal_cdf, normal_pdf};
use super::same_len;
use crate::KernelError;

/// Threads per block of the row kernels (layer norm, softmax, cross-entropy).
pub const NN_BLOCK: usize = 256;

/// Threads of a warp: the causal softmax reduces each row in one warp.
pub const NN_WARP: usize = 32;
/// Row groups of a column reduction (the kernels' blocks are 32 columns × this many groups).
pub const NN_COL_GROUPS: usize = 32;
/// Rows of one chunk of a column reduction (one block of the kernels per chunk and tile of 32
/// columns, so that a reduction over thousands of rows fills the GPU).
pub const NN_COL_CHUNK: usize = 256;

/// The kernels' column reduction, accumulating: for each column `j` of `acc` (`c` columns),
/// `acc[j] += Σ_chunks Σ_g Σ_{r ≡ g} term(r, j)` for `n` rows cut into chunks of
/// [`NN_COL_CHUNK`] rows: in each chunk, row group `g` of [`NN_COL_GROUPS`] folds its rows
/// (`r ≡ g` modulo the groups) in order from zero, and the group sums are folded in group
/// order from zero into the chunk's sum; the chunk sums are added to `acc[j]` in chunk order.
fn column_fold(n: usize, acc: &mut [f32], term: impl Fn(usize, usize) -> f32) {
    let c = acc.len();
    let mut groups = vec![0.0f32; NN_COL_GROUPS * c];
    let mut chunk = vec![0.0f32; c];
    for start in (0..n).step_by(NN_COL_CHUNK) {
        groups.fill(0.0);
        for r in start..n.min(start + NN_COL_CHUNK) {
            let g = &mut groups[(r % NN_COL_GROUPS) * c..][..c];
            for (j, p) in g.iter_mut().enumerate() {
                *p += term(r, j);
            }
        }
        chunk.fill(0.0);
        for g in groups.chunks_exact(c) {
            for (s, p) in chunk.iter_mut().zip(g) {
                *s += p;
            }
        }
        for (a, s) in acc.iter_mut().zip(&chunk) {
            *a += s;
        }
    }
}

/// The kernels' block reduction of `len` values `f(i)`: per-thread folds, then the tree.
pub(super) fn block_reduce(
    len: usize,
    init: f32,
    f: impl Fn(usize) -> f32,
    op: fn(f32, f32) -> f32,
) -> f32 {
    reduce_across(NN_BLOCK, len, init, f, op)
}

/// The kernels' warp reduction of `len` values `f(i)` (the causal softmax's rows): lane `l` of
/// [`NN_WARP`] folds `l, l + NN_WARP, …` in order, then the lanes' butterfly, whose lane 0
/// combines as the block's tree does.
fn warp_reduce(len: usize, init: f32, f: impl Fn(usize) -> f32, op: fn(f32, f32) -> f32) -> f32 {
    reduce_across(NN_WARP, len, init, f, op)
}

/// `width` threads (a power of two, at most [`NN_BLOCK`]): thread `t` folds elements
/// `t, t + width, …` in order from `init`, then a tree halves the partials
/// (`p[t] = op(p[t], p[t + s])` for `s = width/2, …, 1`).
fn reduce_across(
    width: usize,
    len: usize,
    init: f32,
    f: impl Fn(usize) -> f32,
    op: fn(f32, f32) -> f32,
) -> f32 {
    let mut sh = [init; NN_BLOCK];
    let sh = &mut sh[..width];
    for (t, slot) in sh.iter_mut().enumerate() {
        let mut acc = init;
        let mut i = t;
        while i < len {
            acc = op(acc, f(i));
            i += width;
        }
        *slot = acc;
    }
    let mut s = width / 2;
    while s > 0 {
        for t in 0..s {
            sh[t] = op(sh[t], sh[t + s]);
        }
        s /= 2;
    }
    sh[0]
}

pub(super) fn add(a: f32, b: f32) -> f32 {
    a + b
}

pub(super) fn invalid(kernel: &'static str, reason: String) -> KernelError {
    KernelError::InvalidArgument { kernel, reason }
}

/// The rows of a `[rows, cols]` matrix of `len` elements with `cols > 0`.
pub(crate) fn rows_of(
    kernel: &'static str,
    what: &'static str,
    len: usize,
    cols: usize,
) -> Result<usize, KernelError> {
    if cols == 0 {
        return Err(invalid(kernel, format!("{what}: zero columns")));
    }
    if len % cols != 0 {
        return Err(invalid(
            kernel,
            format!("{what} has {len} elements, not whole rows of {cols}"),
        ));
    }
    if u32::try_from(cols).is_err() || u32::try_from(len / cols).is_err() {
        return Err(invalid(
            kernel,
            format!("{what}: {} rows of {cols} exceed 2^32", len / cols),
        ));
    }
    Ok(len / cols)
}

/// Layer norm forward over rows of `x: [n, c]` (`c = weight.len()`, `n = mean.len()`):
/// `mean = Σx / c`, `var = Σ(x − mean)² / c` (biased, as PyTorch), `rstd = 1/√(var + eps)`,
/// `y = ((x − mean)·rstd)·weight + bias`. Writes `y`, `mean` and `rstd` (`[n]`).
///
/// # Errors
/// [`KernelError::Length`] / [`KernelError::InvalidArgument`] for mismatched shapes.
pub fn layernorm_forward(
    x: &[f32],
    weight: &[f32],
    bias: &[f32],
    eps: f32,
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
) -> Result<(), KernelError> {
    let k = "layernorm_forward_f32";
    let c = weight.len();
    let n = check_ln_forward(k, x.len(), c, bias.len(), y.len(), mean.len(), rstd.len())?;
    for r in 0..n {
        let xr = &x[r * c..(r + 1) * c];
        let m = block_reduce(c, 0.0, |i| xr[i], add) / c as f32;
        let var = block_reduce(c, 0.0, |i| (xr[i] - m) * (xr[i] - m), add) / c as f32;
        let rs = 1.0 / (var + eps).sqrt();
        for (i, o) in y[r * c..(r + 1) * c].iter_mut().enumerate() {
            *o = ((xr[i] - m) * rs) * weight[i] + bias[i];
        }
        mean[r] = m;
        rstd[r] = rs;
    }
    Ok(())
}

/// The shapes of layer norm's forward (twin and launch), by their lengths: `x` and `y` whole
/// rows of `c` (the weight's length), `bias` of `c`, `mean` and `rstd` one per row. Returns
/// the rows.
pub(crate) fn check_ln_forward(
    k: &'static str,
    x: usize,
    c: usize,
    bias: usize,
    y: usize,
    mean: usize,
    rstd: usize,
) -> Result<usize, KernelError> {
    let n = rows_of(k, "x", x, c)?;
    same_len(k, "bias", c, bias)?;
    same_len(k, "y", x, y)?;
    same_len(k, "mean", n, mean)?;
    same_len(k, "rstd", n, rstd)?;
    Ok(n)
}

/// The shapes both parts of layer norm's backward (twins and launches) share, by their
/// lengths: `x` whole rows of `c`, `dy` as `x`, `mean` and `rstd` one per row. Returns the rows.
pub(crate) fn check_ln_backward(
    k: &'static str,
    dy: usize,
    x: usize,
    c: usize,
    mean: usize,
    rstd: usize,
) -> Result<usize, KernelError> {
    let n = rows_of(k, "x", x, c)?;
    same_len(k, "dy", x, dy)?;
    same_len(k, "mean", n, mean)?;
    same_len(k, "rstd", n, rstd)?;
    Ok(n)
}

/// Layer norm backward, input part (**accumulates**): with `g = dy·weight` and
/// `x̂ = (x − mean)·rstd`, `dx += rstd·((g − Σg/c) − x̂·(Σg·x̂/c))`.
///
/// # Errors
/// [`KernelError::Length`] / [`KernelError::InvalidArgument`] for mismatched shapes.
pub fn layernorm_backward_input(
    dy: &[f32],
    x: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dx: &mut [f32],
) -> Result<(), KernelError> {
    let k = "layernorm_backward_input_f32";
    let c = weight.len();
    let n = check_ln_backward(k, dy.len(), x.len(), c, mean.len(), rstd.len())?;
    same_len(k, "dx", x.len(), dx.len())?;
    for r in 0..n {
        let (o, m, rs) = (r * c, mean[r], rstd[r]);
        let g = |i: usize| dy[o + i] * weight[i];
        let xh = |i: usize| (x[o + i] - m) * rs;
        let mg = block_reduce(c, 0.0, g, add) / c as f32;
        let mgx = block_reduce(c, 0.0, |i| g(i) * xh(i), add) / c as f32;
        for i in 0..c {
            dx[o + i] += rs * ((g(i) - mg) - xh(i) * mgx);
        }
    }
    Ok(())
}

/// Layer norm backward, parameter part (**accumulates**): `dweight += (dy·(x − mean))·rstd`,
/// `dbias += dy`, summed over the rows as a column reduction (in the order this module's
/// documentation gives).
///
/// # Errors
/// [`KernelError::Length`] / [`KernelError::InvalidArgument`] for mismatched shapes.
pub fn layernorm_backward_params(
    dy: &[f32],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
) -> Result<(), KernelError> {
    let k = "layernorm_backward_params_f32";
    let c = dweight.len();
    let n = check_ln_backward(k, dy.len(), x.len(), c, mean.len(), rstd.len())?;
    same_len(k, "dbias", c, dbias.len())?;
    column_fold(n, dweight, |r, j| {
        let i = r * c + j;
        (dy[i] * (x[i] - mean[r])) * rstd[r]
    });
    column_fold(n, dbias, |r, j| dy[r * c + j]);
    Ok(())
}

/// Exact GELU: `y = x·Φ(x)` (Φ by [`normal_cdf`]).
///
/// # Errors
/// [`KernelError::Length`] if the lengths differ.
pub fn gelu_forward(x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    same_len("gelu_forward_f32", "y", x.len(), y.len())?;
    for (o, &v) in y.iter_mut().zip(x) {
        *o = v * normal_cdf(v);
    }
    Ok(())
}

/// GELU backward (**writes**): `dx = dy·(Φ(x) + x·φ(x))`.
///
/// # Errors
/// [`KernelError::Length`] if the lengths differ.
pub fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError> {
    same_len("gelu_backward_f32", "dy", x.len(), dy.len())?;
    same_len("gelu_backward_f32", "dx", x.len(), dx.len())?;
    for ((d, &v), &g) in dx.iter_mut().zip(x).zip(dy) {
        *d = g * (normal_cdf(v) + v * normal_pdf(v));
    }
    Ok(())
}

/// Causal softmax forward over `[rows, t, t]` score matrices (one per sequence and head):
/// row `i` of each has `v_j = s_j·scale` for `j ≤ i`, `p_j = e^(v_j − max v)/Σ`, and
/// `p_j = 0` for `j > i`. Writes `probs`.
///
/// # Errors
/// [`KernelError::Length`] / [`KernelError::InvalidArgument`] unless both hold whole `t × t`
/// matrices.
pub fn causal_softmax_forward(
    scores: &[f32],
    t: usize,
    scale: f32,
    probs: &mut [f32],
) -> Result<(), KernelError> {
    let k = "causal_softmax_forward_f32";
    let rows = softmax_rows(k, scores.len(), t)?;
    same_len(k, "probs", scores.len(), probs.len())?;
    for r in 0..rows {
        let (i, o) = (r % t, r * t);
        let s = &scores[o..o + t];
        let p = &mut probs[o..o + t];
        let mx = warp_reduce(i + 1, f32::NEG_INFINITY, |j| s[j] * scale, max_of);
        let sum = warp_reduce(i + 1, 0.0, |j| exp(s[j] * scale - mx), add);
        for (j, pj) in p.iter_mut().enumerate() {
            *pj = if j <= i {
                exp(s[j] * scale - mx) / sum
            } else {
                0.0
            };
        }
    }
    Ok(())
}

/// Causal softmax backward (**writes**): `ds_j = scale·(p_j·(dp_j − Σ_{k≤i} p_k·dp_k))` for
/// `j ≤ i`, 0 above the diagonal; `ds` is the gradient of the unscaled scores.
///
/// # Errors
/// As [`causal_softmax_forward`].
pub fn causal_softmax_backward(
    probs: &[f32],
    dprobs: &[f32],
    t: usize,
    scale: f32,
    dscores: &mut [f32],
) -> Result<(), KernelError> {
    let k = "causal_softmax_backward_f32";
    let rows = softmax_rows(k, probs.len(), t)?;
    same_len(k, "dprobs", probs.len(), dprobs.len())?;
    same_len(k, "dscores", probs.len(), dscores.len())?;
    for r in 0..rows {
        let (i, o) = (r % t, r * t);
        let (p, dp) = (&probs[o..o + t], &dprobs[o..o + t]);
        let dot = warp_reduce(i + 1, 0.0, |j| p[j] * dp[j], add);
        for (j, d) in dscores[o..o + t].iter_mut().enumerate() {
            *d = if j <= i {
                scale * (p[j] * (dp[j] - dot))
            } else {
                0.0
            };
        }
    }
    Ok(())
}

/// The rows (of `t`) of whole `t × t` matrices in `len` elements.
pub(crate) fn softmax_rows(k: &'static str, len: usize, t: usize) -> Result<usize, KernelError> {
    let rows = rows_of(k, "scores", len, t)?;
    if rows % t != 0 {
        return Err(invalid(
            k,
            format!("{len} elements are not whole {t}x{t} matrices"),
        ));
    }
    Ok(rows)
}

/// Embedding forward: `x[r] = wte[ids[r]] + wpe[r mod t]` (`c` columns, `t` positions: `ids`
/// are whole sequences of `t` tokens). An id `≥ wte`'s rows gives a NaN row, as the kernel.
///
/// # Errors
/// [`KernelError::Length`] / [`KernelError::InvalidArgument`] for mismatched shapes.
pub fn embedding_forward(
    ids: &[u32],
    wte: &[f32],
    wpe: &[f32],
    t: usize,
    c: usize,
    x: &mut [f32],
) -> Result<(), KernelError> {
    let k = "embedding_forward_f32";
    let vocab = check_embedding(k, ids.len(), wte.len(), wpe.len(), t, c)?;
    same_len(k, "x", ids.len() * c, x.len())?;
    for (r, xr) in x.chunks_exact_mut(c).enumerate() {
        let id = ids[r] as usize;
        let pos = &wpe[(r % t) * c..(r % t + 1) * c];
        for (j, o) in xr.iter_mut().enumerate() {
            *o = if id < vocab {
                wte[id * c + j] + pos[j]
            } else {
                f32::NAN
            };
        }
    }
    Ok(())
}

/// Checks an embedding's shapes; returns the vocabulary size (`wte`'s rows).
pub(crate) fn check_embedding(
    k: &'static str,
    n: usize,
    wte: usize,
    wpe: usize,
    t: usize,
    c: usize,
) -> Result<usize, KernelError> {
    let vocab = rows_of(k, "wte", wte, c)?;
    let positions = rows_of(k, "wpe", wpe, c)?;
    if t == 0 || n % t != 0 || positions < t {
        return Err(invalid(
            k,
            format!("{n} tokens are not whole sequences of {t} positions within wpe's {positions}"),
        ));
    }
    rows_of(k, "tokens x columns", n * c, c)?;
    Ok(vocab)
}

/// Token embedding backward (**accumulates**): `dwte[v] += dx[r]` for every token `r` with
/// `ids[r] == v`, tokens in order (each element starts from its current value; ids out of
/// range add nowhere).
///
/// # Errors
/// [`KernelError::Length`] / [`KernelError::InvalidArgument`] for mismatched shapes.
pub fn embedding_backward_tokens(
    ids: &[u32],
    dx: &[f32],
    c: usize,
    dwte: &mut [f32],
) -> Result<(), KernelError> {
    let k = "embedding_backward_tokens_f32";
    rows_of(k, "dwte", dwte.len(), c)?;
    same_len(k, "dx", ids.len() * c, dx.len())?;
    for (&id, g) in ids.iter().zip(dx.chunks_exact(c)) {
        if let Some(row) = dwte.get_mut(id as usize * c..(id as usize + 1) * c) {
            for (d, &v) in row.iter_mut().zip(g) {
                *d += v;
            }
        }
    }
    Ok(())
}

/// The tokens grouped by id (ids `< vocab`), as `embedding_backward_tokens_grouped_f32` reads
/// them and `launch::embedding_backward_tokens_host_ids` prepares them: the distinct ids
/// ascending, CSR offsets (`distinct + 1`), and each id's token indices in order (a stable
/// counting sort).
///
/// # Panics
/// An id of at least `vocab` (the launcher checks them first).
pub fn group_by_id(ids: &[u32], vocab: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut count = vec![0u32; vocab];
    for &id in ids {
        count[id as usize] += 1;
    }
    let (mut distinct, mut offsets) = (Vec::new(), vec![0u32]);
    let mut start = vec![0u32; vocab];
    for (id, &n) in count.iter().enumerate() {
        if n > 0 {
            let at = offsets[offsets.len() - 1];
            start[id] = at;
            distinct.push(id as u32);
            offsets.push(at + n);
        }
    }
    let mut tokens = vec![0u32; ids.len()];
    for (r, &id) in ids.iter().enumerate() {
        tokens[start[id as usize] as usize] = r as u32;
        start[id as usize] += 1;
    }
    (distinct, offsets, tokens)
}

/// Position embedding backward (**accumulates**): `dwpe[p] += dx[r]` for `r = p, p + t, …`,
/// in order; `dwpe` has at least `t` rows (the rest are untouched).
///
/// # Errors
/// [`KernelError::Length`] / [`KernelError::InvalidArgument`] for mismatched shapes.
pub fn embedding_backward_positions(
    dx: &[f32],
    t: usize,
    c: usize,
    dwpe: &mut [f32],
) -> Result<(), KernelError> {
    let k = "embedding_backward_positions_f32";
    let n = rows_of(k, "dx", dx.len(), c)?;
    check_embedding(k, n, c, dwpe.len(), t, c)?;
    for (r, g) in dx.chunks_exact(c).enumerate() {
        let p = r % t;
        for (d, &v) in dwpe[p * c..(p + 1) * c].iter_mut().zip(g) {
            *d += v;
        }
    }
    Ok(())
}

/// Bias gradient (**accumulates**): `dbias[j] += Σ_r dy[r, j]` (the column sums of
/// `dy: [n, c]`, `c = dbias.len()`), a column reduction (in the order this module's
/// documentation gives).
///
/// # Errors
/// [`KernelError::InvalidArgument`] unless `dy` is whole rows of `c`.
pub fn bias_grad(dy: &[f32], dbias: &mut [f32]) -> Result<(), KernelError> {
    let c = dbias.len();
    let n = rows_of("bias_grad_f32", "dy", dy.len(), c)?;
    column_fold(n, dbias, |r, j| dy[r * c + j]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_fold_adds_chunk_sums_of_group_sums_in_order() {
        // 600 rows: chunks of 256, 256 and 88 rows.
        let n = 600;
        let term = |r: usize, j: usize| ((r * 7 + j * 13) % 17) as f32 * 0.1 + 1e-3 * r as f32;
        let mut acc = vec![0.5f32; 3];
        column_fold(n, &mut acc, term);
        for (j, got) in acc.iter().enumerate() {
            let mut want = 0.5f32;
            for start in [0, 256, 512] {
                let mut chunk = 0.0f32;
                for g in 0..NN_COL_GROUPS {
                    let rows = (start + g..n.min(start + NN_COL_CHUNK)).step_by(NN_COL_GROUPS);
                    chunk += rows.fold(0.0f32, |p, r| p + term(r, j));
                }
                want += chunk;
            }
            assert_eq!(got.to_bits(), want.to_bits(), "column {j}");
            let exact = 0.5 + (0..n).map(|r| f64::from(term(r, j))).sum::<f64>();
            assert!((f64::from(*got) - exact).abs() < 1e-5 * exact, "column {j}");
        }
    }

    #[test]
    fn grouped_tokens_fold_to_the_twins_bits() {
        let (vocab, c, n) = (37usize, 3usize, 200usize);
        let ids: Vec<u32> = (0..n).map(|r| ((r * r * 13 + 5) % vocab) as u32).collect();
        let dx: Vec<f32> = (0..n * c)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
            .collect();
        let (distinct, offsets, tokens) = group_by_id(&ids, vocab);
        assert_eq!(offsets.len(), distinct.len() + 1);
        assert_eq!(offsets[distinct.len()] as usize, n);
        assert!(distinct.windows(2).all(|w| w[0] < w[1]));
        let mut want = vec![0.5f32; vocab * c];
        embedding_backward_tokens(&ids, &dx, c, &mut want).unwrap();
        // The grouped kernel's loop, on the host.
        let mut got = vec![0.5f32; vocab * c];
        for (u, &id) in distinct.iter().enumerate() {
            let toks = &tokens[offsets[u] as usize..offsets[u + 1] as usize];
            assert!(
                toks.windows(2).all(|w| w[0] < w[1]),
                "tokens of {id} in order"
            );
            assert!(toks.iter().all(|&r| ids[r as usize] == id));
            for j in 0..c {
                let mut acc = got[id as usize * c + j];
                for &r in toks {
                    acc += dx[r as usize * c + j];
                }
                got[id as usize * c + j] = acc;
            }
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
    }
}
