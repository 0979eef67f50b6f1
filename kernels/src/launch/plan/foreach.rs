//! The launches of a step's work on many tensors (`launch/foreach.rs`): their sums of
//! squares (`cu/norm.cu`), AdamW and `AnyPrecisionAdamW` as decided (`cu/optim.cu`,
//! `cu/any_precision.cu`) and the zeroing of many buffers (`cu/elementwise.cu`), the tensors'
//! addresses by value in a struct parameter, a batch of tensors a launch.

use super::step::{adamw_choice, anyprecision_choice, anyprecision_kernel};
use super::{blocks, column, foreach_grid, CStruct, KernelLaunch, Param};
use crate::host::{AdamWChoice, AnyPrecision, AnyPrecisionChoice, NORM_BLOCK, NORM_ITEMS};
use crate::{KernelError, Program};

/// The buffers one launch of `zero_segments` carries.
pub const ZERO_SEGMENTS: usize = 96;
/// The tensors one launch of `sum_squares_many` carries.
pub const SQUARES_TENSORS: usize = 96;
/// The tensors one launch of `adamw_decided_many` carries.
pub const ADAMW_TENSORS: usize = 64;
/// The tensors one launch of `anyprecision_decided_many_*` carries.
pub const ANYPRECISION_TENSORS: usize = 48;

/// The block sums [`sum_of_squares_many`] needs over tensors of `lens` elements (its
/// scratch's f64 length before the launcher's minimum of one; 0 for none): the largest
/// batch's blocks of `NORM_BLOCK · NORM_ITEMS` elements (every batch reuses the scratch from
/// its start).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a batch of more blocks than a grid's 2^31 − 1.
pub fn sum_of_squares_many_blocks(
    lens: impl IntoIterator<Item = usize>,
) -> Result<usize, KernelError> {
    let chunk = NORM_BLOCK * NORM_ITEMS;
    let lens: Vec<usize> = lens.into_iter().collect();
    let mut most = 0;
    for batch in lens.chunks(SQUARES_TENSORS) {
        let blocks: usize = batch.iter().map(|n| n.div_ceil(chunk)).sum();
        if blocks > i32::MAX as usize {
            return Err(KernelError::InvalidArgument {
                kernel: "sum_squares_many",
                reason: format!("{blocks} blocks of one launch exceed the grid's 2^31 - 1"),
            });
        }
        most = most.max(blocks);
    }
    Ok(most)
}

/// [`launch::sum_of_squares_many`](crate::launch::sum_of_squares_many): the sum of squares of
/// each tensor of `xs` (its address and f32 length) into `scalars[first + i]` (f64), through
/// the block sums at `sums` ([`sum_of_squares_many_blocks`] f64, reused from their start by
/// every batch): per [`SQUARES_TENSORS`] tensors, `sum_squares_many` on the batch's blocks
/// (left out when it has none) and `sum_f64_final_many` on a block per tensor, both given
/// the batch's `SquaresList` (`x`, `n` arrays of u64, the tensors' first blocks and the end
/// as u32). No launch for no tensors.
///
/// # Errors
/// As [`sum_of_squares_many_blocks`].
pub fn sum_of_squares_many(
    xs: &[(u64, usize)],
    sums: u64,
    scalars: u64,
    first: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    if xs.is_empty() {
        return Ok(Vec::new());
    }
    sum_of_squares_many_blocks(xs.iter().map(|x| x.1))?;
    let chunk = NORM_BLOCK * NORM_ITEMS;
    let threads = NORM_BLOCK as u32;
    let mut out = Vec::new();
    for (b, batch) in xs.chunks(SQUARES_TENSORS).enumerate() {
        let mut start = Vec::with_capacity(SQUARES_TENSORS + 1);
        let mut total = 0u32;
        for &(_, n) in batch {
            start.push(total);
            total += n.div_ceil(chunk) as u32;
        }
        start.push(total);
        start.resize(SQUARES_TENSORS + 1, 0);
        let mut l = CStruct::new();
        l.pointers(&column(SQUARES_TENSORS, batch, |x| x.0))
            .u64s(&column(SQUARES_TENSORS, batch, |x| x.1 as u64))
            .u32s(&start);
        let count = batch.len() as u32;
        if total > 0 {
            // `sum_squares_many(SquaresList, u32 count, double* block_sums)`: block b sums
            // its tensor's chunk into `block_sums[b]`.
            out.push(KernelLaunch::new(
                Program::Norm,
                "sum_squares_many",
                blocks(total, threads),
                vec![
                    Param::Struct(l.clone()),
                    Param::U32(count),
                    Param::Ptr(sums),
                ],
            ));
        }
        let done = b * SQUARES_TENSORS;
        // `sum_f64_final_many(SquaresList, const double* block_sums, double* out)`: block k
        // sums tensor k's block sums into `out[k]`.
        out.push(KernelLaunch::new(
            Program::Norm,
            "sum_f64_final_many",
            blocks(count, threads),
            vec![
                Param::Struct(l),
                Param::Ptr(sums),
                Param::Ptr(scalars + ((first + done) * 8) as u64),
            ],
        ));
    }
    Ok(out)
}

