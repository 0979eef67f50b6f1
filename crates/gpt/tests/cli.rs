//! The `fsdp` command-line program, run as a process: a short training run whose loss falls,
//! and one clear error line with a non-zero exit status for every invalid option.

mod common;

use std::path::PathBuf;
use std::process::Output;

use common::cli::{
    fsdp, golden_args, one_error, read_losses, small_train_args, write_safetensors, ONE_LAYER,
    SMALL_MODEL, TWO_RANKS,
};
use common::{check_final_weights, expected_losses, fixture, LOSS_TOL};

fn tmp(name: &str) -> PathBuf {
    common::cli::tmp("cli", name)
}

fn train(extra: &[&str]) -> Output {
    fsdp(&small_train_args(&[], extra))
}

/// Exactly one stderr line, `error: ...` containing `needle`, a non-zero exit status, and no
/// panic.
fn assert_one_error(out: &Output, needle: &str) {
    one_error(out, &[needle]);
}

#[test]
fn short_training_run_exits_0_and_the_loss_falls() {
    let log = tmp("short.csv");
    let out = train(&[
        "--ranks",
        "2",
        "--batch-size",
        "8",
        "--steps",
        "80",
        "--lr",
        "3e-3",
        "--loss-log",
        log.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let losses = read_losses(&log);
    assert_eq!(losses.len(), 80);
    let (first, last) = (losses[0], losses[79]);
    println!("{stdout}\nloss {first} -> {last}");
    // ln(64) = 4.16 at initialisation; the generated corpus has an entropy rate near 1.1.
    assert!(last < 0.75 * first, "loss {first} -> {last}");
    // The summary names the memory and communication figures of every rank.
    assert!(stdout.contains("peak allocated") && stdout.contains("all-gathered"));
}

#[test]
fn gradient_accumulation_clipping_and_every_strategy_run() {
    for extra in [
        &["--strategy", "shard-grad-op", "--grad-accum", "2"][..],
        &["--strategy", "no-shard", "--grad-clip", "1.0"],
        &[
            "--strategy",
            "hybrid-shard",
            "--ranks-per-node",
            "2",
            "--backward-prefetch",
            "post",
        ],
        &[
            "--strategy",
            "hybrid-shard-zero2",
            "--forward-prefetch",
            "--limit-all-gathers",
            "off",
            "--wrap",
            "size:5000",
        ],
    ] {
        let mut args = vec!["--ranks", "4", "--batch-size", "8", "--steps", "3"];
        args.extend_from_slice(extra);
        let out = train(&args);
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn invalid_options_give_one_error_line_and_a_non_zero_status() {
    // Batch not divisible by the ranks.
    assert_one_error(
        &train(&["--ranks", "4", "--batch-size", "6"]),
        "not divisible by --ranks 4",
    );
    // Unknown strategy.
    assert_one_error(&train(&["--strategy", "zero3"]), "unknown strategy");
    // Hybrid with ranks not divisible by ranks-per-node.
    assert_one_error(
        &train(&[
            "--ranks",
            "4",
            "--strategy",
            "hybrid-shard",
            "--ranks-per-node",
            "3",
        ]),
        "not divisible by --ranks-per-node 3",
    );
    // Other malformed values.
    assert_one_error(&train(&["--limit-all-gathers", "0"]), "limit-all-gathers");
    assert_one_error(&train(&["--wrap", "size:x"]), "--wrap");
    assert_one_error(
        &train(&["--backward-prefetch", "later"]),
        "pre, post or none",
    );
    assert_one_error(&fsdp(&["train", "--n-head", "3"]), "model configuration");
    assert_one_error(
        &train(&["--batch-size", "8", "--grad-accum", "3"]),
        "--grad-accum 3",
    );

    // A data file that is too short for rows of 16 tokens.
    let short = tmp("short.bin");
    std::fs::write(&short, [1u8, 0, 2, 0, 3, 0, 4, 0]).unwrap();
    assert_one_error(&train(&["--data", short.to_str().unwrap()]), "too short");
    // A data file of odd length.
    let odd = tmp("odd.bin");
    std::fs::write(&odd, vec![1u8; 101]).unwrap();
    assert_one_error(&train(&["--data", odd.to_str().unwrap()]), "odd");
    // A missing data file.
    assert_one_error(
        &train(&["--data", tmp("does-not-exist.bin").to_str().unwrap()]),
        "does-not-exist.bin",
    );
    // Tokens outside the vocabulary.
    let big = tmp("big.bin");
    let toks: Vec<u8> = (0..100u16).flat_map(|t| (t * 7).to_le_bytes()).collect();
    std::fs::write(&big, toks).unwrap();
    assert_one_error(
        &train(&["--data", big.to_str().unwrap()]),
        "outside the vocabulary",
    );
}

#[test]
fn cli_reproduces_pytorch_at_1_and_4_ranks() {
    let cfg = common::cfg();
    let init = fixture("gpt_tiny_init.safetensors");
    let expected = expected_losses();
    let data = fixture("tokens.bin");
    for ranks in ["1", "4"] {
        let log = tmp(&format!("golden-{ranks}.csv"));
        let save = tmp(&format!("golden-{ranks}.safetensors"));
        let out = fsdp(&golden_args(
            ranks,
            init.to_str().unwrap(),
            log.to_str().unwrap(),
            save.to_str().unwrap(),
            data.to_str().unwrap(),
        ));
        assert!(
            out.status.success(),
            "ranks {ranks}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let losses = read_losses(&log);
        assert_eq!(losses.len(), expected.len());
        for (k, (l, e)) in losses.iter().zip(&expected).enumerate() {
            let rel = ((l - e) / e).abs();
            assert!(rel < LOSS_TOL, "ranks {ranks} step {k}: {l} vs {e}");
        }
        let params = fsdp_gpt::checkpoint::load_full(&save, &cfg).unwrap();
        let errs = check_final_weights(&params);
        println!("ranks {ranks}: final weights {errs:?}");
    }
}

#[test]
fn bad_checkpoints_give_one_error_line() {
    let cfg = common::cfg();
    let init = common::init();
    let specs = fsdp_gpt::model::param_specs(&cfg);
    let full: Vec<(String, Vec<usize>, Vec<f32>)> = specs
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone(), init[&s.name].clone()))
        .collect();
    let log = tmp("bad.csv");
    let save = tmp("bad-out.safetensors");
    let data = fixture("tokens.bin");

    // A missing tensor.
    let missing = tmp("missing.safetensors");
    let dropped = "transformer.h.1.mlp.c_fc.weight";
    let some: Vec<_> = full.iter().filter(|t| t.0 != dropped).cloned().collect();
    write_safetensors(&missing, &some);
    let out = fsdp(&golden_args(
        "2",
        missing.to_str().unwrap(),
        log.to_str().unwrap(),
        save.to_str().unwrap(),
        data.to_str().unwrap(),
    ));
    assert_one_error(&out, dropped);

    // A mis-shaped tensor.
    let misshaped = tmp("misshaped.safetensors");
    let bad = "transformer.h.0.ln_1.weight";
    let wrong: Vec<_> = full
        .iter()
        .map(|t| {
            if t.0 == bad {
                (t.0.clone(), vec![16, 2], t.2.clone())
            } else {
                t.clone()
            }
        })
        .collect();
    write_safetensors(&misshaped, &wrong);
    let out = fsdp(&golden_args(
        "2",
        misshaped.to_str().unwrap(),
        log.to_str().unwrap(),
        save.to_str().unwrap(),
        data.to_str().unwrap(),
    ));
    assert_one_error(&out, bad);

    // Not a safetensors file at all.
    let garbage = tmp("garbage.safetensors");
    std::fs::write(&garbage, b"not a checkpoint").unwrap();
    let out = fsdp(&golden_args(
        "2",
        garbage.to_str().unwrap(),
        log.to_str().unwrap(),
        save.to_str().unwrap(),
        data.to_str().unwrap(),
    ));
    assert_one_error(&out, "garbage.safetensors");
    assert!(!save.exists(), "no output after a failed start");
}

#[test]
fn trace_option_writes_a_chrome_trace_of_every_rank() {
    let path = tmp("trace.json");
    let out = train(
        &[
            &TWO_RANKS[..],
            &["--steps", "2", "--trace", path.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    for rank in 0..2u64 {
        let mine = |ph: &str| {
            events
                .iter()
                .filter(|e| e["pid"].as_u64() == Some(rank) && e["ph"] == ph)
                .count()
        };
        assert!(mine("X") > 0 && mine("C") > 0, "rank {rank}");
    }
    // A trace to a directory that does not exist is refused before training.
    assert_one_error(
        &train(&["--trace", "/nonexistent-dir/trace.json"]),
        "does not exist",
    );
}

#[test]
fn plan_prints_the_table_and_rejects_invalid_options() {
    let mut args = vec!["plan"];
    args.extend_from_slice(&SMALL_MODEL);
    args.extend_from_slice(&["--ranks", "4", "--batch-size", "8"]);
    let out = fsdp(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("transformer.h.1"), "{stdout}");
    assert!(stdout.contains("peak allocated"), "{stdout}");

    let out = fsdp(&[
        "plan",
        "--strategy",
        "hybrid-shard",
        "--ranks-per-node",
        "3",
    ]);
    assert_one_error(&out, "not divisible by --ranks-per-node 3");
    let out = fsdp(&["plan", "--ranks", "4", "--batch-size", "6"]);
    assert_one_error(&out, "not divisible by --ranks 4");
}

/// A small model and batch for the optimizer option tests.
const SMALL_OPT: [&str; 4] = ["--vocab-size", "64", "--batch-size", "4"];

fn small_run(name: &str, ranks: &str, extra: &[&str]) -> Vec<f64> {
    let log = tmp(name);
    let mut args = vec!["train", "--steps", "6", "--ranks", ranks];
    args.extend(ONE_LAYER);
    args.extend(SMALL_OPT);
    args.extend(extra);
    let log_s = log.to_str().unwrap().to_string();
    args.extend(["--loss-log", &log_s]);
    let out = fsdp(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    read_losses(&log)
}

#[test]
fn optimizer_groups_and_the_cosine_schedule_change_the_run() {
    let plain = small_run("plain.csv", "2", &[]);
    let cosine = small_run(
        "cosine.csv",
        "2",
        &[
            "--lr-schedule",
            "cosine",
            "--warmup-iters",
            "2",
            "--lr-decay-iters",
            "5",
            "--min-lr",
            "1e-4",
        ],
    );
    let groups = small_run(
        "groups.csv",
        "2",
        &["--decay-2d-only", "--weight-decay", "0.5"],
    );
    // The same model at step 0; the schedule (a warmup: a smaller first update) and the groups
    // change what follows.
    assert_eq!(plain[0], cosine[0]);
    assert_eq!(plain[0], groups[0]);
    assert_ne!(plain[1], cosine[1]);
    assert_ne!(plain[1..], groups[1..]);
}

#[test]
fn the_seeded_initialisation_is_the_same_model_at_every_world_size() {
    // The default initialisation is drawn shard by shard from a counter-based generator: the
    // first loss (before any update) is the same at 1, 2 and 4 ranks.
    let one = small_run("seed1.csv", "1", &["--seed", "5"]);
    for ranks in ["2", "4"] {
        let other = small_run(&format!("seed{ranks}.csv"), ranks, &["--seed", "5"]);
        assert!(
            ((one[0] - other[0]) / one[0]).abs() < 1e-6,
            "{ranks} ranks: {} vs {}",
            other[0],
            one[0]
        );
    }
    let other_seed = small_run("seed-other.csv", "1", &["--seed", "6"]);
    assert_ne!(one[0], other_seed[0]);
}

#[test]
fn invalid_schedule_options_are_one_error_line() {
    let with = |extra: &[&str]| {
        let mut args = vec!["train", "--steps", "2"];
        args.extend(ONE_LAYER);
        args.extend(SMALL_OPT);
        args.extend(extra);
        fsdp(&args)
    };
    assert_one_error(&with(&["--warmup-iters", "2"]), "--lr-schedule cosine");
    assert_one_error(&with(&["--min-lr", "0.1"]), "--lr-schedule cosine");
    assert_one_error(
        &with(&[
            "--lr-schedule",
            "cosine",
            "--warmup-iters",
            "5",
            "--lr-decay-iters",
            "2",
        ]),
        "warmup",
    );
    assert_one_error(&with(&["--lr-schedule", "cosine", "--min-lr=-1"]), "min_lr");
    assert_one_error(&with(&["--lr-schedule", "linear"]), "constant or cosine");
}

/// `fsdp train | head -1`: the program ends quietly when its standard output is closed (status
/// 141, as a shell reports `SIGPIPE`), it does not panic.
#[test]
fn a_closed_stdout_ends_training_quietly() {
    use std::io::{BufRead, BufReader, Read};
    let mut args = vec!["train"];
    args.extend_from_slice(&common::cli::SMALL_MODEL);
    args.extend_from_slice(&["--steps", "100000"]);
    let mut child = common::cli::command(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    // The reader (and with it the pipe's read end) is dropped here.
    assert!(first.contains("fsdp train"), "{first}");
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.code(), Some(141), "{err}");
}
