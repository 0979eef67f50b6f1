//! Streams and events.
//!
//! A [`Stream`] is an ordered queue of work; an [`Event`] marks a point in it. The API follows
//! CUDA's (`record`, `query`, `synchronize`, `stream.wait_event`) so that the same runtime code can
//! drive CPU streams (here) and CUDA streams (`crate::cuda`, feature `cuda`).
//!
//! With the `cuda` feature a third kind wraps a cudarc `CudaStream` (`Stream::cuda`, see
//! `crate::cuda`): its events are CUDA events and `wait_event` between two CUDA streams is a
//! GPU-side wait.
//!
//! Two CPU flavours exist:
//! - [`Stream::cpu`]: a worker thread runs the enqueued closures in order, asynchronously to the
//!   thread that enqueued them. Communication streams are of this kind.
//! - [`Stream::inline`]: work runs at once on the calling thread and its events are complete when
//!   recorded. A rank's compute stream may be of this kind.
//!
//! Every blocking call has a timeout: the stream's own ([`Stream::timeout`]) or an explicit one.

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Sender};

use crate::{Device, DeviceError};

/// The timeout used by streams created without one: generous, like PyTorch's process-group
/// default, but finite.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// A process-unique identifier of a stream (the allocator keys its pools by it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(u64);

impl StreamId {
    /// The raw value.
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream#{}", self.0)
    }
}

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

type Task = Box<dyn FnOnce() + Send + 'static>;

/// Progress counters of one stream, shared with the events recorded on it.
struct Progress {
    name: String,
    state: Mutex<ProgressState>,
    cv: Condvar,
}

#[derive(Default)]
struct ProgressState {
    /// Tasks enqueued so far; an event recorded now waits for `completed >= enqueued`.
    enqueued: u64,
    /// Tasks finished so far.
    completed: u64,
    /// The first failure: (sequence number of the failed task, message).
    error: Option<(u64, String)>,
}

impl Progress {
    fn lock(&self) -> MutexGuard<'_, ProgressState> {
        // A poisoned lock only means a panic elsewhere while holding it; the counters stay valid.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait_for(&self, target: u64, timeout: Duration) -> Result<(), DeviceError> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            if st.completed >= target {
                return match &st.error {
                    Some((seq, msg)) if *seq <= target => Err(DeviceError::StreamFailed {
                        stream: self.name.clone(),
                        message: msg.clone(),
                    }),
                    _ => Ok(()),
                };
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(DeviceError::Timeout {
                    what: format!(
                        "stream `{}` to reach task {target} (it has completed {})",
                        self.name, st.completed
                    ),
                    waited: timeout,
                });
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn finish(&self, result: Result<(), String>) {
        let mut st = self.lock();
        st.completed += 1;
        if let Err(msg) = result {
            if st.error.is_none() {
                st.error = Some((st.completed, msg));
            }
        }
        drop(st);
        self.cv.notify_all();
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("task panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("task panicked: {s}")
    } else {
        "task panicked".to_string()
    }
}

enum Kind {
    Worker {
        tx: Option<Sender<Task>>,
        thread: Option<JoinHandle<()>>,
    },
    Inline,
    /// A CUDA stream (feature `cuda`); `progress` only carries the name.
    #[cfg(feature = "cuda")]
    Cuda(Arc<cudarc::driver::CudaStream>),
}

pub(crate) struct StreamInner {
    pub(crate) id: StreamId,
    pub(crate) device: Device,
    pub(crate) timeout: Duration,
    progress: Arc<Progress>,
    kind: Kind,
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if let Kind::Worker { tx, thread } = &mut self.kind {
            // Closing the channel lets the worker drain what is queued and exit.
            drop(tx.take());
            if let Some(handle) = thread.take() {
                // The last handle may be dropped by a task running on the worker itself; joining
                // would then wait for ourselves. Every queued task is bounded by its own timeout,
                // so joining from any other thread finishes.
                if handle.thread().id() != thread::current().id() {
                    let _ = handle.join();
                }
            }
        }
    }
}

