//! `fsdp train --optimizer anyprecision-adamw` and `fsdp plan` with it, run as a process:
//! torchdistx's AnyPrecisionAdamW with the shards stored in `--param-dtype` (bf16: pure-bf16
//! training, no f32 master weights), its moments and Kahan compensation in
//! `--optimizer-state-dtype`. A pure-bf16 run trains and its replicas agree bitwise; the plan's
//! optimizer state is 6/8 of AdamW's (8 bytes of sharded state per parameter against 12); a
//! checkpointed run resumes bitwise, and resuming with another optimizer is an error naming
//! both; bad combinations are one error line each.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::cli::{
    checkpointing_args, fsdp, loss_column, ok, one_error, one_error_status_1, read_losses, resume,
    resume_paths, s, small_train_args, TWO_RANKS,
};

/// The pure-bf16 configuration.
const PURE_BF16: [&str; 4] = ["--optimizer", "anyprecision-adamw", "--param-dtype", "bf16"];

/// A fresh directory of its own for each test.
fn dir(test: &str) -> PathBuf {
    common::cli::scratch("any_precision_cli", test)
}

/// `fsdp train SMALL_MODEL TWO_RANKS PURE_BF16 extra`.
fn train(extra: &[&str]) -> Output {
    let mut config = TWO_RANKS.to_vec();
    config.extend_from_slice(&PURE_BF16);
    fsdp(&small_train_args(&config, extra))
}

/// The per-rank rows of the summary's table, without the rank column.
fn summary_rows(stdout: &str) -> Vec<Vec<&str>> {
    stdout
        .lines()
        .skip_while(|l| !l.starts_with("rank  peak allocated"))
        .skip(1)
        .take_while(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().skip(1).collect())
        .collect()
}

/// Every tensor of a safetensors file, as raw bytes by name.
fn tensors(path: &Path) -> BTreeMap<String, Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| (name, v.data().to_vec()))
        .collect()
}

#[test]
fn pure_bf16_trains_and_the_ranks_agree() {
    let d = dir("trains");
    let log = d.join("log.csv");
    let out = train(&["--steps", "20", "--loss-log", s(&log)]);
    let stdout = ok(&out, "the pure-bf16 run");
    assert!(
        stdout.contains(
            "optimizer: AnyPrecisionAdamW (bf16 shards, bf16 moments, Kahan summation on into a \
             bf16 buffer); sharded state: 8 bytes per parameter (parameter 2 + optimizer 6)"
        ),
        "{stdout}"
    );
    let losses = read_losses(&log);
    assert_eq!(losses.len(), 20);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    let last5 = losses[15..].iter().sum::<f64>() / 5.0;
    assert!(
        last5 < losses[0] - 0.3,
        "the loss does not decrease: {losses:?}"
    );
    // Both ranks report the same memory and traffic.
    let rows = summary_rows(&stdout);
    assert_eq!(rows.len(), 2, "{stdout}");
    assert_eq!(rows[0], rows[1], "{stdout}");
    // The plan of the same options predicts that peak (bf16 shards included).
    let mut plan_args = vec!["plan"];
    plan_args.extend_from_slice(&common::cli::SMALL_MODEL);
    plan_args.extend_from_slice(&TWO_RANKS);
    plan_args.extend_from_slice(&PURE_BF16);
    let planned = ok(&fsdp(&plan_args), "fsdp plan");
    let row: Vec<&str> = planned
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("ranks  sharded state"))
        .nth(1)
        .unwrap_or_else(|| panic!("{planned}"))
        .split_whitespace()
        .collect();
    assert_eq!(
        row[7..9],
        rows[0][0..2],
        "planned vs measured peak: {planned}\n{stdout}"
    );

    // Replicas (NO_SHARD: every rank holds every parameter) stay bitwise equal: the bf16
    // parameters, both bf16 moments and the Kahan compensation of rank 0's checkpoint file
    // are rank 1's.
    let ck = d.join("ck");
    ok(
        &train(&[
            "--strategy",
            "no-shard",
            "--steps",
            "6",
            "--checkpoint-dir",
            s(&ck),
            "--checkpoint-every",
            "6",
        ]),
        "the replicated run",
    );
    let step = ck.join("step-6");
    let (r0, r1) = (
        tensors(&step.join("rank-00000-of-00002.safetensors")),
        tensors(&step.join("rank-00001-of-00002.safetensors")),
    );
    for kind in ["param", "exp_avg", "exp_avg_sq", "compensation"] {
        assert!(
            r0.keys().any(|k| k.ends_with(&format!(".{kind}"))),
            "no `{kind}` tensor: {:?}",
            r0.keys().collect::<Vec<_>>()
        );
    }
    assert_eq!(r0.keys().collect::<Vec<_>>(), r1.keys().collect::<Vec<_>>());
    for (name, data) in &r0 {
        assert!(data == &r1[name], "`{name}` differs between the replicas");
    }
    println!(
        "20 pure-bf16 steps: loss {:.4} -> {:.4}; {} tensors equal on both replicas",
        losses[0],
        losses[19],
        r0.len()
    );
}

