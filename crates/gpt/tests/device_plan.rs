//! The device trainer's predicted memory (`plan_memory`, a replay of the step's buffers by size)
//! against its measured memory on the kernels' host twins (`HostOps` counts every buffer it
//! hands out and keeps): the peak over three steps equals the prediction exactly, for f32 and
//! bf16 products, one and two micro-batches, two model sizes, and with clipping (which holds
//! no copies: the same peak as without); between steps exactly what the plan holds
//! throughout is left. The parts the plan lists are checked against closed forms.

use fsdp::optim::{AdamWConfig, LrSchedule};
use fsdp_device::DType;
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_plan::plan_memory;
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig, DeviceTrainer};
use fsdp_gpt::model::GptConfig;
use fsdp_kernels::gpt::{param_shapes, Attention, HostOps, HostProducts, Logits, Products};
use fsdp_kernels::host::AnyPrecision;

fn config(cfg: GptConfig, batch: usize, accum: usize, clip: Option<f64>) -> DeviceTrainConfig {
    DeviceTrainConfig {
        cfg,
        adamw: AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        schedule: LrSchedule::Constant,
        decay_2d_only: false,
        grad_clip: clip,
        batch_size: batch,
        grad_accum: accum,
        offload: false,
        activation_checkpointing: false,
        attention: Default::default(),
        logits: Default::default(),
        reduce_dtype: fsdp_device::DType::F32,
        any_precision: None,
        grad_scaler: None,
        wrap: Default::default(),
    }
}

/// Runs 3 steps on the host twins; returns (peak, bytes held after each step).
fn measure(c: &DeviceTrainConfig, products: HostProducts) -> (u64, Vec<u64>) {
    let params = seeded_params(&c.cfg, 5).unwrap();
    let ops = HostOps::with_products(products);
    let tokens = synthetic_corpus(20_000, c.cfg.vocab_size as u16, 5);
    let mut tr = DeviceTrainer::new(ops, *c, &params).unwrap();
    let held = (0..3)
        .map(|step| {
            let o = tr.step(&tokens, step).unwrap();
            assert!(o.applied, "{o:?}");
            tr.memory().allocated
        })
        .collect();
    (tr.peak_bytes(), held)
}

fn check(name: &str, c: &DeviceTrainConfig, bf16: bool) -> fsdp_gpt::device_plan::DeviceMemoryPlan {
    let (products, twin) = if bf16 {
        (Products::Bf16, HostProducts::Bf16Operands)
    } else {
        (Products::F32, HostProducts::F32)
    };
    check_products(name, c, products, twin)
}

