//! FSDP across processes: `fsdp train` under `fsdp launch` (TCP backend) and under `mpirun`
//! (MPI backend, with the cargo feature `mpi`) gives the same per-step losses as the in-process
//! ring run of the same configuration (ranks as threads).

mod common;

use std::path::{Path, PathBuf};
#[cfg(feature = "mpi")]
use std::process::Command;
use std::process::Output;

// The thread run must not think it was launched, whatever the caller's environment: `fsdp`
// removes `RANK` and `WORLD_SIZE`.
use common::cli::{fsdp, loss_column, ok, small_train_args, SMALL_MODEL};

fn tmp(name: &str) -> PathBuf {
    common::cli::tmp("multiprocess", name)
}

/// The batch, length and seed of the runs, after `SMALL_MODEL`.
const SMALL: [&str; 6] = ["--batch-size", "8", "--steps", "6", "--seed", "3"];

fn losses(path: &Path) -> Vec<f64> {
    loss_column(path)
        .iter()
        .map(|l| l.parse().unwrap())
        .collect()
}

/// Train with ranks as threads, then with ranks as processes; the loss logs must agree.
/// `exact`: the backend reduces in the ring backend's order, so the logs must be identical.
fn compare(
    name: &str,
    extra: &[&str],
    world: usize,
    exact: bool,
    processes: impl FnOnce(&[&str]) -> Output,
) {
    let threads_log = tmp(&format!("{name}-threads.csv"));
    let world_s = world.to_string();
    let mut args = small_train_args(&SMALL, extra);
    args.extend_from_slice(&["--ranks", &world_s, "--loss-log"]);
    let threads_log_s = threads_log.to_str().unwrap().to_string();
    args.push(&threads_log_s);
    let out = fsdp(&args);
    ok(&out, "the thread run");

    let procs_log = tmp(&format!("{name}-processes.csv"));
    let procs_log_s = procs_log.to_str().unwrap().to_string();
    let mut train = SMALL_MODEL.to_vec();
    train.extend_from_slice(&SMALL);
    train.extend_from_slice(extra);
    train.extend_from_slice(&["--loss-log", &procs_log_s]);
    let out = processes(&train);
    ok(&out, "the process run");
    let stdout = String::from_utf8_lossy(&out.stdout);

    let a = losses(&threads_log);
    let b = losses(&procs_log);
    assert_eq!(a.len(), 6);
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / x.abs())
        .fold(0.0f64, f64::max);
    println!("{name}: {world} processes vs {world} threads: losses {b:?}, worst relative difference {worst:e}");
    if exact {
        // The TCP backend reduces in the ring backend's order: bitwise the same training.
        assert_eq!(a, b, "losses differ");
    } else {
        // MPI reduces in its own order: rounding differences only.
        assert!(
            worst <= 1e-6,
            "losses differ: threads {a:?}, processes {b:?}"
        );
    }
    assert!(a[5] < a[0], "the loss did not fall: {a:?}");
    assert!(
        stdout.contains("done: 6 steps"),
        "no summary from rank 0:\n{stdout}"
    );
}

#[test]
fn launch_two_processes_matches_two_threads() {
    compare("full-shard", &[], 2, true, |train| {
        let mut args = vec![
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "train",
        ];
        args.extend_from_slice(train);
        let out = fsdp(&args);
        // Output comes back prefixed with the rank.
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("[rank 0] done: 6 steps"), "{stdout}");
        // One node: the shared-memory transport, the engine's buffers in shared host memory,
        // read in place by the peer.
        let line = stdout
            .lines()
            .find(|l| l.contains("host memory: shared with the ranks of this node"))
            .unwrap_or_else(|| panic!("no shared-memory line:\n{stdout}"));
        assert!(!line.contains("read 0.0 MiB"), "{line}");
        out
    });
}

#[test]
fn launch_four_processes_hybrid_matches_four_threads() {
    // HYBRID_SHARD splits the world into shard and replicate groups across processes.
    compare(
        "hybrid",
        &["--strategy", "hybrid-shard", "--ranks-per-node", "2"],
        4,
        true,
        |train| {
            let mut args = vec!["launch", "-n", "4", "--master-port", "0", "train"];
            args.extend_from_slice(train);
            fsdp(&args)
        },
    );
}

#[test]
fn launch_reports_a_failing_rank() {
    // Every rank refuses `--ranks 3` under a world of 2; the launcher exits non-zero and says so.
    let out = fsdp(&[
        "launch",
        "-n",
        "2",
        "--master-port",
        "0",
        "train",
        "--ranks",
        "3",
        "--steps",
        "1",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--ranks 3 disagrees with the launcher's world size 2"),
        "{stderr}"
    );
    assert!(stderr.contains("error: launch: rank"), "{stderr}");
}

#[test]
fn tcp_backend_without_a_launcher_is_a_clear_error() {
    let out = fsdp(&["train", "--backend", "tcp", "--steps", "1"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("error: --backend tcp: RANK and WORLD_SIZE are not set"),
        "{stderr}"
    );
}

#[cfg(feature = "mpi")]
#[test]
fn mpirun_two_processes_matches_two_threads() {
    let mpirun = match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => "mpirun",
        _ => {
            println!("skipped: mpirun not found");
            return;
        }
    };
    compare("mpi", &[], 2, false, |train| {
        let mut cmd = Command::new(mpirun);
        // Open MPI's options (CI installs Open MPI): loopback only, no core binding on a
        // 2-core machine.
        cmd.args([
            "--oversubscribe",
            "--bind-to",
            "none",
            "--mca",
            "btl",
            "self,tcp",
            "--mca",
            "btl_tcp_if_include",
            "lo",
            "--mca",
            "oob_tcp_if_include",
            "lo",
            "-np",
            "2",
        ])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .arg(env!("CARGO_BIN_EXE_fsdp"))
        .args(["train", "--backend", "mpi"])
        .args(train);
        cmd.output().expect("running mpirun")
    });
}
