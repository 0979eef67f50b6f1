//! Safe launch functions: a cudarc `CudaStream` and device slices (`CudaSlice`, `CudaView`,
//! `CudaViewMut`) in, the kernel enqueued on the stream out. Lengths are checked before
//! anything is launched. Each program is compiled once per compute capability and loaded once
//! per CUDA context (the first launch of a program on a device compiles it: tens of
//! milliseconds).
//!
//! The functions only enqueue: ordering against other streams is the caller's (record an
//! event and make the other stream wait on it), and slices must outlive the work.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::host::{
    check_reduce, same_len, AdamWScalars, CastFloat, KernelFloat, MomentFloat, ReduceKind,
    SgdScalars, NORM_BLOCK, NORM_ITEMS,
};
use crate::{compile, KernelError, Program};

mod attention;
mod buffers;
mod foreach;
mod gather;
mod nn;
mod nn_embed;
mod nn_heads;
mod nn_loss;
mod step;
mod step_buffers;
pub use attention::{flash_backward, flash_forward, FLASH_HEAD_DIMS, FLASH_TILE};
pub use buffers::{
    adamw_buffers, anyprecision_buffers, axpby_buffer, cast_buffer, clip_coefficient_buffers,
    div_scalar_buffer, scale_by_buffer, sgd_buffers, sum_of_squares_buffer,
};
pub use foreach::{
    adamw_decided_many, anyprecision_decided_many, fill_zero_many, foreach_grid,
    sum_of_squares_many, AdamWTensor, ADAMW_TENSORS, ANYPRECISION_TENSORS, SQUARES_TENSORS,
    ZERO_SEGMENTS,
};
pub use gather::{gather_copies, gather_grid, GatherCopy, GATHER_SEGMENTS};
pub use nn::{
    bias_grad, causal_softmax_backward, causal_softmax_forward, causal_softmax_forward_both,
    gelu_backward, gelu_forward, layernorm_backward_input, layernorm_backward_params,
    layernorm_forward, per_column_tile, per_row, per_warp_row,
};
pub use nn_embed::{
    embedding_backward_positions, embedding_backward_tokens, embedding_backward_tokens_host_ids,
    embedding_forward,
};
pub use nn_heads::{bias_add, heads_merge, heads_split};
pub use nn_loss::{cross_entropy_fused, cross_entropy_fused_in_place};
pub use step::{
    adamw_decided, anyprecision_decided, engine_decide, loss_accumulate, sgd_decided, step_decide,
    unscale_by,
};
pub use step_buffers::{
    adamw_decided_buffers, engine_decide_buffers, sgd_decided_buffers, unscale_by_buffer,
};

/// Threads per block of the element-wise kernels.
const BLOCK: u32 = 256;
/// At most this many blocks; the kernels loop over the rest (grid-stride).
const MAX_BLOCKS: usize = 1 << 20;

type PtxKey = (Program, (i32, i32));
static PTX: Mutex<Option<HashMap<PtxKey, String>>> = Mutex::new(None);
type ModuleKey = (usize, Program);
static MODULES: Mutex<Option<HashMap<ModuleKey, Arc<CudaModule>>>> = Mutex::new(None);

fn driver(op: &'static str, kernel: &str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::Driver {
        op,
        kernel: kernel.to_string(),
        message: format!("{e:?}"),
    }
}

/// The PTX of `program` for compute capability `cc`, compiled on first use.
pub fn ptx_for(program: Program, cc: (i32, i32)) -> Result<String, KernelError> {
    let mut cache = PTX.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.get_or_insert_with(HashMap::new);
    if let Some(p) = cache.get(&(program, cc)) {
        return Ok(p.clone());
    }
    let ptx = compile(program, &format!("compute_{}{}", cc.0, cc.1))?.ptx;
    cache.insert((program, cc), ptx.clone());
    Ok(ptx)
}

