//! The NCCL communicator handle: initialisation, bounded non-blocking calls, split, abort (local
//! and of every rank, through an abort flag), finalisation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::{Duration, Instant};

use cudarc::nccl::sys;

use super::ffi::{self, CommState};
use crate::store::TcpStore;
use crate::{CollectiveError, Result};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A raw communicator pointer (null once aborted or destroyed).
struct Raw(sys::ncclComm_t);
// SAFETY: NCCL communicators may be used from any thread; this module serialises abort and
// destroy against calls with the `RwLock` around the pointer.
unsafe impl Send for Raw {}
// SAFETY: as above; shared access only makes NCCL calls that NCCL allows concurrently
// (launches from the owning thread, `ncclCommGetAsyncError` from the watchdog).
unsafe impl Sync for Raw {}

/// Where every rank of one communicator publishes and reads "abort": a key in the store (ranks
/// in several processes), or a process-wide slot shared by the ranks that joined with the same
/// unique id (ranks as threads, [`NcclCommunicator::from_unique_id`](super::NcclCommunicator)).
#[derive(Clone)]
pub(crate) enum AbortFlag {
    Store { store: TcpStore, key: String },
    Local(Arc<Slot>),
}

/// The reason published in a process-wide abort flag, if any.
type Slot = Mutex<Option<String>>;

/// The process-wide slots of [`AbortFlag::Local`], by key.
static LOCAL_FLAGS: Mutex<Option<HashMap<String, Weak<Slot>>>> = Mutex::new(None);

impl AbortFlag {
    /// The process-wide slot of `key` (the same `Arc` for every rank that asks while one lives).
    pub(crate) fn local(key: String) -> AbortFlag {
        let mut all = lock(&LOCAL_FLAGS);
        let map = all.get_or_insert_with(HashMap::new);
        map.retain(|_, w| w.strong_count() > 0);
        if let Some(slot) = map.get(&key).and_then(Weak::upgrade) {
            return AbortFlag::Local(slot);
        }
        let slot = Arc::new(Mutex::new(None));
        map.insert(key, Arc::downgrade(&slot));
        AbortFlag::Local(slot)
    }

    /// The flag of a child communicator (split number `n`, `color`).
    pub(crate) fn child(&self, n: u64, color: i32) -> AbortFlag {
        match self {
            AbortFlag::Store { store, key } => AbortFlag::Store {
                store: store.clone(),
                key: format!("{key}/split{n}/color{color}"),
            },
            AbortFlag::Local(slot) => {
                AbortFlag::local(format!("{:p}/split{n}/color{color}", Arc::as_ptr(slot)))
            }
        }
    }

    /// Publish `reason` (the first one wins where it matters; errors are logged).
    pub(crate) fn publish(&self, reason: &str) {
        match self {
            AbortFlag::Store { store, key } => {
                if let Err(e) = store.set(key, reason.as_bytes()) {
                    tracing::error!("publishing the NCCL abort flag {key}: {e}");
                }
            }
            AbortFlag::Local(slot) => {
                lock(slot).get_or_insert_with(|| reason.to_string());
            }
        }
    }

    /// The reason some rank published, if any (one store round trip, or a lock).
    pub(crate) fn read(&self) -> Option<String> {
        match self {
            AbortFlag::Store { store, key } => match store.try_get(key) {
                Ok(v) => v.map(|b| String::from_utf8_lossy(&b).into_owned()),
                Err(e) => Some(format!("the store holding the abort flag failed: {e}")),
            },
            AbortFlag::Local(slot) => lock(slot).clone(),
        }
    }
}

/// One rank's NCCL communicator. Calls come from the owning thread; the watchdog reads the
/// asynchronous error state and may abort at any time.
pub(crate) struct Comm {
    pub(crate) rank: usize,
    raw: RwLock<Raw>,
    /// Set before an abort takes the write lock: a call polling for progress gives up.
    stop: AtomicBool,
    aborted: Mutex<Option<String>>,
    pub(crate) flag: AbortFlag,
}

impl Comm {
    /// Wrap a ready communicator.
    pub(crate) fn new(raw: sys::ncclComm_t, rank: usize, flag: AbortFlag) -> Comm {
        Comm {
            rank,
            raw: RwLock::new(Raw(raw)),
            stop: AtomicBool::new(false),
            aborted: Mutex::new(None),
            flag,
        }
    }

    /// Why this communicator was aborted, if it was.
    pub(crate) fn abort_reason(&self) -> Option<String> {
        lock(&self.aborted).clone()
    }

    pub(crate) fn aborted_error(&self) -> CollectiveError {
        CollectiveError::Aborted {
            rank: self.rank,
            reason: self
                .abort_reason()
                .unwrap_or_else(|| "the communicator was destroyed".into()),
        }
    }

