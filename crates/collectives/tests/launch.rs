//! The launcher with `/bin/sh` as the program: environment of each rank, output prefixed by rank,
//! a failing rank that stops the others quickly, signals, time limit, a program that does not
//! exist.
#![cfg(unix)]

use std::io::Write;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fsdp_collectives::launch::{run, run_with_output, LaunchOptions, LaunchReport, RankOutcome};
use fsdp_collectives::CollectiveError;

/// An in-memory sink the launcher writes into.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn lines(&self) -> Vec<String> {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_owned).collect()
    }
}

fn sh(nproc: usize, script: &str) -> LaunchOptions {
    LaunchOptions::new(nproc, "/bin/sh")
        .with_args(["-c", script])
        .with_master("127.0.0.1", 0)
}

fn launch(opts: &LaunchOptions) -> (LaunchReport, Vec<String>, Vec<String>) {
    let (out, err) = (Captured::default(), Captured::default());
    let report = run_with_output(opts, out.clone(), err.clone()).unwrap();
    (report, out.lines(), err.lines())
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

#[test]
fn every_rank_gets_its_environment() {
    let script = r#"echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $EXTRA""#;
    let opts = sh(3, script).with_env("EXTRA", "x");
    let (report, out, err) = launch(&opts);
    assert!(report.success(), "{report}");
    assert_eq!(report.exit_code(), 0);
    assert_eq!(report.first_failure(), None);
    let port = report.master_port;
    assert_ne!(port, 0);
    let expected: Vec<String> = (0..3)
        .map(|r| format!("[rank {r}] {r} 3 {r} 3 127.0.0.1 {port} x"))
        .collect();
    assert_eq!(sorted(out), expected);
    assert!(err.is_empty(), "{err:?}");
    let ranks: Vec<(usize, usize, RankOutcome)> = report
        .ranks
        .iter()
        .map(|r| (r.rank, r.local_rank, r.outcome))
        .collect();
    assert_eq!(
        ranks,
        (0..3)
            .map(|r| (r, r, RankOutcome::Exited(0)))
            .collect::<Vec<_>>()
    );

    // Node 1 of 2, explicit port: global ranks 2 and 3 of 4.
    let opts = sh(2, script)
        .with_env("EXTRA", "y")
        .with_nodes(2, 1)
        .with_master("10.1.2.3", 29511);
    let (report, out, _) = launch(&opts);
    assert!(report.success());
    assert_eq!(
        sorted(out),
        vec![
            "[rank 2] 2 4 0 2 10.1.2.3 29511 y".to_string(),
            "[rank 3] 3 4 1 2 10.1.2.3 29511 y".to_string(),
        ]
    );
}

#[test]
fn output_is_prefixed_by_rank_on_the_right_stream() {
    let script = r#"echo "out-$RANK"; echo "err-$RANK" >&2; printf 'a%s\nb%s' $RANK $RANK"#;
    let (report, out, err) = launch(&sh(2, script));
    assert!(report.success());
    assert_eq!(
        sorted(out),
        [
            "[rank 0] a0",
            "[rank 0] b0",
            "[rank 0] out-0",
            "[rank 1] a1",
            "[rank 1] b1",
            "[rank 1] out-1"
        ]
        .map(String::from)
        .to_vec()
    );
    assert_eq!(sorted(err), vec!["[rank 0] err-0", "[rank 1] err-1"]);
    // Per rank, lines keep their order.
    let (_, out, _) = launch(&sh(2, "for i in 1 2 3 4 5 6 7 8; do echo $i; done"));
    for r in 0..2 {
        let mine: Vec<&String> = out
            .iter()
            .filter(|l| l.starts_with(&format!("[rank {r}] ")))
            .collect();
        let expected: Vec<String> = (1..=8).map(|i| format!("[rank {r}] {i}")).collect();
        assert_eq!(mine, expected.iter().collect::<Vec<_>>());
    }
}

#[test]
fn a_failing_rank_stops_the_others_quickly() {
    // Rank 1 exits with status 3; ranks 0 and 2 would sleep for 30 s.
    let script =
        r#"if [ "$RANK" = 1 ]; then sleep 0.2; echo failing >&2; exit 3; fi; exec sleep 30"#;
    let start = Instant::now();
    let (report, _, err) = launch(&sh(3, script));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(report.first_failure(), Some((1, RankOutcome::Exited(3))));
    assert_eq!(report.exit_code(), 3);
    assert!(!report.success());
    assert_eq!(report.ranks[0].outcome, RankOutcome::Stopped);
    assert_eq!(report.ranks[2].outcome, RankOutcome::Stopped);
    assert!(err.contains(&"[rank 1] failing".to_string()), "{err:?}");
    assert!(
        err.iter()
            .any(|l| l == "[launcher] rank 1 failed (exited with status 3); stopping ranks [0, 2]"),
        "{err:?}"
    );
    assert_eq!(
        report.to_string(),
        "rank 1 failed (exited with status 3); ranks [0, 2] were stopped"
    );
}

#[test]
fn output_held_open_by_a_grandchild_does_not_hold_the_launcher() {
    // Without `exec`, `sh` forks `sleep`: killing `sh` leaves `sleep` holding the output pipe.
    let script = r#"if [ "$RANK" = 0 ]; then sleep 0.5; exit 5; fi; sleep 20; true"#;
    let start = Instant::now();
    let (report, _, err) = launch(&sh(2, script));
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(report.first_failure(), Some((0, RankOutcome::Exited(5))));
    assert_eq!(report.exit_code(), 5);
    assert!(
        err.iter().any(|l| l.contains("still open")),
        "expected a note about the open output: {err:?}"
    );
}

#[test]
fn a_rank_killed_by_a_signal_is_reported_with_128_plus_the_signal() {
    let script = r#"if [ "$RANK" = 1 ]; then kill -9 $$; fi; exec sleep 30"#;
    let start = Instant::now();
    let (report, _, _) = launch(&sh(2, script));
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(report.first_failure(), Some((1, RankOutcome::Signaled(9))));
    assert_eq!(report.exit_code(), 137);
}

#[test]
fn the_time_limit_stops_every_rank() {
    let opts = sh(2, "exec sleep 30").with_max_duration(Duration::from_millis(500));
    let start = Instant::now();
    let (report, _, err) = launch(&opts);
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(4),
        "{took:?}"
    );
    assert!(report.timed_out);
    assert_eq!(report.first_failure(), None);
    assert_eq!(report.exit_code(), 124);
    assert!(report
        .ranks
        .iter()
        .all(|r| r.outcome == RankOutcome::Stopped));
    assert!(err.iter().any(|l| l.contains("limit")), "{err:?}");
}

