//! The NCCL backend (cargo feature `nccl`): collectives on CUDA buffers through NCCL, loaded at
//! run time by cudarc — the program builds and runs without CUDA or NCCL installed, and asking
//! for this backend there is an error ([`CollectiveError::Unavailable`]) that names the library
//! that could not be loaded, never a panic.
//!
//! # Streams and buffer lifetimes
//! The [`Communicator`] trait hands out a CPU [`Stream`]. An [`NcclCommunicator`] therefore owns
//! two streams:
//! - a CPU *proxy* stream ([`Communicator::stream`]) whose worker thread takes each collective in
//!   issue order: it acquires the buffers' access tickets (taken at issue time, exactly as the
//!   ring backend does), enqueues the NCCL call on the CUDA stream with the buffers' device
//!   pointers, records a CUDA event and polls it — together with `ncclCommGetAsyncError` — until
//!   the collective has finished on the GPU or the communicator's timeout has passed; only then
//!   does it release the buffers and complete the [`Work`];
//! - a CUDA stream ([`NcclCommunicator::cuda_stream`]) on which NCCL runs.
//!
//! So a buffer — and the allocator block under it — is never reused or freed while NCCL may still
//! read or write it, and host code that reads a result after [`Work::wait`] sees it, at the price
//! of one proxy thread per communicator (like the watchdog thread of PyTorch's
//! `ProcessGroupNCCL`) and of collectives of one communicator not overlapping each other.
//! Buffers written by other CUDA streams must be complete before the collective is issued (or
//! make [`cuda_stream`](NcclCommunicator::cuda_stream) wait for their event).
//!
//! # No unbounded waits
//! Communicators are created *non-blocking* (`ncclConfig_t::blocking = 0`): initialisation,
//! every collective launch, splits and finalisation return at once and are polled. A peer that
//! never arrives makes the wait end at the timeout ([`NcclOptions::timeout`]) with
//! [`CollectiveError::Timeout`]; the communicator is then aborted (`ncclCommAbort`, which also
//! stops its kernels) and every later call fails with [`CollectiveError::Aborted`]. An error that
//! NCCL reports (synchronously or through `ncclCommGetAsyncError`) becomes
//! [`CollectiveError::Backend`] with NCCL's own error string.
//!
//! # Validation
//! Every call is checked before NCCL sees it (cudarc does not): each buffer is on this
//! communicator's GPU, element types agree, lengths fit (`output = world × input` for all-gather,
//! `input = world × output` for reduce-scatter), the root is a rank, and buffers overlap only in
//! the in-place forms NCCL accepts (all-gather input = this rank's block of the output;
//! reduce-scatter output = this rank's chunk of the input). NCCL itself cannot tell that ranks
//! disagree (a different length on one rank makes it hang or write out of bounds), so with
//! [`NcclOptions::verify`] on (the default) the ranks all-gather a 192-byte description of each
//! call first (the description every backend shares) and compare it: a difference in operation,
//! element type, length, reduce op or root fails the collective on every rank with
//! [`CollectiveError::Mismatch`] before data moves, and a call that failed validation on one rank
//! fails on the others too instead of hanging — the same guarantee as the ring backend. The check
//! costs one 192-byte all-gather per collective (a few microseconds on one node), negligible for
//! FSDP's megabyte collectives; turn it off for latency measurements.
//!
//! Reductions are NCCL's: not bitwise deterministic across algorithms or world sizes the way the
//! ring backend's are, and `Min`/`Max` do not propagate NaN.
//!
//! # Example
//! ```no_run
//! use std::time::Duration;
//! use fsdp_collectives::nccl::{NcclCommunicator, NcclOptions};
//! use fsdp_collectives::store::{StoreOptions, TcpStore};
//! use fsdp_collectives::{Communicator, ReduceOp};
//! use fsdp_allocator::cuda::{CudaAllocator, CudaSource};
//! use fsdp_allocator::AllocatorConfig;
//! use fsdp_device::DType;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = TcpStore::new(StoreOptions::new("127.0.0.1", 29500, 0, 1))?;
//! let comm = NcclCommunicator::new(&store, 0, NcclOptions::default())?;
//! let alloc = CudaAllocator::new(CudaSource::new(0)?, AllocatorConfig::default())?;
//! let buf = alloc.allocate_buffer(DType::F32, 4, comm.cuda_stream())?;
//! comm.copy_from_host(&buf, &[1.0f32, 2.0, 3.0, 4.0])?;
//! comm.all_reduce(&buf, ReduceOp::Sum)?.wait()?;
//! assert_eq!(comm.copy_to_host::<f32>(&buf)?, vec![1.0, 2.0, 3.0, 4.0]);
//! # Ok(())
//! # }
//! ```

mod ffi;

use std::ffi::c_void;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{result as cu, CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::sys;
use fsdp_device::{
    AccessGuard, AccessMode, AccessTicket, Buffer, Device, Element, Stream, DEFAULT_TIMEOUT,
};

pub use self::ffi::version;
use crate::flavors::check::{enqueue_collective, Placement};
use crate::flavors::desc::{self, OpDesc as Desc, Sizes, FIXED_BYTES as DESC_BYTES};
use crate::store::TcpStore;
use crate::{CollectiveError, Communicator, ReduceOp, Result, Work};

/// Options of an NCCL communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NcclOptions {
    /// Bound of every wait: initialisation, buffers becoming free, each collective on the GPU,
    /// splits, and the default of [`Work::wait`]. Default: [`DEFAULT_TIMEOUT`] (300 s).
    pub timeout: Duration,
    /// Compare a description of every call across ranks before running it (one 64-byte
    /// all-gather per collective): mismatched calls then fail with
    /// [`CollectiveError::Mismatch`] on every rank instead of hanging or corrupting memory.
    /// Default: on.
    pub verify: bool,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            timeout: DEFAULT_TIMEOUT,
            verify: true,
        }
    }
}

impl NcclOptions {
    /// These options with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These options with the cross-rank check on or off.
    pub fn with_verify(mut self, verify: bool) -> Self {
        self.verify = verify;
        self
    }
}

/// Whether this machine can run the NCCL backend: the CUDA driver and NCCL libraries load and
/// NCCL is at least 2.18. The error says what is missing.
pub fn available() -> Result<()> {
    let v = version()?;
    if v < ffi::MIN_VERSION {
        return Err(CollectiveError::Unavailable {
            rank: 0,
            backend: "nccl",
            reason: format!(
                "NCCL {}.{}.{} is too old: this backend needs {}.{}.{} or newer",
                v.0,
                v.1,
                v.2,
                ffi::MIN_VERSION.0,
                ffi::MIN_VERSION.1,
                ffi::MIN_VERSION.2
            ),
        });
    }
    Ok(())
}

