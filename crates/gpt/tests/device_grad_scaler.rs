//! Dynamic loss scaling on the device (`DeviceTrainConfig::grad_scaler`, `fsdp train --device
//! --grad-scaler on`), on the kernels' host twins:
//!
//! - at a power-of-two scale the training is bitwise that without a scaler — every loss, norm
//!   and parameter — with f32 and bf16 products, clipping and two micro-batches, at one rank,
//!   under CPU offload and at two ranks (`FULL_SHARD` over the ring), while the scale grows
//!   as the engine's `GradScaler` grows it;
//! - a step whose gradients overflowed (an infinite gradient seed injected by
//!   `HostOps::with_overflow_at`), on the device or under CPU offload, is the
//!   scaler's skip: the parameters are those of a run without a scaler that skips the same
//!   steps for a NaN loss, the scale is backed off as the engine's scaler backs off, and with
//!   `set_skip_nonfinite(Some(0))` nothing halts (an overflow is not a non-finite step);
//! - a trainer resumed with `set_grad_scaler_state` continues bitwise.

use fsdp::engine::{GradScaler, GradScalerConfig, GradScalerState};
use fsdp::optim::LrSchedule;
use fsdp_collectives::ring;
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_comm::{DeviceComm, HostComm};
use fsdp_gpt::device_sharded::ShardedDeviceTrainer;
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig, DeviceTrainer, StepOutcome};
use fsdp_gpt::runtime::ShardingStrategy;
use fsdp_kernels::gpt::{HostOps, HostProducts};

mod common;
use common::device::{device_config, param_bits};

const SEED: u64 = 23;
const STEPS: usize = 8;

/// The shared run with clipping and 2 micro-batches, and a scaler at `init_scale` growing
/// every `interval` steps (`None`: no scaler).
fn config(scaler: Option<(f32, u32)>) -> DeviceTrainConfig {
    let schedule = LrSchedule::Cosine {
        warmup_iters: 2,
        lr_decay_iters: STEPS as u64,
        min_lr: 3e-4,
    };
    DeviceTrainConfig {
        grad_scaler: scaler.map(|(init_scale, growth_interval)| GradScalerConfig {
            init_scale,
            growth_interval,
            ..GradScalerConfig::default()
        }),
        ..device_config(schedule, true, Some(0.5), 2)
    }
}

fn tokens() -> Vec<u16> {
    synthetic_corpus(20_000, 64, SEED)
}

/// Loss bits, norm bits, applied, overflow.
type Key = (u32, u64, bool, bool);

fn key(o: &StepOutcome) -> Key {
    (
        o.loss.to_bits(),
        o.grad_norm.to_bits(),
        o.applied,
        o.overflow,
    )
}

/// One rank: every step's outcome (read one step late) and the final parameters' bits.
fn run(
    c: DeviceTrainConfig,
    ops: HostOps,
    tokens: &[u16],
) -> (Vec<StepOutcome>, Vec<(String, Vec<u32>)>) {
    let params = seeded_params(&c.cfg, SEED).unwrap();
    let mut t = DeviceTrainer::new(ops, c, &params).unwrap();
    t.set_skip_nonfinite(None);
    let mut out = Vec::new();
    for s in 0..STEPS {
        out.extend(t.enqueue_step(tokens, s).unwrap().map(|r| r.outcome));
    }
    out.extend(t.flush().unwrap().map(|r| r.outcome));
    assert_eq!(t.grad_scaler_state(), out.last().unwrap().scaler);
    (out, param_bits(t.full_params().unwrap()))
}

/// The engine's `GradScaler` fed the overflows of `outcomes`: its state after each step.
fn engine_states(config: GradScalerConfig, outcomes: &[StepOutcome]) -> Vec<GradScalerState> {
    let mut g = GradScaler::new(config).unwrap();
    let mut skipped = 0;
    outcomes
        .iter()
        .map(|o| {
            if o.overflow {
                skipped += 1;
                g.update(true);
            } else if o.applied {
                g.update(false);
            }
            GradScalerState {
                skipped_steps: skipped,
                ..g.state()
            }
        })
        .collect()
}

fn keys(o: &[StepOutcome]) -> Vec<Key> {
    o.iter().map(key).collect()
}

