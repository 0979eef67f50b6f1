//! The NCCL backend (cargo feature `nccl`): collectives on CUDA buffers through NCCL, loaded at
//! run time by cudarc (found on the loader path or in a Python package's `site-packages`, see
//! `fsdp_device::cuda::libs`) — the program builds and runs without CUDA or NCCL installed, and
//! asking for this backend there is an error ([`CollectiveError::Unavailable`]) that names the
//! library that could not be loaded, never a panic.
//!
//! # Streams, the way `ProcessGroupNCCL` does it
//! A communicator owns a CUDA stream NCCL runs on ([`Communicator::stream`],
//! [`NcclCommunicator::cuda_stream`]) and has a *current stream*
//! ([`NcclCommunicator::current_stream`]): the stream that produces the buffers handed to it and
//! consumes the results (PyTorch's `torch.cuda.current_stream()`); it is the NCCL stream itself
//! until [`set_current_stream`](NcclCommunicator::set_current_stream) names another. Each
//! collective is launched on the calling thread:
//! 1. the NCCL stream waits, on the GPU (`cuStreamWaitEvent`), for an event recorded on the
//!    current stream, so the producers of the buffers are ordered before it without a host wait;
//! 2. the NCCL call is enqueued on the NCCL stream, then an end event (from the device's event
//!    pool) is recorded after it;
//! 3. the returned [`Work`] holds clones of the buffers until the end event completed, so the
//!    caching allocator never hands their blocks out early; [`Work::wait`] makes the current
//!    stream wait for the end event on the GPU and does not block the host, and
//!    [`Work::synchronize`] blocks the host (bounded) until the result is known.
//!
//! Back-to-back collectives therefore queue on the GPU with no host round trip between them.
//! Uploads and downloads ([`copy_from_host`](NcclCommunicator::copy_from_host),
//! [`copy_to_host`](NcclCommunicator::copy_to_host)) go through pinned staging memory with
//! asynchronous copies on the NCCL stream, ordered after the current stream and the collectives
//! issued before, and never use the legacy default stream or synchronise the device. All
//! communicators and streams of a GPU share the process's one context of it
//! (`fsdp_device::cuda::context`).
//!
//! # Watchdog and abort of every rank
//! A watchdog thread per communicator polls the outstanding end events (completing each
//! [`Work`] and releasing its buffers) and `ncclCommGetAsyncError` (read as an integer). A
//! collective that has not finished [`NcclOptions::timeout`] after its launch, or an NCCL
//! error, makes it **abort every rank**: it publishes the reason in the communicator's abort
//! flag — a key in the store under `nccl/<n>/abort` for communicators made by
//! [`NcclCommunicator::new`], a slot shared in the process by the ranks that joined with the
//! same [`UniqueId`] otherwise — and aborts its own communicator (`ncclCommAbort`, which stops
//! its kernels). Every rank's watchdog reads the flag every 200 ms and aborts its own
//! communicator when it is set; from then on every call fails with [`CollectiveError::Aborted`]
//! and outstanding works fail. Dropping a communicator goes straight to `ncclCommAbort` when any
//! rank aborted; otherwise it finalises (`ncclCommFinalize`, a collective step, bounded by the
//! timeout) and destroys it. Ranks in several processes that joined through
//! [`from_unique_id`](NcclCommunicator::from_unique_id) share no flag: a timeout aborts the
//! local rank and the launcher ends the others.
//!
//! Communicators are **non-blocking** (`ncclConfig_t::blocking = 0`): initialisation (bounded by
//! [`NcclOptions::init_timeout`]), splits, finalisation and launches that set up connections
//! lazily return `ncclInProgress`, and the calling thread polls `ncclCommGetAsyncError` until
//! the call was taken, bounded by the collective timeout — so no NCCL call blocks the host
//! without a bound, and the watchdog can always abort.
//!
//! # Validation
//! Every call is checked before NCCL sees it (cudarc does not): each buffer is on this
//! communicator's GPU, element types agree, lengths fit (`output = world × input` for all-gather,
//! `input = world × output` for reduce-scatter), the root is a rank, and buffers overlap only in
//! the in-place forms NCCL accepts. NCCL itself cannot tell that ranks disagree (a different
//! length on one rank makes it hang or write out of bounds), so with [`NcclOptions::verify`] the
//! ranks all-gather a 192-byte description of each call first and compare it: a difference in
//! operation, element type, length, reduce op or root fails the collective on every rank with
//! [`CollectiveError::Mismatch`] before data moves, and a call that failed validation on one rank
//! fails on the others too instead of hanging. The check costs one small all-gather and a host
//! wait per collective (the bench `nccl_all_gather` prints it), so it is on by default in debug
//! builds and tests and off by default in release builds.
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

