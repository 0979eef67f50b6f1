//! The device benchmark's measurements (`fsdp_gpt::device_bench`, behind `gpt-device-bench`) on
//! the host twins: the FLOP count against the closed form, the timed steps against an untimed
//! run of the same trainer, the median's definition, a step that is not finite refused, and the
//! benchmark program timing two ranks against one.

use std::time::Duration;

use fsdp::optim::{AdamWConfig, LrSchedule};
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_bench::{model_flops_per_token, time_steps, Reads, StepTimes};
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig, DeviceTrainError, DeviceTrainer};
use fsdp_gpt::model::GptConfig;
use fsdp_kernels::gpt::HostOps;

fn tiny() -> DeviceTrainConfig {
    DeviceTrainConfig {
        cfg: GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            block_size: 8,
            vocab_size: 40,
        },
        adamw: AdamWConfig::default(),
        schedule: LrSchedule::Constant,
        decay_2d_only: true,
        grad_clip: Some(1.0),
        batch_size: 4,
        grad_accum: 1,
        offload: false,
        activation_checkpointing: false,
        attention: Default::default(),
        logits: Default::default(),
        reduce_dtype: fsdp_device::DType::F32,
        any_precision: None,
        grad_scaler: None,
        wrap: Default::default(),
    }
}

#[test]
fn model_flops_are_nanogpts_estimate_for_gpt2_124m() {
    let (l, c, t, v) = (12.0f64, 768.0f64, 1024.0f64, 50304.0f64);
    // Parameters without the position embedding: token embedding (tied head), per block two
    // layer norms (4C), attention (3C² + 3C, C² + C) and MLP (4C² + 4C, 4C² + C), final norm.
    let n = v * c + l * (12.0 * c * c + 13.0 * c) + 2.0 * c;
    let want = 6.0 * n + 12.0 * l * t * c;
    let cfg = GptConfig {
        n_layer: 12,
        n_head: 12,
        n_embd: 768,
        block_size: 1024,
        vocab_size: 50304,
    };
    assert_eq!(model_flops_per_token(&cfg), want);
    // About 0.86 GFLOP per token for GPT-2 124M with vocab 50304 (0.74 from the parameters,
    // 0.11 from attention at 1024 tokens).
    assert!((want / 1e9 - 0.8554).abs() < 1e-3, "{want}");
}

#[test]
fn timed_steps_train_exactly_as_untimed_steps() {
    let config = tiny();
    let params = seeded_params(&config.cfg, 5).unwrap();
    let tokens = synthetic_corpus(5000, 40, 5);
    let mut plain = DeviceTrainer::new(HostOps::new(), config, &params).unwrap();
    let losses: Vec<f32> = (0..4)
        .map(|s| plain.step(&tokens, s).unwrap().loss)
        .collect();
    for reads in [Reads::OneLate, Reads::AtOnce] {
        let mut timed = DeviceTrainer::new(HostOps::new(), config, &params).unwrap();
        let times = time_steps(&mut timed, &tokens, 4, 1, reads).unwrap();
        assert_eq!(times.losses, losses, "{reads:?}");
        assert_eq!((times.steps.len(), times.tokens_per_step), (4, 4 * 8));
        assert!(times.tokens_per_s() > 0.0);
        assert!(times.median() >= *times.steps[1..].iter().min().unwrap());
        assert!(times.median() <= *times.steps[1..].iter().max().unwrap());
        // Read at once, each step's time is its enqueuing and the wait after it.
        match reads {
            Reads::OneLate => assert_eq!(times.split_medians(), None),
            Reads::AtOnce => {
                assert_eq!((times.enqueue.len(), times.drain.len()), (4, 4));
                for k in 0..4 {
                    assert!(
                        times.enqueue[k] + times.drain[k] <= times.steps[k],
                        "step {k}"
                    );
                }
                let (e, d) = times.split_medians().unwrap();
                assert!(e + d <= times.steps[1..].iter().sum::<Duration>());
            }
        }
    }
}

