//! `fsdp train --grad-scaler`, run as a process: dynamic loss scaling (PyTorch's
//! `ShardedGradScaler`) is on by default with `--param-dtype f16` and off otherwise; a step
//! whose gradients overflow is the scaler's to skip (no optimizer step, the scale backed off),
//! which neither stops the run nor counts against `--skip-nonfinite`; the summary gives the
//! final scale and the skipped steps; a checkpoint keeps the scaler's state, so a resumed run
//! is bitwise the uninterrupted one; bad values are one-line errors.

mod common;

use std::path::PathBuf;
use std::process::Output;

use common::cli::{
    checkpointing_args, fsdp, loss_column, ok, one_error, read_losses, resume, resume_paths, s,
    small_train_args, TWO_RANKS,
};

/// A fresh directory of its own for each test.
fn dir(test: &str) -> PathBuf {
    common::cli::scratch("grad_scaler_cli", test)
}

/// `fsdp train SMALL_MODEL TWO_RANKS extra`.
fn train(extra: &[&str]) -> Output {
    fsdp(&small_train_args(&TWO_RANKS, extra))
}

/// The summary's grad scaler line: the final scale and the steps the scaler skipped.
fn scaler_line(stdout: &str) -> Option<(f32, usize)> {
    let line = stdout.lines().find(|l| l.starts_with("grad scaler: "))?;
    let scale = line
        .strip_prefix("grad scaler: final scale ")?
        .split(',')
        .next()?
        .parse()
        .ok()?;
    let skipped = line.split(", ").nth(1)?.split(' ').next()?.parse().ok()?;
    Some((scale, skipped))
}

#[test]
fn f16_trains_with_the_scaler_on_by_default() {
    let d = dir("default");
    let log = d.join("log.csv");
    let out = train(&[
        "--param-dtype",
        "f16",
        "--steps",
        "12",
        "--loss-log",
        s(&log),
    ]);
    let stdout = ok(&out, "the f16 run");
    let (scale, skipped) = scaler_line(&stdout).expect("a grad scaler line in the summary");
    // torch's default: 2^16, no overflow at that scale for this model, no growth within 2000.
    assert_eq!((scale, skipped), (65536.0, 0), "{stdout}");
    let losses = read_losses(&log);
    assert_eq!(losses.len(), 12);
    assert!(losses[11] < losses[0], "{losses:?}");

    // Off when asked, and off by default with other dtypes.
    for extra in [
        &["--param-dtype", "f16", "--grad-scaler", "off"][..],
        &["--param-dtype", "bf16"][..],
        &[][..],
    ] {
        let mut args = vec!["--steps", "2"];
        args.extend_from_slice(extra);
        let stdout = ok(&train(&args), &format!("{extra:?}"));
        assert!(scaler_line(&stdout).is_none(), "{extra:?}: {stdout}");
    }
    // On when asked with f32 parameters (the gradients are scaled in f32).
    let stdout = ok(
        &train(&[
            "--grad-scaler",
            "on",
            "--growth-interval",
            "1",
            "--steps",
            "3",
        ]),
        "--grad-scaler on with f32",
    );
    // Three steps without overflow, each growing the scale.
    assert_eq!(scaler_line(&stdout), Some((524288.0, 0)), "{stdout}");
}

#[test]
fn overflowing_steps_are_the_scalers_to_skip() {
    let d = dir("overflow");
    let (log, still) = (d.join("log.csv"), d.join("still.csv"));
    // The gradients scaled by ~1e9 overflow f16: the scaler skips and halves the scale until
    // they fit, then the run trains. --skip-nonfinite is 0: these skips are not its.
    let overflowing = [
        "--param-dtype",
        "f16",
        "--init-scale",
        "1e9",
        "--steps",
        "20",
    ];
    let mut args = overflowing.to_vec();
    args.extend_from_slice(&["--loss-log", s(&log)]);
    let out = train(&args);
    let stdout = ok(&out, "the overflowing run");
    let (scale, skipped) = scaler_line(&stdout).expect("a grad scaler line in the summary");
    assert!((1..20).contains(&skipped), "{stdout}");
    // Each skip halves the scale (no growth within 2000 steps).
    assert_eq!(scale, (1e9 / 2f64.powi(skipped as i32)) as f32, "{stdout}");
    assert!(!stdout.contains("non-finite"), "{stdout}");
    // Every step is logged, skipped ones included.
    let losses = read_losses(&log);
    assert_eq!(losses.len(), 20);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(
        losses[19] < losses[0],
        "the run trains after the skips: {losses:?}"
    );

    // A skipped step leaves the parameters as they are: the first steps' losses are those of
    // a run that never changes its parameters (learning rate 0), bitwise.
    let mut args = overflowing.to_vec();
    args.extend_from_slice(&["--lr", "0", "--loss-log", s(&still)]);
    ok(&train(&args), "the run at learning rate 0");
    let (a, b) = (loss_column(&log), loss_column(&still));
    let same = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    assert!(
        (1..=skipped).contains(&same),
        "{same} leading steps equal, {skipped} skipped: {a:?} vs {b:?}"
    );
    println!("{skipped} overflowing steps skipped, final scale {scale}");
}

