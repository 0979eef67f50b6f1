//! A picture of every segment and block, serialisable to JSON (like
//! `torch.cuda.memory_snapshot()`).

use serde::{Deserialize, Serialize};

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
