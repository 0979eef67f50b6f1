//! Checkpoints: full safetensors files (nanoGPT names, PyTorch-readable, atomic writes) and
//! sharded checkpoints resharded on load.

mod common;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

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

/// Writes a safetensors file of the given f32 tensors (name, shape, values).
fn write_tensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| {
            (
                n.clone(),
                s.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<_> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.as_str(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    fs::write(path, safetensors::serialize(views, &None).unwrap()).unwrap();
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

#[test]
fn full_round_trip_is_bitwise_and_has_nanogpt_names_and_shapes() {
    let (cfg, p) = small();
    let dir = temp_dir("round-trip");
    let path = dir.join("model.safetensors");
    save_full(&path, &cfg, &p).unwrap();
    let back = load_full(&path, &cfg).unwrap();
    assert_eq!(bits(&back), bits(&p));

    // The file itself: nanoGPT's names and shapes, F32, no lm_head, format = pt.
    let bytes = fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), param_specs(&cfg).len());
    for s in param_specs(&cfg) {
        let t = st.tensor(&s.name).unwrap();
        assert_eq!(t.shape(), s.shape.as_slice(), "{}", s.name);
        assert_eq!(t.dtype(), safetensors::Dtype::F32);
    }
    assert!(st.tensor("lm_head.weight").is_err());
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        meta.metadata()
            .as_ref()
            .unwrap()
            .get("format")
            .map(String::as_str),
        Some("pt")
    );
    // No temporary file left behind.
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);

    // Saving what was loaded gives the same bytes.
    let again = dir.join("again.safetensors");
    save_full(&again, &cfg, &back).unwrap();
    assert_eq!(fs::read(&again).unwrap(), bytes);
}

#[test]
fn golden_init_loads_to_the_fixture_values() {
    let cfg = cfg();
    let p = load_full(&common::fixture("gpt_tiny_init.safetensors"), &cfg).unwrap();
    assert_eq!(bits(&p), bits(&init()));
    // The golden weights after training too.
    let f = load_full(&common::fixture("expected_final.safetensors"), &cfg).unwrap();
    assert_eq!(bits(&f), bits(&load("expected_final.safetensors")));
}

#[test]
fn lm_head_equal_to_wte_is_accepted_and_a_different_one_is_not() {
    let (cfg, p) = small();
    let dir = temp_dir("lm-head");
    let path = dir.join("tied.safetensors");
    let mut t = spec_tensors(&cfg, &p);
    let wte = p["transformer.wte.weight"].clone();
    t.push((
        "lm_head.weight".into(),
        vec![cfg.vocab_size, cfg.n_embd],
        wte.clone(),
    ));
    write_tensors(&path, &t);
    assert_eq!(bits(&load_full(&path, &cfg).unwrap()), bits(&p));

    // save_full accepts a map holding the tied lm_head and omits it.
    let mut with_head = p.clone();
    with_head.insert("lm_head.weight".into(), wte.clone());
    let saved = dir.join("saved.safetensors");
    save_full(&saved, &cfg, &with_head).unwrap();
    assert_eq!(bits(&load_full(&saved, &cfg).unwrap()), bits(&p));

    let mut other = wte;
    other[3] += 1.0;
    t.last_mut().unwrap().2 = other;
    write_tensors(&path, &t);
    let e = message(load_full(&path, &cfg).unwrap_err());
    assert!(e.contains("`lm_head.weight` differs"), "{e}");
}