/// NCCL's `ncclUniqueId`: created by one rank, given to every other (through the store, or by
/// hand for ranks that are threads of one process), identifies the communicator to create.
#[derive(Clone, Copy)]
pub struct UniqueId(sys::ncclUniqueId);

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

impl UniqueId {
    /// Bytes in an id.
    pub const BYTES: usize = 128;

    /// A new id (`ncclGetUniqueId`; it also starts NCCL's bootstrap listener in this process,
    /// which must stay alive while the others join).
    pub fn new() -> Result<UniqueId> {
        available()?;
        ffi::guarded(0, "ncclGetUniqueId", || {
            let mut id = sys::ncclUniqueId { internal: [0; 128] };
            // SAFETY: the library is present (probed); the pointer is to a live local.
            let r = unsafe { sys::ncclGetUniqueId(&mut id) };
            ffi::check(0, "ncclGetUniqueId", r)?;
            Ok(UniqueId(id))
        })
    }

    /// The id's bytes.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        self.0.internal.map(|c| c as u8)
    }

    /// An id from [`to_bytes`](UniqueId::to_bytes)'s output.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        if bytes.len() != Self::BYTES {
            return Err(CollectiveError::InvalidArgument {
                rank: 0,
                op: "nccl::UniqueId::from_bytes",
                reason: format!("{} bytes, expected {}", bytes.len(), Self::BYTES),
            });
        }
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        for (d, s) in id.internal.iter_mut().zip(bytes) {
            *d = *s as std::ffi::c_char;
        }
        Ok(UniqueId(id))
    }
}

/// The device scratch of the descriptor exchange and its pinned host mirror.
struct Scratch {
    dev: cudarc::driver::sys::CUdeviceptr,
    host: *mut u8,
    bytes: usize,
}

/// The shared state of one rank's communicator: owned by the communicator and by the proxy tasks
/// in flight.
struct Inner {
    rank: usize,
    world: usize,
    ordinal: usize,
    opts: NcclOptions,
    ctx: Arc<CudaContext>,
    cuda: Arc<CudaStream>,
    /// The NCCL communicator; null once aborted or destroyed.
    comm: AtomicPtr<sys::ncclComm>,
    aborted: Mutex<Option<String>>,
    /// `None` once leaked (a failed exchange left copies in flight).
    scratch: Mutex<Option<Scratch>>,
}

// SAFETY: the raw pointers (communicator, scratch) are only used under the protocol of this
// module: NCCL calls on the communicator come from the proxy thread (one at a time, since the
// proxy stream runs one task at a time), from construction before the proxy exists and from
// `Drop` after it is gone; `abort` swaps the pointer out atomically so it is aborted once. The
// scratch is behind a mutex and only touched by the proxy thread and `Drop`.
unsafe impl Send for Inner {}
// SAFETY: as above; shared access only reads the atomics and mutexes.
unsafe impl Sync for Inner {}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

enum Poll {
    Ready,
    Failed(sys::ncclResult_t),
    TimedOut,
}

