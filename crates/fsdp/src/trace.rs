//! Timeline traces of the engine: compute and communication spans and memory counters per
//! rank, written as Chrome trace JSON (Trace Event Format, opens in Perfetto and
//! `chrome://tracing`).
//!
//! Enable tracing with [`FsdpConfig::trace`](crate::engine::FsdpConfig::trace); after training,
//! collect every rank's [`Fsdp::trace_events`](crate::engine::Fsdp::trace_events) and
//! write them with [`write_chrome_trace`]. All timestamps come from one process-wide clock
//! ([`now_us`]), so ranks running as threads share a time axis.
//!
//! - Compute spans: forward and backward of every span of the model (e.g. an embedding, each
//!   transformer block, a head), with the units the span reads, measured on the rank's compute
//!   stream (its thread).
//! - Communication spans: every all-gather, reduce-scatter and all-reduce, with its per-rank
//!   payload in bytes, measured when the communication stream runs it (timestamp-recording
//!   tasks enqueued right before and after the collective on the same in-order stream); not
//!   on a communicator whose stream is a CUDA stream (NCCL's), which runs no host tasks.
//! - Counters: the allocator's allocated and reserved bytes at every compute span boundary.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use fsdp_device::Stream;

use crate::FsdpError;

static EPOCH: OnceLock<Instant> = OnceLock::new();

/// Microseconds since the process-wide trace epoch (the first call of this function).
pub fn now_us() -> f64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_secs_f64() * 1e6
}

/// The thread (track) of a span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Track {
    /// The rank's compute stream.
    Compute,
    /// The rank's communication stream(s).
    Communication,
}

/// What a span measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpanKind {
    /// Forward of one stage.
    Forward,
    /// Backward of one stage.
    Backward,
    /// An all-gather of a unit's parameters.
    AllGather,
    /// A reduce-scatter of a unit's gradient.
    ReduceScatter,
    /// An all-reduce (gradients across replicas, or the loss).
    AllReduce,
    /// The end of a step: the gradient norm, clipping and the optimizer (a trainer without the
    /// engine traces it on its compute track).
    Optimizer,
}

impl SpanKind {
    /// The track the span belongs to.
    pub fn track(self) -> Track {
        match self {
            SpanKind::Forward | SpanKind::Backward | SpanKind::Optimizer => Track::Compute,
            _ => Track::Communication,
        }
    }

    /// A short lowercase name (the Chrome trace category).
    pub fn as_str(self) -> &'static str {
        match self {
            SpanKind::Forward => "forward",
            SpanKind::Backward => "backward",
            SpanKind::AllGather => "all_gather",
            SpanKind::ReduceScatter => "reduce_scatter",
            SpanKind::AllReduce => "all_reduce",
            SpanKind::Optimizer => "optimizer",
        }
    }
}

/// One recorded trace event of a rank.
#[derive(Debug, Clone, PartialEq)]
pub enum TraceEvent {
    /// A span of time on one track.
    Span {
        /// What it measures (its track follows from it).
        kind: SpanKind,
        /// Display name, e.g. `forward block 2` or `all_gather unit 3`.
        name: String,
        /// The forward/backward pass (micro-batch) counted from 1.
        step: u64,
        /// The units involved (a compute stage's units, or the collective's unit; empty for the
        /// all-reduces of the loss and of the squared gradient norm).
        units: Vec<usize>,
        /// Begin, microseconds since the epoch of [`now_us`].
        begin_us: f64,
        /// End, microseconds since the epoch of [`now_us`].
        end_us: f64,
        /// Per-rank payload of a collective in bytes (`None` for compute).
        bytes: Option<u64>,
    },
    /// A sample of the rank's allocator statistics.
    Counter {
        /// Microseconds since the epoch of [`now_us`].
        time_us: f64,
        /// Allocated bytes (current).
        allocated: u64,
        /// Reserved bytes (current).
        reserved: u64,
    },
}

/// A rank's event sink, shared with the tasks on its communication streams.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tracer {
    events: Arc<Mutex<Vec<TraceEvent>>>,
}

impl Tracer {
    pub(crate) fn push(&self, e: TraceEvent) {
        if let Ok(mut v) = self.events.lock() {
            v.push(e);
        }
    }

    pub(crate) fn events(&self) -> Vec<TraceEvent> {
        self.events.lock().map(|v| v.clone()).unwrap_or_default()
    }

    pub(crate) fn clear(&self) {
        if let Ok(mut v) = self.events.lock() {
            v.clear();
        }
    }

