//! Optimizers as functions over flat slices (parameter, gradient, state), so that they run
//! unchanged on a whole tensor, a flat parameter or one rank's shard of it: every update is
//! element-wise.
//!
//! - [`adamw_step`]: exactly `torch.optim.AdamW`'s single-tensor update (decoupled weight
//!   decay, bias correction), in the same order of operations.
//! - [`sgd_step`]: `torch.optim.SGD` with momentum, dampening, weight decay and Nesterov.
//! - [`AnyPrecisionAdamWState`]: torchdistx's `AnyPrecisionAdamW` (state in bf16 or another
//!   dtype, Kahan-compensated updates) for pure-bf16 parameter shards
//!   ([`OptimizerState::step_grouped_bf16`]) as well as `f32` ones.
//! - [`LrSchedule`]: nanoGPT's learning-rate schedule (linear warmup, cosine decay).
//! - [`ParamGroupOptions`], [`ShardGroups`] and [`OptimizerState::step_grouped`]: PyTorch's
//!   `param_groups` (per-group weight decay and learning rate) inside one flat shard, with
//!   nanoGPT's rule ([`decay_2d_only`]: weight decay on matrices only).

mod any_precision;
mod groups;
mod schedule;
mod sgd;

pub(crate) use any_precision::ParamElement;
pub use any_precision::{AnyPrecisionAdamWConfig, AnyPrecisionAdamWState, PrecisionVec};
pub(crate) use groups::{any_precision_grouped, f32_step_runs, step_configs};
pub use groups::{
    decay_2d_only, decay_2d_only_group, ParamGroupOptions, ShardGroups, DECAY_GROUP,
    NO_DECAY_GROUP, SKIP_GROUP,
};
pub use schedule::LrSchedule;
pub use sgd::{sgd_step, SgdConfig};

use crate::FsdpError;
use fsdp_device::DType;

/// `torch.optim.AdamW`'s hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment (`betas[0]`).
    pub beta1: f64,
    /// Decay of the second moment (`betas[1]`).
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay: each step multiplies the parameter by `1 − lr·weight_decay`.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamWConfig {
    /// Checks the ranges PyTorch checks: `lr ≥ 0`, `eps ≥ 0`, `0 ≤ beta < 1`,
    /// `weight_decay ≥ 0`, and that each is finite (PyTorch accepts `lr = inf`, which turns
    /// every parameter into NaN or infinity at the first step).
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] naming the first bad setting.
    pub fn validate(&self) -> Result<(), FsdpError> {
        non_negative("lr", self.lr)?;
        non_negative("eps", self.eps)?;
        non_negative("weight_decay", self.weight_decay)?;
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(FsdpError::InvalidHyperparameter {
                    name,
                    value: b,
                    reason: "must be in [0, 1)",
                });
            }
        }
        Ok(())
    }
}

/// `value` must be finite and `≥ 0` (NaN and infinities are errors).
fn non_negative(name: &'static str, value: f64) -> Result<(), FsdpError> {
    if !(value.is_finite() && value >= 0.0) {
        return Err(FsdpError::InvalidHyperparameter {
            name,
            value,
            reason: "must be a finite number ≥ 0",
        });
    }
    Ok(())
}

