//! `device_cli`'s comparison of one run on the engine (`fsdp train --ranks 1`) and on the
//! host twins (`--device host-twin`): the losses and the saved weights.

use crate::common::cli::{assert_runs_agree, fsdp, ok, s, scratch, small_train_args};

const BOUND: f64 = 1e-4;

/// Runs `extra` on the engine (`--ranks 1`) and on the host twins; returns the largest
/// relative difference of the losses.
pub fn compare(test: &str, extra: &[&str]) -> f64 {
    compare_within(test, extra, BOUND)
}

/// [`compare`] with the final weights held within `weights` of the largest weight.
pub fn compare_within(test: &str, extra: &[&str], weights: f64) -> f64 {
    let dir = scratch("device_cli", test);
    let (cpu, twin) = (dir.join("cpu.csv"), dir.join("twin.csv"));
    let (cpu_w, twin_w) = (dir.join("cpu.safetensors"), dir.join("twin.safetensors"));
    let base = ["--batch-size", "8", "--steps", "20"];
    let mut a = small_train_args(&base, extra);
    a.extend(["--ranks", "1", "--loss-log", s(&cpu), "--save", s(&cpu_w)]);
    ok(&fsdp(&a), "fsdp train --ranks 1");
    let mut b = small_train_args(&base, extra);
    b.extend([
        "--device",
        "host-twin",
        "--param-dtype",
        "f32",
        "--loss-log",
        s(&twin),
        "--save",
        s(&twin_w),
    ]);
    let out = ok(&fsdp(&b), "fsdp train --device host-twin");
    assert!(out.contains("1 rank on host-twin"), "{out}");
    assert!(out.contains("done: 20 steps"), "{out}");
    assert_runs_agree(test, (&cpu, &cpu_w), (&twin, &twin_w), 20, BOUND, weights)
}
