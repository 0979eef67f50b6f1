//! Many copies into f32 device memory in one launch (`gather_segments` of `cu/elementwise.cu`):
//! a gather of peers' shards enqueues one kernel for a unit's tensors and ranks instead of one
//! `cuMemcpyDtoDAsync` each.

use cudarc::driver::CudaStream;

use super::enqueue;
use super::plan::{self, GatherCopy};
use crate::KernelError;

/// Enqueues `copies` on `stream` in launches of at most
/// [`GATHER_SEGMENTS`](plan::GATHER_SEGMENTS) copies each ([`plan::gather_copies`]). Copies
/// of no elements are left out.
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
    // SAFETY: the caller's contract covers every address and length of the copies.
    unsafe { enqueue(stream, &plan::gather_copies(copies)) }
}
