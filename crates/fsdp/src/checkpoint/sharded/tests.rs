//! Unit tests of the sharded loader on crafted layouts: errors, never aborts.

use std::path::PathBuf;

use super::*;
use crate::units::ParamSpec;

/// A one-rank checkpoint in a fresh directory whose only unit has `layout` and a `param`
/// tensor of `values`.
fn crafted(test: &str, layout: ShardLayout, values: Vec<f32>) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fsdp-sharded-{test}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    let shards = RankShards {
        rank: 0,
        world: 1,
        strategy: "FULL_SHARD".into(),
        optimizer: "none",
        optimizer_step: 0,
        optimizer_steps: 0,
        units: vec![(layout, vec![("param", values)])],
        setup: OptimizerSetup::default(),
    };
    write_rank_shards(&dir, &shards).unwrap();
    dir
}

fn w_spec() -> Vec<ParamSpec> {
    vec![ParamSpec::new("w", vec![4])]
}

#[test]
fn a_huge_layout_is_an_error_naming_the_file_not_an_abort() {
    // 2^61 elements: 2^63 bytes, more than any allocation may hold.
    let huge = 1usize << 61;
    let layout = ShardLayout {
        unit: 0,
        factor: 1,
        shard_index: 0,
        padded_numel: huge,
        shard_numel: huge,
        params: vec![ShardParam {
            name: "w".into(),
            shape: vec![4],
            offset: 0,
        }],
    };
    let dir = crafted("huge", layout, vec![1.0; 4]);
    let e = load_sharded_checkpoint(&dir, &w_spec()).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("rank-00000-of-00001.safetensors"), "{msg}");
    assert!(msg.contains("cannot be allocated"), "{msg}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_parameter_shape_that_overflows_is_an_error() {
    let layout = ShardLayout {
        unit: 0,
        factor: 1,
        shard_index: 0,
        padded_numel: 4,
        shard_numel: 4,
        params: vec![ShardParam {
            name: "w".into(),
            shape: vec![1 << 40, 1 << 40],
            offset: 0,
        }],
    };
    let dir = crafted("overflow", layout, vec![1.0; 4]);
    let e = load_sharded_checkpoint(&dir, &w_spec()).unwrap_err();
    assert!(e.to_string().contains("lies outside"), "{e}");
    let _ = fs::remove_dir_all(&dir);
}
