//! The CUDA C programs and their compilation by NVRTC.

use std::ffi::{c_char, CString};

use cudarc::nvrtc::{result, sys};

use crate::KernelError;

const COMMON: &str = include_str!("cu/common.cuh");

/// One NVRTC program (one CUDA module): the shared header plus one `.cu` file (for
/// [`Program::Nn`], `nn.cu` followed by `nn_softmax.cu` and `nn_embed_heads.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Program {
    /// `cast_<src>_<dst>` between f32, bf16 and f16 (and `cast_f32_bf16_x4`, four elements a
    /// thread).
    Cast,
    /// `axpby_<dtype>`, `div_scalar_<dtype>`, `scale_by_f32`, `unscale_by_f32`,
    /// `memset_b{16,32,64}`, `gather_segments` and `zero_segments`.
    Elementwise,
    /// `reduce_{sum,min,max,prod}_<dtype>` (avg is a sum with a final division).
    Reduce,
    /// `adamw_f32`, `adamw_bf16_state`, `sgd_f32`, and the end of a step decided on the
    /// device: `step_decide`, `engine_decide` (the engine's grad scaler and non-finite rule), `adamw_decided_f32`
    /// (and `_many`) and `sgd_decided_f32`.
    Optim,
    /// torchdistx's `AnyPrecisionAdamW` at the end of a step decided on the device:
    /// `anyprecision_decided_f32` and `anyprecision_decided_bf16_state` (f32 or bf16 state).
    AnyPrecision,
    /// `sum_squares_f32` and `sum_f64_final` (and their `_many` forms), the step's loss
    /// (`loss_accumulate`) and the norm's clip coefficient (`clip_coefficient`).
    Norm,
    /// The GPT's layers besides matrix products (f32): layer norm, GELU, causal softmax,
    /// cross-entropy, embeddings, bias gradient and bias add, and the attention heads'
    /// permutations.
    Nn,
    /// Fused causal attention on tensor cores (`mma.sync`, compute capability 8.0 or newer):
    /// `flash_forward`, `flash_backward_dot`, `flash_backward_dkv` and `flash_backward_dq`,
    /// each for bf16 and f16 operands and heads of 32 and 64 values.
    Attention,
}

impl Program {
    /// Every program.
    pub const ALL: [Program; 8] = [
        Program::Cast,
        Program::Elementwise,
        Program::Reduce,
        Program::Optim,
        Program::AnyPrecision,
        Program::Norm,
        Program::Nn,
        Program::Attention,
    ];

    /// The program's name (its `.cu` file).
    pub const fn name(self) -> &'static str {
        match self {
            Program::Cast => "cast.cu",
            Program::Elementwise => "elementwise.cu",
            Program::Reduce => "reduce.cu",
            Program::Optim => "optim.cu",
            Program::AnyPrecision => "any_precision.cu",
            Program::Norm => "norm.cu",
            Program::Nn => "nn.cu",
            Program::Attention => "attention.cu",
        }
    }

    /// The full source given to NVRTC.
    pub fn source(self) -> String {
        let body = match self {
            Program::Cast => include_str!("cu/cast.cu"),
            Program::Elementwise => include_str!("cu/elementwise.cu"),
            Program::Reduce => include_str!("cu/reduce.cu"),
            Program::Optim => include_str!("cu/optim.cu"),
            Program::AnyPrecision => include_str!("cu/any_precision.cu"),
            Program::Norm => include_str!("cu/norm.cu"),
            // One program from three files, joined in this order.
            Program::Nn => concat!(
                include_str!("cu/nn.cu"),
                include_str!("cu/nn_softmax.cu"),
                include_str!("cu/nn_embed_heads.cu")
            ),
            Program::Attention => include_str!("cu/attention.cu"),
        };
        format!("{COMMON}\n{body}")
    }

    /// The kernels (`extern "C"` names) the program defines.
    pub fn kernels(self) -> Vec<String> {
        let s = |v: &[&str]| v.iter().map(|k| k.to_string()).collect::<Vec<_>>();
        match self {
            Program::Cast => s(&[
                "cast_f32_bf16",
                "cast_f32_f16",
                "cast_bf16_f32",
                "cast_f16_f32",
                "cast_bf16_f16",
                "cast_f16_bf16",
                "cast_f32_bf16_x4",
            ]),
            Program::Elementwise => s(&[
                "axpby_f32",
                "axpby_f64",
                "axpby_bf16",
                "axpby_f16",
                "div_scalar_f32",
                "div_scalar_f64",
                "div_scalar_bf16",
                "div_scalar_f16",
                "scale_by_f32",
                "unscale_by_f32",
                "memset_b16",
                "memset_b32",
                "memset_b64",
                "gather_segments",
                "zero_segments",
            ]),
            Program::Reduce => ["sum", "min", "max", "prod"]
                .iter()
                .flat_map(|op| {
                    ["f32", "f64", "bf16", "f16"]
                        .iter()
                        .map(move |t| format!("reduce_{op}_{t}"))
                })
                .collect(),
            Program::Optim => s(&[
                "adamw_f32",
                "adamw_bf16_state",
                "sgd_f32",
                "step_decide",
                "adamw_decided_f32",
                "adamw_decided_many",
                "engine_decide",
                "sgd_decided_f32",
            ]),
            Program::AnyPrecision => s(&[
                "anyprecision_decided_f32",
                "anyprecision_decided_bf16_state",
                "anyprecision_decided_many_f32",
                "anyprecision_decided_many_bf16_state",
            ]),
            Program::Norm => s(&[
                "sum_squares_f32",
                "sum_f64_final",
                "sum_squares_many",
                "sum_f64_final_many",
                "loss_accumulate",
                "clip_coefficient",
            ]),
            Program::Nn => s(&[
                "layernorm_forward_f32",
                "layernorm_forward_bf16",
                "layernorm_forward_f16",
                "layernorm_backward_input_f32",
                "layernorm_backward_params_f32",
                "gelu_forward_f32",
                "gelu_forward_bf16",
                "gelu_forward_f16",
                "gelu_backward_f32",
                "causal_softmax_forward_f32",
                "causal_softmax_forward_bf16",
                "causal_softmax_forward_f16",
                "causal_softmax_forward_both_bf16",
                "causal_softmax_forward_both_f16",
                "causal_softmax_backward_f32",
                "causal_softmax_backward_bf16",
                "causal_softmax_backward_f16",
                "cross_entropy_fused_f32",
                "cross_entropy_fused_bf16",
                "cross_entropy_fused_f16",
                "embedding_forward_f32",
                "embedding_backward_tokens_f32",
                "embedding_backward_tokens_grouped_f32",
                "embedding_backward_positions_f32",
                "bias_grad_f32",
                "column_chunks_add_f32",
                "bias_add_f32",
                "heads_split_f32",
                "heads_split_bf16",
                "heads_split_f16",
                "heads_merge_f32",
                "heads_merge_bf16",
                "heads_merge_f16",
            ]),
            Program::Attention => ["bf16_d32", "f16_d32", "bf16_d64", "f16_d64"]
                .iter()
                .flat_map(|h| {
                    ["forward", "backward_dot", "backward_dkv", "backward_dq"]
                        .iter()
                        .map(move |k| format!("flash_{k}_{h}"))
                })
                .collect(),
        }
    }
}

