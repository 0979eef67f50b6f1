//! CUDA C kernels compiled at run time by NVRTC, each with a host implementation of the same math
//!
//! Not yet built: see the open issues.
#![forbid(unsafe_code)]