fn same_len(what: &'static str, expected: usize, actual: usize) -> Result<(), FsdpError> {
    if expected != actual {
        return Err(FsdpError::OptimizerLength {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

fn check_step(step: u64) -> Result<(), FsdpError> {
    if step == 0 {
        return Err(FsdpError::InvalidHyperparameter {
            name: "step",
            value: 0.0,
            reason: "steps are counted from 1",
        });
    }
    Ok(())
}

/// One AdamW step on `param` with `grad`, exactly as `torch.optim.AdamW` (single-tensor
/// implementation, `amsgrad=False`, `maximize=False`) at step number `step` (1 for the first
/// step; PyTorch increments its step counter before the update):
///
/// ```text
/// param      *= 1 − lr·weight_decay
/// exp_avg    = lerp(exp_avg, grad, 1 − beta1)
/// exp_avg_sq = beta2·exp_avg_sq + (1 − beta2)·grad²
/// denom      = √exp_avg_sq / √(1 − beta2^step) + eps
/// param     -= lr / (1 − beta1^step) · exp_avg / denom
/// ```
///
/// The scalar factors are computed in `f64` (Python floats) and applied in `f32`, as PyTorch
/// does for `f32` tensors. `exp_avg` and `exp_avg_sq` start at zero.
///
/// # Errors
/// [`FsdpError::OptimizerLength`] if the slices differ in length,
/// [`FsdpError::InvalidHyperparameter`] for a bad setting or `step == 0`. Nothing is changed
/// then.
pub fn adamw_step(
    cfg: &AdamWConfig,
    step: u64,
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
) -> Result<(), FsdpError> {
    cfg.validate()?;
    check_step(step)?;
    same_len("grad", param.len(), grad.len())?;
    same_len("exp_avg", param.len(), exp_avg.len())?;
    same_len("exp_avg_sq", param.len(), exp_avg_sq.len())?;

    let decay = (1.0 - cfg.lr * cfg.weight_decay) as f32;
    let w1 = 1.0 - cfg.beta1; // lerp weight
    let w1f = w1 as f32;
    let beta2 = cfg.beta2 as f32;
    let one_minus_beta2 = (1.0 - cfg.beta2) as f32;
    let steps = step as f64;
    let bias_correction1 = 1.0 - cfg.beta1.powf(steps);
    let bias_correction2 = 1.0 - cfg.beta2.powf(steps);
    let step_size = (cfg.lr / bias_correction1) as f32;
    let bc2_sqrt = bias_correction2.sqrt() as f32;
    let eps = cfg.eps as f32;

    for (((p, &g), m), v) in param
        .iter_mut()
        .zip(grad)
        .zip(exp_avg.iter_mut())
        .zip(exp_avg_sq.iter_mut())
    {
        *p *= decay;
        // torch.lerp: start + w·(end − start) for w < 0.5, else end − (end − start)·(1 − w).
        *m = if w1 < 0.5 {
            *m + w1f * (g - *m)
        } else {
            g - (g - *m) * (1.0 - w1f)
        };
        *v = *v * beta2 + one_minus_beta2 * (g * g);
        let denom = v.sqrt() / bc2_sqrt + eps;
        *p += -step_size * (*m / denom);
    }
    Ok(())
}

/// A flat slice's AdamW state (step count and moments) with [`AdamWState::step`] to update it.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamWState {
    /// Steps taken so far.
    pub step: u64,
    /// First moment.
    pub exp_avg: Vec<f32>,
    /// Second moment.
    pub exp_avg_sq: Vec<f32>,
}

impl AdamWState {
    /// Zero state for `len` elements.
    ///
    /// # Panics
    /// Aborts when the memory cannot be allocated, as `vec!` does; [`AdamWState::try_new`]
    /// returns an error instead.
    pub fn new(len: usize) -> Self {
        AdamWState {
            step: 0,
            exp_avg: vec![0.0; len],
            exp_avg_sq: vec![0.0; len],
        }
    }

    /// Zero state for `len` elements, allocated fallibly.
    ///
    /// # Errors
    /// [`FsdpError::HostOutOfMemory`] naming the moment and its bytes when the memory cannot be
    /// allocated.
    pub fn try_new(len: usize) -> Result<Self, FsdpError> {
        Ok(AdamWState {
            step: 0,
            exp_avg: crate::try_filled_vec(len, 0.0, "the AdamW state (exp_avg)")?,
            exp_avg_sq: crate::try_filled_vec(len, 0.0, "the AdamW state (exp_avg_sq)")?,
        })
    }

    /// Takes one [`adamw_step`] and counts it.
    ///
    /// # Errors
    /// As [`adamw_step`]; the state is unchanged then.
    pub fn step(
        &mut self,
        cfg: &AdamWConfig,
        param: &mut [f32],
        grad: &[f32],
    ) -> Result<(), FsdpError> {
        adamw_step(
            cfg,
            self.step + 1,
            param,
            grad,
            &mut self.exp_avg,
            &mut self.exp_avg_sq,
        )?;
        self.step += 1;
        Ok(())
    }
}

/// The optimizer a sharded runtime applies to each shard: `torch.optim.AdamW`,
/// `torch.optim.SGD` or torchdistx's `AnyPrecisionAdamW`. All are element-wise, so a shard
/// update equals the update of the whole tensor restricted to the shard.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum OptimizerConfig {
    /// AdamW (decoupled weight decay, bias correction).
    AdamW(AdamWConfig),
    /// SGD (momentum, dampening, L2 weight decay, Nesterov).
    Sgd(SgdConfig),
    /// torchdistx's AnyPrecisionAdamW: state in configurable dtypes, optional Kahan summation;
    /// for bf16 parameter shards ([`OptimizerState::step_grouped_bf16`]) or `f32` ones.
    AnyPrecisionAdamW(AnyPrecisionAdamWConfig),
}

impl From<AnyPrecisionAdamWConfig> for OptimizerConfig {
    fn from(cfg: AnyPrecisionAdamWConfig) -> Self {
        OptimizerConfig::AnyPrecisionAdamW(cfg)
    }
}

impl From<AdamWConfig> for OptimizerConfig {
    fn from(cfg: AdamWConfig) -> Self {
        OptimizerConfig::AdamW(cfg)
    }
}

impl From<SgdConfig> for OptimizerConfig {
    fn from(cfg: SgdConfig) -> Self {
        OptimizerConfig::Sgd(cfg)
    }
}

impl OptimizerConfig {
    /// The configured (base) learning rate: what [`LrSchedule::lr_at`] scales.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerConfig::AdamW(c) => c.lr,
            OptimizerConfig::Sgd(c) => c.lr,
            OptimizerConfig::AnyPrecisionAdamW(c) => c.lr,
        }
    }

    /// Checks the hyperparameters.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] naming the first bad setting.
    pub fn validate(&self) -> Result<(), FsdpError> {
        match self {
            OptimizerConfig::AdamW(c) => c.validate(),
            OptimizerConfig::Sgd(c) => c.validate(),
            OptimizerConfig::AnyPrecisionAdamW(c) => c.validate(),
        }
    }

    /// Bytes of optimizer state per shard element (the parameter not included): AdamW 8
    /// (`exp_avg`, `exp_avg_sq` in `f32`), SGD 4 with momentum and 0 without,
    /// AnyPrecisionAdamW the sizes of its state dtypes (6 for the all-bf16 default with Kahan
    /// summation, see [`AnyPrecisionAdamWConfig::state_bytes_per_element`]).
    ///
    /// ```
    /// use fsdp::optim::{AdamWConfig, AnyPrecisionAdamWConfig, OptimizerConfig};
    ///
    /// assert_eq!(OptimizerConfig::from(AdamWConfig::default()).state_bytes_per_element(), 8);
    /// let bf16 = OptimizerConfig::from(AnyPrecisionAdamWConfig::default());
    /// assert_eq!(bf16.state_bytes_per_element(), 6);
    /// ```
    pub fn state_bytes_per_element(&self) -> usize {
        match self {
            OptimizerConfig::AdamW(_) => 2 * std::mem::size_of::<f32>(),
            OptimizerConfig::Sgd(c) if c.momentum == 0.0 => 0,
            OptimizerConfig::Sgd(_) => std::mem::size_of::<f32>(),
            OptimizerConfig::AnyPrecisionAdamW(c) => c.state_bytes_per_element(),
        }
    }

    /// Bytes per shard element of the sharded parameter (of `param_dtype`) and its optimizer
    /// state together, what the plan counts per sharded parameter element: 12 for AdamW on
    /// `f32` parameters, 8 for the default AnyPrecisionAdamW on bf16 parameters (2 for the
    /// parameter, 2 each for `exp_avg`, `exp_avg_sq` and the Kahan compensation).
    ///
    /// ```
    /// use fsdp::optim::{AdamWConfig, AnyPrecisionAdamWConfig, OptimizerConfig};
    /// use fsdp_device::DType;
    ///
    /// let adamw = OptimizerConfig::from(AdamWConfig::default());
    /// assert_eq!(adamw.sharded_bytes_per_param(DType::F32), 12);
    /// let pure_bf16 = OptimizerConfig::from(AnyPrecisionAdamWConfig::default());
    /// assert_eq!(pure_bf16.sharded_bytes_per_param(DType::BF16), 8);
    /// ```
    pub fn sharded_bytes_per_param(&self, param_dtype: DType) -> usize {
        param_dtype.size_in_bytes() + self.state_bytes_per_element()
    }
}

