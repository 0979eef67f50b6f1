//! torchdistx's `AnyPrecisionAdamW` over flat shards: AdamW whose parameters and optimizer
//! state may be stored in low precision (pure-bf16 training), with an optional Kahan
//! compensation buffer that keeps the small updates a bf16 parameter would otherwise lose.
//!
//! [`AnyPrecisionAdamWState`] documents the operations and where each is rounded.
//!
//! This file holds the configuration and the state; the element-wise update is in [`kernel`]
//! (`any_precision_kernel.rs`), the state buffers' type in [`precision_vec`]
//! (`any_precision_vec.rs`).

#[path = "any_precision_kernel.rs"]
mod kernel;
#[path = "any_precision_vec.rs"]
mod precision_vec;

use std::ops::Range;

use fsdp_device::half::bf16;
use fsdp_device::DType;

use super::{check_step, same_len};
use crate::FsdpError;

pub(crate) use kernel::ParamElement;
use kernel::{update, Scalars};
pub use precision_vec::PrecisionVec;

/// `AnyPrecisionAdamW`'s hyperparameters (torchdistx), including the dtypes of its state.
///
/// # Defaults
///
/// [`AnyPrecisionAdamWConfig::default`] is torchdistx's recipe for *pure-bf16* training (its
/// docstring's "To train in pure BF16"): both moments and the compensation buffer in bf16 and
/// Kahan summation on. torchdistx's own constructor defaults differ (momentum in f32, Kahan
/// off); set the fields to get them.
///
/// # Example
///
/// ```
/// use fsdp::optim::AnyPrecisionAdamWConfig;
/// use fsdp_device::DType;
///
/// let cfg = AnyPrecisionAdamWConfig { lr: 3e-4, weight_decay: 0.1, ..Default::default() };
/// cfg.validate()?;
/// assert!(cfg.use_kahan_summation);
/// assert_eq!(cfg.momentum_dtype, DType::BF16);
/// // Two bf16 moments and a bf16 compensation buffer: 6 bytes per element.
/// assert_eq!(cfg.state_bytes_per_element(), 6);
/// # Ok::<(), fsdp::FsdpError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnyPrecisionAdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment (`betas[0]`).
    pub beta1: f64,
    /// Decay of the second moment (`betas[1]`).
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay: each step multiplies the parameter by `1 − lr·weight_decay`
    /// (uncompensated, as torchdistx does).
    pub weight_decay: f64,
    /// Kahan summation of the parameter update into a compensation buffer, so that updates
    /// below the parameter's precision accumulate instead of being rounded away.
    pub use_kahan_summation: bool,
    /// Storage dtype of the first moment `exp_avg` (f32, bf16 or f16).
    pub momentum_dtype: DType,
    /// Storage dtype of the second moment `exp_avg_sq` (f32, bf16 or f16).
    pub variance_dtype: DType,
    /// Storage dtype of the Kahan compensation buffer (f32, bf16 or f16); unused without Kahan
    /// summation.
    pub compensation_buffer_dtype: DType,
}

impl Default for AnyPrecisionAdamWConfig {
    /// Pure-bf16 training: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0 (torchdistx's
    /// defaults), Kahan summation on, every state buffer in bf16.
    fn default() -> Self {
        AnyPrecisionAdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            use_kahan_summation: true,
            momentum_dtype: DType::BF16,
            variance_dtype: DType::BF16,
            compensation_buffer_dtype: DType::BF16,
        }
    }
}

