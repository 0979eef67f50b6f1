//! Launch functions of the cross-entropy fused with its backward (`cu/nn_softmax.cu`), bitwise
//! equal to its twins [`host::nn::cross_entropy_fused`](crate::host::nn::cross_entropy_fused)
//! and [`host::nn::cross_entropy_fused_in_place`](crate::host::nn::cross_entropy_fused_in_place).

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::enqueue;
use super::plan::{self, cross_entropy_fused_kernel};
use crate::host::nn::check_cross_entropy;
use crate::host::{check_scalars_len, CastFloat};
use crate::KernelError;

/// Cross-entropy fused with its backward: per-row losses (the mean is the caller's) and
/// `dlogits` (written as `D`: f32, or its bf16 or f16 rounding); see
/// [`host::nn::cross_entropy_fused`](crate::host::nn::cross_entropy_fused). With a step's
/// scalars `scale` (a grad scaler's), the seed `dloss` is multiplied by their loss scale
/// ([`STEP_SCALE`](crate::host::STEP_SCALE), rounded to f32) on the device first.
///
/// # Errors
/// Shape errors as the twin; a scalar buffer too short; compile, load and launch
/// failures.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_fused<D: CastFloat>(
    stream: &CudaStream,
    logits: &impl DevicePtr<f32>,
    targets: &impl DevicePtr<u32>,
    v: usize,
    dloss: f32,
    scale: Option<&CudaSlice<f64>>,
    losses: &mut impl DevicePtrMut<f32>,
    dlogits: &mut impl DevicePtrMut<D>,
) -> Result<(), KernelError> {
    let k = cross_entropy_fused_kernel::<D>()?;
    let n = check_cross_entropy(
        k,
        logits.len(),
        v,
        targets.len(),
        losses.len(),
        dlogits.len(),
    )?;
    if n == 0 {
        return Ok(());
    }
    let (lp, _l) = logits.device_ptr(stream);
    let (tp, _t) = targets.device_ptr(stream);
    let (op, _o) = losses.device_ptr_mut(stream);
    let (dp, _d) = dlogits.device_ptr_mut(stream);
    let (sp, _s) = scale_ptr(stream, k, scale)?;
    let launches = plan::cross_entropy_fused::<D>(lp, tp, v, dloss, sp, op, dp, n)?;
    // SAFETY: `logits` holds `n·v` f32 and `dlogits` `n·v` of `D`, `targets` and `losses` `n`
    // (checked above), the scalars past STEP_SCALE or none (null), all held; targets are
    // compared with `v` before any indexed read.
    unsafe { enqueue(stream, &launches) }
}

/// The address of a step's scalars for the cross-entropy's seed (null: none), checked to
/// hold the slot of the loss scale, with its borrow.
fn scale_ptr<'a>(
    stream: &'a CudaStream,
    k: &'static str,
    scale: Option<&'a CudaSlice<f64>>,
) -> Result<(CUdeviceptr, Option<impl Drop + 'a>), KernelError> {
    match scale {
        None => Ok((0, None)),
        Some(s) => {
            check_scalars_len(k, s.len(), 0)?;
            let (p, guard) = s.device_ptr(stream);
            Ok((p, Some(guard)))
        }
    }
}

/// [`cross_entropy_fused`] with `dlogits` written over `logits` (see
/// [`host::nn::cross_entropy_fused_in_place`](crate::host::nn::cross_entropy_fused_in_place)):
/// the same kernel given one buffer for both.
///
/// # Errors
/// Shape errors as the twin; compile, load and launch failures.
pub fn cross_entropy_fused_in_place(
    stream: &CudaStream,
    logits: &mut impl DevicePtrMut<f32>,
    targets: &impl DevicePtr<u32>,
    v: usize,
    dloss: f32,
    scale: Option<&CudaSlice<f64>>,
    losses: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let k = "cross_entropy_fused_f32";
    let len = logits.len();
    let n = check_cross_entropy(k, len, v, targets.len(), losses.len(), len)?;
    if n == 0 {
        return Ok(());
    }
    let (lp, _l) = logits.device_ptr_mut(stream);
    let (tp, _t) = targets.device_ptr(stream);
    let (op, _o) = losses.device_ptr_mut(stream);
    let (sp, _s) = scale_ptr(stream, k, scale)?;
    let launches = plan::cross_entropy_fused_in_place(lp, tp, v, dloss, sp, op, n)?;
    // SAFETY: `logits` (also the f32 gradient) holds `n·v` f32, `targets` and `losses` `n`
    // (checked above), the scalars past STEP_SCALE or none (null), all held; the kernel reads
    // each logit before the one thread that writes its gradient does, after the row's
    // reductions (cu/nn_softmax.cu).
    unsafe { enqueue(stream, &launches) }
}