/// Poll `ncclCommGetAsyncError` until the communicator's pending operation is done.
fn poll_comm(comm: sys::ncclComm_t, deadline: Instant) -> Poll {
    let mut pause = Duration::from_micros(2);
    loop {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is a live communicator; the pointer is to a live local.
        let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Poll::Failed(r);
        }
        match state {
            sys::ncclResult_t::ncclSuccess => return Poll::Ready,
            sys::ncclResult_t::ncclInProgress => {}
            other => return Poll::Failed(other),
        }
        let now = Instant::now();
        if now >= deadline {
            return Poll::TimedOut;
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

/// Launch of a collective's NCCL call(s) on the CUDA stream, given the granted buffers.
type Launch = Box<dyn FnOnce(&Inner, &[AccessGuard], u64, Instant) -> Result<()> + Send>;

impl Inner {
    fn aborted(&self) -> Option<String> {
        lock(&self.aborted).clone()
    }

    fn nccl_stream(&self) -> sys::cudaStream_t {
        self.cuda.cu_stream() as sys::cudaStream_t
    }

    fn cu_stream(&self) -> cudarc::driver::sys::CUstream {
        self.cuda.cu_stream()
    }

    fn backend(&self, op: &'static str, reason: String) -> CollectiveError {
        CollectiveError::Backend {
            rank: self.rank,
            backend: "nccl",
            op,
            reason,
        }
    }

    fn driver(&self, op: &'static str) -> impl Fn(cu::DriverError) -> CollectiveError + '_ {
        move |e| self.backend(op, format!("CUDA driver error {e:?}"))
    }

    /// Abort the communicator (once) and remember why.
    fn abort(&self, reason: String) {
        {
            let mut a = lock(&self.aborted);
            if a.is_none() {
                tracing::error!(rank = self.rank, "aborting the NCCL communicator: {reason}");
                *a = Some(reason);
            }
        }
        let comm = self.comm.swap(std::ptr::null_mut(), Ordering::SeqCst);
        if !comm.is_null() {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: `comm` was a live communicator and is aborted exactly once (swapped out).
            let r = unsafe { sys::ncclCommAbort(comm) };
            if r != sys::ncclResult_t::ncclSuccess {
                tracing::error!(rank = self.rank, "ncclCommAbort: {}", ffi::error_string(r));
            }
        }
    }

    fn comm(&self) -> Result<sys::ncclComm_t> {
        let comm = self.comm.load(Ordering::SeqCst);
        if comm.is_null() {
            return Err(CollectiveError::Aborted {
                rank: self.rank,
                reason: self
                    .aborted()
                    .unwrap_or_else(|| "the communicator was destroyed".into()),
            });
        }
        Ok(comm)
    }

    /// An NCCL error on `comm`: abort unless it was only an argument NCCL refused.
    fn nccl_error(
        &self,
        comm: sys::ncclComm_t,
        op: &'static str,
        r: sys::ncclResult_t,
    ) -> CollectiveError {
        let mut reason = ffi::error_string(r);
        if let Some(last) = ffi::last_error(comm) {
            reason = format!("{reason}: {last}");
        }
        if !matches!(
            r,
            sys::ncclResult_t::ncclInvalidArgument | sys::ncclResult_t::ncclInvalidUsage
        ) {
            self.abort(format!("NCCL failed in {op}: {reason}"));
        }
        self.backend(op, reason)
    }

    fn timeout_error(&self, op: &'static str, seq: u64, waiting_for: String) -> CollectiveError {
        self.abort(format!(
            "rank {} timed out in {op} (collective #{seq}): {waiting_for}",
            self.rank
        ));
        CollectiveError::Timeout {
            rank: self.rank,
            op,
            seq,
            waited: self.opts.timeout,
            waiting_for,
        }
    }

    /// Make one NCCL call and wait (bounded) until a non-blocking communicator has taken it.
    fn nccl(
        &self,
        op: &'static str,
        seq: u64,
        deadline: Instant,
        f: impl FnOnce(sys::ncclComm_t) -> sys::ncclResult_t,
    ) -> Result<()> {
        let comm = self.comm()?;
        let r = f(comm);
        match r {
            sys::ncclResult_t::ncclSuccess => Ok(()),
            sys::ncclResult_t::ncclInProgress => match poll_comm(comm, deadline) {
                Poll::Ready => Ok(()),
                Poll::Failed(e) => Err(self.nccl_error(comm, op, e)),
                Poll::TimedOut => Err(self.timeout_error(
                    op,
                    seq,
                    "NCCL did not accept the call (a peer may not have reached this collective)"
                        .into(),
                )),
            },
            e => Err(self.nccl_error(comm, op, e)),
        }
    }

    /// An event at the current end of the CUDA stream.
    fn record(&self) -> Result<CudaEvent> {
        self.cuda
            .record_event(None)
            .map_err(self.driver("cuEventRecord"))
    }

    /// Poll `ev` (and NCCL's asynchronous error state) until it completes or `deadline` passes.
    fn wait_event(
        &self,
        ev: &CudaEvent,
        op: &'static str,
        seq: u64,
        deadline: Instant,
    ) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(5);
        loop {
            match ev.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    let err = self.backend(op, format!("CUDA error on the NCCL stream: {e:?}"));
                    self.abort(err.to_string());
                    return Err(err);
                }
            }
            let comm = self.comm()?;
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: `comm` is live (only this thread aborts it while a task runs, besides
            // `abort` from this same thread); the pointer is to a live local.
            let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
            if r != sys::ncclResult_t::ncclSuccess {
                return Err(self.nccl_error(comm, op, r));
            }
            if !ffi::is_ok_or_in_progress(state) {
                return Err(self.nccl_error(comm, op, state));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timeout_error(
                    op,
                    seq,
                    "the NCCL kernel did not finish: a peer did not reach this collective (or \
                     issued a different one)"
                        .into(),
                ));
            }
            if now - start < Duration::from_micros(200) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause.min(deadline - now));
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
    }

    /// After a failure: whether the work on the CUDA stream finished within a grace period (the
    /// communicator is aborted by then, which stops its kernels). If not, the caller leaks the
    /// memory NCCL may still touch.
    fn settle(&self) -> bool {
        let Ok(ev) = self.record() else {
            return false;
        };
        let deadline = Instant::now() + Duration::from_secs(10).min(self.opts.timeout);
        loop {
            match ev.try_is_complete() {
                Ok(true) => return true,
                Ok(false) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                _ => return false,
            }
        }
    }

    /// All-gather the ranks' descriptions of this call and compare them.
    fn exchange(&self, desc: &Desc, seq: u64, deadline: Instant) -> Result<()> {
        let (rank, world, op) = (self.rank, self.world, desc.op);
        let mut guard = lock(&self.scratch);
        let Some(s) = guard.as_ref() else {
            return Err(CollectiveError::Aborted {
                rank,
                reason: "the call-description buffers were lost in an earlier failure".into(),
            });
        };
        let off = rank * DESC_BYTES;
        let bytes = desc.encode_fixed();
        let (dev, host) = (s.dev, s.host);
        let result = (|| {
            // SAFETY: `host` is pinned memory of `world * DESC_BYTES` bytes owned by this
            // communicator and only touched by this thread; the previous exchange's copies have
            // completed (it waited for them), so nothing else reads or writes it now.
            let mine = unsafe { std::slice::from_raw_parts_mut(host.add(off), DESC_BYTES) };
            mine.copy_from_slice(&bytes);
            // SAFETY: device scratch of world * DESC_BYTES bytes; source pinned and alive until
            // the copy completes (waited for below, or leaked on failure).
            unsafe { cu::memcpy_htod_async(dev + off as u64, &*mine, self.cu_stream()) }
                .map_err(self.driver("cuMemcpyHtoDAsync"))?;
            self.nccl(op, seq, deadline, |comm| {
                // SAFETY: in-place all-gather (send = this rank's block of recv) on the device
                // scratch, on this communicator's stream.
                unsafe {
                    sys::ncclAllGather(
                        (dev + off as u64) as *const c_void,
                        dev as *mut c_void,
                        DESC_BYTES,
                        sys::ncclDataType_t::ncclUint8,
                        comm,
                        self.nccl_stream(),
                    )
                }
            })?;
            // SAFETY: as above; the whole host mirror receives the gathered descriptions.
            let all = unsafe { std::slice::from_raw_parts_mut(host, world * DESC_BYTES) };
            // SAFETY: device scratch and pinned host mirror of the same size.
            unsafe { cu::memcpy_dtoh_async(all, dev, self.cu_stream()) }
                .map_err(self.driver("cuMemcpyDtoHAsync"))?;
            let ev = self.record()?;
            self.wait_event(&ev, op, seq, deadline)
        })();
        if let Err(e) = result {
            if !self.settle() {
                // Copies may still be in flight: drop the handles without freeing (Scratch has
                // no Drop; only `Inner::drop` frees what is still here), so the memory is leaked.
                let _leaked = guard.take();
            }
            return Err(e);
        }
        // SAFETY: the copies have completed (event waited for); nothing else touches `host`.
        let all = unsafe { std::slice::from_raw_parts(host, world * DESC_BYTES) };
        let raw: Vec<&[u8]> = all.chunks(DESC_BYTES).collect();
        desc::decode_all_fixed(&raw)
            .and_then(|descs| desc::compare(&descs, seq))
            .map_err(|details| CollectiveError::Mismatch { rank, seq, details })
    }

    /// The proxy task of one collective.
    fn run(
        &self,
        seq: u64,
        mut desc: Desc,
        tickets: Option<Vec<AccessTicket>>,
        launch: Option<Launch>,
    ) -> Result<()> {
        let (rank, op) = (self.rank, desc.op);
        if let Some(reason) = self.aborted() {
            return Err(CollectiveError::Aborted { rank, reason });
        }
        let timeout = self.opts.timeout;
        let deadline = Instant::now() + timeout;
        let mut local_failure = None;
        let mut guards = Vec::new();
        for t in tickets.into_iter().flatten() {
            let left = deadline.saturating_duration_since(Instant::now());
            match t.acquire(left) {
                Ok(g) => guards.push(g),
                Err(e) => {
                    desc.invalid = Some(format!("its buffers stayed busy: {e}"));
                    local_failure = Some(e.to_string());
                    guards.clear();
                    break;
                }
            }
        }
        self.ctx
            .bind_to_thread()
            .map_err(self.driver("cuCtxSetCurrent"))?;
        if self.world > 1 && (self.opts.verify || op == "barrier") {
            self.exchange(&desc, seq, deadline)?;
        }
        if let Some(why) = local_failure {
            return Err(CollectiveError::Device {
                rank,
                source: fsdp_device::DeviceError::Timeout {
                    what: format!("access to the buffers of {op}: {why}"),
                    waited: timeout,
                },
            });
        }
        if desc.invalid.is_some() {
            // The caller already got the InvalidArgument error; the peers got a Mismatch.
            return Err(CollectiveError::InvalidArgument {
                rank,
                op,
                reason: "invalid arguments (reported when the call was issued)".into(),
            });
        }
        let Some(launch) = launch else {
            return Ok(());
        };
        let launched = launch(self, &guards, seq, deadline);
        let result = launched.and_then(|()| {
            let ev = self.record()?;
            self.wait_event(&ev, op, seq, deadline)
        });
        if result.is_err() && !self.settle() {
            // NCCL may still access these buffers: leak them rather than let them be reused.
            tracing::error!(
                rank,
                seq,
                "NCCL work did not stop after abort; leaking its buffers"
            );
            std::mem::forget(guards);
        }
        result
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let comm = self.comm.swap(std::ptr::null_mut(), Ordering::SeqCst);
        if !comm.is_null() {
            // Finalize (flush, bounded), then destroy; abort if that does not work out.
            let deadline = Instant::now() + self.opts.timeout.min(Duration::from_secs(60));
            // SAFETY: `comm` is live and no task uses it any more (they hold this value).
            let r = unsafe { sys::ncclCommFinalize(comm) };
            let finalized =
                ffi::is_ok_or_in_progress(r) && matches!(poll_comm(comm, deadline), Poll::Ready);
            // SAFETY: as above; exactly one of destroy or abort, once.
            let r = unsafe {
                if finalized {
                    sys::ncclCommDestroy(comm)
                } else {
                    sys::ncclCommAbort(comm)
                }
            };
            if r != sys::ncclResult_t::ncclSuccess {
                tracing::error!(
                    rank = self.rank,
                    "destroying the NCCL communicator: {}",
                    ffi::error_string(r)
                );
            }
        }
        if let Some(s) = lock(&self.scratch).take() {
            // SAFETY: allocated in `Scratch::new` on this stream; no copy is in flight (a failed
            // exchange leaks the scratch instead).
            unsafe {
                let _ = cu::free_async(s.dev, self.cu_stream());
                let _ = cu::free_host(s.host.cast());
            }
            let _ = s.bytes;
        }
    }
}