impl AnyPrecisionAdamWConfig {
    /// Checks what [`AdamWConfig::validate`](super::AdamWConfig::validate) checks (`lr`, `eps`,
    /// `weight_decay` finite and `≥ 0`, `0 ≤ beta < 1`) and that each state dtype is `f32`,
    /// `bf16` or `f16` (the update computes in `f32`, so an `f64` state would not be an `f64`
    /// computation; the compensation dtype is checked only with Kahan summation on).
    ///
    /// ```
    /// use fsdp::{optim::AnyPrecisionAdamWConfig, FsdpError};
    /// use fsdp_device::DType;
    ///
    /// let bad = AnyPrecisionAdamWConfig { beta2: 1.0, ..Default::default() };
    /// assert!(matches!(
    ///     bad.validate(),
    ///     Err(FsdpError::InvalidHyperparameter { name: "beta2", .. })
    /// ));
    /// let f64_state = AnyPrecisionAdamWConfig {
    ///     variance_dtype: DType::F64,
    ///     ..Default::default()
    /// };
    /// assert!(f64_state.validate().is_err());
    /// ```
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] naming the first bad setting.
    pub fn validate(&self) -> Result<(), FsdpError> {
        super::AdamWConfig {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
        .validate()?;
        check_dtype("momentum_dtype", self.momentum_dtype)?;
        check_dtype("variance_dtype", self.variance_dtype)?;
        if self.use_kahan_summation {
            check_dtype("compensation_buffer_dtype", self.compensation_buffer_dtype)?;
        }
        Ok(())
    }

    /// Bytes of optimizer state per shard element: `exp_avg`, `exp_avg_sq` and, with Kahan
    /// summation, the compensation buffer, each at its dtype's size (6 for the default
    /// all-bf16 state; 4 without Kahan summation). The parameter itself is not included: see
    /// [`sharded_bytes_per_param`](super::OptimizerConfig::sharded_bytes_per_param).
    ///
    /// ```
    /// use fsdp::optim::AnyPrecisionAdamWConfig;
    ///
    /// let no_kahan = AnyPrecisionAdamWConfig { use_kahan_summation: false, ..Default::default() };
    /// assert_eq!(no_kahan.state_bytes_per_element(), 4);
    /// ```
    pub fn state_bytes_per_element(&self) -> usize {
        let compensation = if self.use_kahan_summation {
            self.compensation_buffer_dtype.size_in_bytes()
        } else {
            0
        };
        self.momentum_dtype.size_in_bytes() + self.variance_dtype.size_in_bytes() + compensation
    }
}

/// A state dtype must be one the update rounds to from `f32`.
fn check_dtype(name: &'static str, dtype: DType) -> Result<(), FsdpError> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        DType::F64 => Err(FsdpError::InvalidHyperparameter {
            name,
            value: f64::NAN,
            reason: "must be float32, bfloat16 or float16 (the update computes in float32)",
        }),
    }
}

