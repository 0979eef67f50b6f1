//! Mixed precision (FSDP2's `MixedPrecisionPolicy`): the dtype the unsharded parameters are
//! all-gathered and read in, the dtype gradients are reduced in, and the division of the
//! reduced gradients by the data-parallel size.
//!
//! # What a mixed-precision step computes
//! The sharded parameters (the optimizer's master weights) and the gradient shards stay `f32`.
//! For a unit whose policy has `param_dtype` `P` and reduce dtype `R`:
//! 1. **All-gather.** The rank's shard is cast to `P` (round to nearest even) *before* the
//!    all-gather, which moves `P` elements (bf16: half the bytes of an `f32` run).
//! 2. **Compute.** On the CPU the model computes in `f32` from the gathered `P` values (each
//!    widened exactly): the engine widens the gathered buffer into the `f32` buffer the views
//!    show and frees the `P` buffer. The model therefore reads exactly the values of the
//!    master weights rounded to `P`. A unit that is never gathered (`F = 1`) is rounded the
//!    same way into a separate buffer at its first hook of each pass.
//! 3. **Gradients.** The model accumulates the unit's gradient in `f32` (over its spans and,
//!    under `no_sync`, over micro-batches); at the reduction it is rounded once to `P` (the
//!    dtype PyTorch's autograd produces for `P` parameters), cast to `R`, *pre-divided*,
//!    reduced in `R` (the backend rounds after every addition, in the ring's order), and the
//!    result *post-divided*, cast to `f32` and added to the gradient shard.
//!
//! With `P = R = f32` and [`GradientDivide::Model`] nothing is cast or divided: the path is the
//! plain `f32` one, bit for bit.
//!
//! # The division (FSDP2's `_get_gradient_divide_factors`)
//! [`GradientDivide::Model`] (the default): the model normalises its loss over the global batch
//! (the GPT divides by the tokens of all ranks), so the reductions are plain sums — FSDP2 with
//! `set_gradient_divide_factor(1.0)`. [`GradientDivide::DataParallelSize`]: FSDP2's default,
//! each rank's loss is its local mean and the engine divides by the data-parallel size `N`
//! (shard group × replicate group):
//! - `R` = `f32` or `bf16` (no overflow risk): an average, done as NCCL does `ncclAvg` for
//!   floating types — every element is pre-multiplied by `1/N` rounded to `R` (the product
//!   rounded to `R`), then summed. (FSDP2 averages a hybrid mesh in two stages, `1/S` before
//!   the reduce-scatter and `1/R` before the all-reduce; this engine issues both collectives
//!   back to back and pre-multiplies once by `1/N`.)
//! - `R` = `f16`: FSDP's factor pair, about `√N` each: `pre = 1; while N % pre == 0 and
//!   N / pre > pre: pre *= 2`, then `post = N / pre` (N = 8: 4 and 2; N = 3: 2 and 1.5); elements are
//!   divided by `pre` before the sum and by `post` after it (each quotient rounded to `f16`), so
//!   neither the local gradients nor their sum leave `f16`'s range.
//!
//! # Forward inputs and outputs
//! `cast_forward_inputs` and `output_dtype` concern the model's activations, which the engine
//! does not see: the views expose the span's policy ([`Params::mixed_precision`](super::Params::mixed_precision))
//! and the model applies [`MixedPrecisionPolicy::cast_forward_input`] and
//! [`MixedPrecisionPolicy::cast_output`] (on the CPU a cast rounds the `f32` values to the
//! dtype; the gradient through `cast_output` is rounded to `output_dtype` with
//! [`MixedPrecisionPolicy::cast_output_grad`], as autograd delivers it in that dtype).

use fsdp_device::{Buffer, DType, Element};
use half::{bf16, f16};

use super::fsdp::Fsdp;
use crate::FsdpError;