/// At a power-of-two scale, growing every 3 steps: bitwise the run without a scaler, with f32
/// and bf16 products, on the device and under CPU offload; the scale as the engine's.
#[test]
fn a_power_of_two_scale_changes_no_bit() {
    let tokens = tokens();
    for products in [HostProducts::F32, HostProducts::Bf16Operands] {
        let ops = || HostOps::with_products(products);
        let (plain, plain_params) = run(config(None), ops(), &tokens);
        assert!(plain.iter().all(|o| o.applied && o.scaler.is_none()));
        for offload in [false, true] {
            let c = DeviceTrainConfig {
                offload,
                ..config(Some((1024.0, 3)))
            };
            let what = format!("{products:?}, offload {offload}");
            let (scaled, params) = run(c, ops(), &tokens);
            assert_eq!(keys(&scaled), keys(&plain), "{what}: outcomes");
            assert!(params == plain_params, "{what}: parameters differ");
            let states: Vec<_> = scaled.iter().map(|o| o.scaler.unwrap()).collect();
            let want = engine_states(c.grad_scaler.unwrap(), &scaled);
            assert_eq!(states, want, "{what}: the scaler's states");
            // 8 steps growing every 3: 2^10 → 2^12.
            assert_eq!(states.last().unwrap().scale, 4096.0, "{what}");
        }
    }
}

/// Overflows at steps 1, 4 and 5: the scaler's skips. The parameters are those of the run
/// without a scaler that skips the same steps for a NaN loss; the scale backs off and grows
/// as the engine's; no overflow counts as non-finite; the losses are the unscaled ones.
#[test]
fn an_overflow_is_the_scalers_skip() {
    let tokens = tokens();
    let overflows = [1u64, 4, 5];
    for offload in [false, true] {
        let c = DeviceTrainConfig {
            offload,
            ..config(Some((65536.0, 2)))
        };
        // The first micro-batch of each of those steps overflows (calls 2s: two a step).
        let ops = HostOps::new().with_overflow_at(overflows.iter().map(|s| s * 2));
        let params = seeded_params(&c.cfg, SEED).unwrap();
        let mut t = DeviceTrainer::new(ops, c, &params).unwrap();
        // No non-finite step allowed: an overflow must not halt.
        t.set_skip_nonfinite(Some(0));
        let scaled: Vec<_> = (0..STEPS).map(|s| t.step(&tokens, s).unwrap()).collect();
        let scaled_params = param_bits(t.full_params().unwrap());
        // The same steps skipped for a NaN loss (one micro-batch call of two: the step's
        // first), without a scaler.
        let nan = overflows.iter().map(|s| s * 2);
        let (plain, plain_params) = run(
            DeviceTrainConfig {
                offload,
                ..config(None)
            },
            HostOps::new().with_nan_losses(nan),
            &tokens,
        );
        for (s, (a, b)) in scaled.iter().zip(&plain).enumerate() {
            let over = overflows.contains(&(s as u64));
            assert_eq!(a.overflow, over, "offload {offload}, step {s}");
            assert_eq!(a.applied, !over, "offload {offload}, step {s}");
            assert!(!a.halted, "offload {offload}, step {s}: halted");
            assert_eq!(a.lr.to_bits(), b.lr.to_bits(), "step {s}: learning rate");
            if !over {
                assert_eq!(key(a), key(b), "offload {offload}, step {s}");
            }
        }
        assert!(scaled_params == plain_params, "offload {offload}");
        let states: Vec<_> = scaled.iter().map(|o| o.scaler.unwrap()).collect();
        assert_eq!(states, engine_states(c.grad_scaler.unwrap(), &scaled));
        // 2^16: ok, overflow (2^15), ok, ok (grows: 2^16), overflow, overflow (2^14), ok, ok
        // (grows: 2^15); three skips.
        let last = *states.last().unwrap();
        assert_eq!((last.scale, last.skipped_steps), (32768.0, 3));
        assert_eq!(t.optimizer_steps(), (STEPS - overflows.len()) as u64);
    }
}

