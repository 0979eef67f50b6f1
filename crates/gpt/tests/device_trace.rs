//! `DeviceTrainer::set_tracing` (`fsdp train --device --trace`) on the kernels' host twins: each
//! micro-batch's parts in order (embeddings, every block's forward, the head, every block's
//! backward, the accumulation) and each step's optimizer step, as consecutive spans of the
//! compute track with the kinds and micro-batch numbers they name; the same steps and the same
//! training as without tracing, steps read one step late included; and `fsdp train --device
//! host-twin --trace` writes them as a Chrome trace.

mod common;

use common::cli::{fsdp, ok, s, scratch, small_train_args};
use common::device::device_config;
use fsdp::optim::LrSchedule;
use fsdp::trace::{SpanKind, TraceEvent};
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig, DeviceTrainer, StepOutcome};
use fsdp_kernels::gpt::HostOps;

const STEPS: usize = 2;

/// The parts of one micro-batch of the 2-layer model, then what follows them.
fn micro_batch_parts(after: &str) -> Vec<(SpanKind, String)> {
    let f = |n: &str| (SpanKind::Forward, n.to_string());
    let b = |n: &str| (SpanKind::Backward, n.to_string());
    vec![
        f("embedding forward"),
        f("forward block 0"),
        f("forward block 1"),
        f("head forward (ln_f)"),
        b("head (logits, cross-entropy and their backward)"),
        b("head backward (ln_f)"),
        b("backward block 1"),
        b("backward block 0"),
        b("embedding backward"),
        b(after),
    ]
}

/// Trains `STEPS` steps, traced when `trace`, read one step late when `late`; the outcomes,
/// the spans and the final parameters.
#[allow(clippy::type_complexity)]
fn run(
    c: DeviceTrainConfig,
    trace: bool,
    late: bool,
) -> (Vec<StepOutcome>, Vec<TraceEvent>, Vec<(String, Vec<f32>)>) {
    let tokens = synthetic_corpus(20_000, 64, 3);
    let params = seeded_params(&c.cfg, 3).unwrap();
    let mut t = DeviceTrainer::new(HostOps::new(), c, &params).unwrap();
    t.set_tracing(trace).unwrap();
    let mut outcomes = Vec::new();
    for step in 0..STEPS {
        if late {
            outcomes.extend(t.enqueue_step(&tokens, step).unwrap().map(|r| r.outcome));
        } else {
            outcomes.push(t.step(&tokens, step).unwrap());
        }
    }
    outcomes.extend(t.flush().unwrap().map(|r| r.outcome));
    let mut p: Vec<_> = t.full_params().unwrap().into_iter().collect();
    p.sort_by(|a, b| a.0.cmp(&b.0));
    (outcomes, t.trace_events(), p)
}

#[test]
fn a_traced_step_lists_its_parts_in_order_and_trains_the_same() {
    for (offload, late) in [(false, false), (false, true), (true, true)] {
        let c = DeviceTrainConfig {
            offload,
            ..device_config(LrSchedule::Constant, false, Some(0.5), 2)
        };
        let (plain, none, p_plain) = run(c, false, late);
        let (traced, events, p_traced) = run(c, true, late);
        assert!(none.is_empty());
        assert_eq!(
            plain, traced,
            "offload {offload}, late {late}: tracing changed a step"
        );
        assert_eq!(
            p_plain, p_traced,
            "offload {offload}: tracing changed a parameter"
        );
        let after = if offload {
            "gradients copied out"
        } else {
            "gradient accumulation"
        };
        let optimizer = if offload {
            "optimizer step on the host, parameters copied in"
        } else {
            "optimizer step"
        };
        let mut want = Vec::new();
        for step in 0..STEPS {
            for m in 0..2 {
                let micro = (step * 2 + m + 1) as u64;
                want.extend(
                    micro_batch_parts(after)
                        .into_iter()
                        .map(|(k, n)| (k, n, micro)),
                );
            }
            want.push((
                SpanKind::Optimizer,
                optimizer.to_string(),
                (step * 2 + 2) as u64,
            ));
        }
        let mut end = f64::NEG_INFINITY;
        let mut got = Vec::new();
        for e in &events {
            let TraceEvent::Span {
                kind,
                name,
                step,
                units,
                begin_us,
                end_us,
                bytes,
            } = e
            else {
                panic!("not a span: {e:?}");
            };
            assert!(units.is_empty() && bytes.is_none(), "{e:?}");
            assert!(begin_us <= end_us, "{e:?}");
            // Consecutive within a step; a step begins at or after the one before ended.
            assert!(*begin_us >= end || (begin_us - end).abs() < 1e-9, "{e:?}");
            end = *end_us;
            got.push((*kind, name.clone(), *step));
        }
        assert_eq!(got, want, "offload {offload}, late {late}");
    }
}

