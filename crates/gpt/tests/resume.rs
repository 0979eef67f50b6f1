//! Periodic checkpoints and resuming: a run killed with `kill -9` (ranks as threads, or as
//! processes under `fsdp launch`, whose ranks die with the launcher) and resumed with
//! `--resume` gives bitwise the steps and losses of an uninterrupted run at the same number of
//! ranks, and the same losses up to rounding at another; `--keep-checkpoints` and leftovers of
//! crashed runs; the options a checkpoint or an `--init-from` file defines, and the errors when
//! an option disagrees with them.

#![cfg(unix)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::cli::{command, fsdp, ok, one_error, s, small_train_args, LOSS_LOG_HEADER, TWO_RANKS};

/// The batch and seed of the runs, after `SMALL_MODEL` (as in tests/multiprocess.rs).
const SMALL: [&str; 4] = ["--batch-size", "8", "--seed", "3"];

/// How long a run may take to reach the steps a test waits for.
const PATIENCE: Duration = Duration::from_secs(300);

/// `fsdp train SMALL_MODEL SMALL extra`.
fn train(extra: &[&str]) -> Output {
    fsdp(&small_train_args(&SMALL, extra))
}

/// A fresh directory for one test, unique to this process.
fn scratch(test: &str) -> PathBuf {
    common::cli::scratch("resume", &format!("{test}-{}", std::process::id()))
}

/// The step and loss columns of a loss log, as written (bitwise comparable).
fn step_loss(log: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(log).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(LOSS_LOG_HEADER));
    lines
        .map(|l| {
            let mut f = l.split(',');
            let step = f.next().unwrap().parse().unwrap();
            (step, f.next().unwrap().to_string())
        })
        .collect()
}

/// Complete lines of steps in a loss log that may still be written.
fn logged_steps(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .map(|t| t.lines().count().saturating_sub(1))
        .unwrap_or(0)
}

/// Starts `args` in the background and kills it (`SIGKILL`) once `log` holds at least
/// `steps` steps.
fn kill_after(args: &[&str], log: &Path, steps: usize) {
    let mut child = command(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("running the fsdp binary");
    let deadline = Instant::now() + PATIENCE;
    while logged_steps(log) < steps {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{args:?} ended ({status}) before {steps} steps");
        }
        assert!(
            Instant::now() < deadline,
            "{args:?}: no {steps} steps in time"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

/// The complete checkpoints (`step-K`) and staging directories (`step-K.tmp`) in `dir`.
fn checkpoints(dir: &Path) -> (Vec<u64>, Vec<String>) {
    let mut complete = Vec::new();
    let mut staging = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if let Some(k) = name.strip_prefix("step-") {
            match k.parse::<u64>() {
                Ok(k) => complete.push(k),
                Err(_) => staging.push(name),
            }
        }
    }
    complete.sort_unstable();
    (complete, staging)
}

/// The processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) {
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains(needle) {
                found.push(format!("{name}: {cmdline}"));
            }
        }
    }
    found
}

/// The killed-then-resumed log equals the uninterrupted one in its step and loss columns.
fn assert_bitwise(resumed: &Path, reference: &Path, steps: usize, what: &str) {
    let a = step_loss(resumed);
    let b = step_loss(reference);
    assert_eq!(b.len(), steps, "{what}: reference steps");
    assert_eq!(
        a.iter().map(|x| x.0).collect::<Vec<_>>(),
        (0..steps).collect::<Vec<_>>(),
        "{what}: the resumed log's steps"
    );
    assert_eq!(a, b, "{what}: step and loss columns differ");
    println!("{what}: steps 0..{steps} bitwise equal to the uninterrupted run");
}

/// A fresh directory for one test (see [`scratch`]), and in it the paths of its checkpoints,
/// its loss log and the loss log of the uninterrupted reference run.
fn run_dirs(test: &str) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    let d = scratch(test);
    let (ck, log, reference) = (d.join("ck"), d.join("log.csv"), d.join("ref.csv"));
    (d, ck, log, reference)
}

/// Starts `prefix train SMALL_MODEL SMALL config` for ever, checkpointing every 3 steps into
/// `ck` and logging into `log`, and kills it after 5 steps.
fn kill_a_checkpointing_run(prefix: &[&str], config: &[&str], ck: &Path, log: &Path) {
    let mut args = prefix.to_vec();
    args.extend(small_train_args(&SMALL, config));
    args.extend_from_slice(&[
        "--steps",
        "100000",
        "--checkpoint-dir",
        s(ck),
        "--checkpoint-every",
        "3",
        "--loss-log",
        s(log),
    ]);
    kill_after(&args, log, 5);
}

/// The newest complete checkpoint in `ck`.
fn last_checkpoint(ck: &Path) -> u64 {
    *checkpoints(ck).0.last().expect("a complete checkpoint")
}

