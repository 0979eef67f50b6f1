//! Helpers shared by the kernels' integration tests (`gpu.rs`, `gpu_gemm.rs`, `gpu_nn.rs`,
//! `gpu_gpt.rs`, `gpt_vs_reference.rs`, `twins_vs_gpt.rs`): the splitmix64 stream their inputs
//! come from, uniform values, token ids and perturbed GPT weights drawn from it, the check that
//! prints `<test>: skipped: no GPU (<reason>)` where no CUDA device is found, and the host ↔
//! device copies; and (`flash`) the fused attention's twins on random inputs, for
//! `gpu_attention.rs` and `attention_emulated.rs`. Each test uses what it needs.
#![allow(dead_code)]

pub mod emulator;
pub mod flash;
pub mod on_device;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use fsdp_device::Stream;
use fsdp_gpt::model::{init_params, named_params, GptConfig};

/// The next value of a splitmix64 stream whose state is `state` (advanced).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform values in `[-scale, scale)` from a splitmix64 stream.
pub fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            let z = splitmix64(&mut state);
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Token ids in `0..vocab` from the same stream as [`data`].
pub fn ids(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    data(n, seed, 1.0)
        .iter()
        .map(|&x| (((x + 1.0) * 0.5 * vocab as f32) as usize).min(vocab - 1) as u32)
        .collect()
}

/// nanoGPT's initialisation with every parameter moved by up to ±0.05 (biases and layer norms
/// away from 0 and 1, so that their gradients and the bias adds matter).
pub fn weights(cfg: &GptConfig) -> HashMap<String, Vec<f32>> {
    let values = init_params(cfg, 7)
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let noise = data(v.len(), 100 + i as u64, 0.05);
            v.iter().zip(noise).map(|(a, b)| a + b).collect()
        })
        .collect();
    named_params(cfg, values).unwrap()
}

/// The device model's shape of `cfg`.
pub fn dims(cfg: &GptConfig) -> fsdp_kernels::gpt::GptDims {
    fsdp_kernels::gpt::GptDims {
        n_layer: cfg.n_layer,
        n_head: cfg.n_head,
        n_embd: cfg.n_embd,
        block_size: cfg.block_size,
        vocab_size: cfg.vocab_size,
    }
}

/// The bits of each value, for bitwise comparisons.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The largest magnitude of `v`.
pub fn max_abs(v: &[f32]) -> f64 {
    v.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()))
}

/// The largest `|a − b|` element-wise; a NaN difference (a NaN value) wins, so that it fails
/// any bound.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x - y).abs())
        .fold(0.0f64, |m, d| if d.is_nan() || d > m { d } else { m })
}

/// Whether a CUDA device is found; where not, prints `<test>: skipped: no GPU (<reason>)`.
pub fn gpu(test: &str) -> bool {
    if let Err(e) = fsdp_device::cuda::device_count() {
        println!("{test}: skipped: no GPU ({e})");
        return false;
    }
    true
}

/// A CUDA stream on `cuda:0`, or `None` (the skip printed by [`gpu`]) without a GPU.
pub fn gpu_stream(test: &str) -> Option<Arc<CudaStream>> {
    if !gpu(test) {
        return None;
    }
    let s = Stream::cuda(0, test).expect("a CUDA stream on cuda:0");
    Some(s.cuda_stream().expect("a CUDA stream").clone())
}

/// `v` copied to the device.
pub fn up<T: DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    s.clone_htod(v).unwrap()
}

/// `d` copied to the host, the stream synchronized.
pub fn down<T: DeviceRepr + ValidAsZeroBits>(s: &Arc<CudaStream>, d: &CudaSlice<T>) -> Vec<T> {
    let v = s.clone_dtoh(d).unwrap();
    s.synchronize().unwrap();
    v
}
