//! Kernels on stream-ordered `fsdp_device` buffers ([`fsdp_device::Buffer::use_on`]): safe
//! entry points for code that keeps its device memory in such buffers (FSDP's engine on a
//! device) rather than in cudarc slices.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use fsdp_device::{AccessMode, Buffer, DType, Device, Event, Stream};
use half::{bf16, f16};

use super::cast_raw;
use crate::host::{AdamWScalars, AnyPrecision, AnyPrecisionChoice, SgdScalars};
use crate::KernelError;

/// Cast the stream-ordered CUDA buffer `src` into `dst` (same length, distinct element types
/// among f32, bf16 and f16, not overlapping) on `stream`, each value rounded once to nearest
/// even: the kernel of [`cast`](super::cast), ordered by both buffers' stream orders. Returns
/// the event recorded after it.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for buffers that are not stream-ordered CUDA buffers of
/// `stream`'s device, of other lengths, overlapping, or a pair of types without a kernel; the
/// stream orders' errors; compile, load and launch failures.
pub fn cast_buffer(src: &Buffer, dst: &Buffer, stream: &Stream) -> Result<Event, KernelError> {
    if src.len() != dst.len() {
        return Err(KernelError::InvalidArgument {
            kernel: "cast",
            reason: format!("{} elements into {}", src.len(), dst.len()),
        });
    }
    let (s, d) = (src.dtype(), dst.dtype());
    launch_on_buffers("cast", stream, &[src], &[dst], &[s, d], |cu, p| {
        let (sp, dp, n) = (p[0].0, p[1].0, p[0].1);
        // SAFETY: `sp` and `dp` are the addresses of `n` elements of the matched types in two
        // live, non-overlapping stream-ordered buffers of this device, ordered on `stream`
        // (`launch_on_buffers` records their uses after the launch, so the memory outlives the
        // kernel).
        unsafe {
            match (s, d) {
                (DType::F32, DType::BF16) => cast_raw::<f32, bf16>(cu, sp, dp, n),
                (DType::F32, DType::F16) => cast_raw::<f32, f16>(cu, sp, dp, n),
                (DType::BF16, DType::F32) => cast_raw::<bf16, f32>(cu, sp, dp, n),
                (DType::F16, DType::F32) => cast_raw::<f16, f32>(cu, sp, dp, n),
                (DType::BF16, DType::F16) => cast_raw::<bf16, f16>(cu, sp, dp, n),
                (DType::F16, DType::BF16) => cast_raw::<f16, bf16>(cu, sp, dp, n),
                (a, b) => Err(KernelError::InvalidArgument {
                    kernel: "cast",
                    reason: format!("no cast kernel from {a} to {b}"),
                }),
            }
        }
    })
}

/// A stream-ordered CUDA buffer's memory as a cudarc slice for one launch: its address and
/// length, ordered by the caller ([`Buffer::use_on`]), so taking its pointer adds no
/// synchronisation of its own.
pub(super) struct Ordered<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _elements: PhantomData<T>,
}

