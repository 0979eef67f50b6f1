//! The caching allocator and its block handles.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use fsdp_device::{Buffer, DType, Device, Storage};

mod expandable;
mod gc;

use crate::config::resolve_limit;
use crate::history::{History, HistoryConfig, TraceAction, TraceEntry};
use crate::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot, Snapshot};
use crate::{
    allocation_size, AllocError, AllocatorConfig, MemoryLimit, MemorySource, MemoryStats, PoolKind,
    LARGE_BUFFER, MIN_BLOCK_SIZE, SMALL_SIZE,
};

/// An address that may cross threads: the allocator only computes with it, and a block's bytes
/// belong to the one handle that holds them.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);

// SAFETY: a SendPtr is an address, never dereferenced by the allocator; access to the memory is
// governed by the Block handle that owns it.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

type BlockId = usize;
/// Free-pool order: stream, then size, then position — the segment's serial number (its
/// allocation order), then the address inside it. PyTorch breaks ties between equal sizes by
/// address alone; here the segment's age comes first, so that no decision depends on where the
/// source placed its segments: the same calls make the same splits, merges and statistics on
/// every source (host, CUDA, meta) and in every run.
type FreeKey = (u64, usize, u64, usize);

/// The cached free blocks of one pool in [`FreeKey`] order: a sorted vector while short (the
/// common case: a binary search and a short move, no node allocations), a B-tree once long.
#[derive(Default)]
struct FreeList {
    vec: Vec<(FreeKey, BlockId)>,
    tree: Option<BTreeMap<FreeKey, BlockId>>,
}

impl FreeList {
    /// Above this many entries the vector becomes a tree...
    const TO_TREE: usize = 256;
    /// ...and below this many the tree becomes a vector again.
    const TO_VEC: usize = 64;

    #[inline]
    fn insert(&mut self, key: FreeKey, id: BlockId) {
        match &mut self.tree {
            Some(t) => {
                t.insert(key, id);
            }
            None => {
                let i = self.vec.partition_point(|(k, _)| *k < key);
                self.vec.insert(i, (key, id));
                if self.vec.len() > Self::TO_TREE {
                    self.tree = Some(self.vec.drain(..).collect());
                }
            }
        }
    }

    #[inline]
    fn remove(&mut self, key: &FreeKey) {
        match &mut self.tree {
            Some(t) => {
                t.remove(key);
                if t.len() < Self::TO_VEC {
                    self.vec.extend(t.iter().map(|(k, v)| (*k, *v)));
                    self.tree = None;
                }
            }
            None => {
                if let Ok(i) = self.vec.binary_search_by(|(k, _)| k.cmp(key)) {
                    self.vec.remove(i);
                }
            }
        }
    }

    /// The first entry at or after `key`.
    #[inline]
    fn first_from(&self, key: FreeKey) -> Option<(FreeKey, BlockId)> {
        match &self.tree {
            Some(t) => t.range(key..).next().map(|(k, v)| (*k, *v)),
            None => {
                let i = self.vec.partition_point(|(k, _)| *k < key);
                self.vec.get(i).copied()
            }
        }
    }

    /// The entries in `lo..hi`, in order.
    fn range(&self, lo: FreeKey, hi: FreeKey) -> Vec<(FreeKey, BlockId)> {
        match &self.tree {
            Some(t) => t.range(lo..hi).map(|(k, v)| (*k, *v)).collect(),
            None => {
                let a = self.vec.partition_point(|(k, _)| *k < lo);
                let b = self.vec.partition_point(|(k, _)| *k < hi);
                self.vec[a..b.max(a)].to_vec()
            }
        }
    }

