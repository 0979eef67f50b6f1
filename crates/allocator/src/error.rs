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
    #[error("{}", oom_message(*.device, *.requested, *.allocated, *.reserved, *.device_total, *.device_free, *.limit))]
    OutOfMemory {
        /// The device whose memory ran out.
        device: Device,
        /// Bytes asked for (before rounding).
        requested: usize,
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

fn oom_message(
    device: Device,
    requested: usize,
    allocated: usize,
    reserved: usize,
    device_total: usize,
    device_free: usize,
    limit: Option<usize>,
) -> String {
    let limit = match limit {
        Some(l) => format!(
            "The caching allocator is limited to {} by its memory limit. ",
            format_size(l)
        ),
        None => String::new(),
    };
    format!(
        "{device} out of memory. Tried to allocate {}. The device has a total capacity of {} of \
         which {} is free. {limit}Of the allocated memory {} is allocated by the caching \
         allocator, and {} is reserved by it but unallocated. If reserved but unallocated memory \
         is large try setting max_split_size to avoid fragmentation.",
        format_size(requested),
        format_size(device_total),
        format_size(device_free),
        format_size(allocated),
        format_size(reserved.saturating_sub(allocated)),
    )
}