impl Scratch {
    fn new(world: usize, stream: &CudaStream) -> std::result::Result<Scratch, cu::DriverError> {
        let bytes = world * DESC_BYTES;
        // SAFETY: the context is current (bound by the caller); the memory is freed in Drop.
        let dev = unsafe { cu::malloc_async(stream.cu_stream(), bytes) }?;
        // SAFETY: as above; pinned host memory for the exchange's copies.
        let host = match unsafe { cu::malloc_host(bytes, 0) } {
            Ok(h) => h.cast::<u8>(),
            Err(e) => {
                // SAFETY: allocated just above on this stream, never used.
                let _ = unsafe { cu::free_async(dev, stream.cu_stream()) };
                return Err(e);
            }
        };
        Ok(Scratch { dev, host, bytes })
    }
}

/// One rank of an NCCL communicator, on one GPU. Not `Sync`: use it from one thread (its
/// collectives run on its own proxy stream).
pub struct NcclCommunicator {
    inner: Arc<Inner>,
    stream: Stream,
    next_seq: Mutex<u64>,
}

impl fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NcclCommunicator(rank {}/{} on cuda:{})",
            self.inner.rank, self.inner.world, self.inner.ordinal
        )
    }
}

impl NcclCommunicator {
    /// Rank `store.rank()` of a communicator of `store.world_size()` ranks, on GPU
    /// `device_ordinal`: rank 0 creates the unique id and publishes it in the store, the others
    /// read it (waiting up to the store's timeout), then every rank joins
    /// (`ncclCommInitRankConfig`, bounded by `opts.timeout`). Each call on a store makes a new
    /// communicator: the i-th call of every rank uses the same key.
    pub fn new(store: &TcpStore, device_ordinal: usize, opts: NcclOptions) -> Result<Self> {
        let (rank, world) = (store.rank(), store.world_size());
        ffi::probe_libraries(rank)?;
        let n = store.add(&format!("nccl/instances/rank{rank}"), 1)?;
        let key = format!("nccl/unique_id/{n}");
        let id = if rank == 0 {
            let id = UniqueId::new().map_err(|e| with_rank(e, rank))?;
            store.set(&key, &id.to_bytes())?;
            id
        } else {
            UniqueId::from_bytes(&store.get(&key)?).map_err(|e| with_rank(e, rank))?
        };
        Self::from_unique_id(&id, rank, world, device_ordinal, opts)
    }

