//! Dynamic loss scaling (`GradScaler`, PyTorch's `ShardedGradScaler`) in the engine, on a small
//! two-unit model whose backward can inject a non-finite (or huge) gradient on a chosen rank at
//! a chosen step:
//!
//! - a hand-computed sequence of scales (growth interval 3, overflows injected at steps 2, 6
//!   and 7), the skipped steps counted, parameters unchanged on skipped steps and changed on
//!   the others; a gradient that is finite but overflows once scaled is skipped at `2^16` and
//!   taken at `2^15`;
//! - an infinity on one rank only is skipped on every rank, at worlds 2 and 3 (and 4 for the
//!   2×2 hybrid mesh), for every strategy, the run then equal to the run without that step;
//! - without overflow, training with the scaler is bitwise the training without it (scaled by
//!   a power of two, then unscaled), with `no_sync` accumulation and clipping;
//! - the trainer's path (a non-finite `grad_norm`, then `skip_step`) is the scaler's skip; a
//!   backward after unscaling is refused; the state survives a sharded checkpoint;
//! - configuration errors.

use std::collections::HashMap;
use std::time::Duration;

use fsdp::engine::{
    load_grad_scaler_state, Fsdp, FsdpConfig, FsdpModel, GradScaler, GradScalerConfig,
    GradScalerState, ParamInit, ShardingStrategy, Span, GRAD_SCALER_FILE,
};
use fsdp::optim::{AdamWConfig, OptimizerConfig, SgdConfig};
use fsdp::units::{ParamSpec, UnitPlan, UnitSpec};
use fsdp::{FsdpError, Grads, Params};
use fsdp_collectives::{ring, Communicator};

type Map = HashMap<String, Vec<f32>>;

/// Examples in the global batch: divisible by every world size tested.
const GLOBAL: usize = 12;
/// Inputs per example.
const IN: usize = 5;

/// `h = tanh(a · x)` (unit `a`, 5 weights), `y = b0·h + b1·h² + b2` (unit `b`, 3 weights, so
/// shards are padded at worlds 2 and 4), loss `Σ (y − t)² / (2·GLOBAL)`.
struct Net;

/// One rank's examples, and the value added to `b.w[index]`'s gradient in backward, if any.
struct Batch {
    x: Vec<[f32; IN]>,
    t: Vec<f32>,
    poison: Option<(usize, f32)>,
}

#[derive(Default)]
struct Tape {
    h: Vec<f32>,
    y: Vec<f32>,
    dh: Vec<f32>,
    loss: f32,
}

impl FsdpModel for Net {
    type Batch = Batch;
    type Tape = Tape;

    fn spans(&self) -> Vec<Span> {
        vec![Span::new("a", ["a.w"]), Span::new("b", ["b.w"])]
    }

    fn forward(
        &self,
        span: usize,
        p: &dyn Params,
        batch: &Batch,
        tape: &mut Tape,
    ) -> Result<(), FsdpError> {
        if span == 0 {
            let a = p.param("a.w")?;
            tape.h = batch
                .x
                .iter()
                .map(|x| x.iter().zip(a).map(|(x, a)| x * a).sum::<f32>().tanh())
                .collect();
        } else {
            let b = p.param("b.w")?;
            tape.y = tape
                .h
                .iter()
                .map(|h| b[0] * h + b[1] * h * h + b[2])
                .collect();
            tape.loss = tape
                .y
                .iter()
                .zip(&batch.t)
                .map(|(y, t)| (y - t) * (y - t))
                .sum::<f32>()
                / (2 * GLOBAL) as f32;
        }
        Ok(())
    }

    fn loss(&self, tape: &Tape) -> Result<f32, FsdpError> {
        Ok(tape.loss)
    }

