//! Launch functions of the GPT's embeddings (`cu/nn_embed_heads.cu`): the forward (token plus
//! position) and the token and position backwards, each bitwise equal to its twin in
//! [`host::nn`](crate::host::nn). Shapes are checked as the twins check them, before anything
//! is launched; an id out of range on the device gives NaN rows, as the twins.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::{driver, enqueue, plan};
use crate::host::nn::{check_embedding, group_by_id, rows_of};
use crate::host::same_len;
use crate::KernelError;

/// Embedding forward, token plus position (see
/// [`host::nn::embedding_forward`](crate::host::nn::embedding_forward)).
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
#[allow(clippy::too_many_arguments)]
pub fn embedding_forward(
    stream: &CudaStream,
    ids: &impl DevicePtr<u32>,
    wte: &impl DevicePtr<f32>,
    wpe: &impl DevicePtr<f32>,
    t: usize,
    c: usize,
    x: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let k = "embedding_forward_f32";
    let n = ids.len();
    let vocab = check_embedding(k, n, wte.len(), wpe.len(), t, c)?;
    same_len(k, "x", n * c, x.len())?;
    if n == 0 {
        return Ok(());
    }
    let (ip, _i) = ids.device_ptr(stream);
    let (ep, _e) = wte.device_ptr(stream);
    let (pp, _p) = wpe.device_ptr(stream);
    let (xp, _x) = x.device_ptr_mut(stream);
    let launches = plan::embedding_forward(ip, ep, pp, xp, n, c, t, vocab);
    // SAFETY: `n` ids, `vocab·c` of wte, at least `t·c` of wpe (t > 0) and `n·c` of x, as
    // checked above, all held (`_i` … `_x`); ids are compared with `vocab` before the read.
    unsafe { enqueue(stream, &launches) }
}

/// Token embedding backward, accumulated into `dwte` in token order (see
/// [`host::nn::embedding_backward_tokens`](crate::host::nn::embedding_backward_tokens)).
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
pub fn embedding_backward_tokens(
    stream: &CudaStream,
    ids: &impl DevicePtr<u32>,
    dx: &impl DevicePtr<f32>,
    c: usize,
    dwte: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let k = "embedding_backward_tokens_f32";
    let vocab = rows_of(k, "dwte", dwte.len(), c)?;
    let n = ids.len();
    same_len(k, "dx", n * c, dx.len())?;
    rows_of(k, "dx", dx.len(), c)?;
    if n == 0 || vocab == 0 {
        return Ok(());
    }
    let (ip, _i) = ids.device_ptr(stream);
    let (gp, _g) = dx.device_ptr(stream);
    let (wp, _w) = dwte.device_ptr_mut(stream);
    let launches = plan::embedding_backward_tokens(ip, gp, wp, n, c, vocab);
    // SAFETY: `n` ids, `n·c` of dx and `vocab·c` of dwte (checked above), all held.
    unsafe { enqueue(stream, &launches) }
}

/// [`embedding_backward_tokens`] with the ids on the host (the data loader has them): the
/// tokens are grouped by id here (each id's tokens in order), uploaded, and one GPU thread
/// per (distinct id, column) folds its tokens in order: the same bits as the twin, in
/// O(tokens · c) GPU work instead of O(vocab · tokens · c). Uploads three small arrays
/// (freed in stream order).
///
/// # Errors
/// Shape errors as the twin; [`KernelError::InvalidArgument`] for an id out of `dwte`'s rows;
/// allocation, copy, compile, load and launch failures.
pub fn embedding_backward_tokens_host_ids(
    stream: &Arc<CudaStream>,
    ids: &[u32],
    dx: &impl DevicePtr<f32>,
    c: usize,
    dwte: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let k = "embedding_backward_tokens_grouped_f32";
    let vocab = rows_of(k, "dwte", dwte.len(), c)?;
    same_len(k, "dx", ids.len() * c, dx.len())?;
    rows_of(k, "dx", dx.len(), c)?;
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(KernelError::InvalidArgument {
            kernel: k,
            reason: format!("token id {bad} is not below the vocabulary's {vocab}"),
        });
    }
    if ids.is_empty() {
        return Ok(());
    }
    let (distinct, offsets, tokens) = group_by_id(ids, vocab);
    let up = |v: &[u32]| {
        stream
            .clone_htod(v)
            .map_err(|e| driver("cuMemcpyHtoDAsync", k, e))
    };
    let (d_ids, d_off, d_tok) = (up(&distinct)?, up(&offsets)?, up(&tokens)?);
    let (ip, _i) = d_ids.device_ptr(stream);
    let (op, _o) = d_off.device_ptr(stream);
    let (tp, _t) = d_tok.device_ptr(stream);
    let (gp, _g) = dx.device_ptr(stream);
    let (wp, _w) = dwte.device_ptr_mut(stream);
    let launches = plan::embedding_backward_tokens_host_ids(ip, op, tp, gp, wp, distinct.len(), c);
    // SAFETY: the `distinct` ids (each below `vocab`), their `distinct + 1` offsets and the `n`
    // tokens (each below `n`) uploaded above, ordered before the kernel on `stream` and freed
    // in stream order after it; `n·c` of dx and `vocab·c` of dwte (checked above); all held.
    unsafe { enqueue(stream, &launches) }
}

/// Position embedding backward, accumulated into `dwpe`'s first `t` rows in row order (see
/// [`host::nn::embedding_backward_positions`](crate::host::nn::embedding_backward_positions)).
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
pub fn embedding_backward_positions(
    stream: &CudaStream,
    dx: &impl DevicePtr<f32>,
    t: usize,
    c: usize,
    dwpe: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let k = "embedding_backward_positions_f32";
    let n = rows_of(k, "dx", dx.len(), c)?;
    check_embedding(k, n, c, dwpe.len(), t, c)?;
    if n == 0 {
        return Ok(());
    }
    let (gp, _g) = dx.device_ptr(stream);
    let (wp, _w) = dwpe.device_ptr_mut(stream);
    let launches = plan::embedding_backward_positions(gp, wp, n, c, t);
    // SAFETY: `n·c` of dx and at least `t·c` of dwpe (t > 0), checked above, both held.
    unsafe { enqueue(stream, &launches) }
}