    /// Rank `rank` of `world_size` ranks on GPU `device_ordinal`, joining the communicator of
    /// `id` (every rank passes the same id). Ranks may be threads of one process: with NCCL ≥
    /// 2.30 and `NCCL_MULTI_RANK_GPU_ENABLE=1` several may even share a GPU.
    pub fn from_unique_id(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        device_ordinal: usize,
        opts: NcclOptions,
    ) -> Result<Self> {
        let invalid = |reason: String| CollectiveError::InvalidArgument {
            rank,
            op: "NcclCommunicator::from_unique_id",
            reason,
        };
        if world_size == 0 || world_size > i32::MAX as usize {
            return Err(invalid(format!(
                "world size {world_size} (must be 1..=2^31-1)"
            )));
        }
        if rank >= world_size {
            return Err(invalid(format!("rank {rank} >= world size {world_size}")));
        }
        available().map_err(|e| with_rank(e, rank))?;
        let (ctx, cuda) = open_device(rank, device_ordinal)?;
        let id = *id;
        ffi::guarded(rank, "ncclCommInitRankConfig", move || {
            ctx.bind_to_thread().map_err(|e| CollectiveError::Backend {
                rank,
                backend: "nccl",
                op: "cuCtxSetCurrent",
                reason: format!("{e:?}"),
            })?;
            let mut config = ffi::nonblocking_config();
            let mut comm: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: the library is present and recent enough (checked); pointers are to live
            // locals; the device's context is current on this thread, which is how NCCL picks
            // the GPU.
            let r = unsafe {
                sys::ncclCommInitRankConfig(
                    &mut comm,
                    world_size as i32,
                    id.0,
                    rank as i32,
                    &mut config,
                )
            };
            let deadline = Instant::now() + opts.timeout;
            let outcome = if !ffi::is_ok_or_in_progress(r) {
                Poll::Failed(r)
            } else if comm.is_null() {
                Poll::Failed(sys::ncclResult_t::ncclInternalError)
            } else {
                poll_comm(comm, deadline)
            };
            let fail = |comm: sys::ncclComm_t| {
                if !comm.is_null() {
                    // SAFETY: a communicator that failed or timed out in initialisation, aborted
                    // once.
                    unsafe { sys::ncclCommAbort(comm) };
                }
            };
            match outcome {
                Poll::Ready => {
                    Self::from_parts(comm, rank, world_size, device_ordinal, opts, ctx, cuda)
                }
                Poll::Failed(e) => {
                    let mut reason = ffi::error_string(e);
                    if let Some(last) = ffi::last_error(comm) {
                        reason = format!("{reason}: {last}");
                    }
                    fail(comm);
                    Err(CollectiveError::Backend {
                        rank,
                        backend: "nccl",
                        op: "ncclCommInitRankConfig",
                        reason,
                    })
                }
                Poll::TimedOut => {
                    fail(comm);
                    Err(CollectiveError::Timeout {
                        rank,
                        op: "ncclCommInitRankConfig",
                        seq: 0,
                        waited: opts.timeout,
                        waiting_for: format!(
                            "not every rank of 0..{world_size} joined the communicator"
                        ),
                    })
                }
            }
        })
    }