mod collectives;
mod comm;
mod ffi;
mod host;
mod validate;
mod watchdog;
mod work;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::sys;
use fsdp_device::{Stream, DEFAULT_TIMEOUT};

use self::comm::{lock, AbortFlag, Comm};
pub use self::ffi::version;
use self::validate::Scratch;
use self::watchdog::Watchdog;
use crate::store::TcpStore;
use crate::{CollectiveError, Result};

#[cfg(doc)]
use crate::{Communicator, Work};

/// Options of an NCCL communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NcclOptions {
    /// Bound of each collective (from its launch to its end on the GPU, checked by the
    /// watchdog), of launches that wait for lazy connection set-up, of splits, of host copies
    /// and of finalisation (at most 60 s); [`Work::synchronize`] waits up to twice this. Default:
    /// [`DEFAULT_TIMEOUT`] (300 s).
    pub timeout: Duration,
    /// Bound of joining the communicator (`ncclCommInitRankConfig`), which can take seconds on
    /// one GPU. Default: [`DEFAULT_TIMEOUT`].
    pub init_timeout: Duration,
    /// Compare a description of every call across ranks before running it (one 192-byte
    /// all-gather and a host wait per collective): mismatched calls then fail with
    /// [`CollectiveError::Mismatch`] on every rank instead of hanging or corrupting memory.
    /// Default: on in debug builds (and so in tests), off in release builds
    /// (`cfg!(debug_assertions)`).
    pub verify: bool,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            timeout: DEFAULT_TIMEOUT,
            init_timeout: DEFAULT_TIMEOUT,
            verify: cfg!(debug_assertions),
        }
    }
}

impl NcclOptions {
    /// These options with another collective timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These options with another initialisation timeout.
    pub fn with_init_timeout(mut self, timeout: Duration) -> Self {
        self.init_timeout = timeout;
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

    fn hex(&self) -> String {
        self.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// One rank of an NCCL communicator, on one GPU. Use it from one thread at a time (collectives
/// are launched on the calling thread, in call order).
pub struct NcclCommunicator {
    rank: usize,
    world: usize,
    ordinal: usize,
    opts: NcclOptions,
    ctx: Arc<CudaContext>,
    comm: Arc<Comm>,
    /// The NCCL stream, as a runtime stream and as cudarc's.
    stream: Stream,
    cuda: Arc<CudaStream>,
    current: Mutex<Stream>,
    next_seq: AtomicU64,
    splits: AtomicU64,
    /// `None` once leaked (a failed exchange left copies in flight).
    scratch: Mutex<Option<Scratch>>,
    /// The pinned staging of host copies, kept for the next one, and the smaller ones it
    /// replaced (freed on drop).
    staging: Mutex<(Option<host::Pinned>, Vec<host::Pinned>)>,
    /// `None` only while dropping.
    watchdog: Option<Watchdog>,
}

impl fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NcclCommunicator(rank {}/{} on cuda:{})",
            self.rank, self.world, self.ordinal
        )
    }
}

