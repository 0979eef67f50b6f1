//! Bitwise agreement with the naive reference and with PyTorch itself.

use super::*;

// ---------------------------------------------------------------------------------------------
// (a) Bitwise agreement with the naive reference.

#[test]
fn one_step_is_bitwise_the_op_by_op_reference() {
    for (name, cfg) in configs() {
        let n = 257;
        let mut rng = Rng(0xA11CE);
        let mut p: Vec<bf16> = (0..n).map(|_| bf16::from_f32(2.0 * rng.unit())).collect();
        let mut ref_p = T {
            dt: DType::BF16,
            x: p.iter().map(|x| x.to_f32()).collect(),
        };
        let mut ours = AnyPrecisionAdamWState::try_new(&cfg, n).unwrap();
        let mut theirs = RefState::new(&cfg, n);
        // One step from zero state, then more steps: the first is the brief's "one step", the
        // later ones exercise non-zero moments and compensation.
        for step in 1..=6 {
            let g: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
            ours.step(&cfg, &mut p, &g).unwrap();
            reference_step(
                &cfg,
                &mut theirs,
                &mut ref_p,
                &T {
                    dt: DType::F32,
                    x: g.clone(),
                },
            );
            let what = format!("{name}, step {step}");
            for (i, (a, b)) in p.iter().zip(&ref_p.x).enumerate() {
                assert!(same_value(a.to_f32(), *b), "{what}: param[{i}]");
            }
            assert_state_eq(&ours, &theirs, &what);
            assert_eq!(ours.step, step);
        }
    }
}

#[test]
fn f32_parameters_follow_the_same_reference() {
    // AnyPrecisionAdamW on f32 parameters (torchdistx under FSDP mixed precision): the same
    // operations with the parameter's roundings to f32, through the f32 optimizer API.
    for (name, c) in configs() {
        let cfg = OptimizerConfig::from(c);
        let n = 64;
        let mut rng = Rng(7);
        let mut p: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
        let mut ref_p = T {
            dt: DType::F32,
            x: p.clone(),
        };
        let mut ours = OptimizerState::try_new(&cfg, n).unwrap();
        let mut theirs = RefState::new(&c, n);
        for _ in 0..3 {
            let g: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
            ours.step(&cfg, &mut p, &g).unwrap();
            reference_step(
                &c,
                &mut theirs,
                &mut ref_p,
                &T {
                    dt: DType::F32,
                    x: g,
                },
            );
        }
        let OptimizerState::AnyPrecisionAdamW(s) = &ours else {
            panic!("{name}: wrong state")
        };
        for (i, (a, b)) in p.iter().zip(&ref_p.x).enumerate() {
            assert!(same_value(*a, *b), "{name}: param[{i}] {a} vs {b}");
        }
        assert_state_eq(s, &theirs, name);
    }
}

// ---------------------------------------------------------------------------------------------
// (a') Bitwise agreement with PyTorch itself.

/// Golden values from PyTorch's CPU kernels (`tests/data/any_precision/torch_golden.py`:
/// torchdistx's step on real tensors, bf16/f16/f32 states, several steps, gradients over many
/// binades). Each case starts from the parameter and gradients stored in the file.
#[test]
fn steps_are_bitwise_pytorch_cpu() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/any_precision/torch.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    let dtype = |v: &serde_json::Value| match v.as_str().unwrap() {
        "float32" => DType::F32,
        "bfloat16" => DType::BF16,
        "float16" => DType::F16,
        other => panic!("dtype {other}"),
    };
    let ints = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap() as u32)
            .collect()
    };
    let widen = |dt: DType, bits: &[u32]| -> Vec<f32> {
        bits.iter()
            .map(|&b| match dt {
                DType::F32 => f32::from_bits(b),
                DType::BF16 => bf16::from_bits(b as u16).to_f32(),
                DType::F16 => f16::from_bits(b as u16).to_f32(),
                DType::F64 => unreachable!(),
            })
            .collect()
    };
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let cfg = AnyPrecisionAdamWConfig {
            lr: case["lr"].as_f64().unwrap(),
            beta1: case["beta1"].as_f64().unwrap(),
            beta2: case["beta2"].as_f64().unwrap(),
            eps: case["eps"].as_f64().unwrap(),
            weight_decay: case["weight_decay"].as_f64().unwrap(),
            use_kahan_summation: case["kahan"].as_bool().unwrap(),
            momentum_dtype: dtype(&case["momentum_dtype"]),
            variance_dtype: dtype(&case["variance_dtype"]),
            compensation_buffer_dtype: dtype(&case["compensation_dtype"]),
        };
        let param_dtype = dtype(&case["param_dtype"]);
        let p0 = widen(param_dtype, &ints(&case["param0"]));
        let n = p0.len();
        let mut state = AnyPrecisionAdamWState::try_new(&cfg, n).unwrap();
        let mut p_bf16: Vec<bf16> = p0.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut p_f32 = p0.clone();
        let opt = OptimizerConfig::from(cfg);
        let mut wrapped = OptimizerState::AnyPrecisionAdamW(state.clone());
        let steps = case["steps"].as_array().unwrap();
        for (k, (g, want)) in case["grads"]
            .as_array()
            .unwrap()
            .iter()
            .zip(steps)
            .enumerate()
        {
            let g = widen(DType::F32, &ints(g));
            let what = format!("{name} step {}", k + 1);
            let got_p = match param_dtype {
                DType::BF16 => {
                    state.step(&cfg, &mut p_bf16, &g).unwrap();
                    p_bf16.iter().map(|x| x.to_f32()).collect::<Vec<_>>()
                }
                DType::F32 => {
                    wrapped.step(&opt, &mut p_f32, &g).unwrap();
                    let OptimizerState::AnyPrecisionAdamW(s) = &wrapped else {
                        unreachable!()
                    };
                    state = s.clone();
                    p_f32.clone()
                }
                other => panic!("param dtype {other}"),
            };
            let check = |got: &[f32], dt: DType, key: &str| {
                let want = widen(dt, &ints(&want[key]));
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(same_value(*a, *b), "{what}: {key}[{i}] {a} vs {b}");
                }
            };
            check(&got_p, param_dtype, "param");
            check(&state.exp_avg.to_f32_vec(), cfg.momentum_dtype, "exp_avg");
            check(
                &state.exp_avg_sq.to_f32_vec(),
                cfg.variance_dtype,
                "exp_avg_sq",
            );
            if let Some(c) = &state.compensation {
                check(
                    &c.to_f32_vec(),
                    cfg.compensation_buffer_dtype,
                    "compensation",
                );
            }
        }
    }
}
