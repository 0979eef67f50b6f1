//! Many copies into f32 device memory in one launch (`gather_segments` of `cu/elementwise.cu`):
//! a gather of peers' shards enqueues one kernel for a unit's tensors and ranks instead of one
//! `cuMemcpyDtoDAsync` each.

use cudarc::driver::{CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};

use super::driver;
use super::function;
use crate::{KernelError, Program};

/// The segments one launch of `gather_segments` carries (its parameters hold them by value).
pub const GATHER_SEGMENTS: usize = 96;

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

/// The kernel's `GatherSegments` parameter, laid out as in `cu/elementwise.cu`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Segments {
    src: [u64; GATHER_SEGMENTS],
    dst: [u64; GATHER_SEGMENTS],
    n: [u64; GATHER_SEGMENTS],
    widen: [u32; GATHER_SEGMENTS],
}

// SAFETY: plain integers in C layout, the CUDA struct's fields in its order (u64 arrays, then
// a u32 array: no padding), passed by value as a kernel parameter.
unsafe impl DeviceRepr for Segments {}

/// At most this many blocks per segment (they stride over the rest).
const MAX_BLOCKS_X: u64 = 512;

/// The grid of one launch of `gather_segments` over `count` segments whose longest has
/// `longest` elements (as [`foreach_grid`](super::foreach_grid), at most 512 blocks along x).
pub fn gather_grid(longest: u64, count: u32) -> LaunchConfig {
    super::foreach::per_segment(longest, count, MAX_BLOCKS_X)
}

/// Enqueues `copies` on `stream` in launches of at most [`GATHER_SEGMENTS`] copies each.
/// Copies of no elements are left out.
///
/// # Safety
/// Every `src` must be device memory of `stream`'s context valid for `len` elements of its
/// type and every `dst` for `len` f32, aligned for their types, ordered by the caller after
/// their writers and before their next writers; no destination overlaps a source or another
/// destination.
///
/// # Errors
/// Compile, load and launch failures.
pub unsafe fn gather_copies(stream: &CudaStream, copies: &[GatherCopy]) -> Result<(), KernelError> {
    let k = "gather_segments";
    let copies: Vec<&GatherCopy> = copies.iter().filter(|c| c.len > 0).collect();
    if copies.is_empty() {
        return Ok(());
    }
    let f = function(stream, Program::Elementwise, k)?;
    for batch in copies.chunks(GATHER_SEGMENTS) {
        let mut s = Segments {
            src: [0; GATHER_SEGMENTS],
            dst: [0; GATHER_SEGMENTS],
            n: [0; GATHER_SEGMENTS],
            widen: [0; GATHER_SEGMENTS],
        };
        for (i, c) in batch.iter().enumerate() {
            (s.src[i], s.dst[i], s.n[i]) = (c.src, c.dst, c.len as u64);
            s.widen[i] = u32::from(c.widen);
        }
        let longest = batch.iter().map(|c| c.len as u64).max().unwrap_or(1);
        let count = batch.len() as u32;
        let cfg = gather_grid(longest, count);
        let mut b = stream.launch_builder(&f);
        b.arg(&s).arg(&count);
        // SAFETY: (GatherSegments g, u32 count) with `count` ≤ GATHER_SEGMENTS segments filled;
        // the caller's contract covers every address and length.
        unsafe { b.launch(cfg) }.map_err(|e| driver("cuLaunchKernel", k, e))?;
    }
    Ok(())
}
