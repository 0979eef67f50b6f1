//! Tests of the flight recorder: the ring buffer keeps the last N entries, the dump is JSON
//! with every field, and the rank that is behind is named with the collective it never entered.

use std::sync::Arc;

use fsdp_device::DType;

use super::*;

fn desc(op: &'static str, count: usize) -> OpDesc {
    OpDesc {
        dtype: Some(DType::F32),
        count,
        ..OpDesc::new(op)
    }
}

fn recorder(rank: usize, board: Arc<SharedProgress>, cap: usize, dir: &Path) -> FlightRecorder {
    FlightRecorder::new(
        RecorderParts {
            rank,
            world: 3,
            backend: "test",
            group: "g0".into(),
            root_group: true,
            progress: Some(board),
        },
        cap,
        dir.to_path_buf(),
    )
}

/// Run collectives 0..n on `r`, all completed.
fn run(r: &FlightRecorder, n: u64) {
    for seq in 0..n {
        r.scheduled(seq, &desc("all_reduce", 4));
        r.started(seq, "all_reduce");
        r.ended(seq, true);
    }
}

#[test]
fn progress_text_round_trips() {
    for p in [
        Progress::default(),
        Progress {
            entered: Some((7, "all_gather_base")),
            completed: Some(6),
        },
    ] {
        assert_eq!(Progress::decode(&p.encode()), Some(p));
    }
    assert_eq!(Progress::decode("1 nonsense 0"), None);
    assert_eq!(Progress::decode("x"), None);
}

#[test]
#[cfg_attr(miri, ignore = "writes files and reads the wall clock")]
fn dump_names_the_rank_behind_and_keeps_the_last_entries() {
    let dir = std::env::temp_dir().join(format!("fsdp-fr-unit-{}", std::process::id()));
    let board = Arc::new(SharedProgress::new(3));
    let rs: Vec<_> = (0..3)
        .map(|r| recorder(r, board.clone(), 4, &dir))
        .collect();
    // Ranks 0 and 1 finish 0..5 and enter #5 (a reduce_scatter_base); rank 2 stops after #4.
    for (r, rec) in rs.iter().enumerate() {
        run(rec, 5);
        if r < 2 {
            rec.scheduled(5, &desc("reduce_scatter_base", 2));
            rec.started(5, "reduce_scatter_base");
        }
    }
    let found = rs[0].dump("timed out").unwrap();
    assert!(
        found.contains(
            "rank 2 is behind (lowest progress: last entered #4, last completed #4) and never \
             entered reduce_scatter_base (collective #5)"
        ),
        "{found}"
    );
    assert!(found.contains("fsdp_flight_recorder_rank0.json"), "{found}");
    assert_eq!(rs[0].dump("again"), None, "one dump per communicator");
    // Rank 2 itself learns the operation from the rank furthest ahead.
    let found = rs[2].dump("aborted").unwrap();
    assert!(found.contains("rank 2 is behind"), "{found}");
    assert!(
        found.contains("never entered reduce_scatter_base"),
        "{found}"
    );

    let text = std::fs::read_to_string(dir.join("fsdp_flight_recorder_rank0.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["rank"], 0);
    assert_eq!(v["reason"], "timed out");
    let entries = v["entries"].as_array().unwrap();
    // Capacity 4: collectives 2..=5 remain.
    let seqs: Vec<u64> = entries
        .iter()
        .map(|e| e["collective_seq_id"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, vec![2, 3, 4, 5]);
    assert_eq!(entries[0]["state"], "completed");
    assert_eq!(entries[0]["input_sizes"], serde_json::json!([4]));
    assert_eq!(entries[3]["state"], "started");
    assert_eq!(entries[3]["profiling_name"], "reduce_scatter_base");
    assert_eq!(entries[3]["input_sizes"], serde_json::json!([6]));
    assert_eq!(entries[3]["output_sizes"], serde_json::json!([2]));
    assert_eq!(entries[3]["dtype"], "float32");
    assert!(entries[3]["time_discovered_completed_ns"].is_null());
    assert_eq!(v["progress"][2]["last_completed"], 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn equal_progress_and_silent_ranks_are_said_so() {
    let dir = std::env::temp_dir();
    let board = Arc::new(SharedProgress::new(3));
    let a = recorder(0, board.clone(), 8, &dir);
    let b = recorder(1, board.clone(), 8, &dir);
    run(&a, 2);
    run(&b, 2);
    assert_eq!(
        a.behind(&board.read().expect("an in-memory board is always read")),
        "every rank reporting progress reached the same point (last entered #1, last completed \
         #1); ranks [2] published no progress"
    );
}

/// A board that cannot be read, as a store behind a failed link.
struct Unreachable;

impl ProgressBoard for Unreachable {
    fn publish(&self, _rank: usize, _p: &Progress) {}
    fn read(&self) -> Result<Vec<Option<Progress>>, String> {
        Err("the store did not answer (no route to host)".into())
    }
}

#[test]
#[cfg_attr(miri, ignore = "writes files and reads the wall clock")]
fn an_unreadable_board_is_said_so_not_called_silence() {
    let dir = std::env::temp_dir().join(format!("fsdp-fr-unread-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let r = FlightRecorder::new(
        RecorderParts {
            rank: 1,
            world: 3,
            backend: "test",
            group: "g0".into(),
            root_group: true,
            progress: Some(Arc::new(Unreachable)),
        },
        8,
        dir.clone(),
    );
    run(&r, 2);
    let said = r.dump("timed out").expect("the first dump reports");
    assert!(
        said.starts_with(
            "the other ranks' progress is unknown: the store did not answer (no route to host); \
             flight recorder dump: "
        ),
        "{said}"
    );
    assert!(!said.contains("published no progress"), "{said}");
    std::fs::remove_dir_all(&dir).unwrap();
}
