//! The MPI backend (cargo feature `mpi`): ranks are the processes of an MPI job, on one machine
//! or several, and collectives run on host buffers through the system's MPI library (Open MPI)
//! via the `mpi` crate (rsmpi) and its raw `ffi` bindings.
//!
//! [`MpiCommunicator::world`] initializes MPI (once per process, `MPI_THREAD_MULTIPLE`) and
//! returns a communicator over a duplicate of `MPI_COMM_WORLD`; [`split`](Communicator::split)
//! makes sub-groups with `MPI_Comm_split`. Each communicator owns a CPU worker [`Stream`] (its
//! communication stream) that runs its collectives in issue order:
//!
//! | trait method          | MPI call                                                   |
//! |-----------------------|------------------------------------------------------------|
//! | `all_gather_base`     | `MPI_Iallgather`                                           |
//! | `reduce_scatter_base` | `MPI_Ireduce_scatter_block`                                |
//! | `all_reduce`          | `MPI_Iallreduce`                                           |
//! | `broadcast`           | `MPI_Ibcast`                                               |
//! | `reduce`              | `MPI_Ireduce`                                              |
//! | `barrier`             | the descriptor exchange below (an `MPI_Iallgather`)        |
//! | `all_gather`          | `MPI_Iallgatherv` into a flat buffer, then copied out      |
//! | `split`               | `MPI_Comm_split` (color `None` is `MPI_UNDEFINED`)         |
//!
//! # Validation across ranks
//! Before any data moves, every collective exchanges a 160-byte description of the call (operation,
//! element type, length, reduce op, root, a fingerprint of the output sizes of an unequal
//! all-gather, and why the call was invalid if it was) with one `MPI_Iallgather`. A difference
//! fails the collective on every rank with [`CollectiveError::Mismatch`] naming the ranks and their
//! calls, instead of MPI's undefined behaviour; the communicator stays usable. This costs one
//! small all-gather (one latency) per collective; `barrier` is that exchange alone (its completion
//! on any rank implies every rank has entered it).
//!
//! # Timeouts
//! MPI's blocking collectives cannot be bounded, so every call is the non-blocking variant
//! (MPI-3) polled with `MPI_Test` until it completes or [`MpiOptions::timeout`] passes. A timeout
//! returns [`CollectiveError::Timeout`] (MPI cannot tell which ranks are missing) and aborts the
//! communicator: MPI cannot cancel a started collective, so the buffers it touches are leaked
//! (never freed under MPI) and later calls fail with [`CollectiveError::Aborted`]. After a timeout
//! MPI is not finalized (finalizing could block on the stuck operation): end the process, and the
//! launcher (`mpirun`) ends the job. `MPI_Comm_split` is blocking but only starts once the
//! exchange has shown that every rank reached the split. `MPI_Init_thread` (in the first
//! [`MpiCommunicator::world`]) is bounded only by the launcher.
//!
//! # Element types and reductions
//! `f32` and `f64` are `MPI_FLOAT` and `MPI_DOUBLE`, reduced with `MPI_SUM` and `MPI_PROD`.
//! `bf16` and `f16` have no MPI type: they move as `MPI_UINT16_T`, and reductions widen them to
//! `f32`, reduce in `f32` through MPI and round to the 16-bit type **once** at the end. This is
//! more accurate than the ring backend (and NCCL), which round after every addition: summing
//! `256 + 1 + 1` in bf16 gives 258 here (the exact sum) and 256 in the ring. With exactly
//! representable partial results both agree bitwise. The cost is twice the bytes on the wire for
//! 16-bit reductions (a user-defined MPI op on 16-bit data would keep the traffic but round after
//! every step, like the ring).
//!
//! `Avg` is `Sum` followed by one division by the group size (in `f32` for the 16-bit types), as
//! in the ring backend. `Min` and `Max` use user-defined MPI ops (`MPI_Op_create` with an
//! `extern "C"` function, no libffi) that return NaN when either operand is NaN, like
//! [`ReduceOp`]; MPI's `MPI_MIN`/`MPI_MAX` do not guarantee that.
//!
//! Open MPI chooses its reduction algorithm (and therefore the order of floating-point
//! additions) by message size and group size; its algorithms give every rank the same result and
//! the same result in every run for a fixed job shape, but the order may differ from the ring
//! backend's, so sums of inexact values can differ from the ring's in the last bit.
//!
//! # Errors
//! The communicators use `MPI_ERRORS_RETURN`: an MPI error becomes
//! [`CollectiveError::Backend`] with `backend: "mpi"` and MPI's error string, and aborts the
//! communicator.
//!
//! # Threads and finalization
//! Collectives run on the communicators' worker threads while `split` and the constructor run on
//! the caller's, and several communicators (a group and its sub-groups) may be inside MPI at once:
//! this needs `MPI_THREAD_MULTIPLE` (a process-wide lock around blocking calls under
//! `MPI_THREAD_SERIALIZED` could deadlock two groups whose ranks enter them in different orders).
//! If the library provides less, [`MpiCommunicator::world`] fails with
//! [`CollectiveError::Unavailable`]. Every communicator of the process shares one MPI
//! initialization; MPI is finalized when the last of them is dropped (drop it on the thread that
//! created the first one: MPI wants `MPI_Finalize` on the thread that initialized it). MPI cannot
//! be initialized twice, so [`MpiCommunicator::world`] after that fails with `Unavailable`. If MPI
//! was initialized by someone else (e.g. rsmpi's `mpi::initialize_with_threading`), it is used as
//! is and left for its owner to finalize.
//!
//! ```no_run
//! // Run with: mpirun -np 3 <binary>
//! use fsdp_collectives::mpi::{MpiCommunicator, MpiOptions};
//! use fsdp_collectives::{Communicator, ReduceOp};
//! use fsdp_device::Buffer;
//!
//! let comm = MpiCommunicator::world(MpiOptions::default()).unwrap();
//! let buf = Buffer::from_slice(&[comm.rank() as f32 + 1.0; 4]).unwrap();
//! comm.all_reduce(&buf, ReduceOp::Sum).unwrap().wait().unwrap();
//! let n = comm.world_size() as f32;
//! assert_eq!(buf.to_vec::<f32>().unwrap(), vec![n * (n + 1.0) / 2.0; 4]);
//! ```

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ::mpi::environment::{self, Threading, Universe};
use ::mpi::ffi;
use fsdp_device::{
    with_element, AccessGuard, Buffer, DType, Device, Element, Stream, DEFAULT_TIMEOUT,
};

use crate::flavors::check::{enqueue_collective, Access, Placement};
use crate::{CollectiveError, Communicator, ReduceOp, Result, Work};

const BACKEND: &str = "mpi";

/// Options of the MPI backend.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MpiOptions {
    /// Bound of every wait: for buffers to become free, for the peers to reach a collective, for
    /// MPI to complete it, and the default of [`Work::wait`]. Default: [`DEFAULT_TIMEOUT`]
    /// (300 s).
    pub timeout: Duration,
}