/// The state of one flat slice under [`AnyPrecisionAdamWConfig`]: step count, moments and (with
/// Kahan summation) the compensation buffer, each in its configured dtype, as torchdistx's
/// `state[p]`. All buffers start at zero.
///
/// # What is computed, and where it is rounded
///
/// The update follows torchdistx's `AnyPrecisionAdamW.step`
/// (`src/python/torchdistx/optimizers/anyprecision_optimizer.py`) operation by operation. Each
/// line of the listing below is one PyTorch tensor operation; PyTorch evaluates each in `f32`
/// (its "opmath" type for bf16 and f16, and the promoted type where an `f32` gradient meets a
/// bf16 state) from the exactly widened operands and rounds the result **once**, to nearest
/// even, to the dtype of the tensor it writes. Here every operation does the same: compute in
/// `f32`, round to the storage dtype (`P` for the parameter, `M` momentum, `V` variance, `C`
/// compensation; rounding to `f32` is the identity). Python-float hyperparameters are rounded
/// from `f64` to `f32` once, as PyTorch's CPU kernels read the scalar operand of `mul`,
/// `addcmul` and `addcdiv` into `f32` — except `add_(eps)`, whose scalar PyTorch first converts
/// to the tensor's dtype (`V(eps)`: bf16's 1.0012e-8, and 0 for f16, whose smallest subnormal
/// is 6e-8).
///
/// ```text
/// // scalars: state["step"] is a float32 tensor, so these are f32 tensor operations
/// bias_correction1 = 1 − f32(beta1)^f32(step)          (powf, then subtraction, each in f32)
/// step_size        = (1 / bias_correction1) · f32(lr)   (`lr / t` is `t.reciprocal() * lr`)
/// denom_correction = √(1 − f32(beta2)^f32(step))        (`** 0.5` is sqrt)
///
/// // element-wise, g the f32 gradient
/// p  = P(p · f32(1 − lr·weight_decay))                 p.mul_(1 - lr*wd)   (only if wd ≠ 0)
/// m  = M(m · f32(beta1))                               exp_avg.mul_(beta1)
/// m  = M(fma(f32(1 − beta1), g, m))                    .add_(grad, alpha=1 - beta1)
/// v  = V(v · f32(beta2))                               exp_avg_sq.mul_(beta2)
/// v  = V(fma(f32(1 − beta2) · g, g, v))                .addcmul_(grad, grad, value=1 - beta2)
/// d  = V(√v)                                           exp_avg_sq.sqrt()
/// d  = V(d / denom_correction)                         / denom_correction
/// d  = V(d + V(eps))                                   .add_(eps, alpha=1)
/// with Kahan summation:
///   c  = C(c + (−step_size · m) / d)                   comp.addcdiv_(exp_avg, d, value=-step_size)
///   t  = p                                             temp = p.detach().clone()
///   p  = P(p + c)                                      p.add_(comp)
///   t  = P(t − p)                                      temp.sub_(p)
///   c  = C(c + t)                                      comp.add_(temp)
/// without:
///   p  = P(p + (−step_size · m) / d)                   p.addcdiv_(exp_avg, d, value=-step_size)
/// ```
///
/// Products and sums are evaluated as PyTorch's CPU kernels write them (`add`:
/// `self + alpha·other`, `addcmul`: `self + value·t1·t2`, `addcdiv`: `self + value·t1/t2`).
/// Where the gradient takes part it is `f32`, so PyTorch runs its `f32` kernel, whose final
/// multiply-add is fused (`fma`, one rounding: PyTorch's AVX2/AVX512 CPU kernels, vectorized
/// and scalar, compute so, as CUDA's compiler does); the division in `addcdiv` is a true
/// division. This is bitwise PyTorch's CPU result (tested against golden values from PyTorch
/// 2.15 on an AVX512 CPU, `crates/fsdp/tests/data/any_precision/`). A PyTorch built without
/// FMA (its DEFAULT CPU kernels) rounds the product separately, and CUDA divides by
/// `denom_correction` as a multiplication by its reciprocal: each can move an `f32`
/// intermediate by one `f32` ulp and so, rarely, a stored value by one ulp of its dtype.
///
/// The step counter is a `u64` here; torchdistx keeps it in a float32 tensor, which is exact up
/// to 2²⁴ steps (beyond that torchdistx's counter stops growing; here the count is rounded to
/// `f32` for the powers, which only matters for a `beta` within about 1e-6 of 1, where
/// `beta^(2²⁴)` is still above f32's resolution of 1).
///
/// Weight decay is applied to the (bf16) parameter directly and is not compensated, exactly as
/// in torchdistx: with a bf16 parameter, a decay factor within half an ulp of 1 does nothing.
///
/// # Example
///
/// ```
/// use fsdp::optim::{AnyPrecisionAdamWConfig, AnyPrecisionAdamWState};
/// use fsdp_device::half::bf16;
///
/// let cfg = AnyPrecisionAdamWConfig { lr: 1e-2, ..Default::default() };
/// let mut state = AnyPrecisionAdamWState::try_new(&cfg, 2)?;
/// let mut param = [bf16::from_f32(1.0), bf16::from_f32(-1.0)];
/// state.step(&cfg, &mut param, &[0.5, -0.5])?;
/// assert_eq!(state.step, 1);
/// // The first Adam step moves each parameter by about lr against its gradient sign.
/// assert!(param[0].to_f32() < 1.0 && param[1].to_f32() > -1.0);
/// assert_eq!(state.size_in_bytes(), 2 * 6);
/// # Ok::<(), fsdp::FsdpError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct AnyPrecisionAdamWState {
    /// Steps taken so far.
    pub step: u64,
    /// First moment, in the config's `momentum_dtype`.
    pub exp_avg: PrecisionVec,
    /// Second moment, in the config's `variance_dtype`.
    pub exp_avg_sq: PrecisionVec,
    /// Kahan compensation, in the config's `compensation_buffer_dtype`; `None` without Kahan
    /// summation (torchdistx allocates it only then).
    pub compensation: Option<PrecisionVec>,
}

impl AnyPrecisionAdamWState {
    /// Zero state for `len` elements in the dtypes of `cfg`, allocated fallibly.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] for a bad `cfg`; [`FsdpError::HostOutOfMemory`]
    /// naming the buffer and its bytes when the memory cannot be allocated.
    pub fn try_new(cfg: &AnyPrecisionAdamWConfig, len: usize) -> Result<Self, FsdpError> {
        cfg.validate()?;
        Ok(AnyPrecisionAdamWState {
            step: 0,
            exp_avg: PrecisionVec::try_zeros(
                cfg.momentum_dtype,
                len,
                "the AnyPrecisionAdamW state (exp_avg)",
            )?,
            exp_avg_sq: PrecisionVec::try_zeros(
                cfg.variance_dtype,
                len,
                "the AnyPrecisionAdamW state (exp_avg_sq)",
            )?,
            compensation: if cfg.use_kahan_summation {
                Some(PrecisionVec::try_zeros(
                    cfg.compensation_buffer_dtype,
                    len,
                    "the AnyPrecisionAdamW state (compensation)",
                )?)
            } else {
                None
            },
        })
    }

    /// Bytes of the state buffers (the step count aside).
    pub fn size_in_bytes(&self) -> usize {
        self.exp_avg.size_in_bytes()
            + self.exp_avg_sq.size_in_bytes()
            + self
                .compensation
                .as_ref()
                .map_or(0, PrecisionVec::size_in_bytes)
    }

