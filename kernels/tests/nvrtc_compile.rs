//! Every kernel compiles with NVRTC to PTX for sm_80 and sm_90, without an error or a warning.
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
            for kernel in program.kernels() {
                assert!(
                    ptx.contains(&format!(".entry {kernel}(")),
                    "{} for {arch}: no kernel `{kernel}`",
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