impl NcclCommunicator {
    /// Rank `store.rank()` of a communicator of `store.world_size()` ranks, on GPU
    /// `device_ordinal`: rank 0 creates the unique id and publishes it in the store, the others
    /// read it (waiting up to the store's timeout), then every rank joins (bounded by
    /// `opts.init_timeout`). Each call on a store makes a new communicator: the i-th call of
    /// every rank uses the same keys. The abort flag of every rank is the store key
    /// `nccl/<i>/abort`; a rank that fails to set up its device publishes it, so the peers fail
    /// fast instead of waiting for the init timeout.
    pub fn new(store: &TcpStore, device_ordinal: usize, opts: NcclOptions) -> Result<Self> {
        let (rank, world) = (store.rank(), store.world_size());
        ffi::probe_libraries(rank)?;
        let n = store.add(&format!("nccl/instances/rank{rank}"), 1)?;
        let flag = AbortFlag::Store {
            store: store.clone(),
            key: format!("nccl/{n}/abort"),
        };
        let key = format!("nccl/unique_id/{n}");
        let id = if rank == 0 {
            let id = UniqueId::new().map_err(|e| with_rank(e, rank))?;
            store.set(&key, &id.to_bytes())?;
            id
        } else {
            UniqueId::from_bytes(&store.get(&key)?).map_err(|e| with_rank(e, rank))?
        };
        Self::join(&id, rank, world, device_ordinal, opts, flag)
    }

    /// Rank `rank` of `world_size` ranks on GPU `device_ordinal`, joining the communicator of
    /// `id` (every rank passes the same id). Ranks may be threads of one process (they then
    /// share the abort flag); with NCCL ≥ 2.30 and `NCCL_MULTI_RANK_GPU_ENABLE=1` several may
    /// even share a GPU.
    pub fn from_unique_id(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        device_ordinal: usize,
        opts: NcclOptions,
    ) -> Result<Self> {
        let flag = AbortFlag::local(format!("nccl/{}", id.hex()));
        Self::join(id, rank, world_size, device_ordinal, opts, flag)
    }

    fn join(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        device_ordinal: usize,
        opts: NcclOptions,
        flag: AbortFlag,
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
        let setup = || -> Result<(Arc<CudaContext>, Stream)> {
            available().map_err(|e| with_rank(e, rank))?;
            let unavailable = |reason: String| CollectiveError::Unavailable {
                rank,
                backend: "nccl",
                reason,
            };
            let ctx = fsdp_device::cuda::context(device_ordinal)
                .map_err(|e| unavailable(format!("cuda:{device_ordinal}: {e}")))?;
            ctx.bind_to_thread().map_err(|e| {
                unavailable(format!("cuda:{device_ordinal}: cuCtxSetCurrent: {e:?}"))
            })?;
            let stream = Stream::cuda_with_timeout(
                device_ordinal,
                format!("nccl:{rank}/{world_size}:cuda{device_ordinal}"),
                opts.timeout,
            )
            .map_err(|e| unavailable(format!("no stream on cuda:{device_ordinal}: {e}")))?;
            Ok((ctx, stream))
        };
        let (ctx, stream) = match setup() {
            Ok(v) => v,
            Err(e) => {
                // Tell the peers (defect 3 of issue 15): they would otherwise wait in
                // initialisation for their whole init timeout.
                flag.publish(&format!("rank {rank} could not set up its device: {e}"));
                return Err(e);
            }
        };
        let raw = ffi::guarded(rank, "ncclCommInitRankConfig", || {
            comm::init_rank(&id.0, rank, world_size, opts.init_timeout, &flag)
        })
        .inspect_err(|e| flag.publish(&format!("rank {rank} failed to join: {e}")))?;
        Self::from_parts(
            raw,
            rank,
            world_size,
            device_ordinal,
            opts,
            ctx,
            stream,
            flag,
        )
    }