    /// Wrap an initialised communicator (from init or split).
    fn from_parts(
        comm: sys::ncclComm_t,
        rank: usize,
        world: usize,
        ordinal: usize,
        opts: NcclOptions,
        ctx: Arc<CudaContext>,
        cuda: Arc<CudaStream>,
    ) -> Result<Self> {
        let scratch = match Scratch::new(world, &cuda) {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: a live communicator that nothing else holds.
                unsafe { sys::ncclCommAbort(comm) };
                return Err(CollectiveError::Backend {
                    rank,
                    backend: "nccl",
                    op: "cuMemAllocAsync",
                    reason: format!("{e:?}"),
                });
            }
        };
        let stream = Stream::cpu_with_timeout(
            format!("nccl-proxy:{rank}/{world}:cuda{ordinal}"),
            opts.timeout,
        );
        Ok(NcclCommunicator {
            inner: Arc::new(Inner {
                rank,
                world,
                ordinal,
                opts,
                ctx,
                cuda,
                comm: AtomicPtr::new(comm),
                aborted: Mutex::new(None),
                scratch: Mutex::new(Some(scratch)),
            }),
            stream,
            next_seq: Mutex::new(0),
        })
    }

    /// The CUDA stream NCCL runs on. Other streams can wait for a collective with
    /// `other.wait(&event)` on an event recorded here after [`Work::wait`], or make this stream
    /// wait for their producers before issuing.
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.inner.cuda
    }

    /// The CUDA context of the communicator's GPU (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The GPU's ordinal.
    pub fn device_ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The communicator's options.
    pub fn options(&self) -> &NcclOptions {
        &self.inner.opts
    }

    /// Why the communicator was aborted, if it was.
    pub fn abort_reason(&self) -> Option<String> {
        self.inner.aborted()
    }

    fn invalid(&self, op: &'static str, reason: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            rank: self.inner.rank,
            op,
            reason,
        }
    }

    fn check_host_copy<T: Element>(
        &self,
        op: &'static str,
        buf: &Buffer,
        len: usize,
    ) -> Result<()> {
        let dev = Device::Cuda(self.inner.ordinal);
        if buf.device() != dev {
            return Err(self.invalid(op, format!("buffer on {}, expected {dev}", buf.device())));
        }
        if buf.dtype() != T::DTYPE {
            return Err(self.invalid(
                op,
                format!("buffer of {}, host data of {}", buf.dtype(), T::DTYPE),
            ));
        }
        if buf.len() != len {
            return Err(self.invalid(
                op,
                format!("buffer of {} elements, host data of {len}", buf.len()),
            ));
        }
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(self.inner.driver("cuCtxSetCurrent"))
    }

    /// Copy `data` into the device buffer `buf`, after the collectives issued on it before
    /// (waits up to the timeout for them), synchronously.
    pub fn copy_from_host<T: Element>(&self, buf: &Buffer, data: &[T]) -> Result<()> {
        self.check_host_copy::<T>("copy_from_host", buf, data.len())?;
        let g = buf
            .access(AccessMode::Exclusive)
            .acquire(self.inner.opts.timeout)
            .map_err(|source| CollectiveError::Device {
                rank: self.inner.rank,
                source,
            })?;
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: exclusive access to `buf`, device memory of `data.len()` elements of T on this
        // context (checked), which is current on this thread.
        unsafe { cu::memcpy_htod_sync(g.as_ptr() as u64, data) }
            .map_err(self.inner.driver("cuMemcpyHtoD"))
    }

    /// Copy the device buffer `buf` to the host, after the collectives issued on it before.
    pub fn copy_to_host<T: Element>(&self, buf: &Buffer) -> Result<Vec<T>> {
        self.check_host_copy::<T>("copy_to_host", buf, buf.len())?;
        let g = buf
            .access(AccessMode::Shared)
            .acquire(self.inner.opts.timeout)
            .map_err(|source| CollectiveError::Device {
                rank: self.inner.rank,
                source,
            })?;
        let mut out = vec![T::default(); buf.len()];
        if out.is_empty() {
            return Ok(out);
        }
        // SAFETY: shared access to `buf`, device memory of `out.len()` elements of T on this
        // context (checked), which is current on this thread.
        unsafe { cu::memcpy_dtoh_sync(&mut out, g.as_ptr() as u64) }
            .map_err(self.inner.driver("cuMemcpyDtoH"))?;
        Ok(out)
    }

    /// Issue a collective: take a sequence number, enqueue the proxy task, return its work. A
    /// call that failed validation returns the error here; when the ranks verify their calls it
    /// still takes part in the description exchange, so that the peers fail too instead of
    /// waiting.
    fn issue(
        &self,
        mut desc: Desc,
        check: std::result::Result<Vec<AccessTicket>, String>,
        launch: Option<Launch>,
    ) -> Result<Work> {
        let inner = &self.inner;
        let (rank, op) = (inner.rank, desc.op);
        if let Some(reason) = inner.aborted() {
            return Err(CollectiveError::Aborted { rank, reason });
        }
        let (tickets, local_error) = match check {
            Ok(t) => (Some(t), None),
            Err(reason) => {
                desc.invalid = Some(reason.clone());
                (None, Some(self.invalid(op, reason)))
            }
        };
        if let Some(e) = &local_error {
            if !(inner.opts.verify && inner.world > 1) {
                return Err(e.clone());
            }
        }
        let task_inner = inner.clone();
        let work = enqueue_collective(
            &self.stream,
            &self.next_seq,
            rank,
            op,
            inner.opts.timeout,
            move |seq| {
                let mut desc = desc;
                desc.seq = seq;
                task_inner.run(seq, desc, tickets, launch)
            },
        )?;
        match local_error {
            Some(e) => Err(e),
            None => Ok(work),
        }
    }

    /// Where this communicator's buffers live.
    fn placement(&self) -> Placement {
        Placement::on("nccl", Device::Cuda(self.inner.ordinal))
    }

    fn check_op(op: ReduceOp) -> std::result::Result<sys::ncclRedOp_t, String> {
        ffi::nccl_op(op).ok_or_else(|| format!("reduce op {op} is not supported by NCCL"))
    }

    /// [`Communicator::split`] returning the concrete type.
    pub fn split_nccl(&self, color: Option<u32>, key: usize) -> Result<Option<NcclCommunicator>> {
        let inner = &self.inner;
        let rank = inner.rank;
        let mut desc = Desc::new("split");
        let check = (|| {
            if let Some(c) = color {
                if c > i32::MAX as u32 {
                    return Err(format!("color {c} > {} (NCCL takes an int)", i32::MAX));
                }
            }
            if key > i32::MAX as usize {
                return Err(format!("key {key} > {} (NCCL takes an int)", i32::MAX));
            }
            Ok(Vec::new())
        })();
        desc.count = 0;
        let (tx, rx) = crossbeam_channel::bounded::<SendComm>(1);
        let color_c = color.map_or(ffi::SPLIT_NOCOLOR, |c| c as i32);
        let key_c = key.min(i32::MAX as usize) as i32;
        let launch: Launch = Box::new(move |inner, _guards, seq, deadline| {
            let comm = inner.comm()?;
            let mut config = ffi::nonblocking_config();
            let mut newcomm: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: `comm` is live; pointers are to live locals; every rank of the parent
            // calls this (the description exchange checked that they all reached a split).
            let r = unsafe { sys::ncclCommSplit(comm, color_c, key_c, &mut newcomm, &mut config) };
            let abort_new = |c: sys::ncclComm_t| {
                if !c.is_null() {
                    // SAFETY: the new communicator is not handed out; aborted once.
                    unsafe { sys::ncclCommAbort(c) };
                }
            };
            if !ffi::is_ok_or_in_progress(r) {
                abort_new(newcomm);
                return Err(inner.nccl_error(comm, "split", r));
            }
            for c in [comm, newcomm] {
                if c.is_null() {
                    continue;
                }
                match poll_comm(c, deadline) {
                    Poll::Ready => {}
                    Poll::Failed(e) => {
                        let err = inner.nccl_error(c, "split", e);
                        abort_new(newcomm);
                        return Err(err);
                    }
                    Poll::TimedOut => {
                        abort_new(newcomm);
                        return Err(inner.timeout_error(
                            "split",
                            seq,
                            "ncclCommSplit did not complete on every rank".into(),
                        ));
                    }
                }
            }
            let _ = tx.send(SendComm(newcomm));
            Ok(())
        });
        let work = self.issue(desc, check, Some(launch))?;
        work.wait()?;
        let Ok(SendComm(newcomm)) = rx.try_recv() else {
            return Err(CollectiveError::Aborted {
                rank,
                reason: "split ended without a result".into(),
            });
        };
        if newcomm.is_null() {
            return Ok(None);
        }
        let (mut new_rank, mut new_world) = (0i32, 0i32);
        // SAFETY: `newcomm` is a ready communicator that only this thread holds.
        let r1 = unsafe { sys::ncclCommUserRank(newcomm, &mut new_rank) };
        // SAFETY: as above.
        let r2 = unsafe { sys::ncclCommCount(newcomm, &mut new_world) };
        if r1 != sys::ncclResult_t::ncclSuccess || r2 != sys::ncclResult_t::ncclSuccess {
            // SAFETY: not handed out; aborted once.
            unsafe { sys::ncclCommAbort(newcomm) };
            return Err(inner.backend("split", "could not query the new communicator".into()));
        }
        let cuda = match inner.ctx.new_stream() {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: not handed out; aborted once.
                unsafe { sys::ncclCommAbort(newcomm) };
                return Err(inner.backend("split", format!("cuStreamCreate: {e:?}")));
            }
        };
        NcclCommunicator::from_parts(
            newcomm,
            new_rank as usize,
            new_world as usize,
            inner.ordinal,
            inner.opts.clone(),
            inner.ctx.clone(),
            cuda,
        )
        .map(Some)
    }
}

/// A new communicator in transit from the proxy thread to the caller of split.
struct SendComm(sys::ncclComm_t);
// SAFETY: the handle is moved, not shared: the proxy thread never uses it after sending.
unsafe impl Send for SendComm {}

fn with_rank(e: CollectiveError, rank: usize) -> CollectiveError {
    match e {
        CollectiveError::Unavailable {
            backend, reason, ..
        } => CollectiveError::Unavailable {
            rank,
            backend,
            reason,
        },
        CollectiveError::Backend {
            backend,
            op,
            reason,
            ..
        } => CollectiveError::Backend {
            rank,
            backend,
            op,
            reason,
        },
        CollectiveError::InvalidArgument { op, reason, .. } => {
            CollectiveError::InvalidArgument { rank, op, reason }
        }
        other => other,
    }
}