/// `kernel` of `program`, in the module loaded into `stream`'s context.
fn function(
    stream: &CudaStream,
    program: Program,
    kernel: &str,
) -> Result<CudaFunction, KernelError> {
    let ctx = stream.context();
    let key = (ctx.cu_ctx() as usize, program);
    let module = {
        let mut modules = MODULES.lock().unwrap_or_else(|e| e.into_inner());
        let modules = modules.get_or_insert_with(HashMap::new);
        match modules.get(&key) {
            Some(m) => m.clone(),
            None => {
                let cc = ctx
                    .compute_capability()
                    .map_err(|e| driver("cuDeviceGetAttribute", kernel, e))?;
                let ptx = ptx_for(program, cc)?;
                let m = ctx
                    .load_module(Ptx::from_src(ptx))
                    .map_err(|e| driver("cuModuleLoadData", program.name(), e))?;
                modules.insert(key, m.clone());
                m
            }
        }
    };
    module
        .load_function(kernel)
        .map_err(|e| driver("cuModuleGetFunction", kernel, e))
}

/// The grid of the element-wise kernels over `n` elements: blocks of 256 threads, at most 2^20
/// of them (the kernels stride over the rest). Public so that the kernels' host emulation
/// (`tests/emulated_*`) launches them on the launchers' own grids.
pub fn config(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Cast `src` into `dst` (round to nearest even), e.g. f32 master weights to bf16.
///
/// # Errors
/// [`KernelError::Length`] if the lengths differ, [`KernelError::InvalidArgument`] for a cast
/// of a type to itself; compile, load and launch failures.
pub fn cast<S: CastFloat, D: CastFloat>(
    stream: &CudaStream,
    src: &impl DevicePtr<S>,
    dst: &mut impl DevicePtrMut<D>,
) -> Result<(), KernelError> {
    let n = src.len();
    same_len("cast", "dst", n, dst.len())?;
    let (s, _s) = src.device_ptr(stream);
    let (d, _d) = dst.device_ptr_mut(stream);
    // SAFETY: `s` and `d` are the slices' addresses on this stream, both `n` elements long,
    // held for the launches (`_s`, `_d`); distinct slices cannot overlap.
    unsafe { cast_raw::<S, D>(stream, s, d, n) }
}

/// [`cast`] on raw device addresses of `stream`'s context (`n` elements): for memory that is
/// not a cudarc slice (a communicator's staging buffer, a peer's buffer).
///
/// # Safety
/// `s` and `d` must be device addresses of `stream`'s context, aligned for their types, valid
/// for `n` elements of `S` and `D` until the kernels have run (ordered by the caller), and not
/// overlapping.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a cast of a type to itself; compile, load and launch
/// failures.
pub unsafe fn cast_raw<S: CastFloat, D: CastFloat>(
    stream: &CudaStream,
    s: u64,
    d: u64,
    n: usize,
) -> Result<(), KernelError> {
    if S::NAME == D::NAME {
        return Err(KernelError::InvalidArgument {
            kernel: "cast",
            reason: format!("a cast of {} to itself (copy instead)", S::NAME),
        });
    }
    if n == 0 {
        return Ok(());
    }
    // f32 → bf16 (every bf16 product's operands) four elements a thread where the addresses
    // allow 16-byte loads and 8-byte stores; the scalar kernel casts the rest.
    let mut done = 0usize;
    if S::NAME == "f32" && D::NAME == "bf16" && s % 16 == 0 && d % 8 == 0 && n >= 4 {
        let groups = (n / 4) as u64;
        let f = function(stream, Program::Cast, "cast_f32_bf16_x4")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&s).arg(&d).arg(&groups);
        // SAFETY: `cast_f32_bf16_x4(const f32x4*, u32x2*, u64 groups)` reads `4·groups ≤ n`
        // f32 of `src` (16-byte aligned, checked above) and writes as many bf16 of `dst`
        // (8-byte aligned), both `n` long.
        unsafe { b.launch(config(groups as usize)) }
            .map_err(|e| driver("cuLaunchKernel", "cast_f32_bf16_x4", e))?;
        done = 4 * (n / 4);
    }
    if done < n {
        let kernel = format!("cast_{}_{}", S::NAME, D::NAME);
        let f = function(stream, Program::Cast, &kernel)?;
        let (s_rest, d_rest) = (
            s + (done * std::mem::size_of::<S>()) as u64,
            d + (done * std::mem::size_of::<D>()) as u64,
        );
        let rest = (n - done) as u64;
        let mut b = stream.launch_builder(&f);
        b.arg(&s_rest).arg(&d_rest).arg(&rest);
        // SAFETY: `cast_<S>_<D>(const S*, D*, u64)` reads the last `n − done` elements of
        // `src` and writes as many of `dst`, both `n` elements of those types.
        unsafe { b.launch(config(n - done)) }.map_err(|e| driver("cuLaunchKernel", &kernel, e))?;
    }
    Ok(())
}

