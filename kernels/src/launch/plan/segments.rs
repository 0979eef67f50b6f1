//! The launches over segments (a tensor or copy each, `blockIdx.y`): their grids, and the
//! many copies of `gather_segments` (`cu/elementwise.cu`).

use cudarc::driver::LaunchConfig;

use super::{column, CStruct, KernelLaunch, Param};
use crate::Program;

/// Threads per block of the launches over segments.
const BLOCK: u32 = 256;
/// The elements a thread takes at least before another block is added along x.
const PER_THREAD: u64 = 8;
/// The most blocks a tensor of the many-tensor launches gets (they stride over the rest).
const MAX_BLOCKS_X: u64 = 1024;
/// The most blocks a copy of `gather_segments` gets.
const GATHER_BLOCKS_X: u64 = 512;

/// The segments one launch of `gather_segments` carries (its parameters hold them by value).
pub const GATHER_SEGMENTS: usize = 96;

/// The launch shape of `count` segments (`blockIdx.y`) whose longest has `longest` elements:
/// 256-thread blocks along x, one per 2048 elements of the longest, between 1 and
/// `max_blocks_x` (the blocks stride over the rest).
fn per_segment(longest: u64, count: u32, max_blocks_x: u64) -> LaunchConfig {
    let blocks = longest
        .div_ceil(u64::from(BLOCK) * PER_THREAD)
        .clamp(1, max_blocks_x) as u32;
    LaunchConfig {
        grid_dim: (blocks, count, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The grid of one launch of the many-tensor kernels (`adamw_decided_many`,
/// `anyprecision_decided_many_*`, `zero_segments`) over `count` tensors whose longest has
/// `longest` elements: 256-thread blocks, one along x per 2048 elements (at most 1024).
pub fn foreach_grid(longest: u64, count: u32) -> LaunchConfig {
    per_segment(longest, count, MAX_BLOCKS_X)
}

/// The grid of one launch of `gather_segments` over `count` segments whose longest has
/// `longest` elements (as [`foreach_grid`], at most 512 blocks along x).
pub fn gather_grid(longest: u64, count: u32) -> LaunchConfig {
    per_segment(longest, count, GATHER_BLOCKS_X)
}

/// One copy of [`gather_copies`]: `len` elements from the device address `src` (f32, or bf16
/// widened exactly to f32 when `widen`) to the device address `dst` (f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherCopy {
    /// The first source element's address.
    pub src: u64,
    /// The first destination element's address.
    pub dst: u64,
    /// Elements.
    pub len: usize,
    /// Whether the source is bf16 (widened), else f32 (copied).
    pub widen: bool,
}

/// [`launch::gather_copies`](crate::launch::gather_copies): `copies` in launches of at most
/// [`GATHER_SEGMENTS`] copies each, their `GatherSegments` struct by value (`src`, `dst`
/// and `n` arrays of u64, a `widen` array of u32, unused slots zero). Copies of no elements
/// are left out.
pub fn gather_copies(copies: &[GatherCopy]) -> Vec<KernelLaunch> {
    let copies: Vec<&GatherCopy> = copies.iter().filter(|c| c.len > 0).collect();
    let mut out = Vec::new();
    for batch in copies.chunks(GATHER_SEGMENTS) {
        let at = |f: fn(&&GatherCopy) -> u64| column(GATHER_SEGMENTS, batch, f);
        let mut s = CStruct::new();
        s.pointers(&at(|c| c.src))
            .pointers(&at(|c| c.dst))
            .u64s(&at(|c| c.len as u64))
            .u32s(&column(GATHER_SEGMENTS, batch, |c| u32::from(c.widen)));
        let longest = batch.iter().map(|c| c.len as u64).max().unwrap_or(1);
        let count = batch.len() as u32;
        // `gather_segments(GatherSegments g, u32 count)`.
        out.push(KernelLaunch::new(
            Program::Elementwise,
            "gather_segments",
            gather_grid(longest, count),
            vec![Param::Struct(s), Param::U32(count)],
        ));
    }
    out
}