/// Two ranks `FULL_SHARD` over the ring: with a scaler, bitwise without one; every rank's
/// scaler in the same state.
#[test]
fn sharded_ranks_scale_alike_and_change_no_bit() {
    let tokens = tokens();
    let go = |c: DeviceTrainConfig| {
        let params = seeded_params(&c.cfg, SEED).unwrap();
        ring::run_ranks(2, ring::RingOptions::default(), |comm| {
            let comm: Box<dyn DeviceComm<HostOps>> = Box::new(HostComm::new(Box::new(comm)));
            let mut t = ShardedDeviceTrainer::new(
                HostOps::new(),
                comm,
                c,
                ShardingStrategy::FullShard,
                &params,
            )
            .unwrap();
            let mut out = Vec::new();
            for s in 0..STEPS {
                out.extend(t.enqueue_step(&tokens, s).unwrap().map(|r| key(&r.outcome)));
            }
            out.extend(t.flush().unwrap().map(|r| key(&r.outcome)));
            (
                out,
                param_bits(t.full_params().unwrap()),
                t.grad_scaler_state(),
            )
        })
        .unwrap()
    };
    let plain = go(config(None));
    let scaled = go(config(Some((256.0, 3))));
    let grown = GradScalerState {
        scale: 1024.0,
        growth_tracker: 2,
        skipped_steps: 0,
    };
    for (r, ((po, pp, ps), (so, sp, ss))) in plain.iter().zip(&scaled).enumerate() {
        assert_eq!(so, po, "rank {r}: outcomes");
        assert!(sp == pp, "rank {r}: parameters");
        assert_eq!((*ps, *ss), (None, Some(grown)), "rank {r}");
    }
}

/// Two ranks reducing in f16 (`reduce_dtype`) with a grad scaler: the gradients are reduced
/// scaled, as PyTorch's are, so at a scale of 2^18 they overflow f16 in the reduction (f32
/// products, which never do) and the step is the scaler's skip on both ranks, the scale
/// backing off until the reductions fit; every rank's scaler in the same state, and the
/// engine's scaler fed the same overflows agrees.
#[test]
fn f16_reductions_overflow_as_the_scalers_skip() {
    let tokens = tokens();
    let c = DeviceTrainConfig {
        reduce_dtype: fsdp_device::DType::F16,
        ..config(Some((262_144.0, 2000)))
    };
    let params = seeded_params(&c.cfg, SEED).unwrap();
    let ranks = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
        let comm: Box<dyn DeviceComm<HostOps>> = Box::new(HostComm::new(Box::new(comm)));
        let mut t = ShardedDeviceTrainer::new(
            HostOps::new(),
            comm,
            c,
            ShardingStrategy::FullShard,
            &params,
        )
        .unwrap();
        let mut out = Vec::new();
        for s in 0..STEPS {
            out.extend(t.enqueue_step(&tokens, s).unwrap().map(|r| r.outcome));
        }
        out.extend(t.flush().unwrap().map(|r| r.outcome));
        out
    })
    .unwrap();
    let o = &ranks[0];
    assert!(
        o[0].overflow && !o[0].applied,
        "2^24 overflows f16: {:?}",
        o[0]
    );
    assert!(o.iter().any(|o| o.applied), "never fitted: {o:?}");
    assert!(o.iter().all(|o| o.loss.is_finite() && !o.halted));
    let states: Vec<_> = o.iter().map(|o| o.scaler.unwrap()).collect();
    assert_eq!(states, engine_states(c.grad_scaler.unwrap(), o));
    assert_eq!(keys(&ranks[1]), keys(o), "rank 1 against rank 0");
    let skipped = o.iter().filter(|o| o.overflow).count();
    println!("f16 reductions at 2^18: {skipped} of {STEPS} steps skipped");
}