impl Default for MpiOptions {
    fn default() -> Self {
        MpiOptions {
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl MpiOptions {
    /// These options with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

// ---------------------------------------------------------------------------------------------
// The process-wide MPI state.

/// NaN-propagating min and max as MPI ops, for `MPI_FLOAT` and `MPI_DOUBLE`.
struct UserOps {
    min_f32: ffi::MPI_Op,
    max_f32: ffi::MPI_Op,
    min_f64: ffi::MPI_Op,
    max_f64: ffi::MPI_Op,
}

/// `inout[i] = in[i] ⊕ inout[i]` with NaN-propagating min (`MAX == false`) or max.
///
/// # Safety
/// Called by MPI with `invec` and `inoutvec` pointing to `*len` elements of `T` (the op is only
/// used with the MPI type of `T`).
unsafe extern "C" fn nan_min_max<T: Element, const MAX: bool>(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _datatype: *mut ffi::MPI_Datatype,
) {
    // SAFETY: MPI passes valid pointers to `*len` elements of the op's datatype, which is `T`'s
    // (see `UserOps`); the two vectors do not overlap.
    let (a, b) = unsafe {
        let n = usize::try_from(*len).unwrap_or(0);
        (
            std::slice::from_raw_parts(invec as *const T, n),
            std::slice::from_raw_parts_mut(inoutvec as *mut T, n),
        )
    };
    for (d, &x) in b.iter_mut().zip(a) {
        *d = if MAX { x.max_nan(*d) } else { x.min_nan(*d) };
    }
}

impl UserOps {
    fn create() -> std::result::Result<UserOps, String> {
        fn one(f: ffi::MPI_User_function) -> std::result::Result<ffi::MPI_Op, String> {
            let mut op = std::mem::MaybeUninit::<ffi::MPI_Op>::uninit();
            // SAFETY: MPI is initialized; `f` is a valid user function and `op` an out-pointer.
            let rc = unsafe { ffi::MPI_Op_create(f, 1, op.as_mut_ptr()) };
            if rc != ffi::MPI_SUCCESS as c_int {
                return Err(format!("MPI_Op_create: {}", error_string(rc)));
            }
            // SAFETY: MPI_Op_create succeeded and wrote the handle.
            Ok(unsafe { op.assume_init() })
        }
        Ok(UserOps {
            min_f32: one(Some(nan_min_max::<f32, false>))?,
            max_f32: one(Some(nan_min_max::<f32, true>))?,
            min_f64: one(Some(nan_min_max::<f64, false>))?,
            max_f64: one(Some(nan_min_max::<f64, true>))?,
        })
    }

    fn free(&mut self) {
        for op in [
            &mut self.min_f32,
            &mut self.max_f32,
            &mut self.min_f64,
            &mut self.max_f64,
        ] {
            // SAFETY: each op was created by MPI_Op_create and is freed once, before finalize.
            unsafe { ffi::MPI_Op_free(op) };
        }
    }
}

/// What every communicator of the process shares: the MPI initialization and the user ops.
struct Runtime {
    /// `Some` when this crate initialized MPI (and so finalizes it).
    universe: Option<Universe>,
    ops: UserOps,
    /// Set when an operation timed out: MPI still owns a pending request, so it is not finalized.
    poisoned: AtomicBool,
}

// SAFETY: the MPI handles in `UserOps` are plain handles to process-global MPI objects; with
// MPI_THREAD_MULTIPLE (checked at initialization) they may be used from any thread.
unsafe impl Send for Runtime {}
// SAFETY: as for `Send`; the handles are only read after construction.
unsafe impl Sync for Runtime {}

impl Drop for Runtime {
    fn drop(&mut self) {
        let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
        let universe = self.universe.take();
        let owned = universe.is_some();
        slot.owned_alive = false;
        if self.poisoned.load(Ordering::SeqCst) {
            tracing::error!(
                "an MPI operation timed out and is still pending: MPI is not finalized"
            );
            std::mem::forget(universe);
            slot.closed = Some(
                "an MPI operation of this process timed out earlier and is still pending; MPI \
                 cannot be used any more in this process",
            );
            return;
        }
        if !environment::is_finalized() {
            self.ops.free();
        }
        // Dropping rsmpi's universe calls MPI_Finalize.
        drop(universe);
        if owned {
            slot.closed = Some(
                "MPI was finalized when the last MPI communicator of this process was dropped, \
                 and MPI cannot be initialized twice in a process: keep one communicator alive \
                 for as long as MPI is needed",
            );
        }
    }
}

/// The process's runtime while any communicator lives, and why MPI cannot be used any more.
struct Slot {
    runtime: Weak<Runtime>,
    /// Set once this crate finalized MPI (or gave up on it after a timeout).
    closed: Option<&'static str>,
    /// Whether a runtime that owns MPI exists (until its drop has finalized MPI).
    owned_alive: bool,
}

static RUNTIME: Mutex<Slot> = Mutex::new(Slot {
    runtime: Weak::new(),
    closed: None,
    owned_alive: false,
});

fn unavailable(reason: String) -> CollectiveError {
    CollectiveError::Unavailable {
        rank: 0,
        backend: BACKEND,
        reason,
    }
}

/// The shared runtime, initializing MPI if this is the first communicator of the process.
fn runtime() -> Result<Arc<Runtime>> {
    let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rt) = slot.runtime.upgrade() {
        return Ok(rt);
    }
    if let Some(why) = slot.closed {
        return Err(unavailable(why.into()));
    }
    if slot.owned_alive {
        return Err(unavailable(
            "the last MPI communicator of this process is being dropped on another thread, \
             which finalizes MPI"
                .into(),
        ));
    }
    if environment::is_finalized() {
        return Err(unavailable(
            "MPI was already finalized by the application".into(),
        ));
    }
    let universe = if environment::is_initialized() {
        // Someone else (the application, through rsmpi or C) initialized MPI: use it as is.
        let level = environment::threading_support();
        if level < Threading::Multiple {
            return Err(unavailable(format!(
                "MPI was initialized by the application with thread level {level:?}; this \
                 backend needs MPI_THREAD_MULTIPLE (initialize with \
                 mpi::initialize_with_threading(Threading::Multiple) or let this crate do it)"
            )));
        }
        None
    } else {
        let Some((universe, level)) = environment::initialize_with_threading(Threading::Multiple)
        else {
            return Err(unavailable(
                "MPI_Init_thread could not be called (MPI is already initialized)".into(),
            ));
        };
        if level < Threading::Multiple {
            // Finalize (dropping the universe) and report.
            drop(universe);
            slot.closed = Some(
                "the MPI library does not provide MPI_THREAD_MULTIPLE (MPI was initialized and \
                 finalized once in this process)",
            );
            return Err(unavailable(format!(
                "the MPI library provides thread level {level:?}, this backend needs \
                 MPI_THREAD_MULTIPLE (collectives run on a worker thread per communicator); \
                 use an MPI built with thread support"
            )));
        }
        Some(universe)
    };
    let ops = match UserOps::create() {
        Ok(ops) => ops,
        Err(reason) => {
            if universe.is_some() {
                slot.closed = Some("MPI_Op_create failed once in this process");
            }
            drop(universe);
            return Err(CollectiveError::Backend {
                rank: 0,
                backend: BACKEND,
                op: "world",
                reason,
            });
        }
    };
    slot.owned_alive = universe.is_some();
    let rt = Arc::new(Runtime {
        universe,
        ops,
        poisoned: AtomicBool::new(false),
    });
    slot.runtime = Arc::downgrade(&rt);
    Ok(rt)
}

/// MPI's description of an error code.
fn error_string(code: c_int) -> String {
    let mut buf = [0 as std::ffi::c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `buf` holds MPI_MAX_ERROR_STRING characters plus a terminator, as MPI requires.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return format!("MPI error code {code}");
    }
    let len = usize::try_from(len).unwrap_or(0).min(buf.len());
    let bytes: Vec<u8> = buf[..len].iter().map(|&c| c as u8).collect();
    format!(
        "{} (MPI error code {code})",
        String::from_utf8_lossy(&bytes)
    )
}

// SAFETY (for the helpers below): the predefined MPI handles are link-time constants of the
// rsmpi shim, valid for reading at any time and meaningful once MPI is initialized.
fn mpi_float() -> ffi::MPI_Datatype {
    // SAFETY: see above.
    unsafe { ffi::RSMPI_FLOAT }
}
fn mpi_double() -> ffi::MPI_Datatype {
    // SAFETY: see above.
    unsafe { ffi::RSMPI_DOUBLE }
}
fn mpi_u16() -> ffi::MPI_Datatype {
    // SAFETY: see above.
    unsafe { ffi::RSMPI_UINT16_T }
}
fn mpi_u8() -> ffi::MPI_Datatype {
    // SAFETY: see above.
    unsafe { ffi::RSMPI_UINT8_T }
}
fn request_null() -> ffi::MPI_Request {
    // SAFETY: see above.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// The MPI type that moves elements of `dtype` bit for bit.
fn move_type(dtype: DType) -> ffi::MPI_Datatype {
    match dtype {
        DType::F32 => mpi_float(),
        DType::F64 => mpi_double(),
        DType::BF16 | DType::F16 => mpi_u16(),
    }
}

// ---------------------------------------------------------------------------------------------
// Communicators.

/// The MPI communicator handle of one group and its state; shared with the stream tasks.
struct CommInner {
    comm: ffi::MPI_Comm,
    rank: usize,
    world: usize,
    opts: MpiOptions,
    /// Set when the communicator can no longer be used (a timeout or an MPI error).
    aborted: Mutex<Option<String>>,
    /// Sequence number of the next collective, taken together with the enqueue.
    next_seq: Mutex<u64>,
    runtime: Arc<Runtime>,
}

// SAFETY: `comm` is a handle of an MPI communicator; under MPI_THREAD_MULTIPLE it may be used
// from any thread, and this crate never runs two collectives on it at once (one stream).
unsafe impl Send for CommInner {}
// SAFETY: as for `Send`; the mutable state is behind mutexes.
unsafe impl Sync for CommInner {}

impl Drop for CommInner {
    fn drop(&mut self) {
        if self.aborted().is_some() || environment::is_finalized() {
            // A request may still be pending on it (timeout), or MPI is gone: leave it.
            return;
        }
        // SAFETY: the communicator was created by MPI_Comm_idup or MPI_Comm_split, no request is
        // pending on it (the stream ran every task to completion), and it is freed once.
        unsafe { ffi::MPI_Comm_free(&mut self.comm) };
    }
}

impl CommInner {
    fn aborted(&self) -> Option<String> {
        self.aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn abort(&self, reason: String) {
        let mut a = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        if a.is_none() {
            *a = Some(reason);
        }
    }
}

/// One rank of an MPI group. Its collectives run on its own communication stream; use it from
/// one thread at a time (it is `Send`, not `Sync`, like the other backends).
pub struct MpiCommunicator {
    inner: Arc<CommInner>,
    stream: Stream,
}

impl fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "MpiCommunicator(rank {}/{})",
            self.inner.rank, self.inner.world
        )
    }
}

impl Drop for MpiCommunicator {
    fn drop(&mut self) {
        // Let the stream finish (every task is bounded by the timeout) so that the communicator
        // and, for the last one, MPI itself are released on this thread.
        let _ = self.stream.synchronize();
    }
}

impl MpiCommunicator {
    /// A communicator over every process of the MPI job (a duplicate of `MPI_COMM_WORLD`, so
    /// that this crate's traffic never matches the application's own). Initializes MPI with
    /// `MPI_THREAD_MULTIPLE` on the first call in the process; later calls share it. Collective
    /// over the job: every process must call it.
    ///
    /// Fails with [`CollectiveError::Unavailable`] when MPI cannot provide
    /// `MPI_THREAD_MULTIPLE` or was already finalized, and with [`CollectiveError::Timeout`] when
    /// the other processes do not call it within the timeout.
    pub fn world(opts: MpiOptions) -> Result<MpiCommunicator> {
        let runtime = runtime()?;
        // SAFETY: MPI is initialized (runtime is alive); reading the predefined handle.
        let world_comm = unsafe { ffi::RSMPI_COMM_WORLD };
        let (rank, _) = comm_rank_size(world_comm, 0, "world")?;
        // On the heap: MPI writes the new handle when the request completes, which after a
        // timeout may be later (the box is leaked then).
        let mut newcomm = Box::new(std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit());
        let mut req = request_null();
        // SAFETY: valid communicator and out-pointers.
        let rc = unsafe { ffi::MPI_Comm_idup(world_comm, newcomm.as_mut_ptr(), &mut req) };
        check_rc(rc, rank, "world", "MPI_Comm_idup")?;
        let deadline = Instant::now() + opts.timeout;
        match wait_request(&mut req, deadline) {
            Ok(()) => {}
            Err(Fail::Timeout) => {
                // MPI still holds the request and the out-pointer: leak them.
                runtime.poisoned.store(true, Ordering::SeqCst);
                Box::leak(newcomm);
                return Err(CollectiveError::Timeout {
                    rank,
                    op: "world",
                    seq: 0,
                    waited: opts.timeout,
                    waiting_for: "every process of the MPI job to create its communicator \
                                  (MPI_Comm_idup of MPI_COMM_WORLD)"
                        .into(),
                });
            }
            Err(Fail::Mpi { call, reason }) => {
                return Err(CollectiveError::Backend {
                    rank,
                    backend: BACKEND,
                    op: "world",
                    reason: format!("{call}: {reason}"),
                })
            }
        }
        // SAFETY: the idup request completed, so the new communicator was written.
        let comm = unsafe { newcomm.assume_init_read() };
        MpiCommunicator::from_comm(comm, opts, runtime, "world")
    }

    /// Wrap a communicator this crate created (errors return instead of aborting).
    fn from_comm(
        mut comm: ffi::MPI_Comm,
        opts: MpiOptions,
        runtime: Arc<Runtime>,
        op: &'static str,
    ) -> Result<MpiCommunicator> {
        let (rank, world) = match comm_rank_size(comm, 0, op) {
            Ok(rw) => rw,
            Err(e) => {
                // SAFETY: a communicator this crate created, with nothing pending on it.
                unsafe { ffi::MPI_Comm_free(&mut comm) };
                return Err(e);
            }
        };
        // SAFETY: valid communicator; MPI_ERRORS_RETURN is a predefined handler.
        let rc = unsafe { ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN) };
        let inner = Arc::new(CommInner {
            comm,
            rank,
            world,
            opts: opts.clone(),
            aborted: Mutex::new(None),
            next_seq: Mutex::new(0),
            runtime,
        });
        check_rc(rc, rank, op, "MPI_Comm_set_errhandler")?;
        let stream = Stream::cpu_with_timeout(format!("mpi-comm:{rank}/{world}"), opts.timeout);
        Ok(MpiCommunicator { inner, stream })
    }

    /// The options of this communicator.
    pub fn options(&self) -> &MpiOptions {
        &self.inner.opts
    }

    /// The MPI library's version string (`MPI_Get_library_version`).
    pub fn library_version() -> String {
        environment::library_version().unwrap_or_else(|e| format!("<not UTF-8: {e}>"))
    }

    /// [`Communicator::split`] returning the concrete type.
    pub fn split_mpi(&self, color: Option<u32>, key: usize) -> Result<Option<MpiCommunicator>> {
        let rank = self.inner.rank;
        let mut desc = Desc::new(OpKind::Split);
        let mpi_color = match color {
            None => None,
            Some(c) => match c_int::try_from(c) {
                Ok(c) => Some(c),
                Err(_) => {
                    desc.invalid = Some(format!("color {c} exceeds MPI's largest color (int)"));
                    None
                }
            },
        };
        let mpi_key = match c_int::try_from(key) {
            Ok(k) => k,
            Err(_) => {
                desc.invalid = Some(format!("key {key} exceeds MPI's largest key (int)"));
                0
            }
        };
        let check = match desc.invalid.clone() {
            Some(why) => Err(why),
            None => Ok(Access::none()),
        };
        desc.invalid = None;
        let (tx, rx) = crossbeam_channel::bounded::<Result<Option<MpiCommunicator>>>(1);
        let opts = self.inner.opts.clone();
        let body: Body = Box::new(move |ctx, _, _| {
            // SAFETY: reading a predefined constant.
            let undefined = unsafe { ffi::RSMPI_UNDEFINED };
            let mut newcomm = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
            // SAFETY: valid communicator and out-pointer; every rank has reached this split
            // (the exchange completed), so the blocking call returns.
            let rc = unsafe {
                ffi::MPI_Comm_split(
                    ctx.comm(),
                    mpi_color.unwrap_or(undefined),
                    mpi_key,
                    newcomm.as_mut_ptr(),
                )
            };
            ctx.check(rc, "MPI_Comm_split")?;
            // SAFETY: MPI_Comm_split succeeded and wrote the handle.
            let newcomm = unsafe { newcomm.assume_init() };
            // SAFETY: reading a predefined constant.
            let result = if newcomm == unsafe { ffi::RSMPI_COMM_NULL } {
                Ok(None)
            } else {
                MpiCommunicator::from_comm(newcomm, opts, ctx.inner.runtime.clone(), "split")
                    .map(Some)
            };
            let _ = tx.send(result);
            Ok(())
        });
        let work = self.issue(desc, check, body)?;
        let waited = work.wait();
        match rx.try_recv() {
            Ok(r) => r,
            Err(_) => Err(waited.err().unwrap_or(CollectiveError::Aborted {
                rank,
                reason: "split ended without a result".into(),
            })),
        }
    }
}

fn check_rc(rc: c_int, rank: usize, op: &'static str, call: &str) -> Result<()> {
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(CollectiveError::Backend {
            rank,
            backend: BACKEND,
            op,
            reason: format!("{call}: {}", error_string(rc)),
        })
    }
}

