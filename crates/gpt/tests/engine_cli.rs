//! `fsdp train --device host-twin --engine`: the training loop of `--device cpu` with the
//! engine's buffers on a device (the host twin, ranks as threads on the ring) and the GPT
//! computed there by the kernels' twins (`EngineGpt`, the path of `--device cuda --engine`),
//! against the engine's `fsdp train` on the CPU (the reference GPT) with the same options:
//! every step's loss within 1e-6 relative and `--save`'s weights within 1e-4 of the largest
//! (measured: 1.2e-7 and 2.0e-5; the twins differ from the reference by their own e^x, ln and
//! erfc and orders of summation), for every strategy, with clipping, accumulation, the cosine schedule, CPU
//! offload, activation checkpointing, bf16 reductions; a non-finite step stops (or is
//! skipped) with the engine's line; a checkpoint resumes to the uninterrupted run's losses,
//! and on the CPU (the engine's sharded checkpoints are one format) within the same bound.
//! With the device's default bf16 products, `--engine` and the GPT's device trainer train the
//! same bits (losses and saved weights) wherever they run the same operations (no
//! accumulation, clipping or grad scaler). And its refusals, each one `error:` line naming the
//! option.

mod common;

use common::cli::{
    checkpointing_args, cpu_against_device, fsdp, log_losses, loss_column,
    nonfinite_stops_and_skips_as_the_engine, ok, one_error_status_1, resume, resume_paths, s,
    scratch, small_train_args, CLIP_ACCUM_COSINE,
};

use std::path::Path;

const BOUND: f64 = 1e-6;
const STEPS: usize = 8;

/// The CPU engine's run against `--device host-twin --engine` (with `twin` added), the final
/// weights within `weights` of the largest one's magnitude.
fn compare_within(
    test: &str,
    ranks: &str,
    strategy: &str,
    (extra, twin): (&[&str], &[&str]),
    weights: f64,
) {
    let dir = scratch("engine_cli", test);
    let mut device = vec!["--device", "host-twin", "--engine"];
    device.extend(twin);
    let expect = format!("{ranks} ranks on the host twin of a device through the engine");
    let run = (ranks, strategy, STEPS);
    cpu_against_device(&dir, test, run, (extra, &device), &expect, (BOUND, weights));
}

fn compare(test: &str, ranks: &str, strategy: &str, extra: &[&str]) {
    compare_within(test, ranks, strategy, (extra, &[]), 1e-4);
}

#[test]
fn every_strategy_matches_the_engine_on_the_cpu() {
    compare("full_shard_2", "2", "full-shard", &CLIP_ACCUM_COSINE);
    compare("shard_grad_op_4", "4", "shard-grad-op", &[]);
    compare("no_shard_2", "2", "no-shard", &CLIP_ACCUM_COSINE);
    compare(
        "hybrid_shard_4",
        "4",
        "hybrid-shard",
        &["--ranks-per-node", "2", "--grad-accum", "2"],
    );
}

/// One rank with the shards offloaded to host memory and every block checkpointed; two
/// ranks reducing in bf16 (each gradient rounded to bf16 on both sides, in the same order:
/// held to the f32 runs' bounds; a gradient a last f32 bit apart may round to a neighbouring
/// bf16, measured: weights within 2.0e-5).
#[test]
fn offload_checkpointing_and_bf16_reductions_match_the_engine() {
    let twin = ["--cpu-offload", "--activation-checkpointing"];
    let options = (&["--grad-clip", "1.0"][..], &twin[..]);
    compare_within("offload_ckpt_1", "1", "full-shard", options, 1e-4);
    let mut extra = CLIP_ACCUM_COSINE.to_vec();
    extra.extend(["--reduce-dtype", "bf16"]);
    compare_within("full_shard_2_bf16", "2", "full-shard", (&extra, &[]), 1e-4);
}

#[test]
fn a_nonfinite_step_stops_or_is_skipped_as_on_the_cpu() {
    nonfinite_stops_and_skips_as_the_engine(&["--ranks", "2"], &["--ranks", "2", "--engine"]);
}

