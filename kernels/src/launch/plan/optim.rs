//! The launches of the one-tensor optimizers (`cu/optim.cu`) and of the norm's sums of
//! squares and clip coefficient (`cu/norm.cu`).

use super::{blocks, config, KernelLaunch, Param};
use crate::host::{AdamWScalars, MomentFloat, SgdScalars, NORM_BLOCK, NORM_ITEMS};
use crate::{KernelError, Program};

/// AdamW's scalars in the kernels' order: `adamw_f32`'s and `adamw_bf16_state`'s parameters
/// after `n`, and the fields of `AdamWArgs` (each choice of `adamw_decided_*`).
pub(super) fn adamw_scalars(s: &AdamWScalars) -> [Param; 9] {
    [
        Param::F32(s.decay),
        Param::F32(s.w1),
        Param::F32(s.one_minus_w1),
        Param::U32(u32::from(s.lerp_small)),
        Param::F32(s.beta2),
        Param::F32(s.one_minus_beta2),
        Param::F32(s.neg_step_size),
        Param::F32(s.bc2_sqrt),
        Param::F32(s.eps),
    ]
}

/// SGD's scalars in the kernels' order: `sgd_f32`'s parameters after `n`, and the fields of
/// `SgdArgs` (each choice of `sgd_decided_f32`).
pub(super) fn sgd_scalars(s: &SgdScalars) -> [Param; 5] {
    [
        Param::F32(s.neg_lr),
        Param::F32(s.wd),
        Param::F32(s.momentum),
        Param::F32(s.damp),
        Param::U32(s.flags),
    ]
}

/// [`launch::adamw`](crate::launch::adamw): one AdamW step on `n` f32 parameters `p`, their
/// gradients `g` and moments `m`, `v` in `S`.
pub fn adamw<S: MomentFloat>(
    s: &AdamWScalars,
    p: u64,
    g: u64,
    m: u64,
    v: u64,
    n: usize,
) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // (float*, const float*, S*, S*, u64, 3 floats, u32, 5 floats).
    let mut params = vec![
        Param::Ptr(p),
        Param::Ptr(g),
        Param::Ptr(m),
        Param::Ptr(v),
        Param::U64(n as u64),
    ];
    params.extend(adamw_scalars(s));
    vec![KernelLaunch::new(
        Program::Optim,
        S::ADAMW_KERNEL,
        config(n),
        params,
    )]
}

/// [`launch::sgd`](crate::launch::sgd): one SGD step on `n` f32 parameters `p`, gradients `g`
/// and momentum buffer `m` (touched only when the flags say momentum).
pub fn sgd(s: &SgdScalars, p: u64, g: u64, m: u64, n: usize) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // `sgd_f32(float*, const float*, float*, u64, 4 floats, u32)`.
    let mut params = vec![
        Param::Ptr(p),
        Param::Ptr(g),
        Param::Ptr(m),
        Param::U64(n as u64),
    ];
    params.extend(sgd_scalars(s));
    vec![KernelLaunch::new(
        Program::Optim,
        "sgd_f32",
        config(n),
        params,
    )]
}

/// The per-block sums [`sum_of_squares`] needs over `n` elements (its scratch's f64 length;
/// 0 for none).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for more blocks than a grid's 2^31 − 1.
pub fn sum_of_squares_blocks(n: usize) -> Result<usize, KernelError> {
    let blocks = n.div_ceil(NORM_BLOCK * NORM_ITEMS);
    if blocks > i32::MAX as usize {
        return Err(KernelError::InvalidArgument {
            kernel: "sum_squares_f32",
            reason: format!("{n} elements need more than the grid's 2^31 - 1 blocks"),
        });
    }
    Ok(blocks)
}

/// [`launch::sum_of_squares`](crate::launch::sum_of_squares): the sum of squares of `n` f32
/// at `x` into `out[0]` (f64), through `sums` ([`sum_of_squares_blocks`] f64; none for an
/// empty `x`, whose sum is a 0 written by `memset`).
///
/// # Errors
/// As [`sum_of_squares_blocks`].
pub fn sum_of_squares(
    x: u64,
    n: usize,
    sums: u64,
    out: u64,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let count = sum_of_squares_blocks(n)?;
    if n == 0 {
        return Ok(super::memset(out, 0.0f64, 1));
    }
    let threads = NORM_BLOCK as u32;
    Ok(vec![
        // `sum_squares_f32(const float*, u64, double*)`: each block one sum.
        KernelLaunch::new(
            Program::Norm,
            "sum_squares_f32",
            blocks(count as u32, threads),
            vec![Param::Ptr(x), Param::U64(n as u64), Param::Ptr(sums)],
        ),
        // `sum_f64_final(const double*, u64, double*)`, one block.
        KernelLaunch::new(
            Program::Norm,
            "sum_f64_final",
            blocks(1, threads),
            vec![Param::Ptr(sums), Param::U64(count as u64), Param::Ptr(out)],
        ),
    ])
}

/// [`launch::clip_coefficient`](crate::launch::clip_coefficient): the global norm and the
/// clip coefficient from the squared parts `sharded[0]` and `replicated[0]` into `out[0..2]`,
/// one thread.
pub fn clip_coefficient(
    sharded: u64,
    replicated: u64,
    max_norm: f64,
    out: u64,
) -> Vec<KernelLaunch> {
    // `clip_coefficient(const double*, const double*, double, double*)`.
    vec![KernelLaunch::new(
        Program::Norm,
        "clip_coefficient",
        blocks(1, 1),
        vec![
            Param::Ptr(sharded),
            Param::Ptr(replicated),
            Param::F64(max_norm),
            Param::Ptr(out),
        ],
    )]
}