/// [`check`] with the products named.
fn check_products(
    name: &str,
    c: &DeviceTrainConfig,
    products: Products,
    twin: HostProducts,
) -> fsdp_gpt::device_plan::DeviceMemoryPlan {
    let plan = plan_memory(c, products).unwrap();
    let (peak, held) = measure(c, twin);
    println!(
        "{name}: predicted peak {} at {}, measured {peak}",
        plan.peak, plan.peak_moment
    );
    assert_eq!(
        peak, plan.peak,
        "{name}: measured vs predicted peak\n{plan}"
    );
    for h in held {
        assert_eq!(
            h,
            plan.persistent(),
            "{name}: bytes held between steps\n{plan}"
        );
    }
    // The parts against closed forms.
    let p = c.cfg.num_params() as u64;
    assert_eq!(plan.param_elements, p);
    assert_eq!((plan.parameters, plan.gradients), (4 * p, 4 * p));
    // The optimizer's state: AdamW's f32 moments, or AnyPrecisionAdamW's two and its
    // compensation in its state dtype, bf16 two to an f32 element (a tensor of odd length
    // rounds up by one bf16).
    let state = match c.any_precision {
        Some(a) if a.state == DType::BF16 => param_shapes(&c.dims())
            .iter()
            .map(|(_, s)| s.iter().product::<usize>().div_ceil(2) as u64 * 4)
            .sum(),
        _ => 4 * p,
    };
    let comp = if c.any_precision.is_some_and(|a| a.kahan) {
        state
    } else {
        0
    };
    // Under CPU offload the accumulators and the optimizer's state live on the host, with
    // the master parameters.
    let (optim, offloaded) = if c.offload {
        (0, 8 * p + 2 * state + comp)
    } else {
        (state, 0)
    };
    for part in [plan.exp_avg, plan.exp_avg_sq] {
        assert_eq!(part, optim, "{name}");
    }
    assert_eq!(
        plan.compensation,
        if c.offload { 0 } else { comp },
        "{name}"
    );
    // With one micro-batch a step the model's gradients serve: no accumulators.
    let acc = if c.grad_accum == 1 || c.offload {
        0
    } else {
        4 * p
    };
    assert_eq!(plan.accumulators, acc, "{name}");
    assert_eq!(plan.offloaded, offloaded, "{name}");
    // The staging: one or two gradient sets (two with several micro-batches) and the
    // parameters.
    let staging = if c.offload {
        4 * p * (c.grad_accum.min(2) as u64 + 1)
    } else {
        0
    };
    assert_eq!(plan.host_staging, staging, "{name}");
    let (l, e, v, h, t) = (
        c.cfg.n_layer as u64,
        c.cfg.n_embd as u64,
        c.cfg.vocab_size as u64,
        c.cfg.n_head as u64,
        c.cfg.block_size as u64,
    );
    let rows = (c.batch_size / c.grad_accum) as u64;
    let n = rows * t;
    // The attention's t × t matrices: every (sequence, head) pair's probabilities kept when
    // materialized (none kept when chunked or fused); fused keeps each row's log-sum-exp.
    let kept = if c.attention.keeps_probabilities() {
        rows * h * t * t
    } else {
        0
    };
    let lse = if c.attention == Attention::Fused {
        rows * h * t
    } else {
        0
    };
    // Per block 16 activations of n×E, 4 of n (two layer norms' mean and rstd), the
    // attention probabilities when kept; then the final output and ln_f's. With bf16
    // products 10 of the 16 (h1, q, k, v, y, h2, gelu's output of 4) and ln_f's output are
    // kept in bf16, as only products read them. With activation checkpointing, each block's
    // input alone.
    let opb = if twin.half().is_some() { 2 } else { 4 };
    let per_block = if c.activation_checkpointing {
        4 * n * e
    } else {
        4 * (6 * n * e + 4 * n + kept + lse) + opb * 10 * n * e
    };
    let tape = l * per_block + 4 * (n * e + 2 * n) + opb * n * e;
    assert_eq!(plan.tape, tape, "{name}");
    // The kept copies of the products' operands: the largest buffer each position reads (the
    // results only products read are written as operands and pass through neither): first
    // GELU's input gradient or the kept probabilities (`dv`'s product), second the weights.
    let operands = if twin.half().is_some() {
        let a = (4 * n * e).max(kept);
        let b = (4 * e * e).max(v * e);
        2 * (a + b)
    } else {
        0
    };
    assert_eq!(plan.bf16_operands, operands, "{name}");
    assert_eq!(
        plan.peak,
        plan.persistent() + plan.peak_tape + plan.peak_working + plan.peak_ids
    );
    plan
}

fn small() -> GptConfig {
    GptConfig::new(2, 2, 32, 16, 64).unwrap()
}

fn larger() -> GptConfig {
    GptConfig::new(3, 4, 64, 32, 200).unwrap()
}

#[test]
fn predicted_peak_equals_the_host_twins_f32() {
    for (name, cfg) in [("small", small()), ("larger", larger())] {
        for accum in [1, 2] {
            let c = config(cfg, 8, accum, None);
            let plan = check(&format!("{name}, f32, accum {accum}"), &c, false);
            assert!(plan.peak_tape > 0 && plan.peak_working > 0);
        }
    }
}

