//! `device_cli`'s comparison of one run on the engine (`fsdp train --ranks 1`) and on the
//! host twins (`--device host-twin`): the losses and the saved weights.

use std::path::Path;

use crate::common::cli::{fsdp, log_losses, ok, s, scratch, small_train_args};

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
    let (e, d) = (log_losses(&cpu), log_losses(&twin));
    assert_eq!(e.len(), 20);
    assert_eq!(d.len(), 20);
    let mut max = 0.0f64;
    for (step, (le, ld)) in e.iter().zip(&d).enumerate() {
        let r = (ld - le).abs() / le.abs();
        assert!(r <= BOUND, "{test}: step {step}: {ld} vs {le} ({r:.2e})");
        max = max.max(r);
    }
    assert!(e[19] < e[0] - 0.1, "{test}: the loss must fall: {e:?}");
    let load = |p: &Path| fsdp_gpt::checkpoint::load_full(p, &config()).unwrap();
    let (we, wd) = (load(&cpu_w), load(&twin_w));
    // Against the largest weight of the model, not of each tensor: the attention's key bias
    // has a gradient that is 0 up to rounding, which AdamW normalises into updates of either
    // sign, so its values (about 1e-6) are rounding noise on both sides.
    let scale = we.values().flatten().fold(0.0f32, |m, x| m.max(x.abs()));
    let mut wmax = 0.0f64;
    for (name, v) in &we {
        for (x, y) in v.iter().zip(&wd[name]) {
            let r = f64::from((x - y).abs() / scale);
            assert!(r <= weights, "{test}: {name}: {y} vs {x}");
            wmax = wmax.max(r);
        }
    }
    println!(
        "{test}: max relative loss difference {max:.2e} over 20 steps; final weights within \
         {wmax:.2e} of their largest magnitude"
    );
    max
}

fn config() -> fsdp_gpt::model::GptConfig {
    fsdp_gpt::model::GptConfig::new(2, 2, 32, 16, 64).unwrap()
}