/// An ordered queue of work on a device. Cloning gives another handle to the same stream.
///
/// ```
/// use fsdp_device::{Event, Stream};
/// use std::sync::{Arc, Mutex};
///
/// let comm = Stream::cpu("comm");
/// let log = Arc::new(Mutex::new(Vec::new()));
/// for i in 0..3 {
///     let log = log.clone();
///     comm.enqueue(move || log.lock().unwrap().push(i)).unwrap();
/// }
/// let done = comm.record_event();
/// done.synchronize().unwrap();
/// assert_eq!(*log.lock().unwrap(), vec![0, 1, 2]);
/// ```
#[derive(Clone)]
pub struct Stream {
    pub(crate) inner: Arc<StreamInner>,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.inner.id)
            .field("name", &self.inner.progress.name)
            .field("device", &self.inner.device)
            .field("inline", &self.is_inline())
            .finish()
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        self.inner.id == other.inner.id
    }
}
impl Eq for Stream {}

impl Stream {
    /// A CPU stream run by its own worker thread, with the [`DEFAULT_TIMEOUT`].
    pub fn cpu(name: impl Into<String>) -> Stream {
        Stream::cpu_with_timeout(name, DEFAULT_TIMEOUT)
    }

    /// A CPU stream run by its own worker thread; blocking waits on it use `timeout`.
    pub fn cpu_with_timeout(name: impl Into<String>, timeout: Duration) -> Stream {
        let name = name.into();
        let progress = Arc::new(Progress {
            name: name.clone(),
            state: Mutex::new(ProgressState::default()),
            cv: Condvar::new(),
        });
        let (tx, rx) = unbounded::<Task>();
        let worker_progress = progress.clone();
        let spawned = thread::Builder::new()
            .name(format!("stream:{name}"))
            .spawn(move || {
                for task in rx {
                    let result =
                        catch_unwind(AssertUnwindSafe(task)).map_err(|p| panic_message(&*p));
                    worker_progress.finish(result);
                }
            });
        let (tx, thread) = match spawned {
            Ok(handle) => (Some(tx), Some(handle)),
            // No thread could be started: the stream reports the failure on every enqueue.
            Err(e) => {
                progress.lock().error = Some((0, format!("could not start worker thread: {e}")));
                (None, None)
            }
        };
        Stream {
            inner: Arc::new(StreamInner {
                id: StreamId(NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed)),
                device: Device::Cpu,
                timeout,
                progress,
                kind: Kind::Worker { tx, thread },
            }),
        }
    }

    /// A CPU stream whose work runs immediately on the calling thread.
    pub fn inline(name: impl Into<String>) -> Stream {
        Stream::inline_with_timeout(name, DEFAULT_TIMEOUT)
    }

    /// An inline CPU stream whose [`wait_event`](Stream::wait_event) uses `timeout`.
    pub fn inline_with_timeout(name: impl Into<String>, timeout: Duration) -> Stream {
        Stream {
            inner: Arc::new(StreamInner {
                id: StreamId(NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed)),
                device: Device::Cpu,
                timeout,
                progress: Arc::new(Progress {
                    name: name.into(),
                    state: Mutex::new(ProgressState::default()),
                    cv: Condvar::new(),
                }),
                kind: Kind::Inline,
            }),
        }
    }

    /// A stream of another kind than the CPU ones (the CUDA constructor uses it).
    #[cfg(feature = "cuda")]
    pub(crate) fn from_cuda(
        name: String,
        device: Device,
        timeout: Duration,
        stream: Arc<cudarc::driver::CudaStream>,
    ) -> Stream {
        Stream {
            inner: Arc::new(StreamInner {
                id: StreamId(NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed)),
                device,
                timeout,
                progress: Arc::new(Progress {
                    name,
                    state: Mutex::new(ProgressState::default()),
                    cv: Condvar::new(),
                }),
                kind: Kind::Cuda(stream),
            }),
        }
    }

    /// The cudarc stream behind a CUDA stream (`None` for CPU streams), to launch kernels and
    /// copies on.
    #[cfg(feature = "cuda")]
    pub fn cuda_stream(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        match &self.inner.kind {
            Kind::Cuda(s) => Some(s),
            _ => None,
        }
    }

    /// The stream's process-unique id.
    pub fn id(&self) -> StreamId {
        self.inner.id
    }

    /// The name given at creation.
    pub fn name(&self) -> &str {
        &self.inner.progress.name
    }

    /// The device the stream runs on.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The timeout of blocking waits that do not name their own.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Whether work runs at once on the calling thread.
    pub fn is_inline(&self) -> bool {
        matches!(self.inner.kind, Kind::Inline)
    }

    /// Whether [`enqueue`](Self::enqueue) takes host closures: CPU worker and inline streams
    /// do, CUDA streams do not.
    pub fn runs_host_tasks(&self) -> bool {
        match self.inner.kind {
            #[cfg(feature = "cuda")]
            Kind::Cuda(_) => false,
            _ => true,
        }
    }

    /// Append `work` to the stream. On a worker stream it runs later, after everything enqueued
    /// before it; on an inline stream it runs now. A panic inside `work` is caught and becomes
    /// the stream's sticky error. CUDA streams run no host closures
    /// ([`DeviceError::Unsupported`]).
    pub fn enqueue(&self, work: impl FnOnce() + Send + 'static) -> Result<(), DeviceError> {
        let progress = &self.inner.progress;
        match &self.inner.kind {
            #[cfg(feature = "cuda")]
            Kind::Cuda(_) => Err(DeviceError::Unsupported {
                op: "enqueue of a host closure",
                device: self.inner.device.to_string(),
            }),
            Kind::Inline => {
                progress.lock().enqueued += 1;
                let result = catch_unwind(AssertUnwindSafe(work)).map_err(|p| panic_message(&*p));
                progress.finish(result);
                Ok(())
            }
            Kind::Worker { tx, .. } => {
                let mut st = progress.lock();
                let failed = || DeviceError::StreamFailed {
                    stream: progress.name.clone(),
                    message: "the stream's worker thread is not running".into(),
                };
                let tx = tx.as_ref().ok_or_else(failed)?;
                // Holding the lock while sending keeps the counter and the queue in one order
                // when several threads enqueue on the same stream.
                tx.send(Box::new(work)).map_err(|_| failed())?;
                st.enqueued += 1;
                Ok(())
            }
        }
    }

    /// Record a new event at the current end of the stream.
    pub fn record_event(&self) -> Event {
        let event = Event::new();
        event.record(self);
        event
    }

    /// Make all work enqueued after this call wait until `event` completes (its recorded point on
    /// its own stream has run). On a worker stream this enqueues a wait bounded by this stream's
    /// timeout, whose expiry becomes the stream's sticky error; on an inline stream it blocks the
    /// caller (bounded the same way) and returns the error directly. A CUDA stream waits for a
    /// CUDA event on the GPU (`cuStreamWaitEvent`, the host does not block) and for a CPU event
    /// on the host, bounded by its timeout.
    pub fn wait_event(&self, event: &Event) -> Result<(), DeviceError> {
        let point = event.lock().clone();
        let (progress, target) = match point {
            None => return Ok(()),
            Some(EventPoint::Cpu {
                progress, target, ..
            }) => (progress, target),
            #[cfg(feature = "cuda")]
            Some(EventPoint::Cuda(p)) => {
                return match &self.inner.kind {
                    Kind::Cuda(s) => p.stream_wait(s),
                    Kind::Inline => p.synchronize(self.inner.timeout),
                    Kind::Worker { .. } => {
                        let timeout = self.inner.timeout;
                        self.enqueue(move || {
                            if let Err(e) = p.synchronize(timeout) {
                                panic!("wait_event failed: {e}");
                            }
                        })
                    }
                };
            }
        };
        if Arc::ptr_eq(&progress, &self.inner.progress) {
            return Ok(()); // same stream: already ordered
        }
        if progress.lock().completed >= target {
            return Ok(());
        }
        let timeout = self.inner.timeout;
        match &self.inner.kind {
            Kind::Inline => progress.wait_for(target, timeout),
            #[cfg(feature = "cuda")]
            Kind::Cuda(_) => progress.wait_for(target, timeout),
            Kind::Worker { .. } => self.enqueue(move || {
                if let Err(e) = progress.wait_for(target, timeout) {
                    panic!("wait_event failed: {e}");
                }
            }),
        }
    }

    /// Whether everything enqueued so far has run.
    pub fn query(&self) -> bool {
        self.record_event().query()
    }

    /// Block until everything enqueued so far has run, up to the stream's timeout.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.record_event().synchronize_timeout(self.inner.timeout)
    }

    /// The stream's sticky error, if a task failed.
    pub fn error(&self) -> Option<DeviceError> {
        self.inner
            .progress
            .lock()
            .error
            .as_ref()
            .map(|(_, msg)| DeviceError::StreamFailed {
                stream: self.inner.progress.name.clone(),
                message: msg.clone(),
            })
    }
}