/// `y = alpha·x + beta·y` (each product and the sum rounded; 16-bit types in f32).
///
/// # Errors
/// [`KernelError::Length`]; compile, load and launch failures.
pub fn axpby<T: KernelFloat>(
    stream: &CudaStream,
    alpha: T::C,
    x: &impl DevicePtr<T>,
    beta: T::C,
    y: &mut impl DevicePtrMut<T>,
) -> Result<(), KernelError> {
    let n = x.len();
    same_len("axpby", "y", n, y.len())?;
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("axpby_{}", T::NAME);
    let f = function(stream, Program::Elementwise, &kernel)?;
    let (xp, _x) = x.device_ptr(stream);
    let (yp, _y) = y.device_ptr_mut(stream);
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&alpha).arg(&xp).arg(&beta).arg(&yp).arg(&n64);
    // SAFETY: `axpby_<T>(C, const T*, C, T*, u64)` with C = T's compute type, `n` elements.
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", &kernel, e))?;
    Ok(())
}

/// `y = y / d` (the quotient rounded once to `T`; 16-bit types divide in f32): the twin
/// [`host::div_scalar`](crate::host::div_scalar), bitwise.
///
/// # Errors
/// Compile, load and launch failures.
pub fn div_scalar<T: KernelFloat>(
    stream: &CudaStream,
    d: T::C,
    y: &mut impl DevicePtrMut<T>,
) -> Result<(), KernelError> {
    let n = y.len();
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("div_scalar_{}", T::NAME);
    let f = function(stream, Program::Elementwise, &kernel)?;
    let (yp, _y) = y.device_ptr_mut(stream);
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&d).arg(&yp).arg(&n64);
    // SAFETY: `div_scalar_<T>(C, T*, u64)` with C = T's compute type, `n` elements.
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", &kernel, e))?;
    Ok(())
}

/// `x *= c[0]` (the coefficient rounded to f32; nothing when it is 1): the twin
/// [`host::scale_by`](crate::host::scale_by), bitwise.
///
/// # Errors
/// [`KernelError::Length`] unless `c` has one element; compile, load and launch failures.
pub fn scale_by(
    stream: &CudaStream,
    x: &mut impl DevicePtrMut<f32>,
    c: &impl DevicePtr<f64>,
) -> Result<(), KernelError> {
    same_len("scale_by", "c", 1, c.len())?;
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let f = function(stream, Program::Elementwise, "scale_by_f32")?;
    let (xp, _x) = x.device_ptr_mut(stream);
    let (cp, _c) = c.device_ptr(stream);
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&xp).arg(&cp).arg(&n64);
    // SAFETY: `scale_by_f32(float*, const double*, u64)`: `n` elements of `x`, one of `c`.
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", "scale_by_f32", e))?;
    Ok(())
}

/// The global norm and its clip coefficient from the squared parts `sharded[0]` and
/// `replicated[0]` into `out` (two elements: the norm, then the coefficient): the twin
/// [`host::clip_coefficient`](crate::host::clip_coefficient), bitwise.
///
/// # Errors
/// [`KernelError::Length`] for parts of other than one element or an `out` of other than
/// two; compile, load and launch failures.
pub fn clip_coefficient(
    stream: &CudaStream,
    sharded: &impl DevicePtr<f64>,
    replicated: &impl DevicePtr<f64>,
    max_norm: f64,
    out: &mut impl DevicePtrMut<f64>,
) -> Result<(), KernelError> {
    same_len("clip_coefficient", "sharded", 1, sharded.len())?;
    same_len("clip_coefficient", "replicated", 1, replicated.len())?;
    same_len("clip_coefficient", "out", 2, out.len())?;
    let f = function(stream, Program::Norm, "clip_coefficient")?;
    let (sp, _s) = sharded.device_ptr(stream);
    let (rp, _r) = replicated.device_ptr(stream);
    let (op, _o) = out.device_ptr_mut(stream);
    let mut b = stream.launch_builder(&f);
    b.arg(&sp).arg(&rp).arg(&max_norm).arg(&op);
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `clip_coefficient(const double*, const double*, double, double*)`, one thread:
    // reads one element of each part, writes two of `out` (lengths checked above).
    unsafe { b.launch(one) }.map_err(|e| driver("cuLaunchKernel", "clip_coefficient", e))?;
    Ok(())
}

