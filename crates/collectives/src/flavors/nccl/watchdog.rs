//! The watchdog thread of a communicator (as `ProcessGroupNCCL`'s): it completes each
//! collective's [`Work`](crate::Work) when its end event completed and releases its buffers,
//! reads `ncclCommGetAsyncError`, and on a collective past its timeout or an NCCL error aborts
//! every rank: it publishes the reason in the abort flag, which every rank's watchdog reads
//! (every [`FLAG_POLL`]) and acts on by aborting its own communicator.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::comm::{lock, Comm};
use super::ffi::CommState;
use super::work::Pending;
use crate::CollectiveError;

/// How often an idle or busy watchdog reads the abort flag (a store round trip for ranks in
/// several processes).
pub(crate) const FLAG_POLL: Duration = Duration::from_millis(200);

/// How long the work of an aborted communicator may take to stop before its buffers are leaked.
const GRACE: Duration = Duration::from_secs(10);

struct Shared {
    queue: Mutex<VecDeque<Pending>>,
    cv: Condvar,
    stop: AtomicBool,
    comm: Arc<Comm>,
    timeout: Duration,
}

/// The watchdog of one communicator; dropping it drains the outstanding work (bounded by its
/// timeout) and joins the thread.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Start the watchdog of `comm`; collectives time out `timeout` after their launch.
    pub(crate) fn start(
        comm: Arc<Comm>,
        ctx: Arc<cudarc::driver::CudaContext>,
        timeout: Duration,
        name: String,
    ) -> Watchdog {
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            comm,
            timeout,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                // NCCL's abort and the allocator's frees of released buffers run on this thread.
                if let Err(e) = ctx.bind_to_thread() {
                    tracing::error!("NCCL watchdog: cuCtxSetCurrent: {e:?}");
                }
                run(&s)
            })
            .map_err(|e| tracing::error!("could not start the NCCL watchdog thread: {e}"))
            .ok();
        Watchdog { shared, thread }
    }

    /// Watch a launched collective. Without a running thread the work is completed here once
    /// its end event completes (bounded by the timeout).
    pub(crate) fn push(&self, p: Pending) {
        if self.thread.is_none() {
            let r = p.end.synchronize_timeout(self.shared.timeout);
            p.finish(r.map_err(|source| CollectiveError::Device {
                rank: self.shared.comm.rank,
                source,
            }));
            return;
        }
        lock(&self.shared.queue).push_back(p);
        self.shared.cv.notify_one();
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.cv.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Fail every outstanding collective after an abort.
fn fail_all(s: &Shared, timed_out: Option<(&'static str, u64)>) {
    let pending: Vec<Pending> = lock(&s.queue).drain(..).collect();
    let rank = s.comm.rank;
    for p in pending {
        let err = match timed_out {
            Some((op, seq)) if p.seq == seq && p.op == op => CollectiveError::Timeout {
                rank,
                op,
                seq,
                waited: s.timeout,
                waiting_for: "the NCCL kernel did not finish: a peer did not reach this \
                              collective (or issued a different one)"
                    .into(),
            },
            _ => s.comm.aborted_error(),
        };
        p.fail(err, GRACE);
    }
}

fn run(s: &Shared) {
    let mut last_flag = Instant::now();
    let mut polls = 0u32;
    let mut drain_deadline = None;
    loop {
        let stopping = s.stop.load(Ordering::SeqCst);
        let (busy, front) = {
            let mut q = lock(&s.queue);
            while q.front().is_some_and(Pending::done) {
                if let Some(p) = q.pop_front() {
                    // Done, or its stream failed: the end event's query says which.
                    let r = p.end.synchronize_timeout(Duration::ZERO);
                    p.finish(r.map_err(|source| CollectiveError::Device {
                        rank: s.comm.rank,
                        source,
                    }));
                    polls = 0;
                }
            }
            (!q.is_empty(), q.front().map(|p| (p.deadline, p.op, p.seq)))
        };
        if stopping && !busy {
            return;
        }
        if stopping {
            let d = *drain_deadline.get_or_insert_with(|| Instant::now() + s.timeout);
            if Instant::now() >= d {
                s.comm.abort(
                    format!(
                        "rank {}: dropped with collectives still running after {:?}",
                        s.comm.rank, s.timeout
                    ),
                    true,
                );
                fail_all(s, None);
                return;
            }
        }
        let now = Instant::now();
        if busy || now - last_flag >= FLAG_POLL {
            match s.comm.state() {
                None => {
                    fail_all(s, None);
                    if stopping {
                        return;
                    }
                }
                Some(CommState::Failed(e)) => {
                    s.comm
                        .abort(format!("rank {}: NCCL error: {e}", s.comm.rank), true);
                    fail_all(s, None);
                }
                Some(_) => {}
            }
        }
        if let Some((deadline, op, seq)) = front {
            if now >= deadline {
                s.comm.abort(
                    format!(
                        "rank {} timed out in {op} (collective #{seq}) after {:?}",
                        s.comm.rank, s.timeout
                    ),
                    true,
                );
                fail_all(s, Some((op, seq)));
            }
        }
        if now - last_flag >= FLAG_POLL {
            last_flag = now;
            if s.comm.abort_reason().is_none() {
                if let Some(reason) = s.comm.flag.read() {
                    s.comm
                        .abort(format!("another rank aborted: {reason}"), false);
                    fail_all(s, None);
                }
            }
        }
        if busy {
            // Spin briefly, then yield, then short sleeps: the host-side completion latency
            // (Work::synchronize, buffer release) stays in the tens of microseconds.
            polls += 1;
            if polls < 256 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        } else {
            polls = 0;
            let q = lock(&s.queue);
            if q.is_empty() && !s.stop.load(Ordering::SeqCst) {
                let _ = s.cv.wait_timeout(q, FLAG_POLL);
            }
        }
    }
}
