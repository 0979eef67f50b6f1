//! Non-finite values in `fsdp train`, run as a process: a NaN or infinite global loss or
//! gradient norm stops the run on every rank with one error line naming the step, and
//! overwrites no output (`--save` keeps its old bytes); `--skip-nonfinite N` skips up to N
//! such steps instead; non-finite hyperparameters and checkpoint tensors are one-line errors
//! before training; `--grad-clip 0` is no clipping.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

// Exactly one `error: ...` line containing every needle, exit status 1, no panic.
use common::cli::one_error_status_1 as assert_one_error;
use common::cli::{fsdp, loss_column, loss_log_rows, s, small_train_args, text, write_safetensors};
use fsdp_gpt::model::{param_specs, GptConfig};

/// A fresh directory of its own for each test.
fn dir(test: &str) -> PathBuf {
    common::cli::scratch("nonfinite", test)
}

/// The model of `SMALL_MODEL`.
fn small_cfg() -> GptConfig {
    GptConfig::new(2, 2, 32, 16, 64).unwrap()
}

fn train(extra: &[&str]) -> Output {
    fsdp(&small_train_args(&[], extra))
}

fn assert_ok(out: &Output) -> String {
    common::cli::ok(out, "the run")
}

/// The error line names the step and a non-finite value.
fn assert_nonfinite_error(out: &Output, step: Option<usize>) -> String {
    let line = assert_one_error(out, &["non-finite"]);
    let named = match step {
        Some(k) => line.starts_with(&format!("error: step {k}: ")),
        None => line.starts_with("error: step "),
    };
    assert!(named, "{line:?} does not name the step {step:?}");
    assert!(
        line.contains("NaN") || line.contains("inf"),
        "{line:?} names no NaN or inf"
    );
    line
}

/// The losses of a loss log (the loss column parsed; `NaN` and `inf` included).
fn logged_losses(path: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(path).unwrap();
    loss_log_rows(&text)
        .iter()
        .map(|f| f[1].parse::<f64>().unwrap())
        .collect()
}