fn comm_rank_size(comm: ffi::MPI_Comm, rank: usize, op: &'static str) -> Result<(usize, usize)> {
    let (mut r, mut n): (c_int, c_int) = (0, 0);
    // SAFETY: valid communicator and out-pointers.
    let rc = unsafe { ffi::MPI_Comm_rank(comm, &mut r) };
    check_rc(rc, rank, op, "MPI_Comm_rank")?;
    // SAFETY: as above.
    let rc = unsafe { ffi::MPI_Comm_size(comm, &mut n) };
    check_rc(rc, rank, op, "MPI_Comm_size")?;
    Ok((r as usize, n as usize))
}

/// Why a wait or an MPI call failed.
enum Fail {
    /// An MPI call returned an error.
    Mpi { call: &'static str, reason: String },
    /// The request did not complete before the deadline (it is still pending).
    Timeout,
}

/// Poll `req` until it completes or `deadline` passes: spin briefly, then yield, then sleep in
/// growing steps up to 1 ms (MPI progresses inside `MPI_Test`).
fn wait_request(req: &mut ffi::MPI_Request, deadline: Instant) -> std::result::Result<(), Fail> {
    let start = Instant::now();
    let mut polls: u32 = 0;
    loop {
        let mut flag: c_int = 0;
        // SAFETY: `req` is a request started by this crate (or MPI_REQUEST_NULL, which tests as
        // complete); the status is ignored.
        let rc = unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        if rc != ffi::MPI_SUCCESS as c_int {
            return Err(Fail::Mpi {
                call: "MPI_Test",
                reason: error_string(rc),
            });
        }
        if flag != 0 {
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Fail::Timeout);
        }
        polls = polls.saturating_add(1);
        let waited = now - start;
        if polls < 200 {
            std::hint::spin_loop();
        } else if waited < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            let nap = (waited / 64).clamp(Duration::from_micros(20), Duration::from_millis(1));
            std::thread::sleep(nap.min(deadline - now));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The description of a call, exchanged before data moves.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    AllGatherBase = 1,
    ReduceScatterBase = 2,
    AllReduce = 3,
    Broadcast = 4,
    Reduce = 5,
    Barrier = 6,
    AllGather = 7,
    Split = 8,
}

impl OpKind {
    const ALL: [OpKind; 8] = [
        OpKind::AllGatherBase,
        OpKind::ReduceScatterBase,
        OpKind::AllReduce,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::Barrier,
        OpKind::AllGather,
        OpKind::Split,
    ];

