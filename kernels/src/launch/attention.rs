//! Launches of `cu/attention.cu`: causal attention fused into tiles on tensor cores (flash
//! attention), twins in [`host::attention`](crate::host::attention), which agree with the
//! kernels within the rounding of sums taken in another order.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::plan::{self, flash_check, flash_layout_check};
use super::{driver, enqueue};
use crate::host::attention::FusedAttention;
use crate::host::nn::HeadsLayout;
use crate::host::{same_len, CastFloat};
use crate::KernelError;

pub use super::plan::{FLASH_HEAD_DIMS, FLASH_TILE};

/// Checks what the kernels take ([`plan::flash_check`]: heads of [`FLASH_HEAD_DIMS`] values,
/// bf16 or f16 operands, at most 65,535 pairs and `t` within an `i32`), then the device's:
/// compute capability 8.0 or newer.
fn checked<H: CastFloat>(
    stream: &CudaStream,
    kernel: &'static str,
    a: &FusedAttention,
) -> Result<(), KernelError> {
    flash_check::<H>(kernel, a)?;
    let cc = stream
        .context()
        .compute_capability()
        .map_err(|e| driver("cuDeviceGetAttribute", kernel, e))?;
    if cc.0 < 8 {
        return Err(KernelError::InvalidArgument {
            kernel,
            reason: format!(
                "fused attention needs compute capability 8.0 or newer (bf16 tensor cores); \
                 this device has {}.{}",
                cc.0, cc.1
            ),
        });
    }
    Ok(())
}

/// Forward ([`host::attention::flash_forward`](crate::host::attention::flash_forward)):
/// writes `y` (`[pairs, t, d]`, f32) and `lse` (`[pairs·t]`, the rows' base-2 log-sum-exp
/// kept for backward).
///
/// # Errors
/// [`KernelError::Length`] as the twin; [`KernelError::InvalidArgument`] for what the kernels
/// do not take (see [`FLASH_HEAD_DIMS`]; f32 operands; a GPU older than compute capability
/// 8.0; unaligned operands); compile, load and launch failures.
#[allow(clippy::too_many_arguments)]
pub fn flash_forward<H: CastFloat>(
    stream: &CudaStream,
    a: &FusedAttention,
    q: &impl DevicePtr<H>,
    k: &impl DevicePtr<H>,
    v: &impl DevicePtr<H>,
    y: &mut impl DevicePtrMut<f32>,
    lse: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let kernel = "flash_forward";
    for (what, len) in [
        ("q", q.len()),
        ("k", k.len()),
        ("v", v.len()),
        ("y", y.len()),
    ] {
        same_len(kernel, what, a.len(), len)?;
    }
    same_len(kernel, "lse", a.rows(), lse.len())?;
    if a.is_empty() {
        return Ok(());
    }
    checked::<H>(stream, kernel, a)?;
    let (qp, _q) = q.device_ptr(stream);
    let (kp, _k) = k.device_ptr(stream);
    let (vp, _v) = v.device_ptr(stream);
    let (yp, _y) = y.device_ptr_mut(stream);
    let (lp, _l) = lse.device_ptr_mut(stream);
    let launches = plan::flash_forward::<H>(a, qp, kp, vp, yp, lp)?;
    // SAFETY: q, k, v and y hold `pairs·t·d` elements, lse `pairs·t` (checked above), the
    // 16-bit operands and y 16-byte aligned (checked by the plan); each block reads and writes
    // only its pair's rows below t. The slices are held (`_q` … `_l`) while it is enqueued.
    unsafe { enqueue(stream, &launches) }
}

/// Backward ([`host::attention::flash_backward_dot`] then
/// [`host::attention::flash_backward`](crate::host::attention::flash_backward)): writes `dq`,
/// `dk` and `dv` (`[pairs, t, d]`, f32) from the heads' output gradient `dout` (`[pairs, t,
/// d]`), forward's output `y` as the projection's operand (token rows, placed as `layout`
/// says) and forward's `lse`. The rows' sums `dsum` are scratch of the driver's pool, freed in
/// stream order.
///
/// [`host::attention::flash_backward_dot`]: crate::host::attention::flash_backward_dot
///
/// # Errors
/// As [`flash_forward`]; [`KernelError::InvalidArgument`] for a `layout` of other heads than
/// `a`'s.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward<H: CastFloat>(
    stream: &Arc<CudaStream>,
    a: &FusedAttention,
    layout: &HeadsLayout,
    q: &impl DevicePtr<H>,
    k: &impl DevicePtr<H>,
    v: &impl DevicePtr<H>,
    y: &impl DevicePtr<H>,
    dout: &impl DevicePtr<H>,
    lse: &impl DevicePtr<f32>,
    dq: &mut impl DevicePtrMut<f32>,
    dk: &mut impl DevicePtrMut<f32>,
    dv: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let kernel = "flash_backward";
    flash_layout_check(kernel, a, layout)?;
    layout.check(kernel, y.len(), dout.len())?;
    for (what, len) in [
        ("q", q.len()),
        ("k", k.len()),
        ("v", v.len()),
        ("dq", dq.len()),
        ("dk", dk.len()),
        ("dv", dv.len()),
    ] {
        same_len(kernel, what, a.len(), len)?;
    }
    same_len(kernel, "lse", a.rows(), lse.len())?;
    if a.is_empty() {
        return Ok(());
    }
    checked::<H>(stream, "flash_backward_dot", a)?;
    // SAFETY: scratch never read before written: flash_backward_dot writes each of its
    // `pairs·t` entries (one warp a row) before the two kernels after it, on the same stream,
    // read them.
    let mut dsum = unsafe { stream.alloc::<f32>(plan::flash_backward_scratch(a)) }
        .map_err(|e| driver("cuMemAllocAsync", kernel, e))?;
    let (qp, _q) = q.device_ptr(stream);
    let (kp, _k) = k.device_ptr(stream);
    let (vp, _v) = v.device_ptr(stream);
    let (yp, _y) = y.device_ptr(stream);
    let (op, _o) = dout.device_ptr(stream);
    let (lp, _l) = lse.device_ptr(stream);
    let (sp, _s) = dsum.device_ptr_mut(stream);
    let (dqp, _dq) = dq.device_ptr_mut(stream);
    let (dkp, _dk) = dk.device_ptr_mut(stream);
    let (dvp, _dv) = dv.device_ptr_mut(stream);
    let launches = plan::flash_backward::<H>(a, layout, qp, kp, vp, yp, op, lp, sp, dqp, dkp, dvp)?;
    // SAFETY: q, k, v, dout, dq, dk and dv hold `pairs·t·d` elements, lse and dsum `pairs·t`,
    // y the token rows `layout` checked above (every head's d values within a row of `row`);
    // the operands the kernels load eight at a time are 16-byte aligned (checked by the plan).
    // Each block of dkv and dq writes only its own tile's rows. All held (`_q` … `_dv`) while
    // enqueued; dsum is freed in stream order after the kernels.
    unsafe { enqueue(stream, &launches) }
}
