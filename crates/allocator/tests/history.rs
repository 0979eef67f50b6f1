//! Memory history and its export in the pickle layout of `torch.cuda.memory._snapshot()`:
//! the events recorded for a known sequence, the pickle loaded by plain `python3` (field names
//! and types checked there), and, where torch is installed (`FSDP_TORCH_PYTHON` names its
//! Python), `python -m torch.cuda._memory_viz trace_plot` rendering it.

use std::path::PathBuf;
use std::process::Command;

use fsdp_allocator::{
    memory_context, AllocError, AllocatorConfig, HistoryConfig, HostAllocator, HostSource,
    MemoryLimit, Snapshot, TraceAction,
};
use fsdp_device::Stream;

const MIB: usize = 1 << 20;

/// A known sequence: two blocks on two streams, one freed with `record_stream`, an
/// out-of-memory error, `empty_cache`.
fn recorded_snapshot() -> (Snapshot, Vec<(TraceAction, u64, u64)>) {
    let cfg = AllocatorConfig::default().with_memory_limit(MemoryLimit::Bytes(64 * MIB));
    let alloc = HostAllocator::new(HostSource::new(1 << 30), cfg).unwrap();
    let comm = Stream::cpu("comm");
    let compute = Stream::cpu("compute");
    // Before recording: not in the history, but in the segments.
    let early = alloc.allocate(MIB / 2, &compute).unwrap();
    alloc.record_memory_history(Some(HistoryConfig::default()));
    assert!(alloc.is_recording_history());
    let a = {
        let _unit = memory_context("unit 3");
        let _ag = memory_context("all-gather");
        alloc.allocate(3 * MIB, &comm).unwrap()
    };
    let b = alloc.allocate(30 * MIB + 1, &compute).unwrap();
    let (a_addr, b_addr) = (a.addr(), b.addr());
    a.record_stream(&compute).unwrap();
    drop(a);
    compute.synchronize().unwrap();
    alloc.process_events().unwrap();
    let err = alloc.allocate(40 * MIB, &compute).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory { .. }));
    drop(b);
    let snap = alloc.snapshot();
    let want = vec![
        (TraceAction::SegmentAlloc, 0, 20 * MIB as u64),
        (TraceAction::Alloc, a_addr, 3 * MIB as u64),
        (TraceAction::SegmentAlloc, b_addr, 32 * MIB as u64),
        (TraceAction::Alloc, b_addr, (30 * MIB + 1) as u64),
        (TraceAction::FreeRequested, a_addr, 3 * MIB as u64),
        (TraceAction::FreeCompleted, a_addr, 3 * MIB as u64),
        // The retry gives back the cached comm segment, then fails.
        (TraceAction::SegmentFree, 0, 20 * MIB as u64),
        (TraceAction::Oom, 0, 40 * MIB as u64),
        (TraceAction::FreeRequested, b_addr, (30 * MIB + 1) as u64),
        (TraceAction::FreeCompleted, b_addr, (30 * MIB + 1) as u64),
    ];
    drop(early);
    (snap, want)
}

#[test]
#[cfg_attr(miri, ignore = "uses host streams and threads")]
fn history_records_every_event_with_stream_and_frames() {
    let (snap, want) = recorded_snapshot();
    let got: Vec<(TraceAction, u64, u64)> = snap
        .device_traces
        .iter()
        .map(|e| (e.action, e.addr, e.size))
        .collect();
    assert_eq!(got.len(), want.len(), "{got:?}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.0, w.0, "event {i}: {got:?}");
        assert_eq!(g.2, w.2, "event {i} size");
        if w.1 != 0 {
            assert_eq!(g.1, w.1, "event {i} address");
        }
    }
    let t = &snap.device_traces;
    // The segment events carry the segment base, the blocks' events the block address.
    assert_eq!(t[0].addr, t[1].addr, "the first block starts its segment");
    assert_eq!(
        t[6].addr, t[0].addr,
        "the freed segment is the comm segment"
    );
    assert_eq!(t[1].stream, t[0].stream);
    assert_ne!(t[1].stream, t[3].stream, "two streams");
    let oom = &t[7];
    assert_eq!(oom.device_free, Some(oom.addr));
    // Frames: the allocate call's location, then the named contexts, innermost first.
    let names: Vec<&str> = t[1].frames.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["allocate", "all-gather", "unit 3"]);
    assert!(t[1].frames[0].filename.ends_with("history.rs"));
    assert!(t[1].frames[0].line > 0);
    assert_eq!(t[3].frames.len(), 1, "no context named for b");
    assert_eq!(
        t[5].frames, t[1].frames,
        "free_completed carries the alloc's stack"
    );
    assert!(t.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    assert!(
        t[0].time_us > 1_600_000_000_000_000,
        "microseconds since the epoch"
    );
    // Snapshot blocks: the early block has no frames (allocated before recording).
    let early = snap.blocks().find(|(_, b)| b.size == 512 * 1024).unwrap().1;
    assert!(early.frames.is_empty());
    // JSON round trip keeps the history.
    assert_eq!(Snapshot::from_json(&snap.to_json().unwrap()).unwrap(), snap);
}