/// Fill `dst` with `value`.
///
/// # Errors
/// Compile, load and launch failures.
pub fn memset<T: KernelFloat>(
    stream: &CudaStream,
    dst: &mut impl DevicePtrMut<T>,
    value: T,
) -> Result<(), KernelError> {
    let n = dst.len();
    if n == 0 {
        return Ok(());
    }
    let width = std::mem::size_of::<T>() * 8;
    let kernel = format!("memset_b{width}");
    let f = function(stream, Program::Elementwise, &kernel)?;
    let (d, _d) = dst.device_ptr_mut(stream);
    let (n64, bits) = (n as u64, value.bits());
    let (v16, v32) = (bits as u16, bits as u32);
    let mut b = stream.launch_builder(&f);
    b.arg(&d);
    match width {
        16 => b.arg(&v16),
        32 => b.arg(&v32),
        _ => b.arg(&bits),
    };
    b.arg(&n64);
    // SAFETY: `memset_b<W>(uW*, uW, u64)` writes `n` elements of `size_of::<T>()` bytes, the
    // value passed with that width.
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", &kernel, e))?;
    Ok(())
}

fn launch_reduce<T: KernelFloat>(
    stream: &CudaStream,
    op: ReduceKind,
    dst: u64,
    acc: u64,
    x: u64,
    n: usize,
    finish: Option<u32>,
) -> Result<(), KernelError> {
    let kernel = format!("reduce_{}_{}", op.kernel_op(), T::NAME);
    let f = function(stream, Program::Reduce, &kernel)?;
    let finish_n: u32 = match (op, finish) {
        (ReduceKind::Avg, Some(k)) => k,
        _ => 0,
    };
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&dst).arg(&acc).arg(&x).arg(&n64).arg(&finish_n);
    // SAFETY: `reduce_<op>_<T>(T*, const T*, const T*, u64, u32)` over `n` elements of each
    // pointer (checked by the callers); `dst` may equal `x` (element-wise, no restrict).
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", &kernel, e))?;
    Ok(())
}

/// `dst = acc ⊕ x` with the ring's arithmetic; with `finish = Some(n)` an average is divided
/// by `n` (its last step; ignored by the other operations).
///
/// # Errors
/// [`KernelError::Length`], [`KernelError::InvalidArgument`] for `finish == Some(0)`;
/// compile, load and launch failures.
pub fn reduce<T: KernelFloat>(
    stream: &CudaStream,
    op: ReduceKind,
    dst: &mut impl DevicePtrMut<T>,
    acc: &impl DevicePtr<T>,
    x: &impl DevicePtr<T>,
    finish: Option<u32>,
) -> Result<(), KernelError> {
    let n = dst.len();
    check_reduce("reduce", n, acc.len(), finish)?;
    same_len("reduce", "x", n, x.len())?;
    if n == 0 {
        return Ok(());
    }
    let (a, _a) = acc.device_ptr(stream);
    let (xp, _x) = x.device_ptr(stream);
    let (d, _d) = dst.device_ptr_mut(stream);
    launch_reduce::<T>(stream, op, d, a, xp, n, finish)
}

/// [`reduce`] on raw device addresses of `stream`'s context (`dst = acc ⊕ x`, `n` elements):
/// for callers that hold device pointers rather than cudarc slices (the CUDA ring of
/// `fsdp-collectives`).
///
/// # Safety
/// `dst`, `acc` and `x` must be device addresses of `stream`'s context, aligned for `T` and
/// valid for `n` elements until the kernel has run (ordered by the caller); `dst` may equal `x`
/// or `acc` (element-wise), and must not otherwise overlap them.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for `finish == Some(0)`; compile, load and launch failures.
pub unsafe fn reduce_raw<T: KernelFloat>(
    stream: &CudaStream,
    op: ReduceKind,
    dst: u64,
    acc: u64,
    x: u64,
    n: usize,
    finish: Option<u32>,
) -> Result<(), KernelError> {
    check_reduce("reduce", n, n, finish)?;
    if n == 0 {
        return Ok(());
    }
    launch_reduce::<T>(stream, op, dst, acc, x, n, finish)
}

