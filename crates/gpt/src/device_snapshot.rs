//! `--memory-snapshot` of the [`DeviceTrainer`] (and of a rank of the [`ShardedDeviceTrainer`]):
//! the history of its device memory as a memory snapshot in PyTorch's format ([`Snapshot`],
//! `torch.cuda.memory._dump_snapshot`'s pickle), whose `device_traces` `python -m
//! torch.cuda._memory_viz trace_plot` draws.
//!
//! - Where the operations take their buffers from a caching allocator (CUDA's default,
//!   [`GptOps::allocator_snapshot`]), the allocator's own snapshot: its segments and blocks,
//!   and every allocation and free it recorded (the device's: ranks that are threads of one
//!   process share it).
//! - Elsewhere (the host twins, the driver's pool), every buffer the operations made and
//!   dropped ([`GptOps::memory_history`]), addressed by the buffers' identities, without
//!   segments; its running total is the counted memory the plan predicts.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use fsdp_allocator::{Snapshot, TraceAction, TraceEntry};
use fsdp_kernels::gpt::{GptOps, MemoryEvent};

use crate::device_comm::DeviceComm;
use crate::device_sharded::ShardedDeviceTrainer;
use crate::device_train::DeviceTrainer;

/// The recorded history: when recording began (on the Unix clock and the monotonic one) and
/// the events so far.
pub(crate) struct MemoryHistory {
    unix_us: u64,
    start: Instant,
    events: Vec<MemoryEvent>,
}

impl MemoryHistory {
    /// A history starting now.
    pub(crate) fn start() -> MemoryHistory {
        MemoryHistory {
            unix_us: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64),
            start: Instant::now(),
            events: Vec::new(),
        }
    }

    /// The history, with the operations' events since the last call (`more`), as a snapshot
    /// of `device` (see [`DeviceTrainer::memory_snapshot`]).
    pub(crate) fn snapshot(&mut self, more: Vec<MemoryEvent>, device: &str) -> Snapshot {
        self.events.extend(more);
        let mut traces = Vec::new();
        for e in &self.events {
            let time_us =
                self.unix_us + e.at.saturating_duration_since(self.start).as_micros() as u64;
            let entry = |action| TraceEntry {
                action,
                addr: e.id,
                size: e.bytes,
                stream: 0,
                time_us,
                frames: Vec::new(),
                device_free: None,
            };
            if e.alloc {
                traces.push(entry(TraceAction::Alloc));
            } else {
                traces.push(entry(TraceAction::FreeRequested));
                traces.push(entry(TraceAction::FreeCompleted));
            }
        }
        Snapshot {
            device: device.to_string(),
            segments: Vec::new(),
            device_traces: traces,
        }
    }
}

/// The snapshot of `ops`' memory: its allocator's, or `history` with the operations' events
/// (empty when not recording).
fn snapshot_of<O: GptOps>(ops: &O, history: &mut Option<MemoryHistory>, device: &str) -> Snapshot {
    if let Some(s) = ops.allocator_snapshot() {
        return s;
    }
    match history {
        Some(h) => h.snapshot(ops.memory_history(), device),
        None => Snapshot {
            device: device.to_string(),
            segments: Vec::new(),
            device_traces: Vec::new(),
        },
    }
}

impl<O: GptOps> DeviceTrainer<O> {
    /// Record every device buffer made and dropped from now on (`true`), or stop (`false`):
    /// see [`memory_snapshot`](Self::memory_snapshot).
    pub fn record_memory_history(&mut self, on: bool) {
        self.model.ops().record_memory_history(on);
        self.memory_history = on.then(MemoryHistory::start);
    }

    /// The device memory as a snapshot of `device` (e.g. `cuda:0`): the caching allocator's
    /// own snapshot where the buffers come from one (segments, blocks, and the history it
    /// recorded). Elsewhere the history since recording began: each buffer made is an `alloc`
    /// of its bytes, each dropped a `free_requested` and a `free_completed` (nothing waits to
    /// be reused), addressed by the buffer's identity, in time order; no segments; empty when
    /// not recording.
    pub fn memory_snapshot(&mut self, device: &str) -> Snapshot {
        snapshot_of(self.model.ops(), &mut self.memory_history, device)
    }
}

impl<O: GptOps, C: DeviceComm<O>> ShardedDeviceTrainer<O, C> {
    /// Record every device buffer this rank's operations make and drop from now on (`true`),
    /// or stop (`false`), as [`DeviceTrainer::record_memory_history`].
    pub fn record_memory_history(&mut self, on: bool) {
        self.pass.ops().record_memory_history(on);
        self.memory_history = on.then(MemoryHistory::start);
    }

    /// This rank's device memory history as a snapshot of `device`, as
    /// [`DeviceTrainer::memory_snapshot`] (the units gathered and freed, the gradients
    /// reduced, among the step's buffers).
    pub fn memory_snapshot(&mut self, device: &str) -> Snapshot {
        snapshot_of(self.pass.ops(), &mut self.memory_history, device)
    }
}
