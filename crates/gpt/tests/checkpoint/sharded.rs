//! Sharded checkpoints: saved at one world size, loaded at others, resumed exactly, and their
//! errors.

use super::*;

use fsdp::checkpoint::{shard_file_name, LAYOUT_KEY};
use fsdp::optim::AdamWConfig;
use fsdp::units::UnitPlan;
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::checkpoint::{load_sharded, load_sharded_gpt as load_sharded_checkpoint};
use fsdp_gpt::data::{get_batch, synthetic_corpus};
use fsdp_gpt::runtime::{FsdpConfig, FsdpGpt, ShardingStrategy};
use fsdp_gpt::tree::gpt_block_plan;

use common::training::ring_options;

const BATCH: usize = 12;
const SEQ: usize = 16;

fn opt() -> AdamWConfig {
    common::adamw()
}

/// The engine of the rank of `comm` with `strategy`, from the full parameters `params`.
fn engine(
    comm: ring::RingCommunicator,
    cfg: GptConfig,
    plan: &UnitPlan,
    params: &HashMap<String, Vec<f32>>,
    strategy: ShardingStrategy,
) -> FsdpGpt {
    FsdpGpt::new(
        Box::new(comm),
        cfg,
        plan,
        params,
        FsdpConfig::new(strategy),
        opt(),
    )
    .unwrap()
}

/// Trains `steps` steps (numbered from `first`) at `world` from `params` (and, if given, the
/// optimizer state of a sharded checkpoint), optionally saving a sharded checkpoint at the end;
/// returns rank 0's losses and full parameters.
#[allow(clippy::too_many_arguments)]
fn train(
    cfg: &GptConfig,
    world: usize,
    config: FsdpConfig,
    params: &HashMap<String, Vec<f32>>,
    resume: Option<&Path>,
    first: usize,
    steps: usize,
    save: Option<&Path>,
) -> (Vec<f32>, HashMap<String, Vec<f32>>) {
    let tokens = synthetic_corpus(20_000, cfg.vocab_size as u16, 3);
    let plan = gpt_block_plan(cfg);
    let state = resume.map(|d| load_sharded_checkpoint(d, cfg).unwrap());
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let init = state.as_ref().map_or(params, |s| &s.params);
        let mut m = FsdpGpt::new(Box::new(comm), *cfg, &plan, init, config, opt()).unwrap();
        if let Some(s) = &state {
            m.load_optimizer_state(s.optimizer.as_ref().unwrap())
                .unwrap();
        }
        let mut losses = Vec::new();
        for k in first..first + steps {
            let batch = get_batch(&tokens, k as u64, BATCH, SEQ, rank, world).unwrap();
            losses.push(m.step(&batch, BATCH * SEQ).unwrap());
        }
        if let Some(d) = save {
            m.save_sharded(d).unwrap();
        }
        (losses, m.full_params().unwrap())
    })
    .unwrap();
    out.swap_remove(0)
}

#[test]
fn sharded_save_at_world_4_loads_at_worlds_3_and_1_bitwise() {
    let (cfg, init) = small();
    let dir = temp_dir("sharded-4");
    let (_, trained) = train(
        &cfg,
        4,
        FsdpConfig::new(ShardingStrategy::FullShard),
        &init,
        None,
        0,
        2,
        Some(&dir),
    );
    // One file per rank, each with its layout.
    for r in 0..4 {
        let bytes = fs::read(dir.join(shard_file_name(r, 4))).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert!(meta.metadata().as_ref().unwrap().contains_key(LAYOUT_KEY));
    }
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 4);

    let loaded = load_sharded(&dir, &cfg).unwrap();
    assert_eq!(bits(&loaded), bits(&trained));
    // Resharded onto worlds 3 (padding) and 1: the parameters each rank rebuilds are the same.
    for world in [3, 1] {
        let plan = gpt_block_plan(&cfg);
        let got = ring::run_ranks(world, ring_options(), |comm| {
            engine(comm, cfg, &plan, &loaded, ShardingStrategy::FullShard)
                .full_params()
                .unwrap()
        })
        .unwrap();
        for p in &got {
            assert_eq!(bits(p), bits(&trained), "world {world}");
        }
        // Saving again at this world and loading gives the same bits too.
        let d = temp_dir(&format!("sharded-re-{world}"));
        ring::run_ranks(world, ring_options(), |comm| {
            engine(comm, cfg, &plan, &loaded, ShardingStrategy::ShardGradOp)
                .save_sharded(&d)
                .unwrap()
        })
        .unwrap();
        assert_eq!(bits(&load_sharded(&d, &cfg).unwrap()), bits(&trained));
    }
}

#[test]
fn sharded_checkpoints_of_no_shard_and_hybrid_strategies() {
    let (cfg, init) = small();
    for (name, config) in [
        ("no-shard", FsdpConfig::new(ShardingStrategy::NoShard)),
        ("hybrid", {
            let mut c = FsdpConfig::new(ShardingStrategy::HybridShard);
            c.ranks_per_node = Some(2);
            c
        }),
        ("hybrid-zero2", {
            let mut c = FsdpConfig::new(ShardingStrategy::HybridShardZero2);
            c.ranks_per_node = Some(2);
            c
        }),
    ] {
        let dir = temp_dir(&format!("sharded-{name}"));
        let (_, trained) = train(&cfg, 4, config, &init, None, 0, 1, Some(&dir));
        let ck = load_sharded_checkpoint(&dir, &cfg).unwrap();
        assert_eq!(ck.world_size, 4);
        assert_eq!(bits(&ck.params), bits(&trained), "{name}");
        let opt_state = ck.optimizer.unwrap();
        assert_eq!((opt_state.optimizer.as_str(), opt_state.step), ("adamw", 1));
    }
}

