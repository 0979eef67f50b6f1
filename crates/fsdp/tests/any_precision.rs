//! torchdistx's AnyPrecisionAdamW on flat shards: bitwise against a naive op-by-op reference
//! and against PyTorch's own CPU results, Kahan summation against stalls of tiny bf16 updates,
//! parameter groups, validation, and the bytes per parameter.

use std::path::Path;

use fsdp::optim::{
    AdamWConfig, AnyPrecisionAdamWConfig, AnyPrecisionAdamWState, OptimizerConfig, OptimizerState,
    ParamGroupOptions, PrecisionVec, SgdConfig, ShardGroups, SKIP_GROUP,
};
use fsdp::FsdpError;
use fsdp_device::half::{bf16, f16};
use fsdp_device::DType;

// ---------------------------------------------------------------------------------------------
// The naive reference: torchdistx's `step`, one whole-tensor operation at a time.

/// `x` rounded to nearest even in `dt` and widened back: what writing an `f32` result into a
/// tensor of dtype `dt` does.
fn rnd(dt: DType, x: f32) -> f32 {
    match dt {
        DType::F32 => x,
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::F64 => unreachable!(),
    }
}

/// A tensor: its dtype and its values (each representable in the dtype), widened to `f32`.
#[derive(Clone, Debug)]
struct T {
    dt: DType,
    x: Vec<f32>,
}

impl T {
    fn zeros(dt: DType, n: usize) -> T {
        T {
            dt,
            x: vec![0.0; n],
        }
    }
    /// An in-place element-wise op: the result computed in f32, rounded once to the dtype.
    fn apply(&mut self, f: impl Fn(usize, f32) -> f32) -> &mut Self {
        for i in 0..self.x.len() {
            self.x[i] = rnd(self.dt, f(i, self.x[i]));
        }
        self
    }
    // PyTorch's in-place ops, as its CPU kernels (AVX2/AVX512 builds) compute them: with an
    // f32 operand the computation is f32 and the final multiply-add fused.
    fn mul_(&mut self, s: f64) -> &mut Self {
        let s = s as f32;
        self.apply(|_, a| a * s)
    }
    fn add_t(&mut self, o: &T, alpha: f64) -> &mut Self {
        let alpha = alpha as f32;
        self.apply(|i, a| alpha.mul_add(o.x[i], a))
    }
    /// `add_(scalar)`: the scalar is first converted to the tensor's dtype.
    fn add_s(&mut self, s: f64) -> &mut Self {
        let s = rnd(self.dt, s as f32);
        self.apply(|_, a| a + s)
    }
    fn sub_t(&mut self, o: &T) -> &mut Self {
        self.apply(|i, a| a - o.x[i])
    }
    fn addcmul_(&mut self, t1: &T, t2: &T, value: f64) -> &mut Self {
        let value = value as f32;
        self.apply(|i, a| (value * t1.x[i]).mul_add(t2.x[i], a))
    }
    fn addcdiv_(&mut self, t1: &T, t2: &T, value: f32) -> &mut Self {
        self.apply(|i, a| a + value * t1.x[i] / t2.x[i])
    }
    fn sqrt(&self) -> T {
        let mut t = self.clone();
        t.apply(|_, a| a.sqrt());
        t
    }
    /// Division by a 0-dim f32 tensor (no type promotion: the result keeps `self`'s dtype).
    fn div_0d(&self, d: f32) -> T {
        let mut t = self.clone();
        t.apply(|_, a| a / d);
        t
    }
}

struct RefState {
    /// `torch.tensor(0.0)`: a float32 count.
    step: f32,
    exp_avg: T,
    exp_avg_sq: T,
    compensation: Option<T>,
}

impl RefState {
    fn new(cfg: &AnyPrecisionAdamWConfig, n: usize) -> Self {
        RefState {
            step: 0.0,
            exp_avg: T::zeros(cfg.momentum_dtype, n),
            exp_avg_sq: T::zeros(cfg.variance_dtype, n),
            compensation: cfg
                .use_kahan_summation
                .then(|| T::zeros(cfg.compensation_buffer_dtype, n)),
        }
    }
}

