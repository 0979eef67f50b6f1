//! Launches of `cu/attention.cu`: causal attention fused into tiles on tensor cores (flash
//! attention), twins in [`host::attention`](crate::host::attention), which agree with the
//! kernels within the rounding of sums taken in another order.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::nn::launched;
use super::{driver, function};
use crate::host::attention::FusedAttention;
use crate::host::nn::HeadsLayout;
use crate::host::{same_len, CastFloat};
use crate::{KernelError, Program};

/// The values of one head the CUDA kernels take: 32 or 64 (GPT-2's heads are 64 at every
/// size).
pub const FLASH_HEAD_DIMS: [usize; 2] = [32, 64];
/// Rows of one tile (a block's queries or keys, 16 a warp).
pub const FLASH_TILE: usize = 64;
const FLASH_THREADS: u32 = 128;

/// Checks what the kernels take and returns the kernel's name for `H` and the head's size,
/// and the number of tiles of a pair: heads of [`FLASH_HEAD_DIMS`] values, bf16 or f16 operands, compute
/// capability 8.0 or newer, at most 65,535 pairs (the grid's second dimension) and `t` within
/// an `i32`.
fn checked<H: CastFloat>(
    stream: &CudaStream,
    kernel: &'static str,
    a: &FusedAttention,
) -> Result<(String, u32), KernelError> {
    let bad = |reason: String| Err(KernelError::InvalidArgument { kernel, reason });
    if H::NAME != "bf16" && H::NAME != "f16" {
        return bad(format!(
            "fused attention reads bf16 or f16 operands (tensor cores), not {}",
            H::NAME
        ));
    }
    if !FLASH_HEAD_DIMS.contains(&a.d) {
        return bad(format!(
            "fused attention on CUDA takes heads of 32 or 64 values, not {}",
            a.d
        ));
    }
    if a.pairs > u16::MAX as usize || i32::try_from(a.t).is_err() {
        return bad(format!(
            "{} (sequence, head) pairs of {} tokens: at most 65535 pairs of at most 2^31 - 1",
            a.pairs, a.t
        ));
    }
    let cc = stream
        .context()
        .compute_capability()
        .map_err(|e| driver("cuDeviceGetAttribute", kernel, e))?;
    if cc.0 < 8 {
        return bad(format!(
            "fused attention needs compute capability 8.0 or newer (bf16 tensor cores); this \
             device has {}.{}",
            cc.0, cc.1
        ));
    }
    Ok((
        format!("{kernel}_{}_d{}", H::NAME, a.d),
        a.t.div_ceil(FLASH_TILE) as u32,
    ))
}

/// Device addresses must be 16-byte aligned: the kernels load eight 16-bit values at once.
fn aligned(kernel: &'static str, what: &'static str, addr: u64) -> Result<(), KernelError> {
    if addr % 16 == 0 {
        return Ok(());
    }
    Err(KernelError::InvalidArgument {
        kernel,
        reason: format!("{what} at {addr:#x} is not 16-byte aligned"),
    })
}