#[test]
fn resume_from_a_sharded_checkpoint_continues_training_exactly() {
    let (cfg, init) = small();
    let fs_cfg = FsdpConfig::new(ShardingStrategy::FullShard);
    // Uninterrupted: 6 steps at world 2.
    let (all, final_all) = train(&cfg, 2, fs_cfg, &init, None, 0, 6, None);

    // 3 steps at world 2, saved; resumed at world 2 for 3 more: bitwise the same.
    let dir = temp_dir("resume-2");
    let (first, _) = train(&cfg, 2, fs_cfg, &init, None, 0, 3, Some(&dir));
    assert_eq!(first, all[..3]);
    let (rest, final_same) = train(&cfg, 2, fs_cfg, &init, Some(&dir), 3, 3, None);
    let bitwise = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bitwise(&rest), bitwise(&all[3..]));
    assert_eq!(bits(&final_same), bits(&final_all));

    // Resumed at world 4 instead: the same losses up to the reduction order of 4 ranks.
    let (rest4, final4) = train(&cfg, 4, fs_cfg, &init, Some(&dir), 3, 3, None);
    for (k, (a, b)) in rest4.iter().zip(&all[3..]).enumerate() {
        let rel = (a - b).abs() / b.abs();
        assert!(rel <= 1e-5, "step {}: {a} vs {b} (rel {rel:e})", k + 3);
    }
    for (name, want) in &final_all {
        let got = &final4[name];
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = got
            .iter()
            .zip(want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        // The key third of c_attn.bias is rounding noise (see tests/golden.rs).
        let tol = if name.ends_with("attn.c_attn.bias") {
            1e-5
        } else {
            1e-4 * scale
        };
        assert!(e <= tol.max(1e-7), "`{name}`: {e:e}");
    }

    // Without the optimizer state (a fresh AdamW), resuming is measurably different: the state
    // matters, and is what the checkpoint restores.
    let params = load_sharded(&dir, &cfg).unwrap();
    let (fresh, _) = train(&cfg, 2, fs_cfg, &params, None, 3, 3, None);
    assert_ne!(bitwise(&fresh), bitwise(&all[3..]));
}

#[test]
fn load_sharded_errors_are_clear() {
    let (cfg, init) = small();
    let dir = temp_dir("sharded-errors");
    train(
        &cfg,
        2,
        FsdpConfig::new(ShardingStrategy::FullShard),
        &init,
        None,
        0,
        1,
        Some(&dir),
    );
    // Another model configuration.
    let other = GptConfig::new(2, 2, 32, 16, 128).unwrap();
    let e = message(load_sharded(&dir, &other).unwrap_err());
    assert!(
        e.contains("`transformer.wte.weight` has shape [96, 32], expected [128, 32]"),
        "{e}"
    );
    let deeper = GptConfig::new(3, 2, 32, 16, 96).unwrap();
    let e = message(load_sharded(&dir, &deeper).unwrap_err());
    assert!(
        e.contains("missing tensor `transformer.h.2.ln_1.weight`"),
        "{e}"
    );
    let shallower = GptConfig::new(1, 2, 32, 16, 96).unwrap();
    let e = message(load_sharded(&dir, &shallower).unwrap_err());
    assert!(e.contains("unexpected tensor `transformer.h.1."), "{e}");

    // A missing rank file.
    let f1 = dir.join(shard_file_name(1, 2));
    let saved = fs::read(&f1).unwrap();
    fs::remove_file(&f1).unwrap();
    let e = message(load_sharded(&dir, &cfg).unwrap_err());
    assert!(
        e.contains("missing file `rank-00001-of-00002.safetensors`"),
        "{e}"
    );
    // Not a safetensors file.
    fs::write(&f1, b"garbage").unwrap();
    let e = message(load_sharded(&dir, &cfg).unwrap_err());
    assert!(
        e.contains("not a safetensors file") && e.contains("rank-00001"),
        "{e}"
    );
    // A full checkpoint where a shard file is expected.
    save_full(&f1, &cfg, &init).unwrap();
    let e = message(load_sharded(&dir, &cfg).unwrap_err());
    assert!(e.contains("not a sharded checkpoint"), "{e}");
    fs::write(&f1, &saved).unwrap();
    assert!(load_sharded(&dir, &cfg).is_ok());
    // Files of another world size mixed in.
    fs::write(dir.join(shard_file_name(0, 3)), &saved).unwrap();
    let e = message(load_sharded(&dir, &cfg).unwrap_err());
    assert!(e.contains("several world sizes"), "{e}");
    // Empty directory.
    let e = message(load_sharded(&temp_dir("sharded-empty"), &cfg).unwrap_err());
    assert!(e.contains("not a sharded checkpoint"), "{e}");
}

#[test]
fn a_failed_sharded_save_fails_on_every_rank() {
    let (cfg, init) = small();
    let dir = temp_dir("sharded-fail");
    // The target "directory" is a regular file: no rank can write.
    let target = dir.join("not-a-dir");
    fs::write(&target, b"x").unwrap();
    let plan = gpt_block_plan(&cfg);
    let results = ring::run_ranks(2, ring_options(), |comm| {
        engine(comm, cfg, &plan, &init, ShardingStrategy::FullShard)
            .save_sharded(&target)
            .map_err(|e| e.to_string())
    })
    .unwrap();
    for r in results {
        let e = r.unwrap_err();
        assert!(e.contains("not-a-dir"), "{e}");
    }
    assert_eq!(fs::read(&target).unwrap(), b"x");
}