#[test]
fn the_median_leaves_out_the_warm_up() {
    let ms = Duration::from_millis;
    let t = |steps: Vec<Duration>, warmup| StepTimes {
        steps,
        warmup,
        tokens_per_step: 1000,
        losses: Vec::new(),
        enqueue: Vec::new(),
        drain: Vec::new(),
    };
    assert_eq!(t(vec![ms(90), ms(3), ms(1), ms(2)], 1).median(), ms(2));
    assert_eq!(
        t(vec![ms(90), ms(4), ms(1), ms(2), ms(3)], 1).median(),
        ms(5) / 2
    );
    // No step after the warm-up: all of them count.
    assert_eq!(t(vec![ms(9), ms(1), ms(5)], 3).median(), ms(5));
    let x = t(vec![ms(10), ms(2)], 1);
    assert_eq!(x.tokens_per_s(), 500_000.0);
    // The split medians leave out the same warm-up.
    let mut y = t(vec![ms(90), ms(5), ms(7)], 1);
    (y.enqueue, y.drain) = (vec![ms(80), ms(4), ms(6)], vec![ms(9), ms(1), ms(0)]);
    assert_eq!(y.split_medians(), Some((ms(5), ms(1) / 2)));
}

#[test]
fn a_step_that_is_not_finite_is_refused_by_name() {
    let config = tiny();
    let mut params = seeded_params(&config.cfg, 5).unwrap();
    params.get_mut("transformer.ln_f.weight").unwrap()[0] = f32::NAN;
    let tokens = synthetic_corpus(5000, 40, 5);
    let mut trainer = DeviceTrainer::new(HostOps::new(), config, &params).unwrap();
    match time_steps(&mut trainer, &tokens, 3, 0, Reads::OneLate) {
        Err(e @ DeviceTrainError::NotFinite { step: 0, .. }) => {
            assert!(e.to_string().contains("step 0 is not finite"), "{e}")
        }
        other => panic!("expected step 0 to be refused, got {other:?}"),
    }
}

/// A grad scaler's skip of an overflowing step (f16 products at a scale past f16's range) is
/// training as usual: timed, not refused.
#[test]
fn a_grad_scalers_skip_is_timed() {
    let config = DeviceTrainConfig {
        grad_scaler: Some(fsdp::engine::GradScalerConfig {
            init_scale: 16_777_216.0,
            ..Default::default()
        }),
        ..tiny()
    };
    let params = seeded_params(&config.cfg, 5).unwrap();
    let tokens = synthetic_corpus(5000, 40, 5);
    let ops = HostOps::with_products(fsdp_kernels::gpt::HostProducts::F16Operands);
    let mut trainer = DeviceTrainer::new(ops, config, &params).unwrap();
    let times = time_steps(&mut trainer, &tokens, 3, 0, Reads::OneLate).unwrap();
    assert_eq!(times.steps.len(), 3);
    let s = trainer.grad_scaler_state().unwrap();
    assert!(s.skipped_steps > 0, "{s:?}");
}

/// `gpt-device-bench --device host-twin --model tiny --products P --warmup 1` with `extra`:
/// its standard output, once it succeeded.
fn tiny_bench(products: &str, extra: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpt-device-bench"))
        .args(["--device", "host-twin", "--model", "tiny"])
        .args(["--products", products, "--warmup", "1"])
        .args(extra)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}{err}");
    text
}

/// The ratio (`…, R× …`) on the line of `text` that starts with `prefix`: positive and finite.
fn result_ratio(text: &str, prefix: &str) -> f64 {
    let result = text
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("{text}"));
    let ratio: f64 = result
        .split(", ")
        .nth(1)
        .unwrap()
        .split('×')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(ratio > 0.0 && ratio.is_finite(), "{result}");
    ratio
}

