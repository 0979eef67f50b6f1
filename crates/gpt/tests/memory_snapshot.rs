//! `fsdp train --memory-snapshot FILE`: rank 0's memory history, written in the pickle layout
//! of PyTorch's `torch.cuda.memory._snapshot()`, read back with plain `python3`.

#![cfg(unix)]

mod common;

use std::fs;
use std::process::Command;

use common::cli::{command, ok, one_error, s, small_train_args, TWO_RANKS};

/// Reads the pickle and prints: the number of events of each action, whether every alloc was
/// freed, and the frames naming all-gathers and gradients.
const PY: &str = r#"
import pickle, sys, collections
snap = pickle.load(open(sys.argv[1], "rb"))
trace = snap["device_traces"][0]
count = collections.Counter(e["action"] for e in trace)
live = set()
for e in trace:
    if e["action"] == "alloc":
        live.add(e["addr"])
    elif e["action"] == "free_completed":
        live.discard(e["addr"])
allocated = sum(b["size"] for seg in snap["segments"] for b in seg["blocks"]
                if b["state"] == "active_allocated")
names = {f["name"] for e in trace for f in e["frames"]}
print(count["alloc"], count["free_requested"], count["free_completed"], count["segment_alloc"])
print(len(live), allocated > 0)
print(any(n.endswith("all-gather") for n in names), any(n.endswith("gradient") for n in names))
"#;

#[test]
fn train_writes_rank_zeros_memory_snapshot() {
    let d = common::cli::scratch("memory-snapshot", "train");
    let snap = d.join("snap.pickle");
    let out = command(&small_train_args(
        &TWO_RANKS,
        &["--steps", "2", "--memory-snapshot", s(&snap)],
    ))
    .output()
    .unwrap();
    ok(&out, "the run");
    let py = Command::new("python3")
        .arg("-c")
        .arg(PY)
        .arg(&snap)
        .output();
    let Ok(py) = py else {
        println!("skipped the pickle check: no python3");
        return;
    };
    let text = String::from_utf8_lossy(&py.stdout).to_string();
    assert!(
        py.status.success(),
        "python3: {text}{}",
        String::from_utf8_lossy(&py.stderr)
    );
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
    let n: Vec<usize> = lines[0].iter().map(|x| x.parse().unwrap()).collect();
    let (allocs, free_req, free_done, segs) = (n[0], n[1], n[2], n[3]);
    assert!(allocs > 10 && segs > 0, "{text}");
    // Every free requested completed (no record_stream pending at the end), and what is still
    // allocated (the shards) is in the segments.
    assert_eq!(free_req, free_done, "{text}");
    assert!(allocs >= free_req, "{text}");
    assert_eq!(lines[1][1], "True", "the shards are allocated: {text}");
    assert_eq!(lines[2], ["True", "True"], "engine frames: {text}");

    // An output onto a directory fails before training, naming the option.
    let dir = d.join("adir");
    fs::create_dir(&dir).unwrap();
    one_error(
        &command(&small_train_args(
            &TWO_RANKS,
            &["--steps", "1", "--memory-snapshot", s(&dir)],
        ))
        .output()
        .unwrap(),
        &["--memory-snapshot", "is a directory"],
    );
}
