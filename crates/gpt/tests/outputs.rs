//! The `fsdp` program never damages a user's data through its outputs (`--save`, `--loss-log`,
//! `--trace`): every output path is checked before any rank starts; a directory, a device, a
//! FIFO or a socket is never replaced; symbolic links stay links; temporaries of dead writers are
//! cleaned up and those of live ones left alone; the loss log of a killed run keeps every
//! finished step.

#![cfg(unix)]

mod common;

use std::fs;
use std::io::Read;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::cli::{command, one_error, parse_losses, s, small_train_args, SMALL_MODEL, TWO_RANKS};

/// Two ranks and a small batch, after `SMALL_MODEL`.
const SMALL: [&str; 4] = TWO_RANKS;

const HEADER: &str = common::cli::LOSS_LOG_HEADER;

/// Runs `fsdp train SMALL extra`, killed (and failed) after `limit` (a FIFO that is opened by
/// mistake would block forever).
fn train_within(extra: &[&str], limit: Duration) -> Output {
    let args = small_train_args(&SMALL, extra);
    let mut child = command(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running the fsdp binary");
    // Drain the pipes while waiting.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let so = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let se = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("fsdp train {extra:?} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: so.join().unwrap(),
        stderr: se.join().unwrap(),
    }
}

fn train(extra: &[&str]) -> Output {
    train_within(extra, Duration::from_secs(120))
}

/// A fresh, empty directory for one test.
fn scratch(test: &str) -> PathBuf {
    common::cli::scratch("outputs", test)
}

fn ok(out: &Output) -> String {
    common::cli::ok(out, "the run")
}

/// Exactly one stderr line, `error: ...` containing every needle, a non-zero exit status, no
/// panic — and no training: no step was reported. Returns the line.
fn one_error_before_training(out: &Output, needles: &[&str]) -> String {
    let line = one_error(out, needles);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("step"), "training started: {stdout}");
    println!("{line}");
    line
}

/// Runs a tool (`mkfifo`, `mknod`); false, with a message, when it is missing or fails.
fn tool(program: &str, args: &[&str]) -> bool {
    match Command::new(program).args(args).output() {
        Ok(o) if o.status.success() => true,
        Ok(o) => {
            println!(
                "skipped: `{program} {}` failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&o.stderr).trim()
            );
            false
        }
        Err(e) => {
            println!("skipped: `{program}` is unavailable: {e}");
            false
        }
    }
}

fn mkfifo(p: &Path) -> bool {
    tool("mkfifo", &[s(p)])
}

/// A character device node equal to `/dev/null` (1, 3): needs root and a file system that
/// allows device nodes.
fn mknod_null(p: &Path) -> bool {
    tool("mknod", &[s(p), "c", "1", "3"])
}

fn file_type(p: &Path) -> fs::FileType {
    fs::symlink_metadata(p).unwrap().file_type()
}

/// The data lines of a loss log, each parsed; every line complete and numbered from 0.
fn parse_log(text: &str) -> Vec<f64> {
    let losses = parse_losses(text);
    assert!(losses.iter().all(|l| l.is_finite()), "{text:?}");
    losses
}

#[test]
fn save_onto_a_directory_fifo_or_device_is_refused_before_training() {
    let d = scratch("save-refused");
    let dir = d.join("a-dir");
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("keep.txt"), b"user data").unwrap();
    one_error_before_training(
        &train(&["--save", s(&dir)]),
        &["--save", s(&dir), "is a directory"],
    );
    assert!(file_type(&dir).is_dir());
    assert_eq!(fs::read(dir.join("keep.txt")).unwrap(), b"user data");

    let fifo = d.join("a-fifo");
    if mkfifo(&fifo) {
        // Refused without opening it (which would wait for a reader).
        one_error_before_training(
            &train_within(&["--save", s(&fifo)], Duration::from_secs(60)),
            &["--save", s(&fifo), "is a FIFO"],
        );
        assert!(file_type(&fifo).is_fifo());
    }

    let node = d.join("a-null-device");
    if mknod_null(&node) {
        one_error_before_training(
            &train(&["--save", s(&node)]),
            &["--save", s(&node), "is a character device"],
        );
        assert!(file_type(&node).is_char_device());
        // Through a symbolic link too: the link and the device stay.
        let link = d.join("link-to-device");
        std::os::unix::fs::symlink(&node, &link).unwrap();
        one_error_before_training(
            &train(&["--save", s(&link)]),
            &["--save", s(&link), "which is a character device"],
        );
        assert!(file_type(&link).is_symlink());
        assert!(file_type(&node).is_char_device());
    }
    // Nothing else appeared.
    let mut names: Vec<String> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(
        names.iter().all(|n| !n.contains("fsdp-")),
        "leftovers: {names:?}"
    );
}

#[test]
fn loss_log_and_trace_stream_into_a_fifo_and_a_character_device() {
    let d = scratch("streams");
    let fifo = d.join("loss-fifo");
    if mkfifo(&fifo) {
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || fs::read_to_string(fifo).unwrap())
        };
        ok(&train(&["--steps", "4", "--loss-log", s(&fifo)]));
        let text = reader.join().unwrap();
        assert_eq!(parse_log(&text).len(), 4, "{text}");
        assert!(file_type(&fifo).is_fifo());

        // A trace into a FIFO.
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || fs::read_to_string(fifo).unwrap())
        };
        ok(&train(&["--steps", "1", "--trace", s(&fifo)]));
        let json = reader.join().unwrap();
        assert!(json.contains("traceEvents"), "{json}");
        assert!(file_type(&fifo).is_fifo());
    }

    let node = d.join("null-device");
    if mknod_null(&node) {
        ok(&train(&[
            "--steps",
            "2",
            "--loss-log",
            s(&node),
            "--trace",
            s(&node),
        ]));
        assert!(file_type(&node).is_char_device());
    }
    // /dev/null itself.
    if Path::new("/dev/null").exists() {
        ok(&train(&["--steps", "1", "--loss-log", "/dev/null"]));
        assert!(file_type(Path::new("/dev/null")).is_char_device());
    }
}

