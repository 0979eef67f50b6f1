//! The free path of [`State`]: a dropped handle's block returns to its pool, merged with its
//! free neighbours, or, if other streams used it, waits for their record-stream events.

use std::sync::Arc;

use super::{BState, BlockId, PendingEvent, State};
use crate::history::TraceAction;
use crate::MemorySource;

impl<S: MemorySource> State<S> {
    /// The handle of `id` was dropped.
    pub(super) fn free(&mut self, source: &S, id: BlockId) {
        let b = self.blk_mut(id);
        let (pool, size) = (b.pool, b.size);
        let uses = b.uses.take();
        let (addr, requested, stream) = (b.addr as u64, b.requested as u64, b.stream);
        if let Some(h) = self.history.as_mut() {
            let frames = h.frames(None);
            h.record(TraceAction::FreeRequested, addr, requested, stream, frames);
        }
        self.stats.allocation.decrease(pool, 1);
        self.stats.allocated_bytes.decrease(pool, size as u64);
        if self.is_oversize(size) {
            self.stats.oversize_allocations.decrease(1);
        }
        let Some(uses) = uses else {
            self.free_block(id);
            return;
        };
        let mut count = 0;
        for (key, stream) in uses.iter() {
            count += 1;
            match source.record_event(stream) {
                Ok(event) => {
                    self.events
                        .entry(*key)
                        .or_default()
                        .push_back(PendingEvent {
                            event: Arc::new(event),
                            block: id,
                        });
                    self.outstanding += 1;
                }
                // Without an event the block can never be known to be unused: it stays pending
                // (and is counted as active) for good.
                Err(e) => tracing::error!(
                    "record_stream: could not record an event ({e}); leaking a block of {size} bytes"
                ),
            }
        }
        let b = self.blk_mut(id);
        b.state = BState::Pending;
        b.event_count = count;
    }

    /// Return `id` (allocated or pending) to its pool, merging it with free neighbours.
    pub(super) fn free_block(&mut self, id: BlockId) {
        let b = self.blk_mut(id);
        let (pool, requested, segment) = (b.pool, b.requested as u64, b.segment);
        let (mut addr, mut size, mut prev, mut next) = (b.addr, b.size, b.prev, b.next);
        b.uses = None;
        let stream = b.stream;
        if let Some(h) = self.history.as_mut() {
            let frames = h.block_frames.remove(&id).unwrap_or_default();
            h.record(
                TraceAction::FreeCompleted,
                addr as u64,
                requested,
                stream,
                frames,
            );
        }
        let s = &mut self.stats;
        s.active.decrease(pool, 1);
        s.active_bytes.decrease(pool, size as u64);
        s.requested_bytes.decrease(pool, requested);

        // A free neighbour is in its pool and, having a neighbour, counted as inactive split.
        let (mut net_blocks, mut net_bytes) = (0i64, 0i64);
        if let Some(p) = prev.filter(|&p| self.blk(p).state == BState::Free) {
            let pe = self.remove_block(p);
            self.pools[pool.index()].remove(&Self::key(&pe));
            net_blocks -= 1;
            net_bytes -= pe.size as i64;
            addr = pe.addr;
            size += pe.size;
            prev = pe.prev;
            match prev {
                Some(pp) => self.blk_mut(pp).next = Some(id),
                None => {
                    if let Some(seg) = self.segments[segment].as_mut() {
                        seg.head = id;
                    }
                }
            }
        }
        if let Some(n) = next.filter(|&n| self.blk(n).state == BState::Free) {
            let ne = self.remove_block(n);
            self.pools[pool.index()].remove(&Self::key(&ne));
            net_blocks -= 1;
            net_bytes -= ne.size as i64;
            size += ne.size;
            next = ne.next;
            if let Some(nn) = next {
                self.blk_mut(nn).prev = Some(id);
            }
        }
        let gc_base = self.gc_calls[pool.index()];
        let b = self.blk_mut(id);
        b.state = BState::Free;
        b.requested = 0;
        b.event_count = 0;
        b.gc_base = gc_base;
        b.addr = addr;
        b.size = size;
        b.prev = prev;
        b.next = next;
        let key = Self::key(b);
        self.pools[pool.index()].insert(key, id);
        if prev.is_some() || next.is_some() {
            net_blocks += 1;
            net_bytes += size as i64;
        }
        if !self.seg(segment).is_expandable() {
            self.inactive_split_change(pool, net_blocks, net_bytes);
        }
    }
}
