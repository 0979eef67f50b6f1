//! Memory history (PyTorch's `torch.cuda.memory._record_memory_history`): with recording on,
//! the allocator keeps every alloc, free and segment event with a timestamp, the stream and a
//! short call stack, and [`CachingAllocator::snapshot`](crate::CachingAllocator::snapshot)
//! includes them as [`Snapshot::device_traces`](crate::Snapshot::device_traces), which
//! [`Snapshot::to_pickle`](crate::Snapshot::to_pickle) writes in the layout
//! `torch/cuda/_memory_viz.py` reads.
//!
//! Call stacks are the frames the caller names ([`memory_context`], e.g. "unit 3 all-gather"),
//! innermost first, below the source location of the `allocate` call.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::panic::Location;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// One frame of a recorded call stack (PyTorch's `{filename, line, name}`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    /// Source file, or empty for a frame named with [`memory_context`].
    pub filename: String,
    /// Line in the file (0 for named frames).
    pub line: u32,
    /// Function or context name.
    pub name: String,
}

/// What a [`TraceEntry`] records (PyTorch's `TraceEntry::Action`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TraceAction {
    /// A block was handed out.
    Alloc,
    /// A block's handle was dropped (its memory may still wait for record-stream events).
    FreeRequested,
    /// A block returned to its pool.
    FreeCompleted,
    /// A segment was obtained from the memory source.
    SegmentAlloc,
    /// A segment was returned to the memory source.
    SegmentFree,
    /// Pages of an expandable segment were mapped.
    SegmentMap,
    /// Pages of an expandable segment were unmapped.
    SegmentUnmap,
    /// A request failed with an out-of-memory error.
    Oom,
}

impl TraceAction {
    /// The name PyTorch uses (`"alloc"`, `"free_requested"`, `"segment_map"`...).
    pub fn as_str(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::Oom => "oom",
        }
    }
}

/// One recorded event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// The block or segment address (for [`TraceAction::Oom`], the device's free bytes, as in
    /// PyTorch).
    pub addr: u64,
    /// Bytes: the request's size for block events, the segment's (or mapped range's) size for
    /// segment events, the size it tried to reserve for an out-of-memory error.
    pub size: u64,
    /// The stream key of the pool.
    pub stream: u64,
    /// Microseconds since the Unix epoch (the clock read when recording started, advanced by a
    /// monotonic clock: events are in time order).
    pub time_us: u64,
    /// The call stack, innermost first.
    pub frames: Vec<Frame>,
    /// The device's free bytes (out-of-memory events only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_free: Option<u64>,
}

/// Options of memory-history recording.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HistoryConfig {
    /// Keep at most this many events (the oldest are dropped first); default 100,000.
    pub max_entries: usize,
    /// Record the source location of each `allocate` call as the innermost frame; default on.
    pub record_location: bool,
}

impl Default for HistoryConfig {
    fn default() -> Self {
        HistoryConfig {
            max_entries: 100_000,
            record_location: true,
        }
    }
}

impl HistoryConfig {
    /// Keep at most `n` events.
    pub fn with_max_entries(mut self, n: usize) -> Self {
        self.max_entries = n;
        self
    }

    /// Whether to record the source location of each `allocate` call.
    pub fn with_record_location(mut self, on: bool) -> Self {
        self.record_location = on;
        self
    }
}