#[test]
fn a_resumed_run_keeps_the_scalers_state_bitwise() {
    let d = dir("resume");
    let (ck, log, reference) = resume_paths(&d);
    // Growth every 3 steps from 1e6: overflows, backoffs and growths on both sides of the
    // checkpoint at step 10.
    let config = [
        "--param-dtype",
        "f16",
        "--init-scale",
        "1e6",
        "--growth-interval",
        "3",
    ];
    let run = |extra: &[&str]| {
        let mut args = config.to_vec();
        args.extend_from_slice(extra);
        train(&args)
    };
    let uninterrupted = ok(
        &run(&["--steps", "20", "--loss-log", s(&reference)]),
        "the uninterrupted run",
    );
    let first = ok(
        &run(&[&["--steps", "10"][..], &checkpointing_args(&log, &ck, "5")].concat()),
        "the first half",
    );
    let saved = std::fs::read_to_string(ck.join("step-10").join("grad_scaler.json")).unwrap();
    assert!(saved.contains("\"scale\""), "{saved}");
    // Every option but the length comes from the checkpoint (the scaler's included).
    let resumed = ok(
        &resume(&ck, &["--steps", "20", "--loss-log", s(&log)]),
        "the resumed run",
    );
    assert_eq!(
        loss_column(&log),
        loss_column(&reference),
        "the loss columns differ"
    );
    let (before, after) = (scaler_line(&first).unwrap(), scaler_line(&resumed).unwrap());
    assert_eq!(
        scaler_line(&resumed),
        scaler_line(&uninterrupted),
        "the final scale and the skipped steps"
    );
    assert!(before.1 >= 1, "no overflow before the checkpoint: {first}");
    println!("steps 0..20 bitwise equal; scaler at step 10 {before:?}, at step 20 {after:?}");

    // The checkpoint's scaler options are the run's: one that disagrees is an error naming
    // both values.
    let resume_with = |extra: &[&str]| resume(&ck, &[&["--steps", "20"][..], extra].concat());
    one_error(
        &resume_with(&["--grad-scaler", "off"]),
        &["--grad-scaler off", "--grad-scaler on"],
    );
    one_error(
        &resume_with(&["--growth-interval", "7"]),
        &["--growth-interval 7", "--growth-interval 3"],
    );
    one_error(
        &resume_with(&["--param-dtype", "bf16"]),
        &["--param-dtype bf16", "--param-dtype f16"],
    );
}

#[test]
fn bad_scaler_options_are_one_line_errors() {
    let cases: [(&[&str], &[&str]); 9] = [
        (
            &["--grad-scaler", "maybe"],
            &["--grad-scaler", "maybe", "on or off"],
        ),
        (&["--grad-scaler", "1"], &["--grad-scaler", "on or off"]),
        (
            &["--param-dtype", "f16", "--init-scale", "0"],
            &["--init-scale 0", "positive"],
        ),
        (
            &["--param-dtype", "f16", "--init-scale", "-2"],
            &["--init-scale -2", "positive"],
        ),
        (
            &["--param-dtype", "f16", "--init-scale", "inf"],
            &["--init-scale inf", "finite"],
        ),
        (
            &["--param-dtype", "f16", "--init-scale", "nan"],
            &["--init-scale NaN", "finite"],
        ),
        (
            &["--param-dtype", "f16", "--init-scale", "1e39"],
            &["--init-scale 1e39", "f32"],
        ),
        (
            &["--param-dtype", "f16", "--growth-interval", "0"],
            &["--growth-interval", "at least 1"],
        ),
        // The scaler's settings without the scaler.
        (
            &["--init-scale", "1024"],
            &["--init-scale", "off", "--grad-scaler on"],
        ),
    ];
    for (extra, needles) in cases {
        let mut args = vec!["--steps", "1"];
        args.extend_from_slice(extra);
        let line = one_error(&train(&args), needles);
        println!("{extra:?}: {line}");
    }
    one_error(
        &train(&[
            "--param-dtype",
            "f16",
            "--grad-scaler",
            "off",
            "--growth-interval",
            "5",
        ]),
        &["--growth-interval", "off"],
    );
}
