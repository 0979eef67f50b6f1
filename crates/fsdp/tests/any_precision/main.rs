//! torchdistx's AnyPrecisionAdamW on flat shards: bitwise against a naive op-by-op reference
//! and against PyTorch's own CPU results, Kahan summation against stalls of tiny bf16 updates,
//! parameter groups, validation, and the bytes per parameter.
//!
//! This file holds the naive reference and the deterministic data the tests share; the tests
//! are in [`bitwise`], [`groups`], [`validation`] and [`bytes`] (Kahan summation:
//! `tests/any_precision_kahan.rs`).

use std::path::Path;

use fsdp::optim::{
    AdamWConfig, AnyPrecisionAdamWConfig, AnyPrecisionAdamWState, OptimizerConfig, OptimizerState,
    ParamGroupOptions, PrecisionVec, SgdConfig, ShardGroups, SKIP_GROUP,
};
use fsdp::FsdpError;
use fsdp_device::half::{bf16, f16};
use fsdp_device::DType;

mod bitwise;
mod bytes;
mod groups;
mod validation;

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