    /// Wrap an initialised communicator (from init or split).
    #[allow(clippy::too_many_arguments)]
    fn from_parts(
        raw: sys::ncclComm_t,
        rank: usize,
        world: usize,
        ordinal: usize,
        opts: NcclOptions,
        ctx: Arc<CudaContext>,
        stream: Stream,
        flag: AbortFlag,
    ) -> Result<Self> {
        let comm = Arc::new(Comm::new(raw, rank, flag));
        let Some(cuda) = stream.cuda_stream().cloned() else {
            comm.abort(
                "internal: the NCCL stream is not a CUDA stream".into(),
                true,
            );
            return Err(comm.aborted_error());
        };
        let scratch = match Scratch::new(world, &cuda) {
            Ok(s) => s,
            Err(e) => {
                let reason = format!("rank {rank}: cuMemAllocAsync of the check scratch: {e:?}");
                comm.abort(reason.clone(), true);
                return Err(CollectiveError::Backend {
                    rank,
                    backend: "nccl",
                    op: "cuMemAllocAsync",
                    reason,
                });
            }
        };
        let watchdog = Watchdog::start(
            comm.clone(),
            ctx.clone(),
            opts.timeout,
            format!("nccl-watchdog:{rank}/{world}"),
        );
        Ok(NcclCommunicator {
            rank,
            world,
            ordinal,
            ctx,
            comm,
            current: Mutex::new(stream.clone()),
            stream,
            cuda,
            opts,
            next_seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            scratch: Mutex::new(Some(scratch)),
            staging: Mutex::new((None, Vec::new())),
            watchdog: Some(watchdog),
        })
    }

    /// The CUDA stream NCCL runs on (also [`Communicator::stream`]); allocate the buffers of
    /// collectives on it, or on the current stream.
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.cuda
    }

    /// The stream that produces the buffers of collectives and consumes their results: each
    /// collective waits (on the GPU) for the work enqueued on it before, and [`Work::wait`]
    /// makes it wait for the collective. Initially the NCCL stream itself.
    pub fn current_stream(&self) -> Stream {
        lock(&self.current).clone()
    }

    /// Name the caller's current stream (a CUDA stream of this communicator's GPU).
    pub fn set_current_stream(&self, stream: &Stream) -> Result<()> {
        if stream.cuda_stream().is_none()
            || stream.device() != fsdp_device::Device::Cuda(self.ordinal)
        {
            return Err(CollectiveError::InvalidArgument {
                rank: self.rank,
                op: "set_current_stream",
                reason: format!(
                    "stream {} on {} is not a CUDA stream of cuda:{}",
                    stream.name(),
                    stream.device(),
                    self.ordinal
                ),
            });
        }
        *lock(&self.current) = stream.clone();
        Ok(())
    }

    /// The CUDA context of the communicator's GPU (the process's one context of it).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The GPU's ordinal.
    pub fn device_ordinal(&self) -> usize {
        self.ordinal
    }

    /// The communicator's options.
    pub fn options(&self) -> &NcclOptions {
        &self.opts
    }

    /// Why the communicator was aborted (here or on another rank), if it was.
    pub fn abort_reason(&self) -> Option<String> {
        self.comm.abort_reason()
    }

    /// Abort every rank of this communicator with `reason`: this rank at once, the others
    /// within the watchdog's flag poll. Every later call fails with [`CollectiveError::Aborted`].
    pub fn abort(&self, reason: &str) {
        self.comm
            .abort(format!("rank {} aborted: {reason}", self.rank), true);
    }

    fn seq(&self) -> u64 {
        self.next_seq.fetch_add(1, Ordering::Relaxed)
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        // The watchdog drains the outstanding work first (bounded), then the communicator ends,
        // then its memory is freed (pinned frees may synchronise the device).
        drop(self.watchdog.take());
        let _ = self.ctx.bind_to_thread();
        self.comm
            .close(self.opts.timeout.min(Duration::from_secs(60)));
        drop(lock(&self.scratch).take());
        drop(std::mem::take(&mut *lock(&self.staging)));
    }
}

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

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