/// `prefix train --resume ck config --steps steps --loss-log log`.
fn resume(prefix: &[&str], config: &[&str], ck: &Path, steps: usize, log: &Path) -> Output {
    let steps = steps.to_string();
    let mut args = prefix.to_vec();
    args.extend_from_slice(&["train", "--resume", s(ck)]);
    args.extend_from_slice(config);
    args.extend_from_slice(&["--steps", &steps, "--loss-log", s(log)]);
    fsdp(&args)
}

/// Runs the same `steps` uninterrupted on 4 threads, logging into `reference`, and checks that
/// `log`, resumed at step `k`, equals it bitwise.
fn assert_resumed_bitwise(log: &Path, reference: &Path, k: u64, steps: usize, what: &str) {
    let steps_s = steps.to_string();
    ok(
        &train(&[
            "--ranks",
            "4",
            "--steps",
            &steps_s,
            "--loss-log",
            s(reference),
        ]),
        "the uninterrupted run",
    );
    assert_bitwise(
        log,
        reference,
        steps,
        &format!("{what}, resumed at step {k}"),
    );
}

#[test]
fn a_killed_thread_run_resumes_bitwise() {
    let (d, ck, log, reference) = run_dirs("threads");
    kill_a_checkpointing_run(&[], &["--ranks", "4"], &ck, &log);
    let k = last_checkpoint(&ck);
    assert!(k >= 3 && k % 3 == 0, "{:?}", checkpoints(&ck).0);
    let steps = k as usize + 5;
    // Every option but the length comes from the checkpoint.
    let out = resume(&[], &["--ranks", "4"], &ck, steps, &log);
    let stdout = ok(&out, "the resumed run");
    assert!(
        stdout.contains(&format!("at step {k} of {steps}")),
        "{stdout}"
    );
    assert_resumed_bitwise(&log, &reference, k, steps, "4 threads, killed");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_killed_launcher_leaves_no_ranks_and_the_run_resumes_bitwise() {
    let (d, ck, log, reference) = run_dirs("processes");
    kill_a_checkpointing_run(&["launch", "-n", "4", "--master-port", "0"], &[], &ck, &log);
    // The ranks die with their launcher (parent-death signal): none is left within seconds.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = processes_mentioning(s(&d));
        if left.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            // End the orphans this test started before failing.
            for p in &left {
                let pid = p.split(':').next().unwrap_or_default();
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
            panic!("orphan ranks after the launcher was killed: {left:#?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let k = last_checkpoint(&ck);
    let steps = k as usize + 4;
    let out = resume(
        &["launch", "-n", "4", "--master-port", "0"],
        &[],
        &ck,
        steps,
        &log,
    );
    ok(&out, "the resumed process run");
    // The TCP backend reduces in the ring's order: the thread run is the reference.
    assert_resumed_bitwise(&log, &reference, k, steps, "4 processes, launcher killed");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_checkpoint_of_four_ranks_resumes_on_two() {
    let (d, ck, log, reference) = run_dirs("reshard");
    ok(
        &train(&[
            "--ranks",
            "4",
            "--steps",
            "3",
            "--checkpoint-dir",
            s(&ck),
            "--checkpoint-every",
            "3",
            "--loss-log",
            s(&log),
        ]),
        "the 4-rank run",
    );
    assert_eq!(checkpoints(&ck).0, vec![3]);
    ok(
        &resume(&[], &["--ranks", "2"], &ck, 8, &log),
        "the 2-rank resumed run",
    );
    ok(
        &train(&["--ranks", "4", "--steps", "8", "--loss-log", s(&reference)]),
        "the uninterrupted 4-rank run",
    );
    let a = step_loss(&log);
    let b = step_loss(&reference);
    assert_eq!(a.len(), 8);
    assert_eq!(a[..3], b[..3], "the steps before the checkpoint are kept");
    let mut worst = 0.0f64;
    for ((sa, la), (sb, lb)) in a.iter().zip(&b) {
        assert_eq!(sa, sb);
        let (x, y): (f64, f64) = (la.parse().unwrap(), lb.parse().unwrap());
        worst = worst.max((x - y).abs() / y.abs());
    }
    println!("4 ranks -> 2 ranks at step 3: worst relative loss difference {worst:e} over 8 steps");
    assert!(worst <= 1e-5, "resumed {a:?}\nuninterrupted {b:?}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn checkpoint_housekeeping_and_resume_errors() {
    let d = scratch("errors");
    let ck = d.join("ck");
    // A leftover of a crashed run is removed; only the two newest complete checkpoints stay.
    std::fs::create_dir_all(ck.join("step-1.tmp")).unwrap();
    std::fs::write(
        ck.join("step-1.tmp/rank-00000-of-00004.safetensors"),
        b"partial",
    )
    .unwrap();
    ok(
        &train(&[
            "--ranks",
            "2",
            "--steps",
            "9",
            "--checkpoint-dir",
            s(&ck),
            "--checkpoint-every",
            "2",
            "--keep-checkpoints",
            "2",
        ]),
        "the checkpointing run",
    );
    assert_eq!(checkpoints(&ck), (vec![6, 8], vec![]));
    for k in [6, 8] {
        let run = ck.join(format!("step-{k}/run.json"));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run).unwrap()).unwrap();
        assert_eq!(v["step"], k);
        assert_eq!(v["data_position"], k);
        assert_eq!(v["config"]["n_layer"], 2);
        assert!(ck
            .join(format!("step-{k}/rank-00001-of-00002.safetensors"))
            .exists());
    }

    // Nothing to resume from.
    let empty = d.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    one_error(
        &fsdp(&["train", "--resume", s(&empty)]),
        &["--resume", "no complete checkpoint"],
    );
    let partial = d.join("partial");
    std::fs::create_dir_all(partial.join("step-3.tmp")).unwrap();
    one_error(
        &fsdp(&["train", "--resume", s(&partial)]),
        &["no complete checkpoint", "step-3.tmp"],
    );
    // An option that defines the run and disagrees with the checkpoint names both values.
    let line = one_error(
        &fsdp(&[
            "train",
            "--resume",
            s(&ck),
            "--steps",
            "12",
            "--n-layer",
            "3",
        ]),
        &["--n-layer 3", "--n-layer 2", "step-8"],
    );
    println!("{line}");
    one_error(
        &fsdp(&["train", "--resume", s(&ck), "--steps", "12", "--lr", "0.01"]),
        &["--lr 0.01", "--lr 0.003"],
    );
    one_error(
        &fsdp(&["train", "--resume", s(&ck), "--steps", "8"]),
        &["at step 8", "--steps"],
    );
    // A directory holding another run's checkpoints is not written into.
    one_error(
        &train(&[
            "--ranks",
            "2",
            "--steps",
            "2",
            "--checkpoint-dir",
            s(&ck),
            "--checkpoint-every",
            "1",
        ]),
        &["--checkpoint-dir", "already holds checkpoints", "--resume"],
    );
    one_error(
        &train(&["--steps", "2", "--checkpoint-every", "1"]),
        &["--checkpoint-every needs --checkpoint-dir"],
    );
    one_error(
        &train(&["--steps", "2", "--checkpoint-dir", s(&d.join("x"))]),
        &["--checkpoint-dir needs --checkpoint-every"],
    );
    assert_eq!(checkpoints(&ck), (vec![6, 8], vec![]));
    // Every option from the checkpoint, its 2 ranks included; checkpoints go on into it.
    let stdout = ok(
        &fsdp(&["train", "--resume", s(&ck), "--steps", "10"]),
        "resuming with no other option",
    );
    assert!(stdout.contains("fsdp train: 2 ranks"), "{stdout}");
    assert!(stdout.contains("at step 8 of 10"), "{stdout}");
    assert_eq!(checkpoints(&ck), (vec![8, 10], vec![]));
    let _ = std::fs::remove_dir_all(&d);
}

/// `before`, two ranks and a batch of 4 rows, then `after`.
fn on_two_ranks<'a>(before: &[&'a str], after: &[&'a str]) -> Vec<&'a str> {
    [before, &TWO_RANKS, after].concat()
}

#[test]
fn init_from_reads_the_model_sizes() {
    let d = scratch("init-from");
    let model = d.join("model.safetensors");
    // A model of non-default sizes, saved with its sizes as metadata.
    ok(
        &fsdp(&on_two_ranks(
            &[
                "train",
                "--n-layer",
                "3",
                "--n-head",
                "2",
                "--n-embd",
                "48",
                "--block-size",
                "16",
                "--vocab-size",
                "80",
            ],
            &["--steps", "1", "--save", s(&model)],
        )),
        "saving a model",
    );
    let sizes = fsdp_gpt::checkpoint::read_sizes(&model).unwrap();
    assert_eq!(
        sizes.sizes,
        [Some(3), Some(2), Some(48), Some(16), Some(80)]
    );
    assert_eq!(sizes.from_metadata, [true; 5]);
    let stdout = ok(
        &fsdp(&on_two_ranks(
            &["train", "--init-from", s(&model)],
            &["--steps", "2"],
        )),
        "training from it without the size options",
    );
    assert!(
        stdout.contains("GPT 3 layers × 2 heads × 48 wide"),
        "{stdout}"
    );
    let line = one_error(
        &fsdp(&[
            "train",
            "--init-from",
            s(&model),
            "--n-embd",
            "32",
            "--steps",
            "1",
        ]),
        &["--n-embd 32", "--n-embd 48", "--init-from"],
    );
    println!("{line}");
    // A file without metadata (PyTorch's): the sizes its shapes tell, never n_head.
    let fixture = common::fixture("gpt_tiny_init.safetensors");
    let sizes = fsdp_gpt::checkpoint::read_sizes(&fixture).unwrap();
    assert_eq!(sizes.sizes, [Some(2), None, Some(32), Some(16), Some(96)]);
    assert_eq!(sizes.from_metadata, [false; 5]);
    let stdout = ok(
        &fsdp(&on_two_ranks(
            &["train", "--init-from", s(&fixture), "--n-head", "2"],
            &["--steps", "1"],
        )),
        "training from a file without metadata",
    );
    assert!(
        stdout.contains("GPT 2 layers × 2 heads × 32 wide"),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