#[test]
fn activation_checkpointing_names_the_recomputation() {
    let c = DeviceTrainConfig {
        activation_checkpointing: true,
        ..device_config(LrSchedule::Constant, false, None, 1)
    };
    let (_, events, _) = run(c, true, false);
    let names: Vec<String> = events
        .iter()
        .filter_map(|e| match e {
            TraceEvent::Span { name, .. } if name.starts_with("backward block") => {
                Some(name.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(names[0], "backward block 1 (its forward again first)");
    assert_eq!(names.len(), 2 * STEPS);
}

#[test]
fn fsdp_train_device_writes_the_trace() {
    let dir = scratch("device_trace", "cli");
    let trace = dir.join("trace.json");
    let mut a = small_train_args(&["--batch-size", "8", "--steps", "3"], &[]);
    a.extend([
        "--device",
        "host-twin",
        "--trace",
        s(&trace),
        "--timeout",
        "60",
    ]);
    ok(&fsdp(&a), "fsdp train --device host-twin --trace");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    // 3 steps of one micro-batch: 9 parts each (no accumulation), and the optimizer step.
    assert_eq!(spans.len(), 3 * 10, "{v}");
    assert_eq!(spans[1]["name"], "forward block 0");
    assert_eq!(spans[9]["cat"], "optimizer");
    assert!(spans.iter().all(|e| e["pid"] == 0 && e["tid"] == 0));
}

/// Each rank of sharded training traces its steps: the units' collectives as parts of their
/// own between the model's (the root unsharded first, each block unsharded before its forward
/// and again before its backward under `FULL_SHARD`, each unit's gradients reduced after its
/// backward), then the step's end, consecutive on the compute track; tracing changes no bit.
#[test]
fn each_rank_of_sharded_training_traces_its_collectives() {
    use fsdp_collectives::ring;
    use fsdp_gpt::device_comm::HostComm;
    use fsdp_gpt::device_sharded::ShardedDeviceTrainer;
    use fsdp_gpt::runtime::ShardingStrategy;
    let c = device_config(LrSchedule::Constant, false, None, 1);
    let tokens = synthetic_corpus(20_000, 64, 1);
    let params = seeded_params(&c.cfg, 1).unwrap();
    let run = |trace: bool| {
        ring::run_ranks(2, ring::RingOptions::default(), |comm| {
            let comm = HostComm::new(Box::new(comm));
            let s = ShardingStrategy::FullShard;
            let mut t = ShardedDeviceTrainer::new(HostOps::new(), comm, c, s, &params).unwrap();
            t.set_tracing(trace).unwrap();
            let losses: Vec<u32> = (0..STEPS)
                .map(|s| t.step(&tokens, s).unwrap().loss.to_bits())
                .collect();
            (losses, t.trace_events())
        })
        .unwrap()
    };
    let (traced, plain) = (run(true), run(false));
    let f = |n: &str| (SpanKind::Forward, n.to_string());
    let b = |n: &str| (SpanKind::Backward, n.to_string());
    let mut want = vec![
        f("unshard the root"),
        f("embedding forward"),
        f("unshard block 0"),
        f("forward block 0"),
        f("unshard block 1"),
        f("forward block 1"),
        f("head forward (ln_f)"),
        b("head (logits, cross-entropy and their backward)"),
        b("head backward (ln_f)"),
        b("unshard block 1 for backward"),
        b("backward block 1"),
        b("reduce block 1's gradients"),
        b("unshard block 0 for backward"),
        b("backward block 0"),
        b("reduce block 0's gradients"),
        b("embedding backward"),
        b("reduce the root's gradients"),
        (
            SpanKind::Optimizer,
            "the ranks' loss and norm, the optimizer step on the shards".to_string(),
        ),
    ];
    want = [want.clone(), want].concat();
    for (rank, ((losses, events), (plain_losses, none))) in traced.iter().zip(&plain).enumerate() {
        assert_eq!(losses, plain_losses, "rank {rank}: tracing changes no bit");
        assert!(none.is_empty());
        let mut end = None;
        let got: Vec<(SpanKind, String)> = events
            .iter()
            .map(|e| match e {
                TraceEvent::Span {
                    kind,
                    name,
                    begin_us,
                    end_us,
                    ..
                } => {
                    assert!(end_us >= begin_us, "{name}");
                    if name == "unshard the root" {
                        // A step's first part: it begins where the step does.
                        end = None;
                    }
                    if let Some(prev) = end {
                        assert_eq!(
                            *begin_us, prev,
                            "rank {rank}: {name} follows the part before"
                        );
                    }
                    end = Some(*end_us);
                    (*kind, name.clone())
                }
                other => panic!("rank {rank}: {other:?}"),
            })
            .collect();
        assert_eq!(got, want, "rank {rank}");
    }
}