/// The state of one flat slice under an [`OptimizerConfig`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum OptimizerState {
    /// AdamW's step count and moments.
    AdamW(AdamWState),
    /// SGD's step count and momentum buffer (empty without momentum).
    Sgd {
        /// Steps taken so far.
        step: u64,
        /// The momentum buffer.
        momentum_buffer: Vec<f32>,
    },
    /// AnyPrecisionAdamW's step count, moments and compensation, in their configured dtypes.
    AnyPrecisionAdamW(AnyPrecisionAdamWState),
}

impl OptimizerState {
    /// Zero state for `len` elements, allocated fallibly (what the engine uses).
    ///
    /// # Errors
    /// [`FsdpError::HostOutOfMemory`] naming the buffer and its bytes when the memory cannot be
    /// allocated.
    pub fn try_new(cfg: &OptimizerConfig, len: usize) -> Result<Self, FsdpError> {
        Ok(match cfg {
            OptimizerConfig::AdamW(_) => OptimizerState::AdamW(AdamWState::try_new(len)?),
            OptimizerConfig::Sgd(c) => OptimizerState::Sgd {
                step: 0,
                momentum_buffer: if c.momentum == 0.0 {
                    Vec::new()
                } else {
                    crate::try_filled_vec(len, 0.0, "the SGD momentum buffer")?
                },
            },
            OptimizerConfig::AnyPrecisionAdamW(c) => {
                OptimizerState::AnyPrecisionAdamW(AnyPrecisionAdamWState::try_new(c, len)?)
            }
        })
    }