/// In place: `dst = acc ⊕ dst` (see [`reduce`]).
///
/// # Errors
/// As [`reduce`].
pub fn reduce_in_place<T: KernelFloat>(
    stream: &CudaStream,
    op: ReduceKind,
    dst: &mut impl DevicePtrMut<T>,
    acc: &impl DevicePtr<T>,
    finish: Option<u32>,
) -> Result<(), KernelError> {
    let n = dst.len();
    check_reduce("reduce", n, acc.len(), finish)?;
    if n == 0 {
        return Ok(());
    }
    let (a, _a) = acc.device_ptr(stream);
    let (d, _d) = dst.device_ptr_mut(stream);
    launch_reduce::<T>(stream, op, d, a, d, n, finish)
}

/// One fused AdamW step on a flat f32 shard, moments in `S` (f32, or bf16).
///
/// # Errors
/// [`KernelError::Length`]; compile, load and launch failures.
pub fn adamw<S: MomentFloat>(
    stream: &CudaStream,
    s: &AdamWScalars,
    param: &mut impl DevicePtrMut<f32>,
    grad: &impl DevicePtr<f32>,
    exp_avg: &mut impl DevicePtrMut<S>,
    exp_avg_sq: &mut impl DevicePtrMut<S>,
) -> Result<(), KernelError> {
    let n = param.len();
    same_len("adamw", "grad", n, grad.len())?;
    same_len("adamw", "exp_avg", n, exp_avg.len())?;
    same_len("adamw", "exp_avg_sq", n, exp_avg_sq.len())?;
    if n == 0 {
        return Ok(());
    }
    let f = function(stream, Program::Optim, S::ADAMW_KERNEL)?;
    let (p, _p) = param.device_ptr_mut(stream);
    let (g, _g) = grad.device_ptr(stream);
    let (m, _m) = exp_avg.device_ptr_mut(stream);
    let (v, _v) = exp_avg_sq.device_ptr_mut(stream);
    let (n64, lerp_small) = (n as u64, u32::from(s.lerp_small));
    let mut b = stream.launch_builder(&f);
    b.arg(&p).arg(&g).arg(&m).arg(&v).arg(&n64);
    b.arg(&s.decay)
        .arg(&s.w1)
        .arg(&s.one_minus_w1)
        .arg(&lerp_small);
    b.arg(&s.beta2)
        .arg(&s.one_minus_beta2)
        .arg(&s.neg_step_size);
    b.arg(&s.bc2_sqrt).arg(&s.eps);
    // SAFETY: the kernel's signature (float*, const float*, S*, S*, u64, 4 floats, u32,
    // 5 floats) in that order; every slice has `n` elements.
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", S::ADAMW_KERNEL, e))?;
    Ok(())
}

/// One fused SGD step on a flat f32 shard; `momentum_buffer` may be empty when the momentum
/// is 0.
///
/// # Errors
/// [`KernelError::Length`]; compile, load and launch failures.
pub fn sgd(
    stream: &CudaStream,
    s: &SgdScalars,
    param: &mut impl DevicePtrMut<f32>,
    grad: &impl DevicePtr<f32>,
    momentum_buffer: &mut impl DevicePtrMut<f32>,
) -> Result<(), KernelError> {
    let n = param.len();
    same_len("sgd", "grad", n, grad.len())?;
    if s.uses_buffer() {
        same_len("sgd", "momentum_buffer", n, momentum_buffer.len())?;
    }
    if n == 0 {
        return Ok(());
    }
    let f = function(stream, Program::Optim, "sgd_f32")?;
    let (p, _p) = param.device_ptr_mut(stream);
    let (g, _g) = grad.device_ptr(stream);
    let (m, _m) = momentum_buffer.device_ptr_mut(stream);
    let n64 = n as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&p).arg(&g).arg(&m).arg(&n64);
    b.arg(&s.neg_lr)
        .arg(&s.wd)
        .arg(&s.momentum)
        .arg(&s.damp)
        .arg(&s.flags);
    // SAFETY: `sgd_f32(float*, const float*, float*, u64, 4 floats, u32)`; the buffer is only
    // touched when the flags say momentum, and then it has `n` elements.
    unsafe { b.launch(config(n)) }.map_err(|e| driver("cuLaunchKernel", "sgd_f32", e))?;
    Ok(())
}

