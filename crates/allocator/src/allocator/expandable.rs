//! Expandable segments (PyTorch's `expandable_segments:True`): one reserved address range per
//! stream and pool whose pages are mapped as the pool grows, so that a growing request extends
//! the free block at the segment's end instead of leaving cached segments behind.
//!
//! The mapped part is always a prefix of the range: new pages go at its end, and only free
//! pages at its end are unmapped (by `empty_cache` and the out-of-memory retry). PyTorch can
//! also unmap free pages in the middle of a segment, and its best fit counts the unmapped
//! space after a free tail as part of that block; neither is done here.

use std::ptr::NonNull;

use super::{BState, BlockEntry, BlockId, Segment, SendPtr, State};
use crate::history::TraceAction;
use crate::{AllocError, MemorySource, PoolKind, LARGE_BUFFER, SMALL_BUFFER};

/// The mapping granularity of a pool's expandable segments (PyTorch's `segment_size_`).
/// The largest address range an expandable segment reserves (256 TiB): a source of
/// unbounded capacity (a meta source of `usize::MAX` bytes, as the FSDP planner's dry runs
/// use) would otherwise ask for more address space than there is.
pub(super) const MAX_EXPANDABLE_RANGE: usize = if usize::BITS >= 64 {
    1 << 48
} else {
    usize::MAX
};

pub(super) fn page_size(pool: PoolKind) -> usize {
    match pool {
        PoolKind::Small => SMALL_BUFFER,
        PoolKind::Large => LARGE_BUFFER,
    }
}

impl<S: MemorySource> State<S> {
    /// A free block of at least `rounded` bytes (out of its pool) for a request that no cached
    /// block serves: from a new segment, or with expandable segments by mapping pages at the
    /// end of the stream's segment. `Ok(None)` when the limit or the source refuses.
    pub(super) fn new_block(
        &mut self,
        source: &S,
        rounded: usize,
        seg_size: usize,
        pool: PoolKind,
        stream: u64,
        is_retry: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        if self.expandable {
            self.grow_expandable(source, rounded, pool, stream, is_retry)
        } else {
            self.alloc_segment(source, seg_size, pool, stream, is_retry)
        }
    }

    /// The last block of segment `seg`.
    fn tail(&self, seg: usize) -> BlockId {
        let mut id = self.seg(seg).head;
        while let Some(n) = self.blk(id).next {
            id = n;
        }
        id
    }

    fn grow_expandable(
        &mut self,
        source: &S,
        rounded: usize,
        pool: PoolKind,
        stream: u64,
        is_retry: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        let unit = page_size(pool);
        let existing = self.expandable_segs.get(&(stream, pool.index())).copied();
        let free_tail = existing
            .map(|seg| self.tail(seg))
            .filter(|&t| self.blk(t).state == BState::Free);
        let have = free_tail.map_or(0, |t| self.blk(t).size);
        let Some(grow) = rounded.saturating_sub(have).checked_next_multiple_of(unit) else {
            return Ok(None);
        };
        if grow == 0 {
            // The free tail is large enough (a rule of max_split_size passed it over).
            return Ok(free_tail.inspect(|&t| self.remove_free(t)));
        }
        if let Some(limit) = self.limit {
            let reserved = self.stats.reserved_bytes.all.current as usize;
            if reserved.checked_add(grow).is_none_or(|r| r > limit) {
                return Ok(None);
            }
        }
        let seg = match existing {
            Some(seg) => seg,
            None => match self.reserve_expandable(source, pool, stream, grow)? {
                Some(seg) => seg,
                None => return Ok(None),
            },
        };
        let (base, mapped, reserved) = {
            let s = self.seg(seg);
            (s.base, s.size, s.reserved)
        };
        if mapped + grow > reserved {
            return Ok(None);
        }
        let base_ptr = NonNull::new(base.0).expect("segments are non-null");
        // SAFETY: the range came from `reserve_address_range(reserved)`; [mapped, mapped +
        // grow) lies inside it (checked above) and is not mapped (the mapped part is the
        // prefix [0, mapped)).
        match unsafe { source.map_range(base_ptr, mapped, grow) } {
            Ok(()) => {}
            Err(AllocError::SourceOutOfMemory { .. }) => {
                if mapped == 0 {
                    self.release_expandable(source, seg);
                }
                return Ok(None);
            }
            Err(e) => {
                if mapped == 0 {
                    self.release_expandable(source, seg);
                }
                return Err(e);
            }
        }
        if let Some(s) = self.segments[seg].as_mut() {
            s.size += grow;
        }
        self.stats.reserved_bytes.increase(pool, grow as u64);
        self.stats.num_device_alloc += 1;
        if let Some(h) = self.history.as_mut() {
            let frames = h.frames(None);
            let addr = (base.0.addr() + mapped) as u64;
            h.record(TraceAction::SegmentMap, addr, grow as u64, stream, frames);
        }
        let id = if mapped == 0 {
            let head = self.seg(seg).head;
            self.blk_mut(head).size = grow;
            head
        } else if let Some(t) = free_tail {
            self.remove_free(t);
            self.blk_mut(t).size += grow;
            t
        } else {
            let last = self.tail(seg);
            let serial = self.blk(last).serial;
            let id = self.add_block(BlockEntry {
                addr: base.0.addr() + mapped,
                serial,
                size: grow,
                requested: 0,
                segment: seg,
                stream,
                pool,
                prev: Some(last),
                next: None,
                state: BState::Free,
                event_count: 0,
                uses: None,
                gc_base: 0,
            });
            self.blk_mut(last).next = Some(id);
            id
        };
        Ok(Some(id))
    }