    fn ids(&self) -> Vec<BlockId> {
        match &self.tree {
            Some(t) => t.values().copied().collect(),
            None => self.vec.iter().map(|(_, id)| *id).collect(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BState {
    Free,
    Allocated,
    Pending,
}

struct BlockEntry<St> {
    addr: usize,
    /// The serial number of its segment (see [`FreeKey`]).
    serial: u64,
    size: usize,
    requested: usize,
    segment: usize,
    stream: u64,
    pool: PoolKind,
    prev: Option<BlockId>,
    next: Option<BlockId>,
    state: BState,
    /// Record-stream events still to complete (pending state).
    event_count: usize,
    /// Streams other than the allocation stream that used the block (rare: boxed to keep
    /// entries small).
    uses: Option<Box<[(u64, St)]>>,
    /// The pool's cache-lookup count when the block was last cached (garbage collection's
    /// age, PyTorch's `gc_count_base`).
    gc_base: u64,
}

struct Segment {
    base: SendPtr,
    size: usize,
    stream: u64,
    pool: PoolKind,
    /// The block at the segment's start.
    head: BlockId,
    /// For an expandable segment, the size of its reserved address range (`size` is the mapped
    /// part, at its start); 0 for an ordinary segment.
    reserved: usize,
}

impl Segment {
    fn is_expandable(&self) -> bool {
        self.reserved > 0
    }
}

struct PendingEvent<E> {
    event: Arc<E>,
    block: BlockId,
}

struct State<S: MemorySource> {
    blocks: Vec<Option<BlockEntry<S::Stream>>>,
    free_ids: Vec<BlockId>,
    segments: Vec<Option<Segment>>,
    free_segment_ids: Vec<usize>,
    /// Cached free blocks of the small and large pools.
    pools: [FreeList; 2],
    /// Record-stream events per used stream, in record order. Ordered by stream key (not a hash
    /// map), so that completed events free their blocks in the same order in every run: the
    /// order changes the merges in between and so the peaks of the statistics.
    events: BTreeMap<u64, VecDeque<PendingEvent<S::Event>>>,
    outstanding: usize,
    /// Serial number of the next segment.
    next_serial: u64,
    stats: MemoryStats,
    limit: Option<usize>,
    max_split_size: Option<usize>,
    /// The memory history, while recording.
    history: Option<History>,
    /// `garbage_collection_threshold`, if set.
    gc_threshold: Option<f64>,
    /// Cache lookups per pool while garbage collection is active (PyTorch's
    /// `get_free_blocks_call_count`).
    gc_calls: [u64; 2],
    /// Whether new memory comes from expandable segments.
    expandable: bool,
    /// The expandable segment of each (stream, pool index).
    expandable_segs: BTreeMap<(u64, usize), usize>,
}

impl<S: MemorySource> State<S> {
    fn new(
        limit: Option<usize>,
        max_split_size: Option<usize>,
        gc_threshold: Option<f64>,
        expandable: bool,
    ) -> Self {
        State {
            blocks: Vec::new(),
            free_ids: Vec::new(),
            segments: Vec::new(),
            free_segment_ids: Vec::new(),
            pools: [FreeList::default(), FreeList::default()],
            events: BTreeMap::new(),
            outstanding: 0,
            next_serial: 0,
            stats: MemoryStats {
                max_split_size: max_split_size.map_or(-1, |m| i64::try_from(m).unwrap_or(i64::MAX)),
                ..MemoryStats::default()
            },
            limit,
            max_split_size,
            history: None,
            gc_threshold,
            gc_calls: [0; 2],
            expandable,
            expandable_segs: BTreeMap::new(),
        }
    }

    #[inline]
    fn blk(&self, id: BlockId) -> &BlockEntry<S::Stream> {
        self.blocks[id]
            .as_ref()
            .expect("block ids in use refer to live entries")
    }

    #[inline]
    fn blk_mut(&mut self, id: BlockId) -> &mut BlockEntry<S::Stream> {
        self.blocks[id]
            .as_mut()
            .expect("block ids in use refer to live entries")
    }

    fn seg(&self, id: usize) -> &Segment {
        self.segments[id]
            .as_ref()
            .expect("segment ids in use refer to live segments")
    }

    #[inline]
    /// A slot for a new segment (a freed one reused, else a new one) and the serial number of
    /// its first block.
    fn new_segment_slot(&mut self) -> (usize, u64) {
        let seg_id = match self.free_segment_ids.pop() {
            Some(i) => i,
            None => {
                self.segments.push(None);
                self.segments.len() - 1
            }
        };
        let serial = self.next_serial;
        self.next_serial += 1;
        (seg_id, serial)
    }

    fn add_block(&mut self, e: BlockEntry<S::Stream>) -> BlockId {
        match self.free_ids.pop() {
            Some(id) => {
                self.blocks[id] = Some(e);
                id
            }
            None => {
                self.blocks.push(Some(e));
                self.blocks.len() - 1
            }
        }
    }

    #[inline]
    fn remove_block(&mut self, id: BlockId) -> BlockEntry<S::Stream> {
        let e = self.blocks[id].take().expect("removed block is live");
        self.free_ids.push(id);
        e
    }

    #[inline]
    fn key(b: &BlockEntry<S::Stream>) -> FreeKey {
        (b.stream, b.size, b.serial, b.addr)
    }

    fn remove_free(&mut self, id: BlockId) {
        let b = self.blk(id);
        let (pool, key) = (b.pool.index(), Self::key(b));
        self.pools[pool].remove(&key);
    }

    #[inline]
    fn is_oversize(&self, size: usize) -> bool {
        self.max_split_size.is_some_and(|m| size >= m)
    }

    fn is_unsplit(&self, id: BlockId) -> bool {
        let b = self.blk(id);
        b.prev.is_none() && b.next.is_none()
    }

    /// Best fit among the cached blocks of `stream` in `pool`; removes it from the pool.
    fn get_free_block(&mut self, pool: PoolKind, stream: u64, size: usize) -> Option<BlockId> {
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
    fn alloc_segment(
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
    fn inactive_split_change(&mut self, pool: PoolKind, blocks: i64, bytes: i64) {
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
    fn take_block(&mut self, id: BlockId, rounded: usize, requested: usize) {
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

    /// The handle of `id` was dropped.
    fn free(&mut self, source: &S, id: BlockId) {
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
    fn free_block(&mut self, id: BlockId) {
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

    /// Return the blocks whose record-stream events have all completed to their pools.
    fn process_events(&mut self, source: &S) -> Result<(), AllocError> {
        if self.outstanding == 0 {
            return Ok(());
        }
        let mut done = Vec::new();
        let mut error = None;
        for queue in self.events.values_mut() {
            // Events of one stream complete in record order.
            while let Some(front) = queue.front() {
                match source.query_event(&front.event) {
                    Ok(true) => {
                        done.push(front.block);
                        queue.pop_front();
                    }
                    Ok(false) => break,
                    Err(e) => {
                        error = Some(e);
                        break;
                    }
                }
            }
        }
        self.events.retain(|_, q| !q.is_empty());
        self.outstanding -= done.len();
        for id in done {
            let b = self.blk_mut(id);
            b.event_count -= 1;
            if b.event_count == 0 {
                self.free_block(id);
            }
        }
        error.map_or(Ok(()), Err)
    }

    fn pending_events(&self) -> Vec<Arc<S::Event>> {
        self.events
            .values()
            .flat_map(|q| q.iter().map(|p| p.event.clone()))
            .collect()
    }

    /// Give the segment of the unsplit free block `id` back to the source.
    fn release_block(&mut self, source: &S, id: BlockId) {
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
    fn release_cached_blocks(&mut self, source: &S) {
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
    fn release_available_cached_blocks(
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

    /// Count an out-of-memory failure, record it in the history, and build its error.
    fn oom(
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

    fn snapshot(&self, device: Device) -> Snapshot {
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

struct Shared<S: MemorySource> {
    source: S,
    config: AllocatorConfig,
    state: Mutex<State<S>>,
}

impl<S: MemorySource> Shared<S> {
    fn lock(&self) -> MutexGuard<'_, State<S>> {
        // A panic while the lock was held leaves the bookkeeping as it was at that point; the
        // allocator keeps going rather than turning every later drop into a panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wait (without the lock) for `events`, within the configured timeout in all.
    fn wait_events(&self, events: &[Arc<S::Event>]) -> Result<(), AllocError> {
        let deadline = Instant::now() + self.config.sync_timeout;
        for ev in events {
            let left = deadline.saturating_duration_since(Instant::now());
            self.source.synchronize_event(ev, left)?;
        }
        Ok(())
    }

    /// Wait for every pending record-stream event and return those blocks to their pools
    /// (PyTorch's `synchronize_and_free_events`). Takes and returns the lock.
    fn synchronize_and_free_events<'a>(
        &'a self,
        st: MutexGuard<'a, State<S>>,
    ) -> Result<MutexGuard<'a, State<S>>, AllocError> {
        let pending = st.pending_events();
        drop(st);
        // Stream work may itself free blocks (drop handles), so the wait must not hold the lock.
        let waited = self.wait_events(&pending);
        drop(pending);
        let mut st = self.lock();
        waited?;
        st.stats.num_sync_all_streams += 1;
        st.process_events(&self.source)?;
        Ok(st)
    }
}

impl<S: MemorySource> Drop for Shared<S> {
    fn drop(&mut self) {
        // No handle is left (each holds an Arc to this), but blocks freed with record_stream may
        // still be in use by their streams: wait for them before returning memory.
        let Shared {
            source,
            config,
            state,
        } = self;
        let st = state.get_mut().unwrap_or_else(PoisonError::into_inner);
        let deadline = Instant::now() + config.sync_timeout;
        for ev in st.pending_events() {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Err(e) = source.synchronize_event(&ev, left) {
                tracing::warn!("allocator dropped while record-stream events pend: {e}");
                break;
            }
        }
        if let Err(e) = st.process_events(source) {
            tracing::warn!("allocator drop: {e}");
        }
        st.release_cached_blocks(source);
        if st.history.take().is_some() {
            crate::history::recording_stopped();
        }
        let left = st.segments.iter().flatten().count();
        if left > 0 {
            tracing::warn!("allocator dropped: leaking {left} segments still used by streams");
        }
    }
}

/// A per-stream caching allocator over a [`MemorySource`], modelled on PyTorch's CUDA caching
/// allocator. Cloning gives another handle to the same allocator (one per device, shared by
/// every thread).
///
/// See the [crate documentation](crate) for the rules it follows.
pub struct CachingAllocator<S: MemorySource> {
    shared: Arc<Shared<S>>,
}

impl<S: MemorySource> Clone for CachingAllocator<S> {
    fn clone(&self) -> Self {
        CachingAllocator {
            shared: self.shared.clone(),
        }
    }
}

impl<S: MemorySource> fmt::Debug for CachingAllocator<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("device", &self.shared.source.device())
            .field("config", &self.shared.config)
            .field("memory_limit", &self.memory_limit())
            .finish()
    }
}

impl<S: MemorySource> CachingAllocator<S> {
    /// An allocator over `source`. Fails if the configuration is out of range.
    pub fn new(source: S, config: AllocatorConfig) -> Result<Self, AllocError> {
        config.validate()?;
        let limit = resolve_limit(config.memory_limit, source.total_memory())?;
        let expandable = config.expandable_segments && source.supports_expandable_segments();
        let state = State::new(
            limit,
            config.max_split_size,
            config.garbage_collection_threshold,
            expandable,
        );
        Ok(CachingAllocator {
            shared: Arc::new(Shared {
                source,
                config,
                state: Mutex::new(state),
            }),
        })
    }

    /// The memory source.
    pub fn source(&self) -> &S {
        &self.shared.source
    }

    /// The options given at creation (the memory limit may have changed since: see
    /// [`memory_limit`](CachingAllocator::memory_limit)).
    pub fn config(&self) -> &AllocatorConfig {
        &self.shared.config
    }

    /// The device the memory lives on.
    pub fn device(&self) -> Device {
        self.shared.source.device()
    }

    /// The current memory limit in bytes, if any.
    pub fn memory_limit(&self) -> Option<usize> {
        self.shared.lock().limit
    }

    /// Change the memory limit (PyTorch's `set_per_process_memory_fraction`). It applies to
    /// later segment allocations; memory already reserved stays.
    pub fn set_memory_limit(&self, limit: Option<MemoryLimit>) -> Result<(), AllocError> {
        let limit = resolve_limit(limit, self.shared.source.total_memory())?;
        self.shared.lock().limit = limit;
        Ok(())
    }

    /// Allocate at least `size` bytes for use on `stream`.
    ///
    /// Served, in order: from the best-fitting cached block of `stream`'s pool; from a new
    /// segment; (with `max_split_size`) from a new segment after freeing oversize cached blocks;
    /// from a new segment after waiting for pending record-stream events and freeing every
    /// cached whole segment (counted in `num_alloc_retries`). Otherwise it fails with
    /// [`AllocError::OutOfMemory`] (counted in `num_ooms`).
    #[track_caller]
    pub fn allocate(&self, size: usize, stream: &S::Stream) -> Result<Block<S>, AllocError> {
        let location = std::panic::Location::caller();
        let sh = &*self.shared;
        sh.source.validate_stream(stream)?;
        let key = S::stream_key(stream);
        let sizes = sh
            .config
            .round_size(size)
            .and_then(|r| Some((r, allocation_size(r)?)));
        let mut st = sh.lock();
        let Some((rounded, seg_size)) = sizes else {
            // Larger than any address space: no amount of freeing helps.
            return Err(st.oom(&sh.source, size, size, key));
        };
        let pool = PoolKind::for_size(rounded);
        if st.outstanding > 0 {
            st.process_events(&sh.source)?;
        }
        let id = match st.get_free_block(pool, key, rounded) {
            Some(id) => id,
            None => {
                if st.gc_active() {
                    st.garbage_collect(&sh.source);
                }
                let mut got = st.new_block(&sh.source, rounded, seg_size, pool, key, false)?;
                if got.is_none()
                    && st.release_available_cached_blocks(&sh.source, pool, key, rounded)
                {
                    got = st.new_block(&sh.source, rounded, seg_size, pool, key, false)?;
                }
                match got {
                    Some(id) => id,
                    None => {
                        st = sh.synchronize_and_free_events(st)?;
                        st.release_cached_blocks(&sh.source);
                        match st.new_block(&sh.source, rounded, seg_size, pool, key, true)? {
                            Some(id) => id,
                            None => return Err(st.oom(&sh.source, size, seg_size, key)),
                        }
                    }
                }
            }
        };
        st.take_block(id, rounded, size);
        let addr = st.blk(id).addr as u64;
        if let Some(h) = st.history.as_mut() {
            let frames = h.frames(Some(location));
            h.block_frames.insert(id, frames.clone());
            h.record(TraceAction::Alloc, addr, size as u64, key, frames);
        }
        let b = st.blk(id);
        let seg = st.seg(b.segment);
        let ptr = seg.base.0.wrapping_add(b.addr - seg.base.0.addr());
        let block = Block {
            shared: self.shared.clone(),
            id,
            ptr: SendPtr(ptr),
            size: b.size,
            requested: size,
            stream: key,
            pool,
        };
        drop(st);
        Ok(block)
    }

    /// Allocate a [`Buffer`] of `len` elements of `dtype` on `stream`; the buffer owns the
    /// block and returns it to the allocator when its last clone drops.
    #[track_caller]
    pub fn allocate_buffer(
        &self,
        dtype: DType,
        len: usize,
        stream: &S::Stream,
    ) -> Result<Buffer, AllocError> {
        let bytes = len.checked_mul(dtype.size_in_bytes()).ok_or_else(|| {
            AllocError::InvalidArgument(format!("{len} elements of {dtype} overflow usize"))
        })?;
        self.allocate(bytes, stream)?.into_buffer(dtype)
    }

    /// Return to their pools the freed blocks whose record-stream events have completed (done
    /// at every allocation anyway).
    pub fn process_events(&self) -> Result<(), AllocError> {
        self.shared.lock().process_events(&self.shared.source)
    }

    /// Wait for pending record-stream events (up to the configured timeout), then give every
    /// cached whole segment back to the source (PyTorch's `empty_cache`).
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let sh = &*self.shared;
        let mut st = sh.synchronize_and_free_events(sh.lock())?;
        st.release_cached_blocks(&sh.source);
        Ok(())
    }

    /// Like [`empty_cache`](Self::empty_cache) without waiting: return to their pools the
    /// freed blocks whose record-stream events have already completed (queried, never waited
    /// for), then give every cached unsplit block back to the source. Blocks whose events
    /// pend stay pending. For use while collectives may be in flight on other streams, where a
    /// wait could stall behind a peer.
    pub fn release_completed(&self) -> Result<(), AllocError> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        let processed = st.process_events(&sh.source);
        st.release_cached_blocks(&sh.source);
        processed
    }

    /// The statistics.
    pub fn memory_stats(&self) -> MemoryStats {
        self.shared.lock().stats.clone()
    }

    /// Set every peak to the current value.
    pub fn reset_peak_stats(&self) {
        self.shared.lock().stats.reset_peak();
    }

    /// Zero the totals allocated/freed and the counters (`num_alloc_retries`, `num_ooms`, ...).
    pub fn reset_accumulated_stats(&self) {
        self.shared.lock().stats.reset_accumulated();
    }

    /// Start (`Some`) or stop (`None`) recording the memory history (PyTorch's
    /// `torch.cuda.memory._record_memory_history`): every alloc, free and segment event, with
    /// a timestamp, the stream and a short call stack (see [`memory_context`](crate::memory_context)),
    /// shown by [`snapshot`](CachingAllocator::snapshot) as `device_traces`. Starting again
    /// keeps the events so far under the new options; stopping drops them.
    pub fn record_memory_history(&self, config: Option<HistoryConfig>) {
        let mut st = self.shared.lock();
        match (config, st.history.as_mut()) {
            (None, None) => {}
            (None, Some(_)) => {
                st.history = None;
                crate::history::recording_stopped();
            }
            (Some(c), None) => {
                st.history = Some(History::new(c));
                crate::history::recording_started();
            }
            (Some(c), Some(h)) => h.set_config(c),
        }
    }

    /// Whether the memory history is being recorded.
    pub fn is_recording_history(&self) -> bool {
        self.shared.lock().history.is_some()
    }

    /// Every segment and block, and the recorded memory history (if recording).
    pub fn snapshot(&self) -> Snapshot {
        self.shared.lock().snapshot(self.shared.source.device())
    }
}

/// Memory handed out by a [`CachingAllocator`]: it returns to the allocator when dropped (to
/// its stream's pool at once, or, if [`record_stream`](Block::record_stream) named other
/// streams, once their work issued before the drop has completed).
///
/// A block is `Send` and `Sync`, and implements [`fsdp_device::Storage`], so a
/// [`Buffer`] can be built over it ([`into_buffer`](Block::into_buffer),
/// [`shared_buffer`](Block::shared_buffer)).
pub struct Block<S: MemorySource> {
    shared: Arc<Shared<S>>,
    id: BlockId,
    ptr: SendPtr,
    size: usize,
    requested: usize,
    stream: u64,
    pool: PoolKind,
}

impl<S: MemorySource> fmt::Debug for Block<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Block")
            .field("device", &self.device())
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("size", &self.size)
            .field("requested", &self.requested)
            .field("stream", &self.stream)
            .field("pool", &self.pool)
            .finish()
    }
}

impl<S: MemorySource> Block<S> {
    /// Size in bytes after rounding (what the block occupies).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes asked for.
    pub fn requested_size(&self) -> usize {
        self.requested
    }

    /// The address (host or device, per [`device`](Block::device)). It stays valid while the
    /// handle lives; work on other streams that uses it past the drop must be declared with
    /// [`record_stream`](Block::record_stream) (or keep the handle alive).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.0
    }

    /// The address as a number.
    pub fn addr(&self) -> u64 {
        self.ptr.0.addr() as u64
    }

    /// The key of the stream it was allocated on (its pool).
    pub fn stream(&self) -> u64 {
        self.stream
    }

    /// The pool it came from.
    pub fn pool(&self) -> PoolKind {
        self.pool
    }

    /// The device of the memory.
    pub fn device(&self) -> Device {
        self.shared.source.device()
    }

    /// The allocator it belongs to.
    pub fn allocator(&self) -> CachingAllocator<S> {
        CachingAllocator {
            shared: self.shared.clone(),
        }
    }

    /// Declare that `stream` uses the block: when the block is freed, an event is recorded on
    /// `stream`, and the memory is reused only once it completes. Uses on the allocation stream
    /// need no event and are ignored.
    pub fn record_stream(&self, stream: &S::Stream) -> Result<(), AllocError> {
        let key = S::stream_key(stream);
        if key == self.stream {
            return Ok(());
        }
        self.shared.source.validate_stream(stream)?;
        let mut st = self.shared.lock();
        let uses = &mut st.blk_mut(self.id).uses;
        if !uses.iter().flat_map(|u| u.iter()).any(|(k, _)| *k == key) {
            let mut v = uses.take().map(Vec::from).unwrap_or_default();
            v.push((key, stream.clone()));
            *uses = Some(v.into_boxed_slice());
        }
        Ok(())
    }

    /// A buffer of `requested_size / dtype.size_in_bytes()` elements over the block, which it
    /// owns.
    pub fn into_buffer(self, dtype: DType) -> Result<Buffer, AllocError> {
        Ok(Buffer::from_storage(Box::new(self), dtype)?)
    }

    /// A buffer over a shared block: the memory returns to the allocator once `this` and every
    /// buffer are gone, and `this` can still [`record_stream`](Block::record_stream).
    pub fn shared_buffer(this: &Arc<Self>, dtype: DType) -> Result<Buffer, AllocError> {
        Ok(Buffer::from_storage(
            Box::new(SharedBlock(this.clone())),
            dtype,
        )?)
    }
}

impl<S: MemorySource> Drop for Block<S> {
    fn drop(&mut self) {
        let sh = &*self.shared;
        sh.lock().free(&sh.source, self.id);
    }
}

// SAFETY: the `requested` bytes at `ptr` (within the block's `size`) belong to this handle
// alone until it drops: the allocator hands a block to one handle and reuses it only after the
// drop and the completion of every record-stream event. The address is fixed, a multiple of 512
// from a SEGMENT_ALIGN-aligned segment start, and for host sources points to initialised host
// memory; for meta sources it is an identifier only, and `device` reports Device::Meta, so the
// buffers over it never dereference it (MemorySource's contract).
unsafe impl<S: MemorySource> Storage for Block<S> {
    fn device(&self) -> Device {
        self.shared.source.device()
    }
    fn byte_len(&self) -> usize {
        self.requested
    }
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.0
    }
}

/// A shared [`Block`] as a [`Storage`] (see [`Block::shared_buffer`]).
pub struct SharedBlock<S: MemorySource>(pub Arc<Block<S>>);

impl<S: MemorySource> fmt::Debug for SharedBlock<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SharedBlock").field(&self.0).finish()
    }
}

// SAFETY: as for Block, which the Arc keeps alive (and its memory reserved) while this lives.
unsafe impl<S: MemorySource> Storage for SharedBlock<S> {
    fn device(&self) -> Device {
        self.0.device()
    }
    fn byte_len(&self) -> usize {
        self.0.requested
    }
    fn as_ptr(&self) -> *mut u8 {
        self.0.ptr.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_list_matches_a_btree_through_vector_and_tree_forms() {
        let mut list = FreeList::default();
        let mut model: BTreeMap<FreeKey, BlockId> = BTreeMap::new();
        let mut x = 12345u64;
        let mut next = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            x >> 33
        };
        let check = |list: &FreeList, model: &BTreeMap<FreeKey, BlockId>, probe: FreeKey| {
            assert_eq!(
                list.first_from(probe),
                model.range(probe..).next().map(|(k, v)| (*k, *v))
            );
            let hi = (probe.0, probe.1 + 4096, 0, 0);
            let want: Vec<_> = model.range(probe..hi).map(|(k, v)| (*k, *v)).collect();
            assert_eq!(list.range(probe, hi), want);
            assert_eq!(list.ids(), model.values().copied().collect::<Vec<_>>());
        };
        // Grow past TO_TREE, shrink below TO_VEC, twice.
        for round in 0..2 {
            for i in 0..600 {
                let key = (
                    next() % 3,
                    (next() % 64) as usize * 512,
                    next() % 4,
                    i * 512 + round,
                );
                list.insert(key, i);
                model.insert(key, i);
                if i % 50 == 0 {
                    check(
                        &list,
                        &model,
                        (next() % 3, (next() % 64) as usize * 512, 0, 0),
                    );
                }
            }
            assert!(list.tree.is_some());
            let keys: Vec<FreeKey> = model.keys().copied().collect();
            for (j, k) in keys.iter().enumerate() {
                if j % 20 != 0 {
                    list.remove(k);
                    model.remove(k);
                }
                if j % 40 == 0 {
                    check(
                        &list,
                        &model,
                        (next() % 3, (next() % 64) as usize * 512, 0, 0),
                    );
                }
            }
            assert!(list.tree.is_none());
            check(&list, &model, (0, 0, 0, 0));
        }
    }
}
