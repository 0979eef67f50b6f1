//! `fsdp train` under PyTorch's torchrun (`python -m torch.distributed.run --no-python`):
//! the ranks join torchrun's agent store; the loss log is bitwise that of `fsdp train --ranks 2`;
//! a rank killed mid-run puts our error message (naming the rank that left) in torchrun's
//! summary; with `--max-restarts 1` the restarted attempt resumes from `--checkpoint-dir` and
//! ends with the loss log of an uninterrupted run.
//!
//! Needs a Python with torch, named by `FSDP_TORCH_PYTHON`; without it each test prints
//! `skipped: no torch` and passes.

mod common;

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::cli::{free_port, fsdp, ok, s, scratch, text, torch_python, SMALL_MODEL};

/// `torchrun --nproc-per-node 2 --master-port P [extra] --no-python fsdp train ...`.
fn torchrun(py: &str, dir: &Path, extra: &[&str], train: &[&str]) -> Command {
    let port = free_port().to_string();
    let mut c = Command::new(py);
    c.args(["-m", "torch.distributed.run", "--nproc-per-node", "2"])
        .args(["--master-port", &port])
        .args(extra)
        .args(["--no-python", env!("CARGO_BIN_EXE_fsdp"), "train"])
        .args(SMALL_MODEL)
        .args(train)
        .current_dir(dir)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Waits for `child` up to `limit` (then kills it: the test fails rather than hangs).
fn finish(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.wait_with_output().unwrap()
}

/// The pid of the worker of `rank` among the children of `parent` (from /proc).
fn worker(parent: u32, rank: usize) -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        if rest.split_whitespace().nth(1) != Some(&parent.to_string()) {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let want = format!("RANK={rank}");
        if env.split(|&b| b == 0).any(|kv| kv == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// Kills rank 1 once `ready` holds (within a minute).
fn kill_rank_1_when(torchrun: &Child, ready: impl Fn() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < Duration::from_secs(60), "never ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = worker(torchrun.id(), 1).expect("rank 1's process");
    let status = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// The `step,loss` columns of a loss log (the others are timings).
fn losses(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| l.split(',').take(2).collect::<Vec<_>>().join(","))
        .collect()
}

#[test]
fn torchrun_gives_the_loss_log_of_two_ranks() {
    let Some(py) = torch_python("torch.distributed.run") else {
        println!("skipped: no torch");
        return;
    };
    let dir = scratch("torchrun", "same_losses");
    let train = ["--batch-size", "4", "--steps", "8", "--loss-log", "tr.log"];
    let out = finish(
        torchrun(&py, &dir, &[], &train).spawn().unwrap(),
        Duration::from_secs(240),
    );
    ok(&out, "torchrun");
    let mut args = vec!["train"];
    args.extend_from_slice(&SMALL_MODEL);
    args.extend_from_slice(&["--ranks", "2", "--batch-size", "4", "--steps", "8"]);
    let reference = dir.join("ref.log");
    args.extend_from_slice(&["--loss-log", s(&reference)]);
    ok(&fsdp(&args), "fsdp train --ranks 2");
    let got = losses(&dir.join("tr.log"));
    assert_eq!(got.len(), 9);
    assert_eq!(got, losses(&reference));
    println!("torchrun: 8 steps, loss log bitwise that of --ranks 2");
}

#[test]
fn a_killed_rank_shows_our_error_in_torchruns_summary() {
    let Some(py) = torch_python("torch.distributed.run") else {
        println!("skipped: no torch");
        return;
    };
    let dir = scratch("torchrun", "killed");
    let train = [
        "--batch-size",
        "4",
        "--steps",
        "100000",
        "--loss-log",
        "k.log",
    ];
    let child = torchrun(&py, &dir, &[], &train).spawn().unwrap();
    let log = dir.join("k.log");
    kill_rank_1_when(&child, || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.lines().count() > 3)
    });
    let out = finish(child, Duration::from_secs(120));
    assert!(!out.status.success());
    let err = text(&out.stderr);
    // The summary shows rank 0's error file (not its own `error:` line): its message names
    // the rank that left.
    let line = err
        .lines()
        .find(|l| {
            !l.starts_with("error:") && l.contains("rank 0:") && l.contains("rank 1 has left")
        })
        .unwrap_or_else(|| panic!("no error of rank 0 naming rank 1 in the summary:\n{err}"));
    assert!(err.contains("error_file: /"), "{err}");
    assert!(err.contains("Signal 9 (SIGKILL)"), "{err}");
    println!("torchrun's summary: {}", line.trim());
}

#[test]
fn a_restarted_attempt_resumes_from_the_checkpoint_dir() {
    let Some(py) = torch_python("torch.distributed.run") else {
        println!("skipped: no torch");
        return;
    };
    let dir = scratch("torchrun", "restart");
    let steps = "200";
    let train = [
        "--batch-size",
        "4",
        "--steps",
        steps,
        "--loss-log",
        "r.log",
        "--checkpoint-dir",
        "ck",
        "--checkpoint-every",
        "20",
    ];
    let child = torchrun(&py, &dir, &["--max-restarts", "1"], &train)
        .spawn()
        .unwrap();
    let log = dir.join("r.log");
    kill_rank_1_when(&child, || {
        dir.join("ck/step-20").is_dir()
            && std::fs::read_to_string(&log).is_ok_and(|t| t.lines().count() > 30)
    });
    let out = finish(child, Duration::from_secs(300));
    let stdout = ok(&out, "torchrun --max-restarts 1");
    let resumed = stdout
        .lines()
        .find(|l| l.starts_with("resuming from"))
        .unwrap_or_else(|| panic!("no resume in:\n{stdout}"));
    let mut args = vec!["train"];
    args.extend_from_slice(&SMALL_MODEL);
    args.extend_from_slice(&["--ranks", "2", "--batch-size", "4", "--steps", steps]);
    let reference = dir.join("ref.log");
    args.extend_from_slice(&["--loss-log", s(&reference)]);
    ok(&fsdp(&args), "fsdp train --ranks 2");
    assert_eq!(losses(&log), losses(&reference));
    println!("{resumed}; loss log bitwise that of an uninterrupted run");
}