/// A run checkpointed at step 3 of 6 and resumed (through the engine on the device again)
/// logs the uninterrupted run's losses bit for bit; resumed on the CPU (the reference GPT on
/// the engine), within 1e-6.
#[test]
fn a_checkpoint_resumes_to_the_uninterrupted_losses() {
    let dir = scratch("engine_cli", "resume");
    let (ck, log, reference) = resume_paths(&dir);
    let _ = std::fs::remove_dir_all(&ck);
    let base = ["--batch-size", "8", "--ranks", "2", "--param-dtype", "f32"];
    let device = ["--device", "host-twin", "--engine"];
    let mut a = small_train_args(&base, &device);
    a.extend(["--steps", "6", "--loss-log", s(&reference)]);
    ok(&fsdp(&a), "the uninterrupted run");
    let mut b = small_train_args(&base, &device);
    b.extend(["--steps", "3"]);
    b.extend(checkpointing_args(&log, &ck, "3"));
    ok(&fsdp(&b), "the first half");
    let want = log_losses(&reference);
    // On the CPU first (its checkpoints elsewhere, so that ck's newest stays step 3).
    let (cpu_log, cpu_ck) = (dir.join("cpu.csv"), dir.join("ck-cpu"));
    let _ = std::fs::remove_dir_all(&cpu_ck);
    let cpu = [
        "--steps",
        "6",
        "--loss-log",
        s(&cpu_log),
        "--checkpoint-dir",
        s(&cpu_ck),
    ];
    ok(&resume(&ck, &cpu), "resumed on the CPU");
    // Its log holds steps 3 to 5 only.
    let cpu_losses: Vec<f64> = std::fs::read_to_string(&cpu_log)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(cpu_losses.len(), 3);
    for (got, want) in cpu_losses.iter().zip(&want[3..]) {
        assert!(((got - want) / want).abs() <= BOUND, "{got} vs {want}");
    }
    let out = ok(
        &resume(
            &ck,
            &[
                "--steps",
                "6",
                "--device",
                "host-twin",
                "--engine",
                "--loss-log",
                s(&log),
            ],
        ),
        "the resumed half",
    );
    assert!(out.contains("resuming from"), "{out}");
    assert_eq!(log_losses(&log), want);
}

#[test]
fn options_the_engine_on_a_device_does_not_take_are_refused() {
    let base = ["--batch-size", "8", "--steps", "1"];
    for (extra, needle) in [
        (&["--engine"][..], "--engine: only with --device cuda"),
        (
            &[
                "--device",
                "host-twin",
                "--engine",
                "--optimizer",
                "anyprecision-adamw",
            ][..],
            "--engine: --optimizer anyprecision-adamw is not supported",
        ),
        (
            &["--device", "host-twin", "--engine", "--backend", "tcp"][..],
            "--engine: ranks as processes run under fsdp launch",
        ),
    ] {
        let out = fsdp(&small_train_args(&base, extra));
        one_error_status_1(&out, &[needle]);
    }
}

