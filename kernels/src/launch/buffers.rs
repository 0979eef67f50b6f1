//! Kernels on stream-ordered `fsdp_device` buffers ([`fsdp_device::Buffer::use_on`]): safe
//! entry points for code that keeps its device memory in such buffers (FSDP's engine on a
//! device) rather than in cudarc slices.

use fsdp_device::{AccessMode, Buffer, DType, Device, Event, Stream};
use half::{bf16, f16};

use super::cast_raw;
use crate::KernelError;

/// Cast the stream-ordered CUDA buffer `src` into `dst` (same length, distinct element types
/// among f32, bf16 and f16, not overlapping) on `stream`, each value rounded once to nearest
/// even: the kernel of [`cast`](super::cast), ordered by both buffers' stream orders. Returns
/// the event recorded after it.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for buffers that are not stream-ordered CUDA buffers of
/// `stream`'s device, of other lengths, overlapping, or a pair of types without a kernel; the
/// stream orders' errors; compile, load and launch failures.
pub fn cast_buffer(src: &Buffer, dst: &Buffer, stream: &Stream) -> Result<Event, KernelError> {
    let invalid = |reason: String| KernelError::InvalidArgument {
        kernel: "cast",
        reason,
    };
    for b in [src, dst] {
        if !matches!(b.device(), Device::Cuda(_)) || b.stream_order().is_none() {
            return Err(invalid(format!(
                "a buffer on {} that is not a stream-ordered CUDA buffer",
                b.device()
            )));
        }
    }
    if src.len() != dst.len() || (src.overlaps(dst) && src.byte_len() > 0) {
        return Err(invalid(format!(
            "{} elements into {} (or overlapping views)",
            src.len(),
            dst.len()
        )));
    }
    let cu = stream
        .cuda_stream()
        .ok_or_else(|| invalid(format!("stream `{}` is not a CUDA stream", stream.name())))?
        .clone();
    let read = src.use_on(stream, AccessMode::Shared)?;
    let write = dst.use_on(stream, AccessMode::Exclusive)?;
    let (s, d, n) = (read.device_ptr(), write.device_ptr(), src.len());
    // SAFETY: `s` and `d` are the addresses of `n` elements of the matched types in two live,
    // non-overlapping stream-ordered buffers of this device, ordered on `stream` (their uses
    // are recorded after the launch, so the memory outlives the kernel).
    let launched = unsafe {
        match (src.dtype(), dst.dtype()) {
            (DType::F32, DType::BF16) => cast_raw::<f32, bf16>(&cu, s, d, n),
            (DType::F32, DType::F16) => cast_raw::<f32, f16>(&cu, s, d, n),
            (DType::BF16, DType::F32) => cast_raw::<bf16, f32>(&cu, s, d, n),
            (DType::F16, DType::F32) => cast_raw::<f16, f32>(&cu, s, d, n),
            (DType::BF16, DType::F16) => cast_raw::<bf16, f16>(&cu, s, d, n),
            (DType::F16, DType::BF16) => cast_raw::<f16, bf16>(&cu, s, d, n),
            (a, b) => Err(invalid(format!("no cast kernel from {a} to {b}"))),
        }
    };
    read.finish();
    let event = write.finish();
    launched.map(|()| event)
}