#[test]
#[cfg_attr(miri, ignore = "uses host streams and threads")]
fn history_is_bounded_and_stops() {
    let alloc = HostAllocator::new(HostSource::new(1 << 30), AllocatorConfig::default()).unwrap();
    let s = Stream::inline("s");
    alloc.record_memory_history(Some(HistoryConfig::default().with_max_entries(3)));
    for _ in 0..5 {
        drop(alloc.allocate(MIB, &s).unwrap());
    }
    let t = alloc.snapshot().device_traces;
    let actions: Vec<&str> = t.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(actions, ["alloc", "free_requested", "free_completed"]);
    alloc.record_memory_history(None);
    assert!(!alloc.is_recording_history());
    drop(alloc.allocate(MIB, &s).unwrap());
    assert!(alloc.snapshot().device_traces.is_empty());
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("fsdp-alloc-history-{}-{name}", std::process::id()))
}

/// The checks Python runs on the pickle: `torch.cuda.memory._snapshot()`'s field names and
/// types, and the events in order.
const PY_CHECK: &str = r#"
import pickle, sys
snap = pickle.load(open(sys.argv[1], "rb"))
assert set(snap) == {"segments", "device_traces"}, set(snap)
assert isinstance(snap["device_traces"], list) and len(snap["device_traces"]) == 1
seg_keys = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size",
            "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
for seg in snap["segments"]:
    assert set(seg) == seg_keys, set(seg)
    assert seg["device"] == 0 and seg["segment_type"] in ("small", "large")
    assert seg["segment_pool_id"] == (0, 0) and seg["is_expandable"] is False
    for k in ("address", "total_size", "allocated_size", "active_size", "requested_size", "stream"):
        assert isinstance(seg[k], int), k
    assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    for b in seg["blocks"]:
        assert set(b) == {"address", "size", "requested_size", "state", "frames"}, set(b)
        assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
        assert isinstance(b["frames"], list)
trace = snap["device_traces"][0]
for e in trace:
    keys = {"action", "addr", "size", "stream", "time_us", "frames"}
    if e["action"] == "oom":
        keys.add("device_free")
    assert set(e) == keys, set(e)
    for k in keys - {"action", "frames"}:
        assert isinstance(e[k], int) and e[k] >= 0, k
    for f in e["frames"]:
        assert set(f) == {"filename", "line", "name"}
        assert isinstance(f["filename"], str) and isinstance(f["line"], int)
print(" ".join(e["action"] for e in trace))
print(" ".join(f["name"] for f in trace[1]["frames"]))
"#;

#[test]
#[cfg_attr(miri, ignore = "runs python3")]
fn pickle_loads_in_python_with_pytorchs_field_names_and_types() {
    let (snap, want) = recorded_snapshot();
    let path = tmp("snapshot.pickle");
    snap.write_pickle(&path).unwrap();
    let out = match Command::new("python3")
        .arg("-c")
        .arg(PY_CHECK)
        .arg(&path)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            println!("skipped: no python3 ({e})");
            return;
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python3 rejected the pickle: {}{}",
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = stdout.lines();
    let actions: Vec<&str> = want.iter().map(|w| w.0.as_str()).collect();
    assert_eq!(lines.next().unwrap(), actions.join(" "));
    assert_eq!(lines.next().unwrap(), "allocate all-gather unit 3");
    let _ = std::fs::remove_file(path);
}

/// Where torch is installed: `_memory_viz trace_plot` renders our snapshot.
#[test]
#[cfg_attr(miri, ignore = "runs python")]
fn torch_memory_viz_renders_the_snapshot() {
    let Ok(python) = std::env::var("FSDP_TORCH_PYTHON") else {
        println!("skipped: no torch (set FSDP_TORCH_PYTHON to a Python with torch)");
        return;
    };
    let (snap, _) = recorded_snapshot();
    let path = tmp("viz.pickle");
    let html = tmp("viz.html");
    snap.write_pickle(&path).unwrap();
    let out = Command::new(&python)
        .args(["-m", "torch.cuda._memory_viz", "trace_plot"])
        .arg(&path)
        .arg("-o")
        .arg(&html)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "trace_plot failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("add_local_files") && page.contains("snapshot.pickle"));
    // The segment summary reads every segment and block field too.
    let out = Command::new(&python)
        .args(["-m", "torch.cuda._memory_viz", "stats"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "stats failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{}", String::from_utf8_lossy(&out.stdout));

    // tools/memory_viz_html.py: the same page with MemoryViz.js and d3 inlined (stand-ins
    // here with the real files' import lines), nothing left to fetch.
    let dir = std::env::temp_dir();
    let viz = dir.join(format!("fsdp-viz-{}.js", std::process::id()));
    let d3 = dir.join(format!("fsdp-d3-{}.js", std::process::id()));
    std::fs::write(
        &viz,
        "'use strict';\nimport * as d3 from \"https://cdn.skypack.dev/d3@5\";\n\
         import {axisLeft} from \"https://cdn.skypack.dev/d3-axis@1\";\n\
         export function add_local_files(files, kind) { window.viz_loaded = [files.length, kind]; }\n",
    )
    .unwrap();
    std::fs::write(&d3, "window.d3 = {axisLeft: 1}; // d3 stand-in\n").unwrap();
    let tool = concat!(env!("CARGO_MANIFEST_DIR"), "/tools/memory_viz_html.py");
    let out = Command::new(&python)
        .arg(tool)
        .arg(&path)
        .arg("-o")
        .arg(&html)
        .arg("--memory-viz-js")
        .arg(&viz)
        .arg("--d3")
        .arg(&d3)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "memory_viz_html.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(!page.contains("https://"), "{page}");
    assert!(page.contains("d3 stand-in") && page.contains("const d3 = window.d3;"));
    assert!(page.contains("const {axisLeft} = window.d3;"));
    assert!(page.contains("function add_local_files") && page.contains("snapshot.pickle"));
    for p in [path, html, viz, d3] {
        let _ = std::fs::remove_file(p);
    }
}
