//! The allocation path of [`State`]: best-fit lookup in the cached blocks, new segments,
//! splitting, and the out-of-memory error.

use super::{BState, BlockEntry, BlockId, Segment, SendPtr, State};
use crate::history::{TraceAction, TraceEntry};
use crate::{AllocError, MemorySource, PoolKind, LARGE_BUFFER, MIN_BLOCK_SIZE, SMALL_SIZE};

impl<S: MemorySource> State<S> {
    /// Best fit among the cached blocks of `stream` in `pool`; removes it from the pool.
    pub(super) fn get_free_block(
        &mut self,
        pool: PoolKind,
        stream: u64,
        size: usize,
    ) -> Option<BlockId> {
        if self.gc_active() {
            self.gc_calls[pool.index()] += 1;
        }
        let (key, id) = self.pools[pool.index()].first_from((stream, size, 0, 0))?;
        let (s, bsize) = (key.0, key.1);
        if s != stream {
            return None;
        }
        if let Some(m) = self.max_split_size {
            // An oversize block does not serve a small request, nor a large one it exceeds by
            // a whole large segment or more (bsize >= size: it was found at or after it).
            if (bsize >= m && size < m) || (size >= m && bsize - size >= LARGE_BUFFER) {
                return None;
            }
        }
        self.pools[pool.index()].remove(&key);
        Some(id)
    }

    fn should_split(&self, pool: PoolKind, block_size: usize, size: usize, exp: bool) -> bool {
        let remaining = block_size - size;
        match pool {
            // PyTorch splits every block of expandable segments at 512-byte granularity.
            _ if exp => remaining >= MIN_BLOCK_SIZE,
            PoolKind::Small => remaining >= MIN_BLOCK_SIZE,
            PoolKind::Large => !self.is_oversize(size) && remaining > SMALL_SIZE,
        }
    }

    /// A new segment of `size` bytes as one free block (not yet in its pool); `Ok(None)` when
    /// the limit or the source refuses it.
    pub(super) fn alloc_segment(
        &mut self,
        source: &S,
        size: usize,
        pool: PoolKind,
        stream: u64,
        is_retry: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        if let Some(limit) = self.limit {
            let reserved = self.stats.reserved_bytes.all.current as usize;
            if reserved.checked_add(size).is_none_or(|r| r > limit) {
                return Ok(None);
            }
        }
        let base = match source.allocate(size) {
            Ok(p) => p,
            Err(AllocError::SourceOutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let (seg_id, serial) = self.new_segment_slot();
        let id = self.add_block(BlockEntry {
            addr: base.as_ptr().addr(),
            serial,
            size,
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
            size,
            stream,
            pool,
            head: id,
            reserved: 0,
        });
        self.stats.segment.increase(pool, 1);
        self.stats.reserved_bytes.increase(pool, size as u64);
        self.stats.num_device_alloc += 1;
        if self.is_oversize(size) {
            self.stats.oversize_segments.increase(1);
        }
        if let Some(h) = self.history.as_mut() {
            let frames = h.frames(None);
            let addr = base.as_ptr().addr() as u64;
            h.record(TraceAction::SegmentAlloc, addr, size as u64, stream, frames);
        }
        Ok(Some(id))
    }

    /// Apply a net change of `blocks` free blocks and `bytes` bytes to the inactive-split
    /// statistics. Like PyTorch, only the net change of one operation is counted, so that the
    /// `allocated`/`freed` totals match its own.
    #[inline]
    pub(super) fn inactive_split_change(&mut self, pool: PoolKind, blocks: i64, bytes: i64) {
        let s = &mut self.stats;
        if blocks > 0 {
            s.inactive_split.increase(pool, blocks as u64);
        } else if blocks < 0 {
            s.inactive_split.decrease(pool, blocks.unsigned_abs());
        }
        if bytes > 0 {
            s.inactive_split_bytes.increase(pool, bytes as u64);
        } else if bytes < 0 {
            s.inactive_split_bytes.decrease(pool, bytes.unsigned_abs());
        }
    }

    /// Hand out free block `id` (already out of its pool) for a request of `requested` bytes,
    /// `rounded` after rounding: split off the remainder if worth it, update the statistics.
    pub(super) fn take_block(&mut self, id: BlockId, rounded: usize, requested: usize) {
        let b = self.blk(id);
        let (pool, size, addr, serial, next) = (b.pool, b.size, b.addr, b.serial, b.next);
        let (segment, stream) = (b.segment, b.stream);
        let already_split = b.prev.is_some() || next.is_some();
        let exp = self.seg(segment).is_expandable();
        let split = self.should_split(pool, size, rounded, exp);
        // The net change of the inactive-split statistics, as PyTorch counts it: an already
        // split free block that is shrunk loses `rounded` bytes, one handed out whole leaves the
        // count; splitting an unsplit block adds its remainder. Expandable segments are left
        // out, as in PyTorch (their free pages can always be given back).
        match (already_split, split) {
            _ if exp => {}
            (true, true) => self.inactive_split_change(pool, 0, -(rounded as i64)),
            (true, false) => self.inactive_split_change(pool, -1, -(size as i64)),
            (false, true) => self.inactive_split_change(pool, 1, (size - rounded) as i64),
            (false, false) => {}
        }
        let gc_base = self.gc_calls[pool.index()];
        let size = if split {
            let rem = BlockEntry {
                addr: addr + rounded,
                serial,
                size: size - rounded,
                requested: 0,
                segment,
                stream,
                pool,
                prev: Some(id),
                next,
                state: BState::Free,
                event_count: 0,
                uses: None,
                gc_base,
            };
            let key = Self::key(&rem);
            let rid = self.add_block(rem);
            if let Some(n) = next {
                self.blk_mut(n).prev = Some(rid);
            }
            let b = self.blk_mut(id);
            b.next = Some(rid);
            b.size = rounded;
            self.pools[pool.index()].insert(key, rid);
            rounded
        } else {
            size
        };
        let b = self.blk_mut(id);
        b.state = BState::Allocated;
        b.requested = requested;
        let oversize = self.is_oversize(size);
        let (size, s) = (size as u64, &mut self.stats);
        s.allocation.increase(pool, 1);
        s.allocated_bytes.increase(pool, size);
        s.active.increase(pool, 1);
        s.active_bytes.increase(pool, size);
        s.requested_bytes.increase(pool, requested as u64);
        if oversize {
            s.oversize_allocations.increase(1);
        }
    }

    /// Count an out-of-memory failure, record it in the history, and build its error.
    pub(super) fn oom(
        &mut self,
        source: &S,
        requested: usize,
        allocation_size: usize,
        stream: u64,
    ) -> AllocError {
        self.stats.num_ooms += 1;
        let err = self.oom_error(source, requested, allocation_size);
        if let (Some(h), AllocError::OutOfMemory { device_free, .. }) =
            (self.history.as_mut(), &err)
        {
            let frames = h.frames(None);
            h.push(TraceEntry {
                action: TraceAction::Oom,
                addr: *device_free as u64,
                size: allocation_size as u64,
                stream,
                time_us: h.now_us(),
                frames,
                device_free: Some(*device_free as u64),
            });
        }
        err
    }

    fn oom_error(&self, source: &S, requested: usize, allocation_size: usize) -> AllocError {
        AllocError::OutOfMemory {
            device: source.device(),
            requested,
            allocation_size,
            allocated: self.stats.allocated_bytes.all.current as usize,
            reserved: self.stats.reserved_bytes.all.current as usize,
            device_total: source.total_memory(),
            device_free: source.free_memory(),
            limit: self.limit,
        }
    }
}