/// The names in `d`, sorted.
fn listing(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_non_finite_step_stops_every_rank_and_overwrites_nothing() {
    let d = dir("stop");
    let save = d.join("m.st");
    let log = d.join("loss.csv");
    // A good model from a short valid run.
    assert_ok(&train(&[
        "--ranks",
        "2",
        "--steps",
        "2",
        "--save",
        s(&save),
    ]));
    let good = std::fs::read(&save).unwrap();
    fsdp_gpt::checkpoint::load_full(&save, &small_cfg()).unwrap();

    // `--lr 1e30` is finite, so accepted; the first step makes the weights huge, and the
    // next step's loss is NaN.
    for extra in [
        &[][..],
        &["--ranks", "1"],
        &["--strategy", "no-shard"],
        &["--strategy", "shard-grad-op", "--grad-accum", "2"],
        &["--strategy", "hybrid-shard", "--ranks-per-node", "2"],
        &["--grad-clip", "1.0"],
    ] {
        let mut args = vec![
            "--steps",
            "5",
            "--lr",
            "1e30",
            "--save",
            s(&save),
            "--loss-log",
            s(&log),
        ];
        args.extend_from_slice(extra);
        let out = train(&args);
        let line = assert_nonfinite_error(&out, None);
        println!("{extra:?}: {line}");
        // Training started (the option was accepted), on every rank of the run.
        assert!(text(&out.stdout).starts_with("fsdp train: "), "{extra:?}");
        assert_eq!(
            std::fs::read(&save).unwrap(),
            good,
            "{extra:?}: --save was overwritten"
        );
        // No temporary file is left behind; the loss log, if any, holds finite steps only.
        for name in listing(&d) {
            assert!(
                name == "m.st" || name == "loss.csv",
                "{extra:?}: left {name}"
            );
        }
        if log.exists() {
            let losses = logged_losses(&log);
            assert!(
                losses.iter().all(|l| l.is_finite()),
                "{extra:?}: {losses:?}"
            );
            let _ = std::fs::remove_file(&log);
        }
    }
    // The default run (4 ranks, FULL_SHARD): the exact line.
    let out = train(&["--steps", "5", "--lr", "1e30", "--save", s(&save)]);
    assert_eq!(
        assert_nonfinite_error(&out, Some(1)),
        "error: step 1: the loss is NaN (non-finite); training stopped and nothing was saved \
         (--skip-nonfinite N skips up to N such steps)"
    );
    assert_eq!(std::fs::read(&save).unwrap(), good);
}

#[test]
fn non_finite_hyperparameters_are_one_error_line_before_training() {
    for (args, needle) in [
        (&["--lr", "inf"][..], "lr = inf"),
        (&["--lr=-inf"], "lr = -inf"),
        (&["--lr", "nan"], "lr = NaN"),
        (&["--beta1", "nan"], "beta1 = NaN"),
        (&["--beta2", "inf"], "beta2 = inf"),
        (&["--eps", "inf"], "eps = inf"),
        (&["--weight-decay", "nan"], "weight_decay = NaN"),
        (&["--weight-decay", "inf"], "weight_decay = inf"),
        (&["--lr-schedule", "cosine", "--min-lr", "inf"], "min_lr"),
        (&["--grad-clip", "nan"], "--grad-clip"),
        (&["--grad-clip", "inf"], "--grad-clip"),
    ] {
        let out = train(args);
        let line = assert_one_error(&out, &[needle]);
        println!("{args:?}: {line}");
        assert!(
            out.stdout.is_empty(),
            "{args:?}: training started: {}",
            text(&out.stdout)
        );
    }
    assert_eq!(
        assert_one_error(&train(&["--lr", "inf"]), &[]),
        "error: invalid optimizer setting lr = inf: must be a finite number ≥ 0"
    );
}

#[test]
fn init_from_a_checkpoint_with_nan_or_inf_names_the_tensor() {
    let d = dir("init");
    let cfg = small_cfg();
    let good = d.join("good.st");
    assert_ok(&train(&[
        "--ranks",
        "2",
        "--steps",
        "1",
        "--save",
        s(&good),
    ]));
    let params = fsdp_gpt::checkpoint::load_full(&good, &cfg).unwrap();
    let out_path = d.join("out.st");
    for (name, bad) in [
        ("transformer.h.1.attn.c_proj.weight", f32::NAN),
        ("transformer.ln_f.bias", f32::INFINITY),
        ("transformer.wte.weight", f32::NEG_INFINITY),
    ] {
        let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = param_specs(&cfg)
            .into_iter()
            .map(|p| {
                let mut v = params[&p.name].clone();
                if p.name == name {
                    v[3] = bad;
                }
                (p.name, p.shape, v)
            })
            .collect();
        let path = d.join("bad.st");
        write_safetensors(&path, &tensors);
        let want = format!("tensor `{name}` holds NaN or infinite values");
        let out = train(&["--init-from", s(&path), "--save", s(&out_path)]);
        let line = assert_one_error(&out, &[&want, "bad.st"]);
        println!("{name}: {line}");
        assert!(out.stdout.is_empty(), "training started");
        assert!(!out_path.exists());
        // The library: loading is the same error; saving such parameters is refused too, and
        // writes nothing.
        let err = fsdp_gpt::checkpoint::load_full(&path, &cfg).unwrap_err();
        assert!(err.to_string().contains(&want), "{err}");
        let mut map = params.clone();
        map.get_mut(name).unwrap()[3] = bad;
        let err = fsdp_gpt::checkpoint::save_full(&out_path, &cfg, &map).unwrap_err();
        assert!(err.to_string().contains(&want), "{err}");
        assert!(!out_path.exists());
    }
}

#[test]
fn skip_nonfinite_skips_up_to_n_steps_then_stops() {
    let d = dir("skip");
    let log = d.join("loss.csv");
    let out = train(&[
        "--skip-nonfinite",
        "100",
        "--lr",
        "1e30",
        "--steps",
        "4",
        "--loss-log",
        s(&log),
    ]);
    let stdout = assert_ok(&out);
    assert!(
        stdout.contains("skipped 3 non-finite step(s)"),
        "no summary of the skipped steps: {stdout}"
    );
    for k in 1..=3 {
        assert!(
            stdout.contains(&format!("step {k}: the loss is NaN: skipped ({k} of")),
            "step {k} not reported as skipped: {stdout}"
        );
    }
    // Skipped steps are logged like the others, with their loss as it was.
    let losses = logged_losses(&log);
    assert_eq!(losses.len(), 4, "{losses:?}");
    assert!(losses[0].is_finite(), "{losses:?}");
    assert!(losses[1..].iter().all(|l| !l.is_finite()), "{losses:?}");

    // One skip allowed: the second non-finite step (step 2) is the error.
    let out = train(&["--skip-nonfinite", "1", "--lr", "1e30", "--steps", "4"]);
    let line = assert_nonfinite_error(&out, Some(2));
    assert!(line.contains("--skip-nonfinite 1"), "{line}");
    assert_eq!(
        line,
        "error: step 2: the loss is NaN (non-finite) after 1 skipped non-finite step(s) \
         (--skip-nonfinite 1); training stopped and nothing was saved"
    );
    assert!(text(&out.stdout).contains("step 1: the loss is NaN: skipped (1 of"));

    // A run with no non-finite step skips nothing and says nothing about it.
    let stdout = assert_ok(&train(&["--skip-nonfinite", "3", "--steps", "2"]));
    assert!(!stdout.contains("skipped"), "{stdout}");
}

#[test]
fn grad_clip_0_is_no_clipping_and_negative_is_an_error() {
    let d = dir("clip");
    let run = |name: &str, extra: &[&str]| {
        let log = d.join(format!("{name}.csv"));
        let save = d.join(format!("{name}.st"));
        let mut args = vec![
            "--ranks",
            "2",
            "--steps",
            "6",
            "--loss-log",
            s(&log),
            "--save",
            s(&save),
        ];
        args.extend_from_slice(extra);
        assert_ok(&train(&args));
        (loss_column(&log), std::fs::read(&save).unwrap())
    };
    let none = run("none", &[]);
    let zero = run("zero", &["--grad-clip", "0"]);
    assert_eq!(none.0.len(), 6);
    assert_eq!(zero.0, none.0, "--grad-clip 0 changed the losses");
    assert!(zero.1 == none.1, "--grad-clip 0 changed the final weights");
    // A bound the norm exceeds does clip (so the comparison above means something).
    let tight = run("tight", &["--grad-clip", "0.01"]);
    assert_eq!(tight.0[0], none.0[0]);
    assert_ne!(tight.0, none.0, "--grad-clip 0.01 did not clip");

    let line = assert_one_error(&train(&["--grad-clip=-1"]), &["--grad-clip"]);
    assert_eq!(
        line,
        "error: --grad-clip -1: must be a finite number ≥ 0 (0: no clipping)"
    );
}