fn tiles_config(tiles: u32, pairs: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (tiles, pairs as u32, 1),
        block_dim: (FLASH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
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
    let (name, tiles) = checked::<H>(stream, kernel, a)?;
    let f = function(stream, Program::Attention, &name)?;
    let (qp, _q) = q.device_ptr(stream);
    let (kp, _k) = k.device_ptr(stream);
    let (vp, _v) = v.device_ptr(stream);
    let (yp, _y) = y.device_ptr_mut(stream);
    let (lp, _l) = lse.device_ptr_mut(stream);
    for (what, p) in [("q", qp), ("k", kp), ("v", vp), ("y", yp)] {
        aligned(kernel, what, p)?;
    }
    let (t, scale2) = (a.t as i32, a.scale2());
    let mut b = stream.launch_builder(&f);
    b.arg(&qp)
        .arg(&kp)
        .arg(&vp)
        .arg(&yp)
        .arg(&lp)
        .arg(&t)
        .arg(&scale2);
    // SAFETY: flash_forward_<H>_d<d>(const u16* q, k, v, float* y, float* lse, int t, float
    // scale2): q, k, v and y hold `pairs·t·d` elements (checked above), lse `pairs·t`; the
    // grid has one block per tile of 64 rows and pair, and each block reads and writes only
    // its pair's rows below t. The slices are held (`_q` … `_l`) while it is enqueued.
    launched(kernel, unsafe { b.launch(tiles_config(tiles, a.pairs)) })
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
    if FusedAttention::of(layout, a.scale) != *a {
        return Err(KernelError::InvalidArgument {
            kernel,
            reason: format!("the output's layout {layout:?} is not of the heads of {a:?}"),
        });
    }
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
    let (dot, tiles) = checked::<H>(stream, "flash_backward_dot", a)?;
    let name = |k: &str| format!("{k}_{}_d{}", H::NAME, a.d);
    // SAFETY: scratch never read before written: flash_backward_dot writes each of its
    // `pairs·t` entries (one warp a row) before the two kernels after it, on the same stream,
    // read them.
    let mut dsum = unsafe { stream.alloc::<f32>(a.rows()) }
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
    for (what, p) in [("q", qp), ("k", kp), ("v", vp), ("dout", op), ("dq", dqp)] {
        aligned(kernel, what, p)?;
    }
    for (what, p) in [("dk", dkp), ("dv", dvp)] {
        aligned(kernel, what, p)?;
    }
    let (t, scale, scale2) = (a.t as i32, a.scale, a.scale2());
    let (rows, heads) = (a.rows() as u64, layout.h as i32);
    let (row, offset) = (layout.row as i32, layout.offset as i32);

    let f = function(stream, Program::Attention, &dot)?;
    let mut b = stream.launch_builder(&f);
    b.arg(&op)
        .arg(&yp)
        .arg(&sp)
        .arg(&rows)
        .arg(&t)
        .arg(&heads)
        .arg(&row)
        .arg(&offset);
    let warps = FLASH_THREADS as usize / 32;
    let cfg = LaunchConfig {
        grid_dim: (a.rows().div_ceil(warps) as u32, 1, 1),
        block_dim: (FLASH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: flash_backward_dot_<H>_d<d>(const u16* dout, const u16* y, float* dsum, u64
    // rows, int t, int heads, int row, int offset): one warp per row below `rows` = pairs·t;
    // dout holds rows·d values, y the token rows `layout` checked above (every head's d
    // values within a row of `row`), dsum `rows` floats.
    launched("flash_backward_dot", unsafe { b.launch(cfg) })?;

    let k = name("flash_backward_dkv");
    let f = function(stream, Program::Attention, &k)?;
    let mut b = stream.launch_builder(&f);
    b.arg(&qp).arg(&kp).arg(&vp).arg(&op).arg(&lp).arg(&sp);
    b.arg(&dkp).arg(&dvp).arg(&t).arg(&scale).arg(&scale2);
    // SAFETY: flash_backward_dkv_<H>_d<d>(q, k, v, dout, lse, dsum, float* dk, float* dv,
    // int t, float scale, float scale2): every tensor `pairs·t·d` (lse and dsum `pairs·t`), checked
    // above; one block per key tile and pair writes only its own keys' rows.
    launched("flash_backward_dkv", unsafe {
        b.launch(tiles_config(tiles, a.pairs))
    })?;

    let k = name("flash_backward_dq");
    let f = function(stream, Program::Attention, &k)?;
    let mut b = stream.launch_builder(&f);
    b.arg(&qp).arg(&kp).arg(&vp).arg(&op).arg(&lp).arg(&sp);
    b.arg(&dqp).arg(&t).arg(&scale).arg(&scale2);
    // SAFETY: flash_backward_dq_<H>_d<d>(q, k, v, dout, lse, dsum, float* dq, int t, float
    // scale, float scale2): as above; one block per query tile and pair writes only its rows of dq.
    launched("flash_backward_dq", unsafe {
        b.launch(tiles_config(tiles, a.pairs))
    })
}
