//! The flight recorder, end to end: rank 2 of 3 skips a collective. Every rank fails within the
//! timeout; every rank's error names rank 2 as the one behind and the collective it never
//! entered; every rank's dump exists, parses, and holds the collectives it ran with their states.
//! On ranks as threads, and as processes over tcp and over shared memory.

use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use fsdp_collectives::{ring, tcp, CollectiveError, Communicator, ReduceOp};
use fsdp_device::Buffer;

mod support;
use support::procs;

const WORLD: usize = 3;
const TIMEOUT: Duration = Duration::from_secs(1);
const DIR_ENV: &str = "FSDP_FLIGHT_RECORDER_DIR";
const BEHIND: &str =
    "rank 2 is behind (lowest progress: last entered #1, last completed #1) and never entered \
     all_reduce (collective #2)";

fn fresh_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-fr-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Two good all-reduces, then all-reduce #2 that rank 2 skips. Ranks 0 and 1 fail in it; rank
/// 2 waits for `peers_failed` and then finds the communicator aborted. Returns the error text
/// and how long the failing call took.
fn skip_one(comm: &dyn Communicator, peers_failed: &dyn Fn()) -> (String, Duration) {
    let r = comm.rank();
    for _ in 0..2 {
        let b = Buffer::from_slice(&[1.0f32; 8]).unwrap();
        comm.all_reduce(&b, ReduceOp::Sum).unwrap().wait().unwrap();
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![3.0; 8]);
    }
    let b = Buffer::from_slice(&[1.0f32; 8]).unwrap();
    let t0 = Instant::now();
    let err = if r == 2 {
        peers_failed();
        let err = comm.barrier().and_then(|w| w.wait()).unwrap_err();
        assert!(
            matches!(err, CollectiveError::Aborted { .. }),
            "rank 2: {err}"
        );
        err
    } else {
        let err = comm
            .all_reduce(&b, ReduceOp::Sum)
            .and_then(|w| w.wait())
            .unwrap_err();
        assert!(
            matches!(
                err,
                CollectiveError::Timeout { .. } | CollectiveError::Aborted { .. }
            ),
            "rank {r}: {err}"
        );
        peers_failed();
        err
    };
    let text = err.to_string();
    assert!(text.contains(BEHIND), "rank {r}: {text}");
    assert!(
        text.contains(&format!("fsdp_flight_recorder_rank{r}.json")),
        "rank {r}: {text}"
    );
    (text, t0.elapsed())
}

/// Every rank's dump parses and holds what it ran.
fn check_dumps(dir: &Path) {
    for r in 0..WORLD {
        let path = dir.join(format!("fsdp_flight_recorder_rank{r}.json"));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("rank {r}: no dump at {}: {e}", path.display()));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["rank"], r as u64);
        assert_eq!(v["world_size"], WORLD as u64);
        assert!(v["behind"].as_str().unwrap().contains(BEHIND), "{text}");
        let entries = v["entries"].as_array().unwrap();
        let got: Vec<(u64, &str, &str)> = entries
            .iter()
            .map(|e| {
                (
                    e["collective_seq_id"].as_u64().unwrap(),
                    e["profiling_name"].as_str().unwrap(),
                    e["state"].as_str().unwrap(),
                )
            })
            .collect();
        let mut want = vec![
            (0, "all_reduce", "completed"),
            (1, "all_reduce", "completed"),
        ];
        if r != 2 {
            want.push((2, "all_reduce", "failed"));
        }
        assert_eq!(got, want, "rank {r}: {text}");
        assert_eq!(entries[0]["input_sizes"], serde_json::json!([8]));
        assert_eq!(entries[0]["dtype"], "float32");
        assert!(entries[0]["time_discovered_completed_ns"].as_u64().unwrap() > 0);
        let progress = v["progress"].as_array().unwrap();
        assert_eq!(progress[2]["last_completed"], 1, "{text}");
    }
}

#[test]
fn threads_skip_a_collective() {
    if procs::role().is_some() {
        return;
    }
    let dir = fresh_dir("threads");
    // Only this test reads the variable in this process (the others pass it to children).
    std::env::set_var(DIR_ENV, &dir);
    let barrier = Barrier::new(WORLD);
    let results = ring::run_ranks(
        WORLD,
        ring::RingOptions::default().with_timeout(TIMEOUT),
        |c| {
            skip_one(&c, &|| {
                barrier.wait();
            })
        },
    )
    .unwrap();
    for (r, (text, took)) in results.iter().enumerate() {
        assert!(took < &(TIMEOUT * 5), "rank {r} took {took:?}: {text}");
    }
    check_dumps(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// In a child: one rank over `transport`; in the parent: three children, then the dumps.
fn processes(test: &str, transport: tcp::ProcessTransport) {
    if let Some(role) = procs::role() {
        if role != test {
            return;
        }
        let (rank, store) = procs::child_store(WORLD, Duration::from_secs(60));
        let opts = tcp::TcpOptions::default()
            .with_transport(transport)
            .with_timeout(TIMEOUT);
        let comm = tcp::TcpCommunicator::new(&store, opts).unwrap();
        // Rank 2 waits past its peers' timeout (they abort the group then).
        let (text, took) = skip_one(&comm, &|| {
            if rank == 2 {
                std::thread::sleep(TIMEOUT * 3)
            }
        });
        let limit = if rank == 2 { TIMEOUT * 8 } else { TIMEOUT * 5 };
        assert!(took < limit, "rank {rank} took {took:?}: {text}");
        println!("rank {rank}: failed as expected: {text}");
        return;
    }
    let dir = fresh_dir(test);
    let envs = [(DIR_ENV, dir.as_os_str())];
    let results = procs::run_children(test, test, WORLD, &envs, Duration::from_secs(60));
    procs::assert_all_said(test, &results, "failed as expected");
    check_dumps(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tcp_processes_skip_a_collective() {
    processes(
        "tcp_processes_skip_a_collective",
        tcp::ProcessTransport::Tcp,
    );
}

#[test]
fn shm_processes_skip_a_collective() {
    processes(
        "shm_processes_skip_a_collective",
        tcp::ProcessTransport::Shm,
    );
}