    /// Zero state for `len` elements.
    ///
    /// # Panics
    /// Aborts when the memory cannot be allocated, as `vec!` does; [`OptimizerState::try_new`]
    /// returns an error instead. For AnyPrecisionAdamW it panics when the memory cannot be
    /// allocated or the config does not validate (an `f64` state dtype).
    pub fn new(cfg: &OptimizerConfig, len: usize) -> Self {
        match cfg {
            OptimizerConfig::AdamW(_) => OptimizerState::AdamW(AdamWState::new(len)),
            OptimizerConfig::Sgd(c) => OptimizerState::Sgd {
                step: 0,
                momentum_buffer: if c.momentum == 0.0 {
                    Vec::new()
                } else {
                    vec![0.0; len]
                },
            },
            OptimizerConfig::AnyPrecisionAdamW(c) => OptimizerState::AnyPrecisionAdamW(
                AnyPrecisionAdamWState::try_new(c, len).unwrap_or_else(|e| panic!("{e}")),
            ),
        }
    }

    /// Steps taken so far. This is also the 0-based index of the next step, the `iter` that
    /// [`LrSchedule::lr_at`] takes for it.
    pub fn steps(&self) -> u64 {
        match self {
            OptimizerState::AdamW(s) => s.step,
            OptimizerState::Sgd { step, .. } => *step,
            OptimizerState::AnyPrecisionAdamW(s) => s.step,
        }
    }

    /// Set the count of steps taken (a state whose buffers are kept elsewhere, stepped there).
    pub(crate) fn set_steps(&mut self, steps: u64) {
        match self {
            OptimizerState::AdamW(s) => s.step = steps,
            OptimizerState::Sgd { step, .. } => *step = steps,
            OptimizerState::AnyPrecisionAdamW(s) => s.step = steps,
        }
    }

