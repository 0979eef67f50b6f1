//! The device trainer's steps decided on the device and read one step late
//! (`DeviceTrainer::enqueue_step`), on the kernels' host twins: bitwise the steps read at once
//! (`step`) — every loss, norm, learning rate and final parameter — with clipping, micro-batches,
//! the cosine schedule, bf16 products and CPU offload; non-finite steps (a NaN loss injected
//! by `HostOps::with_nan_losses`) skipped with the parameters untouched and the schedule not
//! advanced; `set_skip_nonfinite` halting on the device so that the steps enqueued after the
//! limit apply nothing; and `step` refusing while an enqueued step is unread.

use fsdp::optim::LrSchedule;
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_train::{
    seeded_params, DeviceTrainConfig, DeviceTrainError, DeviceTrainer, StepOutcome,
};
use fsdp_kernels::gpt::{HostOps, HostProducts};

mod common;
use common::device::{device_config, param_bits};

const SEED: u64 = 11;
const STEPS: usize = 8;

fn config(clip: Option<f64>, accum: usize) -> DeviceTrainConfig {
    let schedule = LrSchedule::Cosine {
        warmup_iters: 3,
        lr_decay_iters: STEPS as u64,
        min_lr: 3e-4,
    };
    device_config(schedule, true, clip, accum)
}

fn trainer(c: DeviceTrainConfig, ops: HostOps) -> DeviceTrainer<HostOps> {
    DeviceTrainer::new(ops, c, &seeded_params(&c.cfg, SEED).unwrap()).unwrap()
}

fn tokens() -> Vec<u16> {
    synthetic_corpus(20_000, 64, SEED)
}

/// Every parameter's bits, by name.
fn bits_of(t: &DeviceTrainer<HostOps>) -> Vec<(String, Vec<u32>)> {
    param_bits(t.full_params().unwrap())
}

/// An outcome with its floats as bits (NaN losses compare equal).
fn key(o: &StepOutcome) -> (u32, u64, u64, bool, bool) {
    (
        o.loss.to_bits(),
        o.grad_norm.to_bits(),
        o.lr.to_bits(),
        o.applied,
        o.halted,
    )
}

/// Each step read at once.
fn at_once(t: &mut DeviceTrainer<HostOps>, tokens: &[u16]) -> Vec<StepOutcome> {
    (0..STEPS).map(|s| t.step(tokens, s).unwrap()).collect()
}

/// Each step enqueued, its outcome read when the next is enqueued; checks the step numbers.
fn one_late(t: &mut DeviceTrainer<HostOps>, tokens: &[u16]) -> Vec<StepOutcome> {
    let mut out = Vec::new();
    for s in 0..STEPS {
        let r = t.enqueue_step(tokens, s).unwrap();
        assert_eq!(
            r.map(|r| r.step),
            s.checked_sub(1),
            "step {s}: the report of the step before"
        );
        out.extend(r.map(|r| r.outcome));
    }
    let last = t.flush().unwrap().unwrap();
    assert_eq!(last.step, STEPS - 1);
    out.push(last.outcome);
    assert!(t.flush().unwrap().is_none());
    out
}

fn same_runs(name: &str, c: DeviceTrainConfig, products: HostProducts, nan: &[u64]) {
    let tokens = tokens();
    let ops = || HostOps::with_products(products).with_nan_losses(nan.iter().copied());
    let mut a = trainer(c, ops());
    let mut b = trainer(c, ops());
    let (oa, ob) = (at_once(&mut a, &tokens), one_late(&mut b, &tokens));
    let ka: Vec<_> = oa.iter().map(key).collect();
    let kb: Vec<_> = ob.iter().map(key).collect();
    assert_eq!(ka, kb, "{name}: the outcomes differ read one step late");
    assert_eq!(bits_of(&a), bits_of(&b), "{name}: parameters differ");
    assert_eq!(a.optimizer_steps(), b.optimizer_steps(), "{name}");
    // The learning rate of each step is the schedule's at the optimizer steps taken before.
    let mut taken = 0u64;
    for (s, o) in oa.iter().enumerate() {
        assert_eq!(
            o.lr,
            c.schedule.lr_at(c.adamw.lr, taken),
            "{name}: step {s}"
        );
        taken += u64::from(o.applied);
    }
    assert_eq!(taken, a.optimizer_steps(), "{name}");
}