/// A point in a stream. A new event, or one never recorded, counts as complete (as in CUDA).
/// Cloning gives another handle to the same event; recording again moves the point.
#[derive(Clone, Default)]
pub struct Event {
    point: Arc<Mutex<Option<EventPoint>>>,
}

#[derive(Clone)]
enum EventPoint {
    /// A task count of a CPU stream.
    Cpu {
        progress: Arc<Progress>,
        target: u64,
        timeout: Duration,
    },
    /// A CUDA event of the pool, recorded on a CUDA stream.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaPoint),
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let point = self.lock().clone();
        match point {
            None => f.write_str("Event(unrecorded)"),
            Some(EventPoint::Cpu {
                progress, target, ..
            }) => write!(f, "Event({} @ task {target})", progress.name),
            #[cfg(feature = "cuda")]
            Some(EventPoint::Cuda(p)) => write!(f, "Event({p:?})"),
        }
    }
}

impl Event {
    /// A new, unrecorded (hence complete) event.
    pub fn new() -> Event {
        Event::default()
    }

    fn lock(&self) -> MutexGuard<'_, Option<EventPoint>> {
        self.point.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new event at the same recorded point, not shared with this one: recording either
    /// later moves only that one.
    pub(crate) fn snapshot(&self) -> Event {
        Event {
            point: Arc::new(Mutex::new(self.lock().clone())),
        }
    }

