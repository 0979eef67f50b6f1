//! The GPU check shared by the CUDA tests (`cuda.rs`, `cuda_buffers.rs`, cargo feature `cuda`):
//! without a CUDA driver or device the test prints `<test>: skipped: no GPU (<reason>)`; with
//! one the tests of a binary run one at a time (they share device 0's event pool, whose size one
//! of them checks, or count the process's deferred releases).

use std::sync::{Mutex, MutexGuard};

use fsdp_device::cuda;

/// Held by the test running on the GPU.
static SERIAL: Mutex<()> = Mutex::new(());

/// The serializing guard where a GPU is found; `None` (after printing the skip) otherwise.
pub fn gpu(test: &str) -> Option<MutexGuard<'static, ()>> {
    match cuda::device_count() {
        Ok(_) => Some(SERIAL.lock().unwrap_or_else(|e| e.into_inner())),
        Err(e) => {
            println!("{test}: skipped: no GPU ({e})");
            None
        }
    }
}
