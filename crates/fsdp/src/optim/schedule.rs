//! Learning-rate schedules: nanoGPT's `get_lr` (linear warmup, then cosine decay to a floor).

use crate::FsdpError;

/// The learning rate as a function of the iteration, applied to a base learning rate (the
/// optimizer config's `lr`, see [`OptimizerConfig::lr`](super::OptimizerConfig::lr)).
///
/// Iterations are counted from 0, the first optimizer step, as nanoGPT's `iter_num`: step `n`
/// (1-based, as [`adamw_step`](super::adamw_step) counts) uses `lr_at(base_lr, n - 1)`, which is
/// [`OptimizerState::steps`](super::OptimizerState::steps) before the step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum LrSchedule {
    /// The base learning rate at every iteration (nanoGPT's `decay_lr = False`).
    #[default]
    Constant,
    /// nanoGPT's `get_lr`: linear warmup over `warmup_iters` iterations, cosine decay from the
    /// base learning rate to `min_lr` until `lr_decay_iters`, then `min_lr`.
    Cosine {
        /// Iterations of linear warmup (iterations `0..warmup_iters`).
        warmup_iters: u64,
        /// The iteration at which the cosine reaches `min_lr`; later iterations use `min_lr`.
        lr_decay_iters: u64,
        /// The floor the learning rate decays to.
        min_lr: f64,
    },
}

impl LrSchedule {
    /// The learning rate at iteration `iter` (0 for the first optimizer step) for the base
    /// learning rate `base_lr`. For [`LrSchedule::Cosine`] this is exactly nanoGPT's
    /// `get_lr(it)`, in the same order of `f64` operations:
    ///
    /// ```text
    /// if it < warmup_iters:  return learning_rate * (it + 1) / (warmup_iters + 1)
    /// if it > lr_decay_iters: return min_lr
    /// decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    /// coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    /// return min_lr + coeff * (learning_rate - min_lr)
    /// ```
    ///
    /// Where nanoGPT would divide by zero (`warmup_iters == lr_decay_iters`, at
    /// `it == lr_decay_iters`) this returns `min_lr`. It never panics, even for a schedule that
    /// [`validate`](Self::validate) rejects (`warmup_iters > lr_decay_iters` gives the warmup
    /// ramp, then `min_lr`).
    ///
    /// ```
    /// use fsdp::optim::LrSchedule;
    ///
    /// let s = LrSchedule::Cosine { warmup_iters: 10, lr_decay_iters: 110, min_lr: 6e-5 };
    /// assert_eq!(s.lr_at(6e-4, 0), 6e-4 * 1.0 / 11.0);
    /// assert_eq!(s.lr_at(6e-4, 10), 6e-4);
    /// assert_eq!(s.lr_at(6e-4, 111), 6e-5);
    /// assert_eq!(LrSchedule::Constant.lr_at(6e-4, 5), 6e-4);
    /// ```
    pub fn lr_at(&self, base_lr: f64, iter: u64) -> f64 {
        match *self {
            LrSchedule::Constant => base_lr,
            LrSchedule::Cosine {
                warmup_iters,
                lr_decay_iters,
                min_lr,
            } => {
                if iter < warmup_iters {
                    // Python: (learning_rate * (it + 1)) / (warmup_iters + 1), the exact integers
                    // rounded to float (`iter + 1` cannot overflow: iter < warmup_iters).
                    return base_lr * (iter + 1) as f64 / (u128::from(warmup_iters) + 1) as f64;
                }
                if iter > lr_decay_iters || lr_decay_iters == warmup_iters {
                    return min_lr;
                }
                // warmup_iters <= iter <= lr_decay_iters and warmup_iters < lr_decay_iters.
                let decay_ratio =
                    (iter - warmup_iters) as f64 / (lr_decay_iters - warmup_iters) as f64;
                let coeff = 0.5 * (1.0 + (std::f64::consts::PI * decay_ratio).cos());
                min_lr + coeff * (base_lr - min_lr)
            }
        }
    }

    /// Checks the schedule: `warmup_iters ≤ lr_decay_iters` and `min_lr` finite and `≥ 0`.
    /// `warmup_iters == lr_decay_iters` is allowed (warmup, then `min_lr`).
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] naming the bad setting.
    pub fn validate(&self) -> Result<(), FsdpError> {
        match *self {
            LrSchedule::Constant => Ok(()),
            LrSchedule::Cosine {
                warmup_iters,
                lr_decay_iters,
                min_lr,
            } => {
                if warmup_iters > lr_decay_iters {
                    return Err(FsdpError::InvalidHyperparameter {
                        name: "warmup_iters",
                        value: warmup_iters as f64,
                        reason: "must be ≤ lr_decay_iters",
                    });
                }
                if !min_lr.is_finite() || min_lr < 0.0 {
                    return Err(FsdpError::InvalidHyperparameter {
                        name: "min_lr",
                        value: min_lr,
                        reason: "must be a finite number ≥ 0",
                    });
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LrSchedule;

    #[test]
    fn cosine_degenerate_decay_returns_min_lr() {
        let s = LrSchedule::Cosine {
            warmup_iters: 5,
            lr_decay_iters: 5,
            min_lr: 1e-5,
        };
        s.validate().unwrap();
        assert_eq!(s.lr_at(1e-3, 4), 1e-3 * 5.0 / 6.0);
        assert_eq!(s.lr_at(1e-3, 5), 1e-5);
        assert_eq!(s.lr_at(1e-3, 6), 1e-5);
        // No warmup, no decay: min_lr from the start.
        let s = LrSchedule::Cosine {
            warmup_iters: 0,
            lr_decay_iters: 0,
            min_lr: 0.0,
        };
        assert_eq!(s.lr_at(1e-3, 0), 0.0);
    }
}
