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
    CudaFunction, CudaModule, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::host::{
    check_reduce, same_len, AdamWScalars, CastFloat, KernelFloat, MomentFloat, ReduceKind,
    SgdScalars,
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
pub mod plan;
mod step;
mod step_buffers;
pub use attention::{flash_backward, flash_forward, FLASH_HEAD_DIMS, FLASH_TILE};
pub use buffers::{
    adamw_buffers, anyprecision_buffers, axpby_buffer, cast_buffer, clip_coefficient_buffers,
    div_scalar_buffer, scale_by_buffer, sgd_buffers, sum_of_squares_buffer,
};
pub use foreach::{
    adamw_decided_many, anyprecision_decided_many, fill_zero_many, sum_of_squares_many,
    AdamWTensor, ADAMW_TENSORS, ANYPRECISION_TENSORS, SQUARES_TENSORS, ZERO_SEGMENTS,
};
pub use gather::gather_copies;
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
pub use plan::{
    config, foreach_grid, gather_grid, GatherCopy, KernelLaunch, Param, GATHER_SEGMENTS,
};
pub use step::{
    adamw_decided, anyprecision_decided, engine_decide, loss_accumulate, sgd_decided, step_decide,
    unscale_by,
};
pub use step_buffers::{
    adamw_decided_buffers, engine_decide_buffers, sgd_decided_buffers, unscale_by_buffer,
};

type PtxKey = (Program, (i32, i32));
static PTX: Mutex<Option<HashMap<PtxKey, String>>> = Mutex::new(None);
type ModuleKey = (usize, Program);
/// A program's module loaded into one context, with the functions looked up so far (one
/// `cuModuleGetFunction` per kernel and context, not per launch).
struct Loaded {
    module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}
static MODULES: Mutex<Option<HashMap<ModuleKey, Loaded>>> = Mutex::new(None);

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

/// `kernel` of `program`, in the module loaded into `stream`'s context (loaded, and the
/// function looked up, on first use).
fn function(
    stream: &CudaStream,
    program: Program,
    kernel: &str,
) -> Result<CudaFunction, KernelError> {
    let ctx = stream.context();
    let key = (ctx.cu_ctx() as usize, program);
    let mut modules = MODULES.lock().unwrap_or_else(|e| e.into_inner());
    let modules = modules.get_or_insert_with(HashMap::new);
    let loaded = match modules.entry(key) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            let cc = ctx
                .compute_capability()
                .map_err(|e| driver("cuDeviceGetAttribute", kernel, e))?;
            let ptx = ptx_for(program, cc)?;
            let module = ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(|e| driver("cuModuleLoadData", program.name(), e))?;
            v.insert(Loaded {
                module,
                functions: HashMap::new(),
            })
        }
    };
    if let Some(f) = loaded.functions.get(kernel) {
        return Ok(f.clone());
    }
    let f = loaded
        .module
        .load_function(kernel)
        .map_err(|e| driver("cuModuleGetFunction", kernel, e))?;
    loaded.functions.insert(kernel.to_string(), f.clone());
    Ok(f)
}

