//! Every kernel compiles with NVRTC to PTX for sm_80 and sm_90, without an error or a warning,
//! and (with `FSDP_PTXAS`) that PTX assembles with `ptxas`.
//! NVRTC needs no GPU: CI installs the `nvidia-cuda-nvrtc` wheel and names its library in
//! `FSDP_NVRTC_LIB`. Without NVRTC (not on the loader path, not named by that variable, not in
//! a Python package's site-packages) the test prints `skipped: …` and passes.

use fsdp_kernels::{compile_ptx, compile_source, nvrtc_version, Program};

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    match fsdp_device::cuda::libs::load_nvrtc() {
        Ok(found) => println!("NVRTC: {found:?}"),
        // CI names the library: then not finding it is a failure, not a skip.
        Err(e) if std::env::var_os("FSDP_NVRTC_LIB").is_some() => {
            panic!("FSDP_NVRTC_LIB is set, but {e}")
        }
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    }
    let (major, minor) = nvrtc_version().expect("NVRTC loads");
    println!("NVRTC {major}.{minor}");
    for arch in ["compute_80", "compute_90"] {
        for program in Program::ALL {
            let ptx = compile_ptx(program, arch).unwrap_or_else(|e| panic!("{e}"));
            let target = format!(".target sm_{}", &arch["compute_".len()..]);
            assert!(ptx.contains(&target), "{}: no `{target}`", program.name());
            let kernels = program.kernels();
            for kernel in &kernels {
                assert!(
                    ptx.contains(&format!(".entry {kernel}(")),
                    "{} for {arch}: no kernel `{kernel}`",
                    program.name()
                );
            }
            // And the list is whole: the emulator's registry (`tests/common/emulator.rs`) is it.
            for entry in ptx.split(".entry ").skip(1) {
                let name = entry.split('(').next().unwrap_or_default().trim();
                assert!(
                    kernels.iter().any(|k| k == name),
                    "{} for {arch}: kernel `{name}` missing from Program::kernels",
                    program.name()
                );
            }
            if !program.bitwise_twins() {
                // Tensor cores, and the math library's exp2f and log2f as they come.
                assert!(
                    ptx.contains("mma.sync.aligned.m16n8k16.row.col.f32"),
                    "{}: no tensor-core product",
                    program.name()
                );
                println!("{} for {arch}: {} bytes of PTX", program.name(), ptx.len());
                continue;
            }
            // --fmad=false: no multiply-add was fused (the host twins round each product);
            // a program that asks for them (`__fmaf_rn`) has round-to-nearest f32 ones only.
            let fmas: Vec<&str> = ptx.lines().filter(|l| l.contains("fma.")).collect();
            if program.explicit_fma() {
                assert!(
                    !fmas.is_empty(),
                    "{}: no fused multiply-add",
                    program.name()
                );
                assert!(
                    fmas.iter()
                        .all(|l| l.trim_start().starts_with("fma.rn.f32")),
                    "{}: a fused multiply-add other than fma.rn.f32: {fmas:?}",
                    program.name()
                );
            } else {
                assert!(fmas.is_empty(), "{}: fused multiply-add", program.name());
            }
            // IEEE division and square root, and no CUDA math library approximations (the nn
            // program's e^x, ln and erfc are its own, as its twins').
            assert!(
                !ptx.contains(".approx") && !ptx.contains(".ftz"),
                "{}: an approximate or flush-to-zero instruction",
                program.name()
            );
            println!("{} for {arch}: {} bytes of PTX", program.name(), ptx.len());
        }
    }
}

