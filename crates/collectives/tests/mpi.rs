//! The MPI backend under `mpirun -np 3` on loopback: runs the `mpi_reference` example (every
//! collective, op, dtype, several lengths and sub-groups against a host reference), its mismatch
//! mode, its timeout mode, and the conformance cases every backend runs (`--conformance`).
//!
//! Needs `mpirun` on the PATH and the example built next to this test (`cargo test --features
//! mpi` builds it; `MPI_REFERENCE_BIN` overrides the path). Otherwise each test prints
//! "skipped: ..." and passes.
#![cfg(feature = "mpi")]

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills mpirun's whole process group unless it was reaped.
struct Guard {
    child: Child,
    reaped: bool,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.reaped {
            let pid = self.child.id();
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{pid}")])
                .status();
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    })
}

/// The example binary: `target/<profile>/examples/mpi_reference` next to `target/<profile>/deps`.
fn example_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MPI_REFERENCE_BIN") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let bin = profile_dir.join("examples").join("mpi_reference");
    bin.is_file().then_some(bin)
}

/// What a run of mpirun produced.
struct Run {
    success: bool,
    output: String,
    took: Duration,
}

/// `mpirun -np 3 <example> <args>`, or `None` (after printing why) when it cannot run here.
fn mpirun(args: &[&str], limit: Duration) -> Option<Run> {
    let Some(mpirun) = find_in_path("mpirun") else {
        println!("skipped: mpirun is not on the PATH (apt-get install openmpi-bin libopenmpi-dev)");
        return None;
    };
    let Some(bin) = example_bin() else {
        println!(
            "skipped: the mpi_reference example is not built next to this test \
             (cargo build -p fsdp-collectives --features mpi --examples, or set MPI_REFERENCE_BIN)"
        );
        return None;
    };
    let version = Command::new(&mpirun)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let mut cmd = Command::new(&mpirun);
    // A session directory of its own: the tests' mpiruns start in parallel, and two creating
    // Open MPI's default `/tmp/ompi.<host>.<uid>` at once fail ("File exists").
    let session = std::env::temp_dir().join(format!(
        "fsdp-mpi-{}-{}",
        std::process::id(),
        args.join("").trim_start_matches('-')
    ));
    if version.contains("Open MPI") || version.contains("OpenRTE") {
        std::fs::create_dir_all(&session).expect("an Open MPI session directory");
        cmd.arg("--mca").arg("orte_tmpdir_base").arg(&session);
        // Root in containers, more ranks than cores, loopback TCP only, no core binding.
        cmd.args([
            "--allow-run-as-root",
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
        ]);
    }
    cmd.args(["-np", "3"]).arg(&bin).args(args);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let t0 = Instant::now();
    let mut guard = Guard {
        child: cmd.spawn().expect("spawning mpirun"),
        reaped: false,
    };
    let mut readers = Vec::new();
    for pipe in [
        guard
            .child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
        guard
            .child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        readers.push(std::thread::spawn(move || {
            let mut pipe = pipe;
            let mut s = Vec::new();
            let _ = pipe.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        }));
    }
    let status = loop {
        if let Some(status) = guard.child.try_wait().expect("waiting for mpirun") {
            guard.reaped = true;
            break Some(status);
        }
        if t0.elapsed() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = t0.elapsed();
    // Kill what is left (the process group) so that the pipes close.
    drop(guard);
    let _ = std::fs::remove_dir_all(&session);
    let output: String = readers
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    let Some(status) = status else {
        panic!("mpirun {args:?} did not finish within {limit:?}; output:\n{output}");
    };
    println!("mpirun {args:?}: {status} after {took:.2?}\n{output}");
    Some(Run {
        success: status.success(),
        output,
        took,
    })
}

/// The summary lines of the ranks (`mpi_reference rank r/3 <mode>: N checks, F failed ...`).
fn summaries(output: &str) -> Vec<String> {
    output
        .lines()
        .filter(|l| l.starts_with("mpi_reference rank "))
        .map(str::to_owned)
        .collect()
}

#[test]
fn reference_np3() {
    let Some(run) = mpirun(&[], Duration::from_secs(240)) else {
        return;
    };
    assert!(run.success, "mpirun failed:\n{}", run.output);
    let lines = summaries(&run.output);
    assert_eq!(lines.len(), 3, "one summary per rank:\n{}", run.output);
    for r in 0..3 {
        let line = lines
            .iter()
            .find(|l| l.starts_with(&format!("mpi_reference rank {r}/3 reference:")))
            .unwrap_or_else(|| panic!("no summary of rank {r}:\n{}", run.output));
        assert!(line.contains(" 0 failed"), "{line}");
        // Hundreds of checks ran (not a vacuous pass).
        let checks: usize = line
            .split(": ")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(checks > 500, "rank {r} ran only {checks} checks: {line}");
    }
}

#[test]
fn mismatch_np3() {
    let Some(run) = mpirun(&["--mismatch"], Duration::from_secs(120)) else {
        return;
    };
    assert!(run.success, "mpirun failed:\n{}", run.output);
    let lines = summaries(&run.output);
    assert_eq!(lines.len(), 3, "{}", run.output);
    assert!(lines.iter().all(|l| l.contains(" 0 failed")), "{lines:#?}");
    for needle in [
        "rank 1 issued all_reduce(dtype=float32, count=5, op=sum)",
        "rank 0 issued all_gather_base with invalid arguments",
        "rank 2 issued broadcast(dtype=float64, count=4, root=0)",
    ] {
        assert!(
            run.output.contains(needle),
            "missing {needle:?}:\n{}",
            run.output
        );
    }
}

#[test]
fn missing_rank_times_out_np3() {
    // Timeout 2 s in the example; the ranks that wait must report it within twice that.
    let Some(run) = mpirun(&["--timeout"], Duration::from_secs(60)) else {
        return;
    };
    for r in [0, 1] {
        assert!(
            run.output
                .contains(&format!("rank {r}: expected timeout after")),
            "rank {r} did not report its timeout:\n{}",
            run.output
        );
        assert!(
            run.output.contains(&format!(
                "mpi_reference rank {r}/3 timeout: 2 checks, 0 failed"
            )),
            "rank {r}:\n{}",
            run.output
        );
    }
    assert!(run.took < Duration::from_secs(30), "took {:?}", run.took);
}

#[test]
fn conformance_np3() {
    let Some(run) = mpirun(&["--conformance"], Duration::from_secs(240)) else {
        return;
    };
    assert!(run.success, "mpirun failed:\n{}", run.output);
    for r in 0..3 {
        assert!(
            run.output.contains(&format!("rank {r}: conformant")),
            "rank {r}:\n{}",
            run.output
        );
    }
}
