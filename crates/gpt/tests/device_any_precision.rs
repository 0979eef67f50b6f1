//! torchdistx's `AnyPrecisionAdamW` on the device trainer (`DeviceTrainConfig::any_precision`),
//! on the kernels' host twins; the update itself is held bitwise to `fsdp::optim`'s in the
//! kernels' unit tests, and the whole run to the engine's by `device_cli.rs`:
//!
//! - pure-bf16 training keeps bf16 parameters: the initial ones rounded (its first loss is
//!   AdamW's from the rounded parameters, bitwise), every value bf16 after every step, the
//!   state (moments and Kahan compensation) bf16 too, and the compensation holding what the
//!   parameters could not;
//! - CPU offload, sharding at one rank, and a checkpoint and resume change no bit, at one rank
//!   and at two (`FULL_SHARD`, `NO_SHARD`); the checkpoint is the engine's format
//!   (`anyprecision_adamw` with its compensation), and a state of another optimizer is
//!   refused naming both;
//! - two ranks track one rank within a bound derived from bf16's precision.

use fsdp::optim::LrSchedule;
use fsdp_collectives::ring;
use fsdp_device::DType;
use fsdp_gpt::checkpoint::load_sharded_gpt;
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_comm::HostComm;
use fsdp_gpt::device_sharded::ShardedDeviceTrainer;
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig, DeviceTrainer};
use fsdp_gpt::runtime::ShardingStrategy;
use fsdp_kernels::gpt::HostOps;
use fsdp_kernels::host::AnyPrecision;

mod common;
use common::device::{device_config, param_bits};

const SEED: u64 = 5;
const STEPS: usize = 6;
const CUT: usize = 3;

fn config(param: DType, state: DType, kahan: bool, offload: bool) -> DeviceTrainConfig {
    DeviceTrainConfig {
        any_precision: Some(AnyPrecision {
            param,
            state,
            kahan,
        }),
        offload,
        ..device_config(LrSchedule::Constant, true, Some(0.5), 2)
    }
}

fn bf16_exact(x: f32) -> bool {
    fsdp_device::half::bf16::from_f32(x).to_f32().to_bits() == x.to_bits()
}

/// Each step's (loss, norm, applied) bits, the final parameters' bits and the optimizer
/// state, at one rank.
type Run = (
    Vec<(u32, u64, bool)>,
    Vec<(String, Vec<u32>)>,
    fsdp::checkpoint::FullOptimizerState,
);

fn one_rank(c: DeviceTrainConfig, tokens: &[u16]) -> Run {
    let params = seeded_params(&c.cfg, SEED).unwrap();
    let mut t = DeviceTrainer::new(HostOps::new(), c, &params).unwrap();
    let o = (0..STEPS)
        .map(|s| {
            let o = t.step(tokens, s).unwrap();
            (o.loss.to_bits(), o.grad_norm.to_bits(), o.applied)
        })
        .collect();
    let p = param_bits(t.full_params().unwrap());
    (o, p, t.optimizer_state().unwrap())
}

/// [`one_rank`] at `world` ranks of the ring, with a checkpoint into `dir` after [`CUT`]
/// steps when given; per rank.
fn ranks(
    c: DeviceTrainConfig,
    world: usize,
    strategy: ShardingStrategy,
    tokens: &[u16],
    dir: Option<&std::path::Path>,
) -> Vec<Run> {
    let params = seeded_params(&c.cfg, SEED).unwrap();
    ring::run_ranks(world, ring::RingOptions::default(), |comm| {
        let comm = HostComm::new(Box::new(comm));
        let rank = fsdp_collectives::Communicator::rank(comm.communicator());
        let mut t = ShardedDeviceTrainer::new(HostOps::new(), comm, c, strategy, &params).unwrap();
        let mut o = Vec::new();
        for s in 0..STEPS {
            let r = t.step(tokens, s).unwrap();
            o.push((r.loss.to_bits(), r.grad_norm.to_bits(), r.applied));
            if s + 1 == CUT {
                if let Some(dir) = dir {
                    t.save_checkpoint((rank == 0).then_some(dir)).unwrap();
                }
            }
        }
        let p = param_bits(t.full_params().unwrap());
        (o, p, t.optimizer_state().unwrap())
    })
    .unwrap()
}

