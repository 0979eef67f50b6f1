//! `fsdp train --device host-twin --ranks N --strategy S`: sharded training on one device
//! through the command line (ranks as threads over the host twins, `PeerComm`: the path of
//! `--device cuda --ranks N`) against the engine's `fsdp train --ranks N --strategy S` on the
//! same options: every step's loss within 1e-4 relative (issue 16's criterion; the largest
//! difference is printed) and `--save`'s weights within 1e-4 of the model's largest weight,
//! for every strategy (the hybrid ones in nodes of `--ranks-per-node`), with clipping,
//! accumulation and the cosine schedule. `fsdp plan --device --ranks N` predicts each rank's
//! peak exactly and admission uses it; `--trace` writes a process per rank; a non-finite step
//! stops (or is skipped) as on the engine. And its refusals, each one `error:` line naming the
//! option: hybrid strategies without `--ranks-per-node`, the engine's prefetch options, f16
//! reductions. `--cpu-offload` logs the losses of the run without it, and ranks as processes
//! under `fsdp launch` those of ranks as threads (also with `--reduce-dtype bf16`).

mod common;

use std::path::Path;

use common::cli::{
    cpu_against_device, fsdp, log_losses, ok, one_error_status_1, s, scratch, small_train_args,
    CLIP_ACCUM_COSINE,
};

const BOUND: f64 = 1e-4;
const STEPS: usize = 10;

fn compare(test: &str, ranks: &str, strategy: &str, extra: &[&str]) {
    compare_within(test, ranks, strategy, extra, BOUND);
}

/// [`compare`], the final weights within `weights` of the largest one's magnitude.
fn compare_within(test: &str, ranks: &str, strategy: &str, extra: &[&str], weights: f64) {
    let dir = scratch("device_sharded_cli", test);
    let run = (ranks, strategy, STEPS);
    let device = (extra, &["--device", "host-twin"][..]);
    let expect = format!("{ranks} ranks on host-twin");
    cpu_against_device(&dir, test, run, device, &expect, (BOUND, weights));
}

#[test]
fn full_shard_at_two_ranks_matches_the_engine() {
    compare("full_shard_2", "2", "full-shard", &CLIP_ACCUM_COSINE);
}

#[test]
fn shard_grad_op_at_four_ranks_matches_the_engine() {
    compare("shard_grad_op_4", "4", "shard-grad-op", &[]);
}

#[test]
fn hybrid_shard_at_four_ranks_in_two_nodes_matches_the_engine() {
    compare(
        "hybrid_shard_4",
        "4",
        "hybrid-shard",
        &["--ranks-per-node", "2"],
    );
    compare(
        "hybrid_shard_zero2_4",
        "4",
        "hybrid-shard-zero2",
        &["--ranks-per-node", "2", "--grad-accum", "2"],
    );
}

/// `--reduce-dtype bf16` (FSDP's `reduce_dtype`) on the device against the engine's: both
/// round each gradient to bf16 and reduce with bf16's rounding. The device reduces each
/// micro-batch and the engine once a step (its `no_sync` accumulation), and a gradient that
/// differs in its last f32 bit can round to a neighbouring bf16, so the runs differ more than
/// in f32: the losses stay within the same 1e-4. The weights are held to 1e-2 of the largest
/// (f32: 1e-4): AdamW divides each gradient by its own running magnitude, so a gradient
/// rounded one bf16 step apart (2⁻⁸ relative) moves its weight up to 2⁻⁸ of a step of `lr`
/// (3e-3) differently each step, and more where the gradient is near zero (measured: losses
/// within 6.4e-6, weights within 7.6e-4).
#[test]
fn full_shard_reducing_in_bf16_tracks_the_engine() {
    let mut extra = CLIP_ACCUM_COSINE.to_vec();
    extra.extend(["--reduce-dtype", "bf16"]);
    compare_within("full_shard_2_bf16", "2", "full-shard", &extra, 1e-2);
}

