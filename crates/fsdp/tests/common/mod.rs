//! Set-up shared by the engine tests (`mixed_precision`, `generic_models`, `grad_norm`,
//! `grad_scaler`): the global batch, the AdamW settings, the ring options, the sharding
//! configurations run, one forward and backward pass on plain maps, and the bitwise view of a
//! state dict. Each test uses what it needs.
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Duration;

use fsdp::engine::{FsdpConfig, FsdpModel, ShardingStrategy};
use fsdp::optim::AdamWConfig;
use fsdp::{FsdpError, Params};
use fsdp_collectives::ring;

/// Parameters (or gradients) by name.
pub type Map = HashMap<String, Vec<f32>>;

/// Parameters as sorted `(name, bits)` pairs, for bitwise comparisons.
pub type Bits = Vec<(String, Vec<u32>)>;

/// Examples in the global batch: divisible by every world size tested.
pub const GLOBAL: usize = 12;

/// AdamW at learning rate 1e-2, the other settings PyTorch's defaults.
pub fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-2,
        ..AdamWConfig::default()
    }
}

/// The ring engine's options with a 60 s timeout (generous for a loaded machine).
pub fn ring_options() -> ring::RingOptions {
    let mut options = ring::RingOptions::default();
    options.timeout = Duration::from_secs(60);
    options
}

/// `strategy` with `ranks_per_node` (the hybrid strategies' node size; `None`: one node).
pub fn mesh(strategy: ShardingStrategy, ranks_per_node: Option<usize>) -> FsdpConfig {
    let mut config = FsdpConfig::new(strategy);
    config.ranks_per_node = ranks_per_node;
    config
}

/// Every strategy at worlds 1 to 4, hybrid ones on every `replicas × ranks_per_node` mesh
/// (1×1, 1×2, 2×1, 1×3, 3×1, 1×4, 2×2, 4×1); `None` is one node of all ranks.
pub fn configs() -> Vec<(usize, FsdpConfig)> {
    let mut out = Vec::new();
    for strategy in ShardingStrategy::ALL {
        for world in 1..=4 {
            let meshes: Vec<Option<usize>> = if strategy.is_hybrid() {
                (1..=world).filter(|n| world % n == 0).map(Some).collect()
            } else {
                vec![None]
            };
            for ranks_per_node in meshes {
                out.push((world, mesh(strategy, ranks_per_node)));
            }
        }
    }
    out
}

/// `m` as sorted `(name, bits)` pairs.
pub fn bits(m: &Map) -> Bits {
    let mut v: Vec<_> = m
        .iter()
        .map(|(k, v)| (k.clone(), v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    v.sort();
    v
}

/// One forward and backward pass of `model` through all its spans on `params`, in one process:
/// the loss and the gradients, in fresh zeroed maps shaped as `like`.
///
/// # Errors
/// The model's, as it returns them.
pub fn loss_and_grads<M: FsdpModel>(
    model: &M,
    params: &dyn Params,
    like: &Map,
    batch: &M::Batch,
) -> Result<(f32, Map), FsdpError> {
    let mut grads: Map = like
        .iter()
        .map(|(k, v)| (k.clone(), vec![0.0; v.len()]))
        .collect();
    let mut tape = M::Tape::default();
    let n = model.spans().len();
    for s in 0..n {
        model.forward(s, params, batch, &mut tape)?;
    }
    let loss = model.loss(&tape)?;
    for s in (0..n).rev() {
        model.backward(s, params, &mut grads, batch, &mut tape)?;
    }
    Ok((loss, grads))
}

/// A fresh directory `fsdp-<test>-<process id>-<name>` under the system's temporary one.
pub fn temp_dir(test: &str, name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("fsdp-{test}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
