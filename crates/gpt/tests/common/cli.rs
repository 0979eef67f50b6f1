//! Helpers shared by the tests that run the `fsdp` binary as a process (`cli.rs`,
//! `nonfinite.rs`, `outputs.rs`, `resume.rs`, `admission.rs`, `multiprocess.rs`,
//! `grad_scaler_cli.rs`, `any_precision_cli.rs`): running it, small fast configurations, scratch
//! directories, checkpoint-and-resume arguments, the checks of its error lines, the parsing of
//! its loss logs, safetensors files written as given, and the bounded waits and loss comparisons
//! of the multi-node launcher tests (`launch_nodes.rs`, `two_nodes.rs`).

// Each test crate that includes this module uses a different subset of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use safetensors::tensor::TensorView;

/// A small, fast model (the defaults take about a minute).
pub const SMALL_MODEL: [&str; 10] = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "16",
    "--vocab-size",
    "64",
];

/// A one-layer model (default vocabulary), smaller still.
pub const ONE_LAYER: [&str; 8] = [
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--block-size",
    "16",
];

/// Gradient clipping, accumulation over 2 micro-batches, the cosine schedule with 4 warm-up
/// steps and weight decay on the 2-d parameters only: the options the device trainer's tests
/// (`device_cli.rs`, `gpu_device_train.rs`) run against the engine besides the defaults.
pub const CLIP_ACCUM_COSINE: [&str; 9] = [
    "--grad-clip",
    "0.5",
    "--grad-accum",
    "2",
    "--lr-schedule",
    "cosine",
    "--warmup-iters",
    "4",
    "--decay-2d-only",
];

/// Two ranks and a global batch of 4 rows.
pub const TWO_RANKS: [&str; 4] = ["--ranks", "2", "--batch-size", "4"];

/// The header line of a loss log.
pub const LOSS_LOG_HEADER: &str = "step,loss,tokens_per_s,peak_allocated_bytes_rank0";

/// The `fsdp` binary with `args`, as a thread run (or a launcher), whatever the caller's
/// environment (`RANK` and `WORLD_SIZE` removed).
pub fn command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_fsdp"));
    c.args(args).env_remove("RANK").env_remove("WORLD_SIZE");
    c
}

/// Runs `fsdp args` to the end.
pub fn fsdp(args: &[&str]) -> Output {
    command(args).output().expect("running the fsdp binary")
}

/// `train`, then [`SMALL_MODEL`], then `config`, then `extra`.
pub fn small_train_args<'a>(config: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["train"];
    args.extend_from_slice(&SMALL_MODEL);
    args.extend_from_slice(config);
    args.extend_from_slice(extra);
    args
}

/// The checkpoint directory, the loss log and the reference loss log of a resume test in
/// `dir`: `(ck, log.csv, ref.csv)`.
pub fn resume_paths(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    (dir.join("ck"), dir.join("log.csv"), dir.join("ref.csv"))
}

/// `--loss-log log --checkpoint-dir ck --checkpoint-every every`.
pub fn checkpointing_args<'a>(log: &'a Path, ck: &'a Path, every: &'a str) -> [&'a str; 6] {
    [
        "--loss-log",
        s(log),
        "--checkpoint-dir",
        s(ck),
        "--checkpoint-every",
        every,
    ]
}

/// Runs `fsdp train --resume ck`, then `extra`, to the end.
pub fn resume(ck: &Path, extra: &[&str]) -> Output {
    fsdp(&[&["train", "--resume", s(ck)][..], extra].concat())
}