/// The attention's probabilities kept (materialized) or computed again in chunks of one,
/// three and every (sequence, head) pair, the logits whole or in chunks: each plan is the
/// measured peak, and chunks hold less than kept probabilities.
#[test]
fn predicted_peak_for_each_attention_and_logits_equals_the_host_twins() {
    let cfg = GptConfig::new(2, 2, 32, 64, 64).unwrap();
    let pair = 64 * 64 * 4;
    for (accum, bf16, ckpt) in [(1, false, false), (2, true, false), (1, true, true)] {
        let base = DeviceTrainConfig {
            activation_checkpointing: ckpt,
            ..config(cfg, 4, accum, None)
        };
        let products = if bf16 { Products::Bf16 } else { Products::F32 };
        let kept = DeviceTrainConfig {
            attention: Attention::Materialized,
            ..base
        };
        let what = format!("accum {accum}, bf16 {bf16}, checkpointing {ckpt}");
        let materialized = check(&format!("{what}, materialized"), &kept, bf16);
        for max_bytes in [pair, 3 * pair, usize::MAX] {
            let chunked = DeviceTrainConfig {
                attention: Attention::Chunked { max_bytes },
                ..base
            };
            let plan = check(&format!("{what}, chunks of {max_bytes} B"), &chunked, bf16);
            // One chunk of every pair holds as much as kept probabilities do under
            // checkpointing (one block's at a time either way), plus q's, k's and v's
            // gradients made before the chunks.
            if max_bytes < usize::MAX || !ckpt {
                assert!(
                    plan.peak < materialized.peak,
                    "{what}: {plan}\n{materialized}"
                );
            }
        }
        if bf16 {
            // Fused: no t × t matrix, each block's log-sum-exp kept instead.
            let fused = DeviceTrainConfig {
                attention: Attention::Fused,
                ..base
            };
            let plan = check(&format!("{what}, fused"), &fused, bf16);
            assert!(
                plan.peak < materialized.peak,
                "{what}: {plan}\n{materialized}"
            );
            assert!(plan.to_string().contains("attention: fused"), "{plan}");
        }
        assert_eq!(plan_memory(&kept, products).unwrap(), materialized);
        // The logits whole, and in chunks of 50 tokens (of 256): the chunks hold less.
        let whole = DeviceTrainConfig {
            logits: Logits::Whole,
            ..base
        };
        let whole = check(&format!("{what}, logits whole"), &whole, bf16);
        let fifty = DeviceTrainConfig {
            logits: Logits::Chunked {
                max_bytes: 50 * 64 * 4,
            },
            ..base
        };
        let fifty = check(&format!("{what}, logits in chunks of 50"), &fifty, bf16);
        assert!(fifty.peak <= whole.peak, "{fifty}\n{whole}");
        assert!(fifty
            .to_string()
            .contains("logits: chunked (12800 B), 50 tokens'"));
    }
}

#[test]
fn predicted_peak_equals_the_host_twins_bf16() {
    for (name, cfg) in [("small", small()), ("larger", larger())] {
        for accum in [1, 2] {
            let c = config(cfg, 8, accum, None);
            check(&format!("{name}, bf16, accum {accum}"), &c, true);
        }
    }
}

/// f16 products hold what bf16 products hold (2 bytes an operand): the plan is bf16's, and the
/// host twins' f16 run measures it exactly.
#[test]
fn predicted_peak_f16_products_is_bf16s() {
    for accum in [1, 2] {
        let c = config(small(), 8, accum, None);
        let f16 = check_products("f16", &c, Products::F16, HostProducts::F16Operands);
        assert_eq!(f16.peak, plan_memory(&c, Products::Bf16).unwrap().peak);
    }
}

/// Clipping on every step (a tiny max norm): AdamW scales each gradient as it reads it, so
/// clipping holds no copy — one row of 4 tokens against a vocabulary of 512 × 64, where a
/// scaled copy of wte's gradient would have made the peak. The measured peaks (the plan's,
/// checked against the twins) are those without clipping.
#[test]
fn predicted_peak_clipping_holds_no_copies() {
    let cfg = GptConfig::new(1, 2, 64, 4, 512).unwrap();
    let clipped = check("clipping", &config(cfg, 1, 1, Some(1e-6)), false);
    let plain = check("no clipping", &config(cfg, 1, 1, None), false);
    assert_eq!(clipped, plain);
    assert!(!clipped.peak_moment.contains("clipping"), "{clipped}");
    assert_eq!(
        clipped.step_scalars,
        8 * (fsdp_kernels::host::STEP_SQUARES
            + fsdp_kernels::gpt::param_shapes(&config(cfg, 1, 1, None).dims()).len())
            as u64
    );
}