    /// Abort this rank's communicator once (`ncclCommAbort`, which also stops its kernels);
    /// with `publish`, also tell every other rank through the abort flag.
    pub(crate) fn abort(&self, reason: String, publish: bool) {
        {
            let mut a = lock(&self.aborted);
            if a.is_some() {
                return;
            }
            tracing::error!(rank = self.rank, "aborting the NCCL communicator: {reason}");
            *a = Some(reason.clone());
        }
        if publish {
            self.flag.publish(&reason);
        }
        self.stop.store(true, Ordering::SeqCst);
        let mut raw = self.raw.write().unwrap_or_else(|e| e.into_inner());
        let comm = std::mem::replace(&mut raw.0, std::ptr::null_mut());
        if !comm.is_null() {
            // SAFETY: a live communicator, aborted exactly once (swapped out under the lock,
            // so no call is using it).
            let r = unsafe { sys::ncclCommAbort(comm) };
            if r != sys::ncclResult_t::ncclSuccess {
                tracing::error!(rank = self.rank, "ncclCommAbort: {}", ffi::error_string(r));
            }
        }
    }

    /// `ncclCommGetAsyncError` now; `None` once aborted (the watchdog's poll).
    pub(crate) fn state(&self) -> Option<CommState> {
        let raw = self.raw.read().unwrap_or_else(|e| e.into_inner());
        // SAFETY: non-null under the read lock means live (abort and close take the write lock).
        (!raw.0.is_null()).then(|| unsafe { ffi::comm_state(raw.0) })
    }

    /// Make one NCCL call `f` and, on a non-blocking communicator that answers `ncclInProgress`
    /// (lazy connection set-up), poll until it has been taken, up to `deadline`. A timeout or an
    /// NCCL error aborts every rank.
    pub(crate) fn call(
        &self,
        op: &'static str,
        seq: u64,
        deadline: Instant,
        timeout: Duration,
        f: impl FnOnce(sys::ncclComm_t) -> sys::ncclResult_t,
    ) -> Result<()> {
        let outcome = {
            let raw = self.raw.read().unwrap_or_else(|e| e.into_inner());
            if raw.0.is_null() {
                return Err(self.aborted_error());
            }
            match f(raw.0) {
                sys::ncclResult_t::ncclSuccess => return Ok(()),
                sys::ncclResult_t::ncclInProgress => self.poll(raw.0, deadline),
                r => Poll::Failed(with_last_error(raw.0, r)),
            }
        };
        match outcome {
            Poll::Ready => Ok(()),
            Poll::Stopped => Err(self.aborted_error()),
            Poll::Failed(reason) => {
                self.abort(format!("rank {} failed in {op}: {reason}", self.rank), true);
                Err(CollectiveError::Backend {
                    rank: self.rank,
                    backend: "nccl",
                    op,
                    reason,
                })
            }
            Poll::TimedOut => {
                let waiting_for = "NCCL did not take the call: a peer did not reach this \
                                   collective (or issued a different one)"
                    .to_string();
                self.abort(
                    format!(
                        "rank {} timed out in {op} (collective #{seq}): {waiting_for}",
                        self.rank
                    ),
                    true,
                );
                Err(CollectiveError::Timeout {
                    rank: self.rank,
                    op,
                    seq,
                    waited: timeout,
                    waiting_for,
                })
            }
        }
    }

    /// Poll `comm` until nothing is in progress: spin, then yield, then sleep 20 µs at most.
    fn poll(&self, comm: sys::ncclComm_t, deadline: Instant) -> Poll {
        poll_state(comm, deadline, Some(&self.stop))
    }

