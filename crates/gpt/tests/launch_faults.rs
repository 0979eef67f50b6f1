//! `fsdp launch`'s faults: the primary failure is reported with its real status (kill -9 of
//! rank 2 of 3 is `rank 2 ... status 137`, not the peer that noticed it; on the sharded engine
//! and on the device's host twins), `--timeout` and
//! `--init-timeout` reach the ranks, and `--backend ring` is refused before any rank starts.

mod common;

use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::cli::{command, fsdp, text, SMALL_MODEL};

/// The pids of the children of `parent` (from /proc).
fn children(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": the comm may hold spaces, so split after its ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        if rest.split_whitespace().nth(1) == Some(&parent.to_string()) {
            out.push(pid);
        }
    }
    out
}

/// The value of `var` in the environment of process `pid`.
fn env_of(pid: u32, var: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0).find_map(|kv| {
        let kv = String::from_utf8_lossy(kv);
        kv.strip_prefix(&format!("{var}=")).map(str::to_string)
    })
}

#[test]
fn kill_9_of_rank_2_is_reported_as_rank_2_with_137() {
    kill_9_of_rank_2(&[]);
}

/// The same on the device's host twins, the collectives staged over TCP (`StagedComm`, the
/// code NCCL runs on GPUs) with an all-gather issued ahead in both directions: no rank hangs
/// on a collective in flight.
#[test]
fn kill_9_of_a_device_rank_is_reported_the_same() {
    kill_9_of_rank_2(&["--device", "host-twin", "--forward-prefetch"]);
}