    fn backward(
        &self,
        span: usize,
        p: &dyn Params,
        g: &mut dyn Grads,
        batch: &Batch,
        tape: &mut Tape,
    ) -> Result<(), FsdpError> {
        if span == 1 {
            let b = p.param("b.w")?.to_vec();
            let gb = g.grad_mut("b.w")?;
            tape.dh.clear();
            for ((y, h), t) in tape.y.iter().zip(&tape.h).zip(&batch.t) {
                let d = (y - t) / GLOBAL as f32;
                gb[0] += d * h;
                gb[1] += d * h * h;
                gb[2] += d;
                tape.dh.push(d * (b[0] + 2.0 * b[1] * h));
            }
            if let Some((i, v)) = batch.poison {
                gb[i] += v;
            }
        } else {
            let ga = g.grad_mut("a.w")?;
            for ((x, h), dh) in batch.x.iter().zip(&tape.h).zip(&tape.dh) {
                let dz = dh * (1.0 - h * h);
                for (g, x) in ga.iter_mut().zip(x) {
                    *g += dz * x;
                }
            }
        }
        Ok(())
    }
}

fn plan() -> UnitPlan {
    let unit = |n: &str, len| UnitSpec {
        name: n.into(),
        params: vec![ParamSpec::new(format!("{n}.w"), vec![len])],
    };
    UnitPlan {
        units: vec![unit("a", IN), unit("b", 3)],
        ignored: vec![],
    }
}

fn init() -> Map {
    HashMap::from([
        ("a.w".to_string(), vec![0.3, -0.2, 0.5, 0.1, -0.4]),
        ("b.w".to_string(), vec![0.7, -0.3, 0.2]),
    ])
}

/// Rank `rank`'s slice of the global batch.
fn batch(rank: usize, world: usize, poison: Option<(usize, f32)>) -> Batch {
    let per = GLOBAL / world;
    let rows = rank * per..(rank + 1) * per;
    Batch {
        x: rows
            .clone()
            .map(|i| std::array::from_fn(|j| ((i * IN + j) as f32 * 0.7).sin()))
            .collect(),
        t: rows.map(|i| (i as f32 * 0.3).cos()).collect(),
        poison,
    }
}

fn adamw() -> OptimizerConfig {
    AdamWConfig {
        lr: 1e-2,
        ..AdamWConfig::default()
    }
    .into()
}

fn ring_options() -> ring::RingOptions {
    let mut options = ring::RingOptions::default();
    options.timeout = Duration::from_secs(60);
    options
}

/// One engine per rank on `world` threads; `body(fsdp, rank)` drives it.
fn on_ranks<T: Send>(
    world: usize,
    config: FsdpConfig,
    optim: OptimizerConfig,
    scaler: Option<GradScalerConfig>,
    body: impl Fn(&mut Fsdp, usize) -> T + Sync,
) -> Vec<T> {
    let (plan, init) = (plan(), init());
    ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let mut fsdp =
            Fsdp::new(Box::new(comm), &plan, ParamInit::Full(&init), config, optim).unwrap();
        fsdp.set_grad_scaler(scaler).unwrap();
        body(&mut fsdp, rank)
    })
    .unwrap()
}

/// What one rank saw after each step.
#[derive(Debug, Clone, PartialEq)]
struct Trace {
    /// The full parameters after each step.
    params: Vec<Map>,
    /// The scale and growth tracker after each step.
    scales: Vec<(f32, u32)>,
    skipped: u64,
    optimizer_steps: u64,
}

/// `steps` steps of [`Net`] with `poison(rank, step)` injected into backward.
fn train(
    world: usize,
    config: FsdpConfig,
    optim: OptimizerConfig,
    scaler: Option<GradScalerConfig>,
    steps: usize,
    poison: impl Fn(usize, usize) -> Option<(usize, f32)> + Sync,
) -> Vec<Trace> {
    on_ranks(world, config, optim, scaler, |fsdp, rank| {
        let mut t = Trace {
            params: Vec::new(),
            scales: Vec::new(),
            skipped: 0,
            optimizer_steps: 0,
        };
        for step in 0..steps {
            fsdp.step(&Net, &batch(rank, world, poison(rank, step)))
                .unwrap();
            t.params.push(fsdp.full_state_dict().unwrap());
            if let Some(s) = fsdp.grad_scaler() {
                assert_eq!(s.found_inf(), None, "the step's unscaling is forgotten");
                t.scales.push((s.scale(), s.growth_tracker()));
            }
        }
        t.skipped = fsdp.grad_scaler().map_or(0, GradScaler::skipped_steps);
        t.optimizer_steps = fsdp.optimizer_steps();
        t
    })
}