    /// Takes one step on a bf16 parameter slice with its `f32` gradient (see the
    /// [type's docs](Self) for the exact operations and roundings) and counts it.
    ///
    /// # Errors
    /// Checked before anything changes (the state and `param` are then unchanged):
    /// [`FsdpError::InvalidHyperparameter`] for a bad setting, or a state whose dtypes or
    /// compensation buffer do not match `cfg`; [`FsdpError::OptimizerLength`] if `grad` or a
    /// state buffer does not have `param.len()` elements.
    pub fn step(
        &mut self,
        cfg: &AnyPrecisionAdamWConfig,
        param: &mut [bf16],
        grad: &[f32],
    ) -> Result<(), FsdpError> {
        self.step_slice(cfg, param, grad)
    }

    /// [`step`](Self::step) for any parameter element type the update rounds to (bf16 here,
    /// `f32` through [`OptimizerState::step`](super::OptimizerState::step)).
    pub(super) fn step_slice<P: ParamElement>(
        &mut self,
        cfg: &AnyPrecisionAdamWConfig,
        param: &mut [P],
        grad: &[f32],
    ) -> Result<(), FsdpError> {
        let step = self.step + 1;
        self.check(cfg, param.len())?;
        self.update_range(cfg, step, 0..param.len(), param, grad)?;
        self.step = step;
        Ok(())
    }

    /// Checks `cfg`, the state's dtypes against it and every buffer's length against `len`.
    pub(super) fn check(&self, cfg: &AnyPrecisionAdamWConfig, len: usize) -> Result<(), FsdpError> {
        cfg.validate()?;
        self.check_matches(cfg)?;
        same_len("exp_avg", len, self.exp_avg.len())?;
        same_len("exp_avg_sq", len, self.exp_avg_sq.len())?;
        if let Some(c) = &self.compensation {
            same_len("compensation", len, c.len())?;
        }
        Ok(())
    }

    /// The state was made for `cfg`'s dtypes, and has a compensation buffer if `cfg` uses one.
    pub(super) fn check_matches(&self, cfg: &AnyPrecisionAdamWConfig) -> Result<(), FsdpError> {
        let dtype_mismatch = |name| FsdpError::InvalidHyperparameter {
            name,
            value: f64::NAN,
            reason: "the optimizer state was created with another dtype",
        };
        if self.exp_avg.dtype() != cfg.momentum_dtype {
            return Err(dtype_mismatch("momentum_dtype"));
        }
        if self.exp_avg_sq.dtype() != cfg.variance_dtype {
            return Err(dtype_mismatch("variance_dtype"));
        }
        if cfg.use_kahan_summation {
            match &self.compensation {
                None => {
                    return Err(FsdpError::InvalidHyperparameter {
                        name: "use_kahan_summation",
                        value: 1.0,
                        reason: "the optimizer state was created without a compensation buffer",
                    })
                }
                Some(c) if c.dtype() != cfg.compensation_buffer_dtype => {
                    return Err(dtype_mismatch("compensation_buffer_dtype"))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Updates elements `range` of the state with `param` and `grad` (both `range.len()` long)
    /// at step number `step`, without counting the step. The caller has run
    /// [`check`](Self::check) (with the state's full length) for a config of the same dtypes.
    pub(super) fn update_range<P: ParamElement>(
        &mut self,
        cfg: &AnyPrecisionAdamWConfig,
        step: u64,
        range: Range<usize>,
        param: &mut [P],
        grad: &[f32],
    ) -> Result<(), FsdpError> {
        check_step(step)?;
        same_len("grad", param.len(), grad.len())?;
        same_len("state range", param.len(), range.len())?;
        let s = Scalars::new(cfg, step);
        let comp = if cfg.use_kahan_summation {
            self.compensation.as_mut()
        } else {
            None
        };
        macro_rules! each {
            ($buf:expr, $x:ident => $body:expr) => {
                match $buf {
                    PrecisionVec::F32($x) => $body,
                    PrecisionVec::BF16($x) => $body,
                    PrecisionVec::F16($x) => $body,
                }
            };
        }
        let r = range;
        each!(&mut self.exp_avg, m => each!(&mut self.exp_avg_sq, v => match comp {
            None => {
                let (m, v) = (&mut m[r.clone()], &mut v[r.clone()]);
                update::<P, _, _, f32>(&s, param, grad, m, v, None)
            }
            Some(c) => each!(c, c => update(
                &s,
                param,
                grad,
                &mut m[r.clone()],
                &mut v[r.clone()],
                Some(&mut c[r.clone()]),
            )),
        }));
        Ok(())
    }
}

#[cfg(test)]
#[path = "any_precision_tests.rs"]
mod tests;