/// `name` in the directory `group` under the cargo target's scratch directory (created, never
/// emptied).
pub fn tmp(group: &str, name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(group);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A fresh, empty directory `group/test` under the cargo target's scratch directory.
pub fn scratch(group: &str, test: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(group)
        .join(test);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A successful run (`what` names it in the failure message); returns its stdout.
pub fn ok(out: &Output, what: &str) -> String {
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{what} failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        text(&out.stderr)
    );
    stdout
}

/// Exactly one stderr line, `error: ...` containing every one of `needles`, a non-zero exit
/// status, and no panic. Returns the line.
pub fn one_error(out: &Output, needles: &[&str]) -> String {
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "exit status 0; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "not one error line: {stderr:?}");
    assert!(lines[0].starts_with("error: "), "{stderr:?}");
    for needle in needles {
        assert!(
            lines[0].contains(needle),
            "error line {:?} does not mention {needle:?}",
            lines[0]
        );
    }
    lines[0].to_string()
}

/// [`one_error`] with exit status 1 (not an abort, 134, or a signal).
pub fn one_error_status_1(out: &Output, needles: &[&str]) -> String {
    assert_eq!(
        out.status.code(),
        Some(1),
        "{:?}; stderr: {}",
        out.status,
        text(&out.stderr)
    );
    one_error(out, needles)
}

/// The data rows of a loss log, split into fields: the header checked, four fields a row,
/// the rows numbered from 0.
pub fn loss_log_rows(text: &str) -> Vec<Vec<&str>> {
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(LOSS_LOG_HEADER), "{text:?}");
    lines
        .enumerate()
        .map(|(i, l)| {
            let f: Vec<&str> = l.split(',').collect();
            assert_eq!(f.len(), 4, "{l:?}");
            assert_eq!(f[0].parse::<usize>().unwrap(), i, "{l:?}");
            f
        })
        .collect()
}

/// The losses of a loss log's text, every row with a positive throughput and peak memory.
pub fn parse_losses(text: &str) -> Vec<f64> {
    loss_log_rows(text)
        .into_iter()
        .map(|f| {
            assert!(f[2].parse::<f64>().unwrap() > 0.0, "{f:?}");
            assert!(f[3].parse::<u64>().unwrap() > 0, "{f:?}");
            f[1].parse::<f64>().unwrap()
        })
        .collect()
}

/// [`parse_losses`] of the loss log at `path`.
pub fn read_losses(path: &Path) -> Vec<f64> {
    parse_losses(&std::fs::read_to_string(path).unwrap())
}

/// The loss column of a loss log as written (for bitwise comparisons).
pub fn loss_column(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(1).unwrap().to_string())
        .collect()
}

/// One tensor of a safetensors file as written: name, dtype, shape and little-endian bytes.
pub type RawTensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// The `f32` tensor `name` of `shape` holding `values`.
pub fn f32_tensor(name: &str, shape: &[usize], values: &[f32]) -> RawTensor {
    let bytes = values.iter().flat_map(|x| x.to_le_bytes()).collect();
    (
        name.to_owned(),
        safetensors::Dtype::F32,
        shape.to_vec(),
        bytes,
    )
}

/// Writes `tensors` as a safetensors file, whatever their bytes.
pub fn write_raw_safetensors(path: &Path, tensors: &[RawTensor]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, dtype, shape, b)| {
            (
                n.clone(),
                TensorView::new(*dtype, shape.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, &None).unwrap()).unwrap();
}

/// Writes `tensors` (name, shape, values) as an f32 safetensors file, whatever the values.
pub fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let raw: Vec<RawTensor> = tensors
        .iter()
        .map(|(n, shape, v)| f32_tensor(n, shape, v))
        .collect();
    write_raw_safetensors(path, &raw);
}

/// A TCP port free on loopback right now (the operating system's choice).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits for `child` at most `bound` (killing it past the bound, and failing); returns its
/// output and how long it ran from here.
pub fn finish(child: Child, bound: Duration, what: &str) -> (Output, Duration) {
    let start = Instant::now();
    let pid = child.id();
    let killer = std::thread::spawn(move || {
        while start.elapsed() < bound {
            std::thread::sleep(Duration::from_millis(100));
            if std::fs::metadata(format!("/proc/{pid}")).is_err() {
                return false;
            }
        }
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        true
    });
    let out = child.wait_with_output().expect("wait for fsdp launch");
    let took = start.elapsed();
    let killed = killer.join().unwrap();
    assert!(
        !killed || took < bound,
        "{what} ran past {bound:?} and was killed; stderr:\n{}",
        text(&out.stderr)
    );
    (out, took)
}

/// Waits for the launchers of node 0 and node 1 (each at most `bound`, see [`finish`]); both
/// must succeed. Returns node 0's standard output.
pub fn both_nodes_ok(node0: Child, node1: Child, bound: Duration) -> String {
    let (out0, _) = finish(node0, bound, "node 0");
    let (out1, _) = finish(node1, bound, "node 1");
    let stdout0 = ok(&out0, "node 0");
    ok(&out1, "node 1");
    stdout0
}