    /// Reserve the address range of a new expandable segment (the source's total memory, at
    /// most [`MAX_EXPANDABLE_RANGE`], rounded up to the page size), with one empty free block
    /// to grow. `Ok(None)` if the source refuses.
    fn reserve_expandable(
        &mut self,
        source: &S,
        pool: PoolKind,
        stream: u64,
        at_least: usize,
    ) -> Result<Option<usize>, AllocError> {
        let unit = page_size(pool);
        let Some(size) = source
            .total_memory()
            .min(MAX_EXPANDABLE_RANGE)
            .max(at_least)
            .checked_next_multiple_of(unit)
        else {
            return Ok(None);
        };
        let base = match source.reserve_address_range(size) {
            Ok(p) => p,
            Err(AllocError::SourceOutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let (seg_id, serial) = self.new_segment_slot();
        let head = self.add_block(BlockEntry {
            addr: base.as_ptr().addr(),
            serial,
            size: 0,
            requested: 0,
            segment: seg_id,
            stream,
            pool,
            prev: None,
            next: None,
            state: BState::Free,
            event_count: 0,
            uses: None,
            gc_base: 0,
        });
        self.segments[seg_id] = Some(Segment {
            base: SendPtr(base.as_ptr()),
            size: 0,
            stream,
            pool,
            head,
            reserved: size,
        });
        self.expandable_segs.insert((stream, pool.index()), seg_id);
        Ok(Some(seg_id))
    }

    /// Give the whole (unmapped) range of expandable segment `seg` back, with its one block.
    fn release_expandable(&mut self, source: &S, seg: usize) {
        let Some(s) = self.segments[seg].take() else {
            return;
        };
        debug_assert_eq!(s.size, 0, "only an unmapped segment is released");
        self.remove_block(s.head);
        self.free_segment_ids.push(seg);
        self.expandable_segs.remove(&(s.stream, s.pool.index()));
        // SAFETY: the range came from `reserve_address_range(s.reserved)`, nothing of it is
        // mapped any more, and it is released once (its slot was just emptied).
        unsafe {
            source.release_address_range(
                NonNull::new(s.base.0).expect("segments are non-null"),
                s.reserved,
            )
        };
    }

    /// Unmap the free pages at the end of every expandable segment; a segment left with
    /// nothing mapped gives its range back.
    pub(super) fn unmap_free_tails(&mut self, source: &S) {
        let segs: Vec<usize> = self.expandable_segs.values().copied().collect();
        for seg in segs {
            self.unmap_tail(source, seg);
        }
    }

    /// Unmap the whole pages of the free block at the end of expandable segment `seg`.
    pub(super) fn unmap_tail(&mut self, source: &S, seg: usize) {
        let t = self.tail(seg);
        let b = self.blk(t);
        if b.state != BState::Free {
            return;
        }
        let (base, mapped, pool, stream) = {
            let s = self.seg(seg);
            (s.base, s.size, s.pool, s.stream)
        };
        let start = (b.addr - base.0.addr()).next_multiple_of(page_size(pool));
        if start >= mapped {
            return;
        }
        let bytes = mapped - start;
        // SAFETY: [start, mapped) are whole pages of the mapped prefix, inside a free block
        // (no handle holds them, every record-stream event of them has completed).
        unsafe {
            source.unmap_range(
                NonNull::new(base.0).expect("segments are non-null"),
                start,
                bytes,
            )
        };
        self.stats.reserved_bytes.decrease(pool, bytes as u64);
        self.stats.num_device_free += 1;
        if let Some(h) = self.history.as_mut() {
            let frames = h.frames(None);
            let addr = (base.0.addr() + start) as u64;
            h.record(
                TraceAction::SegmentUnmap,
                addr,
                bytes as u64,
                stream,
                frames,
            );
        }
        if let Some(s) = self.segments[seg].as_mut() {
            s.size = start;
        }
        let (remaining, prev) = (self.blk(t).size - bytes, self.blk(t).prev);
        if remaining > 0 || prev.is_none() {
            // A shorter free tail (or the empty head of an unmapped segment).
            self.remove_free(t);
            self.blk_mut(t).size = remaining;
            if remaining > 0 {
                let key = Self::key(self.blk(t));
                self.pools[pool.index()].insert(key, t);
            }
        } else {
            self.remove_free(t);
            self.remove_block(t);
            if let Some(p) = prev {
                self.blk_mut(p).next = None;
            }
        }
        if start == 0 {
            self.release_expandable(source, seg);
        }
    }
}