/// The sum of squares of `x` in f64 into `out[0]` (one element), in a fixed order: bitwise
/// equal to [`host::sum_of_squares`](crate::host::sum_of_squares) on every GPU.
///
/// # Errors
/// [`KernelError::Length`] unless `out` has one element; allocation, compile, load and launch
/// failures.
pub fn sum_of_squares(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<f64>,
) -> Result<(), KernelError> {
    same_len("sum_of_squares", "out", 1, out.len())?;
    let n = x.len();
    if n == 0 {
        return memset(stream, out, 0.0f64);
    }
    let blocks = n.div_ceil(NORM_BLOCK * NORM_ITEMS);
    let grid = u32::try_from(blocks).map_err(|_| KernelError::InvalidArgument {
        kernel: "sum_squares_f32",
        reason: format!("{n} elements need more than 2^32 blocks"),
    })?;
    // Freed in stream order when dropped (cuMemFreeAsync where the device has memory pools).
    // SAFETY: uninitialised device memory, never read before written: each of the `blocks`
    // blocks of `sum_squares_f32` writes its sum before `sum_f64_final`, later on the same
    // stream, reads them (one fill fewer a call: the trainer takes one sum a tensor).
    let mut sums = unsafe { stream.alloc::<f64>(blocks) }
        .map_err(|e| driver("cuMemAlloc", "sum_squares_f32", e))?;
    let first = function(stream, Program::Norm, "sum_squares_f32")?;
    let last = function(stream, Program::Norm, "sum_f64_final")?;
    let block = |grid: u32| LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (NORM_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n64, count) = (n as u64, blocks as u64);
    {
        let (xp, _x) = x.device_ptr(stream);
        let (sp, _s) = sums.device_ptr_mut(stream);
        let mut b = stream.launch_builder(&first);
        b.arg(&xp).arg(&n64).arg(&sp);
        // SAFETY: `sum_squares_f32(const float*, u64, double*)`: `grid` blocks each write one
        // of the `blocks` sums and read their chunk of the `n` elements.
        unsafe { b.launch(block(grid)) }
            .map_err(|e| driver("cuLaunchKernel", "sum_squares_f32", e))?;
    }
    let (sp, _s) = sums.device_ptr(stream);
    let (o, _o) = out.device_ptr_mut(stream);
    let mut b = stream.launch_builder(&last);
    b.arg(&sp).arg(&count).arg(&o);
    // SAFETY: `sum_f64_final(const double*, u64, double*)`, one block: reads the `blocks`
    // sums, writes `out[0]`.
    unsafe { b.launch(block(1)) }.map_err(|e| driver("cuLaunchKernel", "sum_f64_final", e))?;
    Ok(())
}

/// The C layouts of the structs the launchers pass by value, held to their Rust twins by
/// NVRTC itself: each program compiled with `static_assert`s of `sizeof` and `alignof`
/// equal to the Rust sizes and alignments (no GPU needed; skipped without NVRTC unless
/// `FSDP_NVRTC_LIB` names it, as CI does). A mismatch would hand a kernel garbage silently.
#[cfg(test)]
pub(crate) fn assert_c_layouts(program: Program, structs: &[(&str, usize, usize)]) {
    match fsdp_device::cuda::libs::load_nvrtc() {
        Ok(_) => {}
        Err(e) if std::env::var_os("FSDP_NVRTC_LIB").is_some() => {
            panic!("FSDP_NVRTC_LIB is set, but {e}")
        }
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    }
    let mut src = program.source();
    for (name, size, align) in structs {
        src.push_str(&format!(
            "\nstatic_assert(sizeof({name}) == {size}, \"{name}: Rust has {size} bytes\");\
             \nstatic_assert(alignof({name}) == {align}, \"{name}: Rust aligns to {align}\");"
        ));
    }
    if let Err(e) = crate::compile_source(program.name(), &src, "compute_80") {
        panic!("{e}");
    }
}