/// A unit's mixed-precision policy (FSDP2's `MixedPrecisionPolicy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MixedPrecisionPolicy {
    /// The dtype of the unsharded parameters: what the all-gather moves and the model reads.
    pub param_dtype: DType,
    /// The dtype gradients are reduced in; `None`: `param_dtype` (PyTorch's default).
    pub reduce_dtype: Option<DType>,
    /// The dtype the model casts its span outputs to, if any (see
    /// [`cast_output`](Self::cast_output)).
    pub output_dtype: Option<DType>,
    /// Whether the model casts its floating-point span inputs to `param_dtype` (see
    /// [`cast_forward_input`](Self::cast_forward_input)); FSDP2's default is `true`.
    pub cast_forward_inputs: bool,
}

impl Default for MixedPrecisionPolicy {
    /// Full precision: everything `f32`, nothing cast.
    fn default() -> Self {
        MixedPrecisionPolicy {
            param_dtype: DType::F32,
            reduce_dtype: None,
            output_dtype: None,
            cast_forward_inputs: true,
        }
    }
}

impl MixedPrecisionPolicy {
    /// Parameters in `param_dtype`, gradients reduced in `reduce_dtype` (`None`: the same).
    pub fn new(param_dtype: DType, reduce_dtype: Option<DType>) -> Self {
        MixedPrecisionPolicy {
            param_dtype,
            reduce_dtype,
            ..MixedPrecisionPolicy::default()
        }
    }

    /// The dtype gradients are reduced in.
    pub fn reduce_dtype(&self) -> DType {
        self.reduce_dtype.unwrap_or(self.param_dtype)
    }

    /// Whether anything is cast (some dtype is not `f32`).
    pub fn is_mixed(&self) -> bool {
        self.param_dtype != DType::F32
            || self.reduce_dtype() != DType::F32
            || self.output_dtype.is_some_and(|d| d != DType::F32)
    }