/// One tensor of [`adamw_decided_many`] and [`anyprecision_decided_many`]: its buffers'
/// addresses, its length and which set of scalars it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecidedTensor {
    /// The parameter (f32, `n` elements).
    pub param: u64,
    /// Its gradient (f32, `n`).
    pub grad: u64,
    /// The first moment (AdamW: f32, `n`; `AnyPrecisionAdamW`: its state's `state_len(n)`).
    pub exp_avg: u64,
    /// The second moment (as `exp_avg`).
    pub exp_avg_sq: u64,
    /// The Kahan compensation (as `exp_avg`; `AnyPrecisionAdamW` with Kahan summation only,
    /// else ignored).
    pub compensation: Option<u64>,
    /// The parameter's elements.
    pub n: usize,
    /// `choices[1]` (with weight decay) when true, else `choices[0]`.
    pub decay: bool,
}

/// The grid of a batch of the many-tensor kernels: a row per tensor.
fn batch_grid(batch: &[DecidedTensor]) -> cudarc::driver::LaunchConfig {
    let longest = batch.iter().map(|t| t.n as u64).max().unwrap_or(0);
    foreach_grid(longest, batch.len() as u32)
}

/// [`launch::adamw_decided_many`](crate::launch::adamw_decided_many): AdamW as decided on each
/// of `tensors` with `choices[decay]`, reading the decision's slots of `scalars` (f64): one
/// launch of `adamw_decided_many` per [`ADAMW_TENSORS`] tensors, its `AdamWList` (`p`, `g`,
/// `m`, `v`, `n` arrays of u64, `decay` of u32) by value. No launch when every tensor is
/// empty.
pub fn adamw_decided_many(
    choices: &[AdamWChoice; 2],
    scalars: u64,
    tensors: &[DecidedTensor],
) -> Vec<KernelLaunch> {
    if tensors.iter().all(|t| t.n == 0) {
        return Vec::new();
    }
    let [plain, decayed] = choices.each_ref().map(adamw_choice);
    let mut out = Vec::new();
    for batch in tensors.chunks(ADAMW_TENSORS) {
        let at = |f: fn(&DecidedTensor) -> u64| column(ADAMW_TENSORS, batch, f);
        let mut l = CStruct::new();
        l.pointers(&at(|t| t.param))
            .pointers(&at(|t| t.grad))
            .pointers(&at(|t| t.exp_avg))
            .pointers(&at(|t| t.exp_avg_sq))
            .u64s(&at(|t| t.n as u64))
            .u32s(&column(ADAMW_TENSORS, batch, |t| u32::from(t.decay)));
        // `adamw_decided_many(AdamWList, u32 count, const double* s, AdamWChoice plain,
        // AdamWChoice decayed)`.
        out.push(KernelLaunch::new(
            Program::Optim,
            "adamw_decided_many",
            batch_grid(batch),
            vec![
                Param::Struct(l),
                Param::U32(batch.len() as u32),
                Param::Ptr(scalars),
                Param::Struct(plain.clone()),
                Param::Struct(decayed.clone()),
            ],
        ));
    }
    out
}