    /// Issue a collective through `issue` with a span measured on `stream`: a task recording
    /// the begin time is enqueued right before it, one recording the end right after (the
    /// stream runs its tasks in order). A communicator whose stream runs no host tasks (NCCL's
    /// CUDA stream) issues it without a span.
    pub(crate) fn comm<T>(
        &self,
        stream: &Stream,
        kind: SpanKind,
        step: u64,
        units: Vec<usize>,
        bytes: u64,
        issue: impl FnOnce() -> Result<T, FsdpError>,
    ) -> Result<T, FsdpError> {
        if !stream.runs_host_tasks() {
            return issue();
        }
        let begin = Arc::new(AtomicU64::new(0));
        let b = Arc::clone(&begin);
        stream.enqueue(move || b.store(now_us().to_bits(), Ordering::Release))?;
        let r = issue()?;
        let name = match units.as_slice() {
            [u] => format!("{} unit {u}", kind.as_str()),
            [] if bytes == 4 => format!("{} loss", kind.as_str()),
            [] => format!("{} grad norm", kind.as_str()),
            _ => format!("{} units {units:?}", kind.as_str()),
        };
        let sink = self.clone();
        stream.enqueue(move || {
            let end_us = now_us();
            sink.push(TraceEvent::Span {
                kind,
                name,
                step,
                units,
                begin_us: f64::from_bits(begin.load(Ordering::Acquire)),
                end_us,
                bytes: Some(bytes),
            });
        })?;
        Ok(r)
    }
}

fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o
}

fn tid(t: Track) -> u32 {
    match t {
        Track::Compute => 0,
        Track::Communication => 1,
    }
}

/// The Chrome trace JSON of `per_rank` (index = rank = `pid`; `tid` 0 = compute, 1 =
/// communication): `M` metadata naming processes `rank N` and threads, `X` complete events for
/// spans (args: step, units, bytes) and `C` counter events `memory` with `allocated` and
/// `reserved` bytes.
pub fn chrome_trace_json(per_rank: &[Vec<TraceEvent>]) -> String {
    let mut out = String::from("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    let mut first = true;
    let mut emit = |line: String, out: &mut String| {
        if !first {
            out.push_str(",\n");
        }
        first = false;
        out.push_str(&line);
    };
    for (rank, events) in per_rank.iter().enumerate() {
        emit(
            format!(
                "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{rank},\"tid\":0,\"args\":{{\"name\":\"rank {rank}\"}}}}"
            ),
            &mut out,
        );
        emit(
            format!(
                "{{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":{rank},\"tid\":0,\"args\":{{\"sort_index\":{rank}}}}}"
            ),
            &mut out,
        );
        for (t, name) in [
            (Track::Compute, "compute"),
            (Track::Communication, "communication"),
        ] {
            emit(
                format!(
                    "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{rank},\"tid\":{},\"args\":{{\"name\":\"{name}\"}}}}",
                    tid(t)
                ),
                &mut out,
            );
        }
        for e in events {
            let line = match e {
                TraceEvent::Span {
                    kind,
                    name,
                    step,
                    units,
                    begin_us,
                    end_us,
                    bytes,
                } => {
                    let units = units
                        .iter()
                        .map(|u| u.to_string())
                        .collect::<Vec<_>>()
                        .join(",");
                    let bytes = bytes.map_or(String::new(), |b| format!(",\"bytes\":{b}"));
                    format!(
                        "{{\"ph\":\"X\",\"name\":\"{}\",\"cat\":\"{}\",\"pid\":{rank},\"tid\":{},\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"step\":{step},\"units\":[{units}]{bytes}}}}}",
                        escape(name),
                        kind.as_str(),
                        tid(kind.track()),
                        begin_us,
                        (end_us - begin_us).max(0.0),
                    )
                }
                TraceEvent::Counter {
                    time_us,
                    allocated,
                    reserved,
                } => format!(
                    "{{\"ph\":\"C\",\"name\":\"memory\",\"pid\":{rank},\"tid\":0,\"ts\":{time_us:.3},\"args\":{{\"allocated\":{allocated},\"reserved\":{reserved}}}}}"
                ),
            };
            emit(line, &mut out);
        }
    }
    out.push_str("\n]}\n");
    out
}

/// Write [`chrome_trace_json`] of `per_rank` to `path` with
/// [`checkpoint::write_output`](crate::checkpoint::write_output): a regular file (or a symbolic
/// link's target) is replaced atomically — a temporary file in the same directory is written,
/// synced and renamed over it — and a character device or a FIFO is written into directly.
///
/// # Errors
/// [`FsdpError::Checkpoint`] naming `path` when it may not be written (a directory, a block
/// device, a socket; a missing or read-only directory) or the write fails.
pub fn write_chrome_trace(path: &Path, per_rank: &[Vec<TraceEvent>]) -> Result<(), FsdpError> {
    let json = chrome_trace_json(per_rank);
    crate::checkpoint::write_output(path, |w| w.write_all(json.as_bytes()))
}