/// CPU offload: the same step's buffers, without the accumulators and the moments on the
/// device (measured on the host twins, whose device-side operations
/// count only device buffers).
#[test]
fn predicted_peak_with_cpu_offload_equals_the_host_twins() {
    for (name, cfg) in [("small", small()), ("larger", larger())] {
        for (accum, bf16) in [(1, false), (2, true)] {
            let base = config(cfg, 8, accum, None);
            let off = DeviceTrainConfig {
                offload: true,
                ..base
            };
            let what = format!("{name}, offload, accum {accum}, bf16 {bf16}");
            let plan = check(&what, &off, bf16);
            let plain =
                plan_memory(&base, if bf16 { Products::Bf16 } else { Products::F32 }).unwrap();
            // The moments leave the device, and the accumulators where a step has several
            // micro-batches (with one, the device run has none).
            let p = cfg.num_params() as u64;
            let moved = if accum == 1 { 8 * p } else { 12 * p };
            assert_eq!(plain.peak - plan.peak, moved, "{what}");
        }
    }
    // Clipping scales the accumulators on the host: no copy on the device.
    let cfg = GptConfig::new(1, 2, 64, 4, 512).unwrap();
    let c = DeviceTrainConfig {
        offload: true,
        ..config(cfg, 1, 1, Some(1e-6))
    };
    let plan = check("offload, clipping", &c, false);
    assert!(!plan.peak_moment.contains("clipping"), "{plan}");
    assert!(plan.to_string().contains("offloaded to host"), "{plan}");
}

/// AnyPrecisionAdamW: its state (bf16 packed or f32, with and without the Kahan
/// compensation) on the device or under CPU offload, with bf16 or f32 parameters; the peak is
/// the measured one, and bf16 state with compensation holds 6 bytes an element where AdamW
/// holds 8.
#[test]
fn predicted_peak_with_anyprecision_adamw_equals_the_host_twins() {
    let kinds = [
        (DType::BF16, DType::BF16, true),
        (DType::F32, DType::BF16, false),
        (DType::BF16, DType::F32, true),
    ];
    for (name, cfg) in [("small", small()), ("larger", larger())] {
        for (i, (param, state, kahan)) in kinds.into_iter().enumerate() {
            for offload in [false, true] {
                let accum = 1 + i % 2;
                let c = DeviceTrainConfig {
                    any_precision: Some(AnyPrecision {
                        param,
                        state,
                        kahan,
                    }),
                    offload,
                    ..config(cfg, 8, accum, Some(1.0))
                };
                let what = format!("{name}, {param:?} {state:?} kahan {kahan}, offload {offload}");
                check(&what, &c, param == DType::BF16);
            }
        }
    }
    let adamw = plan_memory(&config(small(), 8, 1, None), Products::F32).unwrap();
    let any = DeviceTrainConfig {
        any_precision: Some(AnyPrecision {
            param: DType::BF16,
            state: DType::BF16,
            kahan: true,
        }),
        ..config(small(), 8, 1, None)
    };
    let any = plan_memory(&any, Products::F32).unwrap();
    let p = small().num_params() as f64;
    let per = |x: &fsdp_gpt::device_plan::DeviceMemoryPlan| {
        (x.exp_avg + x.exp_avg_sq + x.compensation) as f64 / p
    };
    assert_eq!(per(&adamw), 8.0);
    assert!((per(&any) - 6.0).abs() < 0.01, "{}", per(&any));
    assert!(any.to_string().contains("AnyPrecisionAdamW, bf16"), "{any}");
}

/// Activation checkpointing: forward keeps each block's input, backward recomputes the block
/// first; the measured peak is the plan's, and lower than without checkpointing.
#[test]
fn predicted_peak_with_activation_checkpointing_equals_the_host_twins() {
    for (name, cfg) in [("small", small()), ("larger", larger())] {
        for (accum, bf16) in [(1, false), (2, true), (1, true)] {
            let base = config(cfg, 8, accum, None);
            let ckpt = DeviceTrainConfig {
                activation_checkpointing: true,
                ..base
            };
            let what = format!("{name}, checkpointing, accum {accum}, bf16 {bf16}");
            let plan = check(&what, &ckpt, bf16);
            let products = if bf16 { Products::Bf16 } else { Products::F32 };
            let plain = plan_memory(&base, products).unwrap();
            assert!(
                plan.peak < plain.peak,
                "{what}: {} vs {}",
                plan.peak,
                plain.peak
            );
            assert!(
                plan.to_string().contains("activation checkpointing"),
                "{plan}"
            );
        }
    }
}

#[test]
fn the_plan_refuses_what_the_trainer_refuses() {
    let e = plan_memory(&config(small(), 8, 3, None), Products::F32).unwrap_err();
    assert!(e.to_string().contains("micro-batches"), "{e}");
    let mut huge = config(small(), 8, 1, None);
    huge.cfg.vocab_size = u32::MAX as usize;
    huge.cfg.n_embd = 1 << 40;
    huge.cfg.n_head = 1;
    let e = plan_memory(&huge, Products::F32).unwrap_err();
    assert!(e.to_string().contains("64 bits"), "{e}");
}