/// [`launch::anyprecision_decided_many`](crate::launch::anyprecision_decided_many):
/// `AnyPrecisionAdamW` of `kind` as decided on each of `tensors` with `choices[decay]`,
/// reading the decision's slots of `scalars` (f64): one launch of
/// `anyprecision_decided_many_<f32|bf16_state>` per [`ANYPRECISION_TENSORS`] tensors, its
/// `AnyPrecisionList` (`p`, `g`, `m`, `v`, `c`, `n` arrays of u64 — `c` 0 without Kahan
/// summation — and `decay` of u32) by value. No launch when every tensor is empty.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a dtype other than f32 and bf16, or Kahan summation
/// with a tensor without a compensation.
pub fn anyprecision_decided_many(
    choices: &[AnyPrecisionChoice; 2],
    kind: AnyPrecision,
    scalars: u64,
    tensors: &[DecidedTensor],
) -> Result<Vec<KernelLaunch>, KernelError> {
    let all = tensors.iter().all(|t| t.compensation.is_some());
    let (kernel, param_bf16) = anyprecision_kernel(kind, "anyprecision_decided_many_", all)?;
    if tensors.iter().all(|t| t.n == 0) {
        return Ok(Vec::new());
    }
    let [plain, decayed] = choices.each_ref().map(anyprecision_choice);
    let mut out = Vec::new();
    for batch in tensors.chunks(ANYPRECISION_TENSORS) {
        let at = |f: fn(&DecidedTensor) -> u64| column(ANYPRECISION_TENSORS, batch, f);
        let c = column(ANYPRECISION_TENSORS, batch, |t| {
            t.compensation.filter(|_| kind.kahan).unwrap_or(0)
        });
        let mut l = CStruct::new();
        l.pointers(&at(|t| t.param))
            .pointers(&at(|t| t.grad))
            .pointers(&at(|t| t.exp_avg))
            .pointers(&at(|t| t.exp_avg_sq))
            .pointers(&c)
            .u64s(&at(|t| t.n as u64))
            .u32s(&column(ANYPRECISION_TENSORS, batch, |t| u32::from(t.decay)));
        // `anyprecision_decided_many_<f32|bf16_state>(AnyPrecisionList, u32 count,
        // const double* s, AnyPrecisionChoice plain, AnyPrecisionChoice decayed,
        // u32 param_bf16)`.
        out.push(KernelLaunch::new(
            Program::AnyPrecision,
            kernel.clone(),
            batch_grid(batch),
            vec![
                Param::Struct(l),
                Param::U32(batch.len() as u32),
                Param::Ptr(scalars),
                Param::Struct(plain.clone()),
                Param::Struct(decayed.clone()),
                param_bf16.clone(),
            ],
        ));
    }
    Ok(out)
}

/// [`launch::fill_zero_many`](crate::launch::fill_zero_many): every element of each of `bufs`
/// (its address and f32 length) set to +0: one launch of `zero_segments` per
/// [`ZERO_SEGMENTS`] buffers, its `ZeroSegments` (`dst`, `n` arrays of u64) by value. No
/// launch when every buffer is empty.
pub fn fill_zero_many(bufs: &[(u64, usize)]) -> Vec<KernelLaunch> {
    if bufs.iter().all(|b| b.1 == 0) {
        return Vec::new();
    }
    let mut out = Vec::new();
    for batch in bufs.chunks(ZERO_SEGMENTS) {
        let mut z = CStruct::new();
        z.pointers(&column(ZERO_SEGMENTS, batch, |b| b.0))
            .u64s(&column(ZERO_SEGMENTS, batch, |b| b.1 as u64));
        let longest = batch.iter().map(|b| b.1 as u64).max().unwrap_or(0);
        let count = batch.len() as u32;
        // `zero_segments(ZeroSegments, u32 count)`.
        out.push(KernelLaunch::new(
            Program::Elementwise,
            "zero_segments",
            foreach_grid(longest, count),
            vec![Param::Struct(z), Param::U32(count)],
        ));
    }
    out
}
