//! The device trainer's tests' shared run: the tiny GPT (2 layers, 2 heads, 32 wide, 16
//! tokens, a vocabulary of 64), 8 rows a step, AdamW lr 3e-3, betas (0.9, 0.95), eps 1e-8,
//! weight decay 0.1.

use std::collections::HashMap;

use fsdp::optim::{AdamWConfig, LrSchedule};
use fsdp_gpt::device_train::DeviceTrainConfig;
use fsdp_gpt::model::GptConfig;

/// The shared run with `schedule`, nanoGPT's groups when `decay_2d_only`, clipping at `clip`
/// and `accum` micro-batches a step; no offload, no checkpointing.
pub fn device_config(
    schedule: LrSchedule,
    decay_2d_only: bool,
    clip: Option<f64>,
    accum: usize,
) -> DeviceTrainConfig {
    DeviceTrainConfig {
        cfg: GptConfig::new(2, 2, 32, 16, 64).unwrap(),
        adamw: AdamWConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        schedule,
        decay_2d_only,
        grad_clip: clip,
        batch_size: 8,
        grad_accum: accum,
        offload: false,
        activation_checkpointing: false,
    }
}

/// Every parameter's bits, sorted by name (for bitwise comparisons).
pub fn param_bits(p: HashMap<String, Vec<f32>>) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<_> = p
        .into_iter()
        .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    v.sort();
    v
}