/// A trainer that stops after 4 steps and one that resumes from its optimizer state and its
/// scaler's state continue as the uninterrupted run: bitwise.
#[test]
fn a_resumed_scaler_continues_bitwise() {
    let tokens = tokens();
    let c = config(Some((512.0, 3)));
    let params = seeded_params(&c.cfg, SEED).unwrap();
    let ops = || HostOps::new().with_overflow_at([4]);
    let mut whole = DeviceTrainer::new(ops(), c, &params).unwrap();
    let all: Vec<_> = (0..STEPS)
        .map(|s| whole.step(&tokens, s).unwrap())
        .collect();
    let mut first = DeviceTrainer::new(ops(), c, &params).unwrap();
    for s in 0..4 {
        first.step(&tokens, s).unwrap();
    }
    let state = first.optimizer_state().unwrap();
    let scaler = first.grad_scaler_state().unwrap();
    assert_eq!(scaler, all[3].scaler.unwrap());
    let mid = first.full_params().unwrap();
    // No overflow injected after the restart (the whole run's was at step 2).
    let mut second = DeviceTrainer::new(HostOps::new(), c, &mid).unwrap();
    second.load_optimizer_state(&state, 0).unwrap();
    assert_eq!(second.grad_scaler_state().unwrap().scale, 512.0);
    second.set_grad_scaler_state(scaler).unwrap();
    for (s, want) in all.iter().enumerate().skip(4) {
        let o = second.step(&tokens, s).unwrap();
        assert_eq!(key(&o), key(want), "step {s}");
        assert_eq!(o.scaler, want.scaler, "step {s}");
    }
    assert!(param_bits(second.full_params().unwrap()) == param_bits(whole.full_params().unwrap()));
    // A state for a trainer without a scaler, or a bad scale, is refused.
    let mut none = DeviceTrainer::new(HostOps::new(), config(None), &params).unwrap();
    assert!(none.set_grad_scaler_state(scaler).is_err());
    let bad = GradScalerState {
        scale: f32::INFINITY,
        ..scaler
    };
    assert!(second.set_grad_scaler_state(bad).is_err());
}

/// f16 products (`HostProducts::F16Operands`, `fsdp train --device --param-dtype f16`), with
/// the grad scaler they need:
/// - at 2^24 the gradients' f16 operands overflow (past 65504), so the scaler skips and backs
///   off until they fit, then trains — the engine's scaler fed the same overflows agrees, and
///   no overflow counts as non-finite;
/// - at the default 2^16, nothing overflows, and the losses are closer to the f32 run's than
///   those of bf16 products (f16 keeps 11 significant bits to bf16's 8).
#[test]
fn f16_products_overflow_until_the_scale_fits() {
    let tokens = tokens();
    let f16 = || HostOps::with_products(HostProducts::F16Operands);
    let c = config(Some((16_777_216.0, 2000)));
    let (o, _) = run(c, f16(), &tokens);
    let skipped = o.iter().filter(|o| o.overflow).count();
    assert!(
        o[0].overflow && !o[0].applied,
        "2^24 overflows f16: {:?}",
        o[0]
    );
    assert!(o.iter().any(|o| o.applied), "never fitted: {o:?}");
    assert!(o.iter().all(|o| o.loss.is_finite() && !o.halted));
    let states: Vec<_> = o.iter().map(|o| o.scaler.unwrap()).collect();
    assert_eq!(states, engine_states(c.grad_scaler.unwrap(), &o));
    let last = *states.last().unwrap();
    assert_eq!(last.skipped_steps, skipped as u64);
    assert_eq!(last.scale, 16_777_216.0 / 2f32.powi(skipped as i32));
    println!(
        "f16 at 2^24: {skipped} of {STEPS} steps skipped, the scale {} after",
        last.scale
    );
    // At 2^16: no overflow; closer to f32 than bf16 products are.
    let c = config(Some((65536.0, 2000)));
    let (f16_run, _) = run(c, f16(), &tokens);
    assert!(f16_run.iter().all(|o| o.applied && !o.overflow));
    let (f32_run, _) = run(config(None), HostOps::new(), &tokens);
    let (bf16_run, _) = run(
        config(None),
        HostOps::with_products(HostProducts::Bf16Operands),
        &tokens,
    );
    let apart = |r: &[StepOutcome]| {
        r.iter()
            .zip(&f32_run)
            .map(|(a, b)| (f64::from(a.loss) - f64::from(b.loss)).abs() / f64::from(b.loss))
            .fold(0.0, f64::max)
    };
    let (d16, dbf16) = (apart(&f16_run), apart(&bf16_run));
    println!("losses against f32: f16 products {d16:.2e}, bf16 products {dbf16:.2e}");
    assert!(d16 > 0.0 && d16 < dbf16, "f16 {d16:e}, bf16 {dbf16:e}");
}
