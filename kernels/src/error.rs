//! The crate's error type.

use fsdp_device::DeviceError;

/// Errors of compiling and launching kernels.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The CUDA driver or NVRTC could not be found or a device call failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// NVRTC rejected a program, or (for [`compile_ptx`](crate::compile_ptx)) warned about it.
    #[error("NVRTC could not compile `{program}` for {arch} ({status}):\n{log}")]
    Compile {
        /// The program.
        program: &'static str,
        /// The virtual architecture (`compute_90`).
        arch: String,
        /// NVRTC's status.
        status: String,
        /// NVRTC's log.
        log: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {op} failed for kernel `{kernel}`: {message}")]
    Driver {
        /// The call (`cuModuleLoadData`, `cuLaunchKernel`, …).
        op: &'static str,
        /// The kernel or program.
        kernel: String,
        /// The driver's error.
        message: String,
    },
    /// Slices of a kernel call differ in length.
    #[error("kernel `{kernel}`: {what} has {actual} elements, expected {expected}")]
    Length {
        /// The kernel.
        kernel: &'static str,
        /// The argument.
        what: &'static str,
        /// The length it must have.
        expected: usize,
        /// The length it has.
        actual: usize,
    },
    /// The caching allocator could not serve a buffer (out of memory, with PyTorch's message,
    /// or its memory source failed), or its settings in the environment are malformed.
    #[error(transparent)]
    Alloc(#[from] fsdp_allocator::AllocError),
    /// A scalar argument is out of range.
    #[error("kernel `{kernel}`: {reason}")]
    InvalidArgument {
        /// The kernel.
        kernel: &'static str,
        /// What is wrong.
        reason: String,
    },
}
