//! The crate's error type.

use std::time::Duration;

use fsdp_device::{Device, DeviceError};

use crate::format_size;

/// Errors of the caching allocator and its memory sources.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    /// The allocator could not serve a request even after freeing its cache and retrying. The
    /// message reads like PyTorch's `CUDA out of memory` error.
    #[error("{}", oom_message(*.device, *.allocation_size, *.allocated, *.reserved, *.device_total, *.device_free, *.limit))]
    OutOfMemory {
        /// The device whose memory ran out.
        device: Device,
        /// Bytes asked for (before rounding).
        requested: usize,
        /// Bytes the allocator tried to reserve for the request: the size of the segment it
        /// needed (PyTorch's "Tried to allocate"), or the request itself when it overflows.
        allocation_size: usize,
        /// Bytes held by live blocks when the request failed.
        allocated: usize,
        /// Bytes held in segments (allocated, pending or cached) when the request failed.
        reserved: usize,
        /// The memory source's total capacity.
        device_total: usize,
        /// The memory source's free bytes.
        device_free: usize,
        /// The allocator's memory limit, if one is set.
        limit: Option<usize>,
    },
    /// A memory source could not provide a segment of this size (the allocator answers this by
    /// freeing its cache and retrying, then with [`AllocError::OutOfMemory`]).
    #[error("the memory source could not provide {}", format_size(*.bytes))]
    SourceOutOfMemory {
        /// Bytes asked of the source.
        bytes: usize,
    },
    /// A memory source failed for a reason other than lack of memory (a CUDA driver error).
    #[error("{op} failed: {message}")]
    Source {
        /// The failing operation.
        op: &'static str,
        /// The source's description of the failure.
        message: String,
    },
    /// No device is available for this source (no CUDA driver, no GPU, bad ordinal).
    #[error("no device: {0}")]
    NoDevice(String),
    /// An option of [`AllocatorConfig`](crate::AllocatorConfig) is out of range.
    #[error("invalid allocator configuration: {0}")]
    InvalidConfig(String),
    /// PyTorch's allocator settings text (`PYTORCH_CUDA_ALLOC_CONF`) could not be read:
    /// an unknown key, a malformed or out-of-range value, an option that is not supported.
    #[error("allocator option `{key}`: {reason} (value `{value}`)")]
    AllocConf {
        /// The key (or the token where a key was expected).
        key: String,
        /// Its value as written, without whitespace (empty when there is none).
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// An argument did not fit (a stream of another device, a size that overflows).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A blocking wait ran past its timeout.
    #[error("timed out after {waited:?} waiting for {what}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long the wait lasted.
        waited: Duration,
    },
    /// An error of a stream, event or buffer.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A snapshot could not be written or read as JSON.
    #[error("snapshot JSON: {0}")]
    Json(String),
}

/// The message of PyTorch's `CUDA out of memory` error (`CUDACachingAllocator.cpp`), with the
/// same facts: the size it tried to reserve, the device, its total and free memory, the limit
/// (PyTorch's "allowed" memory of a memory fraction), what the allocator holds, and the hint at
/// the options that fight fragmentation.
fn oom_message(
    device: Device,
    tried: usize,
    allocated: usize,
    reserved: usize,
    device_total: usize,
    device_free: usize,
    limit: Option<usize>,
) -> String {
    let (kind, name) = match device {
        Device::Cuda(i) => ("CUDA".to_string(), format!("GPU {i}")),
        d => (d.to_string(), format!("Device {d}")),
    };
    let allowed = match limit {
        Some(l) => format!("{} allowed; ", format_size(l)),
        None => String::new(),
    };
    format!(
        "{kind} out of memory. Tried to allocate {}. {name} has a total capacity of {} of which \
         {} is free. {allowed}Of the allocated memory {} is allocated by the caching allocator, \
         and {} is reserved by the caching allocator but unallocated. If reserved but \
         unallocated memory is large try setting max_split_size (PyTorch's max_split_size_mb) \
         or expandable_segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) to avoid \
         fragmentation.",
        format_size(tried),
        format_size(device_total),
        format_size(device_free),
        format_size(allocated),
        format_size(reserved.saturating_sub(allocated)),
    )
}
