//! The fused attention's CUDA kernels (`src/cu/attention.cu`) run on the host, against their
//! twins (`fsdp_kernels::host::attention`), so that their tiling, masks, shared-memory
//! transposes, online softmax and fragment indexing are checked without a GPU.
//!
//! `tests/emulate/` compiles the kernels' very source as C++ (`cuda_shim.h`: a block's threads
//! as host threads, `__syncthreads` and the warps' shuffles through barriers) with `mma.sync`
//! computed from the PTX ISA's fragment layouts, written there once and independently of the
//! kernels' indexing (`mma_emulated.h`); `driver.cpp` launches the four kernels on the grids
//! their launchers use. The emulated products sum in order in f32, so the bounds are those of
//! `tests/gpu_attention.rs` (four 16-bit units of each output's largest value, `lse` within
//! 1e-5). What this cannot check is the layouts themselves and the hardware's own behaviour:
//! `gpu_attention` does, on a GPU.
//!
//! It needs a C++20 compiler (`CXX`, else `c++`, `g++` or `clang++`); without one it prints
//! `skipped: …` and passes (CI has one).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::flash::{check_lse, rel, twin};
use fsdp_kernels::host::attention::FusedAttention;
use fsdp_kernels::host::CastFloat;
use half::{bf16, f16};

/// The emulator, built once into `dir`; `None` without a C++ compiler.
fn build(dir: &Path) -> Option<PathBuf> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let compilers: Vec<String> = std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["c++", "g++", "clang++"].map(String::from))
        .collect();
    let cxx = compilers.into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })?;
    let exe = dir.join("emu");
    let out = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O2",
            "-pthread",
            "-ffp-contract=off",
            "-fno-strict-aliasing",
        ])
        .args(["-Wall", "-Wno-unknown-pragmas", "-Werror"])
        .arg("-I")
        .arg(manifest.join("src/cu"))
        .arg("-I")
        .arg(manifest.join("tests/emulate"))
        .arg("-o")
        .arg(&exe)
        .arg(manifest.join("tests/emulate/driver.cpp"))
        .output()
        .unwrap_or_else(|e| panic!("running {cxx}: {e}"));
    assert!(
        out.status.success(),
        "{cxx} could not build the emulator:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}

fn write_half<H: CastFloat>(path: &Path, v: &[f32]) {
    let bytes: Vec<u8> = v
        .iter()
        .flat_map(|&x| (H::store(x).bits() as u16).to_le_bytes())
        .collect();
    std::fs::write(path, bytes).unwrap();
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// One case on the emulator and the twins: the errors of `[y, dq, dk, dv]`.
fn compare<H: CastFloat>(emu: &Path, dir: &Path, a: FusedAttention, sharp: f32) -> [f64; 4] {
    let w = twin::<H>(&a, sharp);
    for (name, x) in [
        ("q", &w.q),
        ("k", &w.k),
        ("v", &w.v),
        ("dout", &w.dout),
        ("rows", &w.rows),
    ] {
        write_half::<H>(&dir.join(format!("{name}.bin")), x);
    }
    let mut cmd = Command::new(emu);
    cmd.arg(dir)
        .arg(H::NAME)
        .args([a.d, a.pairs, a.t].map(|x| x.to_string()))
        .arg(format!("{:e}", a.scale));
    let out = common::emulator::output_within(cmd, common::emulator::RUN_TIMEOUT, "attention");
    assert!(
        out.status.success(),
        "the emulator failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = |name: &str| read_f32(&dir.join(format!("{name}.bin")));
    check_lse(&a, &got("lse"), &w.lse);
    [
        rel(&got("y"), &w.y),
        rel(&got("dq"), &w.grads[0]),
        rel(&got("dk"), &w.grads[1]),
        rel(&got("dv"), &w.grads[2]),
    ]
}

fn each<H: CastFloat>(test: &str, unit: f64) {
    let dir = std::env::temp_dir().join(format!("fsdp-emu-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let Some(emu) = build(&dir) else {
        println!("{test}: skipped: no C++ compiler (CXX, c++, g++, clang++)");
        return;
    };
    let case = |pairs, t, d: usize| FusedAttention {
        pairs,
        t,
        d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    // One token; a part of a tile; one whole tile and one row more; several tiles with a part
    // (causal tiles of every kind); sharp scores that move the running maximum; heads of 32.
    for (a, sharp) in [
        (case(1, 1, 64), 1.0),
        (case(2, 37, 64), 1.0),
        (case(1, 64, 64), 1.0),
        (case(1, 65, 32), 1.0),
        (case(1, 150, 64), 1.0),
        (case(1, 130, 64), 8.0),
        (case(2, 70, 32), 8.0),
    ] {
        let e = compare::<H>(&emu, &dir, a, sharp);
        println!(
            "{test}: pairs {} t {} d {} sharp {sharp}: y {:.2e} dq {:.2e} dk {:.2e} dv {:.2e}",
            a.pairs, a.t, a.d, e[0], e[1], e[2], e[3]
        );
        for (what, e) in ["y", "dq", "dk", "dv"].iter().zip(e) {
            assert!(e <= 4.0 * unit, "{a:?}, sharp {sharp}: {what} {e:e}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn emulated_flash_bf16_equals_its_twin() {
    each::<bf16>("emulated_flash_bf16", 2f64.powi(-9));
}

#[test]
fn emulated_flash_f16_equals_its_twin() {
    each::<f16>("emulated_flash_f16", 2f64.powi(-12));
}
