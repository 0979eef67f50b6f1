//! `fsdp train --device cuda --steps 20` (the device trainer over `CudaOps`: the GPT's NVRTC
//! kernels and cuBLAS on one CUDA stream, AdamW on the device) against `fsdp train --ranks 1`
//! (the sharded engine on the CPU): every step's loss within 1e-4 relative (issue 16's
//! criterion; the largest difference is printed), with the defaults, with clipping,
//! accumulation and the cosine schedule, with the grad scaler, and with AnyPrecisionAdamW (f32
//! state, and bf16 state with the Kahan compensation); `--param-dtype f16` against its host
//! twin. The kernels equal their host twins bitwise and the
//! host-twin path is held far inside the bound here without a GPU (`tests/device_train.rs`,
//! `tests/device_cli.rs`: at most 1.2e-7), so what is left is cuBLAS's rounding of the
//! products (`fsdp-kernels`' `tests/gpu_gpt.rs`: within 1e-5 of the loss per step).
//!
//! And the device memory: `fsdp plan --device cuda`'s predicted peak equals the peak the CUDA
//! run counts (its loss log's peak column and its final line) exactly, and the caching
//! allocator's peak allocated bytes (the buffers' blocks, rounded to 512 bytes) is within 5%
//! of it (issue 16), with f32 and with bf16 products, CPU offload and activation
//! checkpointing, without a retry, and its peaks of allocated and reserved bytes are the ones
//! `fsdp plan --device cuda` predicts, exactly; under `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync` the
//! run takes the driver's pool instead (whose high-water mark adds the scratch of single
//! kernels) and logs the same losses bitwise, as it does on expandable segments.
//!
//! Without a CUDA driver or device it prints `skipped: no GPU (<reason>)` and passes. On a GPU
//! machine without a Rust toolchain (`scripts/gpu-check.sh`) it runs the `fsdp` program that
//! `scripts/gpu-build.sh` copies beside it (`fsdp-gpt--bin--fsdp`).

mod common;

use std::path::Path;

use common::cli::CLIP_ACCUM_COSINE;
use common::gpu::{gpu, run, run_with_env, SMALL_GPU_MODEL};

const BOUND: f64 = 1e-4;

fn losses(path: &Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
        .collect()
}

