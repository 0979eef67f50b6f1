//! `torch.optim.SGD` over flat slices: [`SgdConfig`] and [`sgd_step`] (momentum, dampening,
//! weight decay, Nesterov), exactly PyTorch's single-tensor update.

use super::{check_step, non_negative, same_len};
use crate::FsdpError;

/// `torch.optim.SGD`'s hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: plain SGD, no buffer used).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
}

impl SgdConfig {
    /// SGD with momentum and nothing else (dampening 0, no weight decay, not Nesterov).
    pub fn with_momentum(lr: f64, momentum: f64) -> Self {
        SgdConfig {
            lr,
            momentum,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// Checks the ranges PyTorch checks (`lr`, `momentum`, `weight_decay` `≥ 0`; Nesterov
    /// needs momentum and no dampening), and that every setting is finite.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] naming the first bad setting.
    pub fn validate(&self) -> Result<(), FsdpError> {
        non_negative("lr", self.lr)?;
        non_negative("momentum", self.momentum)?;
        non_negative("weight_decay", self.weight_decay)?;
        if !self.dampening.is_finite() {
            return Err(FsdpError::InvalidHyperparameter {
                name: "dampening",
                value: self.dampening,
                reason: "must be a finite number",
            });
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(FsdpError::InvalidHyperparameter {
                name: "momentum",
                value: self.momentum,
                reason: "Nesterov momentum needs momentum > 0 and dampening 0",
            });
        }
        Ok(())
    }
}

/// One SGD step, exactly as `torch.optim.SGD` at step number `step` (1 for the first):
///
/// ```text
/// d   = grad + weight_decay·param
/// buf = d                                   (first step)
/// buf = momentum·buf + (1 − dampening)·d     (later steps)
/// d   = d + momentum·buf if nesterov, else buf
/// param -= lr·d
/// ```
///
/// With `momentum == 0` the buffer is not used (it may be empty).
///
/// # Errors
/// [`FsdpError::OptimizerLength`] if the slices differ in length,
/// [`FsdpError::InvalidHyperparameter`] for a bad setting or `step == 0`. Nothing is changed
/// then.
pub fn sgd_step(
    cfg: &SgdConfig,
    step: u64,
    param: &mut [f32],
    grad: &[f32],
    momentum_buffer: &mut [f32],
) -> Result<(), FsdpError> {
    cfg.validate()?;
    check_step(step)?;
    same_len("grad", param.len(), grad.len())?;
    let lr = cfg.lr as f32;
    let wd = cfg.weight_decay as f32;
    if cfg.momentum == 0.0 {
        for (p, &g) in param.iter_mut().zip(grad) {
            let d = if wd != 0.0 { g + wd * *p } else { g };
            *p += -lr * d;
        }
        return Ok(());
    }
    same_len("momentum_buffer", param.len(), momentum_buffer.len())?;
    let mom = cfg.momentum as f32;
    let damp = (1.0 - cfg.dampening) as f32;
    for ((p, &g), b) in param.iter_mut().zip(grad).zip(momentum_buffer.iter_mut()) {
        let d = if wd != 0.0 { g + wd * *p } else { g };
        *b = if step == 1 { d } else { *b * mom + damp * d };
        let upd = if cfg.nesterov { d + mom * *b } else { *b };
        *p += -lr * upd;
    }
    Ok(())
}