/// `gpt-device-bench --device host-twin --model tiny --ranks 2`: after the world-1 run, the
/// same global batch as two ranks (each timed by `time_steps` over `ShardedDeviceTrainer`):
/// the same losses as world 1 within 1e-5 (printed at 4 decimals: equal), its median step and
/// its ratio to world 1's on a `RESULT` line, and every rank's peak; with `--reduce-dtype
/// bf16`, a `RESULT` line naming it and the bytes rank 0's collectives moved a step.
#[test]
fn the_benchmark_times_two_ranks_against_one() {
    // The tiny model's f32 run on the host twins, then as 2 ranks: its output.
    let bench_with = |steps: &str, products: &str, extra: &[&str]| {
        tiny_bench(
            products,
            &[&["--steps", steps, "--ranks", "2"], extra].concat(),
        )
    };
    let bench = |steps: &str, extra: &[&str]| bench_with(steps, "f32", extra);
    let text = bench("4", &[]);
    let losses = |line: &str| line.rsplit("loss ").next().unwrap().trim().to_string();
    let one = text
        .lines()
        .find(|l| l.starts_with("gpt-device-bench tiny"))
        .unwrap();
    let two = text
        .lines()
        .find(|l| l.contains("2 ranks as threads"))
        .unwrap();
    assert_eq!(losses(one), losses(two), "{text}");
    assert!(two.contains("peak memory per rank"), "{two}");
    result_ratio(&text, "RESULT gpt-device-bench tiny f32 world 2 full-shard");
    // With `--reduce-dtype bf16` the ranks reduce in bf16, and the RESULT line says so.
    let text = bench("2", &["--reduce-dtype", "bf16"]);
    assert!(
        text.contains("RESULT gpt-device-bench tiny f32 world 2 full-shard reduce bf16: median"),
        "{text}"
    );
    // And the bytes rank 0's collectives moved a step.
    assert!(
        text.contains("rank 0's collectives a step: all-gathered"),
        "{text}"
    );
    // The fused attention (16-bit products) at one rank and at two.
    let text = bench_with("2", "bf16", &["--attention", "fused"]);
    assert!(
        text.contains("RESULT gpt-device-bench tiny bf16 attention fused"),
        "{text}"
    );
    assert!(text.contains("2 ranks as threads"), "{text}");
    // AnyPrecisionAdamW: the RESULT lines name it, and with bf16 products (pure bf16) the
    // ranks gather in bf16: half the bytes of AdamW's f32 gathers.
    let gathered = |text: &str| -> String {
        let l = text
            .lines()
            .find(|l| l.contains("rank 0's collectives a step: all-gathered"))
            .unwrap_or_else(|| panic!("{text}"));
        l.split("all-gathered ")
            .nth(1)
            .unwrap()
            .split(',')
            .next()
            .unwrap()
            .to_string()
    };
    let adamw = bench_with("2", "bf16", &[]);
    let any = bench_with("2", "bf16", &["--optimizer", "anyprecision-adamw"]);
    assert!(
        any.contains("RESULT gpt-device-bench tiny bf16 world 2 full-shard anyprecision-adamw:"),
        "{any}"
    );
    println!(
        "all-gathered a step: AdamW {}, pure bf16 {}",
        gathered(&adamw),
        gathered(&any)
    );
    assert_ne!(gathered(&adamw), gathered(&any));
}

/// `gpt-device-bench --device host-twin --model tiny --engine`: after the device trainer's
/// run, the same model through the fsdp engine (`EngineGpt` on the host twin of a device, with
/// the trainer's options: its decay groups, its shards offloaded with --cpu-offload): its
/// median step and its ratio to the device trainer's on a `RESULT` line, and the same losses
/// as printed (4 decimals). What the engine's run does not do as the trainer's is refused.
#[test]
fn the_benchmark_times_the_engine_against_the_device_trainer() {
    for extra in [&[][..], &["--cpu-offload"][..]] {
        let mut args = vec!["--steps", "4", "--engine"];
        args.extend(extra);
        let text = tiny_bench("f32", &args);
        let losses = |line: &str| line.rsplit("loss ").next().unwrap().trim().to_string();
        let trainer = text
            .lines()
            .find(|l| l.starts_with("gpt-device-bench tiny"))
            .unwrap_or_else(|| panic!("{text}"));
        let engine = text
            .lines()
            .find(|l| l.contains("through the fsdp engine"))
            .unwrap_or_else(|| panic!("{text}"));
        assert_eq!(losses(trainer), losses(engine), "{text}");
        assert_eq!(
            engine.contains("shards offloaded"),
            !extra.is_empty(),
            "{text}"
        );
        result_ratio(
            &text,
            "RESULT gpt-device-bench tiny f32 engine: median step",
        );
    }
    for (products, extra, needle) in [
        ("f16", "--steps=1", "--products f16 is not supported"),
        (
            "f32",
            "--wait-each-step",
            "--wait-each-step is not supported",
        ),
        (
            "f32",
            "--optimizer=anyprecision-adamw",
            "--optimizer (AnyPrecisionAdamW)",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpt-device-bench"))
            .args(["--device", "host-twin", "--model", "tiny", "--engine"])
            .args(["--products", products, extra])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(needle), "{err}");
    }
}