    /// Mark the current end of `stream`: the event completes once everything enqueued on it so
    /// far has run. On a CUDA stream this records a CUDA event taken from the device's event
    /// pool; a failure to record is reported by [`synchronize`](Event::synchronize).
    pub fn record(&self, stream: &Stream) {
        let point = match &stream.inner.kind {
            #[cfg(feature = "cuda")]
            Kind::Cuda(s) => {
                EventPoint::Cuda(crate::cuda::CudaPoint::record(s, stream.inner.timeout))
            }
            _ => {
                let progress = stream.inner.progress.clone();
                let target = progress.lock().enqueued;
                EventPoint::Cpu {
                    progress,
                    target,
                    timeout: stream.inner.timeout,
                }
            }
        };
        *self.lock() = Some(point);
    }

    /// Whether the recorded point has been reached (true if never recorded).
    pub fn query(&self) -> bool {
        let point = self.lock().clone();
        match point {
            None => true,
            Some(EventPoint::Cpu {
                progress, target, ..
            }) => progress.lock().completed >= target,
            #[cfg(feature = "cuda")]
            Some(EventPoint::Cuda(p)) => p.query(),
        }
    }

    /// Block until the point is reached, up to the recording stream's timeout. Fails if a task
    /// before the point panicked (a CUDA error for CUDA events).
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        let timeout = match &*self.lock() {
            None => return Ok(()),
            Some(EventPoint::Cpu { timeout, .. }) => *timeout,
            #[cfg(feature = "cuda")]
            Some(EventPoint::Cuda(p)) => p.timeout(),
        };
        self.synchronize_timeout(timeout)
    }

    /// Block until the point is reached or `timeout` passes.
    pub fn synchronize_timeout(&self, timeout: Duration) -> Result<(), DeviceError> {
        let point = self.lock().clone();
        match point {
            None => Ok(()),
            Some(EventPoint::Cpu {
                progress, target, ..
            }) => progress.wait_for(target, timeout),
            #[cfg(feature = "cuda")]
            Some(EventPoint::Cuda(p)) => p.synchronize(timeout),
        }
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
