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
//! Before any data moves, every collective exchanges a 192-byte description of the call (the one
//! every backend shares: operation, element type, length, reduce op, root, a fingerprint of the
//! output sizes of an unequal all-gather, and why the call was invalid if it was) with one
//! `MPI_Iallgather`. A difference fails the collective on every rank with
//! [`CollectiveError::Mismatch`] naming the ranks and their calls, instead of MPI's undefined
//! behaviour; the communicator stays usable. This costs one small all-gather (one latency) per
//! collective; `barrier` is that exchange alone (its completion on any rank implies every rank has
//! entered it).
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

use std::ffi::c_int;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ::mpi::environment;
use ::mpi::ffi;
use fsdp_device::{Stream, DEFAULT_TIMEOUT};

use self::issue::{wait_request, Fail};
use self::runtime::{error_string, request_null, runtime, Runtime};
use crate::{CollectiveError, Result};

mod collectives;
mod issue;
mod runtime;
mod split;

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
