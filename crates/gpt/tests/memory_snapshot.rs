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

/// Reads a device trainer's snapshot and prints: the events of each action, the buffers still
/// live at the end, and the most bytes live at once counting from the start of the recording.
const DEVICE_PY: &str = r#"
import pickle, sys, collections
snap = pickle.load(open(sys.argv[1], "rb"))
trace = snap["device_traces"][0]
count = collections.Counter(e["action"] for e in trace)
live, now, most = {}, 0, 0
for e in trace:
    if e["action"] == "alloc":
        live[e["addr"]] = e["size"]
        now += e["size"]
        most = max(most, now)
    elif e["action"] == "free_completed":
        now -= live.pop(e["addr"])
print(count["alloc"], count["free_requested"], count["free_completed"], len(snap["segments"]))
print(len(live), most)
"#;

/// The number after `prefix` in `text`.
fn number_after(text: &str, prefix: &str) -> u64 {
    let at = text
        .find(prefix)
        .unwrap_or_else(|| panic!("no {prefix:?} in {text}"))
        + prefix.len();
    text[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap()
}

/// `fsdp train --device host-twin --memory-snapshot` (the device trainer's path): every buffer
/// made and dropped, each dropped one freed, none live at the end (f32 products keep no
/// operand copies), and the most live at once, added to what the plan holds throughout, is
/// the peak the run counted.
#[test]
fn device_train_writes_its_memory_history() {
    device_history("device", &[], 0);
}

/// The same with two ranks as threads on the device (rank 0's history): the units gathered and
/// freed, the gradients reduced, among the step's buffers; one buffer made after recording
/// began stays, the scalars' all-reduce's result that the collectives keep from step to step.
#[test]
fn sharded_device_train_writes_rank_zeros_memory_history() {
    device_history("sharded", &["--ranks", "2", "--strategy", "full-shard"], 1);
}

/// `fsdp train --device host-twin --memory-snapshot` with `extra`, checked against the run's
/// counted peak and `fsdp plan --device`'s held bytes; `kept` buffers live at the end.
fn device_history(name: &str, extra: &[&str], kept: u64) {
    let d = common::cli::scratch("memory-snapshot", name);
    let snap = d.join("snap.pickle");
    let mut run = vec![
        "--device",
        "host-twin",
        "--param-dtype",
        "f32",
        "--batch-size",
        "8",
    ];
    run.extend(extra);
    let mut a = small_train_args(&["--steps", "2"], &run);
    a.extend(["--memory-snapshot", s(&snap)]);
    let out = ok(
        &command(&a).output().unwrap(),
        "fsdp train --device host-twin",
    );
    let prefix = if extra.is_empty() {
        "peak device memory "
    } else {
        "peak device memory per rank "
    };
    let peak = number_after(&out, prefix);
    let mut p = vec!["plan"];
    p.extend(&small_train_args(&[], &run)[1..]);
    let plan = ok(
        &command(&p).output().unwrap(),
        "fsdp plan --device host-twin",
    );
    let held = number_after(&plan, "held throughout ");
    let Ok(py) = Command::new("python3")
        .arg("-c")
        .arg(DEVICE_PY)
        .arg(&snap)
        .output()
    else {
        println!("skipped the pickle check: no python3");
        return;
    };
    let text = String::from_utf8_lossy(&py.stdout).to_string();
    assert!(
        py.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&py.stderr)
    );
    let n: Vec<u64> = text
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    let (allocs, free_req, free_done, segments, live, most) = (n[0], n[1], n[2], n[3], n[4], n[5]);
    assert!(allocs > 20, "{text}");
    assert_eq!(
        (free_req, free_done, segments, live),
        (allocs - kept, allocs - kept, 0, kept),
        "{text}"
    );
    assert_eq!(
        held + most,
        peak,
        "{name}: {text}: held {held}, counted peak {peak}"
    );
}
