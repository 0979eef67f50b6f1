//! `fsdp train --device`: the device trainer's whole command-line path on the kernels' host
//! twins (the hidden `--device host-twin`, the same code as `--device cuda` over `HostOps`)
//! against `fsdp train --ranks 1` (the sharded engine on the CPU): every step's loss in the
//! two loss logs within 1e-4 relative (issue 16's criterion; the largest difference is
//! printed), once with the defaults and once with clipping, gradient accumulation, the cosine
//! schedule and `--decay-2d-only`; `--save` writes the same weights (within 1e-4 of the
//! model's largest weight); a non-finite step stops (or with `--skip-nonfinite` is skipped)
//! with the engine's error line. And the refusals of `--device cuda`, each one `error:` line:
//! every unsupported option by name, and (without a CUDA driver, as here) no CUDA device, at
//! one rank and at several (`device_sharded_cli.rs` runs several on the host twins).

mod common;

use common::cli::{
    fsdp, log_losses, loss_log_rows, ok, one_error_status_1, s, scratch, small_train_args,
    CLIP_ACCUM_COSINE,
};

#[path = "common/device_compare.rs"]
mod compare;
use compare::{compare, compare_within};

#[test]
fn host_twin_matches_the_engine_at_one_rank() {
    compare("defaults", &[]);
}

#[test]
fn host_twin_matches_the_engine_with_clipping_accumulation_and_schedule() {
    compare("clip_accum_cosine", &CLIP_ACCUM_COSINE);
}

/// torchdistx's AnyPrecisionAdamW (bf16 moments and Kahan compensation by default; then f32
/// state without Kahan, with clipping, accumulation and the cosine schedule) on f32
/// parameters, against the engine's.
#[test]
fn host_twin_matches_the_engine_with_anyprecision_adamw() {
    let mut f32_state = vec![
        "--optimizer",
        "anyprecision-adamw",
        "--optimizer-state-dtype",
        "f32",
        "--kahan-summation",
        "off",
    ];
    f32_state.extend(CLIP_ACCUM_COSINE);
    compare("anyprecision_f32_state", &f32_state);
    // bf16 state: the engine's and the device's gradients differ in their last f32 bits, and
    // a moment or a compensation rounded to bf16 can then round the other way, moving that
    // step's update (at most about lr = 3e-3, Adam's normalised step) by 2⁻⁸ of itself. Two
    // such roundings a step over 20 steps: 2·20·3e-3·2⁻⁸ ≈ 4.7e-4 of a weight, and the
    // largest weight (a layer norm's) is at least 1. The losses stay within 1e-4.
    compare_within(
        "anyprecision",
        &["--optimizer", "anyprecision-adamw"],
        2.0 * 20.0 * 3e-3 / 256.0,
    );
}

/// The device's defaults with AnyPrecisionAdamW: pure bf16 (bf16 parameter values, bf16
/// moments and compensation), said on the run's first lines and planned with its state; the
/// optimizer's options refused with AdamW as the engine refuses them.
#[test]
fn anyprecision_adamw_on_the_device_says_and_plans_its_state() {
    let dir = scratch("device_cli", "anyprecision_says");
    let log = dir.join("log.csv");
    let mut a = small_train_args(&["--batch-size", "8", "--steps", "3"], &[]);
    a.extend([
        "--device",
        "host-twin",
        "--optimizer",
        "anyprecision-adamw",
        "--loss-log",
        s(&log),
    ]);
    let out = ok(
        &fsdp(&a),
        "fsdp train --device host-twin --optimizer anyprecision-adamw",
    );
    assert!(
        out.contains(
            "optimizer: AnyPrecisionAdamW (bf16 parameter values in f32 buffers, bf16 moments, \
             Kahan summation on into a bf16 buffer)"
        ),
        "{out}"
    );
    assert_eq!(log_losses(&log).len(), 3);
    let mut p = vec!["plan"];
    p.extend(&common::cli::SMALL_MODEL);
    p.extend([
        "--batch-size",
        "8",
        "--device",
        "host-twin",
        "--optimizer",
        "anyprecision-adamw",
        "--kahan-summation",
        "off",
    ]);
    let plan = ok(
        &fsdp(&p),
        "fsdp plan --device host-twin --optimizer anyprecision-adamw",
    );
    assert!(plan.contains("(AnyPrecisionAdamW, bf16)"), "{plan}");
    assert!(!plan.contains("compensation"), "no Kahan: {plan}");
    let mut b = small_train_args(&["--steps", "2", "--device", "host-twin"], &[]);
    b.extend(["--kahan-summation", "on"]);
    one_error_status_1(
        &fsdp(&b),
        &["--kahan-summation applies only to --optimizer anyprecision-adamw"],
    );
}