/// Kills rank 2 of 3 training with `extra` once they train: the launcher ends within 30 s
/// with rank 2's status, blaming it alone.
fn kill_9_of_rank_2(extra: &[&str]) {
    #[cfg(target_os = "linux")]
    {
        let mut args = vec!["launch", "-n", "3", "--master-port", "0", "train"];
        args.extend_from_slice(&SMALL_MODEL);
        args.extend_from_slice(&["--batch-size", "6", "--steps", "100000", "--timeout", "60"]);
        args.extend_from_slice(extra);
        let mut child = command(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let launcher = child.id();
        // Wait until the ranks train (rank 0 prints its header after the communicator is up).
        let mut stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            let mut seen = String::new();
            let mut sent = false;
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                seen.push_str(&String::from_utf8_lossy(&buf[..n]));
                if !sent && seen.contains("[rank 0] fsdp train:") {
                    let _ = tx.send(());
                    sent = true;
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(120))
            .expect("the ranks never started training");
        std::thread::sleep(Duration::from_millis(500));
        let rank2 = children(launcher)
            .into_iter()
            .find(|&p| env_of(p, "RANK").as_deref() == Some("2"))
            .expect("rank 2's process");
        let killed = std::process::Command::new("kill")
            .args(["-9", &rank2.to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let start = Instant::now();
        let mut stderr = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        let status = child.wait().unwrap();
        assert!(start.elapsed() < Duration::from_secs(30), "{stderr}");
        assert_eq!(status.code(), Some(137), "{stderr}");
        assert!(
            stderr.contains("error: launch: rank 2 failed (killed by signal 9, status 137)"),
            "{stderr}"
        );
        // The ranks that noticed say why, and are not blamed.
        assert!(!stderr.contains("rank 0 failed ("), "{stderr}");
        assert!(!stderr.contains("rank 1 failed ("), "{stderr}");
    }
}

#[test]
fn backend_ring_under_launch_is_an_error_before_any_rank_starts() {
    for form in [&["--backend", "ring"][..], &["--backend=ring"][..]] {
        let mut args = vec!["launch", "-n", "2", "--master-port", "0", "train"];
        args.extend_from_slice(form);
        let out = fsdp(&args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert_eq!(
            err.trim(),
            "error: launch: --backend ring runs every rank as a thread of one process; under \
             fsdp launch use the default (tcp)"
        );
        assert!(!err.contains("[rank"), "a rank started: {err}");
    }
}

#[test]
fn launch_passes_the_timeouts_to_its_ranks() {
    let out = fsdp(&[
        "launch",
        "-n",
        "1",
        "--master-port",
        "0",
        "--timeout",
        "7",
        "--init-timeout",
        "2.5",
        "/bin/sh",
        "-c",
        "echo $FSDP_TIMEOUT/$FSDP_INIT_TIMEOUT",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "[rank 0] 7/2.5");
    let out = fsdp(&["train", "--timeout", "0", "--steps", "1"]);
    assert!(
        text(&out.stderr).contains("--timeout"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_rank_that_never_arrives_fails_after_the_init_timeout() {
    // Rank 1 of 2 is never started: rank 0 gives up after --init-timeout, not 300 s.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let start = Instant::now();
    let mut args = vec!["train", "--init-timeout", "2", "--steps", "1"];
    args.extend_from_slice(&SMALL_MODEL);
    let out = command(&args)
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port)
        .output()
        .unwrap();
    let took = start.elapsed();
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(took < Duration::from_secs(20), "{took:?}: {err}");
    assert!(err.contains("never arrived"), "{err}");
}

/// Under torchrun a signalled rank aborts its communicator with the signal as the reason: its
/// peers fail at once quoting it (not a bare "rank 1 has left"), as secondary failures. The two
/// ranks are started by hand with torchrun's variables (our store, not an agent's).
#[test]
fn sigterm_under_torchrun_aborts_the_peers_with_the_reason() {
    #[cfg(target_os = "linux")]
    {
        use common::cli::{free_port, scratch};
        let dir = scratch("launch_faults", "sigterm");
        let port = free_port().to_string();
        let spawn = |rank: &str| {
            let mut args = vec!["train"];
            args.extend_from_slice(&SMALL_MODEL);
            args.extend_from_slice(&["--batch-size", "4", "--steps", "100000", "--timeout", "60"]);
            command(&args)
                .env("RANK", rank)
                .env("LOCAL_RANK", rank)
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("TORCHELASTIC_RESTART_COUNT", "0")
                .env(
                    "TORCHELASTIC_ERROR_FILE",
                    dir.join(format!("error-{rank}.json")),
                )
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        };
        let mut rank0 = spawn("0");
        let mut rank1 = spawn("1");
        // Wait until they train (rank 0 prints its header once the communicator is up).
        let mut stdout = rank0.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            let mut seen = String::new();
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                seen.push_str(&String::from_utf8_lossy(&buf[..n]));
                if seen.contains("fsdp train:") {
                    let _ = tx.send(());
                    seen.clear();
                }
            }
        });
        if rx.recv_timeout(Duration::from_secs(120)).is_err() {
            let _ = rank0.kill();
            let _ = rank1.kill();
            panic!("the ranks never started training");
        }
        std::thread::sleep(Duration::from_millis(500));
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &rank1.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let start = Instant::now();
        let (mut err0, mut err1) = (String::new(), String::new());
        rank1
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err1)
            .unwrap();
        let status1 = rank1.wait().unwrap();
        rank0
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err0)
            .unwrap();
        let status0 = rank0.wait().unwrap();
        // The grace (1.5 s) and the abort: well within the 60 s collective timeout.
        assert!(start.elapsed() < Duration::from_secs(20), "{err0}\n{err1}");
        assert_eq!(status1.code(), Some(128 + 15), "{err1}");
        assert!(err1.contains("rank 1: stopped by SIGTERM"), "{err1}");
        assert_eq!(status0.code(), Some(1), "{err0}");
        assert!(
            err0.contains("communicator aborted") && err0.contains("rank 1: stopped by SIGTERM"),
            "{err0}"
        );
        // torchelastic's error files: rank 1 names the signal, rank 0 quotes it.
        let file1 = std::fs::read_to_string(dir.join("error-1.json")).unwrap();
        assert!(file1.contains("stopped by SIGTERM"), "{file1}");
        let file0 = std::fs::read_to_string(dir.join("error-0.json")).unwrap();
        assert!(file0.contains("stopped by SIGTERM"), "{file0}");
    }
}