#[test]
fn save_through_a_symbolic_link_replaces_its_target() {
    let d = scratch("symlink");
    let target = d.join("weights.safetensors");
    fs::write(&target, b"previous weights").unwrap();
    let link = d.join("latest.safetensors");
    std::os::unix::fs::symlink("weights.safetensors", &link).unwrap();
    ok(&train(&["--steps", "2", "--save", s(&link)]));
    assert!(file_type(&link).is_symlink());
    assert_eq!(
        fs::read_link(&link).unwrap(),
        PathBuf::from("weights.safetensors")
    );
    assert!(file_type(&target).is_file());
    let bytes = fs::read(&target).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("new weights in the target");
    assert_eq!(
        st.tensor("transformer.wte.weight").unwrap().shape(),
        &[64, 32]
    );

    // A dangling link: its target is created, the link stays.
    let dangling = d.join("dangling.safetensors");
    std::os::unix::fs::symlink("created.safetensors", &dangling).unwrap();
    ok(&train(&["--steps", "1", "--save", s(&dangling)]));
    assert!(file_type(&dangling).is_symlink());
    assert!(file_type(&d.join("created.safetensors")).is_file());
}

#[test]
fn a_loss_log_onto_a_directory_fails_before_anything_is_written() {
    let d = scratch("log-dir");
    let adir = d.join("adir");
    fs::create_dir(&adir).unwrap();
    let save = d.join("s.st");
    one_error_before_training(
        &train(&["--steps", "2", "--loss-log", s(&adir), "--save", s(&save)]),
        &["--loss-log", s(&adir), "is a directory"],
    );
    assert!(!save.exists());
    assert_eq!(fs::read_dir(&adir).unwrap().count(), 0);
    assert_eq!(fs::read_dir(&d).unwrap().count(), 1, "only adir");

    // A directory that does not exist, and two outputs on one file.
    let missing = d.join("missing/s.st");
    one_error_before_training(
        &train(&["--save", s(&missing)]),
        &["--save", "does not exist"],
    );
    one_error_before_training(
        &train(&["--save", s(&save), "--loss-log", s(&save)]),
        &["--save and --loss-log name the same file"],
    );
    assert!(!save.exists());
    // An output onto an input.
    let data = d.join("train.bin");
    let tokens: Vec<u8> = (0..4096u32)
        .flat_map(|i| ((i % 64) as u16).to_le_bytes())
        .collect();
    fs::write(&data, &tokens).unwrap();
    one_error_before_training(
        &train(&["--data", s(&data), "--loss-log", s(&data)]),
        &["--loss-log", "is the --data file"],
    );
    assert_eq!(fs::read(&data).unwrap(), tokens);
}

#[test]
fn stale_temporaries_are_removed_and_live_ones_kept() {
    let d = scratch("stale");
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = d.join(format!(".s.st.fsdp-tmp.{dead}"));
    let live = d.join(format!(".s.st.fsdp-tmp.{}", std::process::id()));
    fs::write(&stale, b"partial").unwrap();
    fs::write(&live, b"in progress").unwrap();
    let save = d.join("s.st");
    ok(&train(&["--steps", "1", "--save", s(&save)]));
    assert!(save.is_file());
    if cfg!(target_os = "linux") {
        assert!(!stale.exists(), "the dead writer's temporary stays");
    }
    assert_eq!(fs::read(&live).unwrap(), b"in progress");
    // Nothing else is left behind.
    let mut names: Vec<String> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut expected = vec![
        "s.st".to_string(),
        live.file_name().unwrap().to_string_lossy().into_owned(),
    ];
    expected.sort();
    assert_eq!(names, expected);
}

#[test]
fn the_loss_log_of_a_killed_run_keeps_complete_lines() {
    let d = scratch("killed");
    let log = d.join("loss.csv");
    // An existing file is truncated when training starts.
    fs::write(&log, b"old content\n").unwrap();
    let args = small_train_args(&SMALL, &["--steps", "100000", "--loss-log", s(&log)]);
    let mut child = command(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let text = fs::read_to_string(&log).unwrap_or_default();
        let complete = text.matches('\n').count();
        if text.starts_with(HEADER) && complete >= 4 {
            break;
        }
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            panic!("the loss log did not get 3 lines: {text:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let text = fs::read_to_string(&log).unwrap();
    assert!(text.ends_with('\n'), "a partial line: {text:?}");
    let losses = parse_log(&text);
    assert!(losses.len() >= 3, "{text}");
    println!("{} steps kept", losses.len());
}

#[test]
fn rank_trace_files_are_checked_before_any_rank_starts() {
    let d = scratch("launch-trace");
    let trace = d.join("t.json");
    // Rank 1's trace file would be t.rank1.json: a directory.
    fs::create_dir(d.join("t.rank1.json")).unwrap();
    let mut args = vec!["launch", "-n", "2", "--master-port", "0", "train"];
    args.extend_from_slice(&SMALL_MODEL);
    args.extend_from_slice(&["--batch-size", "4", "--steps", "1", "--trace", s(&trace)]);
    let out = command(&args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--trace (rank 1's file)") && stderr.contains("is a directory"),
        "{stderr}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("step"));
    assert!(!trace.exists());
    assert!(d.join("t.rank1.json").is_dir());
}