fn mesh(strategy: ShardingStrategy, ranks_per_node: Option<usize>) -> FsdpConfig {
    let mut config = FsdpConfig::new(strategy);
    config.ranks_per_node = ranks_per_node;
    config
}

/// Parameters as sorted `(name, bits)` pairs, for bitwise comparisons.
type Bits = Vec<(String, Vec<u32>)>;

fn bits(m: &Map) -> Bits {
    let mut v: Vec<_> = m
        .iter()
        .map(|(k, v)| (k.clone(), v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    v.sort();
    v
}

#[test]
fn update_follows_torch_amp_update_scale() {
    let config = GradScalerConfig {
        growth_interval: 3,
        ..GradScalerConfig::default()
    };
    let mut s = GradScaler::new(config).unwrap();
    assert_eq!(
        (s.scale(), s.growth_tracker(), s.inv_scale()),
        (65536.0, 0, 1.0 / 65536.0)
    );
    let found = [
        false, false, true, false, false, false, true, true, false, false, false,
    ];
    let want: [(f32, u32); 11] = [
        (65536.0, 1),
        (65536.0, 2),
        (32768.0, 0),
        (32768.0, 1),
        (32768.0, 2),
        (65536.0, 0),
        (32768.0, 0),
        (16384.0, 0),
        (16384.0, 1),
        (16384.0, 2),
        (32768.0, 0),
    ];
    for (f, w) in found.iter().zip(want) {
        s.update(*f);
        assert_eq!((s.scale(), s.growth_tracker()), w);
    }
    // The engine counts skipped steps, `update` does not.
    assert_eq!(s.skipped_steps(), 0);

    // Growth that would overflow to infinity is not applied; the tracker still resets.
    let top = f32::from_bits(0x7f00_0000); // 2^127
    let mut s = GradScaler::new(GradScalerConfig {
        init_scale: top,
        growth_interval: 1,
        ..GradScalerConfig::default()
    })
    .unwrap();
    s.update(false);
    assert_eq!((s.scale(), s.growth_tracker()), (top, 0));
    s.update(true);
    assert_eq!(s.scale(), top / 2.0);

    // Non-power-of-two factors: products in f64, rounded to f32 once.
    let mut s = GradScaler::new(GradScalerConfig {
        init_scale: 3.0,
        growth_factor: 1.1,
        backoff_factor: 0.3,
        growth_interval: 1,
        enabled: true,
    })
    .unwrap();
    s.update(false);
    assert_eq!(s.scale(), (3.0f64 * 1.1) as f32);
    s.update(true);
    assert_eq!(s.scale(), (f64::from((3.0f64 * 1.1) as f32) * 0.3) as f32);
    assert_eq!(s.inv_scale(), (1.0 / f64::from(s.scale())) as f32);
}

#[test]
fn hand_computed_scales_with_injected_overflows() {
    // Growth interval 3; an infinity (rank 0), a NaN (rank 1) and an infinity on both ranks at
    // steps 2, 6 and 7.
    let scaler = GradScalerConfig {
        growth_interval: 3,
        ..GradScalerConfig::default()
    };
    let poison = |rank: usize, step: usize| match (step, rank) {
        (2, 0) | (7, _) => Some((1, f32::INFINITY)),
        (6, 1) => Some((2, f32::NAN)),
        _ => None,
    };
    // The scale after each of the 12 steps: 2^16 until the overflow at step 2 halves it, three
    // clean steps (3, 4, 5) double it, steps 6 and 7 halve it twice, steps 8, 9, 10 double it.
    let scales: [f32; 12] = [
        65536.0, 65536.0, 32768.0, 32768.0, 32768.0, 65536.0, 32768.0, 16384.0, 16384.0, 16384.0,
        32768.0, 32768.0,
    ];
    let trackers: [u32; 12] = [1, 2, 0, 1, 2, 0, 0, 0, 1, 2, 0, 1];
    let skipped_at = [2, 6, 7];
    for (world, config) in [
        (2, mesh(ShardingStrategy::FullShard, None)),
        (3, mesh(ShardingStrategy::NoShard, None)),
    ] {
        let runs = train(world, config, adamw(), Some(scaler), 12, poison);
        for (r, t) in runs.iter().enumerate() {
            let what = format!("world {world} {:?} rank {r}", config.strategy);
            let got: Vec<f32> = t.scales.iter().map(|s| s.0).collect();
            assert_eq!(got, scales, "{what}: scales");
            let got: Vec<u32> = t.scales.iter().map(|s| s.1).collect();
            assert_eq!(got, trackers, "{what}: growth trackers");
            assert_eq!(t.skipped, 3, "{what}: skipped steps");
            assert_eq!(t.optimizer_steps, 9, "{what}: optimizer steps");
            let init = init();
            for step in 0..12 {
                let before = if step == 0 {
                    &init
                } else {
                    &t.params[step - 1]
                };
                let after = &t.params[step];
                assert!(after.values().flatten().all(|x| x.is_finite()), "{what}");
                if skipped_at.contains(&step) {
                    assert_eq!(bits(before), bits(after), "{what}: step {step} was skipped");
                } else {
                    for name in ["a.w", "b.w"] {
                        assert_ne!(before[name], after[name], "{what}: step {step} {name}");
                    }
                }
            }
            assert_eq!(t, &runs[0], "{what}: differs from rank 0");
        }
    }
}

#[test]
fn a_gradient_that_overflows_only_once_scaled_backs_the_scale_off_until_it_fits() {
    // 2^112 is finite, 2^112 · 2^16 = 2^128 is not, 2^112 · 2^15 = 2^127 is: the first step is
    // skipped and the second, with the same gradient, taken.
    let huge = 2f32.powi(112);
    let runs = train(
        2,
        mesh(ShardingStrategy::FullShard, None),
        SgdConfig::with_momentum(1e-33, 0.0).into(),
        Some(GradScalerConfig::default()),
        2,
        |rank, _| (rank == 0).then_some((0, huge)),
    );
    for t in &runs {
        assert_eq!(t.scales, [(32768.0, 0), (32768.0, 1)]);
        assert_eq!((t.skipped, t.optimizer_steps), (1, 1));
        assert_eq!(bits(&t.params[0]), bits(&init()), "step 0 was skipped");
        let b = &t.params[1]["b.w"];
        // b0 − 1e-33 · (2^112 + small): moved by about −5.2, and finite.
        assert!(
            b[0].is_finite() && (b[0] - (0.7 - 1e-33 * huge)).abs() < 1e-2,
            "{b:?}"
        );
    }
}

/// Every strategy at worlds 2 and 3, hybrid ones on every mesh, and the 2×2 hybrid mesh.
fn configs() -> Vec<(usize, FsdpConfig)> {
    let mut out = Vec::new();
    for world in [2, 3] {
        for strategy in ShardingStrategy::ALL {
            if strategy.is_hybrid() {
                for rpn in [1, world] {
                    out.push((world, mesh(strategy, Some(rpn))));
                }
            } else {
                out.push((world, mesh(strategy, None)));
            }
        }
    }
    out.push((4, mesh(ShardingStrategy::HybridShard, Some(2))));
    out.push((4, mesh(ShardingStrategy::HybridShardZero2, Some(2))));
    out
}

#[test]
fn an_infinity_on_one_rank_is_skipped_on_every_rank() {
    for (world, config) in configs() {
        let what = format!(
            "world {world} {:?} ranks_per_node {:?}",
            config.strategy, config.ranks_per_node
        );
        // An infinity in `b.w[2]`'s gradient on rank 1 at step 1: with sharded strategies it
        // lands in one rank's shard only.
        let runs = train(
            world,
            config,
            adamw(),
            Some(GradScalerConfig::default()),
            3,
            |rank, step| (rank == 1 && step == 1).then_some((2, f32::INFINITY)),
        );
        // The same run without the scaler and without that step.
        let plain = train(world, config, adamw(), None, 2, |_, _| None);
        for (r, (t, p)) in runs.iter().zip(&plain).enumerate() {
            assert_eq!(
                t.scales,
                [(65536.0, 1), (32768.0, 0), (32768.0, 1)],
                "{what} rank {r}"
            );
            assert_eq!((t.skipped, t.optimizer_steps), (1, 2), "{what} rank {r}");
            assert_eq!(bits(&t.params[0]), bits(&t.params[1]), "{what} rank {r}");
            assert_eq!(
                bits(&t.params[2]),
                bits(&p.params[1]),
                "{what} rank {r}: differs from the run without the skipped step"
            );
            assert_eq!(
                bits(&t.params[2]),
                bits(&runs[0].params[2]),
                "{what} rank {r}"
            );
        }
    }
}

/// Per rank: the losses, gradient norms and final parameters of 4 steps of 2 micro-batches
/// (the first under `no_sync`), clipped to a norm the gradients exceed.
fn accumulate_and_clip(
    world: usize,
    config: FsdpConfig,
    scaler: Option<GradScalerConfig>,
) -> Vec<(Vec<u64>, Bits, Option<f32>)> {
    on_ranks(world, config, adamw(), scaler, |fsdp, rank| {
        let b = batch(rank, world, None);
        let mut norms = Vec::new();
        for _ in 0..4 {
            fsdp.no_sync(|f| f.forward_backward(&Net, &b)).unwrap();
            fsdp.forward_backward(&Net, &b).unwrap();
            let n = fsdp.clip_grad_norm(0.01).unwrap();
            assert!(n > 0.01);
            norms.push(n.to_bits());
            norms.push(fsdp.grad_norm().unwrap().to_bits());
            fsdp.optimizer_step().unwrap();
        }
        (
            norms,
            bits(&fsdp.full_state_dict().unwrap()),
            fsdp.grad_scaler().map(GradScaler::scale),
        )
    })
}

#[test]
fn without_overflow_the_scaler_changes_nothing() {
    // The scale grows at every step (2^16 to 2^20), or starts below 1.
    let growing = GradScalerConfig {
        growth_interval: 1,
        ..GradScalerConfig::default()
    };
    let small = GradScalerConfig {
        init_scale: 0.25,
        growth_interval: 1,
        ..GradScalerConfig::default()
    };
    for (world, config) in [
        (1, mesh(ShardingStrategy::FullShard, None)),
        (2, mesh(ShardingStrategy::FullShard, None)),
        (3, mesh(ShardingStrategy::ShardGradOp, None)),
        (2, mesh(ShardingStrategy::NoShard, None)),
        (4, mesh(ShardingStrategy::HybridShard, Some(2))),
    ] {
        let what = format!("world {world} {:?}", config.strategy);
        let plain = accumulate_and_clip(world, config, None);
        for (scaler, last) in [(growing, 2f32.powi(20)), (small, 4.0)] {
            let scaled = accumulate_and_clip(world, config, Some(scaler));
            for (r, (p, s)) in plain.iter().zip(&scaled).enumerate() {
                assert_eq!(p.0, s.0, "{what} rank {r}: gradient norms");
                assert!(p.1 == s.1, "{what} rank {r}: parameters differ");
                assert_eq!(s.2, Some(last), "{what} rank {r}: scale");
            }
        }
        // Plain stepping too (no clipping, no accumulation).
        let plain = train(world, config, adamw(), None, 3, |_, _| None);
        let scaled = train(world, config, adamw(), Some(growing), 3, |_, _| None);
        for (p, s) in plain.iter().zip(&scaled) {
            assert_eq!(
                p.params.iter().map(bits).collect::<Vec<_>>(),
                s.params.iter().map(bits).collect::<Vec<_>>(),
                "{what}"
            );
        }
    }
}

#[test]
fn the_trainers_nonfinite_check_skips_as_the_scaler_does() {
    let runs = on_ranks(
        2,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        Some(GradScalerConfig::default()),
        |fsdp, rank| {
            let mut out = Vec::new();
            for step in 0..3 {
                let poison = (rank == 0 && step == 1).then_some((0, f32::INFINITY));
                fsdp.forward_backward(&Net, &batch(rank, 2, poison))
                    .unwrap();
                let norm = fsdp.grad_norm().unwrap();
                let s = fsdp.grad_scaler().unwrap();
                out.push((norm.is_finite(), s.found_inf()));
                // The unscaling is done once: a second norm is the same.
                assert_eq!(fsdp.grad_norm().unwrap().to_bits(), norm.to_bits());
                assert_eq!(fsdp.unscale_grads().unwrap(), !norm.is_finite());
                if norm.is_finite() {
                    fsdp.optimizer_step().unwrap();
                } else {
                    fsdp.skip_step().unwrap();
                }
            }
            let s = fsdp.grad_scaler().unwrap();
            (out, s.state(), fsdp.optimizer_steps())
        },
    );
    for (out, state, steps) in runs {
        assert_eq!(
            out,
            [
                (true, Some(false)),
                (false, Some(true)),
                (true, Some(false))
            ]
        );
        assert_eq!(
            state,
            GradScalerState {
                scale: 32768.0,
                growth_tracker: 1,
                skipped_steps: 1
            }
        );
        assert_eq!(steps, 2);
    }

    // A skip for the caller's own reasons (finite gradients) leaves the scaler alone, and so
    // does a skip before unscaling.
    let runs = on_ranks(
        2,
        mesh(ShardingStrategy::NoShard, None),
        adamw(),
        Some(GradScalerConfig::default()),
        |fsdp, rank| {
            fsdp.forward_backward(&Net, &batch(rank, 2, None)).unwrap();
            fsdp.grad_norm().unwrap();
            fsdp.skip_step().unwrap();
            let poison = Some((0, f32::INFINITY));
            fsdp.forward_backward(&Net, &batch(rank, 2, poison))
                .unwrap();
            fsdp.skip_step().unwrap();
            fsdp.grad_scaler().unwrap().state()
        },
    );
    for state in runs {
        assert_eq!(
            state,
            GradScalerState {
                scale: 65536.0,
                growth_tracker: 0,
                skipped_steps: 0
            }
        );
    }
}

#[test]
fn a_backward_after_unscaling_is_refused() {
    let runs = on_ranks(
        2,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        Some(GradScalerConfig::default()),
        |fsdp, rank| {
            let b = batch(rank, 2, None);
            // Unscaling no gradient marks nothing: a backward may follow.
            assert!(!fsdp.unscale_grads().unwrap());
            fsdp.forward_backward(&Net, &b).unwrap();
            assert!(!fsdp.unscale_grads().unwrap());
            let refused = matches!(
                fsdp.forward_backward(&Net, &b),
                Err(FsdpError::InvalidFsdpConfig { .. })
            );
            // The scaler cannot change while gradients are held.
            let held = matches!(
                fsdp.set_grad_scaler(None),
                Err(FsdpError::InvalidFsdpConfig { .. })
            );
            fsdp.zero_grad().unwrap();
            fsdp.step(&Net, &b).unwrap();
            fsdp.set_grad_scaler(None).unwrap();
            (refused, held, fsdp.optimizer_steps())
        },
    );
    assert_eq!(runs, [(true, true, 1), (true, true, 1)]);
}

#[test]
fn the_scaler_state_is_saved_with_a_sharded_checkpoint() {
    let dir = std::env::temp_dir().join(format!("fsdp-grad-scaler-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let scaler = GradScalerConfig {
        growth_interval: 2,
        ..GradScalerConfig::default()
    };
    let saved = on_ranks(
        2,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        Some(scaler),
        |fsdp, rank| {
            for step in 0..4 {
                let poison = (step == 1).then_some((1, f32::INFINITY));
                fsdp.step(&Net, &batch(rank, 2, poison)).unwrap();
            }
            fsdp.save_sharded(&dir).unwrap();
            fsdp.grad_scaler().unwrap().state()
        },
    );
    let want = GradScalerState {
        scale: 65536.0,
        growth_tracker: 0,
        skipped_steps: 1,
    };
    assert_eq!(saved, [want, want]);
    let loaded = load_grad_scaler_state(&dir).unwrap();
    assert_eq!(loaded, Some(want));
    let restored = on_ranks(
        2,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        Some(scaler),
        |fsdp, _| {
            fsdp.set_grad_scaler_state(loaded.unwrap()).unwrap();
            fsdp.grad_scaler().unwrap().state()
        },
    );
    assert_eq!(restored, [want, want]);
    // Saved again without a scaler: the stale state is removed.
    on_ranks(
        2,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        None,
        |fsdp, _| {
            let e = fsdp.set_grad_scaler_state(want);
            assert!(matches!(e, Err(FsdpError::InvalidFsdpConfig { .. })));
            fsdp.save_sharded(&dir).unwrap();
        },
    );
    assert!(!dir.join(GRAD_SCALER_FILE).exists());
    assert_eq!(load_grad_scaler_state(&dir).unwrap(), None);
    std::fs::write(dir.join(GRAD_SCALER_FILE), "{\"scale\": -1}").unwrap();
    assert!(matches!(
        load_grad_scaler_state(&dir),
        Err(FsdpError::Checkpoint { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn invalid_configurations_are_refused() {
    let d = GradScalerConfig::default();
    assert_eq!(
        (
            d.init_scale,
            d.growth_factor,
            d.backoff_factor,
            d.growth_interval,
            d.enabled
        ),
        (65536.0, 2.0, 0.5, 2000, true)
    );
    let cases: Vec<(&str, GradScalerConfig)> = vec![
        (
            "init_scale",
            GradScalerConfig {
                init_scale: 0.0,
                ..d
            },
        ),
        (
            "init_scale",
            GradScalerConfig {
                init_scale: -1.0,
                ..d
            },
        ),
        (
            "init_scale",
            GradScalerConfig {
                init_scale: f32::INFINITY,
                ..d
            },
        ),
        (
            "init_scale",
            GradScalerConfig {
                init_scale: f32::NAN,
                ..d
            },
        ),
        (
            "growth_factor",
            GradScalerConfig {
                growth_factor: 1.0,
                ..d
            },
        ),
        (
            "growth_factor",
            GradScalerConfig {
                growth_factor: 0.5,
                ..d
            },
        ),
        (
            "growth_factor",
            GradScalerConfig {
                growth_factor: f64::INFINITY,
                ..d
            },
        ),
        (
            "growth_factor",
            GradScalerConfig {
                growth_factor: f64::NAN,
                ..d
            },
        ),
        (
            "backoff_factor",
            GradScalerConfig {
                backoff_factor: 0.0,
                ..d
            },
        ),
        (
            "backoff_factor",
            GradScalerConfig {
                backoff_factor: 1.0,
                ..d
            },
        ),
        (
            "backoff_factor",
            GradScalerConfig {
                backoff_factor: -0.5,
                ..d
            },
        ),
        (
            "backoff_factor",
            GradScalerConfig {
                backoff_factor: f64::NAN,
                ..d
            },
        ),
        (
            "growth_interval",
            GradScalerConfig {
                growth_interval: 0,
                ..d
            },
        ),
    ];
    for (name, c) in &cases {
        match c.validate() {
            Err(FsdpError::InvalidHyperparameter { name: n, .. }) => assert_eq!(n, *name),
            other => panic!("{c:?}: {other:?}"),
        }
        assert!(GradScaler::new(*c).is_err());
    }
    let runs = on_ranks(
        1,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        None,
        |fsdp, _| {
            for (_, c) in &cases {
                assert!(matches!(
                    fsdp.set_grad_scaler(Some(*c)),
                    Err(FsdpError::InvalidHyperparameter { .. })
                ));
                assert!(fsdp.grad_scaler().is_none());
            }
            // A disabled scaler is none, and is not checked (as torch).
            let off = GradScalerConfig {
                enabled: false,
                growth_factor: 0.0,
                ..d
            };
            fsdp.set_grad_scaler(Some(off)).unwrap();
            let none = fsdp.grad_scaler().is_none();
            fsdp.set_grad_scaler(Some(d)).unwrap();
            let bad = GradScalerState {
                scale: f32::INFINITY,
                growth_tracker: 0,
                skipped_steps: 0,
            };
            let refused = matches!(
                fsdp.set_grad_scaler_state(bad),
                Err(FsdpError::InvalidHyperparameter { .. })
            );
            (none, refused, fsdp.grad_scaler().map(GradScaler::scale))
        },
    );
    assert_eq!(runs, [(true, true, Some(65536.0))]);
}