/// `fsdp launch` of 2 processes over TCP trains as 2 threads on the ring, with clipping and
/// accumulation: the same losses and saved weights, bit for bit (the TCP ring's results are
/// the ring's). Under the launcher `--backend nccl` (CUDA buffers) and `ring` are refused on
/// the host twin, every rank stopping before it trains.
#[test]
fn ranks_as_processes_train_as_threads() {
    let dir = scratch("engine_cli", "processes");
    let (threads_log, procs_log) = (dir.join("threads.csv"), dir.join("procs.csv"));
    let (threads_w, procs_w) = (
        dir.join("threads.safetensors"),
        dir.join("procs.safetensors"),
    );
    let config = [
        "--batch-size",
        "8",
        "--steps",
        "4",
        "--grad-accum",
        "2",
        "--grad-clip",
        "0.5",
        "--param-dtype",
        "f32",
    ];
    let run = |launched: bool, log: &Path, save: &Path| {
        let mut a = Vec::new();
        if launched {
            a.extend(["launch", "--nproc-per-node", "2", "--master-port", "0"]);
        }
        a.extend(small_train_args(
            &config,
            &["--device", "host-twin", "--engine"],
        ));
        if !launched {
            a.extend(["--ranks", "2"]);
        }
        a.extend(["--loss-log", s(log), "--save", s(save)]);
        fsdp(&a)
    };
    ok(&run(false, &threads_log, &threads_w), "threads");
    ok(&run(true, &procs_log, &procs_w), "processes");
    assert_eq!(loss_column(&procs_log), loss_column(&threads_log));
    assert_eq!(
        std::fs::read(&procs_w).unwrap(),
        std::fs::read(&threads_w).unwrap(),
        "the saved weights"
    );
    for (backend, needle) in [
        ("nccl", "--backend nccl is not supported (tcp)"),
        ("ring", "--backend ring"),
    ] {
        let log = dir.join(format!("{backend}.csv"));
        let mut a = vec!["launch", "--nproc-per-node", "2", "--master-port", "0"];
        a.extend(small_train_args(
            &["--steps", "1", "--batch-size", "4"],
            &["--device", "host-twin", "--engine", "--backend", backend],
        ));
        a.extend(["--loss-log", s(&log)]);
        let out = fsdp(&a);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{backend}: {stderr}");
        assert!(stderr.contains(needle), "{backend}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!log.exists(), "{backend}: nothing written");
    }
}

/// With bf16 products (the device's default) and without accumulation, clipping or the grad
/// scaler, `--engine` and the GPT's device trainer run the same operations in the same order
/// on the same twins: the same losses and `--save`d weights bit for bit, at 1 and 2 ranks
/// (FULL_SHARD, SHARD_GRAD_OP with bf16 reductions, offload with checkpointing); at 4 ranks in
/// two nodes the weights bit for bit (the global loss is summed over the ranks in another
/// order). With accumulation the two differ by design: the device trainer reduces each
/// micro-batch, the engine once a step.
#[test]
fn the_engine_and_the_device_trainer_train_the_same_bits() {
    let base = ["--batch-size", "8", "--steps", "6"];
    for (test, extra, same_losses) in [
        ("same_1", &["--ranks", "1"][..], true),
        ("same_2", &["--ranks", "2"][..], true),
        (
            "same_sgo_bf16",
            &[
                "--ranks",
                "2",
                "--strategy",
                "shard-grad-op",
                "--reduce-dtype",
                "bf16",
            ][..],
            true,
        ),
        (
            "same_offload_ckpt",
            &[
                "--ranks",
                "2",
                "--cpu-offload",
                "--activation-checkpointing",
            ][..],
            true,
        ),
        (
            "same_hybrid_4",
            &[
                "--ranks",
                "4",
                "--strategy",
                "hybrid-shard",
                "--ranks-per-node",
                "2",
            ][..],
            false,
        ),
    ] {
        let dir = scratch("engine_cli", test);
        let run = |engine: bool| {
            let (log, w) = (
                dir.join(format!("{engine}.csv")),
                dir.join(format!("{engine}.st")),
            );
            let mut a = small_train_args(&base, extra);
            a.extend([
                "--device",
                "host-twin",
                "--loss-log",
                s(&log),
                "--save",
                s(&w),
            ]);
            if engine {
                a.push("--engine");
            }
            ok(&fsdp(&a), test);
            (log_losses(&log), std::fs::read(&w).unwrap())
        };
        let (engine, trainer) = (run(true), run(false));
        assert!(engine.1 == trainer.1, "{test}: the saved weights differ");
        if same_losses {
            assert_eq!(engine.0, trainer.0, "{test}");
        } else {
            for (a, b) in engine.0.iter().zip(&trainer.0) {
                assert!(((a - b) / b).abs() <= 1e-7, "{test}: {a} vs {b}");
            }
        }
    }
}

/// `--trace` with `--engine`: each rank's process holds the engine's collectives and the
/// kernels' parts (each block's forward and backward, the head, the hooks' unsharding and
/// reductions), timed on the device's timeline.
#[test]
fn a_trace_holds_the_engines_collectives_and_the_kernels_parts() {
    let dir = scratch("engine_cli", "trace");
    let trace = dir.join("t.json");
    let base = ["--batch-size", "8", "--steps", "2", "--ranks", "2"];
    let device = ["--device", "host-twin", "--engine", "--trace", s(&trace)];
    ok(&fsdp(&small_train_args(&base, &device)), "--engine --trace");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let spans: Vec<(u64, String)> = json["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for rank in [0, 1] {
        for want in [
            "all_gather unit 1",
            "reduce_scatter unit 2",
            "forward block 1",
            "backward block 0",
            "head (logits, cross-entropy and their backward)",
            "unshard block 1 for backward",
            "reduce block 0's gradients",
        ] {
            assert!(
                spans.iter().any(|(p, n)| *p == rank && n == want),
                "rank {rank}: {want} in {spans:?}"
            );
        }
    }
}

/// `fsdp train --engine` prints rank 0's device memory beside `fsdp plan --device --engine`'s
/// prediction: on the host twin the engine's buffers within the plan's range (the plan to one
/// unit's gradient more, as the device keeps up with the host or runs behind it) and the
/// kernels' buffers exactly; `fsdp plan` prints the same figures; with --cpu-offload too (the
/// device then holds less: no shards, gradient shards or optimizer state); a run whose planned
/// peak does not fit `--memory-limit` is refused before it starts.
#[test]
fn the_plan_predicts_the_devices_memory() {
    let config = ["--batch-size", "8", "--param-dtype", "f32", "--ranks", "2"];
    let twin = ["--device", "host-twin", "--engine", "--steps", "3"];
    let out = ok(&fsdp(&small_train_args(&config, &twin)), "train");
    let [engine, low, high, kernels, planned] = memory_line(&out);
    assert!(low <= engine && engine <= high && low < high, "{out}");
    assert_eq!(kernels, planned, "{out}");
    let mut plan = vec!["plan"];
    plan.extend(small_train_args(&config, &["--device", "host-twin", "--engine"])[1..].iter());
    let p = ok(&fsdp(&plan), "plan");
    assert!(p.contains("2 ranks on host-twin through the engine"), "{p}");
    let kb = |b: u64| format!("{:.1} KiB", b as f64 / 1024.0);
    assert!(
        p.contains(&format!("the engine's buffers {} at their peak", kb(low))),
        "{p}"
    );
    assert!(
        p.contains(&format!("kernels' buffers {} at theirs", kb(planned))),
        "{p}"
    );
    // Offloaded: the run within its plan's range, below the resident run's.
    let mut offloaded = small_train_args(&config, &twin);
    offloaded.push("--cpu-offload");
    let out_off = ok(&fsdp(&offloaded), "--cpu-offload");
    let [engine_off, low_off, high_off, kernels_off, planned_off] = memory_line(&out_off);
    assert!(low_off <= engine_off && engine_off <= high_off, "{out_off}");
    assert_eq!(kernels_off, planned_off, "{out_off}");
    assert!(high_off < low, "offloaded {high_off}, resident {low}");
    plan.push("--cpu-offload");
    let p_off = ok(&fsdp(&plan), "plan --cpu-offload");
    assert!(
        p_off.contains(&format!(
            "the engine's buffers {} at their peak",
            kb(low_off)
        )) && p_off.contains("(shards and gradient shards 0 B, optimizer state 0 B)"),
        "{p_off}"
    );
    // The device's caching allocator takes --alloc-conf (the host twin's too): the same
    // losses, bit for bit, and the plan of the same allocator (its rounding) brackets the run.
    let conf = "expandable_segments:True,roundup_power2_divisions:4";
    let mut with_conf = small_train_args(&config, &twin);
    with_conf.extend(["--alloc-conf", conf]);
    let out_conf = ok(&fsdp(&with_conf), "--alloc-conf");
    assert!(out_conf.contains("allocator: roundup_power2_divisions:4,expandable_segments:True"));
    let done = |o: &str| {
        o.lines()
            .find(|l| l.starts_with("done:"))
            .map(|l| l.rsplit("; ").next().map(String::from))
    };
    assert_eq!(done(&out_conf), done(&out), "{out_conf}");
    let [engine, low, high, kernels, planned] = memory_line(&out_conf);
    assert!(low <= engine && engine <= high, "{out_conf}");
    assert_eq!(kernels, planned, "{out_conf}");
    // Admission on the plan: two ranks of the plan's peak with its margin do not fit in 1 MiB.
    let mut small = small_train_args(&config, &twin);
    small.extend(["--memory-limit", "1MiB"]);
    one_error_status_1(
        &fsdp(&small),
        &[
            "--engine: the run needs",
            "2 ranks of",
            "1.0 MiB is --memory-limit",
        ],
    );
}

/// The host is admitted on the plan's host figures: `fsdp plan --engine` prints each rank's
/// host memory (its figure checked against the host twins' by `tests/engine_plan.rs`); on the
/// host twin, whose device memory is the host's, `--memory-limit` bounds both. A limit of one
/// rank's host memory admits the device (two ranks' device peaks fit) but not the host; the
/// refusal names what it needs, in bytes, at least both ranks' host memory and the corpus; a
/// run with exactly that limit is admitted (its one step within the plan of one step), and
/// one byte less is refused.
#[test]
fn the_host_is_admitted_on_the_plans_host_figures() {
    let config = ["--batch-size", "8", "--param-dtype", "f32", "--ranks", "2"];
    let mut plan = vec!["plan"];
    plan.extend(small_train_args(&config, &["--device", "host-twin", "--engine"])[1..].iter());
    plan.push("--cpu-offload");
    let p = ok(&fsdp(&plan), "plan");
    let line = p
        .lines()
        .find(|l| l.starts_with("host memory per rank:"))
        .unwrap_or_else(|| panic!("{p}"));
    let host_peak = number_before(line, " bytes)");
    let twin = [
        "--device",
        "host-twin",
        "--engine",
        "--cpu-offload",
        "--steps",
        "1",
    ];
    let with_limit = |limit: u64| {
        let limit = limit.to_string();
        let mut a: Vec<String> = small_train_args(&config, &twin)
            .iter()
            .map(|a| a.to_string())
            .collect();
        a.extend(["--memory-limit".to_string(), limit]);
        fsdp(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let refused = one_error_status_1(
        &with_limit(host_peak),
        &[
            "--engine: not enough host memory",
            "2 ranks as threads of this process",
            "offloaded ones throughout",
            "--memory-limit",
        ],
    );
    let needed = number_before(&refused, " bytes) for");
    // The synthetic corpus: 200 000 tokens of 2 bytes.
    assert!(needed >= 2 * host_peak + 400_000, "{refused}");
    let out = ok(&with_limit(needed), "the limit of the host's need");
    // A run of one step within the plan of one step (its first step prefetches nothing).
    let [engine, low, high, kernels, planned] = memory_line(&out);
    assert!(low <= engine && engine <= high, "{out}");
    assert_eq!(kernels, planned, "{out}");
    one_error_status_1(
        &with_limit(needed - 1),
        &["--engine: not enough host memory"],
    );
}

/// The number that ends right before `end` in `text`.
fn number_before(text: &str, end: &str) -> u64 {
    let at = text
        .find(end)
        .unwrap_or_else(|| panic!("{end:?} in {text}"));
    let digits = text[..at]
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap_or_default();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("{end:?} in {text}"))
}

/// The figures of `fsdp train --engine`'s line on rank 0's device memory: the engine's peak,
/// its predicted range, the kernels' count and its prediction.
fn memory_line(out: &str) -> [u64; 5] {
    let line = out
        .lines()
        .find(|l| l.starts_with("device memory (rank 0):"))
        .unwrap_or_else(|| panic!("{out}"));
    let n: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    // After "rank 0".
    n[1..].try_into().unwrap_or_else(|_| panic!("{line}"))
}