thread_local! {
    static CONTEXT: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// How many allocators of the process record their history: while none does, naming frames
/// costs nothing.
static RECORDING: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn recording_started() {
    RECORDING.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn recording_stopped() {
    RECORDING.fetch_sub(1, Ordering::Relaxed);
}

/// Name a frame of the call stacks recorded on this thread until the guard drops (PyTorch's
/// Python frames; here the caller says what it is doing, e.g. "unit 3 all-gather"). Frames
/// nest; the innermost comes first in a recorded stack. While no allocator records its
/// history, nothing is kept (see [`memory_context_with`] to skip building the name too).
///
/// ```
/// use fsdp_allocator::{memory_context, AllocatorConfig, HistoryConfig, MetaAllocator, MetaSource};
/// use fsdp_device::Stream;
///
/// let alloc = MetaAllocator::new(MetaSource::new(1 << 30), AllocatorConfig::default())?;
/// alloc.record_memory_history(Some(HistoryConfig::default()));
/// let block = {
///     let _unit = memory_context("unit 3");
///     let _ag = memory_context("all-gather");
///     alloc.allocate(4 << 20, &Stream::inline("comm"))?
/// };
/// let snap = alloc.snapshot();
/// let alloc_event = snap.device_traces.iter().find(|e| e.action.as_str() == "alloc").unwrap();
/// let names: Vec<&str> = alloc_event.frames.iter().map(|f| f.name.as_str()).collect();
/// assert_eq!(names, ["allocate", "all-gather", "unit 3"]);
/// # drop(block);
/// # Ok::<(), fsdp_allocator::AllocError>(())
/// ```
pub fn memory_context(name: impl Into<String>) -> MemoryContextGuard {
    memory_context_with(|| name.into())
}

/// [`memory_context`] with the name built only while some allocator records its history.
pub fn memory_context_with(name: impl FnOnce() -> String) -> MemoryContextGuard {
    let pushed = RECORDING.load(Ordering::Relaxed) > 0;
    if pushed {
        let name = name();
        CONTEXT.with(|c| c.borrow_mut().push(name));
    }
    MemoryContextGuard {
        pushed,
        _not_send: std::marker::PhantomData,
    }
}

/// Pops the frame pushed by [`memory_context`] when dropped (on the same thread).
#[must_use = "the frame is popped when the guard drops"]
#[derive(Debug)]
pub struct MemoryContextGuard {
    pushed: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for MemoryContextGuard {
    fn drop(&mut self) {
        if self.pushed {
            CONTEXT.with(|c| {
                c.borrow_mut().pop();
            });
        }
    }
}

/// The recorded events of one allocator, and the frames of its live blocks and segments.
pub(crate) struct History {
    config: HistoryConfig,
    entries: VecDeque<TraceEntry>,
    /// Frames of allocated blocks, by block id.
    pub(crate) block_frames: HashMap<usize, Vec<Frame>>,
    /// When recording started, on the monotonic clock and in microseconds since the epoch.
    start: (Instant, u64),
}

/// Microseconds since the Unix epoch now (0 under Miri, whose isolation has no wall clock).
fn epoch_micros() -> u64 {
    if cfg!(miri) {
        return 0;
    }
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

impl History {
    pub(crate) fn new(config: HistoryConfig) -> History {
        History {
            config,
            entries: VecDeque::new(),
            block_frames: HashMap::new(),
            start: (Instant::now(), epoch_micros()),
        }
    }

    /// Change the options; the events so far stay (the oldest dropped past the new maximum).
    pub(crate) fn set_config(&mut self, config: HistoryConfig) {
        self.config = config;
        while self.entries.len() > config.max_entries {
            self.entries.pop_front();
        }
    }

    /// The current call stack: the caller's location (if any and wanted), then the named
    /// frames of this thread, innermost first.
    pub(crate) fn frames(&self, location: Option<&Location<'_>>) -> Vec<Frame> {
        let mut frames = Vec::new();
        if let Some(l) = location.filter(|_| self.config.record_location) {
            frames.push(Frame {
                filename: l.file().to_string(),
                line: l.line(),
                name: "allocate".to_string(),
            });
        }
        CONTEXT.with(|c| {
            frames.extend(c.borrow().iter().rev().map(|name| Frame {
                filename: String::new(),
                line: 0,
                name: name.clone(),
            }))
        });
        frames
    }

    pub(crate) fn record(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: u64,
        frames: Vec<Frame>,
    ) {
        self.push(TraceEntry {
            action,
            addr,
            size,
            stream,
            time_us: self.now_us(),
            frames,
            device_free: None,
        });
    }

    pub(crate) fn push(&mut self, entry: TraceEntry) {
        if self.config.max_entries == 0 {
            return;
        }
        while self.entries.len() >= self.config.max_entries {
            self.entries.pop_front();
        }
        self.entries.push_back(entry);
    }

    /// The current time in microseconds since the epoch, monotonic.
    pub(crate) fn now_us(&self) -> u64 {
        self.start.1 + self.start.0.elapsed().as_micros() as u64
    }

    pub(crate) fn entries(&self) -> Vec<TraceEntry> {
        self.entries.iter().cloned().collect()
    }
}