#[test]
fn a_program_that_does_not_exist_is_a_clear_error() {
    for (program, needle) in [
        ("/nonexistent/fsdp-prog", "not found"),
        ("fsdp-no-such-program-xyz", "not found in PATH"),
    ] {
        let start = Instant::now();
        let err = run_with_output(
            &LaunchOptions::new(2, program).with_master("127.0.0.1", 0),
            std::io::sink(),
            std::io::sink(),
        )
        .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2));
        match err {
            CollectiveError::Launch { rank: 0, reason } => {
                assert!(reason.contains(program), "{reason}");
                assert!(reason.contains(needle), "{reason}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn invalid_options_are_refused() {
    for (opts, needle) in [
        (LaunchOptions::new(0, "/bin/sh"), "nproc_per_node"),
        (
            LaunchOptions::new(2, "/bin/sh").with_nodes(2, 2),
            "node_rank",
        ),
        (LaunchOptions::new(2, ""), "program"),
        (
            LaunchOptions::new(2, "/bin/sh")
                .with_nodes(2, 0)
                .with_master("127.0.0.1", 0),
            "one node",
        ),
    ] {
        match run_with_output(&opts, std::io::sink(), std::io::sink()).unwrap_err() {
            CollectiveError::Launch { reason, .. } => assert!(reason.contains(needle), "{reason}"),
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// `run` writes to the process's own standard output and error: checked by re-executing this
/// test binary and reading what it printed.
#[test]
fn run_forwards_to_the_launchers_own_streams() {
    const ROLE: &str = "FSDP_LAUNCH_TEST_CHILD";
    if std::env::var_os(ROLE).is_some() {
        let script =
            r#"echo "hi $RANK"; echo "oops $RANK" >&2; [ "$RANK" = 1 ] && sleep 0.5; exit $RANK"#;
        let report = run(&sh(2, script)).unwrap();
        println!("exit code {}", report.exit_code());
        return;
    }
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "run_forwards_to_the_launchers_own_streams",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "1")
        .output()
        .unwrap();
    assert!(output.status.success());
    let out = String::from_utf8_lossy(&output.stdout);
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(out.contains("[rank 0] hi 0\n"), "{out}");
    assert!(out.contains("exit code 1\n"), "{out}");
    assert!(out.contains("[rank 1] hi 1\n"), "{out}");
    assert!(err.contains("[rank 0] oops 0\n"), "{err}");
    assert!(err.contains("[rank 1] oops 1\n"), "{err}");
    assert!(
        !out.contains("oops") && !err.contains("hi "),
        "{out}\n{err}"
    );
}
