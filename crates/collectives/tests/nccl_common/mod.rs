//! Helpers shared by the NCCL GPU tests (`tests/nccl.rs`, `tests/nccl_stream.rs`).
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fsdp_allocator::cuda::{CudaAllocator, CudaSource};
use fsdp_allocator::AllocatorConfig;
use fsdp_collectives::nccl::{self, NcclCommunicator, NcclOptions};
use fsdp_collectives::ReduceOp;
use fsdp_device::{Buffer, Element};

pub const ROLE: &str = "FSDP_NCCL_TEST_ROLE";
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// Why the GPU tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    if let Err(e) = nccl::available() {
        return Some(e.to_string());
    }
    if let Err(e) = CudaSource::new(0) {
        return Some(format!("no CUDA device 0: {e}"));
    }
    None
}

/// Why two ranks cannot share GPU 0 here, if they cannot.
pub fn skip_reason_shared_gpu() -> Option<String> {
    if let Some(r) = skip_reason() {
        return Some(r);
    }
    match nccl::version() {
        Ok(v) if v >= (2, 30, 0) => None,
        Ok(v) => Some(format!(
            "NCCL {}.{}.{} found; two ranks on one GPU need NCCL >= 2.30",
            v.0, v.1, v.2
        )),
        Err(e) => Some(e.to_string()),
    }
}

/// The tests' options: the cross-rank check on (the tests check mismatches), 60 s bounds.
pub fn opts() -> NcclOptions {
    NcclOptions::default()
        .with_timeout(TIMEOUT)
        .with_init_timeout(TIMEOUT)
        .with_verify(true)
}

pub fn allocator() -> CudaAllocator {
    CudaAllocator::new(CudaSource::new(0).unwrap(), AllocatorConfig::default()).unwrap()
}

/// The test value of rank `r` at index `i`: small integers, so that sums, products, averages
/// over two ranks, minima and maxima are exact in every element type.
pub fn val(r: usize, i: usize) -> f64 {
    ((r * 7 + i * 3) % 11) as f64
}

pub fn reference(op: ReduceOp, xs: impl Iterator<Item = f64>, n: usize) -> f64 {
    let xs: Vec<f64> = xs.collect();
    match op {
        ReduceOp::Sum => xs.iter().sum(),
        ReduceOp::Avg => xs.iter().sum::<f64>() / n as f64,
        ReduceOp::Min => xs.iter().copied().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Product => xs.iter().product(),
        other => panic!("no reference for {other:?}"),
    }
}

pub fn upload<T: Element>(comm: &NcclCommunicator, alloc: &CudaAllocator, data: &[f64]) -> Buffer {
    let buf = alloc
        .allocate_buffer(T::DTYPE, data.len(), comm.cuda_stream())
        .unwrap();
    let host: Vec<T> = data.iter().map(|v| T::from_f64(*v)).collect();
    comm.copy_from_host(&buf, &host).unwrap();
    buf
}

pub fn download<T: Element>(comm: &NcclCommunicator, buf: &Buffer) -> Vec<f64> {
    comm.copy_to_host::<T>(buf)
        .unwrap()
        .into_iter()
        .map(|v| v.to_f64())
        .collect()
}

/// Equal within `rel` of the wanted magnitude (for averages and long products, which NCCL
/// rounds in its own order).
pub fn assert_close(what: &str, got: &[f64], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * w.abs().max(1.0),
            "{what}: element {i} of {}: {g} vs {w}",
            got.len()
        );
    }
}

pub fn assert_vals(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g, w, "{what}: element {i} of {}", got.len());
    }
}

/// Kills and reaps a child process on every path.
pub struct ChildGuard(pub Option<Child>);

impl ChildGuard {
    pub fn wait(mut self, timeout: Duration) -> (bool, String) {
        let mut child = self.0.take().unwrap();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                let out = child.wait_with_output().unwrap();
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                return (status.success(), text);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("child did not finish within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn spawn_self(test: &str, role: &str) -> ChildGuard {
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    ChildGuard(Some(child))
}