/// Enqueues `launches` on `stream` in order.
///
/// # Safety
/// Every pointer parameter must be device memory of `stream`'s context valid for what its
/// kernel reads and writes there (the plan's documentation says what), ordered by the caller
/// after its writers and before its next writers, and held until the kernels have run.
///
/// # Errors
/// Compile, load and launch failures.
pub unsafe fn enqueue(stream: &CudaStream, launches: &[KernelLaunch]) -> Result<(), KernelError> {
    for l in launches {
        let f = function(stream, l.program, &l.kernel)?;
        let mut b = stream.launch_builder(&f);
        for p in &l.params {
            match p {
                Param::Ptr(v) | Param::U64(v) => b.arg(v),
                Param::U32(v) => b.arg(v),
                Param::U16(v) => b.arg(v),
                Param::I32(v) => b.arg(v),
                Param::F32(v) => b.arg(v),
                Param::F64(v) => b.arg(v),
                Param::Struct(s) => b.arg(s.storage()),
            };
        }
        // SAFETY: the parameters are the kernel's, in its order and of its types (each plan
        // builds them so, and the host emulation checks them against the C signatures); a
        // struct's storage holds its `sizeof` bytes and more. The memory behind the pointers
        // is the caller's contract.
        unsafe { b.launch(l.config) }.map_err(|e| KernelError::Driver {
            op: "cuLaunchKernel",
            kernel: l.kernel.clone(),
            // The launch's shape too: a driver's "invalid value" is most often a grid or
            // block out of range or a parameter list of the wrong size.
            message: format!(
                "{e:?} (grid {:?}, block {:?}, {} parameters)",
                l.config.grid_dim,
                l.config.block_dim,
                l.params.len()
            ),
        })?;
    }
    Ok(())
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
    let launches = plan::cast::<S, D>(s, d, n)?;
    // SAFETY: the casts read `n` elements at `s` and write as many at `d` (the vector kernel
    // only where they are aligned for it); the caller's contract covers both.
    unsafe { enqueue(stream, &launches) }
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
    let (xp, _x) = x.device_ptr(stream);
    let (yp, _y) = y.device_ptr_mut(stream);
    // SAFETY: `n` elements of `x` read and of `y` written, both slices held (`_x`, `_y`).
    unsafe { enqueue(stream, &plan::axpby::<T>(alpha, xp, beta, yp, n)) }
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
    let (yp, _y) = y.device_ptr_mut(stream);
    // SAFETY: `n` elements of `y`, held (`_y`).
    unsafe { enqueue(stream, &plan::div_scalar::<T>(d, yp, n)) }
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
    let (xp, _x) = x.device_ptr_mut(stream);
    let (cp, _c) = c.device_ptr(stream);
    // SAFETY: `n` elements of `x`, one of `c`, both held.
    unsafe { enqueue(stream, &plan::scale_by(xp, cp, n)) }
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
    let (sp, _s) = sharded.device_ptr(stream);
    let (rp, _r) = replicated.device_ptr(stream);
    let (op, _o) = out.device_ptr_mut(stream);
    // SAFETY: one element of each part read, two of `out` written (lengths checked above).
    unsafe { enqueue(stream, &plan::clip_coefficient(sp, rp, max_norm, op)) }
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
    let (d, _d) = dst.device_ptr_mut(stream);
    // SAFETY: `n` elements of `dst` written, held (`_d`).
    unsafe { enqueue(stream, &plan::memset(d, value, n)) }
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
    let launches = plan::reduce::<T>(op, dst, acc, x, n, finish)?;
    // SAFETY: `n` elements at each address, checked or promised by the callers; `dst` may
    // equal `x` or `acc` (element-wise).
    unsafe { enqueue(stream, &launches) }
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
    // The plan checks `finish` and launches nothing for no elements.
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
    let (p, _p) = param.device_ptr_mut(stream);
    let (g, _g) = grad.device_ptr(stream);
    let (m, _m) = exp_avg.device_ptr_mut(stream);
    let (v, _v) = exp_avg_sq.device_ptr_mut(stream);
    // SAFETY: every slice has `n` elements (checked above) and is held.
    unsafe { enqueue(stream, &plan::adamw::<S>(s, p, g, m, v, n)) }
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
    let (p, _p) = param.device_ptr_mut(stream);
    let (g, _g) = grad.device_ptr(stream);
    let (m, _m) = momentum_buffer.device_ptr_mut(stream);
    // SAFETY: `n` elements of each slice; the buffer is only touched when the flags say
    // momentum, and then it has `n` elements (checked above).
    unsafe { enqueue(stream, &plan::sgd(s, p, g, m, n)) }
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
    let blocks = plan::sum_of_squares_blocks(n)?;
    // Freed in stream order when dropped (cuMemFreeAsync where the device has memory pools).
    // SAFETY: uninitialised device memory, never read before written: each of the `blocks`
    // blocks of `sum_squares_f32` writes its sum before `sum_f64_final`, later on the same
    // stream, reads them (one fill fewer a call: the trainer takes one sum a tensor).
    let mut sums = unsafe { stream.alloc::<f64>(blocks) }
        .map_err(|e| driver("cuMemAlloc", "sum_squares_f32", e))?;
    let (xp, _x) = x.device_ptr(stream);
    let (sp, _s) = sums.device_ptr_mut(stream);
    let (o, _o) = out.device_ptr_mut(stream);
    let launches = plan::sum_of_squares(xp, n, sp, o)?;
    // SAFETY: `n` elements of `x` read, the `blocks` sums written then read, `out[0]` written;
    // all held until enqueued, `sums` freed in stream order after the kernels.
    unsafe { enqueue(stream, &launches) }
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
