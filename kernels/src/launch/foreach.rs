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

use cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::step::{AdamWChoiceArgs, AnyPrecisionChoiceArgs};
use super::plan::foreach_grid;
use super::{driver, function};
use crate::host::{
    check_anyprecision_call, check_scalars_len, same_len, AdamWChoice, AnyPrecision,
    AnyPrecisionChoice, NORM_BLOCK, NORM_ITEMS,
};
use crate::{KernelError, Program};

/// The buffers one launch of `zero_segments` carries.
pub const ZERO_SEGMENTS: usize = 96;
/// The tensors one launch of `sum_squares_many` carries.
pub const SQUARES_TENSORS: usize = 96;
/// The tensors one launch of `adamw_decided_many` carries.
pub const ADAMW_TENSORS: usize = 64;
/// The tensors one launch of `anyprecision_decided_many_*` carries.
pub const ANYPRECISION_TENSORS: usize = 48;

/// `SquaresList` of `cu/norm.cu`.
#[repr(C)]
#[derive(Clone, Copy)]
struct SquaresList {
    x: [u64; SQUARES_TENSORS],
    n: [u64; SQUARES_TENSORS],
    start: [u32; SQUARES_TENSORS + 1],
}

/// `AdamWList` of `cu/optim.cu`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamWList {
    p: [u64; ADAMW_TENSORS],
    g: [u64; ADAMW_TENSORS],
    m: [u64; ADAMW_TENSORS],
    v: [u64; ADAMW_TENSORS],
    n: [u64; ADAMW_TENSORS],
    decay: [u32; ADAMW_TENSORS],
}

// SAFETY: plain integers in C layout, the CUDA structs' fields in their order (u64 arrays,
// then a u32 array, whose tail padding C adds too), passed by value as kernel parameters.
unsafe impl DeviceRepr for SquaresList {}
// SAFETY: as `SquaresList`.
unsafe impl DeviceRepr for AdamWList {}

/// `ZeroSegments` of `cu/elementwise.cu`.
#[repr(C)]
#[derive(Clone, Copy)]
struct ZeroSegments {
    dst: [u64; ZERO_SEGMENTS],
    n: [u64; ZERO_SEGMENTS],
}

// SAFETY: as `SquaresList`.
unsafe impl DeviceRepr for ZeroSegments {}

/// `AnyPrecisionList` of `cu/any_precision.cu`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AnyPrecisionList {
    p: [u64; ANYPRECISION_TENSORS],
    g: [u64; ANYPRECISION_TENSORS],
    m: [u64; ANYPRECISION_TENSORS],
    v: [u64; ANYPRECISION_TENSORS],
    c: [u64; ANYPRECISION_TENSORS],
    n: [u64; ANYPRECISION_TENSORS],
    decay: [u32; ANYPRECISION_TENSORS],
}

// SAFETY: as `SquaresList`.
unsafe impl DeviceRepr for AnyPrecisionList {}

