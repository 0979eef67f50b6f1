//! A picture of every segment and block, with the recorded memory history, serialisable to
//! JSON and to the pickle layout of PyTorch's `torch.cuda.memory._snapshot()` (which
//! `torch/cuda/_memory_viz.py` draws).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::history::{Frame, TraceEntry};
use crate::pickle::{to_pickle, PyValue};
use crate::{AllocError, PoolKind};

/// The state of a block in a [`Snapshot`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    /// Held by a live [`Block`](crate::Block) handle.
    ActiveAllocated,
    /// Freed, but waiting for the events of the streams recorded with
    /// [`record_stream`](crate::Block::record_stream).
    ActivePendingFree,
    /// Free and cached in its pool.
    Inactive,
}

/// One block of a segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSnapshot {
    /// Address of the first byte (a host or device address).
    pub address: u64,
    /// Size in bytes (a multiple of 512).
    pub size: u64,
    /// Bytes asked for by the request that holds the block (0 for inactive blocks).
    pub requested_size: u64,
    /// Whether it is allocated, pending or free.
    pub state: BlockState,
    /// The call stack of its allocation, when the memory history recorded it (active blocks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frames: Vec<Frame>,
}

/// One segment obtained from the memory source, with its blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentSnapshot {
    /// Address of the segment.
    pub address: u64,
    /// Size in bytes.
    pub total_size: u64,
    /// Bytes in allocated blocks.
    pub allocated_size: u64,
    /// Bytes in allocated and pending blocks.
    pub active_size: u64,
    /// Bytes asked for by the active blocks' requests.
    pub requested_size: u64,
    /// The stream key ([`MemorySource::stream_key`](crate::MemorySource::stream_key)) of the
    /// pool the segment belongs to.
    pub stream: u64,
    /// The pool.
    pub segment_type: PoolKind,
    /// Whether it is an expandable segment (a reserved range whose pages are mapped as needed).
    #[serde(default)]
    pub is_expandable: bool,
    /// The blocks tiling the segment, in address order.
    pub blocks: Vec<BlockSnapshot>,
}

/// Every segment of an allocator, in address order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The device, as text (`cpu`, `cuda:0`).
    pub device: String,
    /// The segments.
    pub segments: Vec<SegmentSnapshot>,
    /// The recorded memory history, oldest first (empty unless
    /// [`record_memory_history`](crate::CachingAllocator::record_memory_history) is on).
    #[serde(default)]
    pub device_traces: Vec<TraceEntry>,
}

impl Snapshot {
    /// The snapshot as pretty-printed JSON.
    pub fn to_json(&self) -> Result<String, AllocError> {
        serde_json::to_string_pretty(self).map_err(|e| AllocError::Json(e.to_string()))
    }

    /// Read a snapshot written by [`to_json`](Snapshot::to_json).
    pub fn from_json(json: &str) -> Result<Snapshot, AllocError> {
        serde_json::from_str(json).map_err(|e| AllocError::Json(e.to_string()))
    }