    /// Checks that every dtype is `f32`, `bf16` or `f16`.
    ///
    /// # Errors
    /// [`FsdpError::InvalidFsdpConfig`] naming the field holding `float64`.
    pub fn validate(&self) -> Result<(), FsdpError> {
        let fields = [
            ("param_dtype", Some(self.param_dtype)),
            ("reduce_dtype", self.reduce_dtype),
            ("output_dtype", self.output_dtype),
        ];
        for (name, d) in fields {
            if d == Some(DType::F64) {
                return Err(FsdpError::InvalidFsdpConfig {
                    reason: format!(
                        "mixed precision: {name} float64 is not supported (use float32, \
                         bfloat16 or float16)"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Round a span's floating-point input to `param_dtype` when `cast_forward_inputs` is set
    /// (values stay `f32`, each exactly representable in `param_dtype`).
    pub fn cast_forward_input(&self, x: &mut [f32]) {
        if self.cast_forward_inputs {
            round_slice(self.param_dtype, x);
        }
    }

    /// Round a span's output to `output_dtype`, if set.
    pub fn cast_output(&self, y: &mut [f32]) {
        if let Some(d) = self.output_dtype {
            round_slice(d, y);
        }
    }

    /// Round the gradient arriving at a span's output to `output_dtype`, if set (the dtype
    /// autograd delivers it in).
    pub fn cast_output_grad(&self, g: &mut [f32]) {
        self.cast_output(g);
    }
}

/// Who divides the summed gradients by the number of data-parallel ranks (see the
/// [module](self) documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GradientDivide {
    /// The model normalises its loss over the global batch; reductions are plain sums
    /// (FSDP2's `set_gradient_divide_factor(1.0)`). The default.
    #[default]
    Model,
    /// FSDP2's default: each rank's loss is its local mean and the engine divides by the
    /// data-parallel size (an average for `f32`/`bf16`, a pre/post-divide pair for `f16`).
    DataParallelSize,
}

/// The factors of one reduction (see [`divide_factors`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DivideFactors {
    /// Multiply every element by this (rounded to the reduce dtype) before the reduction.
    pub premul: Option<f32>,
    /// Divide every element by this before the reduction.
    pub pre_divide: Option<f32>,
    /// Divide every element of the result by this after the reduction.
    pub post_divide: Option<f32>,
}

impl DivideFactors {
    /// No scaling at all.
    pub const NONE: DivideFactors = DivideFactors {
        premul: None,
        pre_divide: None,
        post_divide: None,
    };
}

/// The factors applied around a reduction over `n` data-parallel ranks in `reduce` (FSDP2's
/// `_get_gradient_divide_factors`; see the [module](self) documentation).
///
/// ```
/// use fsdp::engine::{divide_factors, GradientDivide};
/// use fsdp_device::DType;
/// let f = divide_factors(GradientDivide::DataParallelSize, DType::F16, 8);
/// assert_eq!((f.pre_divide, f.post_divide), (Some(4.0), Some(2.0)));
/// let f = divide_factors(GradientDivide::DataParallelSize, DType::BF16, 4);
/// assert_eq!((f.premul, f.post_divide), (Some(0.25), None));
/// ```
pub fn divide_factors(mode: GradientDivide, reduce: DType, n: usize) -> DivideFactors {
    if mode == GradientDivide::Model || n <= 1 {
        return DivideFactors::NONE;
    }
    if reduce == DType::F16 {
        let mut pre = 1usize;
        while n % pre == 0 && n / pre > pre {
            pre *= 2;
        }
        let post = n as f64 / pre as f64;
        DivideFactors {
            premul: None,
            pre_divide: (pre > 1).then_some(pre as f32),
            post_divide: (post != 1.0).then_some(post as f32),
        }
    } else {
        DivideFactors {
            premul: Some(round_to(reduce, (1.0 / n as f64) as f32)),
            pre_divide: None,
            post_divide: None,
        }
    }
}

/// `x` rounded to `dtype` (nearest even) and widened back to `f32`.
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::F32 | DType::F64 => x,
    }
}

/// Round every element of `x` to `dtype`.
pub fn round_slice(dtype: DType, x: &mut [f32]) {
    if dtype != DType::F32 && dtype != DType::F64 {
        x.iter_mut().for_each(|v| *v = round_to(dtype, *v));
    }
}

/// Write `f(src[i])` into `dst` (of any dtype), each value rounded once to `dst`'s dtype.
pub(crate) fn store(dst: &Buffer, src: &[f32], f: impl Fn(f32) -> f32) -> Result<(), FsdpError> {
    fn run<T: Element>(dst: &Buffer, src: &[f32], f: impl Fn(f32) -> f32) -> Result<(), FsdpError> {
        let mut d = dst.write::<T>()?;
        for (d, &s) in d.iter_mut().zip(src) {
            *d = T::from_f32(f(s));
        }
        Ok(())
    }
    match dst.dtype() {
        DType::F32 => run::<f32>(dst, src, f),
        DType::BF16 => run::<bf16>(dst, src, f),
        DType::F16 => run::<f16>(dst, src, f),
        DType::F64 => run::<f64>(dst, src, f),
    }
}

/// Write `src` into `dst` (of any dtype), each value rounded once to `dst`'s dtype (the
/// vectorised conversions of `half` for the 16-bit types).
pub(crate) fn store_exact(dst: &Buffer, src: &[f32]) -> Result<(), FsdpError> {
    use half::slice::HalfFloatSliceExt;
    let n = src.len().min(dst.len());
    match dst.dtype() {
        DType::BF16 => dst.write::<bf16>()?[..n].convert_from_f32_slice(&src[..n]),
        DType::F16 => dst.write::<f16>()?[..n].convert_from_f32_slice(&src[..n]),
        _ => return store(dst, src, |x| x),
    }
    Ok(())
}

/// Widen `src` (any dtype) into `dst` exactly.
pub(crate) fn load_exact(src: &Buffer, dst: &mut [f32]) -> Result<(), FsdpError> {
    use half::slice::HalfFloatSliceExt;
    let n = src.len().min(dst.len());
    match src.dtype() {
        DType::BF16 => src.read::<bf16>()?[..n].convert_to_f32_slice(&mut dst[..n]),
        DType::F16 => src.read::<f16>()?[..n].convert_to_f32_slice(&mut dst[..n]),
        _ => return load(src, |i, v| dst[i] = v),
    }
    Ok(())
}

/// Call `f(i, src[i] as f32)` for every element of `src` (of any dtype; widening is exact).
pub(crate) fn load(src: &Buffer, mut f: impl FnMut(usize, f32)) -> Result<(), FsdpError> {
    fn run<T: Element>(src: &Buffer, f: &mut impl FnMut(usize, f32)) -> Result<(), FsdpError> {
        for (i, &v) in src.read::<T>()?.iter().enumerate() {
            f(i, v.to_f32());
        }
        Ok(())
    }
    match src.dtype() {
        DType::F32 => run::<f32>(src, &mut f),
        DType::BF16 => run::<bf16>(src, &mut f),
        DType::F16 => run::<f16>(src, &mut f),
        DType::F64 => run::<f64>(src, &mut f),
    }
}

/// Fill the reduction input of dtype `R` from an `f32` unsharded gradient: round to `param`,
/// cast to `R` (by the store), pre-multiply or pre-divide (each result rounded to `R`).
pub(crate) fn fill_reduce_input(
    grad: &[f32],
    dst: &Buffer,
    param: DType,
    f: DivideFactors,
) -> Result<(), FsdpError> {
    let r = dst.dtype();
    store(dst, grad, |x| {
        let mut v = round_to(r, round_to(param, x));
        if let Some(s) = f.premul {
            v = round_to(r, v * s);
        }
        if let Some(d) = f.pre_divide {
            v = round_to(r, v / d);
        }
        v
    })
}

/// Add a reduced buffer (any dtype) into an `f32` gradient shard, post-dividing each element
/// first (the quotient rounded to the buffer's dtype), or copy it when `replace`.
pub(crate) fn accumulate_reduced(
    reduced: &Buffer,
    acc: &mut [f32],
    post_divide: Option<f32>,
    replace: bool,
) -> Result<(), FsdpError> {
    let r = reduced.dtype();
    load(reduced, |i, v| {
        let v = match post_divide {
            Some(d) => round_to(r, v / d),
            None => v,
        };
        if let Some(a) = acc.get_mut(i) {
            *a = if replace { v } else { *a + v };
        }
    })
}

impl Fsdp {
    /// The mixed-precision policy of unit `u`.
    ///
    /// # Errors
    /// An unknown unit.
    pub fn mixed_precision(&self, u: usize) -> Result<MixedPrecisionPolicy, FsdpError> {
        self.param_groups()
            .get(u)
            .map(|g| g.policy)
            .ok_or_else(|| FsdpError::InvalidFsdpConfig {
                reason: format!(
                    "unit {u} does not exist (the engine has {})",
                    self.num_units()
                ),
            })
    }

    /// Override unit `u`'s policy (FSDP2 takes one per `fully_shard` call); the engine-wide
    /// one is [`FsdpConfig::mixed_precision`](super::FsdpConfig::mixed_precision). Only between
    /// passes.
    ///
    /// # Errors
    /// An unknown unit, an invalid policy, a call inside a pass, or a unit whose parameters
    /// are stored in a low-precision dtype other than the policy's `param_dtype`.
    pub fn set_mixed_precision(
        &mut self,
        u: usize,
        policy: MixedPrecisionPolicy,
    ) -> Result<(), FsdpError> {
        policy.validate()?;
        self.mixed_precision(u)?;
        if self.pass_is_open() {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: "set_mixed_precision inside a forward/backward pass".into(),
            });
        }
        self.set_group_policy(u, policy)
    }
}
