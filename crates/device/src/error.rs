//! The crate's error type.

use std::time::Duration;

use crate::DType;

/// Errors of streams, events and buffers.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// A blocking wait ran past its timeout.
    #[error("timed out after {waited:?} waiting for {what}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long the wait lasted.
        waited: Duration,
    },
    /// A task enqueued on a stream panicked; the stream keeps the first such error (like CUDA's
    /// sticky errors) and reports it on every later synchronisation.
    #[error("stream `{stream}` failed: {message}")]
    StreamFailed {
        /// The stream's name.
        stream: String,
        /// The panic message or failure reason.
        message: String,
    },
    /// The operation needs a device other than the buffer's or stream's.
    #[error("{op} is not supported on {device}")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// The device it was asked of.
        device: String,
    },
    /// A buffer was accessed as an element type other than its own.
    #[error("buffer holds {actual} elements but was accessed as {requested}")]
    DTypeMismatch {
        /// The buffer's element type.
        actual: DType,
        /// The type it was accessed as.
        requested: DType,
    },
    /// A length, range or alignment did not fit.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A CUDA driver call failed (feature `cuda`).
    #[error("CUDA {op} failed: {message}")]
    Cuda {
        /// The driver call.
        op: &'static str,
        /// The driver's error.
        message: String,
    },
    /// A shared library (CUDA driver, NVRTC, NCCL) could not be found or loaded.
    #[error("{library} not found: {detail}")]
    LibraryNotFound {
        /// The library's name.
        library: String,
        /// Where it was looked for, or why it did not load.
        detail: String,
    },
    /// Host memory could not be allocated.
    #[error("could not allocate {bytes} bytes of host memory")]
    OutOfMemory {
        /// Bytes requested.
        bytes: usize,
    },
    /// Shared host memory (a `memfd` region) could not be created, sized, sealed or mapped.
    #[error("could not create {bytes} bytes of shared host memory: {what} failed: {reason}")]
    SharedMemory {
        /// Bytes requested.
        bytes: usize,
        /// The step that failed.
        what: &'static str,
        /// The system's reason.
        reason: String,
    },
}