#[test]
fn a_warning_is_seen() {
    if let Err(e) = fsdp_device::cuda::libs::load_nvrtc() {
        assert!(
            std::env::var_os("FSDP_NVRTC_LIB").is_none(),
            "FSDP_NVRTC_LIB is set, but {e}"
        );
        println!("skipped: {e}");
        return;
    }
    // Negative control of the test above: the log it checks does carry warnings.
    let src = "extern \"C\" __global__ void k(float* x) { int unused = 3; x[0] = 1.0f; }";
    let c = compile_source("warning.cu", src, "compute_90").unwrap();
    assert!(c.log.contains("unused"), "log: {:?}", c.log);
    // And the CUDA math library's e^x does show as `.approx` (what the check above excludes).
    let src = "extern \"C\" __global__ void k(float* x) { x[0] = expf(x[0]); }";
    let ptx = compile_source("expf.cu", src, "compute_90").unwrap().ptx;
    assert!(ptx.contains(".approx"), "expf without .approx:\n{ptx}");
    let err = compile_source("broken.cu", "__global__ void k( {", "compute_90").unwrap_err();
    assert!(err.to_string().contains("broken.cu"), "{err}");
}

/// Every program's PTX assembles with `ptxas` for sm_80 and sm_90. NVRTC does not assemble
/// inline PTX (the fused attention's `mma.sync`), so an operand of the wrong type or count
/// would otherwise fail only when a GPU loads the module. `ptxas` is the one `FSDP_PTXAS`
/// names (CI installs the CUDA 13.0 nvcc wheel beside NVRTC's); without it the test prints
/// `skipped: …` and passes. It prints each program's largest register count and its spills.
#[test]
fn every_program_assembles_with_ptxas() {
    let Some(ptxas) = std::env::var_os("FSDP_PTXAS") else {
        println!("skipped: FSDP_PTXAS names no ptxas");
        return;
    };
    if let Err(e) = fsdp_device::cuda::libs::load_nvrtc() {
        panic!("FSDP_PTXAS is set, but NVRTC does not load: {e}");
    }
    let dir = std::env::temp_dir().join(format!("fsdp-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for arch in ["80", "90"] {
        for program in Program::ALL {
            let ptx =
                compile_ptx(program, &format!("compute_{arch}")).unwrap_or_else(|e| panic!("{e}"));
            let src = dir.join(format!("{}.{arch}.ptx", program.name()));
            std::fs::write(&src, ptx).unwrap();
            let out = std::process::Command::new(&ptxas)
                .arg(format!("-arch=sm_{arch}"))
                .arg("-v")
                .arg(&src)
                .arg("-o")
                .arg(dir.join(format!("{}.{arch}.cubin", program.name())))
                .output()
                .unwrap_or_else(|e| panic!("running {}: {e}", ptxas.to_string_lossy()));
            let log = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "{} for sm_{arch}: ptxas failed:\n{log}",
                program.name()
            );
            let number_before = |l: &str, word: &str| -> u64 {
                l.split(word)
                    .next()
                    .and_then(|h| h.split_whitespace().last())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0)
            };
            let registers = log
                .lines()
                .filter(|l| l.contains(" registers"))
                .map(|l| number_before(l, " registers"))
                .max()
                .unwrap_or(0);
            let spills: u64 = log
                .lines()
                .filter(|l| l.contains("bytes spill stores"))
                .map(|l| number_before(l, " bytes spill stores"))
                .sum();
            println!(
                "{} for sm_{arch}: assembled; at most {registers} registers a thread, {spills} \
                 bytes of spill stores in all",
                program.name()
            );
        }
    }
    // The control: NVRTC passes an `mma.sync` of mismatched operand types (bf16 A, f16 B)
    // through; ptxas refuses it.
    let bad = r#"extern "C" __global__ void k(float* c, unsigned a, unsigned b) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%4,%4,%4}, {%5,%5}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a), "r"(b));
    }"#;
    let ptx = compile_source("bad_mma.cu", bad, "compute_90").unwrap().ptx;
    let src = dir.join("bad_mma.ptx");
    std::fs::write(&src, ptx).unwrap();
    let out = std::process::Command::new(&ptxas)
        .args(["-arch=sm_90", "-o"])
        .arg(dir.join("bad_mma.cubin"))
        .arg(&src)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && log.contains("mma"),
        "ptxas assembled a mismatched mma.sync: {log}"
    );
    println!("the control, refused: {}", log.lines().next().unwrap_or(""));
    let _ = std::fs::remove_dir_all(&dir);
}
