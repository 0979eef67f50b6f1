//! The timeline trace: FULL_SHARD at world 2 with BACKWARD_PRE and forward prefetch, 2 steps on
//! a 4-block model, written as Chrome trace JSON, parsed back and checked: metadata, compute
//! spans of every unit in forward and backward, all-gather and reduce-scatter spans with the
//! per-rank payload `unit params × 4 / F`, counter tracks, and communication overlapping
//! compute in time on the same rank.
//!
//! Overlap on a loaded 2-core machine: the model is large enough (E = 256, vocabulary 2048,
//! about 3.7M parameters, a block all-gather of 1.6 MB per rank) that a prefetched block
//! all-gather runs on the communication thread for a measurable time while the compute thread
//! runs the current block; the test requires at least one such intersection per rank, and
//! retries the run (up to 3 times) before failing, so a single unlucky scheduling of the two
//! rank threads plus their communication threads on 2 cores cannot fail it.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use fsdp::trace::{write_chrome_trace, TraceEvent};
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::{get_batch, synthetic_corpus};
use fsdp_gpt::model::{init_params, named_params, GptConfig};
use fsdp_gpt::runtime::{BackwardPrefetch, FsdpConfig, FsdpGpt, ShardingStrategy};
use fsdp_gpt::tree::gpt_block_plan;
use serde_json::Value;

const WORLD: usize = 2;

fn run(cfg: GptConfig) -> Vec<Vec<TraceEvent>> {
    let init = named_params(&cfg, init_params(&cfg, 1)).unwrap();
    let tokens = synthetic_corpus(20_000, cfg.vocab_size as u16, 2);
    let opt = common::adamw();
    let plan = gpt_block_plan(&cfg);
    let opts = ring::RingOptions::default().with_timeout(Duration::from_secs(60));
    ring::run_ranks(WORLD, opts, |comm| {
        let rank = comm.rank();
        let config = FsdpConfig {
            backward_prefetch: BackwardPrefetch::Pre,
            forward_prefetch: true,
            trace: true,
            ..FsdpConfig::new(ShardingStrategy::FullShard)
        };
        let mut fsdp = FsdpGpt::new(Box::new(comm), cfg, &plan, &init, config, opt).unwrap();
        for k in 0..2 {
            let batch = get_batch(&tokens, k, 4, 32, rank, WORLD).unwrap();
            fsdp.step(&batch, 4 * 32).unwrap();
        }
        fsdp.trace_events()
    })
    .unwrap()
}

struct Span {
    name: String,
    cat: String,
    tid: u64,
    ts: f64,
    end: f64,
    units: Vec<usize>,
    bytes: Option<u64>,
}

/// Parse the file; check metadata and counters; return the spans per rank.
fn parse(path: &std::path::Path) -> Vec<Vec<Span>> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().expect("traceEvents array");
    let mut spans: Vec<Vec<Span>> = (0..WORLD).map(|_| Vec::new()).collect();
    let mut process_names = HashMap::new();
    let mut thread_names = BTreeSet::new();
    let mut counters = [0usize; WORLD];
    for e in events {
        let pid = e["pid"].as_u64().unwrap() as usize;
        assert!(pid < WORLD);
        match e["ph"].as_str().unwrap() {
            "M" => match e["name"].as_str().unwrap() {
                "process_name" => {
                    process_names.insert(pid, e["args"]["name"].as_str().unwrap().to_string());
                }
                "thread_name" => {
                    thread_names.insert((
                        pid,
                        e["tid"].as_u64().unwrap(),
                        e["args"]["name"].as_str().unwrap().to_string(),
                    ));
                }
                _ => {}
            },
            "C" => {
                assert_eq!(e["name"], "memory");
                assert!(e["ts"].as_f64().is_some());
                let alloc = e["args"]["allocated"].as_u64().unwrap();
                let reserved = e["args"]["reserved"].as_u64().unwrap();
                assert!(alloc > 0 && alloc <= reserved);
                counters[pid] += 1;
            }
            "X" => {
                let ts = e["ts"].as_f64().unwrap();
                let dur = e["dur"].as_f64().unwrap();
                assert!(dur >= 0.0);
                spans[pid].push(Span {
                    name: e["name"].as_str().unwrap().to_string(),
                    cat: e["cat"].as_str().unwrap().to_string(),
                    tid: e["tid"].as_u64().unwrap(),
                    ts,
                    end: ts + dur,
                    units: e["args"]["units"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|u| u.as_u64().unwrap() as usize)
                        .collect(),
                    bytes: e["args"]["bytes"].as_u64(),
                });
            }
            other => panic!("unexpected phase {other}"),
        }
    }
    for rank in 0..WORLD {
        assert_eq!(process_names[&rank], format!("rank {rank}"));
        assert!(thread_names.contains(&(rank, 0, "compute".to_string())));
        assert!(thread_names.contains(&(rank, 1, "communication".to_string())));
        // Two counter samples (allocated, reserved) per compute span boundary.
        let compute = spans[rank].iter().filter(|s| s.tid == 0).count();
        assert_eq!(counters[rank], 2 * compute, "rank {rank}");
    }
    spans
}