fn compare(test: &str, extra: &[&str]) {
    let dir = std::env::temp_dir().join(format!("fsdp-gpu-device-train-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cpu, cuda) = (
        dir.join(format!("{test}-cpu.csv")),
        dir.join(format!("{test}-cuda.csv")),
    );
    let mut base = vec!["train"];
    base.extend(SMALL_GPU_MODEL);
    base.extend(["--steps", "20"]);
    let with = |more: &[&str], log: &Path| {
        let mut a: Vec<String> = base
            .iter()
            .chain(extra)
            .chain(more)
            .map(|s| s.to_string())
            .collect();
        a.extend(["--loss-log".to_string(), log.display().to_string()]);
        a
    };
    let a = with(&["--ranks", "1"], &cpu);
    run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let b = with(&["--device", "cuda", "--param-dtype", "f32"], &cuda);
    run(&b.iter().map(String::as_str).collect::<Vec<_>>());
    let (e, d) = (losses(&cpu), losses(&cuda));
    assert_eq!((e.len(), d.len()), (20, 20));
    let mut max = 0.0f64;
    for (step, (le, ld)) in e.iter().zip(&d).enumerate() {
        let r = (ld - le).abs() / le.abs();
        assert!(
            r <= BOUND,
            "{test}: step {step}: cuda {ld}, cpu {le} ({r:.2e})"
        );
        max = max.max(r);
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("{test}: max relative loss difference, --device cuda vs --ranks 1: {max:.2e}");
}

#[test]
fn device_cuda_follows_the_engine_at_one_rank() {
    if gpu("device_cuda_follows_the_engine_at_one_rank") {
        compare("defaults", &[]);
    }
}

#[test]
fn device_cuda_clips_accumulates_and_schedules_as_the_engine() {
    if gpu("device_cuda_clips_accumulates_and_schedules_as_the_engine") {
        compare("clip_accum_cosine", &CLIP_ACCUM_COSINE);
    }
}

/// AnyPrecisionAdamW with f32 state (the CUDA kernel `anyprecision_decided_f32`, Kahan
/// summation off) on f32 parameters: the engine's losses within 1e-4, as AdamW.
#[test]
fn device_cuda_anyprecision_adamw_follows_the_engine() {
    if gpu("device_cuda_anyprecision_adamw_follows_the_engine") {
        compare(
            "anyprecision_f32_state",
            &[
                "--optimizer",
                "anyprecision-adamw",
                "--optimizer-state-dtype",
                "f32",
                "--kahan-summation",
                "off",
            ],
        );
        // bf16 state and the Kahan compensation (`anyprecision_decided_bf16_state`).
        compare("anyprecision", &["--optimizer", "anyprecision-adamw"]);
    }
}

/// The grad scaler on f32 parameters (`--grad-scaler on`, on both sides): at its power-of-two
/// scale the device's training is that without it, so the engine's losses within 1e-4 as
/// ever; the CUDA kernels of the scaled seed, the decision and the unscaling all run.
#[test]
fn device_cuda_grad_scaler_follows_the_engine() {
    if gpu("device_cuda_grad_scaler_follows_the_engine") {
        compare(
            "grad_scaler",
            &["--grad-scaler", "on", "--growth-interval", "3"],
        );
    }
}

/// `fsdp train` of the small GPU model for 20 steps on `device` with `more`, its loss log
/// `name` in `dir`: every step's loss and the output.
fn twenty_steps(dir: &Path, device: &str, more: &[&str], name: &str) -> (Vec<f64>, String) {
    let log = dir.join(name);
    let mut a: Vec<String> = ["train"]
        .iter()
        .chain(SMALL_GPU_MODEL.iter())
        .chain(["--steps", "20", "--device", device].iter())
        .chain(more)
        .map(|s| s.to_string())
        .collect();
    a.extend(["--loss-log".to_string(), log.display().to_string()]);
    let out = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    (losses(&log), out)
}

/// The largest relative difference of two runs' losses (against `b`'s).
fn apart(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs())
        .fold(0.0, f64::max)
}

/// `--param-dtype f16` (f16 products, the grad scaler on by default): the CUDA run against
/// the host twins' f16 run, both multiplying f16-rounded operands in different summation
/// orders; held, as `fsdp-kernels`' `gpu_gpt` holds one step, to twice the twins' own
/// distance between f16 and f32 products over the same 20 steps. And the scaler's line, with
/// `--init-scale 16777216`, reports the overflows it skipped.
#[test]
fn device_cuda_f16_products_track_their_twin() {
    if !gpu("device_cuda_f16_products_track_their_twin") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("fsdp-gpu-f16-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f16 = ["--param-dtype", "f16"];
    let (cuda, out) = twenty_steps(&dir, "cuda", &f16, "cuda16.csv");
    assert!(out.contains("grad scaler: final scale"), "{out}");
    let (twin, _) = twenty_steps(&dir, "host-twin", &f16, "twin16.csv");
    let (twin32, _) = twenty_steps(&dir, "host-twin", &["--param-dtype", "f32"], "twin32.csv");
    let (d, scale) = (apart(&cuda, &twin), apart(&twin, &twin32));
    println!("f16 products: cuda vs twin {d:.2e}, twin f16 vs f32 {scale:.2e}");
    assert!(
        d <= 2.0 * scale,
        "cuda vs twin {d:e}, twin f16 vs f32 {scale:e}"
    );
    let over = ["--param-dtype", "f16", "--init-scale", "16777216"];
    let (_, out) = twenty_steps(&dir, "cuda", &over, "over.csv");
    assert!(!out.contains(", 0 overflowing"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--attention fused` (flash attention on tensor cores; the small model's heads of 32 values)
/// against the host twins' fused run, held as the f16 products are above: to
/// twice the twins' own distance between the fused bf16 run and the f32 run over 20 steps.
#[test]
fn device_cuda_fused_attention_tracks_its_twin() {
    if !gpu("device_cuda_fused_attention_tracks_its_twin") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("fsdp-gpu-fused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fused = ["--param-dtype", "bf16", "--attention", "fused"];
    let (cuda, out) = twenty_steps(&dir, "cuda", &fused, "cuda.csv");
    assert!(out.contains("attention: fused"), "{out}");
    let (twin, _) = twenty_steps(&dir, "host-twin", &fused, "twin.csv");
    let (twin32, _) = twenty_steps(&dir, "host-twin", &["--param-dtype", "f32"], "twin32.csv");
    let (d, scale) = (apart(&cuda, &twin), apart(&twin, &twin32));
    println!("fused attention: cuda vs twin {d:.2e}, twin fused bf16 vs f32 {scale:.2e}");
    assert!(
        d <= 2.0 * scale,
        "cuda vs twin {d:e}, twin bf16 vs f32 {scale:e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The number after `prefix` in `text` (up to the next space).
fn number_after(text: &str, prefix: &str) -> u64 {
    let at = text
        .find(prefix)
        .unwrap_or_else(|| panic!("no `{prefix}` in {text}"));
    text[at + prefix.len()..]
        .split([' ', ')', ','])
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after `{prefix}` in {text}"))
}

#[test]
fn device_cuda_peak_memory_is_the_plans() {
    if !gpu("device_cuda_peak_memory_is_the_plans") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("fsdp-gpu-device-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = [
        "--n-layer",
        "2",
        "--n-head",
        "4",
        "--n-embd",
        "256",
        "--block-size",
        "64",
        "--vocab-size",
        "512",
        "--batch-size",
        "8",
    ];
    for (i, extra) in [
        &["--param-dtype", "f32"][..],
        &["--param-dtype", "bf16", "--grad-accum", "2"][..],
        &["--param-dtype", "bf16", "--cpu-offload"][..],
        &["--param-dtype", "bf16", "--activation-checkpointing"][..],
        &["--param-dtype", "f16"][..],
        &["--param-dtype", "bf16", "--attention", "fused"][..],
    ]
    .into_iter()
    .enumerate()
    {
        let with = |cmd: &str, more: &[&str]| -> Vec<String> {
            [cmd]
                .iter()
                .chain(&model)
                .chain(extra)
                .chain(more)
                .map(|s| s.to_string())
                .collect()
        };
        let plan = run(&with("plan", &["--device", "cuda"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>());
        let predicted = number_after(&plan, "peak: ");
        let log = dir.join(format!("log{i}.csv"));
        let log_s = log.display().to_string();
        let train = with(
            "train",
            &["--device", "cuda", "--steps", "3", "--loss-log", &log_s],
        );
        let out = run(&train.iter().map(String::as_str).collect::<Vec<_>>());
        let counted = number_after(&out, "peak device memory ");
        let logged: u64 = std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .last()
            .and_then(|l| l.split(',').nth(3))
            .and_then(|v| v.parse().ok())
            .unwrap();
        assert_eq!(
            counted, predicted,
            "{extra:?}: counted vs planned\n{plan}\n{out}"
        );
        assert_eq!(logged, predicted, "{extra:?}: logged vs planned");
        let pool = number_after(&out, "caching allocator: peak allocated ");
        let rel = (pool as f64 - predicted as f64).abs() / predicted as f64;
        println!(
            "{extra:?}: predicted = counted peak {predicted} bytes; caching allocator's peak \
             allocated {pool} ({:+.2}%)",
            100.0 * (pool as f64 / predicted as f64 - 1.0)
        );
        assert!(
            rel <= 0.05,
            "{extra:?}: allocator {pool} vs planned {predicted}"
        );
        assert!(
            pool >= counted,
            "{extra:?}: every counted buffer is one of its blocks"
        );
        assert_eq!(
            number_after(&out, "num_alloc_retries "),
            0,
            "{extra:?}: {out}"
        );
        // The plan's caching allocator (the run's requests on a meta source) decides as the
        // GPU's: the same peaks, to the byte.
        for what in ["caching allocator: peak allocated ", "peak reserved "] {
            assert_eq!(
                number_after(&out, what),
                number_after(&plan, what),
                "{extra:?}: {what}planned vs measured\n{plan}\n{out}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The buffers' memory as PyTorch's allocator settings choose it: the caching allocator by
/// default (and on expandable segments, given by `--alloc-conf`), the driver's stream-ordered
/// pool under `backend:cudaMallocAsync`; the run names it in its first lines, `--memory-snapshot` writes
/// the caching allocator's own snapshot (segments, and allocations named by the step's parts),
/// and the losses are the same bits whichever serves the buffers.
#[test]
fn device_cuda_memory_is_the_caching_allocator_or_the_drivers_pool() {
    if !gpu("device_cuda_memory_is_the_caching_allocator_or_the_drivers_pool") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("fsdp-gpu-alloc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut logs = Vec::new();
    for (i, (conf, says)) in [
        (
            "",
            "memory: the caching allocator of cuda:0 (backend:native)",
        ),
        // Given as `--alloc-conf` (the others through the variable).
        (
            "--alloc-conf expandable_segments:True",
            "memory: the caching allocator of cuda:0 (backend:native,expandable_segments:True)",
        ),
        (
            "backend:cudaMallocAsync",
            "memory: the CUDA driver's stream-ordered pool (backend:cudaMallocAsync)",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let log = dir.join(format!("alloc{i}.csv"));
        let log_s = log.display().to_string();
        let snap = dir.join(format!("alloc{i}.pickle"));
        let snap_s = snap.display().to_string();
        let mut args = vec!["train"];
        args.extend(SMALL_GPU_MODEL);
        args.extend(["--device", "cuda", "--steps", "5", "--loss-log", &log_s]);
        args.extend(["--memory-snapshot", &snap_s]);
        let env: Vec<(&str, &str)> = match conf.strip_prefix("--alloc-conf ") {
            Some(flag) => {
                args.extend(["--alloc-conf", flag]);
                Vec::new()
            }
            None if conf.is_empty() => Vec::new(),
            None => vec![("PYTORCH_CUDA_ALLOC_CONF", conf)],
        };
        let out = run_with_env(&args, &env);
        assert!(out.contains(says), "{conf:?}: expected `{says}` in\n{out}");
        // The snapshot: the caching allocator's own (segments, and its history's frames named
        // by the step's parts), or the counted buffers' history without segments.
        let pickle = std::fs::read(&snap).unwrap();
        let has = |what: &str| pickle.windows(what.len()).any(|w| w == what.as_bytes());
        let caching = !conf.starts_with("backend");
        assert_eq!(
            has("segment_type"),
            caching,
            "{conf:?}: segments in the snapshot"
        );
        assert_eq!(
            has("forward block 1"),
            caching,
            "{conf:?}: the parts' frames"
        );
        if !caching {
            assert!(out.contains("the driver's pool: high-water mark "), "{out}");
        } else {
            assert_eq!(number_after(&out, "num_alloc_retries "), 0, "{out}");
            assert_eq!(number_after(&out, "num_ooms "), 0, "{out}");
            let allocated = number_after(&out, "peak allocated ");
            let reserved = number_after(&out, "peak reserved ");
            assert!(reserved >= allocated, "{conf:?}: {out}");
            println!("{conf:?}: peak allocated {allocated}, peak reserved {reserved}");
        }
        logs.push(losses(&log));
    }
    assert_eq!(logs[0].len(), 5);
    assert_eq!(logs[0], logs[1], "expandable segments vs default");
    assert_eq!(
        logs[0], logs[2],
        "the driver's pool vs the caching allocator"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--cpu-offload` on CUDA (master parameters, accumulators and AdamW's moments in host memory,
/// the optimizer step on the host twins) against the same run on the device: the host twins of
/// AdamW, the sum of squares and the scaling equal the kernels bitwise (`fsdp-kernels`'
/// `tests/gpu_gpt.rs`), so the losses stay within 1e-6 relative (the largest is printed), with
/// clipping, accumulation and the cosine schedule. The same for `--activation-checkpointing`
/// (each block's forward run again before its backward: the same kernels and products on the
/// same inputs).
#[test]
fn device_cuda_cpu_offload_trains_as_without_it() {
    if !gpu("device_cuda_cpu_offload_trains_as_without_it") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("fsdp-gpu-offload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut logs = Vec::new();
    let variants = [
        &[][..],
        &["--cpu-offload"][..],
        &["--activation-checkpointing"][..],
    ];
    for (i, offload) in variants.into_iter().enumerate() {
        let log = dir.join(format!("run{i}.csv"));
        let log_s = log.display().to_string();
        let mut a = vec!["train"];
        a.extend(SMALL_GPU_MODEL);
        a.extend(["--steps", "10", "--param-dtype", "f32", "--device", "cuda"]);
        a.extend(CLIP_ACCUM_COSINE);
        a.extend(offload);
        a.extend(["--loss-log", &log_s]);
        run(&a);
        logs.push(losses(&log));
    }
    assert_eq!(logs[0].len(), 10);
    for (i, what) in [(1, "cpu offload"), (2, "activation checkpointing")] {
        let max = logs[0]
            .iter()
            .zip(&logs[i])
            .map(|(a, b)| (a - b).abs() / a.abs())
            .fold(0.0f64, f64::max);
        println!("{what} on CUDA: largest relative loss difference {max:.2e} over 10 steps");
        assert!(max <= 1e-6, "{what}: {:?} vs {:?}", logs[0], logs[i]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