    /// Bytes of the state's buffers (what the sharded optimizer state occupies in host memory).
    ///
    /// ```
    /// use fsdp::optim::{AdamWConfig, AnyPrecisionAdamWConfig, OptimizerState};
    ///
    /// let adamw = OptimizerState::try_new(&AdamWConfig::default().into(), 10)?;
    /// assert_eq!(adamw.size_in_bytes(), 80);
    /// let any = OptimizerState::try_new(&AnyPrecisionAdamWConfig::default().into(), 10)?;
    /// assert_eq!(any.size_in_bytes(), 60);
    /// # Ok::<(), fsdp::FsdpError>(())
    /// ```
    pub fn size_in_bytes(&self) -> usize {
        match self {
            OptimizerState::AdamW(s) => {
                (s.exp_avg.len() + s.exp_avg_sq.len()) * std::mem::size_of::<f32>()
            }
            OptimizerState::Sgd {
                momentum_buffer, ..
            } => std::mem::size_of_val(momentum_buffer.as_slice()),
            OptimizerState::AnyPrecisionAdamW(s) => s.size_in_bytes(),
        }
    }

    /// Takes one step on `f32` parameters and counts it. AnyPrecisionAdamW then keeps its state
    /// in its dtypes and rounds the parameter to `f32` (torchdistx on `f32` parameters); for
    /// bf16 parameters use [`AnyPrecisionAdamWState::step`] or
    /// [`step_grouped_bf16`](Self::step_grouped_bf16).
    ///
    /// # Errors
    /// As [`adamw_step`] / [`sgd_step`] / [`AnyPrecisionAdamWState::step`], or
    /// [`FsdpError::InvalidHyperparameter`] when the state was made for another optimizer; the
    /// state is unchanged then.
    pub fn step(
        &mut self,
        cfg: &OptimizerConfig,
        param: &mut [f32],
        grad: &[f32],
    ) -> Result<(), FsdpError> {
        match (self, cfg) {
            (OptimizerState::AdamW(state), OptimizerConfig::AdamW(c)) => state.step(c, param, grad),
            (
                OptimizerState::Sgd {
                    step,
                    momentum_buffer,
                },
                OptimizerConfig::Sgd(c),
            ) => {
                sgd_step(c, *step + 1, param, grad, momentum_buffer)?;
                *step += 1;
                Ok(())
            }
            (OptimizerState::AnyPrecisionAdamW(state), OptimizerConfig::AnyPrecisionAdamW(c)) => {
                state.step_slice(c, param, grad)
            }
            _ => Err(state_mismatch()),
        }
    }
}

/// The error for an [`OptimizerState`] used with the other optimizer's config.
fn state_mismatch() -> FsdpError {
    FsdpError::InvalidHyperparameter {
        name: "optimizer",
        value: f64::NAN,
        reason: "the state was created for another optimizer",
    }
}

/// Checks a `max_norm` for gradient clipping: finite and non-negative.
///
/// # Errors
/// [`FsdpError::InvalidHyperparameter`] naming `max_norm`.
pub fn check_max_norm(max_norm: f64) -> Result<(), crate::FsdpError> {
    if max_norm.is_finite() && max_norm >= 0.0 {
        return Ok(());
    }
    Err(crate::FsdpError::InvalidHyperparameter {
        name: "max_norm",
        value: max_norm,
        reason: "must be finite and non-negative",
    })
}

/// PyTorch's `clip_grad_norm_` rule: the factor `max_norm / (total_norm + 1e-6)` to scale every
/// gradient by when it is below 1 and the norm is finite; `None` leaves the gradients as they
/// are.
///
/// ```
/// use fsdp::optim::clip_coefficient;
/// assert_eq!(clip_coefficient(1.0, 0.5), None);
/// assert_eq!(clip_coefficient(1.0, 4.0), Some((1.0 / (4.0 + 1e-6)) as f32));
/// assert_eq!(clip_coefficient(1.0, f64::INFINITY), None);
/// ```
pub fn clip_coefficient(max_norm: f64, total_norm: f64) -> Option<f32> {
    let coef = max_norm / (total_norm + 1e-6);
    (total_norm.is_finite() && coef < 1.0).then_some(coef as f32)
}
