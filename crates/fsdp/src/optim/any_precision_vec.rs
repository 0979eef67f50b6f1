//! [`PrecisionVec`]: a flat optimizer-state buffer of AnyPrecisionAdamW in `f32`, `bf16` or
//! `f16`, read widened to `f32` and written rounded to nearest even.

use fsdp_device::half::{bf16, f16};
use fsdp_device::DType;

use super::check_dtype;
use crate::FsdpError;

/// A flat optimizer-state buffer stored in one of the dtypes
/// [`AnyPrecisionAdamWConfig`](super::AnyPrecisionAdamWConfig) allows. Values are read exactly
/// (widened to `f32`) and written rounded to nearest even.
///
/// ```
/// use fsdp::optim::PrecisionVec;
/// use fsdp_device::DType;
///
/// let v = PrecisionVec::from_f32(DType::BF16, &[1.0, 0.1])?;
/// assert_eq!(v.dtype(), DType::BF16);
/// // 0.1 rounded to bf16 (8 significant bits).
/// assert_eq!(v.to_f32_vec(), vec![1.0, 0.10009765625]);
/// assert_eq!(v.size_in_bytes(), 4);
/// # Ok::<(), fsdp::FsdpError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum PrecisionVec {
    /// `f32` elements.
    F32(Vec<f32>),
    /// `bf16` elements.
    BF16(Vec<bf16>),
    /// `f16` elements.
    F16(Vec<f16>),
}

impl PrecisionVec {
    /// `len` zeros of `dtype`, allocated fallibly.
    ///
    /// # Errors
    /// [`FsdpError::HostOutOfMemory`] naming `what` when the memory cannot be allocated;
    /// [`FsdpError::InvalidHyperparameter`] for `f64`.
    pub fn try_zeros(dtype: DType, len: usize, what: &str) -> Result<Self, FsdpError> {
        Ok(match dtype {
            DType::F32 => PrecisionVec::F32(crate::try_filled_vec(len, 0.0, what)?),
            DType::BF16 => PrecisionVec::BF16(crate::try_filled_vec(len, bf16::ZERO, what)?),
            DType::F16 => PrecisionVec::F16(crate::try_filled_vec(len, f16::ZERO, what)?),
            DType::F64 => return Err(check_dtype("dtype", dtype).unwrap_err()),
        })
    }

    /// `values` rounded to `dtype` (nearest even), e.g. to load a checkpointed state.
    ///
    /// # Errors
    /// [`FsdpError::HostOutOfMemory`] when the memory cannot be allocated;
    /// [`FsdpError::InvalidHyperparameter`] for `f64`.
    pub fn from_f32(dtype: DType, values: &[f32]) -> Result<Self, FsdpError> {
        let mut v = PrecisionVec::try_zeros(dtype, values.len(), "an AnyPrecisionAdamW state")?;
        match &mut v {
            PrecisionVec::F32(d) => d.copy_from_slice(values),
            PrecisionVec::BF16(d) => d.iter_mut().zip(values).for_each(|(d, &x)| {
                *d = bf16::from_f32(x);
            }),
            PrecisionVec::F16(d) => d.iter_mut().zip(values).for_each(|(d, &x)| {
                *d = f16::from_f32(x);
            }),
        }
        Ok(v)
    }

    /// The storage dtype.
    pub fn dtype(&self) -> DType {
        match self {
            PrecisionVec::F32(_) => DType::F32,
            PrecisionVec::BF16(_) => DType::BF16,
            PrecisionVec::F16(_) => DType::F16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            PrecisionVec::F32(v) => v.len(),
            PrecisionVec::BF16(v) => v.len(),
            PrecisionVec::F16(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the elements (`len · dtype size`).
    pub fn size_in_bytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// The values widened to `f32` (exact).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            PrecisionVec::F32(v) => v.clone(),
            PrecisionVec::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            PrecisionVec::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
}