impl<T> DeviceSlice<T> for Ordered<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for Ordered<T> {
    fn device_ptr<'a>(&'a self, _: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Ordered<T> {
    fn device_ptr_mut<'a>(&'a mut self, _: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// The slices a launch on `stream` gets from stream-ordered CUDA buffers: `reads` (shared) and
/// `writes` (exclusive, not overlapping any other buffer of the launch), of the element types
/// `dtypes` (reads then writes); `launch` enqueues the kernel, after which every use is
/// recorded. Returns the event after it.
pub(super) fn launch_on_buffers(
    kernel: &'static str,
    stream: &Stream,
    reads: &[&Buffer],
    writes: &[&Buffer],
    dtypes: &[DType],
    launch: impl FnOnce(&Arc<CudaStream>, &[(u64, usize)]) -> Result<(), KernelError>,
) -> Result<Event, KernelError> {
    let invalid = |reason: String| KernelError::InvalidArgument { kernel, reason };
    let all: Vec<&Buffer> = reads.iter().chain(writes).copied().collect();
    for (b, &t) in all.iter().zip(dtypes) {
        if !matches!(b.device(), Device::Cuda(_)) || b.stream_order().is_none() {
            return Err(invalid(format!(
                "a buffer on {} that is not a stream-ordered CUDA buffer",
                b.device()
            )));
        }
        if b.dtype() != t {
            return Err(invalid(format!(
                "a buffer of {} where {t} is expected",
                b.dtype()
            )));
        }
    }
    if let Some((w, o)) = Buffer::overlapping_write(reads, writes) {
        return Err(invalid(format!(
            "a written buffer of {} elements overlaps another of {}",
            w.len(),
            o.len()
        )));
    }
    let cu = stream
        .cuda_stream()
        .ok_or_else(|| invalid(format!("stream `{}` is not a CUDA stream", stream.name())))?
        .clone();
    let mut uses = Vec::with_capacity(all.len());
    for b in reads {
        uses.push(b.use_on(stream, AccessMode::Shared)?);
    }
    for b in writes {
        uses.push(b.use_on(stream, AccessMode::Exclusive)?);
    }
    let ptrs: Vec<(u64, usize)> = uses
        .iter()
        .zip(&all)
        .map(|(u, b)| (u.device_ptr(), b.len()))
        .collect();
    let launched = launch(&cu, &ptrs);
    let mut last = None;
    for u in uses {
        last = Some(u.finish());
    }
    launched.map(|()| last.unwrap_or_else(|| stream.record_event()))
}

/// The slice of `p` for a launch on `stream`.
///
/// # Safety
/// `p` must be the address and length of live device memory of `T`s, ordered on the stream
/// for the launch (see [`launch_on_buffers`]).
pub(super) unsafe fn ordered<T>(stream: &Arc<CudaStream>, p: (u64, usize)) -> Ordered<T> {
    Ordered {
        ptr: p.0,
        len: p.1,
        stream: stream.clone(),
        _elements: PhantomData,
    }
}

/// `y = alpha·x + beta·y` ([`axpby`](super::axpby)) on stream-ordered CUDA buffers of one
/// length and element type (f32, f64, bf16 or f16; the 16-bit types computed in f32 and rounded
/// once when stored), on `stream`: with `alpha = beta = 1` the exact sum `x + y`, rounded once (an
/// accumulation); `x` may be `y` itself (then `alpha·y + beta·y`: with `beta = 0`, a scaling
/// `alpha·y` rounded once). Returns the event after it.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for buffers that are not stream-ordered CUDA buffers of
/// one of those types, or of other lengths or types; compile, load and launch failures.
pub fn axpby_buffer(
    alpha: f32,
    x: &Buffer,
    beta: f32,
    y: &Buffer,
    stream: &Stream,
) -> Result<Event, KernelError> {
    let t = y.dtype();
    let same = x.same_storage(y) && x.byte_range() == y.byte_range();
    let reads: &[&Buffer] = if same { &[] } else { &[x] };
    let dtypes: &[DType] = if same { &[t] } else { &[t, t] };
    launch_on_buffers("axpby", stream, reads, &[y], dtypes, |cu, p| {
        let (xp, yp) = (p[0], p[p.len() - 1]);
        /// The launch for elements of `T`.
        fn run<T: crate::host::KernelFloat<C = f32>>(
            cu: &Arc<CudaStream>,
            (alpha, beta): (f32, f32),
            xp: (u64, usize),
            yp: (u64, usize),
        ) -> Result<(), KernelError> {
            // SAFETY: addresses and lengths of ordered buffers of `T` (`launch_on_buffers`);
            // when `x` is `y` both views are the same memory, read and written element by
            // element by one thread each.
            let (x, mut y) = unsafe { (ordered::<T>(cu, xp), ordered::<T>(cu, yp)) };
            super::axpby::<T>(cu, alpha, &x, beta, &mut y)
        }
        match t {
            DType::F32 => run::<f32>(cu, (alpha, beta), xp, yp),
            DType::BF16 => run::<bf16>(cu, (alpha, beta), xp, yp),
            DType::F16 => run::<f16>(cu, (alpha, beta), xp, yp),
            DType::F64 => {
                // SAFETY: as above, for buffers of f64 (computed in f64; `alpha` and `beta`
                // widened exactly).
                let (x, mut y) = unsafe { (ordered::<f64>(cu, xp), ordered::<f64>(cu, yp)) };
                let (a, b) = (f64::from(alpha), f64::from(beta));
                super::axpby::<f64>(cu, a, &x, b, &mut y)
            }
        }
    })
}

/// `x *= c[0]` ([`scale_by`](super::scale_by): the coefficient rounded to f32, nothing when
/// it is 1) on a stream-ordered `f32` CUDA buffer with the one-element `f64` buffer `c`, on
/// `stream`: scaling by a coefficient computed on the device (clipping), which the host never
/// reads. Returns the event after it.
///
/// # Errors
/// As [`axpby_buffer`]; `c` not of one element.
pub fn scale_by_buffer(x: &Buffer, c: &Buffer, stream: &Stream) -> Result<Event, KernelError> {
    let dtypes = [DType::F64, DType::F32];
    launch_on_buffers("scale_by_f32", stream, &[c], &[x], &dtypes, |cu, p| {
        // SAFETY: addresses and lengths of ordered buffers (`launch_on_buffers`).
        let (c, mut x) = unsafe { (ordered::<f64>(cu, p[0]), ordered::<f32>(cu, p[1])) };
        super::scale_by(cu, &mut x, &c)
    })
}

/// The global norm and its clip coefficient ([`clip_coefficient`](super::clip_coefficient))
/// from the one-element `f64` buffers `sharded` and `replicated` into the two-element `f64`
/// buffer `out` (the norm, then the coefficient), on `stream`. Returns the event after it.
///
/// # Errors
/// As [`axpby_buffer`]; buffers of other lengths.
pub fn clip_coefficient_buffers(
    sharded: &Buffer,
    replicated: &Buffer,
    max_norm: f64,
    out: &Buffer,
    stream: &Stream,
) -> Result<Event, KernelError> {
    let reads = [sharded, replicated];
    launch_on_buffers(
        "clip_coefficient",
        stream,
        &reads,
        &[out],
        &[DType::F64; 3],
        |cu, p| {
            // SAFETY: addresses and lengths of ordered buffers (`launch_on_buffers`).
            let (s, r, mut out) = unsafe {
                (
                    ordered::<f64>(cu, p[0]),
                    ordered::<f64>(cu, p[1]),
                    ordered::<f64>(cu, p[2]),
                )
            };
            super::clip_coefficient(cu, &s, &r, max_norm, &mut out)
        },
    )
}

/// `y = y / d` ([`div_scalar`](super::div_scalar): the quotient rounded once to the element
/// type, 16-bit types divided in f32) on a stream-ordered CUDA buffer of f32, bf16 or f16, on
/// `stream`. Returns the event after it.
///
/// # Errors
/// As [`axpby_buffer`].
pub fn div_scalar_buffer(d: f32, y: &Buffer, stream: &Stream) -> Result<Event, KernelError> {
    let t = y.dtype();
    launch_on_buffers("div_scalar", stream, &[], &[y], &[t], |cu, p| {
        /// The launch for elements of `T`.
        fn run<T: crate::host::KernelFloat<C = f32>>(
            cu: &Arc<CudaStream>,
            d: f32,
            yp: (u64, usize),
        ) -> Result<(), KernelError> {
            // SAFETY: the address and length of an ordered buffer of `T` (`launch_on_buffers`).
            let mut y = unsafe { ordered::<T>(cu, yp) };
            super::div_scalar::<T>(cu, d, &mut y)
        }
        match t {
            DType::F32 => run::<f32>(cu, d, p[0]),
            DType::BF16 => run::<bf16>(cu, d, p[0]),
            DType::F16 => run::<f16>(cu, d, p[0]),
            DType::F64 => Err(KernelError::InvalidArgument {
                kernel: "div_scalar",
                reason: "f64 buffers (f32, bf16 or f16 expected)".into(),
            }),
        }
    })
}

/// The sum of the squares of the stream-ordered `f32` CUDA buffer `x` in `f64` into the
/// one-element `f64` buffer `out` ([`sum_of_squares`](super::sum_of_squares): a fixed order,
/// bitwise [`host::sum_of_squares`](crate::host::sum_of_squares)), on `stream`.
///
/// # Errors
/// As [`axpby_buffer`]; `out` not of one `f64`.
pub fn sum_of_squares_buffer(
    x: &Buffer,
    out: &Buffer,
    stream: &Stream,
) -> Result<Event, KernelError> {
    launch_on_buffers(
        "sum_squares_f32",
        stream,
        &[x],
        &[out],
        &[DType::F32, DType::F64],
        |cu, p| {
            // SAFETY: addresses and lengths of ordered buffers (`launch_on_buffers`).
            let (x, mut out) = unsafe { (ordered::<f32>(cu, p[0]), ordered::<f64>(cu, p[1])) };
            super::sum_of_squares(cu, &x, &mut out)
        },
    )
}

/// One fused AdamW step ([`adamw`](super::adamw), f32 moments) on stream-ordered `f32` CUDA
/// buffers of one length, on `stream`.
///
/// # Errors
/// As [`axpby_buffer`].
pub fn adamw_buffers(
    s: &AdamWScalars,
    param: &Buffer,
    grad: &Buffer,
    exp_avg: &Buffer,
    exp_avg_sq: &Buffer,
    stream: &Stream,
) -> Result<Event, KernelError> {
    let writes = [param, exp_avg, exp_avg_sq];
    launch_on_buffers(
        "adamw",
        stream,
        &[grad],
        &writes,
        &[DType::F32; 4],
        |cu, p| {
            // SAFETY: addresses and lengths of ordered, non-overlapping buffers.
            let (g, mut param, mut m, mut v) = unsafe {
                (
                    ordered::<f32>(cu, p[0]),
                    ordered(cu, p[1]),
                    ordered(cu, p[2]),
                    ordered(cu, p[3]),
                )
            };
            super::adamw::<f32>(cu, s, &mut param, &g, &mut m, &mut v)
        },
    )
}

/// One fused SGD step ([`sgd`](super::sgd)) on stream-ordered `f32` CUDA buffers of one length
/// (`momentum_buffer` `None` without momentum), on `stream`.
///
/// # Errors
/// As [`axpby_buffer`].
pub fn sgd_buffers(
    s: &SgdScalars,
    param: &Buffer,
    grad: &Buffer,
    momentum_buffer: Option<&Buffer>,
    stream: &Stream,
) -> Result<Event, KernelError> {
    let writes: Vec<&Buffer> = std::iter::once(param).chain(momentum_buffer).collect();
    let dtypes = vec![DType::F32; 1 + writes.len()];
    launch_on_buffers("sgd", stream, &[grad], &writes, &dtypes, |cu, p| {
        // SAFETY: addresses and lengths of ordered, non-overlapping buffers; without momentum
        // the kernel never touches the (empty) buffer.
        let (g, mut param, mut buf) = unsafe {
            (
                ordered::<f32>(cu, p[0]),
                ordered(cu, p[1]),
                ordered(cu, p.get(2).copied().unwrap_or((0, 0))),
            )
        };
        super::sgd(cu, s, &mut param, &g, &mut buf)
    })
}

/// torchdistx's `AnyPrecisionAdamW` on one run of stream-ordered CUDA buffers
/// ([`anyprecision_decided`](super::anyprecision_decided), whose twin is
/// [`host::anyprecision_decided`](crate::host::anyprecision_decided)): the `f32` parameters
/// (values of `kind.param`), their `f32` gradient, and the momentum, variance and (with
/// `kind.kahan`) compensation as buffers of `kind.state` elements (f32 or bf16, one each per
/// parameter), as `scalars` decided (an `f64` buffer of at least
/// [`STEP_SQUARES`](crate::host::STEP_SQUARES) elements), on `stream`. Returns the event after
/// it.
///
/// # Errors
/// As [`axpby_buffer`]; buffers of other lengths, a compensation missing with Kahan summation;
/// a `kind` with other dtypes.
#[allow(clippy::too_many_arguments)]
pub fn anyprecision_buffers(
    choice: &AnyPrecisionChoice,
    kind: AnyPrecision,
    scalars: &Buffer,
    param: &Buffer,
    grad: &Buffer,
    exp_avg: &Buffer,
    exp_avg_sq: &Buffer,
    compensation: Option<&Buffer>,
    stream: &Stream,
) -> Result<Event, KernelError> {
    kind.validate()?;
    let n = param.len();
    let states = [Some(exp_avg), Some(exp_avg_sq), compensation];
    if states.iter().flatten().any(|b| b.len() != n) || grad.len() != n {
        return Err(KernelError::InvalidArgument {
            kernel: "anyprecision_decided",
            reason: format!("buffers of other lengths than the parameters' {n}"),
        });
    }
    let comp = compensation.filter(|_| kind.kahan);
    let writes: Vec<&Buffer> = [param, exp_avg, exp_avg_sq]
        .into_iter()
        .chain(comp)
        .collect();
    let mut dtypes = vec![DType::F64, DType::F32, DType::F32];
    dtypes.resize(2 + writes.len(), kind.state);
    let reads = [scalars, grad];
    launch_on_buffers(
        "anyprecision_decided",
        stream,
        &reads,
        &writes,
        &dtypes,
        |cu, p| {
            // The kernel reads and writes `n` values of the state's type at each state buffer's
            // address; its launcher counts state buffers in f32 slots (`state_len`: bf16 two a
            // slot), a length only checked, never used to address memory.
            let slots = |q: (u64, usize)| (q.0, crate::host::state_len(q.1, kind.state));
            // SAFETY: addresses and lengths of ordered, non-overlapping buffers
            // (`launch_on_buffers`); the state buffers hold `n` elements of `kind.state` each
            // (checked above), which is what the kernel touches.
            unsafe {
                let (s, g) = (ordered::<f64>(cu, p[0]), ordered::<f32>(cu, p[1]));
                let mut param = ordered::<f32>(cu, p[2]);
                let (mut m, mut v) = (ordered::<f32>(cu, slots(p[3])), ordered(cu, slots(p[4])));
                let mut c = p.get(5).map(|&q| ordered::<f32>(cu, slots(q)));
                super::anyprecision_decided(
                    cu,
                    choice,
                    kind,
                    &s,
                    &mut param,
                    &g,
                    &mut m,
                    &mut v,
                    c.as_mut(),
                )
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every entry refuses buffers that are not stream-ordered CUDA buffers, naming them, before
    /// anything needs a GPU.
    #[test]
    fn host_buffers_are_refused_by_name() {
        let s = Stream::cpu("host");
        let b = |t| Buffer::zeros(t, 4).unwrap();
        let (x, y) = (b(DType::F32), b(DType::F32));
        let cfg = crate::host::AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let adamw = AdamWScalars::new(&cfg, 1).unwrap();
        let errors = [
            cast_buffer(&x, &b(DType::BF16), &s).unwrap_err(),
            axpby_buffer(1.0, &x, 1.0, &y, &s).unwrap_err(),
            axpby_buffer(0.0, &x, 2.0, &x, &s).unwrap_err(),
            div_scalar_buffer(2.0, &x, &s).unwrap_err(),
            sum_of_squares_buffer(&x, &Buffer::zeros(DType::F64, 1).unwrap(), &s).unwrap_err(),
            adamw_buffers(&adamw, &x, &y, &b(DType::F32), &b(DType::F32), &s).unwrap_err(),
        ];
        for e in errors {
            assert!(
                e.to_string().contains("not a stream-ordered CUDA buffer"),
                "{e}"
            );
        }
        let e = cast_buffer(&x, &b(DType::BF16).slice(0..2).unwrap(), &s).unwrap_err();
        assert!(e.to_string().contains("4 elements into 2"), "{e}");
    }
}