/// `--reduce-dtype f16` likewise: each gradient rounded to f16 and reduced with f16's rounding
/// on the device and in the engine, held to the bf16 run's bounds (f16 keeps 3 more bits).
#[test]
fn full_shard_reducing_in_f16_tracks_the_engine() {
    let mut extra = CLIP_ACCUM_COSINE.to_vec();
    extra.extend(["--reduce-dtype", "f16"]);
    compare_within("full_shard_2_f16", "2", "full-shard", &extra, 1e-2);
}

/// `--wrap size:3000`: three units of linear layers a block, the rest of the blocks in the
/// root (`tests/device_wrap.rs` works the units out), on the device and in the engine.
#[test]
fn full_shard_with_units_of_layers_matches_the_engine() {
    let mut extra = CLIP_ACCUM_COSINE.to_vec();
    extra.extend(["--wrap", "size:3000"]);
    compare("full_shard_2_size", "2", "full-shard", &extra);
}

#[test]
fn no_shard_at_two_ranks_matches_the_engine() {
    compare("no_shard_2", "2", "no-shard", &CLIP_ACCUM_COSINE);
}

#[test]
fn several_ranks_refuse_what_they_do_not_run() {
    let dir = scratch("device_sharded_cli", "refusals");
    let log = dir.join("log.csv");
    let run = |extra: &[&str]| {
        let mut a = small_train_args(
            &["--steps", "2", "--batch-size", "4", "--device", "host-twin"],
            &["--ranks", "2", "--loss-log", s(&log)],
        );
        a.extend(extra);
        fsdp(&a)
    };
    let cases: [(&[&str], &[&str]); 2] = [
        (
            &["--strategy", "hybrid-shard"],
            &["--strategy hybrid-shard", "--ranks-per-node"],
        ),
        (
            &["--backward-prefetch", "none"],
            &["--backward-prefetch", "not supported"],
        ),
    ];
    for (extra, needles) in cases {
        one_error_status_1(&run(extra), needles);
    }
    // Micro-batches of 3 rows do not split over 2 ranks: the engine's error.
    let mut a = small_train_args(
        &["--steps", "2", "--batch-size", "6", "--grad-accum", "2"],
        &["--device", "host-twin", "--ranks", "2"],
    );
    a.extend(["--loss-log", s(&log)]);
    one_error_status_1(&fsdp(&a), &["3", "2"]);
    // Refused before anything was written.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

/// `fsdp plan --device host-twin --ranks N` predicts the peak each rank of `fsdp train` counts,
/// to the byte, and admission refuses a run whose ranks together exceed `--memory-limit`.
#[test]
fn plan_predicts_each_ranks_peak_and_admission_uses_it() {
    for (ranks, strategy, extra) in [
        ("4", "hybrid-shard", &["--ranks-per-node", "2"][..]),
        ("2", "full-shard", &["--activation-checkpointing"][..]),
        ("4", "shard-grad-op", &["--grad-accum", "2"][..]),
        ("2", "no-shard", &["--param-dtype", "bf16"][..]),
    ] {
        let base = [
            "--batch-size",
            "8",
            "--ranks",
            ranks,
            "--strategy",
            strategy,
            "--device",
            "host-twin",
        ];
        let mut p = vec!["plan"];
        p.extend_from_slice(&common::cli::SMALL_MODEL);
        p.extend(base);
        p.extend(extra);
        let plan = ok(&fsdp(&p), "fsdp plan");
        let line = plan.lines().find(|l| l.starts_with("peak: ")).unwrap();
        let planned: u64 = line["peak: ".len()..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let mut a = small_train_args(&["--steps", "3"], &base);
        a.extend(extra);
        let out = ok(&fsdp(&a), "fsdp train");
        let line = out.lines().find(|l| l.starts_with("device: ")).unwrap();
        let per_rank = line
            .split("per rank ")
            .nth(1)
            .unwrap()
            .split(" bytes")
            .next()
            .unwrap();
        let peaks: Vec<u64> = per_rank.split(", ").map(|v| v.parse().unwrap()).collect();
        assert_eq!(peaks.len(), ranks.parse::<usize>().unwrap(), "{line}");
        assert!(
            peaks.iter().all(|&p| p == planned),
            "{ranks} {strategy}: planned {planned}, {line}"
        );
        assert!(line.contains(&format!("predicted {planned}")), "{line}");
        // A limit just below the ranks' total is refused, naming both figures.
        let limit = (planned * ranks.parse::<u64>().unwrap() - 1).to_string();
        let mut a = small_train_args(&["--steps", "3", "--memory-limit", &limit], &base);
        a.extend(extra);
        one_error_status_1(&fsdp(&a), &["ranks of", "--memory-limit"]);
        println!("{ranks} ranks, {strategy} {extra:?}: {planned} bytes per rank, planned exactly");
    }
}

/// A non-finite step stops every rank with the engine's error line (and with
/// `--skip-nonfinite` is skipped first), as at one rank.
#[test]
fn several_ranks_stop_and_skip_non_finite_steps_as_the_engine() {
    common::cli::nonfinite_stops_and_skips_as_the_engine(&["--ranks", "2"], &["--ranks", "2"]);
}

/// `--trace` with several ranks writes one Chrome trace with a process per rank, each with the
/// units' collectives among the model's parts.
#[test]
fn several_ranks_write_one_trace() {
    let dir = scratch("device_sharded_cli", "trace");
    let trace = dir.join("t.json");
    let a = small_train_args(
        &["--steps", "2", "--batch-size", "8", "--device", "host-twin"],
        &["--ranks", "2", "--trace", s(&trace)],
    );
    ok(&fsdp(&a), "fsdp train --trace");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    for pid in [0, 1] {
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["pid"] == pid && e["ph"] == "X")
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        for want in [
            "unshard block 0",
            "forward block 1",
            "reduce block 0's gradients",
        ] {
            assert_eq!(
                names.iter().filter(|&&n| n == want).count(),
                2,
                "rank {pid}: {want} once a step: {names:?}"
            );
        }
    }
}

/// `--cpu-offload` with two ranks logs bitwise the losses of the run without it, and its
/// counted peak is the plan's and lower.
#[test]
fn cpu_offload_with_two_ranks_logs_the_same_losses() {
    let dir = scratch("device_sharded_cli", "offload");
    let run = |offload: bool| {
        let log = dir.join(format!("{offload}.csv"));
        let mut a = small_train_args(
            &["--steps", "4", "--batch-size", "8", "--device", "host-twin"],
            &[
                "--ranks",
                "2",
                "--param-dtype",
                "f32",
                "--loss-log",
                s(&log),
            ],
        );
        if offload {
            a.push("--cpu-offload");
        }
        let out = ok(&fsdp(&a), "fsdp train");
        let line = out
            .lines()
            .find(|l| l.starts_with("device: "))
            .unwrap()
            .to_string();
        (log_losses(&log), line)
    };
    let ((with, line_with), (without, line_without)) = (run(true), run(false));
    assert_eq!(with, without);
    let peak = |l: &str| -> u64 {
        l.split("per rank ")
            .nth(1)
            .unwrap()
            .split(',')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(
        peak(&line_with) < peak(&line_without),
        "{line_with} / {line_without}"
    );
    assert!(
        line_with.contains(&format!("predicted {}", peak(&line_with))),
        "{line_with}"
    );
}

/// Ranks as processes under `fsdp launch` (`--device host-twin`: each process one rank, the
/// collectives over TCP through `StagedComm`, the code NCCL runs on GPUs, prefetching the
/// next unit's all-gather in forward and backward) log bitwise the losses of the same ranks
/// as threads and save the same weights; rank 0 reports.
#[test]
fn launched_processes_train_as_threads() {
    let dir = scratch("device_sharded_cli", "launched");
    for (n, extra, param, i) in [
        ("2", &["--strategy", "full-shard"][..], "f32"),
        // Gradients reduced in bf16: every collective is over 2 ranks, whose sum is the
        // same in either order, so processes and threads agree bitwise.
        (
            "4",
            &[
                "--strategy",
                "hybrid-shard",
                "--ranks-per-node",
                "2",
                "--reduce-dtype",
                "bf16",
            ][..],
            "f32",
        ),
        // Pure bf16 (AnyPrecisionAdamW on bf16 parameters): the units gathered in bf16.
        (
            "2",
            &[
                "--strategy",
                "shard-grad-op",
                "--optimizer",
                "anyprecision-adamw",
            ][..],
            "bf16",
        ),
        // f16 products with the grad scaler (on by default with f16): every rank decides
        // the same scale from the same reduced squares.
        ("2", &["--strategy", "full-shard"][..], "f16"),
        // Units of linear layers (`--wrap size:3000`): several all-gathers a block, each
        // prefetched one unit ahead.
        (
            "2",
            &["--strategy", "full-shard", "--wrap", "size:3000"][..],
            "f32",
        ),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (n, extra, param))| (n, extra, param, i))
    {
        let n_tag = format!("{i}-{n}{param}");
        let n_tag = n_tag.as_str();
        let (procs, threads) = (
            dir.join(format!("p{n_tag}.csv")),
            dir.join(format!("t{n_tag}.csv")),
        );
        let (wp, wt) = (
            dir.join(format!("p{n_tag}.safetensors")),
            dir.join(format!("t{n_tag}.safetensors")),
        );
        let base = ["--steps", "4", "--batch-size", "8", "--device", "host-twin"];
        let mut a = vec!["launch", "--nproc-per-node", n, "--master-port", "0"];
        a.extend(small_train_args(&base, extra));
        // The processes issue each block's all-gather one unit ahead in both directions.
        a.push("--forward-prefetch");
        a.extend([
            "--param-dtype",
            param,
            "--loss-log",
            s(&procs),
            "--save",
            s(&wp),
        ]);
        let out = ok(&fsdp(&a), "fsdp launch ... train --device host-twin");
        assert!(
            out.contains(&format!(
                "[rank 0] fsdp train: rank 0 of {n} processes on host-twin (tcp)"
            )),
            "{out}"
        );
        assert!(
            !out.contains("[rank 1] fsdp train"),
            "rank 0 reports alone: {out}"
        );
        let (reduced, moved) = if extra.contains(&"bf16") {
            (
                "reductions: the gradients in bf16 (each unit's rounded",
                "(parameters in f32, gradients in bf16)",
            )
        } else if param == "bf16" {
            (
                "reductions: the gradients in f32",
                "(parameters in bf16, gradients in f32)",
            )
        } else {
            (
                "reductions: the gradients in f32",
                "(parameters in f32, gradients in f32)",
            )
        };
        assert!(out.contains(reduced), "{out}");
        if param == "f16" {
            assert!(out.contains("grad scaler: final scale 65536"), "{out}");
        }
        // The summary's bytes moved by rank 0's collectives (`comm_volume`).
        let line = out
            .lines()
            .find(|l| l.contains("rank 0's collectives moved: all-gathered"))
            .unwrap_or_else(|| panic!("{out}"));
        assert!(line.ends_with(moved), "{line}");
        // Rank 0's peak (the operations' and the staging buffers') is the process plan's.
        let (line, peak) = common::cli::device_peak_line(&out, "host-twin");
        assert!(
            line.contains(&format!(
                "(predicted {peak}: fsdp plan --device host-twin --ranks {n})"
            )),
            "{line}"
        );
        let mut b = small_train_args(&base, extra);
        b.extend([
            "--ranks",
            n,
            "--param-dtype",
            param,
            "--loss-log",
            s(&threads),
            "--save",
            s(&wt),
        ]);
        ok(&fsdp(&b), "fsdp train --device host-twin --ranks N");
        assert_eq!(
            log_losses(&procs),
            log_losses(&threads),
            "{n} ranks {extra:?}"
        );
        let cfg = fsdp_gpt::model::GptConfig::new(2, 2, 32, 16, 64).unwrap();
        let load = |p: &Path| fsdp_gpt::checkpoint::load_full(p, &cfg).unwrap();
        assert_eq!(
            load(&wp),
            load(&wt),
            "{n} ranks {extra:?}: the saved weights"
        );
    }
}

/// `--backend` of ranks as processes on a device: nccl needs CUDA buffers (refused on the
/// host twins, and by the CPU engine), ring is not a backend of processes; every rank stops
/// with the error before training. `tcp` is the host twins' default and runs.
#[test]
fn launched_processes_take_tcp_or_nccl() {
    let dir = scratch("device_sharded_cli", "backends");
    let log = dir.join("log.csv");
    let launch = |backend: &str| {
        let mut a = vec!["launch", "--nproc-per-node", "2", "--master-port", "0"];
        a.extend(small_train_args(
            &["--steps", "1", "--batch-size", "4", "--device", "host-twin"],
            &["--loss-log", s(&log), "--backend"],
        ));
        a.extend(backend.split(' '));
        fsdp(&a)
    };
    for (backend, needle) in [
        (
            "nccl",
            "--backend nccl runs on CUDA buffers: use --device cuda, or tcp",
        ),
        ("ring", "--backend ring"),
        (
            "tcp --backward-prefetch post",
            "--backward-prefetch post is not supported",
        ),
    ] {
        let out = launch(backend);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{backend}: {stderr}");
        assert!(stderr.contains(needle), "{backend}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!log.exists(), "{backend}: nothing written");
    }
    // The first line says which all-gathers are prefetched: backward by default, both with
    // --forward-prefetch, none at --limit-all-gathers 1 (a prefetch is one unit deep).
    for (options, says) in [
        ("tcp", Some("all-gathers prefetched in backward")),
        (
            "tcp --forward-prefetch",
            Some("all-gathers prefetched in forward and backward"),
        ),
        ("tcp --forward-prefetch --limit-all-gathers 1", None),
        ("tcp --backward-prefetch none --limit-all-gathers 2", None),
    ] {
        let out = ok(&launch(options), options);
        let first = out
            .lines()
            .find(|l| l.contains("fsdp train: rank 0"))
            .unwrap();
        match says {
            Some(says) => assert!(first.contains(says), "{options}: {first}"),
            None => assert!(!first.contains("prefetched"), "{options}: {first}"),
        }
    }
    assert!(log.exists());
    let mut a = small_train_args(
        &["--steps", "1", "--batch-size", "4"],
        &["--backend", "nccl"],
    );
    a.extend(["--ranks", "2"]);
    one_error_status_1(
        &fsdp(&a),
        &["--backend nccl needs CUDA buffers", "--device cuda"],
    );
}

/// A run reducing in bf16 checkpoints its `--reduce-dtype`: resumed from its first checkpoint
/// without the option, it reduces in bf16 again and logs the uninterrupted run's losses
/// bitwise; resumed with `--reduce-dtype f32` it is refused, naming both.
#[test]
fn resume_keeps_the_reduction_dtype() {
    let dir = scratch("device_sharded_cli", "resume_bf16");
    let (ck, log, reference) = common::cli::resume_paths(&dir);
    let base = ["--batch-size", "8", "--ranks", "2", "--device", "host-twin"];
    let mut a = small_train_args(&base, &["--reduce-dtype", "bf16", "--steps", "6"]);
    a.extend(["--loss-log", s(&reference)]);
    ok(&fsdp(&a), "the uninterrupted run");
    // The constant schedule: the first three steps of a run of three are those of six.
    let mut a = small_train_args(&base, &["--reduce-dtype", "bf16", "--steps", "3"]);
    a.extend(["--checkpoint-dir", s(&ck), "--checkpoint-every", "3"]);
    ok(&fsdp(&a), "the first three steps");
    let resume = |extra: &[&str]| {
        let mut a = vec!["train", "--resume", s(&ck), "--steps", "6"];
        a.extend(["--device", "host-twin", "--loss-log", s(&log)]);
        a.extend(extra);
        fsdp(&a)
    };
    one_error_status_1(
        &resume(&["--reduce-dtype", "f32"]),
        &["--reduce-dtype f32", "--reduce-dtype bf16"],
    );
    let out = ok(&resume(&[]), "the resumed run");
    assert!(out.contains("reductions: the gradients in bf16"), "{out}");
    let (whole, resumed) = (
        common::cli::loss_column(&reference),
        common::cli::loss_column(&log),
    );
    assert_eq!(resumed, whole[3..], "{out}");
}