/// The loss logs of a run on 4 threads and one on 2 nodes × 2 processes: `steps` losses, equal
/// bitwise. Prints both, each line starting with `label`.
pub fn assert_same_losses(label: &str, threads_log: &Path, nodes_log: &Path, steps: usize) {
    let a = loss_column(threads_log);
    let b = loss_column(nodes_log);
    println!("{label}4 threads {a:?}\n{label}2 nodes × 2 processes {b:?}");
    assert_eq!(a.len(), steps);
    assert_eq!(a, b, "the two-node run's losses differ from the threads'");
}

/// The Python named by `FSDP_TORCH_PYTHON` if it can import `module` (tests that need torch
/// skip without it).
pub fn torch_python(module: &str) -> Option<String> {
    let py = std::env::var("FSDP_TORCH_PYTHON").ok()?;
    let ok = Command::new(&py)
        .args(["-c", &format!("import {module}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(py)
}

/// The golden configuration of `tests/fixtures/README.md`.
pub fn golden_args<'a>(
    ranks: &'a str,
    init: &'a str,
    log: &'a str,
    save: &'a str,
    data: &'a str,
) -> Vec<&'a str> {
    // The sizes of `SMALL_MODEL` but the fixtures' vocabulary of 96.
    let mut args = vec!["train"];
    args.extend_from_slice(&SMALL_MODEL[..8]);
    args.extend_from_slice(&[
        "--vocab-size",
        "96",
        "--batch-size",
        "8",
        "--steps",
        "10",
        "--lr",
        "1e-3",
        "--beta1",
        "0.9",
        "--beta2",
        "0.95",
        "--eps",
        "1e-8",
        "--weight-decay",
        "0.1",
        "--ranks",
        ranks,
        "--init-from",
        init,
        "--loss-log",
        log,
        "--save",
        save,
        "--data",
        data,
    ]);
    args
}

/// The losses of a loss log (`--loss-log`), step by step.
pub fn log_losses(path: &Path) -> Vec<f64> {
    loss_log_rows(&std::fs::read_to_string(path).unwrap())
        .into_iter()
        .map(|f| f[1].parse().unwrap())
        .collect()
}

/// The engine's run of the small model (`cpu`: its loss log and `--save`d weights) against
/// the device's (`twin`) over `steps` steps: every step's loss within `bound` relative, the
/// loss falling by at least 0.1, every final weight within `weights` of the model's largest
/// weight (not of each tensor's: the attention's key bias has a gradient that is 0 up to
/// rounding, which AdamW normalises into updates of either sign, so its values, about 1e-6,
/// are rounding noise on both sides). Prints both largest differences and returns the
/// losses'.
pub fn assert_runs_agree(
    test: &str,
    cpu: (&Path, &Path),
    twin: (&Path, &Path),
    steps: usize,
    bound: f64,
    weights: f64,
) -> f64 {
    let (e, d) = (log_losses(cpu.0), log_losses(twin.0));
    assert_eq!((e.len(), d.len()), (steps, steps));
    let mut max = 0.0f64;
    for (step, (le, ld)) in e.iter().zip(&d).enumerate() {
        let r = (ld - le).abs() / le.abs();
        assert!(r <= bound, "{test}: step {step}: {ld} vs {le} ({r:.2e})");
        max = max.max(r);
    }
    assert!(
        e[steps - 1] < e[0] - 0.1,
        "{test}: the loss must fall: {e:?}"
    );
    let cfg = fsdp_gpt::model::GptConfig::new(2, 2, 32, 16, 64).unwrap();
    let load = |p: &Path| fsdp_gpt::checkpoint::load_full(p, &cfg).unwrap();
    let (we, wd) = (load(cpu.1), load(twin.1));
    let scale = we.values().flatten().fold(0.0f32, |m, x| m.max(x.abs()));
    let mut wmax = 0.0f64;
    for (name, v) in &we {
        for (x, y) in v.iter().zip(&wd[name]) {
            let r = f64::from((x - y).abs() / scale);
            assert!(r <= weights, "{test}: {name}: {y} vs {x} ({r:.2e})");
            wmax = wmax.max(r);
        }
    }
    println!(
        "{test}: max relative loss difference {max:.2e} over {steps} steps; final weights \
         within {wmax:.2e} of their largest magnitude"
    );
    max
}

/// The engine's `fsdp train` of the small model on the CPU (batch 8, `steps` steps, `ranks`
/// ranks, `strategy`, f32 parameters, then `extra`) against the same run with `device` added,
/// both with `--loss-log` and `--save` in `dir`: the device run says `expect` and `done:
/// {steps} steps`, and [`assert_runs_agree`] within `bound` (losses) and `weights`.
pub fn cpu_against_device(
    dir: &Path,
    test: &str,
    (ranks, strategy, steps): (&str, &str, usize),
    (extra, device): (&[&str], &[&str]),
    expect: &str,
    (bound, weights): (f64, f64),
) {
    let (cpu, twin) = (dir.join("cpu.csv"), dir.join("twin.csv"));
    let (cpu_w, twin_w) = (dir.join("cpu.safetensors"), dir.join("twin.safetensors"));
    let n = steps.to_string();
    let base = [
        "--batch-size",
        "8",
        "--steps",
        &n,
        "--ranks",
        ranks,
        "--strategy",
        strategy,
        "--param-dtype",
        "f32",
    ];
    let base = &base[..];
    let mut a = small_train_args(base, extra);
    a.extend(["--loss-log", s(&cpu), "--save", s(&cpu_w)]);
    ok(&fsdp(&a), "fsdp train (the engine on the CPU)");
    let mut b = small_train_args(base, extra);
    b.extend(device);
    b.extend(["--loss-log", s(&twin), "--save", s(&twin_w)]);
    let out = ok(&fsdp(&b), &format!("fsdp train {}", device.join(" ")));
    assert!(out.contains(expect), "{out}");
    assert!(out.contains(&format!("done: {steps} steps")), "{out}");
    assert_runs_agree(
        test,
        (&cpu, &cpu_w),
        (&twin, &twin_w),
        steps,
        bound,
        weights,
    );
}

/// `fsdp train` with the learning rate 1e30 (its first update makes the model's next loss
/// NaN) and `extra`, run as `engine` says (`--ranks N`) and on the host twins (`twin` added to
/// `--device host-twin`): both must stop with the same one `error:` line about a non-finite
/// step; returns that line and the host-twin run's standard output.
pub fn nonfinite_on_both(extra: &[&str], engine: &[&str], twin: &[&str]) -> (String, String) {
    let base = ["--batch-size", "8", "--lr", "1e30"];
    let cpu = fsdp(&small_train_args(&base, &[extra, engine].concat()));
    let on_twin = fsdp(&small_train_args(
        &base,
        &[extra, &["--device", "host-twin"], twin].concat(),
    ));
    let (a, b) = (
        one_error_status_1(&cpu, &["non-finite"]),
        one_error_status_1(&on_twin, &["non-finite"]),
    );
    assert_eq!(a, b, "the same error line");
    (a, text(&on_twin.stdout))
}

/// [`nonfinite_on_both`]: a run of 5 steps stops at step 1 with the engine's line, and with
/// `--skip-nonfinite 1` step 1 is skipped (its line printed) and step 2 stops the run.
pub fn nonfinite_stops_and_skips_as_the_engine(engine: &[&str], twin: &[&str]) {
    let (line, _) = nonfinite_on_both(&["--steps", "5"], engine, twin);
    assert!(
        line.starts_with("error: step 1: the loss is NaN (non-finite)"),
        "{line}"
    );
    let (line, stdout) =
        nonfinite_on_both(&["--steps", "4", "--skip-nonfinite", "1"], engine, twin);
    assert!(line.starts_with("error: step 2: the loss is NaN"), "{line}");
    assert!(
        stdout.contains("step 1: the loss is NaN: skipped (1 of"),
        "{stdout}"
    );
}

/// The run's `device:` line of `dev` in `out` and the first per-rank peak it reports.
pub fn device_peak_line<'a>(out: &'a str, dev: &str) -> (&'a str, &'a str) {
    let line = out
        .lines()
        .find(|l| l.contains(&format!("device: {dev}")))
        .unwrap_or_else(|| panic!("no device line: {out}"));
    let peak = line
        .split("per rank ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap_or_else(|| panic!("no peak: {line}"));
    (line, peak)
}
