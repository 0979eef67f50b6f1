//! `benches/torch_fsdp2_gpt.py` — the PyTorch FSDP2 baseline of the GPU benchmark — trains the
//! reference GPT: on the CPU, in f32, from the golden initial weights and batches, its losses
//! are PyTorch's golden losses (1e-5 relative, the golden README's tolerance), alone and as two
//! ranks under torchrun; and it prints its `RESULT` line.
//!
//! In bf16 (parameters bf16, reductions f32) `fsdp train` tracks PyTorch FSDP2's bf16 loss
//! curve of the same model, data and initial weights. The bound is measured in the same run:
//! bf16 moves PyTorch's own curve away from its f32 curve (the golden losses) by at most `g`;
//! ours, an independent bf16 implementation rounding at other places, must stay within `2·g` of
//! PyTorch's bf16 curve at every step: the engine at 1 and 2 ranks (FSDP's bf16 policy) and the
//! device trainer on its host twins (`--device host-twin --param-dtype bf16`: bf16 products,
//! every other layer f32, what `--device cuda` computes). Measured: 0.66·g, 0.57·g and 0.87·g.
//!
//! Needs a Python with torch, named by `FSDP_TORCH_PYTHON`; without it each test prints
//! `skipped: no torch` and passes.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::cli::{free_port, fsdp, golden_args, read_losses, scratch, torch_python};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    p.to_string_lossy().into_owned()
}

/// The `step,loss` rows of a CSV text (header first).
fn losses(csv: &str) -> Vec<f64> {
    let mut lines = csv.lines().skip_while(|l| *l != "step,loss");
    assert_eq!(lines.next(), Some("step,loss"), "no loss table in:\n{csv}");
    lines
        .map_while(|l| {
            let (step, loss) = l.split_once(',')?;
            step.parse::<usize>().ok()?;
            loss.parse::<f64>().ok()
        })
        .collect()
}

/// Run the script (through `launcher` args before it) on the golden configuration in f32; its
/// stdout.
fn run_script(py: &str, launcher: &[&str]) -> String {
    run_script_in(py, launcher, "f32")
}

fn run_script_in(py: &str, launcher: &[&str], param_dtype: &str) -> String {
    let script = repo().join("benches/torch_fsdp2_gpt.py");
    let (init, tokens) = (fixture("gpt_tiny_init.safetensors"), fixture("tokens.bin"));
    let out = Command::new(py)
        .args(launcher)
        .arg(&script)
        .args([
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--param-dtype",
            param_dtype,
        ])
        .args(["--reduce-dtype", "f32", "--batch", "8", "--seq", "16"])
        .args(["--steps", "10", "--warmup", "2", "--loss-csv", "-"])
        .args(["--init", &init, "--tokens", &tokens])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("the torch python runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "the script failed:\n{stdout}\n{stderr}"
    );
    stdout
}

fn check_against_golden(stdout: &str, world: u64) {
    let golden = losses(&std::fs::read_to_string(fixture("expected_losses.csv")).unwrap());
    let got = losses(stdout);
    assert_eq!(got.len(), golden.len(), "{stdout}");
    for (i, (g, e)) in got.iter().zip(&golden).enumerate() {
        assert!(
            ((g - e) / e).abs() <= 1e-5,
            "step {i}: PyTorch FSDP2 gives {g}, the golden loss is {e}\n{stdout}"
        );
    }
    let result = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .expect("a RESULT line");
    let v: serde_json::Value = serde_json::from_str(result).unwrap();
    assert_eq!(v["world"], world, "{result}");
    assert_eq!(v["params"], 29_056, "{result}");
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0, "{result}");
}

#[test]
fn the_fsdp2_baseline_gives_the_golden_losses_alone() {
    let Some(py) = torch_python("torch.distributed.fsdp") else {
        eprintln!("skipped: no torch (set FSDP_TORCH_PYTHON to a Python with torch)");
        return;
    };
    check_against_golden(&run_script(&py, &[]), 1);
}

#[test]
fn the_fsdp2_baseline_gives_the_golden_losses_as_two_ranks() {
    let Some(py) = torch_python("torch.distributed.fsdp") else {
        eprintln!("skipped: no torch (set FSDP_TORCH_PYTHON to a Python with torch)");
        return;
    };
    let port = free_port().to_string();
    let launcher = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        &port,
    ];
    check_against_golden(&run_script(&py, &launcher), 2);
}

#[test]
fn bf16_training_tracks_pytorch_fsdp2_bf16() {
    let Some(py) = torch_python("torch.distributed.fsdp") else {
        eprintln!("skipped: no torch (set FSDP_TORCH_PYTHON to a Python with torch)");
        return;
    };
    let golden = losses(&std::fs::read_to_string(fixture("expected_losses.csv")).unwrap());
    let torch_bf16 = losses(&run_script_in(&py, &[], "bf16"));
    let gap = torch_bf16
        .iter()
        .zip(&golden)
        .map(|(b, f)| (b - f).abs())
        .fold(0.0, f64::max);
    assert!(
        gap > 0.0,
        "PyTorch's bf16 curve equals its f32 curve: bf16 was not applied"
    );
    let dir = scratch("torch_fsdp2_bench", "bf16");
    let (init, tokens) = (fixture("gpt_tiny_init.safetensors"), fixture("tokens.bin"));
    // The engine at 1 and 2 ranks (FSDP's bf16 policy), and the device trainer on its host
    // twins (bf16 products, the rest f32: what `--device cuda` computes).
    for (ranks, device) in [("1", false), ("2", false), ("1", true)] {
        let name = if device { "device" } else { ranks };
        let log = dir.join(format!("bf16-{name}.csv"));
        let log_s = log.to_string_lossy().into_owned();
        let save = dir.join(format!("bf16-{name}.safetensors"));
        let save_s = save.to_string_lossy().into_owned();
        let mut args = golden_args(ranks, &init, &log_s, &save_s, &tokens);
        args.extend_from_slice(&["--param-dtype", "bf16", "--reduce-dtype", "f32"]);
        if device {
            args.extend_from_slice(&["--device", "host-twin"]);
        }
        let out = fsdp(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ours = read_losses(&log);
        assert_eq!(ours.len(), torch_bf16.len());
        let worst = ours
            .iter()
            .zip(&torch_bf16)
            .map(|(o, t)| (o - t).abs())
            .fold(0.0, f64::max);
        println!(
            "{name}: within {:.2} × {gap:.3e} of PyTorch's bf16 curve",
            worst / gap
        );
        for (k, (o, t)) in ours.iter().zip(&torch_bf16).enumerate() {
            assert!(
                (o - t).abs() <= 2.0 * gap,
                "{name} step {k}: ours {o}, PyTorch FSDP2 bf16 {t}: further apart than \
                 2 × {gap:.3e} (bf16's own effect on PyTorch's curve)"
            );
        }
    }
}
