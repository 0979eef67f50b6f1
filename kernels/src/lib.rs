//! CUDA C kernels compiled at run time by NVRTC, each with a host twin (the same arithmetic in
//! Rust).
#![allow(missing_docs)]
mod error;
pub mod programs;
pub use error::KernelError;
pub use programs::{compile, compile_ptx, compile_source, nvrtc_version, Program};
