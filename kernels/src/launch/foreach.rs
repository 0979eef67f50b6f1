//! A step's work on many tensors in few launches (PyTorch's `_foreach_*` operations over
//! `multi_tensor_apply`): every gradient zeroed (`zero_segments` of `cu/elementwise.cu`),
//! every gradient's sum of squares into its slot of the step's scalars
//! (`sum_squares_many`, `sum_f64_final_many` of `cu/norm.cu`), AdamW as decided
//! (`adamw_decided_many` of `cu/optim.cu`) and `AnyPrecisionAdamW` as decided
//! (`anyprecision_decided_many_*` of `cu/any_precision.cu`), the tensors' addresses by value in
//! the kernels' parameters. Each tensor's result is bitwise the one-tensor launch's
//! ([`sum_of_squares`](super::sum_of_squares), [`adamw_decided`](super::adamw_decided)): the
//! same blocks sum the same elements in the same order, and AdamW is elementwise.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::plan::{self, DecidedTensor};
pub use super::plan::{ADAMW_TENSORS, ANYPRECISION_TENSORS, SQUARES_TENSORS, ZERO_SEGMENTS};
use super::{driver, enqueue};
use crate::host::{
    check_anyprecision_call, check_scalars_len, same_len, AdamWChoice, AnyPrecision,
    AnyPrecisionChoice,
};
use crate::KernelError;

/// The sum of squares of each of `xs` (f64, in `sum_squares_f32`'s fixed order) into
/// `scalars[first + i]`, in two launches per [`SQUARES_TENSORS`] tensors; bitwise
/// [`host::sum_of_squares`](crate::host::sum_of_squares) of each.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for slots past `scalars` or a batch of more than 2^31 − 1 blocks;
/// allocation, compile, load and launch failures.
pub fn sum_of_squares_many(
    stream: &Arc<CudaStream>,
    xs: &[&CudaSlice<f32>],
    scalars: &mut CudaSlice<f64>,
    first: usize,
) -> Result<(), KernelError> {
    let k = "sum_squares_many";
    let end = first.checked_add(xs.len()).filter(|&e| e <= scalars.len());
    if end.is_none() {
        return Err(KernelError::InvalidArgument {
            kernel: k,
            reason: format!(
                "slots {first}..{first}+{} of {} scalars",
                xs.len(),
                scalars.len()
            ),
        });
    }
    if xs.is_empty() {
        return Ok(());
    }
    let blocks = plan::sum_of_squares_many_blocks(xs.iter().map(|x| x.len()))?;
    // SAFETY: uninitialised device memory (at least one element), never read before written:
    // every block of `sum_squares_many` writes its sum before `sum_f64_final_many`, later on
    // the same stream, reads the sums of its tensor's blocks.
    let mut sums =
        unsafe { stream.alloc::<f64>(blocks.max(1)) }.map_err(|e| driver("cuMemAlloc", k, e))?;
    let mut guards = Vec::with_capacity(xs.len());
    let mut addrs = Vec::with_capacity(xs.len());
    for x in xs {
        let (p, g) = x.device_ptr(stream);
        guards.push(g);
        addrs.push((p, x.len()));
    }
    let (sp, _s) = sums.device_ptr_mut(stream);
    let (op, _o) = scalars.device_ptr_mut(stream);
    let launches = plan::sum_of_squares_many(&addrs, sp, op, first)?;
    // SAFETY: each tensor's `len` f32 read; the block sums, `blocks` ≥ any batch's, written
    // then read; `scalars[first..first + xs.len()]` (checked inside `scalars`) written; all
    // held until enqueued, `sums` freed in stream order after the kernels.
    unsafe { enqueue(stream, &launches) }
}

/// One tensor of [`adamw_decided_many`] and [`anyprecision_decided_many`]: the parameter, its
/// gradient, both moments (of one length; `AnyPrecisionAdamW`'s of its state's), its Kahan
/// compensation (`AnyPrecisionAdamW` with Kahan summation only) and whether its set of
/// scalars is the one with weight decay.
pub struct AdamWTensor<'a> {
    /// The parameter, updated.
    pub param: &'a mut CudaSlice<f32>,
    /// Its gradient.
    pub grad: &'a CudaSlice<f32>,
    /// The first moment, updated.
    pub exp_avg: &'a mut CudaSlice<f32>,
    /// The second moment, updated.
    pub exp_avg_sq: &'a mut CudaSlice<f32>,
    /// The Kahan compensation, updated (`None` for AdamW and without Kahan summation).
    pub compensation: Option<&'a mut CudaSlice<f32>>,
    /// `choices[1]` (with weight decay) when true, else `choices[0]`.
    pub decay: bool,
}