    /// The device's index as PyTorch numbers devices: `N` for `cuda:N`, 0 otherwise.
    pub fn device_index(&self) -> usize {
        self.device
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// The snapshot as the Python object `torch.cuda.memory._snapshot()` returns: a dict with
    /// `segments` (each with `device`, `address`, `total_size`, `allocated_size`,
    /// `active_size`, `requested_size`, `stream`, `segment_type`, `segment_pool_id`,
    /// `is_expandable`, `frames` and `blocks` of `address`, `size`, `requested_size`, `state`,
    /// `frames`) and `device_traces` (a list per device index, ours at
    /// [`device_index`](Snapshot::device_index), of dicts with `action`, `addr`, `size`,
    /// `stream`, `time_us`, `frames` and, for `oom`, `device_free`); frames are dicts of
    /// `filename`, `line`, `name`.
    pub fn to_python(&self) -> PyValue {
        let index = self.device_index();
        let segments = self
            .segments
            .iter()
            .map(|s| {
                let blocks = s
                    .blocks
                    .iter()
                    .map(|b| {
                        PyValue::Dict(vec![
                            ("address".into(), b.address.into()),
                            ("size".into(), b.size.into()),
                            ("requested_size".into(), b.requested_size.into()),
                            ("state".into(), block_state_name(b.state).into()),
                            ("frames".into(), frames_value(&b.frames)),
                        ])
                    })
                    .collect();
                PyValue::Dict(vec![
                    ("device".into(), (index as u64).into()),
                    ("address".into(), s.address.into()),
                    ("total_size".into(), s.total_size.into()),
                    ("allocated_size".into(), s.allocated_size.into()),
                    ("active_size".into(), s.active_size.into()),
                    ("requested_size".into(), s.requested_size.into()),
                    ("stream".into(), s.stream.into()),
                    (
                        "segment_type".into(),
                        match s.segment_type {
                            PoolKind::Small => "small",
                            PoolKind::Large => "large",
                        }
                        .into(),
                    ),
                    (
                        "segment_pool_id".into(),
                        PyValue::Tuple(vec![PyValue::Int(0), PyValue::Int(0)]),
                    ),
                    ("is_expandable".into(), s.is_expandable.into()),
                    ("frames".into(), PyValue::List(Vec::new())),
                    ("blocks".into(), PyValue::List(blocks)),
                ])
            })
            .collect();
        let trace = self
            .device_traces
            .iter()
            .map(|e| {
                let mut d = vec![
                    ("action".into(), e.action.as_str().into()),
                    ("addr".into(), e.addr.into()),
                    ("size".into(), e.size.into()),
                    ("stream".into(), e.stream.into()),
                    ("time_us".into(), e.time_us.into()),
                    ("frames".into(), frames_value(&e.frames)),
                ];
                if let Some(free) = e.device_free {
                    d.push(("device_free".into(), free.into()));
                }
                PyValue::Dict(d)
            })
            .collect();
        let mut traces = vec![PyValue::List(Vec::new()); index];
        traces.push(PyValue::List(trace));
        PyValue::Dict(vec![
            ("segments".into(), PyValue::List(segments)),
            ("device_traces".into(), PyValue::List(traces)),
        ])
    }

    /// The snapshot pickled ([`to_python`](Snapshot::to_python)), for
    /// `python -m torch.cuda._memory_viz trace_plot FILE -o out.html`.
    pub fn to_pickle(&self) -> Vec<u8> {
        to_pickle(&self.to_python())
    }

    /// Write [`to_pickle`](Snapshot::to_pickle) to `path`.
    pub fn write_pickle(&self, path: impl AsRef<Path>) -> Result<(), AllocError> {
        let path = path.as_ref();
        std::fs::write(path, self.to_pickle()).map_err(|e| {
            AllocError::InvalidArgument(format!(
                "could not write the memory snapshot {}: {e}",
                path.display()
            ))
        })
    }

    /// Bytes in all segments.
    pub fn reserved_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.total_size).sum()
    }

    /// Every block, with the segment that holds it.
    pub fn blocks(&self) -> impl Iterator<Item = (&SegmentSnapshot, &BlockSnapshot)> {
        self.segments
            .iter()
            .flat_map(|s| s.blocks.iter().map(move |b| (s, b)))
    }
}

fn block_state_name(state: BlockState) -> &'static str {
    match state {
        BlockState::ActiveAllocated => "active_allocated",
        BlockState::ActivePendingFree => "active_pending_free",
        BlockState::Inactive => "inactive",
    }
}

fn frames_value(frames: &[Frame]) -> PyValue {
    PyValue::List(
        frames
            .iter()
            .map(|f| {
                PyValue::Dict(vec![
                    ("filename".into(), f.filename.as_str().into()),
                    ("line".into(), PyValue::Int(f.line.into())),
                    ("name".into(), f.name.as_str().into()),
                ])
            })
            .collect(),
    )
}