#[test]
fn device_cuda_refuses_unsupported_options() {
    let run = |extra: &[&str]| {
        let mut a = small_train_args(&["--steps", "2", "--device", "cuda"], extra);
        a.push("--batch-size");
        a.push("4");
        fsdp(&a)
    };
    one_error_status_1(
        &run(&["--reduce-dtype", "bf16"]),
        &[
            "--device cuda",
            "--reduce-dtype bf16",
            "f32 only",
            "one rank reduces nothing",
        ],
    );
    let dir = scratch("device_cli", "refusals");
    let log = dir.join("log.csv");
    // Each with why.
    let cases: [(&[&str], &str, &str); 4] = [
        (
            &["--strategy", "no-shard"],
            "--strategy",
            "one rank shards nothing",
        ),
        (&["--backend", "tcp"], "--backend", "without a backend"),
        (
            &["--forward-prefetch"],
            "--forward-prefetch",
            "one rank shards nothing",
        ),
        (
            &["--ranks", "2", "--forward-prefetch"],
            "--forward-prefetch",
            "nothing to overlap",
        ),
    ];
    for (extra, name, why) in cases {
        let mut with_log = extra.to_vec();
        with_log.extend(["--loss-log", s(&log)]);
        let line = one_error_status_1(
            &run(&with_log),
            &["--device cuda", name, "not supported", why],
        );
        assert!(!line.contains("no CUDA device"), "{line}");
    }
    // A size policy that splits the tied `wte` from `lm_head` is the wrap policy's error, as
    // on the engine.
    let line = one_error_status_1(
        &run(&["--wrap", "size:100", "--loss-log", s(&log)]),
        &["lm_head.weight", "transformer.wte.weight"],
    );
    let engine = small_train_args(
        &["--steps", "2", "--batch-size", "4"],
        &["--wrap", "size:100"],
    );
    assert_eq!(
        one_error_status_1(&fsdp(&engine), &["lm_head.weight"]),
        line
    );
    // Refused before anything was written.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

#[test]
fn host_twin_refuses_alloc_conf() {
    let a = small_train_args(
        &["--steps", "2", "--batch-size", "4", "--device", "host-twin"],
        &["--alloc-conf", "expandable_segments:True"],
    );
    one_error_status_1(
        &fsdp(&a),
        &[
            "--device host-twin",
            "--alloc-conf",
            "not supported",
            "--device cuda",
        ],
    );
}

#[test]
fn device_cuda_without_a_driver_is_one_error() {
    if let Ok(n) = fsdp_device::cuda::device_count() {
        println!("skipped: a CUDA driver is present ({n} devices): tests/gpu_device_train.rs");
        return;
    }
    for dev in ["cuda", "cuda:1"] {
        for ranks in ["1", "2"] {
            let a = small_train_args(
                &["--steps", "2", "--batch-size", "4", "--device", dev],
                &["--ranks", ranks],
            );
            one_error_status_1(&fsdp(&a), &[&format!("--device {dev}: no CUDA device (")]);
        }
    }
    // A bad spelling is clap's error.
    let a = small_train_args(&["--device", "gpu"], &[]);
    let out = fsdp(&a);
    assert_eq!(out.status.code(), Some(2));
    assert!(common::cli::text(&out.stderr).contains("expected cpu, cuda or cuda:N"));
}

#[test]
fn host_twin_stops_and_skips_non_finite_steps_as_the_engine() {
    common::cli::nonfinite_stops_and_skips_as_the_engine(&["--ranks", "1"], &[]);
}

/// `--param-dtype bf16` on the device: products of bf16-rounded operands with f32 sums, every
/// other layer in f32 (host twins here). Bound, derived: each operand carries a relative
/// rounding of at most 2⁻⁸, so each product term at most about 2⁻⁷; the loss averages many
/// such terms of both signs, so its relative change stays far below that. 20 steps must stay
/// within 1e-2 relative of the f32 engine's losses (measured: printed), and the rounding must
/// show (some step differs by more than 1e-6), else the option would be ignored.
#[test]
fn host_twin_bf16_products_track_the_f32_run() {
    let dir = scratch("device_cli", "bf16_products");
    let (cpu, twin) = (dir.join("cpu.csv"), dir.join("twin.csv"));
    let base = ["--batch-size", "8", "--steps", "20"];
    let mut a = small_train_args(&base, &[]);
    a.extend(["--ranks", "1", "--loss-log", s(&cpu)]);
    ok(&fsdp(&a), "fsdp train --ranks 1");
    let mut b = small_train_args(&base, &[]);
    b.extend([
        "--device",
        "host-twin",
        "--param-dtype",
        "bf16",
        "--loss-log",
        s(&twin),
    ]);
    let out = ok(
        &fsdp(&b),
        "fsdp train --device host-twin --param-dtype bf16",
    );
    assert!(out.contains("products: bf16 operands"), "{out}");
    let (e, d) = (log_losses(&cpu), log_losses(&twin));
    assert_eq!((e.len(), d.len()), (20, 20));
    let rel: Vec<f64> = e
        .iter()
        .zip(&d)
        .map(|(a, b)| (b - a).abs() / a.abs())
        .collect();
    let max = rel.iter().copied().fold(0.0, f64::max);
    println!("bf16 products: max relative loss difference {max:.2e} over 20 steps");
    assert!(max <= 1e-2, "{rel:?}");
    assert!(
        max > 1e-6,
        "bf16 rounding left every loss unchanged: {rel:?}"
    );
    assert!(d[19] < d[0] - 0.1, "the loss must fall: {d:?}");
    // bf16 is the device's default `--param-dtype` (torchtitan's recipes): the same run.
    let default_log = dir.join("default.csv");
    let mut c = small_train_args(&base, &[]);
    c.extend(["--device", "host-twin", "--loss-log", s(&default_log)]);
    let out = ok(&fsdp(&c), "fsdp train --device host-twin");
    assert!(out.contains("products: bf16 operands"), "{out}");
    assert_eq!(log_losses(&default_log), d);
    // `--param-dtype f16`: f16 operands (2⁻¹¹ a rounding: closer still), with the grad scaler
    // on by default; `--init-scale 16777216` overflows the f16 operands of the first steps,
    // which the scaler skips (not counted against --skip-nonfinite 0) and backs off from.
    let f16_log = dir.join("f16.csv");
    let mut f = small_train_args(&base, &[]);
    f.extend(["--device", "host-twin", "--param-dtype", "f16"]);
    f.extend(["--loss-log", s(&f16_log), "--skip-nonfinite", "0"]);
    let out = ok(&fsdp(&f), "fsdp train --device host-twin --param-dtype f16");
    assert!(out.contains("products: f16 operands"), "{out}");
    assert!(
        out.contains("grad scaler: final scale 65536, 0 overflowing"),
        "{out}"
    );
    let h = log_losses(&f16_log);
    let rel16 = e
        .iter()
        .zip(&h)
        .map(|(a, b)| (b - a).abs() / a.abs())
        .fold(0.0, f64::max);
    println!("f16 products: max relative loss difference {rel16:.2e} over 20 steps");
    assert!(rel16 > 0.0 && rel16 < max, "f16 {rel16:e}, bf16 {max:e}");
    f.extend(["--init-scale", "16777216"]);
    let out = ok(&fsdp(&f), "--param-dtype f16 --init-scale 16777216");
    let skipped = out
        .lines()
        .find_map(|l| l.strip_prefix("grad scaler: final scale "))
        .and_then(|l| l.split(", ").nth(1))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse::<u32>().ok())
        .unwrap_or_else(|| panic!("no scaler line: {out}"));
    assert!(skipped > 0, "{out}");
}

