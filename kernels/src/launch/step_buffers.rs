//! Launchers over stream-ordered CUDA buffers ([`fsdp_device::Buffer`]) of the kernels that
//! end a step decided on the device, for the engine's grad scaler and non-finite rule there:
//! the gradients unscaled by the scale on the device (`unscale_by_f32`), the engine's decision
//! (`engine_decide`), and AdamW and SGD as decided (`adamw_decided_f32`, `sgd_decided_f32`).
//! Each checks its buffers as [`axpby_buffer`](super::axpby_buffer) does and returns the
//! event after its launch.

use fsdp_device::{Buffer, DType, Event, Stream};

use super::buffers::{launch_on_buffers, ordered};
use crate::host::{AdamWChoice, EngineDecision, SgdChoice};
use crate::KernelError;

/// `x *= 1 / scale[0]` ([`unscale_by`](super::unscale_by)) on a stream-ordered `f32` CUDA
/// buffer, with the scale a one-element `f64` buffer on the device, on `stream`.
///
/// # Errors
/// As [`axpby_buffer`](super::axpby_buffer); a scale of other than one element.
pub fn unscale_by_buffer(
    x: &Buffer,
    scale: &Buffer,
    stream: &Stream,
) -> Result<Event, KernelError> {
    let dtypes = [DType::F64, DType::F32];
    launch_on_buffers(
        "unscale_by_f32",
        stream,
        &[scale],
        &[x],
        &dtypes,
        |cu, p| {
            // SAFETY: addresses and lengths of ordered buffers (`launch_on_buffers`).
            let (s, mut x) = unsafe { (ordered::<f64>(cu, p[0]), ordered::<f32>(cu, p[1])) };
            super::unscale_by(cu, &mut x, &s)
        },
    )
}

/// The end of the engine's step ([`engine_decide`](super::engine_decide)) into its `f64`
/// `scalars` on the device, from the one-element `f64` buffers `sharded` and `replicated`
/// and, with the non-finite rule, `loss`, on `stream`.
///
/// # Errors
/// As [`axpby_buffer`](super::axpby_buffer); as [`engine_decide`](super::engine_decide).
pub fn engine_decide_buffers(
    decision: &EngineDecision,
    scalars: &Buffer,
    sharded: &Buffer,
    replicated: &Buffer,
    loss: Option<&Buffer>,
    stream: &Stream,
) -> Result<Event, KernelError> {
    let mut reads = vec![sharded, replicated];
    reads.extend(loss);
    let dtypes = vec![DType::F64; reads.len() + 1];
    launch_on_buffers(
        "engine_decide",
        stream,
        &reads,
        &[scalars],
        &dtypes,
        |cu, p| {
            // SAFETY: addresses and lengths of ordered, non-overlapping buffers
            // (`launch_on_buffers`): the parts, the loss when given, then the scalars.
            let (sh, re, mut s) = unsafe {
                (
                    ordered::<f64>(cu, p[0]),
                    ordered::<f64>(cu, p[1]),
                    ordered::<f64>(cu, p[p.len() - 1]),
                )
            };
            // SAFETY: as above, the loss's address and length (the third buffer when given).
            let l = loss.map(|_| unsafe { ordered::<f64>(cu, p[2]) });
            super::engine_decide(cu, decision, &mut s, &sh, &re, l.as_ref())
        },
    )
}

/// AdamW as decided ([`adamw_decided`](super::adamw_decided)) on stream-ordered `f32` CUDA
/// buffers of one length, with the step's `f64` `scalars`, on `stream`.
///
/// # Errors
/// As [`axpby_buffer`](super::axpby_buffer); as [`adamw_decided`](super::adamw_decided).
pub fn adamw_decided_buffers(
    choice: &AdamWChoice,
    scalars: &Buffer,
    param: &Buffer,
    grad: &Buffer,
    exp_avg: &Buffer,
    exp_avg_sq: &Buffer,
    stream: &Stream,
) -> Result<Event, KernelError> {
    let mut dtypes = [DType::F32; 5];
    dtypes[0] = DType::F64;
    let writes = [param, exp_avg, exp_avg_sq];
    launch_on_buffers(
        "adamw_decided",
        stream,
        &[scalars, grad],
        &writes,
        &dtypes,
        |cu, p| {
            // SAFETY: addresses and lengths of ordered, non-overlapping buffers
            // (`launch_on_buffers`).
            let (s, g, mut param, mut m, mut v) = unsafe {
                (
                    ordered::<f64>(cu, p[0]),
                    ordered::<f32>(cu, p[1]),
                    ordered(cu, p[2]),
                    ordered(cu, p[3]),
                    ordered(cu, p[4]),
                )
            };
            super::adamw_decided(cu, choice, &s, &mut param, &g, &mut m, &mut v)
        },
    )
}

/// SGD as decided ([`sgd_decided`](super::sgd_decided)) on stream-ordered `f32` CUDA buffers
/// of one length (the momentum buffer absent without momentum), with the step's `f64`
/// `scalars`, on `stream`.
///
/// # Errors
/// As [`axpby_buffer`](super::axpby_buffer); as [`sgd_decided`](super::sgd_decided).
pub fn sgd_decided_buffers(
    choice: &SgdChoice,
    scalars: &Buffer,
    param: &Buffer,
    grad: &Buffer,
    momentum_buffer: Option<&Buffer>,
    stream: &Stream,
) -> Result<Event, KernelError> {
    let writes: Vec<&Buffer> = std::iter::once(param).chain(momentum_buffer).collect();
    let mut dtypes = vec![DType::F64];
    dtypes.resize(2 + writes.len(), DType::F32);
    launch_on_buffers(
        "sgd_decided",
        stream,
        &[scalars, grad],
        &writes,
        &dtypes,
        |cu, p| {
            // SAFETY: addresses and lengths of ordered, non-overlapping buffers; without
            // momentum the kernel never touches the (empty) buffer.
            let (s, g, mut param, mut buf) = unsafe {
                (
                    ordered::<f64>(cu, p[0]),
                    ordered::<f32>(cu, p[1]),
                    ordered(cu, p[2]),
                    ordered(cu, p.get(3).copied().unwrap_or((0, 0))),
                )
            };
            super::sgd_decided(cu, choice, &s, &mut param, &g, &mut buf)
        },
    )
}
