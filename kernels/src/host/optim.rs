//! AdamW and SGD on flat f32 shards: the scalars each step passes to the kernels, and the
//! twins. The formulas and their order are `torch.optim.AdamW`/`SGD`'s as
//! `fsdp::optim::{adamw_step, sgd_step}` compute them (scalars in `f64`, applied in `f32`).

use super::{same_len, KernelFloat};
use crate::KernelError;

/// `torch.optim.AdamW`'s hyperparameters (`amsgrad=False`, `maximize=False`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// `betas[0]`.
    pub beta1: f64,
    /// `betas[1]`.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

/// The per-step scalars of the AdamW kernels, computed once on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    /// `1 − lr·weight_decay`.
    pub decay: f32,
    /// torch.lerp's weight `1 − beta1`.
    pub w1: f32,
    /// `1 − w1` (in f32).
    pub one_minus_w1: f32,
    /// Whether `w1 < 0.5` (torch.lerp's first branch).
    pub lerp_small: bool,
    /// `beta2`.
    pub beta2: f32,
    /// `1 − beta2`.
    pub one_minus_beta2: f32,
    /// `−lr / (1 − beta1^step)`.
    pub neg_step_size: f32,
    /// `√(1 − beta2^step)`.
    pub bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
}

impl AdamWScalars {
    /// The scalars of step number `step` (1 for the first).
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] for `step == 0` or a non-finite setting.
    pub fn new(cfg: &AdamW, step: u64) -> Result<AdamWScalars, KernelError> {
        let all = [cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay];
        if step == 0 || all.iter().any(|v| !v.is_finite()) {
            return Err(KernelError::InvalidArgument {
                kernel: "adamw",
                reason: format!("step {step} (counted from 1) with {cfg:?}"),
            });
        }
        let w1 = 1.0 - cfg.beta1;
        let w1f = w1 as f32;
        let steps = step as f64;
        let bias_correction1 = 1.0 - cfg.beta1.powf(steps);
        let bias_correction2 = 1.0 - cfg.beta2.powf(steps);
        Ok(AdamWScalars {
            decay: (1.0 - cfg.lr * cfg.weight_decay) as f32,
            w1: w1f,
            one_minus_w1: 1.0 - w1f,
            lerp_small: w1 < 0.5,
            beta2: cfg.beta2 as f32,
            one_minus_beta2: (1.0 - cfg.beta2) as f32,
            neg_step_size: -((cfg.lr / bias_correction1) as f32),
            bc2_sqrt: bias_correction2.sqrt() as f32,
            eps: cfg.eps as f32,
        })
    }
}

/// Twin of `adamw_f32` (`S = f32`) and `adamw_bf16_state` (`S = bf16`: the moments are read
/// as f32, updated in f32 and stored rounded to bf16).
///
/// # Errors
/// [`KernelError::Length`] if the slices differ in length.
pub fn adamw<S: MomentFloat>(
    s: &AdamWScalars,
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [S],
    exp_avg_sq: &mut [S],
) -> Result<(), KernelError> {
    let n = param.len();
    same_len("adamw", "grad", n, grad.len())?;
    same_len("adamw", "exp_avg", n, exp_avg.len())?;
    same_len("adamw", "exp_avg_sq", n, exp_avg_sq.len())?;
    for (((p, &g), m), v) in param
        .iter_mut()
        .zip(grad)
        .zip(exp_avg.iter_mut())
        .zip(exp_avg_sq.iter_mut())
    {
        let pi = *p * s.decay;
        let (mut mi, mut vi) = (m.load(), v.load());
        let diff = g - mi;
        mi = if s.lerp_small {
            mi + s.w1 * diff
        } else {
            g - diff * s.one_minus_w1
        };
        vi = vi * s.beta2 + s.one_minus_beta2 * (g * g);
        let denom = vi.sqrt() / s.bc2_sqrt + s.eps;
        *p = pi + s.neg_step_size * (mi / denom);
        *m = S::store(mi);
        *v = S::store(vi);
    }
    Ok(())
}

/// `torch.optim.SGD`'s hyperparameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum (0: no buffer).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// The per-step scalars of `sgd_f32`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdScalars {
    /// `−lr`.
    pub neg_lr: f32,
    /// Weight decay.
    pub wd: f32,
    /// Momentum.
    pub momentum: f32,
    /// `1 − dampening`.
    pub damp: f32,
    /// The kernel's flags: 1 momentum, 2 first step, 4 Nesterov, 8 weight decay.
    pub flags: u32,
}

impl SgdScalars {
    /// The scalars of step number `step` (1 for the first).
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] for `step == 0` or a non-finite setting.
    pub fn new(cfg: &Sgd, step: u64) -> Result<SgdScalars, KernelError> {
        let all = [cfg.lr, cfg.momentum, cfg.dampening, cfg.weight_decay];
        if step == 0 || all.iter().any(|v| !v.is_finite()) {
            return Err(KernelError::InvalidArgument {
                kernel: "sgd",
                reason: format!("step {step} (counted from 1) with {cfg:?}"),
            });
        }
        let wd = cfg.weight_decay as f32;
        let mut flags = 0;
        if cfg.momentum != 0.0 {
            flags |= 1;
            if step == 1 {
                flags |= 2;
            }
            if cfg.nesterov {
                flags |= 4;
            }
        }
        if wd != 0.0 {
            flags |= 8;
        }
        Ok(SgdScalars {
            neg_lr: -(cfg.lr as f32),
            wd,
            momentum: cfg.momentum as f32,
            damp: (1.0 - cfg.dampening) as f32,
            flags,
        })
    }

    /// Whether the step uses the momentum buffer.
    pub fn uses_buffer(&self) -> bool {
        self.flags & 1 != 0
    }
}

/// Twin of `sgd_f32`. `momentum_buffer` may be empty when the momentum is 0.
///
/// # Errors
/// [`KernelError::Length`] if the slices differ in length.
pub fn sgd(
    s: &SgdScalars,
    param: &mut [f32],
    grad: &[f32],
    momentum_buffer: &mut [f32],
) -> Result<(), KernelError> {
    same_len("sgd", "grad", param.len(), grad.len())?;
    if s.uses_buffer() {
        same_len("sgd", "momentum_buffer", param.len(), momentum_buffer.len())?;
    }
    for (i, (p, &g)) in param.iter_mut().zip(grad).enumerate() {
        let mut d = if s.flags & 8 != 0 { g + s.wd * *p } else { g };
        if s.uses_buffer() {
            let b = if s.flags & 2 != 0 {
                d
            } else {
                momentum_buffer[i] * s.momentum + s.damp * d
            };
            momentum_buffer[i] = b;
            d = if s.flags & 4 != 0 {
                d + s.momentum * b
            } else {
                b
            };
        }
        *p += s.neg_lr * d;
    }
    Ok(())
}

/// The moment types of the AdamW kernels: f32, or bf16 for the low-memory state.
pub trait MomentFloat: KernelFloat<C = f32> {
    /// The kernel.
    const ADAMW_KERNEL: &'static str;
}
impl MomentFloat for f32 {
    const ADAMW_KERNEL: &'static str = "adamw_f32";
}
impl MomentFloat for half::bf16 {
    const ADAMW_KERNEL: &'static str = "adamw_bf16_state";
}
