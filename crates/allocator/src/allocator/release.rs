//! Giving cached segments back to the memory source (`empty_cache`, the out-of-memory retry,
//! `max_split_size`).

use super::{BlockId, State};
use crate::history::TraceAction;
use crate::{MemorySource, PoolKind};

impl<S: MemorySource> State<S> {
    /// Give the segment of the unsplit free block `id` back to the source.
    pub(super) fn release_block(&mut self, source: &S, id: BlockId) {
        let seg = self.blk(id).segment;
        if self.seg(seg).is_expandable() {
            self.unmap_tail(source, seg);
            return;
        }
        self.remove_free(id);
        let b = self.remove_block(id);
        let Some(seg) = self.segments[b.segment].take() else {
            return;
        };
        self.free_segment_ids.push(b.segment);
        // SAFETY: the segment came from `source.allocate(seg.size)` and is released once (its
        // slot was just emptied). Its one block is free: no handle holds it and every
        // record-stream event of it has completed.
        unsafe {
            source.free(
                std::ptr::NonNull::new(seg.base.0).expect("segments are non-null"),
                seg.size,
            )
        };
        self.stats.segment.decrease(seg.pool, 1);
        self.stats
            .reserved_bytes
            .decrease(seg.pool, seg.size as u64);
        self.stats.num_device_free += 1;
        if self.is_oversize(seg.size) {
            self.stats.oversize_segments.decrease(1);
        }
        if let Some(h) = self.history.as_mut() {
            let frames = h.frames(None);
            let addr = seg.base.0.addr() as u64;
            h.record(
                TraceAction::SegmentFree,
                addr,
                seg.size as u64,
                seg.stream,
                frames,
            );
        }
    }

    /// Free every cached block that is a whole segment, in both pools and all streams, and the
    /// free pages at the end of every expandable segment.
    pub(super) fn release_cached_blocks(&mut self, source: &S) {
        self.unmap_free_tails(source);
        let ids: Vec<BlockId> = self
            .pools
            .iter()
            .flat_map(|p| p.ids())
            .filter(|&id| self.is_unsplit(id))
            .collect();
        for id in ids {
            self.release_block(source, id);
        }
        let owners: std::collections::BTreeSet<u64> = self
            .segments
            .iter()
            .flatten()
            .map(|seg| seg.stream)
            .chain(self.events.keys().copied())
            .collect();
        source.retain_streams(&|key| owners.contains(&key));
    }

    /// With `max_split_size` set: free oversize cached blocks of `stream` (one large enough,
    /// else the largest ones) so that a request of `size` bytes may fit.
    pub(super) fn release_available_cached_blocks(
        &mut self,
        source: &S,
        pool: PoolKind,
        stream: u64,
        size: usize,
    ) -> bool {
        let Some(m) = self.max_split_size else {
            return false;
        };
        let key_size = size.max(m);
        let list = &self.pools[pool.index()];
        let single = list
            .range(
                (stream, key_size, 0, 0),
                (stream, usize::MAX, u64::MAX, usize::MAX),
            )
            .into_iter()
            .map(|(_, id)| id)
            .find(|&id| self.is_unsplit(id));
        if let Some(id) = single {
            self.release_block(source, id);
            return true;
        }
        let largest_first: Vec<(usize, BlockId)> = list
            .range((stream, m, 0, 0), (stream, key_size, 0, 0))
            .into_iter()
            .rev()
            .filter(|&(_, id)| self.is_unsplit(id))
            .map(|(k, id)| (k.1, id))
            .collect();
        let mut released = 0;
        for (bsize, id) in largest_first {
            if released >= size {
                break;
            }
            self.release_block(source, id);
            released += bsize;
        }
        released >= size
    }
}
