//! The caching allocator and its block handles: the type definitions and the top-level flow.
//!
//! The bookkeeping lives in submodules, one per role: the block and segment tables
//! (`blocks`), the free lists (`free_list`), the allocation and free paths (`malloc`, `free`),
//! record-stream events (`events`), giving memory back (`release`, `gc`), expandable segments
//! (`expandable`), snapshots (`snapshot`) and the handles' methods (`handle`).

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use fsdp_device::{Buffer, DType, Device};

mod blocks;
mod events;
mod expandable;
mod free;
mod free_list;
mod gc;
mod handle;
mod malloc;
mod release;
mod snapshot;

use free_list::FreeList;
pub use handle::SharedBlock;

use crate::config::resolve_limit;
use crate::history::{History, HistoryConfig, TraceAction};
use crate::snapshot::Snapshot;
use crate::{
    allocation_size, AllocError, AllocatorConfig, MemoryLimit, MemorySource, MemoryStats, PoolKind,
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
        let key = S::stream_key(stream);
        let sizes = sh
            .config
            .round_size(size)
            .and_then(|r| Some((r, allocation_size(r)?)));
        let mut st = sh.lock();
        // Under the state lock, which a release of cached memory holds while it lets go of the
        // streams that own none: a new stream is seen owning this allocation's memory.
        sh.source.validate_stream(stream)?;
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