/// The addresses of `tensors` for [`plan::adamw_decided_many`] and
/// [`plan::anyprecision_decided_many`] (each compensation only with `kahan`; else none, as
/// AdamW takes none), with the guards that hold them until the launches are enqueued.
fn decided_addresses<'a>(
    stream: &'a CudaStream,
    tensors: &'a mut [AdamWTensor<'_>],
    kahan: bool,
) -> (Vec<SyncOnDrop<'a>>, Vec<DecidedTensor>) {
    let mut held = Vec::with_capacity(5 * tensors.len());
    let mut addrs = Vec::with_capacity(tensors.len());
    for t in tensors.iter_mut() {
        let n = t.param.len();
        let (p, gp) = t.param.device_ptr_mut(stream);
        let (m, gm) = t.exp_avg.device_ptr_mut(stream);
        let (v, gv) = t.exp_avg_sq.device_ptr_mut(stream);
        let (g, gg) = t.grad.device_ptr(stream);
        held.extend([gp, gm, gv, gg]);
        let mut compensation = None;
        if let Some(c) = t.compensation.as_mut().filter(|_| kahan) {
            let (cp, gc) = c.device_ptr_mut(stream);
            compensation = Some(cp);
            held.push(gc);
        }
        addrs.push(DecidedTensor {
            param: p,
            grad: g,
            exp_avg: m,
            exp_avg_sq: v,
            compensation,
            n,
            decay: t.decay,
        });
    }
    (held, addrs)
}