    fn name(self) -> &'static str {
        match self {
            OpKind::AllGatherBase => "all_gather_base",
            OpKind::ReduceScatterBase => "reduce_scatter_base",
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::Barrier => "barrier",
            OpKind::AllGather => "all_gather",
            OpKind::Split => "split",
        }
    }
}

const WIRE_WORDS: usize = 20;
const WIRE_BYTES: usize = WIRE_WORDS * 8;
const WIRE_MAGIC: u64 = 0x6673_6470_6d70_6901; // "fsdpmpi", version 1
const REASON_BYTES: usize = (WIRE_WORDS - 9) * 8;
const NONE: u64 = u64::MAX;

/// What one rank issued, in a fixed-size form for the exchange.
#[derive(Clone, Debug, PartialEq)]
struct Desc {
    op: OpKind,
    dtype: Option<DType>,
    /// Elements per rank (this rank's input length for an unequal all-gather).
    count: usize,
    reduce: Option<ReduceOp>,
    root: Option<usize>,
    /// Fingerprint of the output sizes of an unequal all-gather.
    sizes: Option<u64>,
    /// Why this rank's call was invalid (truncated to fit the descriptor).
    invalid: Option<String>,
}

fn dtype_code(d: Option<DType>) -> u64 {
    match d {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::F64) => 2,
        Some(DType::BF16) => 3,
        Some(DType::F16) => 4,
    }
}

fn reduce_code(op: Option<ReduceOp>) -> u64 {
    op.map_or(0, |op| {
        ReduceOp::ALL
            .iter()
            .position(|&o| o == op)
            .map_or(NONE, |i| i as u64 + 1)
    })
}

