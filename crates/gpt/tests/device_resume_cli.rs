//! `fsdp train --device` with `--checkpoint-dir`, `--checkpoint-every` and `--resume`, on the
//! kernels' host twins (the hidden `--device host-twin`, the same code as `--device cuda`): a
//! run resumed from its own checkpoint logs bitwise the losses of the run that never stopped
//! and saves the same weights; the device's checkpoints are the engine's format, so the engine
//! resumes from them (at 2 ranks) and the device from the engine's, each continuing the other's
//! losses within issue 16's 1e-4; two ranks on the device (`--ranks 2`) resume bitwise too, and
//! cross with the engine at another world; two ranks as processes under `fsdp launch` (with
//! prefetch and CPU offload) resume bitwise, under the launcher or as threads. And the
//! device's admission: a run whose planned peak exceeds `--memory-limit` (on a GPU: its free
//! memory) is refused before it starts, naming both figures; `fsdp plan --device
//! --memory-limit` gives the same verdict.

mod common;

use std::path::Path;

use common::cli::{fsdp, log_losses, ok, s, scratch, small_train_args, CLIP_ACCUM_COSINE};

const BOUND: f64 = 1e-4;

/// The first run: 6 steps with checkpoints after steps 3 and 6 in `ck`, the loss log `log`;
/// `on` says where (`--device host-twin --param-dtype f32`, or `--ranks 1`). The checkpoint of
/// step 6 is removed, so that a resume starts at step 3.
fn first_run(on: &[&str], ck: &Path, log: &Path, weights: &Path) {
    let base = ["--batch-size", "8", "--steps", "6"];
    let mut a = small_train_args(&base, &CLIP_ACCUM_COSINE);
    a.extend(on);
    a.extend(["--checkpoint-dir", s(ck), "--checkpoint-every", "3"]);
    a.extend(["--loss-log", s(log), "--save", s(weights)]);
    ok(&fsdp(&a), "the first run");
    for k in [3, 6] {
        assert!(
            ck.join(format!("step-{k}")).is_dir(),
            "no step-{k} in {ck:?}"
        );
    }
    std::fs::remove_dir_all(ck.join("step-6")).unwrap();
}

/// Resumes from `ck` where `on` says, the loss log continuing a copy of `log` in `log2`.
fn resume(on: &[&str], ck: &Path, log: &Path, log2: &Path, weights: &Path) -> String {
    std::fs::copy(log, log2).unwrap();
    let mut b = vec!["train", "--resume", s(ck)];
    b.extend(on);
    b.extend(["--loss-log", s(log2), "--save", s(weights)]);
    let out = ok(&fsdp(&b), "the resumed run");
    assert!(out.contains("resuming from"), "{out}");
    assert!(out.contains("at step 3 of 6"), "{out}");
    out
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs())
        .fold(0.0, f64::max)
}

#[test]
fn host_twin_resumes_bitwise_from_its_checkpoint() {
    let dir = scratch("device_resume_cli", "own");
    let (ck, log, log2) = (dir.join("ck"), dir.join("log.csv"), dir.join("log2.csv"));
    let (wa, wb) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    let twin = ["--device", "host-twin", "--param-dtype", "f32"];
    first_run(&twin, &ck, &log, &wa);
    resume(&["--device", "host-twin"], &ck, &log, &log2, &wb);
    let (a, b) = (log_losses(&log), log_losses(&log2));
    assert_eq!(a.len(), 6);
    assert_eq!(a, b, "the resumed run's losses");
    let cfg = fsdp_gpt::model::GptConfig::new(2, 2, 32, 16, 64).unwrap();
    let load = |p: &Path| fsdp_gpt::checkpoint::load_full(p, &cfg).unwrap();
    assert_eq!(load(&wa), load(&wb), "the final weights");
}