    /// Split this communicator (every rank of it calls this in the same order). A failure of
    /// the child aborts the child only; a failure of the parent's own state aborts the parent.
    pub(crate) fn split(
        &self,
        color: i32,
        key: i32,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<sys::ncclComm_t> {
        let mut child: sys::ncclComm_t = std::ptr::null_mut();
        let raw = self.raw.read().unwrap_or_else(|e| e.into_inner());
        if raw.0.is_null() {
            return Err(self.aborted_error());
        }
        let mut config = ffi::nonblocking_config();
        // SAFETY: `raw.0` is live under the read lock; pointers are to live locals.
        let r = unsafe { sys::ncclCommSplit(raw.0, color, key, &mut child, &mut config) };
        let fail = |what: String, child: sys::ncclComm_t| {
            if !child.is_null() {
                // SAFETY: the child is not handed out; aborted once.
                unsafe { sys::ncclCommAbort(child) };
            }
            CollectiveError::Backend {
                rank: self.rank,
                backend: "nccl",
                op: "split",
                reason: what,
            }
        };
        if !ffi::is_ok_or_in_progress(r) {
            return Err(fail(with_last_error(raw.0, r), child));
        }
        match self.poll(raw.0, deadline) {
            Poll::Ready => {}
            Poll::Stopped => return Err(fail("the parent was aborted".into(), child)),
            Poll::Failed(e) => return Err(fail(format!("the parent: {e}"), child)),
            Poll::TimedOut => {
                return Err(fail(
                    format!("ncclCommSplit did not complete on every rank within {timeout:?}"),
                    child,
                ))
            }
        }
        if child.is_null() {
            return Ok(child);
        }
        match poll_state(child, deadline, None) {
            Poll::Ready => Ok(child),
            Poll::Failed(e) => Err(fail(format!("the new communicator: {e}"), child)),
            Poll::Stopped | Poll::TimedOut => Err(fail(
                format!("the new communicator was not ready within {timeout:?}"),
                child,
            )),
        }
    }

    /// End the communicator: straight to `ncclCommAbort` when any rank aborted (its peers will
    /// not take part in a finalisation), else `ncclCommFinalize` bounded by `timeout`, then
    /// `ncclCommDestroy` (or abort if finalisation did not complete).
    pub(crate) fn close(&self, timeout: Duration) {
        if let Some(reason) = self.flag.read() {
            self.abort(format!("a rank aborted: {reason}"), false);
            return;
        }
        let mut raw = self.raw.write().unwrap_or_else(|e| e.into_inner());
        let comm = std::mem::replace(&mut raw.0, std::ptr::null_mut());
        if comm.is_null() {
            return;
        }
        // SAFETY: live and swapped out under the write lock: nothing else uses it.
        let r = unsafe { sys::ncclCommFinalize(comm) };
        let finalized = ffi::is_ok_or_in_progress(r)
            && matches!(
                poll_state(comm, Instant::now() + timeout, None),
                Poll::Ready
            );
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
}

/// The outcome of polling a communicator's asynchronous state.
pub(crate) enum Poll {
    Ready,
    Failed(String),
    TimedOut,
    Stopped,
}

/// Poll `comm`'s state until it is not in progress, `deadline` passes or `stop` is set.
pub(crate) fn poll_state(
    comm: sys::ncclComm_t,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Poll {
    let mut polls = 0u32;
    loop {
        // SAFETY: the caller holds `comm` live (read lock, or sole owner).
        match unsafe { ffi::comm_state(comm) } {
            CommState::Ready => return Poll::Ready,
            CommState::InProgress => {}
            CommState::Failed(e) => return Poll::Failed(e),
        }
        if stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
            return Poll::Stopped;
        }
        if Instant::now() >= deadline {
            return Poll::TimedOut;
        }
        polls += 1;
        if polls < 64 {
            std::hint::spin_loop();
        } else if polls < 256 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// NCCL's string for `r`, with its last error message on `comm` when it has one.
pub(crate) fn with_last_error(comm: sys::ncclComm_t, r: sys::ncclResult_t) -> String {
    let mut reason = ffi::error_string(r);
    if let Some(last) = ffi::last_error(comm) {
        reason = format!("{reason}: {last}");
    }
    reason
}

/// Initialise rank `rank` of `world` on the current context's device (non-blocking, polled up
/// to `timeout`; every 200 ms the abort flag is read, so that a peer that failed to set up ends
/// the wait at once).
pub(crate) fn init_rank(
    id: &sys::ncclUniqueId,
    rank: usize,
    world: usize,
    timeout: Duration,
    flag: &AbortFlag,
) -> Result<sys::ncclComm_t> {
    let mut config = ffi::nonblocking_config();
    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: the library is present and recent enough (checked by the caller); pointers are
    // to live locals; the device's context is current on this thread (how NCCL picks the GPU).
    let r = unsafe {
        sys::ncclCommInitRankConfig(&mut comm, world as i32, *id, rank as i32, &mut config)
    };
    let outcome = if !ffi::is_ok_or_in_progress(r) {
        Poll::Failed(with_last_error(comm, r))
    } else if comm.is_null() {
        Poll::Failed("NCCL returned no communicator".into())
    } else {
        let deadline = Instant::now() + timeout;
        loop {
            let slice = (Instant::now() + Duration::from_millis(200)).min(deadline);
            match poll_state(comm, slice, None) {
                Poll::TimedOut if Instant::now() < deadline => {
                    if let Some(reason) = flag.read() {
                        break Poll::Failed(format!("another rank aborted: {reason}"));
                    }
                }
                other => break other,
            }
        }
    };
    let fail = || {
        if !comm.is_null() {
            // SAFETY: a communicator that failed or timed out in initialisation, aborted once.
            unsafe { sys::ncclCommAbort(comm) };
        }
    };
    match outcome {
        Poll::Ready => Ok(comm),
        Poll::Failed(reason) => {
            fail();
            Err(CollectiveError::Backend {
                rank,
                backend: "nccl",
                op: "ncclCommInitRankConfig",
                reason,
            })
        }
        Poll::TimedOut | Poll::Stopped => {
            fail();
            Err(CollectiveError::Timeout {
                rank,
                op: "ncclCommInitRankConfig",
                seq: 0,
                waited: timeout,
                waiting_for: format!(
                    "not every rank of 0..{world} joined the communicator within the init \
                     timeout"
                ),
            })
        }
    }
}