/// Open GPU `ordinal` (its primary context) and a stream for NCCL; errors are `Unavailable`.
fn open_device(rank: usize, ordinal: usize) -> Result<(Arc<CudaContext>, Arc<CudaStream>)> {
    let unavailable = |reason: String| CollectiveError::Unavailable {
        rank,
        backend: "nccl",
        reason,
    };
    let ctx = catch_unwind(AssertUnwindSafe(|| CudaContext::new(ordinal)))
        .map_err(|_| unavailable("the CUDA driver could not be initialised".into()))?
        .map_err(|e| unavailable(format!("CUDA device {ordinal} could not be opened: {e:?}")))?;
    let cuda = ctx
        .new_stream()
        .map_err(|e| unavailable(format!("no stream on CUDA device {ordinal}: {e:?}")))?;
    Ok((ctx, cuda))
}

fn void(p: *mut u8) -> *mut c_void {
    p.cast()
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world_size(&self) -> usize {
        self.inner.world
    }

    fn stream(&self) -> &Stream {
        &self.stream
    }

    fn all_gather_base(&self, input: &Buffer, output: &Buffer) -> Result<Work> {
        let (world, rank) = (self.inner.world, self.inner.rank);
        let n = input.len();
        let mut desc = Desc::new("all_gather_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        let in_place = input.overlaps(output);
        let check = self
            .placement()
            .all_gather_base(rank, world, input, output)
            .map(|a| a.tickets);
        let dtype = input.dtype();
        let launch: Launch = Box::new(move |inner, guards, seq, deadline| {
            if n == 0 {
                return Ok(());
            }
            let out = guards[guards.len() - 1].as_ptr();
            let inp = if in_place {
                out.wrapping_add(rank * n * dtype.size_in_bytes())
            } else {
                guards[0].as_ptr()
            };
            inner.nccl("all_gather_base", seq, deadline, |comm| {
                // SAFETY: the guards hold the input (shared) and output (exclusive) device
                // buffers of the checked sizes until the collective has finished on the GPU.
                unsafe {
                    sys::ncclAllGather(
                        inp as *const c_void,
                        void(out),
                        n,
                        ffi::nccl_dtype(dtype),
                        comm,
                        inner.nccl_stream(),
                    )
                }
            })
        });
        self.issue(desc, check, Some(launch))
    }

    fn reduce_scatter_base(&self, input: &Buffer, output: &Buffer, op: ReduceOp) -> Result<Work> {
        let (world, rank) = (self.inner.world, self.inner.rank);
        let n = output.len();
        let mut desc = Desc::new("reduce_scatter_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let in_place = input.overlaps(output);
        let nop = Self::check_op(op);
        let check = nop.clone().and_then(|_| {
            self.placement()
                .reduce_scatter_base(rank, world, input, output)
                .map(|a| a.tickets)
        });
        let dtype = input.dtype();
        let launch: Launch = Box::new(move |inner, guards, seq, deadline| {
            let nop = nop.map_err(|r| inner.backend("reduce_scatter_base", r))?;
            if n == 0 {
                return Ok(());
            }
            let inp = guards[0].as_ptr();
            let out = if in_place {
                inp.wrapping_add(rank * n * dtype.size_in_bytes())
            } else {
                guards[1].as_ptr()
            };
            inner.nccl("reduce_scatter_base", seq, deadline, |comm| {
                // SAFETY: the guards hold input (shared, or exclusive in place) and output
                // (exclusive) of the checked sizes until the collective has finished.
                unsafe {
                    sys::ncclReduceScatter(
                        inp as *const c_void,
                        void(out),
                        n,
                        ffi::nccl_dtype(dtype),
                        nop,
                        comm,
                        inner.nccl_stream(),
                    )
                }
            })
        });
        self.issue(desc, check, Some(launch))
    }

    fn all_reduce(&self, buf: &Buffer, op: ReduceOp) -> Result<Work> {
        let n = buf.len();
        let mut desc = Desc::new("all_reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let nop = Self::check_op(op);
        let check = nop
            .clone()
            .and_then(|_| self.placement().all_reduce(buf).map(|a| a.tickets));
        let dtype = buf.dtype();
        let launch: Launch = Box::new(move |inner, guards, seq, deadline| {
            let nop = nop.map_err(|r| inner.backend("all_reduce", r))?;
            if n == 0 {
                return Ok(());
            }
            let p = guards[0].as_ptr();
            inner.nccl("all_reduce", seq, deadline, |comm| {
                // SAFETY: exclusive guard over the buffer (in place) until the collective ends.
                unsafe {
                    sys::ncclAllReduce(
                        p as *const c_void,
                        void(p),
                        n,
                        ffi::nccl_dtype(dtype),
                        nop,
                        comm,
                        inner.nccl_stream(),
                    )
                }
            })
        });
        self.issue(desc, check, Some(launch))
    }

    fn broadcast(&self, buf: &Buffer, root: usize) -> Result<Work> {
        let rank = self.inner.rank;
        let n = buf.len();
        let mut desc = Desc::new("broadcast");
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.root = Some(root);
        let check = self
            .placement()
            .broadcast(rank, self.inner.world, buf, root)
            .map(|a| a.tickets);
        let dtype = buf.dtype();
        let launch: Launch = Box::new(move |inner, guards, seq, deadline| {
            if n == 0 {
                return Ok(());
            }
            let p = guards[0].as_ptr();
            inner.nccl("broadcast", seq, deadline, |comm| {
                // SAFETY: the root only reads its buffer (shared guard); the others own theirs
                // (exclusive); in place; held until the collective ends.
                unsafe {
                    sys::ncclBroadcast(
                        p as *const c_void,
                        void(p),
                        n,
                        ffi::nccl_dtype(dtype),
                        root as i32,
                        comm,
                        inner.nccl_stream(),
                    )
                }
            })
        });
        self.issue(desc, check, Some(launch))
    }

    fn reduce(&self, buf: &Buffer, op: ReduceOp, root: usize) -> Result<Work> {
        let rank = self.inner.rank;
        let n = buf.len();
        let mut desc = Desc::new("reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        desc.root = Some(root);
        let nop = Self::check_op(op);
        let check = nop.clone().and_then(|_| {
            self.placement()
                .reduce(rank, self.inner.world, buf, root)
                .map(|a| a.tickets)
        });
        let dtype = buf.dtype();
        let launch: Launch = Box::new(move |inner, guards, seq, deadline| {
            let nop = nop.map_err(|r| inner.backend("reduce", r))?;
            if n == 0 {
                return Ok(());
            }
            let p = guards[0].as_ptr();
            inner.nccl("reduce", seq, deadline, |comm| {
                // SAFETY: non-root ranks only read their buffer (NCCL writes recvbuff only on
                // the root); the root owns its exclusively; held until the collective ends.
                unsafe {
                    sys::ncclReduce(
                        p as *const c_void,
                        void(p),
                        n,
                        ffi::nccl_dtype(dtype),
                        nop,
                        root as i32,
                        comm,
                        inner.nccl_stream(),
                    )
                }
            })
        });
        self.issue(desc, check, Some(launch))
    }

    fn barrier(&self) -> Result<Work> {
        // The description exchange (a 64-byte all-gather) is the barrier.
        self.issue(Desc::new("barrier"), Ok(Vec::new()), None)
    }

    fn all_gather(&self, input: &Buffer, outputs: &[Buffer]) -> Result<Work> {
        let (world, rank) = (self.inner.world, self.inner.rank);
        let sizes: Vec<usize> = outputs.iter().map(Buffer::len).collect();
        let mut desc = Desc::new("all_gather");
        desc.dtype = Some(input.dtype());
        desc.count = input.len();
        desc.sizes = Some(Sizes::List(sizes.clone()));
        let dtype = input.dtype();
        let esz = dtype.size_in_bytes();
        let max = sizes.iter().copied().max().unwrap_or(0);
        let check = (|| {
            if max
                .checked_mul(esz)
                .and_then(|b| b.checked_mul(world + 1))
                .is_none()
            {
                return Err("the padded temporary buffer would overflow usize".into());
            }
            self.placement()
                .all_gather(rank, world, input, outputs)
                .map(|a| a.tickets)
        })();
        let launch: Launch = Box::new(move |inner, guards, seq, deadline| {
            if max == 0 {
                return Ok(());
            }
            // Pad every input to the largest, all-gather base into one flat temporary, copy out.
            let s = inner.cu_stream();
            let bytes = max * esz * (world + 1);
            // SAFETY: stream-ordered allocation on this communicator's stream (no device-wide
            // synchronisation, unlike cuMemFree), freed below after the copies in stream order.
            let tmp =
                unsafe { cu::malloc_async(s, bytes) }.map_err(inner.driver("cuMemAllocAsync"))?;
            let flat = tmp + (max * esz) as u64;
            let result = (|| {
                if sizes[rank] > 0 {
                    // SAFETY: guards[0] is this rank's input (sizes[rank] elements); tmp holds
                    // at least that many bytes.
                    unsafe {
                        cu::memcpy_dtod_async(tmp, guards[0].as_ptr() as u64, sizes[rank] * esz, s)
                    }
                    .map_err(inner.driver("cuMemcpyDtoDAsync"))?;
                }
                inner.nccl("all_gather", seq, deadline, |comm| {
                    // SAFETY: padded input and flat output are private to this task.
                    unsafe {
                        sys::ncclAllGather(
                            tmp as *const c_void,
                            flat as *mut c_void,
                            max,
                            ffi::nccl_dtype(dtype),
                            comm,
                            inner.nccl_stream(),
                        )
                    }
                })?;
                for (i, g) in guards[1..].iter().enumerate() {
                    if sizes[i] == 0 {
                        continue;
                    }
                    // SAFETY: exclusive guard over outputs[i] (sizes[i] elements); block i of
                    // the flat buffer holds at least that many.
                    unsafe {
                        cu::memcpy_dtod_async(
                            g.as_ptr() as u64,
                            flat + (i * max * esz) as u64,
                            sizes[i] * esz,
                            s,
                        )
                    }
                    .map_err(inner.driver("cuMemcpyDtoDAsync"))?;
                }
                Ok(())
            })();
            // SAFETY: allocated above on this stream; freed after the work enqueued on it.
            let freed = unsafe { cu::free_async(tmp, s) };
            result?;
            freed.map_err(inner.driver("cuMemFreeAsync"))
        });
        self.issue(desc, check, Some(launch))
    }

    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Box<dyn Communicator>>> {
        Ok(self
            .split_nccl(color, key)?
            .map(|c| Box::new(c) as Box<dyn Communicator>))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without the libraries (this machine), every entry point fails with `Unavailable` naming
    /// the library, never a panic. Where they are present, the probe succeeds.
    #[test]
    fn missing_libraries_are_an_error_not_a_panic() {
        // SAFETY: only tries to open the libraries.
        let (cuda, nccl) = unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::nccl::sys::is_culib_present(),
            )
        };
        let probe = ffi::probe_libraries(3);
        match (cuda, nccl) {
            (true, true) => assert!(probe.is_ok(), "{probe:?}"),
            _ => {
                let err = probe.unwrap_err();
                let want = if cuda { "libnccl" } else { "libcuda" };
                assert!(matches!(
                    err,
                    CollectiveError::Unavailable {
                        rank: 3,
                        backend: "nccl",
                        ..
                    }
                ));
                assert!(err.to_string().contains(want), "{err}");
                assert!(err.to_string().contains("LD_LIBRARY_PATH"), "{err}");
                let err = UniqueId::new().unwrap_err();
                assert!(err.to_string().contains(want), "{err}");
                let id = UniqueId::from_bytes(&[0u8; 128]).unwrap();
                let err = NcclCommunicator::from_unique_id(&id, 1, 2, 0, NcclOptions::default())
                    .unwrap_err();
                assert!(
                    matches!(err, CollectiveError::Unavailable { rank: 1, .. }),
                    "{err}"
                );
                assert!(version().is_err());
                assert!(available().is_err());
            }
        }
    }

    #[test]
    fn constructor_arguments_are_checked_first() {
        let id = UniqueId::from_bytes(&[7u8; 128]).unwrap();
        assert_eq!(id.to_bytes(), [7u8; 128]);
        let err = UniqueId::from_bytes(&[0u8; 5]).unwrap_err();
        assert!(err.to_string().contains("5 bytes, expected 128"), "{err}");
        let err =
            NcclCommunicator::from_unique_id(&id, 2, 2, 0, NcclOptions::default()).unwrap_err();
        assert!(err.to_string().contains("rank 2 >= world size 2"), "{err}");
        let err =
            NcclCommunicator::from_unique_id(&id, 0, 0, 0, NcclOptions::default()).unwrap_err();
        assert!(err.to_string().contains("world size 0"), "{err}");
    }
}