#[test]
fn bf16_and_f16_tensors_are_converted() {
    let (cfg, p) = small();
    let dir = temp_dir("half");
    let path = dir.join("half.safetensors");
    // Values exactly representable in bf16 (and f16 for the small ones): round each to bf16.
    let rounded: HashMap<String, Vec<f32>> = p
        .iter()
        .map(|(k, v)| {
            let r = v
                .iter()
                .map(|x| f32::from_bits(x.to_bits() & 0xffff_0000))
                .collect();
            (k.clone(), r)
        })
        .collect();
    let specs = param_specs(&cfg);
    let data: Vec<(String, Vec<usize>, Vec<u8>, safetensors::Dtype)> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let v = &rounded[&s.name];
            if i % 2 == 0 {
                let b = v
                    .iter()
                    .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                    .collect();
                (s.name.clone(), s.shape.clone(), b, safetensors::Dtype::BF16)
            } else {
                let b = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                (s.name.clone(), s.shape.clone(), b, safetensors::Dtype::F32)
            }
        })
        .collect();
    let views: Vec<_> = data
        .iter()
        .map(|(n, s, b, d)| {
            (
                n.as_str(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    fs::write(&path, safetensors::serialize(views, &None).unwrap()).unwrap();
    assert_eq!(bits(&load_full(&path, &cfg).unwrap()), bits(&rounded));

    // F16: 1.0, -2.5, 2^-24 (smallest subnormal), 65504 (largest), 0, -0.
    let halves: [(u16, f32); 6] = [
        (0x3c00, 1.0),
        (0xc100, -2.5),
        (0x0001, 2f32.powi(-24)),
        (0x7bff, 65504.0),
        (0x0000, 0.0),
        (0x8000, -0.0),
    ];
    let mut t = spec_tensors(&cfg, &p);
    t.retain(|(n, _, _)| n != "transformer.h.0.ln_1.bias");
    let e = cfg.n_embd;
    let vals: Vec<u16> = (0..e).map(|i| halves[i % 6].0).collect();
    let b16: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let f32b: Vec<(String, Vec<usize>, Vec<u8>)> = t
        .iter()
        .map(|(n, s, v)| {
            (
                n.clone(),
                s.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let mut views: Vec<_> = f32b
        .iter()
        .map(|(n, s, b)| {
            (
                n.as_str(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    views.push((
        "transformer.h.0.ln_1.bias",
        safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![e], &b16).unwrap(),
    ));
    fs::write(&path, safetensors::serialize(views, &None).unwrap()).unwrap();
    let got = load_full(&path, &cfg).unwrap();
    let ln = &got["transformer.h.0.ln_1.bias"];
    for (i, x) in ln.iter().enumerate() {
        assert_eq!(x.to_bits(), halves[i % 6].1.to_bits(), "element {i}");
    }
}

#[test]
fn load_full_errors_name_the_tensor_and_the_file() {
    let (cfg, p) = small();
    let dir = temp_dir("errors");
    let path = dir.join("bad.safetensors");

    // Missing tensor.
    let mut t = spec_tensors(&cfg, &p);
    t.retain(|(n, _, _)| n != "transformer.h.1.mlp.c_fc.bias");
    write_tensors(&path, &t);
    let e = message(load_full(&path, &cfg).unwrap_err());
    assert!(
        e.contains("missing tensor `transformer.h.1.mlp.c_fc.bias`"),
        "{e}"
    );
    assert!(e.contains("bad.safetensors"), "{e}");

    // Wrong shape (same number of elements, transposed).
    let mut t = spec_tensors(&cfg, &p);
    for (n, s, _) in t.iter_mut() {
        if n == "transformer.h.0.attn.c_attn.weight" {
            *s = vec![s[1], s[0]];
        }
    }
    write_tensors(&path, &t);
    let e = message(load_full(&path, &cfg).unwrap_err());
    assert!(
        e.contains(
            "tensor `transformer.h.0.attn.c_attn.weight` has shape [32, 96], expected [96, 32]"
        ),
        "{e}"
    );

    // Unexpected tensor.
    let mut t = spec_tensors(&cfg, &p);
    t.push((
        "transformer.h.2.ln_1.weight".into(),
        vec![32],
        vec![0.0; 32],
    ));
    write_tensors(&path, &t);
    let e = message(load_full(&path, &cfg).unwrap_err());
    assert!(
        e.contains("unexpected tensor `transformer.h.2.ln_1.weight`"),
        "{e}"
    );

    // A checkpoint of another model size: the first mismatch is named.
    let big = GptConfig::new(2, 2, 64, 16, 96).unwrap();
    let e = message(load_full(&common::fixture("gpt_tiny_init.safetensors"), &big).unwrap_err());
    assert!(
        e.contains("transformer.wte.weight") && e.contains("expected"),
        "{e}"
    );

    // Not a safetensors file.
    fs::write(&path, b"definitely not a safetensors file").unwrap();
    let e = message(load_full(&path, &cfg).unwrap_err());
    assert!(e.contains("not a safetensors file"), "{e}");
    assert!(e.contains("bad.safetensors"), "{e}");

    // Missing file.
    let e = message(load_full(&dir.join("nope.safetensors"), &cfg).unwrap_err());
    assert!(
        e.contains("nope.safetensors") && e.contains("cannot read"),
        "{e}"
    );
}

#[test]
fn save_full_validates_before_writing_and_is_atomic() {
    let (cfg, p) = small();
    let dir = temp_dir("atomic");
    let path = dir.join("model.safetensors");
    save_full(&path, &cfg, &p).unwrap();
    let before = fs::read(&path).unwrap();

    let mut changed = p.clone();
    for v in changed.values_mut() {
        v.iter_mut().for_each(|x| *x += 1.0);
    }

    // A parameter with the wrong size: an error naming it; the previous file is untouched.
    let mut bad = changed.clone();
    bad.get_mut("transformer.h.1.attn.c_proj.weight")
        .unwrap()
        .pop();
    let e = message(save_full(&path, &cfg, &bad).unwrap_err());
    assert!(e.contains("`transformer.h.1.attn.c_proj.weight`"), "{e}");
    // Missing and unexpected parameters.
    let mut bad = changed.clone();
    bad.remove("transformer.ln_f.bias");
    let e = message(save_full(&path, &cfg, &bad).unwrap_err());
    assert!(e.contains("missing tensor `transformer.ln_f.bias`"), "{e}");
    let mut bad = changed.clone();
    bad.insert("extra.weight".into(), vec![1.0]);
    let e = message(save_full(&path, &cfg, &bad).unwrap_err());
    assert!(e.contains("unexpected tensor `extra.weight`"), "{e}");
    assert_eq!(fs::read(&path).unwrap(), before);

    // A failure in the middle of writing (half of the new bytes written, then an I/O error):
    // the previous file is byte-identical and no temporary file is left.
    let e = write_atomic(&path, |w| {
        w.write_all(&vec![0xAB; before.len() / 2])?;
        Err(std::io::Error::other("simulated crash mid-save"))
    })
    .unwrap_err();
    assert!(message(e).contains("simulated crash"));
    assert_eq!(fs::read(&path).unwrap(), before);
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);

    // A successful save replaces it.
    save_full(&path, &cfg, &changed).unwrap();
    assert_eq!(bits(&load_full(&path, &cfg).unwrap()), bits(&changed));
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
}

// ------------------------------------------------------------------------------------------
// Sharded checkpoints
// ------------------------------------------------------------------------------------------

use std::time::Duration;

use fsdp::checkpoint::{shard_file_name, LAYOUT_KEY};
use fsdp::optim::AdamWConfig;
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::checkpoint::{load_sharded, load_sharded_gpt as load_sharded_checkpoint};
use fsdp_gpt::data::{get_batch, synthetic_corpus};
use fsdp_gpt::runtime::{FsdpConfig, FsdpGpt, ShardingStrategy};
use fsdp_gpt::tree::gpt_block_plan;

const BATCH: usize = 12;
const SEQ: usize = 16;

fn opt() -> AdamWConfig {
    common::adamw()
}

fn ring_opts() -> ring::RingOptions {
    ring::RingOptions::default().with_timeout(Duration::from_secs(60))
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
    let mut out = ring::run_ranks(world, ring_opts(), |comm| {
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
        let got = ring::run_ranks(world, ring_opts(), |comm| {
            FsdpGpt::new(
                Box::new(comm),
                cfg,
                &plan,
                &loaded,
                FsdpConfig::new(ShardingStrategy::FullShard),
                opt(),
            )
            .unwrap()
            .full_params()
            .unwrap()
        })
        .unwrap();
        for p in &got {
            assert_eq!(bits(p), bits(&trained), "world {world}");
        }
        // Saving again at this world and loading gives the same bits too.
        let d = temp_dir(&format!("sharded-re-{world}"));
        ring::run_ranks(world, ring_opts(), |comm| {
            FsdpGpt::new(
                Box::new(comm),
                cfg,
                &plan,
                &loaded,
                FsdpConfig::new(ShardingStrategy::ShardGradOp),
                opt(),
            )
            .unwrap()
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
fn save_full_of_the_golden_init_matches_pytorchs_file() {
    // PyTorch's `safetensors.torch.save_file` wrote the fixture; ours has the same tensors in the
    // same order at the same offsets with the same bytes (only the metadata `format = pt` differs).
    let cfg = cfg();
    let fixture = fs::read(common::fixture("gpt_tiny_init.safetensors")).unwrap();
    let dir = temp_dir("golden-bytes");
    let path = dir.join("init.safetensors");
    save_full(
        &path,
        &cfg,
        &load_full(&common::fixture("gpt_tiny_init.safetensors"), &cfg).unwrap(),
    )
    .unwrap();
    let ours = fs::read(&path).unwrap();
    let header =
        |b: &[u8]| usize::try_from(u64::from_le_bytes(b[..8].try_into().unwrap())).unwrap();
    let (hf, ho) = (header(&fixture), header(&ours));
    assert_eq!(&ours[8 + ho..], &fixture[8 + hf..], "tensor data");
    let (_, mf) = safetensors::SafeTensors::read_metadata(&fixture).unwrap();
    let (_, mo) = safetensors::SafeTensors::read_metadata(&ours).unwrap();
    let infos = |m: &safetensors::tensor::Metadata| {
        let mut v: Vec<_> = m
            .tensors()
            .into_iter()
            .map(|(k, i)| (k, i.dtype, i.shape.clone(), i.data_offsets))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    assert_eq!(infos(&mo), infos(&mf));
}

#[test]
fn a_failed_sharded_save_fails_on_every_rank() {
    let (cfg, init) = small();
    let dir = temp_dir("sharded-fail");
    // The target "directory" is a regular file: no rank can write.
    let target = dir.join("not-a-dir");
    fs::write(&target, b"x").unwrap();
    let plan = gpt_block_plan(&cfg);
    let results = ring::run_ranks(2, ring_opts(), |comm| {
        FsdpGpt::new(
            Box::new(comm),
            cfg,
            &plan,
            &init,
            FsdpConfig::new(ShardingStrategy::FullShard),
            opt(),
        )
        .unwrap()
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
