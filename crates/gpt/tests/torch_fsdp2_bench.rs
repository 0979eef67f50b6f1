//! `benches/torch_fsdp2_gpt.py` — the PyTorch FSDP2 baseline of the GPU benchmark — trains the
//! reference GPT: on the CPU, in f32, from the golden initial weights and batches, its losses
//! are PyTorch's golden losses (1e-5 relative, the golden README's tolerance), alone and as two
//! ranks under torchrun; and it prints its `RESULT` line.
//!
//! Needs a Python with torch, named by `FSDP_TORCH_PYTHON`; without it each test prints
//! `skipped: no torch` and passes.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::cli::{free_port, torch_python};

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

/// Run the script (through `launcher` args before it) on the golden configuration; its stdout.
fn run_script(py: &str, launcher: &[&str]) -> String {
    let script = repo().join("benches/torch_fsdp2_gpt.py");
    let (init, tokens) = (fixture("gpt_tiny_init.safetensors"), fixture("tokens.bin"));
    let out = Command::new(py)
        .args(launcher)
        .arg(&script)
        .args(["--model", "tiny", "--device", "cpu", "--param-dtype", "f32"])
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