/// FNV-1a over the sizes: a fingerprint of an unequal all-gather's output layout.
fn sizes_fingerprint(sizes: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &s in sizes {
        for b in (s as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

impl Desc {
    fn new(op: OpKind) -> Desc {
        Desc {
            op,
            dtype: None,
            count: 0,
            reduce: None,
            root: None,
            sizes: None,
            invalid: None,
        }
    }

    fn encode(&self, seq: u64) -> [u8; WIRE_BYTES] {
        let mut w = [0u64; WIRE_WORDS];
        w[0] = WIRE_MAGIC;
        w[1] = seq;
        w[2] = self.op as u64;
        w[3] = dtype_code(self.dtype);
        w[4] = self.count as u64;
        w[5] = reduce_code(self.reduce);
        w[6] = self.root.map_or(NONE, |r| r as u64);
        w[7] = self.sizes.unwrap_or(0);
        let mut out = [0u8; WIRE_BYTES];
        for (i, word) in w.iter().enumerate() {
            out[i * 8..(i + 1) * 8].copy_from_slice(&word.to_le_bytes());
        }
        if let Some(why) = &self.invalid {
            // Truncate at a character boundary; the length word marks the call invalid.
            let mut end = why.len().min(REASON_BYTES);
            while !why.is_char_boundary(end) {
                end -= 1;
            }
            out[64..72].copy_from_slice(&(end as u64 + 1).to_le_bytes());
            out[72..72 + end].copy_from_slice(&why.as_bytes()[..end]);
        }
        out
    }

    /// Decode a peer's descriptor; `Err` describes a corrupt one.
    fn decode(b: &[u8]) -> std::result::Result<(u64, Desc), String> {
        let word = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i * 8..(i + 1) * 8]);
            u64::from_le_bytes(a)
        };
        if word(0) != WIRE_MAGIC {
            return Err(format!(
                "descriptor with magic {:#x} (another program or version?)",
                word(0)
            ));
        }
        let op = OpKind::ALL
            .into_iter()
            .find(|&o| o as u64 == word(2))
            .ok_or_else(|| format!("unknown operation code {}", word(2)))?;
        let dtype = match word(3) {
            0 => None,
            c => Some(
                *DType::ALL
                    .get(c as usize - 1)
                    .ok_or_else(|| format!("unknown dtype code {c}"))?,
            ),
        };
        let reduce = match word(5) {
            0 => None,
            c => Some(
                *ReduceOp::ALL
                    .get((c as usize).wrapping_sub(1))
                    .ok_or_else(|| format!("unknown reduce op code {c}"))?,
            ),
        };
        let invalid = match word(8) {
            0 => None,
            n => {
                let n = ((n - 1) as usize).min(REASON_BYTES);
                Some(String::from_utf8_lossy(&b[72..72 + n]).into_owned())
            }
        };
        Ok((
            word(1),
            Desc {
                op,
                dtype,
                count: word(4) as usize,
                reduce,
                root: (word(6) != NONE).then_some(word(6) as usize),
                sizes: (op == OpKind::AllGather).then_some(word(7)),
                invalid,
            },
        ))
    }

    /// Everything that must agree across ranks, as text.
    fn signature(&self) -> String {
        let mut parts = Vec::new();
        if let Some(d) = self.dtype {
            parts.push(format!("dtype={d}"));
        }
        if !matches!(self.op, OpKind::Barrier | OpKind::Split | OpKind::AllGather) {
            parts.push(format!("count={}", self.count));
        }
        if let Some(op) = self.reduce {
            parts.push(format!("op={op}"));
        }
        if let Some(root) = self.root {
            parts.push(format!("root={root}"));
        }
        if let Some(s) = self.sizes {
            parts.push(format!("output sizes #{s:016x}"));
        }
        format!("{}({})", self.op.name(), parts.join(", "))
    }
}

