//! The [`Snapshot`] of [`State`]: every segment and block, and the recorded history.

use super::{BState, Segment, State};
use crate::history::History;
use crate::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot, Snapshot};
use crate::MemorySource;
use fsdp_device::Device;

impl<S: MemorySource> State<S> {
    pub(super) fn snapshot(&self, device: Device) -> Snapshot {
        let mut segs: Vec<&Segment> = self.segments.iter().flatten().collect();
        segs.sort_by_key(|s| s.base.0.addr());
        let segments = segs
            .into_iter()
            .map(|seg| {
                let mut blocks = Vec::new();
                let mut cur = Some(seg.head);
                while let Some(id) = cur {
                    let b = self.blk(id);
                    let frames = match (&self.history, b.state) {
                        (Some(h), BState::Allocated | BState::Pending) => {
                            h.block_frames.get(&id).cloned().unwrap_or_default()
                        }
                        _ => Vec::new(),
                    };
                    blocks.push(BlockSnapshot {
                        address: b.addr as u64,
                        size: b.size as u64,
                        requested_size: b.requested as u64,
                        state: match b.state {
                            BState::Allocated => BlockState::ActiveAllocated,
                            BState::Pending => BlockState::ActivePendingFree,
                            BState::Free => BlockState::Inactive,
                        },
                        frames,
                    });
                    cur = b.next;
                }
                let sum = |f: &dyn Fn(&BlockSnapshot) -> bool,
                           v: &dyn Fn(&BlockSnapshot) -> u64| {
                    blocks.iter().filter(|b| f(b)).map(v).sum::<u64>()
                };
                let active = |b: &BlockSnapshot| b.state != BlockState::Inactive;
                SegmentSnapshot {
                    address: seg.base.0.addr() as u64,
                    total_size: seg.size as u64,
                    allocated_size: sum(&|b| b.state == BlockState::ActiveAllocated, &|b| b.size),
                    active_size: sum(&active, &|b| b.size),
                    requested_size: sum(&active, &|b| b.requested_size),
                    stream: seg.stream,
                    segment_type: seg.pool,
                    is_expandable: seg.is_expandable(),
                    blocks,
                }
            })
            .collect();
        Snapshot {
            device: device.to_string(),
            segments,
            device_traces: self
                .history
                .as_ref()
                .map(History::entries)
                .unwrap_or_default(),
        }
    }
}