/// Whether some communication span intersects some compute span in time.
fn overlaps(spans: &[Span]) -> bool {
    spans.iter().filter(|c| c.tid == 1).any(|c| {
        spans
            .iter()
            .filter(|s| s.tid == 0)
            .any(|s| c.ts < s.end && s.ts < c.end)
    })
}

#[test]
fn trace_has_every_track_and_overlaps_communication_with_compute() {
    let cfg = GptConfig::new(4, 4, 256, 32, 2048).unwrap();
    let plan = gpt_block_plan(&cfg);
    let numel: Vec<usize> = plan.units.iter().map(|u| u.numel()).collect();
    assert_eq!(numel.len(), 5);
    let dir = std::env::temp_dir().join(format!("fsdp-trace-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("trace.json");

    let mut overlapped = false;
    for attempt in 0..3 {
        let per_rank = run(cfg);
        write_chrome_trace(&path, &per_rank).unwrap();
        let spans = parse(&path);
        for (rank, spans) in spans.iter().enumerate() {
            for (cat, tid) in [("forward", 0), ("backward", 0)] {
                let seen: BTreeSet<usize> = spans
                    .iter()
                    .filter(|s| s.cat == cat)
                    .inspect(|s| assert_eq!(s.tid, tid))
                    .flat_map(|s| s.units.iter().copied())
                    .collect();
                assert_eq!(seen, (0..numel.len()).collect(), "rank {rank} {cat}");
                // One span per stage (embed, 4 blocks, head) per step.
                assert_eq!(spans.iter().filter(|s| s.cat == cat).count(), 2 * 6);
            }
            for cat in ["all_gather", "reduce_scatter"] {
                let comm: Vec<&Span> = spans.iter().filter(|s| s.cat == cat).collect();
                assert!(!comm.is_empty(), "rank {rank}: no {cat}");
                for s in &comm {
                    assert_eq!(s.tid, 1);
                    assert_eq!(s.units.len(), 1, "{}", s.name);
                    let u = s.units[0];
                    assert_eq!(numel[u] % WORLD, 0);
                    assert_eq!(s.bytes, Some((numel[u] * 4 / WORLD) as u64), "{}", s.name);
                    assert!(s.end >= s.ts);
                }
            }
            // Every unit is reduce-scattered once per step; the blocks are gathered in forward
            // and again in backward, the root once per step.
            let count = |cat: &str, u: usize| {
                spans
                    .iter()
                    .filter(|s| s.cat == cat && s.units == [u])
                    .count()
            };
            for u in 0..numel.len() {
                assert_eq!(count("reduce_scatter", u), 2, "rank {rank} unit {u}");
                assert_eq!(
                    count("all_gather", u),
                    if u == 0 { 2 } else { 4 },
                    "rank {rank} unit {u}"
                );
            }
            // The loss all-reduce, 4 bytes.
            assert!(spans
                .iter()
                .any(|s| s.cat == "all_reduce" && s.bytes == Some(4)));
        }
        if spans.iter().all(|s| overlaps(s)) {
            overlapped = true;
            break;
        }
        eprintln!("attempt {attempt}: no communication/compute overlap on some rank; retrying");
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        overlapped,
        "no communication span intersected a compute span on every rank in 3 runs"
    );
}

#[test]
fn tracing_off_records_nothing_and_an_empty_trace_is_valid_json() {
    let cfg = GptConfig::new(1, 2, 32, 16, 96).unwrap();
    let init = named_params(&cfg, init_params(&cfg, 0)).unwrap();
    let tokens = synthetic_corpus(2_000, 96, 1);
    let opt = common::adamw();
    let events = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
        let rank = comm.rank();
        let config = FsdpConfig::new(ShardingStrategy::FullShard);
        let mut fsdp = FsdpGpt::new(
            Box::new(comm),
            cfg,
            &gpt_block_plan(&cfg),
            &init,
            config,
            opt,
        )
        .unwrap();
        let batch = get_batch(&tokens, 0, 2, 16, rank, 2).unwrap();
        fsdp.step(&batch, 2 * 16).unwrap();
        fsdp.trace_events()
    })
    .unwrap();
    assert!(events.iter().all(Vec::is_empty));
    let dir = std::env::temp_dir().join(format!("fsdp-trace-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("empty.json");
    write_chrome_trace(&path, &events).unwrap();
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    // Only metadata: process name, sort index and two thread names per rank.
    assert_eq!(v["traceEvents"].as_array().unwrap().len(), 2 * 4);
    let _ = std::fs::remove_dir_all(&dir);
}
