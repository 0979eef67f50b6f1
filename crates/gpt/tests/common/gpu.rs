//! The helpers of the GPU tests that run the `fsdp` program (`gpu_device_train`,
//! `gpu_golden`): on a GPU machine without a Rust toolchain (`scripts/gpu-check.sh`) the
//! program, the PyTorch baseline and the fixtures lie beside the test (`scripts/gpu-build.sh`
//! puts them there); here, cargo's program and the repository's files.

use std::path::PathBuf;
use std::process::Command;

/// `name` beside this test's executable, if it is there.
fn beside(name: &str) -> Option<PathBuf> {
    let p = std::env::current_exe().ok()?.parent()?.join(name);
    p.exists().then_some(p)
}

/// The `fsdp` program: beside this test (`scripts/gpu-build.sh`), else cargo's.
pub fn program() -> PathBuf {
    beside("fsdp-gpt--bin--fsdp").unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_fsdp")))
}

/// The golden fixture `name`: in `golden/` beside this test, else `tests/fixtures`.
pub fn golden_fixture(name: &str) -> PathBuf {
    beside(&format!("golden/{name}")).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    })
}

/// The PyTorch FSDP2 baseline: beside this test, else `benches/torch_fsdp2_gpt.py`.
pub fn torch_script() -> PathBuf {
    beside("torch_fsdp2_gpt.py").unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../benches/torch_fsdp2_gpt.py")
    })
}

/// Whether a CUDA device is present; else prints `<test>: skipped: no GPU (<reason>)`.
pub fn gpu(test: &str) -> bool {
    match fsdp_device::cuda::device_count() {
        Ok(n) if n > 0 => true,
        Ok(_) => {
            println!("{test}: skipped: no GPU (the driver reports 0 devices)");
            false
        }
        Err(e) => {
            println!("{test}: skipped: no GPU ({e})");
            false
        }
    }
}

/// Runs the `fsdp` program with `args` as one rank (no launcher's variables, no allocator
/// settings); its stdout. Panics with its output when it fails.
pub fn run(args: &[&str]) -> String {
    run_with_env(args, &[])
}

/// As [`run`], with the variables `env` set.
pub fn run_with_env(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(program());
    cmd.args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("PYTORCH_ALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("running fsdp");
    assert!(
        out.status.success(),
        "fsdp {args:?}: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The model and batch of the GPU tests' comparisons with the CPU: 2 layers, 2 heads, 64
/// wide, 32 tokens, a vocabulary of 256, 8 rows a step.
pub const SMALL_GPU_MODEL: [&str; 12] = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "64",
    "--block-size",
    "32",
    "--vocab-size",
    "256",
    "--batch-size",
    "8",
];