/// `fsdp plan` figures: (optimizer state bytes per rank, bytes per shard element, shard
/// elements), (sharded bytes per parameter, parameter, optimizer), predicted total bytes.
type PlanFigures = ((u64, u64, u64), (u64, u64, u64), u64);

fn plan(extra: &[&str]) -> PlanFigures {
    let mut args = vec!["plan", "--memory-limit", "64G"];
    args.extend_from_slice(extra);
    let stdout = ok(&fsdp(&args), &format!("fsdp plan {extra:?}"));
    let line = |prefix: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no line {prefix:?}: {stdout}"))
            .to_string()
    };
    // The numbers of a line, in order (`×`, `+` and parentheses aside).
    let numbers = |l: &str| -> Vec<u64> {
        l.split(|c: char| !c.is_ascii_digit())
            .filter_map(|w| w.parse().ok())
            .collect()
    };
    let state = numbers(&line("optimizer state: "));
    let sharded = numbers(&line("sharded state: "));
    let memory = line("memory: predicted ");
    let total = memory
        .split_once(" (")
        .and_then(|(_, rest)| rest.split_once(" bytes)"))
        .map(|(n, _)| n.parse().unwrap())
        .unwrap_or_else(|| panic!("{memory}"));
    assert_eq!(state.len(), 3, "{state:?}");
    assert_eq!(sharded.len(), 3, "{sharded:?}");
    (
        (state[0], state[1], state[2]),
        (sharded[0], sharded[1], sharded[2]),
        total,
    )
}

#[test]
fn the_plan_shows_six_of_adamws_eight_bytes() {
    // The default model, bf16 parameters: AdamW keeps f32 master shards and two f32 moments.
    let adamw = plan(&["--param-dtype", "bf16"]);
    let any = plan(&PURE_BF16);
    let ((a_state, a_elem, a_n), a_sharded, a_total) = adamw;
    let ((p_state, p_elem, p_n), p_sharded, p_total) = any;
    assert_eq!((a_elem, p_elem), (8, 6));
    assert_eq!(a_n, p_n, "the same shards");
    assert_eq!(a_state, a_elem * a_n);
    assert_eq!(p_state * 8, a_state * 6, "{p_state} vs {a_state}");
    assert_eq!(a_sharded, (12, 4, 8));
    assert_eq!(p_sharded, (8, 2, 6));
    // Smaller shards and state: the whole prediction is smaller too.
    assert!(p_total < a_total, "{p_total} vs {a_total}");
    println!(
        "default model, 4 ranks: optimizer state {a_state} (AdamW) vs {p_state} \
         (AnyPrecisionAdamW) bytes per rank; predicted {a_total} vs {p_total} bytes"
    );

    // The other settings: no Kahan buffer, f32 state, f32 shards.
    let no_kahan = plan(&[&PURE_BF16[..], &["--kahan-summation", "off"]].concat());
    assert_eq!((no_kahan.0 .1, no_kahan.1), (4, (6, 2, 4)));
    let f32_state = plan(&[&PURE_BF16[..], &["--optimizer-state-dtype", "f32"]].concat());
    assert_eq!((f32_state.0 .1, f32_state.1), (12, (14, 2, 12)));
    let f32_shards = plan(&["--optimizer", "anyprecision-adamw"]);
    assert_eq!((f32_shards.0 .1, f32_shards.1), (6, (10, 4, 6)));
}

