//! The launches of the causal softmaxes and of the cross-entropy fused with its backward
//! (`cu/nn_softmax.cu` of `Program::Nn`): a warp per row of the `t × t` score matrices, a
//! block per row of logits.

use super::nn::{per_row, per_warp_row, writing};
use super::{KernelLaunch, Param};
use crate::host::CastFloat;
use crate::{KernelError, Program};

/// The causal softmax forward kernel writing the probabilities as `P`.
pub(crate) fn causal_softmax_forward_kernel<P: CastFloat>() -> Result<&'static str, KernelError> {
    writing::<P>([
        "causal_softmax_forward_f32",
        "causal_softmax_forward_bf16",
        "causal_softmax_forward_f16",
    ])
}

/// The causal softmax forward kernel writing f32 probabilities and their rounding as `H`
/// (bf16 or f16).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for an `H` of f32 (the probabilities themselves).
pub(crate) fn causal_softmax_forward_both_kernel<H: CastFloat>() -> Result<&'static str, KernelError>
{
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
    Ok(k)
}

/// The causal softmax backward kernel writing the scores' gradient as `D`.
pub(crate) fn causal_softmax_backward_kernel<D: CastFloat>() -> Result<&'static str, KernelError> {
    writing::<D>([
        "causal_softmax_backward_f32",
        "causal_softmax_backward_bf16",
        "causal_softmax_backward_f16",
    ])
}

/// The cross-entropy kernel writing the logits' gradient as `D`.
pub(crate) fn cross_entropy_fused_kernel<D: CastFloat>() -> Result<&'static str, KernelError> {
    writing::<D>([
        "cross_entropy_fused_f32",
        "cross_entropy_fused_bf16",
        "cross_entropy_fused_f16",
    ])
}

/// The parameters the softmaxes end with: `u32 t, float scale, u64 rows`.
fn softmax_tail(mut head: Vec<Param>, t: usize, scale: f32, rows: usize) -> Vec<Param> {
    head.extend([
        Param::U32(t as u32),
        Param::F32(scale),
        Param::U64(rows as u64),
    ]);
    head
}

/// [`launch::causal_softmax_forward`](crate::launch::causal_softmax_forward) over `rows` rows
/// of `t` (whole `t × t` matrices): reads `scores` (`rows·t` f32, only on and below each
/// matrix's diagonal), writes `probs` (`rows·t` of `P`, zero above the diagonal). One warp
/// per row ([`per_warp_row`]).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a `P` other than f32, bf16 and f16, or more rows than
/// the grid holds.
pub fn causal_softmax_forward<P: CastFloat>(
    scores: u64,
    t: usize,
    scale: f32,
    probs: u64,
    rows: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let k = causal_softmax_forward_kernel::<P>()?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    // `causal_softmax_forward_<P>(const float* s, P* p, u32 t, float scale, u64 rows)`.
    Ok(vec![KernelLaunch::new(
        Program::Nn,
        k,
        per_warp_row(k, rows)?,
        softmax_tail(vec![Param::Ptr(scores), Param::Ptr(probs)], t, scale, rows),
    )])
}

/// [`launch::causal_softmax_forward_both`](crate::launch::causal_softmax_forward_both) over
/// `rows` rows of `t`: reads `scores` (`rows·t` f32), writes `probs` (`rows·t` f32) and
/// their rounding `rounded` (`rows·t` of `H`) in one pass. One warp per row.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for an `H` other than bf16 and f16, or more rows than
/// the grid holds.
pub fn causal_softmax_forward_both<H: CastFloat>(
    scores: u64,
    t: usize,
    scale: f32,
    probs: u64,
    rounded: u64,
    rows: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let k = causal_softmax_forward_both_kernel::<H>()?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    // `causal_softmax_forward_both_<H>(const float* s, float* p, H* pb, u32 t, float scale,
    // u64 rows)`.
    let head = vec![Param::Ptr(scores), Param::Ptr(probs), Param::Ptr(rounded)];
    Ok(vec![KernelLaunch::new(
        Program::Nn,
        k,
        per_warp_row(k, rows)?,
        softmax_tail(head, t, scale, rows),
    )])
}

/// [`launch::causal_softmax_backward`](crate::launch::causal_softmax_backward) over `rows`
/// rows of `t`: reads `probs` and `dprobs` (`rows·t` f32, on and below the diagonal), writes
/// `dscores` (`rows·t` of `D`). One warp per row.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a `D` other than f32, bf16 and f16, or more rows than
/// the grid holds.
pub fn causal_softmax_backward<D: CastFloat>(
    probs: u64,
    dprobs: u64,
    t: usize,
    scale: f32,
    dscores: u64,
    rows: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let k = causal_softmax_backward_kernel::<D>()?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    // `causal_softmax_backward_<D>(const float* p, const float* dp, D* ds, u32 t,
    // float scale, u64 rows)`.
    let head = vec![Param::Ptr(probs), Param::Ptr(dprobs), Param::Ptr(dscores)];
    Ok(vec![KernelLaunch::new(
        Program::Nn,
        k,
        per_warp_row(k, rows)?,
        softmax_tail(head, t, scale, rows),
    )])
}

/// [`launch::cross_entropy_fused`](crate::launch::cross_entropy_fused) over `n` rows of `v`:
/// reads `logits` (`n·v` f32) and `targets` (`n` u32), and the loss scale of a step's
/// `scalars` (f64, past [`STEP_SCALE`](crate::host::STEP_SCALE); 0: none); writes `losses`
/// (`n` f32) and `dlogits` (`n·v` of `D`; it may be `logits` itself for f32, each element
/// read before it is written). One block per row.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a `D` other than f32, bf16 and f16, or more rows than
/// the grid holds ([`per_row`]).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_fused<D: CastFloat>(
    logits: u64,
    targets: u64,
    v: usize,
    dloss: f32,
    scalars: u64,
    losses: u64,
    dlogits: u64,
    n: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let k = cross_entropy_fused_kernel::<D>()?;
    if n == 0 {
        return Ok(Vec::new());
    }
    // `cross_entropy_fused_<D>(const float* logits, const u32* targets, float* losses,
    // D* dlogits, u32 v, float dloss, const double* s)`.
    Ok(vec![KernelLaunch::new(
        Program::Nn,
        k,
        per_row(k, n)?,
        vec![
            Param::Ptr(logits),
            Param::Ptr(targets),
            Param::Ptr(losses),
            Param::Ptr(dlogits),
            Param::U32(v as u32),
            Param::F32(dloss),
            Param::Ptr(scalars),
        ],
    )])
}

/// [`launch::cross_entropy_fused_in_place`](crate::launch::cross_entropy_fused_in_place):
/// [`cross_entropy_fused`] in f32 with the gradient written over `logits`.
///
/// # Errors
/// More rows than the grid holds ([`per_row`]).
pub fn cross_entropy_fused_in_place(
    logits: u64,
    targets: u64,
    v: usize,
    dloss: f32,
    scalars: u64,
    losses: u64,
    n: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    cross_entropy_fused::<f32>(logits, targets, v, dloss, scalars, losses, logits, n)
}