/// Compare the descriptions of all ranks; `Err(details)` names the ranks and what differed.
fn compare(descs: &[Desc]) -> std::result::Result<(), String> {
    let invalid: Vec<String> = descs
        .iter()
        .enumerate()
        .filter_map(|(r, d)| {
            d.invalid.as_ref().map(|why| {
                format!(
                    "rank {r} issued {} with invalid arguments: {why}",
                    d.op.name()
                )
            })
        })
        .collect();
    if !invalid.is_empty() {
        return Err(invalid.join("; "));
    }
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (r, d) in descs.iter().enumerate() {
        let sig = d.signature();
        match groups.iter_mut().find(|(s, _)| *s == sig) {
            Some((_, ranks)) => ranks.push(r),
            None => groups.push((sig, vec![r])),
        }
    }
    if groups.len() > 1 {
        return Err(groups
            .into_iter()
            .map(|(sig, ranks)| {
                if ranks.len() == 1 {
                    format!("rank {} issued {sig}", ranks[0])
                } else {
                    format!("ranks {ranks:?} issued {sig}")
                }
            })
            .collect::<Vec<_>>()
            .join("; "));
    }
    if descs[0].op == OpKind::AllGather {
        // Every rank agrees on the output sizes; they must be the actual input lengths.
        let lens: Vec<usize> = descs.iter().map(|d| d.count).collect();
        if descs[0].sizes != Some(sizes_fingerprint(&lens)) {
            return Err(format!(
                "every rank issued all_gather with output sizes that differ from the ranks' \
                 input lengths {lens:?}"
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Issuing and running collectives.

/// What a collective's body gets: the communicator, the deadline and scratch memory that is
/// leaked (never freed under MPI) if the collective times out.
struct Ctx<'a> {
    inner: &'a CommInner,
    deadline: Instant,
    scratch: Vec<Vec<u64>>,
}

impl Ctx<'_> {
    fn comm(&self) -> ffi::MPI_Comm {
        self.inner.comm
    }

    fn ops(&self) -> &UserOps {
        &self.inner.runtime.ops
    }

    /// Zeroed scratch memory of at least `bytes` bytes (8-byte aligned, never null), valid until
    /// the collective ends.
    fn temp(&mut self, bytes: usize) -> *mut u8 {
        let mut v = vec![0u64; bytes.div_ceil(8).max(1)];
        let p = v.as_mut_ptr() as *mut u8;
        self.scratch.push(v);
        p
    }

    fn check(&self, rc: c_int, call: &'static str) -> std::result::Result<(), Fail> {
        if rc == ffi::MPI_SUCCESS as c_int {
            Ok(())
        } else {
            Err(Fail::Mpi {
                call,
                reason: error_string(rc),
            })
        }
    }

    /// Start a non-blocking call (`start` writes the request) and wait for it.
    fn run(
        &self,
        call: &'static str,
        start: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
    ) -> std::result::Result<(), Fail> {
        let mut req = request_null();
        self.check(start(&mut req), call)?;
        wait_request(&mut req, self.deadline).map_err(|f| match f {
            Fail::Mpi { reason, .. } => Fail::Mpi { call, reason },
            Fail::Timeout => Fail::Timeout,
        })
    }
}

type Body =
    Box<dyn FnOnce(&mut Ctx<'_>, &[AccessGuard], &[Desc]) -> std::result::Result<(), Fail> + Send>;

fn c_count(n: usize, what: &str) -> std::result::Result<c_int, String> {
    c_int::try_from(n).map_err(|_| {
        format!(
            "{what} of {n} elements exceeds MPI's largest count ({})",
            c_int::MAX
        )
    })
}

impl MpiCommunicator {
    fn invalid(&self, op: &'static str, reason: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            rank: self.inner.rank,
            op,
            reason,
        }
    }

    /// Issue a collective: take a sequence number, enqueue the task and return its work. When
    /// `check` failed, the task still posts the (invalid) description so that the peers fail at
    /// once instead of waiting, and the error is returned here.
    fn issue(
        &self,
        mut desc: Desc,
        check: std::result::Result<Access, String>,
        body: Body,
    ) -> Result<Work> {
        let inner = &self.inner;
        let (rank, op) = (inner.rank, desc.op.name());
        if let Some(reason) = inner.aborted() {
            return Err(CollectiveError::Aborted { rank, reason });
        }
        let (access, local_error) = match check {
            Ok(a) => (Some(a), None),
            Err(reason) => {
                desc.invalid = Some(reason.clone());
                (None, Some(self.invalid(op, reason)))
            }
        };
        let task_inner = inner.clone();
        let work = enqueue_collective(
            &self.stream,
            &inner.next_seq,
            rank,
            op,
            inner.opts.timeout,
            move |seq| run_collective(&task_inner, seq, desc, access, body),
        )?;
        match local_error {
            Some(e) => Err(e),
            None => Ok(work),
        }
    }

    /// Where this backend's buffers live.
    fn placement(&self) -> Placement {
        Placement::on("mpi", Device::Cpu)
    }
}

/// The stream task of one collective: take the buffers, compare descriptions with the peers, move
/// the data.
fn run_collective(
    inner: &CommInner,
    seq: u64,
    mut desc: Desc,
    access: Option<Access>,
    body: Body,
) -> Result<()> {
    let (rank, world, op) = (inner.rank, inner.world, desc.op.name());
    let timeout = inner.opts.timeout;
    if let Some(reason) = inner.aborted() {
        return Err(CollectiveError::Aborted { rank, reason });
    }
    // One budget for the whole collective: buffers, exchange and data.
    let deadline = Instant::now() + timeout;
    let mut local_failure = None;
    let guards = match access {
        Some(a) => {
            let mut guards = Vec::with_capacity(a.tickets.len());
            for t in a.tickets {
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
            guards
        }
        None => Vec::new(),
    };
    let mut ctx = Ctx {
        inner,
        deadline,
        scratch: Vec::new(),
    };
    let fail = |ctx: Ctx<'_>, guards: Vec<AccessGuard>, what: String, f: Fail| {
        let err = match f {
            Fail::Timeout => {
                // MPI still owns the request and the memory it was given: leak it all.
                std::mem::forget(ctx.scratch);
                std::mem::forget(guards);
                inner.runtime.poisoned.store(true, Ordering::SeqCst);
                CollectiveError::Timeout {
                    rank,
                    op,
                    seq,
                    waited: timeout,
                    waiting_for: what,
                }
            }
            Fail::Mpi { call, reason } => CollectiveError::Backend {
                rank,
                backend: BACKEND,
                op,
                reason: format!("{call} (collective #{seq}): {reason}"),
            },
        };
        inner.abort(err.to_string());
        err
    };
    // The exchange of descriptions.
    let send = ctx.temp(WIRE_BYTES);
    let recv = ctx.temp(WIRE_BYTES * world);
    let wire = desc.encode(seq);
    // SAFETY: `send` holds WIRE_BYTES bytes of scratch.
    unsafe { std::ptr::copy_nonoverlapping(wire.as_ptr(), send, WIRE_BYTES) };
    let exchanged = ctx.run("MPI_Iallgather", |req| {
        // SAFETY: send and recv are scratch of WIRE_BYTES and world × WIRE_BYTES bytes that live
        // until the request completes (or are leaked on timeout).
        unsafe {
            ffi::MPI_Iallgather(
                send as *const c_void,
                WIRE_BYTES as c_int,
                mpi_u8(),
                recv as *mut c_void,
                WIRE_BYTES as c_int,
                mpi_u8(),
                inner.comm,
                req,
            )
        }
    });
    if let Err(f) = exchanged {
        return Err(fail(
            ctx,
            guards,
            "the peers to reach this collective (MPI does not tell which ranks are missing)".into(),
            f,
        ));
    }
    // SAFETY: the exchange completed and wrote world × WIRE_BYTES bytes.
    let all = unsafe { std::slice::from_raw_parts(recv as *const u8, WIRE_BYTES * world) };
    let mut descs = Vec::with_capacity(world);
    for (r, b) in all.chunks_exact(WIRE_BYTES).enumerate() {
        match Desc::decode(b) {
            Ok((peer_seq, d)) if peer_seq == seq || d.invalid.is_some() => descs.push(d),
            Ok((peer_seq, d)) => {
                let mut d = d;
                d.invalid = Some(format!(
                    "it is collective #{peer_seq} on that rank, #{seq} here"
                ));
                descs.push(d);
            }
            Err(why) => {
                return Err(CollectiveError::Mismatch {
                    rank,
                    seq,
                    details: format!("rank {r} sent an unreadable call description: {why}"),
                })
            }
        }
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
    compare(&descs).map_err(|details| CollectiveError::Mismatch { rank, seq, details })?;
    match body(&mut ctx, &guards, &descs) {
        Ok(()) => Ok(()),
        Err(f) => {
            let what = format!("MPI to complete {op} (a peer stopped taking part?)");
            Err(fail(ctx, guards, what, f))
        }
    }
}

/// Pointer to a guard's first element.
fn ptr(g: &AccessGuard) -> *mut u8 {
    g.as_ptr()
}

/// The MPI op and datatype that reduce `dtype` (16-bit types are reduced as `f32`).
fn reduce_op_type(ctx: &Ctx<'_>, dtype: DType, op: ReduceOp) -> (ffi::MPI_Op, ffi::MPI_Datatype) {
    let ops = ctx.ops();
    let f64 = dtype == DType::F64;
    let mpi_op = match op {
        // SAFETY: reading predefined constants.
        ReduceOp::Sum | ReduceOp::Avg => unsafe { ffi::RSMPI_SUM },
        // SAFETY: as above.
        ReduceOp::Product => unsafe { ffi::RSMPI_PROD },
        ReduceOp::Min if f64 => ops.min_f64,
        ReduceOp::Min => ops.min_f32,
        ReduceOp::Max if f64 => ops.max_f64,
        ReduceOp::Max => ops.max_f32,
    };
    (mpi_op, if f64 { mpi_double() } else { mpi_float() })
}

/// Whether `dtype` is reduced through an `f32` copy.
fn widened(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `dst[i] = src[i] as f32` for `n` elements of `T`.
///
/// # Safety
/// `src` points to `n` readable elements of `T`, `dst` to `n` writable `f32`s.
unsafe fn widen<T: Element>(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: guaranteed by the caller; both are aligned (host buffers and scratch).
    let (s, d) = unsafe {
        (
            std::slice::from_raw_parts(src as *const T, n),
            std::slice::from_raw_parts_mut(dst as *mut f32, n),
        )
    };
    for (d, s) in d.iter_mut().zip(s) {
        *d = s.to_f32();
    }
}

/// `dst[i] = T::from_f32(finish(src[i]))` for `n` elements: the one rounding of a widened
/// reduction (after Avg's division in f32).
///
/// # Safety
/// `src` points to `n` readable `f32`s, `dst` to `n` writable elements of `T`.
unsafe fn narrow<T: Element>(src: *const u8, dst: *mut u8, n: usize, op: ReduceOp, world: usize) {
    // SAFETY: guaranteed by the caller.
    let (s, d) = unsafe {
        (
            std::slice::from_raw_parts(src as *const f32, n),
            std::slice::from_raw_parts_mut(dst as *mut T, n),
        )
    };
    for (d, &s) in d.iter_mut().zip(s) {
        *d = T::from_f32(op.finish(s, world));
    }
}

/// Avg's division, in place, for `n` elements of `dtype` (f32 or f64).
///
/// # Safety
/// `p` points to `n` writable elements of `dtype`.
unsafe fn finish_in_place(p: *mut u8, n: usize, dtype: DType, op: ReduceOp, world: usize) {
    if op != ReduceOp::Avg {
        return;
    }
    with_element!(dtype, T => {
        // SAFETY: guaranteed by the caller.
        let s = unsafe { std::slice::from_raw_parts_mut(p as *mut T, n) };
        for v in s {
            *v = op.finish(*v, world);
        }
    })
}

/// `dtype`'s element size.
fn esz(dtype: DType) -> usize {
    dtype.size_in_bytes()
}

impl Communicator for MpiCommunicator {
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
        let mut desc = Desc::new(OpKind::AllGatherBase);
        desc.dtype = Some(input.dtype());
        desc.count = n;
        let check = c_count(n, "input")
            .and_then(|_| self.placement().all_gather_base(rank, world, input, output));
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let dtype = input.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            if n == 0 {
                return Ok(());
            }
            let bytes = n * esz(dtype);
            let out = ptr(&guards[guards.len() - 1]);
            let send = if in_place {
                // MPI_IN_PLACE is not exposed portably by rsmpi: send a copy of the own block.
                let t = ctx.temp(bytes);
                // SAFETY: the exclusive guard covers the output, whose block `rank` holds n
                // elements; `t` is fresh scratch of `bytes` bytes.
                unsafe { std::ptr::copy_nonoverlapping(out.add(rank * bytes), t, bytes) };
                t
            } else {
                ptr(&guards[0])
            };
            let count = n as c_int;
            ctx.run("MPI_Iallgather", |req| {
                // SAFETY: `send` holds n elements, `out` world × n (checked at issue), both held
                // by guards or scratch until the request completes (leaked on timeout).
                unsafe {
                    ffi::MPI_Iallgather(
                        send as *const c_void,
                        count,
                        move_type(dtype),
                        out as *mut c_void,
                        count,
                        move_type(dtype),
                        ctx.comm(),
                        req,
                    )
                }
            })
        });
        self.issue(desc, check, body)
    }

    fn reduce_scatter_base(&self, input: &Buffer, output: &Buffer, op: ReduceOp) -> Result<Work> {
        let (world, rank) = (self.inner.world, self.inner.rank);
        let n = output.len();
        let mut desc = Desc::new(OpKind::ReduceScatterBase);
        desc.dtype = Some(input.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let check = c_count(n, "output").and_then(|_| {
            self.placement()
                .reduce_scatter_base(rank, world, input, output)
        });
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let dtype = input.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            if n == 0 {
                return Ok(());
            }
            let inp = ptr(&guards[0]);
            let out = if in_place {
                inp.wrapping_add(rank * n * esz(dtype))
            } else {
                ptr(&guards[1])
            };
            let (mpi_op, mpi_type) = reduce_op_type(ctx, dtype, op);
            let wide = widened(dtype);
            // Send: the input (widened to f32 for 16-bit types). Receive: scratch when the
            // result must be post-processed or the call is in place, else the output itself.
            let send = if wide {
                let t = ctx.temp(world * n * 4);
                // SAFETY: the guard covers world × n input elements; `t` holds as many f32s.
                with_element!(dtype, T => unsafe { widen::<T>(inp, t, world * n) });
                t
            } else {
                inp
            };
            let recv = if wide || in_place {
                ctx.temp(n * if wide { 4 } else { esz(dtype) })
            } else {
                out
            };
            let count = n as c_int;
            ctx.run("MPI_Ireduce_scatter_block", |req| {
                // SAFETY: `send` holds world × n and `recv` n elements of `mpi_type`, held by
                // guards or scratch until the request completes (leaked on timeout).
                unsafe {
                    ffi::MPI_Ireduce_scatter_block(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        mpi_type,
                        mpi_op,
                        ctx.comm(),
                        req,
                    )
                }
            })?;
            if wide {
                // SAFETY: `recv` holds n f32s; `out` n elements of T under an exclusive guard.
                with_element!(dtype, T => unsafe { narrow::<T>(recv, out, n, op, world) });
            } else {
                if in_place {
                    // SAFETY: `recv` is scratch of n elements; `out` is this rank's chunk of the
                    // input, held exclusively.
                    unsafe { std::ptr::copy_nonoverlapping(recv, out, n * esz(dtype)) };
                }
                // SAFETY: `out` holds n elements of dtype under an exclusive guard.
                unsafe { finish_in_place(out, n, dtype, op, world) };
            }
            Ok(())
        });
        self.issue(desc, check, body)
    }

    fn all_reduce(&self, buf: &Buffer, op: ReduceOp) -> Result<Work> {
        let world = self.inner.world;
        let n = buf.len();
        let mut desc = Desc::new(OpKind::AllReduce);
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let check = c_count(n, "buffer").and_then(|_| self.placement().all_reduce(buf));
        let dtype = buf.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            if n == 0 {
                return Ok(());
            }
            let p = ptr(&guards[0]);
            let (mpi_op, mpi_type) = reduce_op_type(ctx, dtype, op);
            let wide = widened(dtype);
            let send = ctx.temp(n * if wide { 4 } else { esz(dtype) });
            if wide {
                // SAFETY: the guard covers n elements; `send` holds n f32s.
                with_element!(dtype, T => unsafe { widen::<T>(p, send, n) });
            } else {
                // SAFETY: as above, n elements of dtype.
                unsafe { std::ptr::copy_nonoverlapping(p, send, n * esz(dtype)) };
            }
            let recv = if wide { ctx.temp(n * 4) } else { p };
            let count = n as c_int;
            ctx.run("MPI_Iallreduce", |req| {
                // SAFETY: `send` and `recv` hold n elements of `mpi_type`, held by the guard or
                // scratch until the request completes (leaked on timeout).
                unsafe {
                    ffi::MPI_Iallreduce(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        mpi_type,
                        mpi_op,
                        ctx.comm(),
                        req,
                    )
                }
            })?;
            if wide {
                // SAFETY: `recv` holds n f32s; `p` n elements of T under an exclusive guard.
                with_element!(dtype, T => unsafe { narrow::<T>(recv, p, n, op, world) });
            } else {
                // SAFETY: `p` holds n elements of dtype under an exclusive guard.
                unsafe { finish_in_place(p, n, dtype, op, world) };
            }
            Ok(())
        });
        self.issue(desc, check, body)
    }

    fn broadcast(&self, buf: &Buffer, root: usize) -> Result<Work> {
        let rank = self.inner.rank;
        let n = buf.len();
        let mut desc = Desc::new(OpKind::Broadcast);
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.root = Some(root);
        let check = c_count(n, "buffer").and_then(|_| {
            self.placement()
                .broadcast(rank, self.inner.world, buf, root)
        });
        let dtype = buf.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            if n == 0 {
                return Ok(());
            }
            let p = ptr(&guards[0]);
            let count = n as c_int;
            ctx.run("MPI_Ibcast", |req| {
                // SAFETY: `p` holds n elements under the guard (the root's is only read) until
                // the request completes (leaked on timeout).
                unsafe {
                    ffi::MPI_Ibcast(
                        p as *mut c_void,
                        count,
                        move_type(dtype),
                        root as c_int,
                        ctx.comm(),
                        req,
                    )
                }
            })
        });
        self.issue(desc, check, body)
    }

    fn reduce(&self, buf: &Buffer, op: ReduceOp, root: usize) -> Result<Work> {
        let (rank, world) = (self.inner.rank, self.inner.world);
        let n = buf.len();
        let mut desc = Desc::new(OpKind::Reduce);
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        desc.root = Some(root);
        let check =
            c_count(n, "buffer").and_then(|_| self.placement().reduce(rank, world, buf, root));
        let dtype = buf.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            if n == 0 {
                return Ok(());
            }
            let p = ptr(&guards[0]);
            let (mpi_op, mpi_type) = reduce_op_type(ctx, dtype, op);
            let wide = widened(dtype);
            let is_root = rank == root;
            let send = if wide {
                let t = ctx.temp(n * 4);
                // SAFETY: the guard covers n elements; `t` holds n f32s.
                with_element!(dtype, T => unsafe { widen::<T>(p, t, n) });
                t
            } else if is_root {
                let t = ctx.temp(n * esz(dtype));
                // SAFETY: as above, n elements of dtype.
                unsafe { std::ptr::copy_nonoverlapping(p, t, n * esz(dtype)) };
                t
            } else {
                p
            };
            let recv = match (is_root, wide) {
                (true, true) => ctx.temp(n * 4),
                (true, false) => p,
                // Ignored by MPI on non-root ranks.
                (false, _) => std::ptr::null_mut(),
            };
            let count = n as c_int;
            ctx.run("MPI_Ireduce", |req| {
                // SAFETY: `send` holds n elements of `mpi_type` and, on the root, `recv` too;
                // held by the guard or scratch until the request completes (leaked on timeout).
                unsafe {
                    ffi::MPI_Ireduce(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        mpi_type,
                        mpi_op,
                        root as c_int,
                        ctx.comm(),
                        req,
                    )
                }
            })?;
            if is_root {
                if wide {
                    // SAFETY: `recv` holds n f32s; `p` n elements of T under an exclusive guard.
                    with_element!(dtype, T => unsafe { narrow::<T>(recv, p, n, op, world) });
                } else {
                    // SAFETY: `p` holds n elements of dtype under an exclusive guard.
                    unsafe { finish_in_place(p, n, dtype, op, world) };
                }
            }
            Ok(())
        });
        self.issue(desc, check, body)
    }

    fn barrier(&self) -> Result<Work> {
        // The exchange of descriptions is itself the barrier.
        let body: Body = Box::new(|_, _, _| Ok(()));
        self.issue(Desc::new(OpKind::Barrier), Ok(Access::none()), body)
    }

    fn all_gather(&self, input: &Buffer, outputs: &[Buffer]) -> Result<Work> {
        let (world, rank) = (self.inner.world, self.inner.rank);
        let sizes: Vec<usize> = outputs.iter().map(Buffer::len).collect();
        let mut desc = Desc::new(OpKind::AllGather);
        desc.dtype = Some(input.dtype());
        desc.count = input.len();
        desc.sizes = Some(sizes_fingerprint(&sizes));
        let check = c_count(sizes.iter().sum(), "the total output")
            .and_then(|_| self.placement().all_gather(rank, world, input, outputs));
        let dtype = input.dtype();
        let body: Body = Box::new(move |ctx, guards, descs| {
            // The exchange already compared the sizes: descs[i].count is rank i's length.
            let lens: Vec<usize> = descs.iter().map(|d| d.count).collect();
            let total: usize = lens.iter().sum();
            if total == 0 {
                return Ok(());
            }
            let e = esz(dtype);
            let counts: Vec<c_int> = lens.iter().map(|&l| l as c_int).collect();
            let displs: Vec<c_int> = lens
                .iter()
                .scan(0usize, |acc, &l| {
                    let d = *acc;
                    *acc += l;
                    Some(d as c_int)
                })
                .collect();
            let flat = ctx.temp(total * e);
            let send = if lens[rank] == 0 {
                ctx.temp(e)
            } else {
                ptr(&guards[0])
            };
            // The counts and displacements must outlive the request too.
            let meta = ctx.temp(2 * world * std::mem::size_of::<c_int>()) as *mut c_int;
            // SAFETY: `meta` is scratch for 2 × world ints.
            unsafe {
                std::ptr::copy_nonoverlapping(counts.as_ptr(), meta, world);
                std::ptr::copy_nonoverlapping(displs.as_ptr(), meta.add(world), world);
            }
            let own = counts[rank];
            ctx.run("MPI_Iallgatherv", |req| {
                // SAFETY: `send` holds lens[rank] elements, `flat` the total; counts and
                // displacements describe `flat`; all live until the request completes.
                unsafe {
                    ffi::MPI_Iallgatherv(
                        send as *const c_void,
                        own,
                        move_type(dtype),
                        flat as *mut c_void,
                        meta,
                        meta.add(world),
                        move_type(dtype),
                        ctx.comm(),
                        req,
                    )
                }
            })?;
            for (i, g) in guards[1..].iter().enumerate() {
                // SAFETY: exclusive guard over outputs[i] of lens[i] elements (the exchange
                // checked the sizes); block i of `flat` holds them.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        flat.add(displs[i] as usize * e),
                        ptr(g),
                        lens[i] * e,
                    )
                };
            }
            Ok(())
        });
        self.issue(desc, check, body)
    }

    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Box<dyn Communicator>>> {
        Ok(self
            .split_mpi(color, key)?
            .map(|c| Box::new(c) as Box<dyn Communicator>))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_round_trip_and_compare() {
        let mut d = Desc::new(OpKind::AllReduce);
        d.dtype = Some(DType::BF16);
        d.count = 17;
        d.reduce = Some(ReduceOp::Max);
        let (seq, back) = Desc::decode(&d.encode(5)).unwrap();
        assert_eq!((seq, &back), (5, &d));
        let mut other = d.clone();
        other.count = 18;
        let err = compare(&[d.clone(), other, d.clone()]).unwrap_err();
        assert!(err.contains("ranks [0, 2] issued all_reduce(dtype=bfloat16, count=17, op=max)"));
        assert!(err.contains("rank 1 issued all_reduce(dtype=bfloat16, count=18, op=max)"));
        let mut bad = d.clone();
        bad.invalid = Some("é".repeat(100));
        let (_, back) = Desc::decode(&bad.encode(0)).unwrap();
        assert!(back.invalid.unwrap().len() <= REASON_BYTES);
    }

    #[test]
    fn unequal_all_gather_sizes_are_checked() {
        let mk = |len: usize, sizes: &[usize]| {
            let mut d = Desc::new(OpKind::AllGather);
            d.dtype = Some(DType::F32);
            d.count = len;
            d.sizes = Some(sizes_fingerprint(sizes));
            d
        };
        assert!(compare(&[mk(1, &[1, 2]), mk(2, &[1, 2])]).is_ok());
        let err = compare(&[mk(1, &[1, 3]), mk(2, &[1, 3])]).unwrap_err();
        assert!(err.contains("[1, 2]"), "{err}");
        assert!(compare(&[mk(1, &[1, 2]), mk(2, &[2, 2])]).is_err());
    }
}
