//! The device trainer's checkpoints (`DeviceTrainer::save_checkpoint`, the engine's sharded
//! format at world 1) on the kernels' host twins: a run stopped after 3 steps and resumed from
//! its checkpoint (`load_sharded_gpt`, `load_optimizer_state`) trains bitwise as the run that
//! never stopped — every later loss, norm, learning rate and final parameter — with the cosine
//! schedule, nanoGPT's groups, clipping, 2 micro-batches, and under CPU offload; the state
//! saved is what the trainer holds; bad states are refused by name.

use std::path::PathBuf;

use fsdp::optim::LrSchedule;
use fsdp_gpt::checkpoint::load_sharded_gpt;
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig, DeviceTrainer, StepOutcome};
use fsdp_kernels::gpt::HostOps;

mod common;
use common::device::{device_config, param_bits};

const SEED: u64 = 17;
const STEPS: usize = 6;
const CUT: usize = 3;

fn config(offload: bool) -> DeviceTrainConfig {
    let schedule = LrSchedule::Cosine {
        warmup_iters: 2,
        lr_decay_iters: STEPS as u64,
        min_lr: 3e-4,
    };
    DeviceTrainConfig {
        offload,
        ..device_config(schedule, true, Some(0.5), 2)
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-device-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn bits(o: &StepOutcome) -> (u32, u64, u64, bool) {
    (
        o.loss.to_bits(),
        o.grad_norm.to_bits(),
        o.lr.to_bits(),
        o.applied,
    )
}

#[test]
fn a_resumed_run_trains_bitwise_as_the_run_that_never_stopped() {
    let tokens = synthetic_corpus(20_000, 64, SEED);
    for offload in [false, true] {
        let c = config(offload);
        let params = seeded_params(&c.cfg, SEED).unwrap();
        let mut whole = DeviceTrainer::new(HostOps::new(), c, &params).unwrap();
        let all: Vec<_> = (0..STEPS)
            .map(|s| whole.step(&tokens, s).unwrap())
            .collect();
        assert!(
            all.iter().any(|o| o.grad_norm > 0.5),
            "clipping never active"
        );

        let dir = scratch(&format!("resume-{offload}"));
        let mut first = DeviceTrainer::new(HostOps::new(), c, &params).unwrap();
        for s in 0..CUT {
            first.step(&tokens, s).unwrap();
        }
        first.save_checkpoint(&dir).unwrap();
        let saved = first.optimizer_state().unwrap();
        assert_eq!(
            (saved.step, saved.optimizer_steps),
            (CUT as u64, CUT as u64)
        );

        let ck = load_sharded_gpt(&dir, &c.cfg).unwrap();
        assert_eq!(ck.world_size, 1);
        assert_eq!(
            param_bits(ck.params.clone()),
            param_bits(first.full_params().unwrap())
        );
        let state = ck.optimizer.unwrap();
        assert_eq!(state, saved, "the checkpoint holds the trainer's state");
        let mut resumed = DeviceTrainer::new(HostOps::new(), c, &ck.params).unwrap();
        resumed.load_optimizer_state(&state, 0).unwrap();
        assert_eq!(resumed.optimizer_steps(), CUT as u64);
        for (s, want) in all.iter().enumerate().skip(CUT) {
            let got = resumed.step(&tokens, s).unwrap();
            assert_eq!(bits(&got), bits(want), "offload {offload}: step {s}");
        }
        assert_eq!(
            param_bits(resumed.full_params().unwrap()),
            param_bits(whole.full_params().unwrap()),
            "offload {offload}: final parameters"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn bad_optimizer_states_are_refused_by_name() {
    let c = config(false);
    let params = seeded_params(&c.cfg, SEED).unwrap();
    let mut t = DeviceTrainer::new(HostOps::new(), c, &params).unwrap();
    let good = t.optimizer_state().unwrap();
    let mut s = good.clone();
    s.optimizer = "sgd".into();
    let e = t.load_optimizer_state(&s, 0).unwrap_err();
    assert!(e.to_string().contains("`sgd`"), "{e}");
    let mut s = good.clone();
    s.step = 4;
    let e = t.load_optimizer_state(&s, 0).unwrap_err();
    assert!(e.to_string().contains("step count 4"), "{e}");
    let mut s = good.clone();
    s.buffers
        .get_mut("exp_avg_sq")
        .unwrap()
        .get_mut("transformer.wte.weight")
        .unwrap()
        .pop();
    let e = t.load_optimizer_state(&s, 0).unwrap_err();
    assert!(
        e.to_string()
            .contains("`exp_avg_sq` of `transformer.wte.weight`"),
        "{e}"
    );
    // Refused states change nothing: the trainer still holds the zero state.
    assert_eq!(t.optimizer_state().unwrap(), good);
}
