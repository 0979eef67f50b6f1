//! Handles to issued collectives.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fsdp_device::{Event, Stream};

use crate::{CollectiveError, Result};

#[derive(Default)]
struct State {
    result: Mutex<Option<Result<()>>>,
    cv: Condvar,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Option<Result<()>>> {
        self.result.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A collective issued on a communicator's stream (PyTorch's `Work`). It completes when the
/// stream has run the collective; waiting is bounded by a timeout. Dropping or forgetting a
/// `Work` is always safe: the stream owns the buffers it touches until it is done with them.
/// Clones are handles to the same collective (as PyTorch's `Work` is shared): each sees its
/// completion and its result.
#[derive(Clone)]
pub struct Work {
    state: Arc<State>,
    event: Event,
    op: &'static str,
    rank: usize,
    timeout: Duration,
    /// Stream-ordered work (the NCCL backend's): [`Work::wait`] makes this stream wait for
    /// [`Work::event`] on the device instead of blocking the host.
    wait_stream: Option<Stream>,
}

impl fmt::Debug for Work {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.op)
            .field("rank", &self.rank)
            .field("completed", &self.is_completed())
            .finish()
    }
}

/// The producer side of a [`Work`]: the stream task that runs the collective sets the result.
/// If it is dropped without a result (the task panicked or was discarded), the work fails.
pub struct WorkCompleter {
    state: Option<Arc<State>>,
    op: &'static str,
    rank: usize,
}

impl fmt::Debug for WorkCompleter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WorkCompleter({} on rank {})", self.op, self.rank)
    }
}

impl WorkCompleter {
    /// Publish the result and wake the waiters.
    pub fn complete(mut self, result: Result<()>) {
        if let Some(state) = self.state.take() {
            *state.lock() = Some(result);
            state.cv.notify_all();
        }
    }
}

impl Drop for WorkCompleter {
    fn drop(&mut self) {
        if let Some(state) = self.state.take() {
            *state.lock() = Some(Err(CollectiveError::Aborted {
                rank: self.rank,
                reason: format!("the stream task running {} ended without a result", self.op),
            }));
            state.cv.notify_all();
        }
    }
}

impl Work {
    /// A pending work and the completer that finishes it. `event` must be recorded on the
    /// stream right after the task that owns the completer.
    pub fn pending(
        op: &'static str,
        rank: usize,
        timeout: Duration,
    ) -> (WorkCompleter, impl FnOnce(Event) -> Work) {
        let state = Arc::new(State::default());
        let completer = WorkCompleter {
            state: Some(state.clone()),
            op,
            rank,
        };
        (completer, move |event| Work {
            state,
            event,
            op,
            rank,
            timeout,
            wait_stream: None,
        })
    }

    /// A work that has already completed successfully, for a collective that had nothing to
    /// wait for (the [`dryrun`](crate::dryrun) backend's). Its [`event`](Work::event) is a new,
    /// unrecorded event, hence complete: `stream.wait_event(work.event())` never waits.
    pub fn completed(op: &'static str, rank: usize) -> Work {
        Work {
            state: Arc::new(State {
                result: Mutex::new(Some(Ok(()))),
                cv: Condvar::new(),
            }),
            event: Event::new(),
            op,
            rank,
            timeout: fsdp_device::DEFAULT_TIMEOUT,
            wait_stream: None,
        }
    }

    /// This work made stream-ordered (PyTorch's `ProcessGroupNCCL` semantics): [`Work::wait`]
    /// then makes `stream` wait on the device for [`Work::event`] without blocking the host,
    /// and returns an error only if the work has already failed; [`Work::synchronize`] blocks
    /// the host until the result is known.
    pub fn with_stream_wait(mut self, stream: Stream) -> Work {
        self.wait_stream = Some(stream);
        self
    }

    /// The operation's name.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// An event that completes with the work, for `other_stream.wait_event(work.event())`.
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// Whether the work has finished (successfully or not). Never blocks.
    pub fn is_completed(&self) -> bool {
        self.state.lock().is_some()
    }

    /// The result if finished, without blocking.
    pub fn poll(&self) -> Option<Result<()>> {
        self.state.lock().clone()
    }

    /// Wait for the result, up to twice the communicator's timeout: the collective itself fails
    /// within one timeout of starting, and work issued before it on the stream within another.
    /// For stream-ordered work ([`Work::with_stream_wait`]) the host does not block: the
    /// waiting stream is made to wait for [`Work::event`] on the device, and a failure that is
    /// not known yet surfaces in [`Work::synchronize`] and in the communicator's next call.
    pub fn wait(&self) -> Result<()> {
        let Some(stream) = &self.wait_stream else {
            return self.synchronize();
        };
        if let Some(Err(e)) = self.poll() {
            return Err(e);
        }
        stream
            .wait_event(&self.event)
            .map_err(|source| CollectiveError::Device {
                rank: self.rank,
                source,
            })
    }

    /// Block the host until the result is known, up to twice the communicator's timeout.
    pub fn synchronize(&self) -> Result<()> {
        self.wait_timeout(self.timeout.saturating_mul(2))
    }

    /// Wait for the result, up to `timeout`.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock();
        loop {
            if let Some(r) = st.as_ref() {
                return r.clone();
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CollectiveError::Timeout {
                    rank: self.rank,
                    op: self.op,
                    seq: u64::MAX,
                    waited: timeout,
                    waiting_for: "the work to finish on the communication stream".into(),
                });
            }
            st = self
                .state
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