/// [`adamw_decided`](super::adamw_decided) on each of `tensors` with `choices[decay]`, in one
/// launch per [`ADAMW_TENSORS`] tensors; bitwise the one-tensor launches.
///
/// # Errors
/// [`KernelError::Length`] for a tensor whose buffers differ in length; a short scalar buffer;
/// compile, load and launch failures.
pub fn adamw_decided_many(
    stream: &CudaStream,
    choices: &[AdamWChoice; 2],
    scalars: &CudaSlice<f64>,
    tensors: &mut [AdamWTensor<'_>],
) -> Result<(), KernelError> {
    let k = "adamw_decided_many";
    check_scalars_len(k, scalars.len(), 0)?;
    for t in tensors.iter() {
        let n = t.param.len();
        same_len(k, "grad", n, t.grad.len())?;
        same_len(k, "exp_avg", n, t.exp_avg.len())?;
        same_len(k, "exp_avg_sq", n, t.exp_avg_sq.len())?;
    }
    if tensors.iter().all(|t| t.param.is_empty()) {
        return Ok(());
    }
    let (s, _s) = scalars.device_ptr(stream);
    let (_held, addrs) = decided_addresses(stream, tensors, false);
    let launches = plan::adamw_decided_many(choices, s, &addrs);
    // SAFETY: every tensor's four buffers hold `n` f32 (checked above), the scalars at least
    // STEP_SQUARES; all held until enqueued.
    unsafe { enqueue(stream, &launches) }
}

/// [`anyprecision_decided`](super::anyprecision_decided) of `kind` on each of `tensors` with
/// `choices[decay]`, in one launch per [`ANYPRECISION_TENSORS`] tensors; bitwise the
/// one-tensor launches.
///
/// # Errors
/// As [`anyprecision_decided`](super::anyprecision_decided) for any tensor (checked before
/// anything is enqueued); compile, load and launch failures.
pub fn anyprecision_decided_many(
    stream: &CudaStream,
    choices: &[AnyPrecisionChoice; 2],
    kind: AnyPrecision,
    scalars: &CudaSlice<f64>,
    tensors: &mut [AdamWTensor<'_>],
) -> Result<(), KernelError> {
    let mut kahan = false;
    for t in tensors.iter() {
        let lens = [
            scalars.len(),
            t.param.len(),
            t.grad.len(),
            t.exp_avg.len(),
            t.exp_avg_sq.len(),
        ];
        kahan = check_anyprecision_call(kind, lens, t.compensation.as_ref().map(|c| c.len()))?;
    }
    if tensors.iter().all(|t| t.param.is_empty()) {
        return Ok(());
    }
    let (s, _s) = scalars.device_ptr(stream);
    let (_held, addrs) = decided_addresses(stream, tensors, kahan);
    let launches = plan::anyprecision_decided_many(choices, kind, s, &addrs)?;
    // SAFETY: every tensor's parameter and gradient hold `n` f32 and its state buffers
    // `state_len(n)` f32 (checked above), the compensation given exactly with Kahan summation
    // (else 0 in the list: never read), the scalars at least STEP_SQUARES; all held until
    // enqueued.
    unsafe { enqueue(stream, &launches) }
}

/// Every element of each of `bufs` set to +0 (as [`memset`](super::memset) of 0), in one
/// launch per [`ZERO_SEGMENTS`] buffers.
///
/// # Errors
/// Compile, load and launch failures.
pub fn fill_zero_many(
    stream: &CudaStream,
    bufs: &mut [&mut CudaSlice<f32>],
) -> Result<(), KernelError> {
    if bufs.iter().all(|b| b.is_empty()) {
        return Ok(());
    }
    let mut guards = Vec::with_capacity(bufs.len());
    let mut addrs = Vec::with_capacity(bufs.len());
    for b in bufs.iter_mut() {
        let n = b.len();
        let (p, g) = b.device_ptr_mut(stream);
        guards.push(g);
        addrs.push((p, n));
    }
    // SAFETY: `n` f32 written at each address, every buffer borrowed mutably and held until
    // enqueued.
    unsafe { enqueue(stream, &plan::fill_zero_many(&addrs)) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{AdamW, AdamWScalars, AnyPrecisionScalars, Sgd, SgdChoice, SgdScalars};
    use crate::launch::assert_c_layouts;
    use crate::launch::plan::{struct_layout, GatherCopy, KernelLaunch};
    use crate::Program;
    use fsdp_device::DType;

    fn first(launches: Vec<KernelLaunch>) -> KernelLaunch {
        launches.into_iter().next().expect("a launch")
    }

    /// The structs passed by value are laid out as their CUDA C twins (checked by NVRTC),
    /// each as its plan builds it.
    #[test]
    fn parameter_lists_are_laid_out_as_in_c() {
        let squares = first(plan::sum_of_squares_many(&[(8, 1)], 16, 24, 0).unwrap());
        let cfg = AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let adamw = AdamWChoice([AdamWScalars::new(&cfg, 1).unwrap(); 2]);
        let tensor = DecidedTensor {
            param: 8,
            grad: 8,
            exp_avg: 8,
            exp_avg_sq: 8,
            compensation: Some(8),
            n: 1,
            decay: false,
        };
        let ap = AnyPrecisionChoice([AnyPrecisionScalars::new(&cfg, 1).unwrap(); 2]);
        let kind = AnyPrecision {
            param: DType::F32,
            state: DType::F32,
            kahan: true,
        };
        let sgd = Sgd {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        let sgd = SgdChoice([SgdScalars::new(&sgd, 1).unwrap(); 2]);
        assert_c_layouts(Program::Norm, &[struct_layout("SquaresList", &squares)]);
        assert_c_layouts(
            Program::Optim,
            &[
                struct_layout(
                    "AdamWList",
                    &first(plan::adamw_decided_many(&[adamw; 2], 8, &[tensor])),
                ),
                struct_layout(
                    "AdamWChoice",
                    &first(plan::adamw_decided(&adamw, 8, 8, 8, 8, 8, 1)),
                ),
                struct_layout("SgdChoice", &first(plan::sgd_decided(&sgd, 8, 8, 8, 8, 1))),
            ],
        );
        assert_c_layouts(
            Program::AnyPrecision,
            &[
                struct_layout(
                    "AnyPrecisionList",
                    &first(plan::anyprecision_decided_many(&[ap; 2], kind, 8, &[tensor]).unwrap()),
                ),
                struct_layout(
                    "AnyPrecisionChoice",
                    &first(
                        plan::anyprecision_decided(&ap, kind, 8, 8, 8, 8, 8, Some(8), 1).unwrap(),
                    ),
                ),
            ],
        );
        let copy = GatherCopy {
            src: 8,
            dst: 8,
            len: 1,
            widen: false,
        };
        assert_c_layouts(
            Program::Elementwise,
            &[
                struct_layout("ZeroSegments", &first(plan::fill_zero_many(&[(8, 1)]))),
                struct_layout("GatherSegments", &first(plan::gather_copies(&[copy]))),
            ],
        );
        // A wrong size is refused: the check can fail.
        let (_, size, align) = struct_layout("SquaresList", &squares);
        let wrong = std::panic::catch_unwind(|| {
            assert_c_layouts(Program::Norm, &[("SquaresList", size + 8, align)])
        });
        let nvrtc = fsdp_device::cuda::libs::load_nvrtc().is_ok();
        assert_eq!(wrong.is_err(), nvrtc, "a wrong size passed NVRTC's check");
    }
}
