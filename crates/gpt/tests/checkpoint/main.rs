//! Checkpoints: full safetensors files (nanoGPT names, PyTorch-readable, atomic writes) and
//! sharded checkpoints resharded on load ([`full`], [`sharded`]). This file holds what both use.

#[path = "../common/mod.rs"]
mod common;
mod full;
mod sharded;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use common::cli::{f32_tensor, write_raw_safetensors, write_safetensors, RawTensor};
use common::{cfg, init, load};
use fsdp::checkpoint::write_atomic;
use fsdp::FsdpError;
use fsdp_gpt::checkpoint::{load_full, save_full};
use fsdp_gpt::model::{init_params, named_params, param_specs, GptConfig};

/// A fresh, empty directory under the target's temporary directory.
fn temp_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("checkpoint-{name}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn bits(p: &HashMap<String, Vec<f32>>) -> HashMap<String, Vec<u32>> {
    p.iter()
        .map(|(k, v)| (k.clone(), v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

fn small() -> (GptConfig, HashMap<String, Vec<f32>>) {
    let cfg = GptConfig::new(2, 2, 32, 16, 96).unwrap();
    let p = named_params(&cfg, init_params(&cfg, 7)).unwrap();
    (cfg, p)
}

fn message(e: FsdpError) -> String {
    e.to_string()
}

fn spec_tensors(
    cfg: &GptConfig,
    p: &HashMap<String, Vec<f32>>,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    param_specs(cfg)
        .into_iter()
        .map(|s| {
            let v = p[&s.name].clone();
            (s.name, s.shape, v)
        })
        .collect()
}