impl Program {
    /// Whether the program asks for fused multiply-adds itself (`__fmaf_rn`, where its twin
    /// calls `mul_add`): only [`Program::AnyPrecision`]. `--fmad=false` ([`options`]) keeps
    /// NVRTC from fusing anything else in every program.
    pub const fn explicit_fma(self) -> bool {
        matches!(self, Program::AnyPrecision)
    }

    /// Whether every kernel of the program equals its host twin bitwise: all but
    /// [`Program::Attention`], whose tensor-core products sum in an order the hardware
    /// chooses, and which takes the CUDA math library's `exp2f` and `log2f` (their
    /// multiply-adds and approximations included) where its twins take Rust's.
    pub const fn bitwise_twins(self) -> bool {
        !matches!(self, Program::Attention)
    }
}

/// The NVRTC options of every program: no fused multiply-add and IEEE division, square root
/// and denormals, so that results equal the host twins bitwise.
pub fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--fmad=false".into(),
        "--ftz=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--std=c++17".into(),
    ]
}

/// PTX of a program and NVRTC's log (empty when it had nothing to say).
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The PTX text.
    pub ptx: String,
    /// NVRTC's log: warnings, if any.
    pub log: String,
}

fn c_text(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// Compile `program` to PTX for the virtual architecture `arch` (`compute_90`) with NVRTC,
/// found by [`fsdp_device::cuda::libs::load_nvrtc`]. A log (warnings) does not fail the
/// compilation: see [`Compiled::log`] and [`compile_ptx`].
///
/// # Errors
/// [`KernelError::Device`] without NVRTC, [`KernelError::Compile`] with NVRTC's log.
pub fn compile(program: Program, arch: &str) -> Result<Compiled, KernelError> {
    compile_source(program.name(), &program.source(), arch)
}

/// Compile CUDA C `source` (named `name` in NVRTC's messages) with the options of
/// [`options`].
///
/// # Errors
/// As [`compile`].
pub fn compile_source(
    name: &'static str,
    source: &str,
    arch: &str,
) -> Result<Compiled, KernelError> {
    fsdp_device::cuda::libs::load_nvrtc()?;
    let fail = |status: String, log: String| KernelError::Compile {
        program: name,
        arch: arch.to_string(),
        status,
        log,
    };
    let src = CString::new(source).map_err(|e| fail(e.to_string(), String::new()))?;
    let cname = CString::new(name).map_err(|e| fail(e.to_string(), String::new()))?;
    let prog = result::create_program(&src, Some(&cname))
        .map_err(|e| fail(format!("{e:?}"), String::new()))?;
    let opts = options(arch);
    // SAFETY: `prog` was created above and is destroyed once, below; `src` and `cname`
    // outlive it.
    let out = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = result::get_program_log(prog)
            .map(|l| c_text(&l))
            .unwrap_or_default();
        let ptx = compiled.and_then(|()| result::get_ptx(prog));
        let _ = result::destroy_program(prog);
        ptx.map(|p| Compiled {
            ptx: c_text(&p),
            log: log.clone(),
        })
        .map_err(|e| fail(format!("{e:?}"), log))
    };
    drop((src, cname));
    out
}

/// Compile `program` for `arch` and treat any NVRTC log (a warning) as an error: what CI runs
/// on every program.
///
/// # Errors
/// As [`compile`]; [`KernelError::Compile`] with status `warnings` for a non-empty log.
pub fn compile_ptx(program: Program, arch: &str) -> Result<String, KernelError> {
    let c = compile(program, arch)?;
    if !c.log.is_empty() {
        return Err(KernelError::Compile {
            program: program.name(),
            arch: arch.to_string(),
            status: "warnings".into(),
            log: c.log,
        });
    }
    Ok(c.ptx)
}

/// NVRTC's version (major, minor).
///
/// # Errors
/// [`KernelError::Device`] without NVRTC.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    fsdp_device::cuda::libs::load_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters of the right type.
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if status != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(KernelError::Compile {
            program: "nvrtcVersion",
            arch: String::new(),
            status: format!("{status:?}"),
            log: String::new(),
        });
    }
    Ok((major, minor))
}