#[test]
fn pure_bf16_training_keeps_bf16_parameters_and_state() {
    let tokens = synthetic_corpus(20_000, 64, SEED);
    let c = config(DType::BF16, DType::BF16, true, false);
    let params = seeded_params(&c.cfg, SEED).unwrap();
    let rounded = c.rounded_params(&params).into_owned();
    assert!(rounded.values().flatten().all(|&x| bf16_exact(x)));
    assert!(params.values().flatten().any(|&x| !bf16_exact(x)));
    // The first loss is AdamW's from the rounded parameters (no update has happened yet).
    let adamw = DeviceTrainConfig {
        any_precision: None,
        ..c
    };
    let mut reference = DeviceTrainer::new(HostOps::new(), adamw, &rounded).unwrap();
    let mut t = DeviceTrainer::new(HostOps::new(), c, &params).unwrap();
    let first = t.step(&tokens, 0).unwrap();
    assert_eq!(
        first.loss.to_bits(),
        reference.step(&tokens, 0).unwrap().loss.to_bits()
    );
    let mut losses = vec![first.loss];
    for s in 1..12 {
        let o = t.step(&tokens, s).unwrap();
        assert!(o.applied, "step {s}: {o:?}");
        losses.push(o.loss);
        for (name, v) in t.full_params().unwrap() {
            assert!(v.iter().all(|&x| bf16_exact(x)), "step {s}: {name}");
        }
    }
    assert!(
        losses[11] < losses[0] - 0.1,
        "the loss must fall: {losses:?}"
    );
    let state = t.optimizer_state().unwrap();
    assert_eq!(state.optimizer, "anyprecision_adamw");
    assert_eq!(state.optimizer_steps, 12);
    for kind in ["exp_avg", "exp_avg_sq", "compensation"] {
        let b = &state.buffers[kind];
        assert_eq!(b.len(), params.len(), "{kind}");
        assert!(b.values().flatten().all(|&x| bf16_exact(x)), "{kind}");
    }
    // The compensation holds what bf16 parameters could not: updates below half their ulp.
    let comp = &state.buffers["compensation"];
    assert!(comp.values().flatten().any(|&x| x != 0.0));
    // Without Kahan summation the same run has no compensation and ends elsewhere.
    let plain = one_rank(config(DType::BF16, DType::BF16, false, false), &tokens);
    assert!(!plain.2.buffers.contains_key("compensation"));
    let kahan = one_rank(c, &tokens);
    assert_ne!(plain.1, kahan.1);
}

#[test]
fn offload_sharding_and_resume_change_no_bit() {
    let tokens = synthetic_corpus(20_000, 64, SEED);
    for (param, state) in [(DType::BF16, DType::BF16), (DType::F32, DType::BF16)] {
        let c = config(param, state, true, false);
        let off = DeviceTrainConfig { offload: true, ..c };
        let what = format!("{param:?} parameters, {state:?} state");
        // One rank: offload, and the sharded trainer at one rank.
        let base = one_rank(c, &tokens);
        assert_eq!(one_rank(off, &tokens), base, "{what}: one rank, offloaded");
        let one = ranks(c, 1, ShardingStrategy::FullShard, &tokens, None);
        assert_eq!(one[0], base, "{what}: the sharded trainer at one rank");
        for strategy in [ShardingStrategy::FullShard, ShardingStrategy::NoShard] {
            let what = format!("{what}, 2 ranks {strategy:?}");
            let dir = std::env::temp_dir().join(format!(
                "fsdp-any-precision-{}-{param:?}-{strategy:?}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            let whole = ranks(c, 2, strategy, &tokens, Some(&dir));
            assert_eq!(whole[0], whole[1], "{what}: both ranks");
            assert_eq!(
                ranks(off, 2, strategy, &tokens, None),
                whole,
                "{what}: offloaded"
            );
            // Resumed from the checkpoint at CUT (the engine's format): the same bits.
            let ck = load_sharded_gpt(&dir, &c.cfg).unwrap();
            let saved = ck.optimizer.clone().unwrap();
            assert_eq!(saved.optimizer, "anyprecision_adamw");
            assert!(saved.buffers.contains_key("compensation"), "{what}");
            assert_eq!(saved.optimizer_steps, CUT as u64);
            let resumed = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
                let comm = HostComm::new(Box::new(comm));
                let mut t =
                    ShardedDeviceTrainer::new(HostOps::new(), comm, c, strategy, &ck.params)
                        .unwrap();
                t.load_optimizer_state(&saved, 0).unwrap();
                let o: Vec<_> = (CUT..STEPS)
                    .map(|s| {
                        let r = t.step(&tokens, s).unwrap();
                        (r.loss.to_bits(), r.grad_norm.to_bits(), r.applied)
                    })
                    .collect();
                (o, param_bits(t.full_params().unwrap()))
            })
            .unwrap();
            for (r, (o, p)) in resumed.iter().enumerate() {
                assert_eq!(o[..], whole[r].0[CUT..], "{what}: rank {r}'s later steps");
                assert!(*p == whole[r].1, "{what}: rank {r}'s final parameters");
            }
            // AdamW's trainer refuses the state, naming both optimizers.
            let adamw = DeviceTrainConfig {
                any_precision: None,
                ..c
            };
            let mut t = DeviceTrainer::new(HostOps::new(), adamw, &ck.params).unwrap();
            let e = t.load_optimizer_state(&saved, 0).unwrap_err().to_string();
            assert!(
                e.contains("anyprecision_adamw") && e.contains("`adamw`"),
                "{e}"
            );
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Two ranks sum each gradient in another order than one rank, so a parameter rounded to
/// bf16 can land one bf16 step (2⁻⁸ of itself) away; the losses then differ by about what
/// such steps move. Bound: 2⁻⁸ relative, the size of one bf16 rounding of the weights.
#[test]
fn two_ranks_track_one_rank_within_bf16s_precision() {
    let tokens = synthetic_corpus(20_000, 64, SEED);
    let c = config(DType::BF16, DType::BF16, true, false);
    let one = one_rank(c, &tokens);
    let two = ranks(c, 2, ShardingStrategy::FullShard, &tokens, None);
    let loss = |b: u32| f64::from(f32::from_bits(b));
    let mut worst = 0.0f64;
    for (s, (a, b)) in one.0.iter().zip(&two[0].0).enumerate() {
        let r = (loss(a.0) - loss(b.0)).abs() / loss(a.0);
        assert!(
            r <= 2f64.powi(-8),
            "step {s}: {} vs {}",
            loss(a.0),
            loss(b.0)
        );
        worst = worst.max(r);
    }
    println!("two ranks vs one, pure bf16: losses within {worst:.2e} relative");
}