#[test]
fn a_resumed_run_is_bitwise_the_uninterrupted_one() {
    let d = dir("resume");
    let (ck, log, reference) = resume_paths(&d);
    // Parameter groups and a schedule: they apply to AnyPrecisionAdamW as to AdamW.
    let config = [
        "--decay-2d-only",
        "--lr-schedule",
        "cosine",
        "--warmup-iters",
        "2",
        "--steps",
        "10",
    ];
    let run = |extra: &[&str]| train(&[&config[..], extra].concat());
    ok(
        &run(&["--loss-log", s(&reference)]),
        "the uninterrupted run",
    );
    ok(
        &run(&checkpointing_args(&log, &ck, "5")),
        "the checkpointed run",
    );
    assert_eq!(loss_column(&log), loss_column(&reference));
    let saved = std::fs::read_to_string(ck.join("step-5").join("run.json")).unwrap();
    for field in [
        "\"optimizer\": \"anyprecision-adamw\"",
        "\"kahan_summation\": true",
        "\"optimizer_state_dtype\": \"bf16\"",
    ] {
        assert!(saved.contains(field), "{field} not in {saved}");
    }
    // Resume from step 5 (the run's options all come from the checkpoint): steps 5 to 9 are
    // recomputed and the loss log is the uninterrupted one, bitwise.
    std::fs::remove_dir_all(ck.join("step-10")).unwrap();
    let resumed = ok(&resume(&ck, &["--loss-log", s(&log)]), "the resumed run");
    assert!(resumed.contains("resuming from"), "{resumed}");
    assert!(resumed.contains("AnyPrecisionAdamW"), "{resumed}");
    let (a, b) = (loss_column(&log), loss_column(&reference));
    assert_eq!(a.len(), 10);
    assert_eq!(a, b, "the loss columns differ");

    // Another optimizer, or other settings, disagree with the checkpoint: errors naming both.
    std::fs::remove_dir_all(ck.join("step-10")).unwrap();
    let resume_with = |extra: &[&str]| resume(&ck, extra);
    one_error_status_1(
        &resume_with(&["--optimizer", "adamw"]),
        &[
            "--optimizer adamw",
            "--optimizer anyprecision-adamw",
            "step-5",
        ],
    );
    one_error_status_1(
        &resume_with(&["--kahan-summation", "off"]),
        &["--kahan-summation off", "--kahan-summation on"],
    );
    one_error_status_1(
        &resume_with(&["--optimizer-state-dtype", "f32"]),
        &[
            "--optimizer-state-dtype f32",
            "--optimizer-state-dtype bf16",
        ],
    );
}

#[test]
fn a_checkpoint_without_the_optimizer_is_adamws() {
    let d = dir("old");
    let ck = d.join("ck");
    let base = ["--steps", "4"];
    ok(
        &fsdp(&small_train_args(
            &TWO_RANKS,
            &[
                &base[..],
                &["--checkpoint-dir", s(&ck), "--checkpoint-every", "2"],
            ]
            .concat(),
        )),
        "the AdamW run",
    );
    // Written before --optimizer: no optimizer keys.
    std::fs::remove_dir_all(ck.join("step-4")).unwrap();
    let run_file = ck.join("step-2").join("run.json");
    let mut run: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&run_file).unwrap()).unwrap();
    let config = run["config"].as_object_mut().unwrap();
    assert_eq!(config["optimizer"], "adamw");
    assert!(config["kahan_summation"].is_null());
    for key in ["optimizer", "kahan_summation", "optimizer_state_dtype"] {
        config.remove(key);
    }
    std::fs::write(&run_file, serde_json::to_string_pretty(&run).unwrap()).unwrap();
    one_error_status_1(
        &fsdp(&[
            "train",
            "--resume",
            s(&ck),
            "--optimizer",
            "anyprecision-adamw",
        ]),
        &[
            "--optimizer anyprecision-adamw",
            "which has --optimizer adamw",
        ],
    );
    let stdout = ok(
        &fsdp(&["train", "--resume", s(&ck)]),
        "resuming the old checkpoint",
    );
    assert!(stdout.contains("optimizer: AdamW"), "{stdout}");
}

#[test]
fn bad_combinations_are_one_error_line() {
    // f16 shards are refused, before any rank starts (train and plan).
    let f16 = ["--optimizer", "anyprecision-adamw", "--param-dtype", "f16"];
    let needles = [
        "--optimizer anyprecision-adamw",
        "f16",
        "--param-dtype bf16",
    ];
    one_error_status_1(&fsdp(&small_train_args(&TWO_RANKS, &f16)), &needles);
    one_error_status_1(&fsdp(&[&["plan"][..], &f16].concat()), &needles);
    // Malformed values: clap's line, exit status 2.
    for (option, value, expected) in [
        ("--kahan-summation", "maybe", "expected on or off"),
        ("--optimizer-state-dtype", "f16", "expected bf16 or f32"),
        ("--optimizer", "sgd", "expected adamw or anyprecision-adamw"),
    ] {
        let out = fsdp(&small_train_args(&TWO_RANKS, &[option, value]));
        assert_eq!(out.status.code(), Some(2), "{option} {value}");
        one_error(&out, &[option, value, expected]);
    }
    // AnyPrecisionAdamW's settings without it.
    for option in [
        &["--kahan-summation", "off"][..],
        &["--optimizer-state-dtype", "f32"][..],
    ] {
        one_error_status_1(
            &fsdp(&small_train_args(&TWO_RANKS, option)),
            &[option[0], "applies only to --optimizer anyprecision-adamw"],
        );
    }
    // Its hyperparameters are checked as AdamW's.
    one_error_status_1(
        &train(&["--beta2", "1"]),
        &["invalid optimizer setting beta2 = 1", "[0, 1)"],
    );
}