/// With the grad scaler on (`--grad-scaler on --init-scale 1024 --growth-interval 2`, one rank
/// and two as threads): the checkpoint holds the scaler's state, the resumed run continues it
/// (the same final scale, 1024 grown 3 times in 6 steps), and the losses are bitwise those of
/// the run without a scaler (a power-of-two scale changes no bit).
#[test]
fn host_twin_resumes_its_grad_scaler() {
    let scaler = [
        "--grad-scaler",
        "on",
        "--init-scale",
        "1024",
        "--growth-interval",
        "2",
    ];
    for ranks in ["1", "2"] {
        let dir = scratch("device_resume_cli", &format!("scaler{ranks}"));
        let (ck, log, log2) = (dir.join("ck"), dir.join("log.csv"), dir.join("log2.csv"));
        let (wa, wb) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
        let mut twin = vec![
            "--device",
            "host-twin",
            "--param-dtype",
            "f32",
            "--ranks",
            ranks,
        ];
        let plain_log = dir.join("plain.csv");
        let base = ["--batch-size", "8", "--steps", "6"];
        let mut p = small_train_args(&base, &CLIP_ACCUM_COSINE);
        p.extend(&twin);
        p.extend(["--loss-log", s(&plain_log)]);
        let out = ok(&fsdp(&p), "the run without a scaler");
        assert!(!out.contains("grad scaler"), "{out}");
        twin.extend(scaler);
        first_run(&twin, &ck, &log, &wa);
        let saved = std::fs::read_to_string(ck.join("step-3").join("grad_scaler.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&saved).unwrap();
        // Steps 0..3: grown once (after step 2), one step since.
        assert_eq!(
            (v["scale"].as_f64(), v["growth_tracker"].as_u64()),
            (Some(2048.0), Some(1))
        );
        let out = resume(&["--device", "host-twin"], &ck, &log, &log2, &wb);
        assert!(
            out.contains("grad scaler: final scale 8192, 0 overflowing"),
            "{out}"
        );
        let (a, b) = (log_losses(&log), log_losses(&log2));
        assert_eq!(a, b, "ranks {ranks}: the resumed run's losses");
        assert_eq!(
            a,
            log_losses(&plain_log),
            "ranks {ranks}: the losses without a scaler"
        );
    }
}

/// Two ranks as threads on the device (`--ranks 2 --strategy full-shard`): the resumed run
/// (ranks and strategy from the checkpoint's run record) logs bitwise the losses of the run
/// that never stopped and saves the same weights.
#[test]
fn sharded_host_twin_resumes_bitwise_from_its_checkpoint() {
    let dir = scratch("device_resume_cli", "sharded");
    let (ck, log, log2) = (dir.join("ck"), dir.join("log.csv"), dir.join("log2.csv"));
    let (wa, wb) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    let twin = [
        "--device",
        "host-twin",
        "--param-dtype",
        "f32",
        "--ranks",
        "2",
        "--strategy",
        "full-shard",
    ];
    first_run(&twin, &ck, &log, &wa);
    let out = resume(&["--device", "host-twin"], &ck, &log, &log2, &wb);
    assert!(out.contains("2 ranks on host-twin"), "{out}");
    let (a, b) = (log_losses(&log), log_losses(&log2));
    assert_eq!(a.len(), 6);
    assert_eq!(a, b, "the resumed run's losses");
    let cfg = fsdp_gpt::model::GptConfig::new(2, 2, 32, 16, 64).unwrap();
    let load = |p: &Path| fsdp_gpt::checkpoint::load_full(p, &cfg).unwrap();
    assert_eq!(load(&wa), load(&wb), "the final weights");
}

#[test]
fn engine_and_device_resume_from_each_others_checkpoints() {
    let dir = scratch("device_resume_cli", "cross");
    let twin = ["--device", "host-twin", "--param-dtype", "f32"];
    let twin2 = [
        "--device",
        "host-twin",
        "--param-dtype",
        "f32",
        "--ranks",
        "2",
    ];
    let cases: [(&str, &[&str], &[&str]); 4] = [
        ("device then engine at 2 ranks", &twin, &["--ranks", "2"]),
        (
            "device at 2 ranks then engine at 4",
            &twin2,
            &["--ranks", "4", "--param-dtype", "f32"],
        ),
        (
            "engine at 4 ranks then device at 2",
            &["--ranks", "4", "--param-dtype", "f32"],
            &["--device", "host-twin", "--ranks", "2"],
        ),
        (
            "engine then device",
            &["--ranks", "1"],
            &["--device", "host-twin"],
        ),
    ];
    cross(&dir, &cases);
}

/// `AnyPrecisionAdamW` (bf16 moments and Kahan compensation, f32 parameters): the engine's
/// checkpoint resumed on the device at 2 ranks, the device's at 2 ranks by the engine at one,
/// each continuing the other's losses within 1e-4 (the state is written widened to f32 and
/// read back exactly; the resumed run takes the optimizer from the checkpoint's record).
#[test]
fn anyprecision_adamw_checkpoints_cross_between_engine_and_device() {
    let dir = scratch("device_resume_cli", "cross_anyprecision");
    let any = ["--optimizer", "anyprecision-adamw"];
    let cases: [(&str, &[&str], &[&str]); 2] = [
        (
            "engine then device at 2 ranks",
            &["--ranks", "1", any[0], any[1]],
            &["--device", "host-twin", "--ranks", "2"],
        ),
        (
            "device at 2 ranks then engine",
            &[
                "--device",
                "host-twin",
                "--param-dtype",
                "f32",
                "--ranks",
                "2",
                any[0],
                any[1],
            ],
            &["--ranks", "1"],
        ),
    ];
    cross(&dir, &cases);
}

/// Each case: the first run where its first options say, resumed from its step-3 checkpoint
/// where its second say; the resumed losses within [`BOUND`] of the first run's.
fn cross(dir: &Path, cases: &[(&str, &[&str], &[&str])]) {
    for &(name, first, then) in cases {
        let sub = dir.join(name.replace(' ', "-"));
        std::fs::create_dir_all(&sub).unwrap();
        let (ck, log, log2) = (sub.join("ck"), sub.join("log.csv"), sub.join("log2.csv"));
        let (wa, wb) = (sub.join("a.safetensors"), sub.join("b.safetensors"));
        first_run(first, &ck, &log, &wa);
        resume(then, &ck, &log, &log2, &wb);
        let (a, b) = (log_losses(&log), log_losses(&log2));
        assert_eq!((a.len(), b.len()), (6, 6), "{name}");
        assert_eq!(a[..3], b[..3], "{name}: the kept lines");
        let r = max_rel(&b[3..], &a[3..]);
        assert!(
            r <= BOUND,
            "{name}: {:?} vs {:?} ({r:.2e})",
            &b[3..],
            &a[3..]
        );
        println!(
            "{name}: steps 3-5 {:?} within {r:.2e} of the first run's {:?}",
            &b[3..],
            &a[3..]
        );
    }
}

#[test]
fn device_runs_above_the_memory_limit_are_refused_before_they_start() {
    let dir = scratch("device_resume_cli", "admission");
    let log = dir.join("log.csv");
    let base = ["--batch-size", "8", "--steps", "2"];
    let mut a = small_train_args(&base, &["--device", "host-twin"]);
    a.extend(["--memory-limit", "512K", "--loss-log", s(&log)]);
    let line = common::cli::one_error_status_1(
        &fsdp(&a),
        &[
            "--device host-twin: the run needs",
            "of device memory at its peak (fsdp plan --device host-twin), 512.0 KiB is \
             --memory-limit",
            "--activation-checkpointing",
        ],
    );
    assert!(!log.exists(), "nothing starts: {line}");
    let mut b = small_train_args(&base, &["--device", "host-twin"]);
    b.extend(["--memory-limit", "1G"]);
    ok(&fsdp(&b), "within the limit");
    // The plan gives the same verdicts.
    let plan = |limit: &str| {
        let mut p = vec!["plan"];
        p.extend(&common::cli::SMALL_MODEL);
        p.extend([
            "--batch-size",
            "8",
            "--device",
            "host-twin",
            "--memory-limit",
            limit,
        ]);
        ok(&fsdp(&p), "fsdp plan --device host-twin")
    };
    assert!(plan("512K").contains("exceeds: `fsdp train --device` refuses it, as --memory-limit"));
    assert!(plan("1G").contains("fits within --memory-limit 1.0 GiB"));
}

/// Two ranks as processes (`fsdp launch … --device host-twin`: `StagedComm` over TCP, with
/// prefetch and CPU offload): rank 0 writes the checkpoints, and the run resumed under the
/// launcher logs bitwise the losses of the run that never stopped and saves the same
/// weights; so does the run resumed as two threads from the processes' checkpoint.
#[test]
fn launched_processes_resume_bitwise_from_their_checkpoint() {
    let dir = scratch("device_resume_cli", "launched");
    let (ck, log) = (dir.join("ck"), dir.join("log.csv"));
    let wa = dir.join("a.safetensors");
    let launch = ["launch", "--nproc-per-node", "2", "--master-port", "0"];
    let twin = [
        "--device",
        "host-twin",
        "--param-dtype",
        "f32",
        "--strategy",
        "full-shard",
        "--forward-prefetch",
        "--cpu-offload",
    ];
    let mut a = launch.to_vec();
    a.extend(small_train_args(
        &["--batch-size", "8", "--steps", "6"],
        &CLIP_ACCUM_COSINE,
    ));
    a.extend(twin);
    a.extend(["--checkpoint-dir", s(&ck), "--checkpoint-every", "3"]);
    a.extend(["--loss-log", s(&log), "--save", s(&wa)]);
    ok(&fsdp(&a), "the first run");
    std::fs::remove_dir_all(ck.join("step-6")).unwrap();
    let cfg = fsdp_gpt::model::GptConfig::new(2, 2, 32, 16, 64).unwrap();
    let load = |p: &Path| fsdp_gpt::checkpoint::load_full(p, &cfg).unwrap();
    let losses = log_losses(&log);
    assert_eq!(losses.len(), 6);
    for (name, prefix, on) in [
        (
            "processes",
            &launch[..],
            &[
                "--device",
                "host-twin",
                "--forward-prefetch",
                "--cpu-offload",
            ][..],
        ),
        (
            "threads",
            &[][..],
            &["--device", "host-twin", "--cpu-offload"][..],
        ),
    ] {
        let (log2, wb) = (
            dir.join(format!("{name}.csv")),
            dir.join(format!("{name}.safetensors")),
        );
        // The resumed run writes step 6's checkpoint again: each resume starts at step 3.
        let _ = std::fs::remove_dir_all(ck.join("step-6"));
        std::fs::copy(&log, &log2).unwrap();
        let mut b = prefix.to_vec();
        b.extend(["train", "--resume", s(&ck)]);
        b.extend(on);
        b.extend(["--loss-log", s(&log2), "--save", s(&wb)]);
        let out = ok(&fsdp(&b), name);
        assert!(out.contains("at step 3 of 6"), "{name}: {out}");
        assert_eq!(
            log_losses(&log2),
            losses,
            "{name}: the resumed run's losses"
        );
        assert_eq!(load(&wb), load(&wa), "{name}: the final weights");
    }
}