#[test]
fn steps_read_one_late_train_bitwise_as_steps_read_at_once() {
    same_runs("defaults", config(None, 1), HostProducts::F32, &[]);
    same_runs(
        "clip, 2 micro-batches, bf16",
        config(Some(0.5), 2),
        HostProducts::Bf16Operands,
        &[],
    );
    let offload = DeviceTrainConfig {
        offload: true,
        ..config(Some(0.5), 2)
    };
    same_runs("offload", offload, HostProducts::F32, &[]);
}

/// Steps 2 and 5 (micro-batches 2 and 5) have a NaN loss: both skipped, in both ways of
/// reading, and the schedule counts only the steps taken.
#[test]
fn nonfinite_steps_are_skipped_when_read_one_late() {
    same_runs(
        "NaN at steps 2 and 5",
        config(Some(0.5), 1),
        HostProducts::F32,
        &[2, 5],
    );
    // With 2 micro-batches, the NaN of micro-batch 3 makes step 1 non-finite.
    same_runs(
        "NaN in step 1's second micro-batch",
        config(None, 2),
        HostProducts::F32,
        &[3],
    );
    let tokens = tokens();
    let mut t = trainer(config(None, 1), HostOps::new().with_nan_losses([2]));
    let o = at_once(&mut t, &tokens);
    let applied: Vec<bool> = o.iter().map(|o| o.applied).collect();
    let mut want = vec![true; STEPS];
    want[2] = false;
    assert_eq!(applied, want);
    assert!(o[2].loss.is_nan() && o[2].grad_norm.is_finite() && !o[2].halted);
    assert_eq!(t.optimizer_steps(), STEPS as u64 - 1);
}

/// A skipped step leaves the parameters as they were: steps 0–1, then the NaN step 2.
#[test]
fn a_skipped_step_changes_no_parameter() {
    let tokens = tokens();
    let mut t = trainer(config(Some(0.5), 1), HostOps::new().with_nan_losses([2]));
    t.step(&tokens, 0).unwrap();
    t.step(&tokens, 1).unwrap();
    let before = bits_of(&t);
    let o = t.step(&tokens, 2).unwrap();
    assert!(!o.applied);
    assert_eq!(bits_of(&t), before);
    assert!(t.step(&tokens, 3).unwrap().applied);
    assert_ne!(bits_of(&t), before);
}

/// `--skip-nonfinite 2`: NaN losses at steps 1, 2 and 3; steps 1 and 2 are skipped, step 3
/// halts the trainer on the device, and the finite steps enqueued after it (read late) apply
/// nothing: the parameters are those after step 0.
#[test]
fn skip_limit_halts_on_the_device() {
    let tokens = tokens();
    let c = config(None, 1);
    let mut t = trainer(c, HostOps::new().with_nan_losses([1, 2, 3]));
    t.set_skip_nonfinite(Some(2));
    let o = one_late(&mut t, &tokens);
    let seen: Vec<(bool, bool)> = o.iter().map(|o| (o.applied, o.halted)).collect();
    let mut want = vec![(false, true); STEPS];
    want[0] = (true, false);
    want[1] = (false, false);
    want[2] = (false, false);
    assert_eq!(seen, want);
    assert_eq!(t.optimizer_steps(), 1);
    let mut one = trainer(c, HostOps::new());
    one.step(&tokens, 0).unwrap();
    assert_eq!(bits_of(&t), bits_of(&one));
}

#[test]
fn step_refuses_while_an_enqueued_step_is_unread() {
    let tokens = tokens();
    let mut t = trainer(config(None, 1), HostOps::new());
    assert!(t.enqueue_step(&tokens, 0).unwrap().is_none());
    let e = t.step(&tokens, 1).err().unwrap();
    assert!(matches!(e, DeviceTrainError::Unread { step: 0 }), "{e}");
    assert!(e.to_string().contains("step 0"), "{e}");
    assert_eq!(t.flush().unwrap().unwrap().step, 0);
    assert!(t.step(&tokens, 1).unwrap().applied);
}