/// torchdistx `AnyPrecisionAdamW.step` for one parameter, line by line.
fn reference_step(cfg: &AnyPrecisionAdamWConfig, state: &mut RefState, p: &mut T, grad: &T) {
    let (lr, beta1, beta2, eps, wd) = (cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay);
    // state["step"] += 1; step = state["step"]
    state.step += 1.0;
    let step = state.step;
    // if weight_decay: p.data.mul_(1 - lr * weight_decay)
    if wd != 0.0 {
        p.mul_(1.0 - lr * wd);
    }
    // exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    state.exp_avg.mul_(beta1).add_t(grad, 1.0 - beta1);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    state
        .exp_avg_sq
        .mul_(beta2)
        .addcmul_(grad, grad, 1.0 - beta2);
    // bias_correction1 = 1 - beta1**step  (float32 tensors: pow, rsub)
    let bias_correction1 = 1.0f32 - (beta1 as f32).powf(step);
    // step_size = lr / bias_correction1  (Tensor.__rtruediv__: reciprocal() * lr)
    let step_size = bias_correction1.recip() * lr as f32;
    // denom_correction = (1 - beta2**step) ** 0.5
    let denom_correction = (1.0f32 - (beta2 as f32).powf(step)).sqrt();
    // centered_variance = (exp_avg_sq.sqrt() / denom_correction).add_(eps, alpha=1)
    let mut centered_variance = state.exp_avg_sq.sqrt().div_0d(denom_correction);
    centered_variance.add_s(eps);
    match &mut state.compensation {
        Some(compensation) => {
            // compensation.addcdiv_(exp_avg, centered_variance, value=-step_size)
            compensation.addcdiv_(&state.exp_avg, &centered_variance, -step_size);
            // temp_buffer = p.detach().clone()
            let mut temp_buffer = p.clone();
            // p.data.add_(compensation)
            p.add_t(compensation, 1.0);
            // compensation.add_(temp_buffer.sub_(p.data))
            temp_buffer.sub_t(p);
            compensation.add_t(&temp_buffer, 1.0);
        }
        None => {
            // p.data.addcdiv_(exp_avg, centered_variance, value=-step_size)
            p.addcdiv_(&state.exp_avg, &centered_variance, -step_size);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Deterministic data.

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Signed values over many binades (10⁻¹⁰ … 10¹), zeros included, so that `√v` meets `eps`.
    fn spread(&mut self) -> f32 {
        let e = (self.next() % 12) as i32 - 10;
        if self.next() % 17 == 0 {
            0.0
        } else {
            self.unit() * 10f32.powi(e)
        }
    }
}

/// Bitwise equal, or both NaN (NaN payloads are not part of the contract: PyTorch's vectorized
/// bf16 conversion and `half`'s give different NaN bits).
fn same_value(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn bits_of(p: &[bf16]) -> Vec<u16> {
    p.iter().map(|x| x.to_bits()).collect()
}

fn assert_state_eq(ours: &AnyPrecisionAdamWState, reference: &RefState, what: &str) {
    let same = |a: &PrecisionVec, b: &T, name: &str| {
        assert_eq!(a.dtype(), b.dt, "{what}: {name} dtype");
        let a = a.to_f32_vec();
        for (i, (x, y)) in a.iter().zip(&b.x).enumerate() {
            assert!(same_value(*x, *y), "{what}: {name}[{i}] {x} vs {y}");
        }
    };
    same(&ours.exp_avg, &reference.exp_avg, "exp_avg");
    same(&ours.exp_avg_sq, &reference.exp_avg_sq, "exp_avg_sq");
    match (&ours.compensation, &reference.compensation) {
        (Some(a), Some(b)) => same(a, b, "compensation"),
        (None, None) => {}
        _ => panic!("{what}: compensation present in one state only"),
    }
}

fn configs() -> Vec<(&'static str, AnyPrecisionAdamWConfig)> {
    let d = AnyPrecisionAdamWConfig::default();
    vec![
        ("default", d),
        (
            "weight decay",
            AnyPrecisionAdamWConfig {
                lr: 3e-3,
                weight_decay: 0.1,
                ..d
            },
        ),
        (
            "no kahan",
            AnyPrecisionAdamWConfig {
                use_kahan_summation: false,
                weight_decay: 0.01,
                ..d
            },
        ),
        (
            "f32 momentum (torchdistx's constructor default)",
            AnyPrecisionAdamWConfig {
                momentum_dtype: DType::F32,
                ..d
            },
        ),
        (
            "f32 compensation",
            AnyPrecisionAdamWConfig {
                compensation_buffer_dtype: DType::F32,
                weight_decay: 0.05,
                ..d
            },
        ),
        (
            "f16 states",
            AnyPrecisionAdamWConfig {
                momentum_dtype: DType::F16,
                variance_dtype: DType::F16,
                compensation_buffer_dtype: DType::F16,
                ..d
            },
        ),
        (
            "f16 states, eps 1e-3",
            AnyPrecisionAdamWConfig {
                momentum_dtype: DType::F16,
                variance_dtype: DType::F16,
                compensation_buffer_dtype: DType::F16,
                eps: 1e-3,
                ..d
            },
        ),
        (
            "odd betas, large eps",
            AnyPrecisionAdamWConfig {
                lr: 0.1,
                beta1: 0.5,
                beta2: 0.75,
                eps: 1e-6,
                ..d
            },
        ),
        (
            "beta 0",
            AnyPrecisionAdamWConfig {
                beta1: 0.0,
                beta2: 0.0,
                eps: 0.0,
                ..d
            },
        ),
    ]
}

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

// (b) Tiny updates (bf16 stalls, Kahan tracks f32): tests/any_precision_kahan.rs.

#[test]
fn grouped_bf16_step_equals_per_group_steps() {
    let base = AnyPrecisionAdamWConfig {
        weight_decay: 0.1,
        ..Default::default()
    };
    let cfg = OptimizerConfig::from(base);
    let groups = [
        ParamGroupOptions::with_weight_decay(0.2),
        ParamGroupOptions {
            weight_decay: None,
            lr_scale: 0.5,
        },
    ];
    // Runs: 0..5 group 0, 5..7 skipped, 7..12 group 1.
    let layout = fsdp_flatparam::FlatParamLayout::builder(1)
        .param("w", &[5])
        .param("frozen", &[2])
        .param("b", &[5])
        .build()
        .unwrap();
    let segments = ShardGroups::new(&layout, 0, |name, _| match name {
        "w" => 0,
        "b" => 1,
        _ => SKIP_GROUP,
    })
    .unwrap();
    assert_eq!(
        segments.segments(),
        &[(0..5, 0), (5..7, SKIP_GROUP), (7..12, 1)]
    );
    let n = 12;
    let mut rng = Rng(3);
    let p0: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.unit())).collect();
    let mut p = p0.clone();
    let mut state = OptimizerState::try_new(&cfg, n).unwrap();
    // Reference: each group's range stepped on its own with its own config.
    let g0 = AnyPrecisionAdamWConfig {
        lr: 2e-3,
        weight_decay: 0.2,
        ..base
    };
    let g1 = AnyPrecisionAdamWConfig { lr: 1e-3, ..base };
    let mut r0 = AnyPrecisionAdamWState::try_new(&g0, 5).unwrap();
    let mut r1 = AnyPrecisionAdamWState::try_new(&g1, 5).unwrap();
    let mut q = p0.clone();
    for _ in 0..4 {
        let g: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
        state
            .step_grouped_bf16(&cfg, 2e-3, &groups, &segments, &mut p, &g)
            .unwrap();
        r0.step(&g0, &mut q[0..5], &g[0..5]).unwrap();
        r1.step(&g1, &mut q[7..12], &g[7..12]).unwrap();
    }
    assert_eq!(state.steps(), 4);
    assert_eq!(bits_of(&p), bits_of(&q));
    assert_eq!(&p[5..7], &p0[5..7], "skipped elements untouched");
    let OptimizerState::AnyPrecisionAdamW(s) = &state else {
        unreachable!()
    };
    let m = s.exp_avg.to_f32_vec();
    assert_eq!(&m[5..7], &[0.0, 0.0], "skipped state untouched");
    assert_eq!(&m[0..5], &r0.exp_avg.to_f32_vec()[..]);
    assert_eq!(&m[7..12], &r1.exp_avg.to_f32_vec()[..]);
    let c = s.compensation.as_ref().unwrap().to_f32_vec();
    assert_eq!(
        &c[7..12],
        &r1.compensation.as_ref().unwrap().to_f32_vec()[..]
    );

    // One default group over the whole shard is the plain step.
    let mut a = p0.clone();
    let mut b = p0.clone();
    let mut sa = OptimizerState::try_new(&cfg, n).unwrap();
    let mut sb = AnyPrecisionAdamWState::try_new(&base, n).unwrap();
    let g: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
    sa.step_grouped_bf16(
        &cfg,
        base.lr,
        &[ParamGroupOptions::default()],
        &ShardGroups::single(n),
        &mut a,
        &g,
    )
    .unwrap();
    sb.step(&base, &mut b, &g).unwrap();
    assert_eq!(bits_of(&a), bits_of(&b));
}

#[test]
fn grouped_f32_step_supports_any_precision() {
    let base = AnyPrecisionAdamWConfig::default();
    let cfg = OptimizerConfig::from(base);
    let n = 8;
    let mut rng = Rng(11);
    let p0: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
    let g: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
    let (mut a, mut b) = (p0.clone(), p0);
    let mut sa = OptimizerState::try_new(&cfg, n).unwrap();
    let mut sb = OptimizerState::try_new(&cfg, n).unwrap();
    sa.step_grouped(
        &cfg,
        base.lr,
        &[ParamGroupOptions::default()],
        &ShardGroups::single(n),
        &mut a,
        &g,
    )
    .unwrap();
    sb.step(&cfg, &mut b, &g).unwrap();
    assert_eq!(a, b);
    assert_eq!(sa, sb);
}

// ---------------------------------------------------------------------------------------------
// (c) Validation and errors.

#[test]
fn invalid_settings_are_rejected_by_name() {
    let d = AnyPrecisionAdamWConfig::default();
    let cases: Vec<(AnyPrecisionAdamWConfig, &str)> = vec![
        (AnyPrecisionAdamWConfig { lr: -1e-3, ..d }, "lr"),
        (AnyPrecisionAdamWConfig { lr: f64::NAN, ..d }, "lr"),
        (
            AnyPrecisionAdamWConfig {
                lr: f64::INFINITY,
                ..d
            },
            "lr",
        ),
        (AnyPrecisionAdamWConfig { eps: -1.0, ..d }, "eps"),
        (
            AnyPrecisionAdamWConfig {
                weight_decay: -0.1,
                ..d
            },
            "weight_decay",
        ),
        (AnyPrecisionAdamWConfig { beta1: 1.0, ..d }, "beta1"),
        (AnyPrecisionAdamWConfig { beta1: -0.1, ..d }, "beta1"),
        (
            AnyPrecisionAdamWConfig {
                beta2: f64::NAN,
                ..d
            },
            "beta2",
        ),
        (
            AnyPrecisionAdamWConfig {
                momentum_dtype: DType::F64,
                ..d
            },
            "momentum_dtype",
        ),
        (
            AnyPrecisionAdamWConfig {
                variance_dtype: DType::F64,
                ..d
            },
            "variance_dtype",
        ),
        (
            AnyPrecisionAdamWConfig {
                compensation_buffer_dtype: DType::F64,
                ..d
            },
            "compensation_buffer_dtype",
        ),
    ];
    for (cfg, name) in cases {
        match cfg.validate() {
            Err(FsdpError::InvalidHyperparameter { name: got, .. }) => {
                assert_eq!(got, name, "{cfg:?}")
            }
            other => panic!("{cfg:?}: {other:?}"),
        }
        assert!(OptimizerConfig::from(cfg).validate().is_err());
        assert!(AnyPrecisionAdamWState::try_new(&cfg, 4).is_err());
    }
    // The compensation dtype does not matter without Kahan summation.
    AnyPrecisionAdamWConfig {
        use_kahan_summation: false,
        compensation_buffer_dtype: DType::F64,
        ..d
    }
    .validate()
    .unwrap();
    d.validate().unwrap();
    AnyPrecisionAdamWConfig {
        lr: 0.0,
        eps: 0.0,
        beta1: 0.0,
        beta2: 0.0,
        ..d
    }
    .validate()
    .unwrap();
}

#[test]
fn errors_leave_state_and_parameters_unchanged() {
    let cfg = AnyPrecisionAdamWConfig::default();
    let mut state = AnyPrecisionAdamWState::try_new(&cfg, 3).unwrap();
    let mut p = vec![bf16::from_f32(1.0); 3];
    let before = state.clone();

    // Gradient of the wrong length.
    let e = state.step(&cfg, &mut p, &[1.0; 2]).unwrap_err();
    assert!(
        matches!(e, FsdpError::OptimizerLength { what: "grad", .. }),
        "{e:?}"
    );
    // Parameter of another length than the state.
    let mut long = vec![bf16::from_f32(1.0); 4];
    let e = state.step(&cfg, &mut long, &[1.0; 4]).unwrap_err();
    assert!(
        matches!(
            e,
            FsdpError::OptimizerLength {
                what: "exp_avg",
                ..
            }
        ),
        "{e:?}"
    );
    // A bad hyperparameter.
    let bad = AnyPrecisionAdamWConfig { lr: -1.0, ..cfg };
    assert!(state.step(&bad, &mut p, &[1.0; 3]).is_err());
    // A config whose dtypes are not the state's.
    let f32_m = AnyPrecisionAdamWConfig {
        momentum_dtype: DType::F32,
        ..cfg
    };
    let e = state.step(&f32_m, &mut p, &[1.0; 3]).unwrap_err();
    assert!(
        matches!(
            e,
            FsdpError::InvalidHyperparameter {
                name: "momentum_dtype",
                ..
            }
        ),
        "{e:?}"
    );
    // Kahan summation asked of a state made without a compensation buffer.
    let plain = AnyPrecisionAdamWConfig {
        use_kahan_summation: false,
        ..cfg
    };
    let mut plain_state = AnyPrecisionAdamWState::try_new(&plain, 3).unwrap();
    let e = plain_state.step(&cfg, &mut p, &[1.0; 3]).unwrap_err();
    assert!(
        matches!(
            e,
            FsdpError::InvalidHyperparameter {
                name: "use_kahan_summation",
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(state, before);
    assert_eq!(p, vec![bf16::from_f32(1.0); 3]);

    // A Kahan state stepped without Kahan summation leaves its compensation alone.
    state.step(&plain, &mut p, &[1.0; 3]).unwrap();
    assert_eq!(state.compensation, before.compensation);
}

#[test]
fn optimizer_state_and_config_must_match() {
    let any = OptimizerConfig::from(AnyPrecisionAdamWConfig::default());
    let adamw = OptimizerConfig::from(AdamWConfig::default());
    let sgd = OptimizerConfig::from(SgdConfig::with_momentum(0.1, 0.9));
    let groups = [ParamGroupOptions::default()];
    let seg = ShardGroups::single(2);
    let mut p16 = vec![bf16::from_f32(1.0); 2];
    let g = [1.0f32; 2];
    // AdamW and SGD cannot step bf16 parameters.
    for cfg in [adamw, sgd] {
        let mut st = OptimizerState::try_new(&cfg, 2).unwrap();
        let e = st
            .step_grouped_bf16(&cfg, 0.1, &groups, &seg, &mut p16, &g)
            .unwrap_err();
        assert!(
            matches!(
                e,
                FsdpError::InvalidHyperparameter {
                    name: "optimizer",
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(st.steps(), 0);
    }
    // A state of another optimizer.
    let mut st = OptimizerState::try_new(&adamw, 2).unwrap();
    assert!(st
        .step_grouped_bf16(&any, 0.1, &groups, &seg, &mut p16, &g)
        .is_err());
    let mut st = OptimizerState::try_new(&any, 2).unwrap();
    assert!(st.step(&adamw, &mut [1.0f32; 2], &g).is_err());
    assert!(st
        .step_grouped(&sgd, 0.1, &groups, &seg, &mut [1.0f32; 2], &g)
        .is_err());
    // Group errors are checked before anything changes.
    let bad_groups = [ParamGroupOptions {
        weight_decay: None,
        lr_scale: -1.0,
    }];
    assert!(st
        .step_grouped_bf16(&any, 0.1, &bad_groups, &seg, &mut p16, &g)
        .is_err());
    assert!(st
        .step_grouped_bf16(&any, 0.1, &groups, &ShardGroups::single(3), &mut p16, &g)
        .is_err());
    assert!(st
        .step_grouped_bf16(&any, -0.1, &groups, &seg, &mut p16, &g)
        .is_err());
    assert_eq!(st.steps(), 0);
    assert_eq!(p16, vec![bf16::from_f32(1.0); 2]);
    assert_eq!(st, OptimizerState::try_new(&any, 2).unwrap());
}

#[test]
fn huge_state_is_an_error_not_an_abort() {
    let cfg = AnyPrecisionAdamWConfig::default();
    let e = AnyPrecisionAdamWState::try_new(&cfg, usize::MAX / 4).unwrap_err();
    assert!(matches!(e, FsdpError::HostOutOfMemory { .. }), "{e:?}");
    let e = OptimizerState::try_new(&cfg.into(), usize::MAX / 4).unwrap_err();
    assert!(matches!(e, FsdpError::HostOutOfMemory { .. }), "{e:?}");
}

// ---------------------------------------------------------------------------------------------
// (d) Bytes per parameter.

#[test]
fn bytes_per_parameter() {
    let any = AnyPrecisionAdamWConfig::default();
    // Pure bf16: parameter 2 + exp_avg 2 + exp_avg_sq 2 + compensation 2.
    assert_eq!(any.state_bytes_per_element(), 6);
    let cfg = OptimizerConfig::from(any);
    assert_eq!(cfg.state_bytes_per_element(), 6);
    assert_eq!(cfg.sharded_bytes_per_param(DType::BF16), 8);
    // f32 AdamW on f32 parameters: 4 + 4 + 4.
    let adamw = OptimizerConfig::from(AdamWConfig::default());
    assert_eq!(adamw.state_bytes_per_element(), 8);
    assert_eq!(adamw.sharded_bytes_per_param(DType::F32), 12);
    // Variants.
    let no_kahan = AnyPrecisionAdamWConfig {
        use_kahan_summation: false,
        compensation_buffer_dtype: DType::F32,
        ..any
    };
    assert_eq!(no_kahan.state_bytes_per_element(), 4);
    let torchdistx_defaults = AnyPrecisionAdamWConfig {
        use_kahan_summation: false,
        momentum_dtype: DType::F32,
        ..any
    };
    assert_eq!(
        OptimizerConfig::from(torchdistx_defaults).sharded_bytes_per_param(DType::F32),
        10
    );
    assert_eq!(
        OptimizerConfig::from(SgdConfig::with_momentum(0.1, 0.9)).state_bytes_per_element(),
        4
    );
    assert_eq!(
        OptimizerConfig::from(SgdConfig::with_momentum(0.1, 0.0)).state_bytes_per_element(),
        0
    );
    // The allocated state agrees with the per-element figure.
    for c in [cfg, adamw, no_kahan.into(), torchdistx_defaults.into()] {
        let st = OptimizerState::try_new(&c, 1000).unwrap();
        assert_eq!(
            st.size_in_bytes(),
            1000 * c.state_bytes_per_element(),
            "{c:?}"
        );
    }
}