/// `fsdp plan --device host-twin` (the device trainer's predicted memory) against `fsdp train
/// --device host-twin --loss-log` of the same options (its counted memory): the plan's peak is
/// the loss log's peak column after the last step (never exceeded before) and the final line's
/// measured peak, exactly; with f32 products and one micro-batch, and with bf16 products, two
/// micro-batches and clipping. And `fsdp plan --device cuda` refuses other worlds with
/// `fsdp train`'s line.
/// `--attention fused` (flash attention's algorithm on the host twins of its kernels) against
/// the default chunked attention, both with bf16 products: the two round the probabilities
/// and the scores' gradient to bf16 at different points (2⁻⁹ relative each), which moves a
/// loss far less than the products' own rounding does against f32 (bounded by 1e-2 in
/// `host_twin_bf16_products_track_the_f32_run`): 20 steps within 1e-2 relative, some step
/// different (else the option would be ignored), the loss falling; two ranks as threads
/// (`FULL_SHARD`) within 1e-4 of one. f32 products are refused by name.
#[test]
fn host_twin_fused_attention_tracks_the_chunked_run() {
    let dir = scratch("device_cli", "fused_attention");
    let base = ["--batch-size", "8", "--steps", "20"];
    let run = |name: &str, extra: &[&str]| {
        let log = dir.join(format!("{name}.csv"));
        let mut a = small_train_args(&base, extra);
        a.extend(["--device", "host-twin", "--loss-log", s(&log)]);
        let out = ok(
            &fsdp(&a),
            &format!("fsdp train --device host-twin {extra:?}"),
        );
        (log_losses(&log), out)
    };
    let (chunked, _) = run("chunked", &[]);
    let (fused, out) = run("fused", &["--attention", "fused"]);
    assert!(out.contains("attention: fused"), "{out}");
    let rel = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(a, b)| (b - a).abs() / a.abs())
            .fold(0.0, f64::max)
    };
    let max = rel(&chunked, &fused);
    println!("fused attention: max relative loss difference {max:.2e} over 20 steps");
    assert!(max <= 1e-2 && max > 0.0, "{chunked:?}\n{fused:?}");
    assert!(fused[19] < fused[0] - 0.1, "the loss must fall: {fused:?}");
    let (two, _) = run("two", &["--attention", "fused", "--ranks", "2"]);
    let max2 = rel(&fused, &two);
    println!("fused attention, 2 ranks against 1: {max2:.2e}");
    assert!(max2 <= 1e-4, "{fused:?}\n{two:?}");
    let mut f32_run = small_train_args(&["--steps", "2", "--device", "host-twin"], &[]);
    f32_run.extend(["--attention", "fused", "--param-dtype", "f32"]);
    one_error_status_1(
        &fsdp(&f32_run),
        &["--attention fused", "bf16 or f16", "not f32"],
    );
}