/// The sum of squares of each of `xs` (f64, in `sum_squares_f32`'s fixed order) into
/// `scalars[first + i]`, in two launches per [`SQUARES_TENSORS`] tensors; bitwise
/// [`host::sum_of_squares`](crate::host::sum_of_squares) of each.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for slots past `scalars` or more than 2^32 blocks;
/// allocation, compile, load and launch failures.
pub fn sum_of_squares_many(
    stream: &Arc<CudaStream>,
    xs: &[&CudaSlice<f32>],
    scalars: &mut CudaSlice<f64>,
    first: usize,
) -> Result<(), KernelError> {
    let k = "sum_squares_many";
    let end = first.checked_add(xs.len()).filter(|&e| e <= scalars.len());
    let Some(end) = end else {
        return Err(KernelError::InvalidArgument {
            kernel: k,
            reason: format!(
                "slots {first}..{first}+{} of {} scalars",
                xs.len(),
                scalars.len()
            ),
        });
    };
    if xs.is_empty() {
        return Ok(());
    }
    let chunk = NORM_BLOCK * NORM_ITEMS;
    let blocks: usize = xs.iter().map(|x| x.len().div_ceil(chunk)).sum();
    let too_many = || KernelError::InvalidArgument {
        kernel: k,
        reason: format!("{blocks} blocks of sums do not fit in 32 bits"),
    };
    u32::try_from(blocks).map_err(|_| too_many())?;
    // SAFETY: uninitialised device memory (at least one element), never read before written:
    // every block of `sum_squares_many` writes its sum before `sum_f64_final_many`, later on
    // the same stream, reads the sums of its tensor's blocks.
    let mut sums =
        unsafe { stream.alloc::<f64>(blocks.max(1)) }.map_err(|e| driver("cuMemAlloc", k, e))?;
    let many = function(stream, Program::Norm, k)?;
    let last = function(stream, Program::Norm, "sum_f64_final_many")?;
    let mut out = scalars.slice_mut(first..end);
    let mut done = 0usize;
    for batch in xs.chunks(SQUARES_TENSORS) {
        let mut l = SquaresList {
            x: [0; SQUARES_TENSORS],
            n: [0; SQUARES_TENSORS],
            start: [0; SQUARES_TENSORS + 1],
        };
        let mut guards = Vec::with_capacity(batch.len());
        let mut total = 0u32;
        for (i, x) in batch.iter().enumerate() {
            let (p, g) = x.device_ptr(stream);
            guards.push(g);
            l.x[i] = p;
            l.n[i] = x.len() as u64;
            l.start[i] = total;
            total += x.len().div_ceil(chunk) as u32;
        }
        l.start[batch.len()] = total;
        let count = batch.len() as u32;
        let grid = |g: u32| LaunchConfig {
            grid_dim: (g, 1, 1),
            block_dim: (NORM_BLOCK as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut sums_here = sums.slice_mut(..);
        let (sp, _s) = sums_here.device_ptr_mut(stream);
        if total > 0 {
            let mut b = stream.launch_builder(&many);
            b.arg(&l).arg(&count).arg(&sp);
            // SAFETY: (SquaresList l, u32 count, double* block_sums): `count` tensors of
            // `l.n` f32 at `l.x`, their blocks `l.start[k]..l.start[k + 1]` of `total`, each
            // writing one of the `blocks` ≥ `total` sums.
            unsafe { b.launch(grid(total)) }.map_err(|e| driver("cuLaunchKernel", k, e))?;
        }
        let mut here = out.slice_mut(done..done + batch.len());
        let (op, _o) = here.device_ptr_mut(stream);
        let mut b = stream.launch_builder(&last);
        b.arg(&l).arg(&sp).arg(&op);
        // SAFETY: (SquaresList l, const double* block_sums, double* out): block k reads the
        // sums `l.start[k]..l.start[k + 1]` written above and writes `out[k]`, one of the
        // `batch.len()` slots of `here`.
        unsafe { b.launch(grid(count)) }
            .map_err(|e| driver("cuLaunchKernel", "sum_f64_final_many", e))?;
        drop(guards);
        done += batch.len();
    }
    Ok(())
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
    let f = function(stream, Program::Optim, k)?;
    let [plain, decayed] = choices.each_ref().map(AdamWChoiceArgs::from);
    let (s, _s) = scalars.device_ptr(stream);
    for batch in tensors.chunks_mut(ADAMW_TENSORS) {
        let mut l = AdamWList {
            p: [0; ADAMW_TENSORS],
            g: [0; ADAMW_TENSORS],
            m: [0; ADAMW_TENSORS],
            v: [0; ADAMW_TENSORS],
            n: [0; ADAMW_TENSORS],
            decay: [0; ADAMW_TENSORS],
        };
        let mut reads = Vec::with_capacity(batch.len());
        let mut writes = Vec::with_capacity(3 * batch.len());
        let count = batch.len() as u32;
        for (i, t) in batch.iter_mut().enumerate() {
            l.n[i] = t.param.len() as u64;
            let (p, gp) = t.param.device_ptr_mut(stream);
            let (m, gm) = t.exp_avg.device_ptr_mut(stream);
            let (v, gv) = t.exp_avg_sq.device_ptr_mut(stream);
            let (g, gg) = t.grad.device_ptr(stream);
            writes.extend([gp, gm, gv]);
            reads.push(gg);
            (l.p[i], l.g[i], l.m[i], l.v[i]) = (p, g, m, v);
            l.decay[i] = u32::from(t.decay);
        }
        let longest = l.n.iter().copied().max().unwrap_or(0);
        let cfg = foreach_grid(longest, count);
        let mut b = stream.launch_builder(&f);
        b.arg(&l).arg(&count).arg(&s).arg(&plain).arg(&decayed);
        // SAFETY: (AdamWList l, u32 count, const double* s, AdamWChoice plain, AdamWChoice
        // decayed): `count` tensors whose four buffers hold `l.n` f32 each (checked above),
        // borrowed until the launch is enqueued; the scalars hold at least STEP_SQUARES.
        unsafe { b.launch(cfg) }.map_err(|e| driver("cuLaunchKernel", k, e))?;
        drop((reads, writes));
    }
    Ok(())
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
    let k = if kind.state == fsdp_device::DType::BF16 {
        "anyprecision_decided_many_bf16_state"
    } else {
        "anyprecision_decided_many_f32"
    };
    let f = function(stream, Program::AnyPrecision, k)?;
    let [plain, decayed] = choices.each_ref().map(AnyPrecisionChoiceArgs::from);
    let param_bf16 = u32::from(kind.param == fsdp_device::DType::BF16);
    let (s, _s) = scalars.device_ptr(stream);
    for batch in tensors.chunks_mut(ANYPRECISION_TENSORS) {
        let z = [0u64; ANYPRECISION_TENSORS];
        let mut l = AnyPrecisionList {
            p: z,
            g: z,
            m: z,
            v: z,
            c: z,
            n: z,
            decay: [0; ANYPRECISION_TENSORS],
        };
        let count = batch.len() as u32;
        let mut guards = Vec::with_capacity(5 * batch.len());
        for (i, t) in batch.iter_mut().enumerate() {
            l.n[i] = t.param.len() as u64;
            l.decay[i] = u32::from(t.decay);
            let (p, gp) = t.param.device_ptr_mut(stream);
            let (m, gm) = t.exp_avg.device_ptr_mut(stream);
            let (v, gv) = t.exp_avg_sq.device_ptr_mut(stream);
            let (g, gg) = t.grad.device_ptr(stream);
            (l.p[i], l.g[i], l.m[i], l.v[i]) = (p, g, m, v);
            guards.extend([gp, gm, gv, gg]);
            if let Some(c) = t.compensation.as_mut().filter(|_| kahan) {
                let (cp, gc) = c.device_ptr_mut(stream);
                l.c[i] = cp;
                guards.push(gc);
            }
        }
        let longest = l.n.iter().copied().max().unwrap_or(0);
        let cfg = foreach_grid(longest, count);
        let mut b = stream.launch_builder(&f);
        b.arg(&l)
            .arg(&count)
            .arg(&s)
            .arg(&plain)
            .arg(&decayed)
            .arg(&param_bf16);
        // SAFETY: (AnyPrecisionList l, u32 count, const double* s, AnyPrecisionChoice plain,
        // AnyPrecisionChoice decayed, u32 param_bf16): `count` tensors whose parameter and
        // gradient hold `l.n` f32 and whose state buffers `state_len(n)` f32 (checked above),
        // the compensation 0 exactly without Kahan summation, borrowed until the launch is
        // enqueued; the scalars hold at least STEP_SQUARES.
        unsafe { b.launch(cfg) }.map_err(|e| driver("cuLaunchKernel", k, e))?;
        drop(guards);
    }
    Ok(())
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
    let k = "zero_segments";
    if bufs.iter().all(|b| b.is_empty()) {
        return Ok(());
    }
    let f = function(stream, Program::Elementwise, k)?;
    for batch in bufs.chunks_mut(ZERO_SEGMENTS) {
        let mut z = ZeroSegments {
            dst: [0; ZERO_SEGMENTS],
            n: [0; ZERO_SEGMENTS],
        };
        let count = batch.len() as u32;
        let mut guards = Vec::with_capacity(batch.len());
        for (i, b) in batch.iter_mut().enumerate() {
            z.n[i] = b.len() as u64;
            let (p, g) = b.device_ptr_mut(stream);
            z.dst[i] = p;
            guards.push(g);
        }
        let longest = z.n.iter().copied().max().unwrap_or(0);
        let cfg = foreach_grid(longest, count);
        let mut b = stream.launch_builder(&f);
        b.arg(&z).arg(&count);
        // SAFETY: (ZeroSegments z, u32 count): `count` buffers of `z.n` f32 at `z.dst`,
        // borrowed mutably until the launch is enqueued.
        unsafe { b.launch(cfg) }.map_err(|e| driver("cuLaunchKernel", k, e))?;
        drop(guards);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::mem::{align_of, size_of};

    use super::*;

    fn layout<T>(name: &'static str) -> (&'static str, usize, usize) {
        (name, size_of::<T>(), align_of::<T>())
    }

    /// The lists passed by value are laid out as their CUDA C twins (checked by NVRTC).
    #[test]
    fn parameter_lists_are_laid_out_as_in_c() {
        use crate::launch::assert_c_layouts;
        assert_c_layouts(Program::Norm, &[layout::<SquaresList>("SquaresList")]);
        assert_c_layouts(
            Program::Optim,
            &[
                layout::<AdamWList>("AdamWList"),
                layout::<AdamWChoiceArgs>("AdamWChoice"),
            ],
        );
        assert_c_layouts(
            Program::AnyPrecision,
            &[
                layout::<AnyPrecisionList>("AnyPrecisionList"),
                layout::<AnyPrecisionChoiceArgs>("AnyPrecisionChoice"),
            ],
        );
        assert_c_layouts(
            Program::Elementwise,
            &[
                layout::<ZeroSegments>("ZeroSegments"),
                crate::launch::plan::struct_layout(
                    "GatherSegments",
                    &crate::launch::plan::gather_copies(&[crate::launch::GatherCopy {
                        src: 0,
                        dst: 0,
                        len: 1,
                        widen: false,
                    }])[0],
                ),
            ],
        );
        // A wrong size is refused: the check can fail.
        let wrong = std::panic::catch_unwind(|| {
            assert_c_layouts(
                Program::Norm,
                &[("SquaresList", size_of::<SquaresList>() + 8, 8)],
            )
        });
        let nvrtc = fsdp_device::cuda::libs::load_nvrtc().is_ok();
        assert_eq!(wrong.is_err(), nvrtc, "a wrong size passed NVRTC's check");
    }
}
