//! AnyPrecisionAdamW's element-wise update: the parameter element types it rounds to, the
//! step's `f32` scalars and the per-element operations, each rounded as torchdistx's (the
//! listing is in [`AnyPrecisionAdamWState`](super::AnyPrecisionAdamWState)'s docs).

use fsdp_device::half::{bf16, f16};
use fsdp_device::Element;

use super::AnyPrecisionAdamWConfig;

/// Parameter element types the update rounds to: `bf16` (pure-bf16 training), `f16` and `f32`
/// (not `f64`, which would need `f64` arithmetic).
pub(crate) trait ParamElement: Element {
    /// The shard as `f32` parameters, which AdamW and SGD update: `Some` for `f32` only.
    fn as_f32_mut(param: &mut [Self]) -> Option<&mut [f32]> {
        let _ = param;
        None
    }
}
impl ParamElement for bf16 {}
impl ParamElement for f16 {}
impl ParamElement for f32 {
    fn as_f32_mut(param: &mut [f32]) -> Option<&mut [f32]> {
        Some(param)
    }
}

/// `x` rounded to `T` (nearest even) and widened back to `f32`: one PyTorch operation writing a
/// `T` tensor. The identity for `f32`.
#[inline(always)]
fn round<T: Element>(x: f32) -> f32 {
    T::from_f32(x).to_f32()
}

/// The step's scalars, in `f32` as torchdistx computes them (its step count is a float32
/// tensor; the hyperparameters are Python floats read into `f32` by the kernels).
#[derive(Debug, Clone, Copy)]
pub(super) struct Scalars {
    /// `f32(1 − lr·weight_decay)` (computed in `f64`, as Python does), `None` without decay.
    pub(super) decay: Option<f32>,
    beta1: f32,
    /// `alpha = 1 − beta1` of `exp_avg.add_`.
    pub(super) one_minus_beta1: f32,
    pub(super) beta2: f32,
    /// `value = 1 − beta2` of `exp_avg_sq.addcmul_`.
    pub(super) one_minus_beta2: f32,
    pub(super) denom_correction: f32,
    pub(super) eps: f32,
    /// `value = −step_size` of `addcdiv_`.
    pub(super) neg_step_size: f32,
}

impl Scalars {
    pub(super) fn new(cfg: &AnyPrecisionAdamWConfig, step: u64) -> Self {
        // torch.tensor(0.0) += 1 per step: a float32 count.
        let step = step as f32;
        // `beta ** step` is torch.pow(Scalar, Tensor): the base read into f32, std::pow(float,
        // float); `1 - t` is rsub in f32.
        let bias_correction1 = 1.0f32 - (cfg.beta1 as f32).powf(step);
        // `lr / t` is Tensor.__rtruediv__: `t.reciprocal() * lr`, two f32 roundings.
        let step_size = (1.0f32 / bias_correction1) * cfg.lr as f32;
        // `t ** 0.5` is sqrt.
        let denom_correction = (1.0f32 - (cfg.beta2 as f32).powf(step)).sqrt();
        Scalars {
            // torchdistx: `if weight_decay: p.data.mul_(1 - lr * weight_decay)`.
            decay: (cfg.weight_decay != 0.0).then_some((1.0 - cfg.lr * cfg.weight_decay) as f32),
            beta1: cfg.beta1 as f32,
            one_minus_beta1: (1.0 - cfg.beta1) as f32,
            beta2: cfg.beta2 as f32,
            one_minus_beta2: (1.0 - cfg.beta2) as f32,
            denom_correction,
            eps: cfg.eps as f32,
            // `-step_size` negates the f32 tensor (exact); as a Scalar it is read back into f32.
            neg_step_size: -step_size,
        }
    }
}

/// The element-wise update (see the module docs): `P`, `M`, `V`, `C` are the storage types of
/// parameter, momentum, variance and compensation; every line is one PyTorch operation,
/// computed in `f32` and rounded once to the type it writes.
pub(super) fn update<P: Element, M: Element, V: Element, C: Element>(
    s: &Scalars,
    param: &mut [P],
    grad: &[f32],
    exp_avg: &mut [M],
    exp_avg_sq: &mut [V],
    compensation: Option<&mut [C]>,
) {
    // `add_(eps)` converts its scalar to the tensor's dtype.
    let eps = round::<V>(s.eps);
    // Everything up to the denominator, for one element: returns (p, m, d) with the new
    // parameter after weight decay, the new momentum and the denominator, and stores m and v.
    let moments = |p: &mut P, g: f32, m: &mut M, v: &mut V| -> (f32, f32, f32) {
        let mut pf = p.to_f32();
        if let Some(decay) = s.decay {
            // p.mul_(1 - lr*wd)
            pf = round::<P>(pf * decay);
        }
        // exp_avg.mul_(beta1).add_(grad, alpha=1-beta1)
        let mut mf = round::<M>(m.to_f32() * s.beta1);
        mf = round::<M>(s.one_minus_beta1.mul_add(g, mf));
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2)
        let mut vf = round::<V>(v.to_f32() * s.beta2);
        vf = round::<V>((s.one_minus_beta2 * g).mul_add(g, vf));
        *m = M::from_f32(mf);
        *v = V::from_f32(vf);
        // (exp_avg_sq.sqrt() / denom_correction).add_(eps, alpha=1)
        let mut d = round::<V>(vf.sqrt());
        d = round::<V>(d / s.denom_correction);
        d = round::<V>(d + eps);
        (pf, mf, d)
    };
    match compensation {
        Some(comp) => {
            for ((((p, &g), m), v), c) in param
                .iter_mut()
                .zip(grad)
                .zip(exp_avg.iter_mut())
                .zip(exp_avg_sq.iter_mut())
                .zip(comp.iter_mut())
            {
                let (pf, mf, d) = moments(p, g, m, v);
                // compensation.addcdiv_(exp_avg, centered_variance, value=-step_size)
                let cf = round::<C>(c.to_f32() + s.neg_step_size * mf / d);
                let temp = pf; // temp_buffer = p.detach().clone()
                let pn = round::<P>(pf + cf); // p.data.add_(compensation)
                let t = round::<P>(temp - pn); // temp_buffer.sub_(p.data)
                *c = C::from_f32(cf + t); // compensation.add_(temp_buffer)
                *p = P::from_f32(pn);
            }
        }
        None => {
            for (((p, &g), m), v) in param
                .iter_mut()
                .zip(grad)
                .zip(exp_avg.iter_mut())
                .zip(exp_avg_sq.iter_mut())
            {
                let (pf, mf, d) = moments(p, g, m, v);
                // p.data.addcdiv_(exp_avg, centered_variance, value=-step_size)
                *p = P::from_f32(pf + s.neg_step_size * mf / d);
            }
        }
    }
}