#[test]
fn device_plan_predicts_the_peak_the_run_logs() {
    let dir = scratch("device_cli", "device_plan");
    let cases: [&[&str]; 6] = [
        &[],
        &[
            "--param-dtype",
            "bf16",
            "--grad-accum",
            "2",
            "--grad-clip",
            "0.5",
        ],
        &["--activation-checkpointing"],
        &["--attention", "materialized"],
        &["--logits", "whole"],
        &["--attention", "fused"],
    ];
    let mut losses = Vec::new();
    for (i, extra) in cases.into_iter().enumerate() {
        let mut p = vec!["plan"];
        p.extend_from_slice(&common::cli::SMALL_MODEL);
        p.extend(["--batch-size", "8", "--device", "host-twin"]);
        p.extend_from_slice(extra);
        let plan = ok(&fsdp(&p), "fsdp plan --device host-twin");
        let peak: u64 = plan
            .lines()
            .find_map(|l| l.strip_prefix("peak: "))
            .and_then(|l| l.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no peak line: {plan}"));
        for part in ["parameters", "exp_avg_sq", "activations", "bf16 operands"] {
            assert!(plan.contains(part), "{part}: {plan}");
        }
        let log = dir.join(format!("log{i}.csv"));
        let mut t = small_train_args(&["--batch-size", "8", "--steps", "3"], extra);
        t.extend(["--device", "host-twin", "--loss-log", s(&log)]);
        let out = ok(&fsdp(&t), "fsdp train --device host-twin");
        let text = std::fs::read_to_string(&log).unwrap();
        let peaks: Vec<u64> = loss_log_rows(&text)
            .iter()
            .map(|f| f[3].parse().unwrap())
            .collect();
        assert_eq!(peaks.len(), 3);
        assert!(
            peaks.iter().all(|&b| b > 0 && b <= peak),
            "{peaks:?} vs {peak}"
        );
        assert_eq!(
            peaks[2], peak,
            "{extra:?}: logged {peaks:?}, planned {peak}\n{plan}"
        );
        let line = format!("peak device memory {peak} bytes (predicted {peak}");
        assert!(out.contains(&line), "{out}");
        println!("{extra:?}: peak {peak} bytes, planned and logged");
        let loss: Vec<String> = loss_log_rows(&text)
            .iter()
            .map(|f| f[1].to_string())
            .collect();
        losses.push((loss, peak, plan, out));
    }
    // Activation checkpointing: the same losses as the first case, a lower peak.
    assert_eq!(
        losses[2].0, losses[0].0,
        "losses with --activation-checkpointing"
    );
    assert!(
        losses[2].1 < losses[0].1,
        "peaks {} vs {}",
        losses[2].1,
        losses[0].1
    );
    assert!(
        losses[2].2.contains("activation checkpointing"),
        "{}",
        losses[2].2
    );
    let first = |i: usize| &losses[i].3;
    assert!(
        first(0).contains(
            "attention: chunked (64 MiB), the probabilities computed again in backward; \
             logits: chunked (256 MiB)"
        ),
        "{}",
        first(0)
    );
    assert!(first(3).contains("attention: materialized"), "{}", first(3));
    assert!(first(4).contains("logits: whole"), "{}", first(4));
    // The attention's probabilities kept: the same losses, bitwise, as the default chunks
    // (which compute them again in backward); each plan names its attention.
    assert_eq!(
        losses[3].0, losses[0].0,
        "losses with --attention materialized"
    );
    assert!(
        losses[0].2.contains("attention: chunked (64 MiB)"),
        "{}",
        losses[0].2
    );
    assert!(
        losses[3].2.contains("attention: materialized"),
        "{}",
        losses[3].2
    );
    // The logits whole: the same losses (the test model's logits are one chunk anyway).
    assert_eq!(losses[4].0, losses[0].0, "losses with --logits whole");
    assert!(
        losses[0].2.contains("logits: chunked (256 MiB)"),
        "{}",
        losses[0].2
    );
    assert!(losses[4].2.contains("logits: whole"), "{}", losses[4].2);
    // Only the device's GPT has them.
    for cmd in ["train", "plan"] {
        for (option, value) in [("--attention", "chunked"), ("--logits", "whole")] {
            let mut a = vec![cmd, option, value];
            a.extend_from_slice(&common::cli::SMALL_MODEL);
            one_error_status_1(&fsdp(&a), &[option, "only with --device"]);
        }
    }
    // Several ranks: one rank's plan (tests/device_sharded_cli.rs holds it to the run's peak).
    let mut a = vec!["plan"];
    a.extend_from_slice(&common::cli::SMALL_MODEL);
    a.extend(["--device", "cuda", "--ranks", "2", "--batch-size", "4"]);
    let out = ok(&fsdp(&a), "fsdp plan --device cuda --ranks 2");
    assert!(out.contains("per rank, 2 ranks, FullShard"), "{out}");
    // f16 parameters: products of f16 operands, planned as bf16's (2 bytes an operand).
    let mut a = vec!["plan", "--device", "cuda", "--param-dtype", "f16"];
    a.extend_from_slice(&common::cli::SMALL_MODEL);
    let out = ok(&fsdp(&a), "fsdp plan --device cuda --param-dtype f16");
    assert!(out.contains("f16-operand products"), "{out}");
    // The sharded engine's options, given, are refused by name as `fsdp train` refuses them.
    let mut a = vec!["plan", "--device", "cuda", "--strategy", "shard-grad-op"];
    a.extend_from_slice(&common::cli::SMALL_MODEL);
    one_error_status_1(&fsdp(&a), &["--device cuda", "--strategy", "not supported"]);
    // The wrap policy decides what several ranks hold: the root alone (`size:30000`, more
    // than the model's 28,032 elements) holds every parameter throughout, above the blocks'.
    let peak = |wrap: &str, units: &[&str]| -> u64 {
        let mut a = vec!["plan", "--device", "cuda", "--ranks", "2", "--wrap", wrap];
        a.extend_from_slice(&common::cli::SMALL_MODEL);
        let out = ok(&fsdp(&a), "fsdp plan --device cuda --ranks 2 --wrap");
        // The units it lists, each with its elements and span.
        let listed: Vec<String> = out
            .lines()
            .skip_while(|l| !l.starts_with("units: "))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(listed, units, "{out}");
        let line = out.lines().find(|l| l.starts_with("peak: ")).unwrap();
        let bytes = line.trim_start_matches("peak: ").split(' ').next().unwrap();
        bytes.parse().unwrap()
    };
    let block = peak(
        "block",
        &[
            "(root) 2624 the whole pass",
            "transformer.h.0 12704 block 0",
            "transformer.h.1 12704 block 1",
        ],
    );
    let root = peak("size:30000", &["(root) 28032 the whole pass"]);
    assert!(root > block, "root alone {root} vs blocks {block}");
}

/// `--cpu-offload` on the device (host twins): the same losses, bitwise, as without it; `fsdp
/// plan --cpu-offload` shows the state moved to the host and predicts the lower peak the run
/// logs; on `--device cpu` the option is refused.
#[test]
fn cpu_offload_trains_as_without_it_and_plans_its_memory() {
    let dir = scratch("device_cli", "cpu_offload");
    let model = common::cli::SMALL_MODEL;
    let mut peaks = Vec::new();
    let mut logs = Vec::new();
    for (i, offload) in [&[][..], &["--cpu-offload"][..]].into_iter().enumerate() {
        let log = dir.join(format!("run{i}.csv"));
        let mut t: Vec<&str> = vec!["train", "--steps", "4", "--batch-size", "4"];
        t.extend(model);
        t.extend(offload);
        t.extend([
            "--device",
            "host-twin",
            "--grad-clip",
            "0.001",
            "--loss-log",
            s(&log),
        ]);
        let out = ok(&fsdp(&t), "fsdp train --device host-twin");
        assert_eq!(out.contains("CPU offload"), !offload.is_empty(), "{out}");
        let mut p: Vec<&str> = vec!["plan", "--batch-size", "4"];
        p.extend(model);
        p.extend(offload);
        p.extend(["--device", "host-twin", "--grad-clip", "0.001"]);
        let plan = ok(&fsdp(&p), "fsdp plan --device host-twin");
        assert_eq!(
            plan.contains("offloaded to host"),
            !offload.is_empty(),
            "{plan}"
        );
        let predicted: u64 = plan
            .split("peak: ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no peak in:\n{plan}"));
        let logged: u64 = std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .last()
            .and_then(|l| l.split(',').nth(3))
            .and_then(|v| v.trim().parse().ok())
            .unwrap();
        assert_eq!(logged, predicted, "offload {offload:?}");
        peaks.push(predicted);
        logs.push(log_losses(&log));
    }
    assert_eq!(logs[0], logs[1], "losses differ with --cpu-offload");
    assert!(peaks[1] < peaks[0], "{peaks:?}");
    let mut a = small_train_args(&["--steps", "1"], &[]);
    a.push("--cpu-offload");
    let out = fsdp(&a);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--cpu-offload: only with --device cuda"),
        "{err}"
    );
}
