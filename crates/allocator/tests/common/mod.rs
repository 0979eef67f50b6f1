//! Scenarios shared by the host, meta and CUDA tests: each runs against any memory source
//! through a [`Harness`] that provides three streams and ways to hold them up.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use crossbeam_channel::Sender;
use fsdp_allocator::{
    AllocError, AllocatorConfig, Block, BlockState, CachingAllocator, MemoryLimit, MemorySource,
    MemoryStats, PoolKind, SegmentSnapshot, Snapshot, Stat, StatArray, SMALL_BUFFER, SMALL_SIZE,
};
use fsdp_device::{Event, Stream};
use proptest::prelude::*;

pub const MIB: usize = 1 << 20;
pub const KIB: usize = 1 << 10;
/// How many bytes at each end of a block [`Harness::write_pattern`] writes.
pub const PATTERN: usize = 64;

mod host_pattern;
mod miri;
// Only the host sources' tests write host patterns.
#[allow(unused_imports)]
pub use host_pattern::{check_host_pattern, write_host_pattern};
// Not every test that includes `common` runs property tests (`cuda.rs` does not).
#[allow(unused_imports)]
pub use miri::{ops_len, proptest_config};

/// Streams and device operations for one memory source.
pub trait Harness {
    /// The source under test.
    type Src: MemorySource;
    /// A point in a stream, recorded by the test itself.
    type Marker;

    /// A fresh allocator over a fresh source.
    fn allocator(&self, config: AllocatorConfig) -> CachingAllocator<Self::Src>;
    /// Stream 0, 1 or 2.
    fn stream(&self, i: usize) -> &<Self::Src as MemorySource>::Stream;
    /// Enqueue on stream `i` work that blocks until [`release`](Harness::release) or `max`.
    fn stall(&self, i: usize, max: Duration);
    /// Let every stalled task of stream `i` finish.
    fn release(&self, i: usize);
    /// Enqueue `d` of simulated work on stream `i`.
    fn busy(&self, i: usize, d: Duration);
    /// Make stream `waiter` wait for the current end of stream `on`.
    fn wait_for(&self, waiter: usize, on: usize);
    /// Record a marker at the current end of stream `i`.
    fn marker(&self, i: usize) -> Self::Marker;
    /// Whether the marker has completed.
    fn marker_done(&self, m: &Self::Marker) -> bool;
    /// Wait for the marker.
    fn marker_wait(&self, m: &Self::Marker, timeout: Duration);
    /// Write `byte` into the first and last [`PATTERN`] bytes of the block (synchronously).
    fn write_pattern(&self, b: &Block<Self::Src>, byte: u8);
    /// Whether the first and last [`PATTERN`] bytes still hold `byte`.
    fn check_pattern(&self, b: &Block<Self::Src>, byte: u8) -> bool;
    /// Wait for everything enqueued on stream `i`.
    fn synchronize(&self, i: usize);

    fn release_all(&self) {
        for i in 0..3 {
            self.release(i);
        }
    }

    fn synchronize_all(&self) {
        for i in 0..3 {
            self.synchronize(i);
        }
    }
}

/// What a [`CpuHarness`] leaves to its memory source: the source, and how the scenarios' bytes
/// are written into and read from its blocks.
pub trait CpuMemory: Default {
    /// The source under test, with fsdp-device's CPU streams and events.
    type Src: MemorySource<Stream = Stream, Event = Event>;
    /// A fresh source of `capacity` bytes.
    fn source(capacity: usize) -> Self::Src;
    /// [`Harness::write_pattern`].
    fn write_pattern(&self, b: &Block<Self::Src>, byte: u8);
    /// [`Harness::check_pattern`].
    fn check_pattern(&self, b: &Block<Self::Src>, byte: u8) -> bool;
}

/// The harness of a source whose streams are fsdp-device's CPU streams: three worker streams
/// and gates to hold them up, over the memory `M`.
pub struct CpuHarness<M: CpuMemory> {
    streams: [Stream; 3],
    gates: [Mutex<Vec<Sender<()>>>; 3],
    capacity: usize,
    memory: M,
}

impl<M: CpuMemory> CpuHarness<M> {
    /// A harness whose allocators get sources of `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        CpuHarness {
            streams: [Stream::cpu("s0"), Stream::cpu("s1"), Stream::cpu("s2")],
            gates: Default::default(),
            capacity,
            memory: M::default(),
        }
    }
}

impl<M: CpuMemory> Harness for CpuHarness<M> {
    type Src = M::Src;
    type Marker = Event;

    fn allocator(&self, config: AllocatorConfig) -> CachingAllocator<M::Src> {
        CachingAllocator::new(M::source(self.capacity), config).unwrap()
    }

    fn stream(&self, i: usize) -> &Stream {
        &self.streams[i]
    }

    fn stall(&self, i: usize, max: Duration) {
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        self.gates[i].lock().unwrap().push(tx);
        self.streams[i]
            .enqueue(move || {
                let _ = rx.recv_timeout(max);
            })
            .unwrap();
    }

    fn release(&self, i: usize) {
        self.gates[i].lock().unwrap().clear();
    }

    fn busy(&self, i: usize, d: Duration) {
        self.streams[i].enqueue(move || thread::sleep(d)).unwrap();
    }

    fn wait_for(&self, waiter: usize, on: usize) {
        let ev = self.streams[on].record_event();
        self.streams[waiter].wait_event(&ev).unwrap();
    }

    fn marker(&self, i: usize) -> Event {
        self.streams[i].record_event()
    }

    fn marker_done(&self, m: &Event) -> bool {
        m.query()
    }

    fn marker_wait(&self, m: &Event, timeout: Duration) {
        m.synchronize_timeout(timeout).unwrap();
    }

    fn write_pattern(&self, b: &Block<M::Src>, byte: u8) {
        self.memory.write_pattern(b, byte);
    }

    fn check_pattern(&self, b: &Block<M::Src>, byte: u8) -> bool {
        self.memory.check_pattern(b, byte)
    }

    fn synchronize(&self, i: usize) {
        self.streams[i].synchronize().unwrap();
    }
}

fn pick(arr: &StatArray, pool: Option<PoolKind>) -> Stat {
    match pool {
        None => arr.all,
        Some(p) => *arr.pool(p),
    }
}

/// Check every structural invariant of the snapshot, that `live` are exactly the allocated
/// blocks, and that every current statistic equals its value recomputed from the snapshot.
pub fn check_invariants<S: MemorySource>(alloc: &CachingAllocator<S>, live: &[&Block<S>]) {
    let snap = alloc.snapshot();
    let stats = alloc.memory_stats();
    check_snapshot_against_stats(&snap, &stats);
    let allocated: HashMap<u64, (u64, u64)> = snap
        .blocks()
        .filter(|(_, b)| b.state == BlockState::ActiveAllocated)
        .map(|(_, b)| (b.address, (b.size, b.requested_size)))
        .collect();
    assert_eq!(
        allocated.len(),
        live.len(),
        "live handles = allocated blocks"
    );
    for h in live {
        let (size, requested) = allocated[&h.addr()];
        assert_eq!(size as usize, h.size());
        assert_eq!(requested as usize, h.requested_size());
        assert!(h.size() >= h.requested_size());
    }
}

/// Structural invariants of a snapshot and the agreement of the statistics with it.
pub fn check_snapshot_against_stats(snap: &Snapshot, stats: &MemoryStats) {
    let mut prev_end = 0u64;
    for seg in &snap.segments {
        assert!(seg.address >= prev_end, "segments overlap");
        prev_end = seg.address + seg.total_size;
        assert!(!seg.blocks.is_empty());
        if seg.segment_type == PoolKind::Small {
            assert_eq!(seg.total_size, SMALL_BUFFER as u64);
        }
        let mut addr = seg.address;
        let mut prev_inactive = false;
        for b in &seg.blocks {
            assert_eq!(b.address, addr, "blocks tile their segment");
            assert!(b.size > 0 && b.size % 512 == 0);
            addr += b.size;
            let inactive = b.state == BlockState::Inactive;
            assert!(!(inactive && prev_inactive), "free neighbours are merged");
            prev_inactive = inactive;
            if inactive {
                assert_eq!(b.requested_size, 0);
            } else {
                assert!(b.requested_size <= b.size);
            }
        }
        assert_eq!(
            addr,
            seg.address + seg.total_size,
            "blocks fill their segment"
        );
    }
    for pool in [None, Some(PoolKind::Small), Some(PoolKind::Large)] {
        let segs: Vec<&SegmentSnapshot> = snap
            .segments
            .iter()
            .filter(|s| pool.is_none_or(|p| s.segment_type == p))
            .collect();
        let blocks = || segs.iter().flat_map(|s| s.blocks.iter());
        let count = |f: &dyn Fn(BlockState) -> bool| blocks().filter(|b| f(b.state)).count() as u64;
        let bytes = |f: &dyn Fn(BlockState) -> bool| {
            blocks().filter(|b| f(b.state)).map(|b| b.size).sum::<u64>()
        };
        let is_alloc = |s: BlockState| s == BlockState::ActiveAllocated;
        let is_active = |s: BlockState| s != BlockState::Inactive;
        let inactive_split: Vec<_> = segs
            .iter()
            .filter(|s| s.blocks.len() > 1)
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.state == BlockState::Inactive)
            .collect();
        let expect = [
            ("allocation", &stats.allocation, count(&is_alloc)),
            ("allocated_bytes", &stats.allocated_bytes, bytes(&is_alloc)),
            ("active", &stats.active, count(&is_active)),
            ("active_bytes", &stats.active_bytes, bytes(&is_active)),
            (
                "requested_bytes",
                &stats.requested_bytes,
                blocks().map(|b| b.requested_size).sum(),
            ),
            ("segment", &stats.segment, segs.len() as u64),
            (
                "reserved_bytes",
                &stats.reserved_bytes,
                segs.iter().map(|s| s.total_size).sum(),
            ),
            (
                "inactive_split",
                &stats.inactive_split,
                inactive_split.len() as u64,
            ),
            (
                "inactive_split_bytes",
                &stats.inactive_split_bytes,
                inactive_split.iter().map(|b| b.size).sum(),
            ),
        ];
        for (name, arr, want) in expect {
            let s = pick(arr, pool);
            assert_eq!(
                s.current, want,
                "{name} ({pool:?}) disagrees with the snapshot"
            );
            assert_eq!(s.allocated - s.freed, s.current, "{name} ({pool:?}) totals");
            assert!(s.peak >= s.current, "{name} ({pool:?}) peak");
        }
    }
    if let Some(m) = stats.max_split_size() {
        let over = |size: u64| size >= m;
        let n_alloc = snap
            .blocks()
            .filter(|(_, b)| b.state == BlockState::ActiveAllocated && over(b.size))
            .count() as u64;
        let n_seg = snap.segments.iter().filter(|s| over(s.total_size)).count() as u64;
        assert_eq!(stats.oversize_allocations.current, n_alloc);
        assert_eq!(stats.oversize_segments.current, n_seg);
    }
}

/// One step of a random workload.
#[derive(Clone, Debug)]
pub enum Op {
    /// Allocate on a stream.
    Alloc { stream: usize, size: usize },
    /// Free one of the live blocks (index modulo their number).
    Free { pick: usize },
    /// Record a live block's use on a stream.
    Record { pick: usize, stream: usize },
    /// Hold a stream up.
    Stall { stream: usize },
    /// Let a stream go.
    Release { stream: usize },
    /// Release every stream and empty the cache.
    EmptyCache,
}

/// Random operations: mostly small requests, some large, a few of their own segment size.
pub fn op_strategy() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        6 => 0..=SMALL_SIZE,
        3 => SMALL_SIZE + 1..10 * MIB,
        1 => 10 * MIB..=24 * MIB,
    ];
    prop_oneof![
        40 => (0..3usize, size).prop_map(|(stream, size)| Op::Alloc { stream, size }),
        30 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        15 => (any::<usize>(), 0..3usize).prop_map(|(pick, stream)| Op::Record { pick, stream }),
        5 => (0..3usize).prop_map(|stream| Op::Stall { stream }),
        8 => (0..3usize).prop_map(|stream| Op::Release { stream }),
        2 => Just(Op::EmptyCache),
    ]
}

struct Live<S: MemorySource> {
    block: Block<S>,
    stream: usize,
    pattern: u8,
    used_on: Vec<usize>,
}

/// What a random run did.
#[derive(Debug, Default, Clone, Copy)]
pub struct RunSummary {
    pub allocs: usize,
    pub ooms: usize,
    pub cache_hits_while_pending: usize,
}

/// Run `ops` and check, after every step: the invariants of [`check_invariants`]; that live
/// blocks never overlap (also through their memory contents); that no block is handed out while
/// a marker recorded before its free on a stream that used it is pending. At the end everything
/// is freed: every segment must be one free block, and `empty_cache` must return every byte.
pub fn run_ops<H: Harness>(
    h: &H,
    alloc: &CachingAllocator<H::Src>,
    ops: &[Op],
    stall_max: Duration,
) -> RunSummary {
    let mut live: Vec<Live<H::Src>> = Vec::new();
    // Freed blocks used on other streams: (start, end, markers recorded just before the free).
    let mut pending: Vec<(u64, u64, Vec<H::Marker>)> = Vec::new();
    let mut counter = 0u8;
    let mut summary = RunSummary::default();
    for op in ops {
        match *op {
            Op::Alloc { stream, size } => {
                let ooms_before = alloc.memory_stats().num_ooms;
                match alloc.allocate(size, h.stream(stream)) {
                    Ok(b) => {
                        summary.allocs += 1;
                        assert!(b.size() >= size.max(1) && b.size() % 512 == 0);
                        let (start, end) = (b.addr(), b.addr() + b.size() as u64);
                        for l in &live {
                            let (ls, le) = (l.block.addr(), l.block.addr() + l.block.size() as u64);
                            assert!(end <= ls || le <= start, "live blocks overlap");
                        }
                        pending.retain(|(_, _, ms)| !ms.iter().all(|m| h.marker_done(m)));
                        for (ps, pe, _) in &pending {
                            assert!(
                                end <= *ps || *pe <= start,
                                "a block was reused while a stream that used it is still running"
                            );
                        }
                        counter = counter.wrapping_add(1).max(1);
                        h.write_pattern(&b, counter);
                        live.push(Live {
                            block: b,
                            stream,
                            pattern: counter,
                            used_on: Vec::new(),
                        });
                    }
                    Err(AllocError::OutOfMemory { .. }) => {
                        summary.ooms += 1;
                        assert_eq!(alloc.memory_stats().num_ooms, ooms_before + 1);
                    }
                    Err(e) => panic!("allocation failed: {e}"),
                }
            }
            Op::Free { pick } => {
                if !live.is_empty() {
                    let l = live.swap_remove(pick % live.len());
                    assert!(
                        h.check_pattern(&l.block, l.pattern),
                        "a live block's contents were overwritten"
                    );
                    let markers: Vec<H::Marker> = l.used_on.iter().map(|&s| h.marker(s)).collect();
                    if !markers.is_empty() {
                        let start = l.block.addr();
                        pending.push((start, start + l.block.size() as u64, markers));
                    }
                    drop(l.block);
                }
            }
            Op::Record { pick, stream } => {
                if !live.is_empty() {
                    let n = live.len();
                    let l = &mut live[pick % n];
                    l.block.record_stream(h.stream(stream)).unwrap();
                    if stream != l.stream && !l.used_on.contains(&stream) {
                        l.used_on.push(stream);
                    }
                }
            }
            Op::Stall { stream } => h.stall(stream, stall_max),
            Op::Release { stream } => h.release(stream),
            Op::EmptyCache => {
                h.release_all();
                alloc.empty_cache().unwrap();
            }
        }
        let handles: Vec<&Block<H::Src>> = live.iter().map(|l| &l.block).collect();
        check_invariants(alloc, &handles);
    }
    // Wind down: everything freed, every stream done.
    h.release_all();
    for l in live.drain(..) {
        assert!(h.check_pattern(&l.block, l.pattern));
    }
    h.synchronize_all();
    alloc.process_events().unwrap();
    check_invariants::<H::Src>(alloc, &[]);
    let snap = alloc.snapshot();
    for seg in &snap.segments {
        assert_eq!(seg.blocks.len(), 1, "a fully freed segment is one block");
        assert_eq!(seg.blocks[0].state, BlockState::Inactive);
    }
    let stats = alloc.memory_stats();
    assert_eq!(stats.allocated_bytes.all.current, 0);
    assert_eq!(stats.active_bytes.all.current, 0);
    assert_eq!(stats.inactive_split_bytes.all.current, 0);
    alloc.empty_cache().unwrap();
    let stats = alloc.memory_stats();
    assert_eq!(stats.reserved_bytes.all.current, 0);
    assert_eq!(stats.segment.all.current, 0);
    assert_eq!(stats.num_device_alloc, stats.num_device_free);
    assert!(alloc.snapshot().segments.is_empty());
    summary
}

/// `ops` with plenty of memory, on a fresh allocator of `h`.
pub fn random_ops_scenario<H: Harness>(h: &H, ops: &[Op]) -> RunSummary {
    let alloc = h.allocator(AllocatorConfig::default().with_sync_timeout(Duration::from_secs(30)));
    run_ops(h, &alloc, ops, Duration::from_secs(20))
}

/// `ops` under a tight memory limit (and `max_split_size`), on a fresh allocator of `h`:
/// retries, releases of oversize blocks and out-of-memory errors happen while events are
/// pending.
pub fn random_ops_limited_scenario<H: Harness>(h: &H, ops: &[Op]) -> RunSummary {
    let alloc = h.allocator(
        AllocatorConfig::default()
            .with_memory_limit(MemoryLimit::Bytes(96 * MIB))
            .with_max_split_size(22 * MIB)
            .with_sync_timeout(Duration::from_secs(30)),
    );
    run_ops(h, &alloc, ops, Duration::from_millis(3))
}

/// The FSDP paper's producer/consumer pattern: for each of `layers` units, the CPU allocates an
/// all-gather-sized buffer on the producer stream (0), the producer fills it, the consumer
/// stream (1) waits for it and computes, and the CPU frees it at once with record_stream(
/// consumer). The consumer starts late (a slow first kernel), so the CPU runs ahead.
/// `rate_limit`: at most that many freed-but-unfinished buffers in flight (FSDP's
/// `limit_all_gathers`), enforced by waiting on the consumer's event of the oldest.
pub fn paper_scenario<H: Harness>(h: &H, rate_limit: Option<usize>) -> MemoryStats {
    const LAYERS: usize = 12;
    const BUF: usize = 24 * MIB; // >= 10 MiB: each buffer is a segment of its own size
    let alloc = h.allocator(
        AllocatorConfig::default()
            .with_memory_limit(MemoryLimit::Bytes(4 * BUF + 4 * MIB))
            .with_sync_timeout(Duration::from_secs(30)),
    );
    let (producer, consumer) = (0, 1);
    h.stall(consumer, Duration::from_millis(150));
    let mut inflight = std::collections::VecDeque::new();
    for _ in 0..LAYERS {
        if let Some(limit) = rate_limit {
            while inflight.len() >= limit {
                let m = inflight.pop_front().expect("non-empty");
                h.marker_wait(&m, Duration::from_secs(30));
            }
        }
        let block = alloc
            .allocate(BUF, h.stream(producer))
            .expect("all-gather buffer");
        h.busy(producer, Duration::from_millis(1)); // the all-gather into the buffer
        h.wait_for(consumer, producer);
        h.busy(consumer, Duration::from_millis(4)); // compute with the unsharded parameters
        block.record_stream(h.stream(consumer)).unwrap();
        drop(block); // the CPU frees it long before the consumer has run
        if rate_limit.is_some() {
            inflight.push_back(h.marker(consumer));
        }
        check_invariants::<H::Src>(&alloc, &[]);
    }
    h.release_all();
    h.synchronize_all();
    alloc.process_events().unwrap();
    let stats = alloc.memory_stats();
    check_invariants::<H::Src>(&alloc, &[]);
    stats
}

/// Print and check the paper scenario with and without the rate limiter.
pub fn paper_scenario_both<H: Harness>(h: &H, label: &str) {
    let free = paper_scenario(h, None);
    let limited = paper_scenario(h, Some(2));
    for (name, s) in [("no limit", &free), ("limit_all_gathers=2", &limited)] {
        println!(
            "[{label}] paper scenario, {name}: num_alloc_retries = {}, num_sync_all_streams = {}, \
             num_ooms = {}, peak reserved = {} MiB, peak active = {} MiB, segments allocated = {}",
            s.num_alloc_retries,
            s.num_sync_all_streams,
            s.num_ooms,
            s.reserved_bytes.all.peak >> 20,
            s.active_bytes.all.peak >> 20,
            s.num_device_alloc,
        );
    }
    assert!(
        free.num_alloc_retries > 0,
        "running ahead must cause retries"
    );
    assert_eq!(free.num_ooms, 0);
    assert_eq!(
        limited.num_alloc_retries, 0,
        "the rate limiter avoids retries"
    );
    assert_eq!(limited.num_ooms, 0);
    assert!(limited.reserved_bytes.all.peak <= 2 * 24 * MIB as u64);
}

/// The out-of-memory error, its message and counters; retries that succeed; fragmentation that
/// cannot be undone; an absurd request.
pub fn oom_scenario<H: Harness>(h: &H) {
    let alloc =
        h.allocator(AllocatorConfig::default().with_memory_limit(MemoryLimit::Bytes(64 * MIB)));
    let s = h.stream(0);
    let a = alloc.allocate(40 * MIB, s).unwrap();
    let err = alloc.allocate(40 * MIB, s).unwrap_err();
    match &err {
        AllocError::OutOfMemory {
            requested,
            allocated,
            reserved,
            limit,
            ..
        } => {
            assert_eq!(*requested, 40 * MIB);
            assert_eq!(*allocated, 40 * MIB);
            assert_eq!(*reserved, 40 * MIB);
            assert_eq!(*limit, Some(64 * MIB));
        }
        e => panic!("expected out of memory, got {e}"),
    }
    let msg = err.to_string();
    println!("out-of-memory message: {msg}");
    assert!(
        msg.contains("out of memory. Tried to allocate 40.00 MiB."),
        "{msg}"
    );
    assert!(msg.contains("total capacity of"), "{msg}");
    assert!(msg.contains("64.00 MiB allowed; "), "{msg}");
    assert!(
        msg.contains(
            "Of the allocated memory 40.00 MiB is allocated by the caching allocator, and 0 bytes \
             is reserved by the caching allocator but unallocated."
        ),
        "{msg}"
    );
    assert!(
        msg.contains("max_split_size") && msg.contains("expandable_segments"),
        "{msg}"
    );
    let st = alloc.memory_stats();
    assert_eq!(
        (st.num_ooms, st.num_alloc_retries, st.num_sync_all_streams),
        (1, 1, 1)
    );

    // PyTorch reports the size it tried to reserve: 30 MiB + 1 B needs a 32 MiB segment.
    let err = alloc.allocate(30 * MIB + 1, s).unwrap_err();
    match &err {
        AllocError::OutOfMemory {
            requested,
            allocation_size,
            ..
        } => assert_eq!((*requested, *allocation_size), (30 * MIB + 1, 32 * MIB)),
        e => panic!("expected out of memory, got {e}"),
    }
    assert!(
        err.to_string()
            .contains("out of memory. Tried to allocate 32.00 MiB."),
        "{err}"
    );
    let st = alloc.memory_stats();
    assert_eq!((st.num_ooms, st.num_alloc_retries), (2, 2));

    // A cached whole segment is given back and the request retried successfully.
    drop(a);
    let b = alloc.allocate(50 * MIB, s).unwrap();
    let st = alloc.memory_stats();
    assert_eq!((st.num_ooms, st.num_alloc_retries), (2, 3));
    assert_eq!(st.reserved_bytes.all.current, 50 * MIB as u64);
    assert_eq!(st.num_device_free, 1);
    drop(b);

    // A split segment cannot be given back: fragmentation shows as reserved-but-unallocated.
    alloc.empty_cache().unwrap();
    let small = alloc.allocate(2 * MIB, s).unwrap(); // a 20 MiB segment, split
    let err = alloc.allocate(48 * MIB, s).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("2.00 MiB is allocated by the caching allocator, and 18.00 MiB is reserved"),
        "{msg}"
    );
    assert_eq!(alloc.memory_stats().num_ooms, 3);
    check_invariants(&alloc, &[&small]);

    // Absurd sizes fail cleanly.
    for size in [usize::MAX, usize::MAX - 4 * MIB, 1 << 62] {
        assert!(matches!(
            alloc.allocate(size, s),
            Err(AllocError::OutOfMemory { .. })
        ));
    }
    assert_eq!(alloc.memory_stats().num_ooms, 6);
    check_invariants(&alloc, &[&small]);
}

/// `max_split_size`: oversize blocks are not split, do not serve small requests, and serve large
/// ones only within 20 MiB; they are freed first when memory runs short.
pub fn max_split_scenario<H: Harness>(h: &H) {
    let msp = 32 * MIB;
    let s = h.stream(0);
    let alloc = h.allocator(AllocatorConfig::default().with_max_split_size(msp));
    let a = alloc.allocate(40 * MIB, s).unwrap();
    let a_addr = a.addr();
    assert_eq!(a.size(), 40 * MIB);
    let st = alloc.memory_stats();
    assert_eq!(st.oversize_allocations.current, 1);
    assert_eq!(st.oversize_segments.current, 1);
    assert_eq!(st.max_split_size, msp as i64);
    assert_eq!(st.as_map()["max_split_size"], msp as i64);
    drop(a);
    // A small request does not take the cached oversize block.
    let small = alloc.allocate(4 * MIB, s).unwrap();
    assert!(small.addr() < a_addr || small.addr() >= a_addr + 40 * MIB as u64);
    assert_eq!(
        alloc.memory_stats().reserved_bytes.all.current,
        60 * MIB as u64
    );
    // A large one does, whole (not split).
    let b = alloc.allocate(36 * MIB, s).unwrap();
    assert_eq!((b.addr(), b.size()), (a_addr, 40 * MIB));
    check_invariants(&alloc, &[&small, &b]);
    // A cached 64 MiB block is 20 MiB or more too big for 33 MiB: a new segment instead.
    let c = alloc.allocate(64 * MIB, s).unwrap();
    let c_addr = c.addr();
    drop(c);
    let e = alloc.allocate(33 * MIB, s).unwrap();
    assert_ne!(e.addr(), c_addr);
    assert_eq!(e.size(), 34 * MIB);
    check_invariants(&alloc, &[&small, &b, &e]);
    for size in [usize::MAX, usize::MAX - 4 * MIB, 1 << 62] {
        assert!(matches!(
            alloc.allocate(size, s),
            Err(AllocError::OutOfMemory { .. })
        ));
    }
    drop((small, b, e));

    // Without max_split_size, the same cached 40 MiB block is split for a small request.
    let plain = h.allocator(AllocatorConfig::default());
    let a = plain.allocate(40 * MIB, s).unwrap();
    let a_addr = a.addr();
    drop(a);
    let small = plain.allocate(4 * MIB, s).unwrap();
    assert_eq!(small.addr(), a_addr);
    check_invariants(&plain, &[&small]);
    drop(small);

    // Short of memory, cached oversize blocks are released before a full retry.
    let tight = h.allocator(
        AllocatorConfig::default()
            .with_max_split_size(msp)
            .with_memory_limit(MemoryLimit::Bytes(100 * MIB)),
    );
    drop(tight.allocate(80 * MIB, s).unwrap());
    let b = tight.allocate(40 * MIB, s).unwrap();
    let st = tight.memory_stats();
    assert_eq!(
        (st.num_alloc_retries, st.num_sync_all_streams, st.num_ooms),
        (0, 0, 0)
    );
    assert_eq!(st.reserved_bytes.all.current, 40 * MIB as u64);
    assert_eq!(st.num_device_free, 1);
    check_invariants(&tight, &[&b]);
}

/// A snapshot with allocated, pending and free blocks on two streams survives JSON.
pub fn snapshot_scenario<H: Harness>(h: &H) {
    let alloc = h.allocator(AllocatorConfig::default());
    let (s0, s1) = (h.stream(0), h.stream(1));
    let a = alloc.allocate(100 * KIB, s0).unwrap();
    let b = alloc.allocate(3 * MIB, s0).unwrap();
    let c = alloc.allocate(12 * MIB, s1).unwrap();
    h.stall(1, Duration::from_secs(20));
    b.record_stream(s1).unwrap();
    let b_size = b.size() as u64;
    drop(b);
    let d = alloc.allocate(200 * KIB, s0).unwrap();
    drop(d);
    let stats = alloc.memory_stats();
    assert_eq!(
        stats.active_bytes.all.current - stats.allocated_bytes.all.current,
        b_size,
        "freed-but-pending bytes are active but not allocated"
    );
    let snap = alloc.snapshot();
    check_invariants(&alloc, &[&a, &c]);
    let states: Vec<BlockState> = snap.blocks().map(|(_, b)| b.state).collect();
    for s in [
        BlockState::ActiveAllocated,
        BlockState::ActivePendingFree,
        BlockState::Inactive,
    ] {
        assert!(states.contains(&s), "{s:?} missing from {states:?}");
    }
    let streams: std::collections::BTreeSet<u64> = snap.segments.iter().map(|s| s.stream).collect();
    assert_eq!(streams.len(), 2);
    let json = snap.to_json().unwrap();
    for key in [
        "\"active_pending_free\"",
        "\"active_allocated\"",
        "\"inactive\"",
        "\"segment_type\": \"small\"",
        "\"segment_type\": \"large\"",
        "\"requested_size\": 102400",
    ] {
        assert!(json.contains(key), "{key} not in {json}");
    }
    let back = Snapshot::from_json(&json).unwrap();
    assert_eq!(back, snap);
    assert!(matches!(
        Snapshot::from_json("{\"device\": 3}"),
        Err(AllocError::Json(_))
    ));
    // Once the stream has run, the pending block returns.
    h.release(1);
    h.synchronize(1);
    alloc.process_events().unwrap();
    let stats = alloc.memory_stats();
    assert_eq!(
        stats.active_bytes.all.current,
        stats.allocated_bytes.all.current
    );
    check_invariants(&alloc, &[&a, &c]);
}

/// Pools are per stream; record_stream holds a block back until the stream's work is done.
pub fn per_stream_scenario<H: Harness>(h: &H) {
    let alloc = h.allocator(AllocatorConfig::default());
    let (s0, s1) = (h.stream(0), h.stream(1));
    let a = alloc.allocate(4 * KIB, s0).unwrap();
    let a_addr = a.addr();
    drop(a);
    let b = alloc.allocate(4 * KIB, s1).unwrap();
    assert_eq!(
        alloc.memory_stats().segment.all.current,
        2,
        "another stream gets another segment"
    );
    let again = alloc.allocate(4 * KIB, s0).unwrap();
    assert_eq!(again.addr(), a_addr, "same stream: served from the cache");
    // Used on s1 while s1 is held up: not reused until s1 has run.
    h.stall(1, Duration::from_secs(20));
    again.record_stream(s1).unwrap();
    again.record_stream(s1).unwrap(); // recorded once
    again.record_stream(s0).unwrap(); // own stream: ignored
    drop(again);
    let c = alloc.allocate(4 * KIB, s0).unwrap();
    assert_ne!(c.addr(), a_addr);
    let stats = alloc.memory_stats();
    assert_eq!(stats.active.all.current, 3);
    assert_eq!(stats.allocation.all.current, 2);
    h.release(1);
    h.synchronize(1);
    let d = alloc.allocate(4 * KIB, s0).unwrap();
    assert_eq!(d.addr(), a_addr, "returned once the event completed");
    check_invariants(&alloc, &[&b, &c, &d]);
    drop((b, c, d));
    alloc.reset_peak_stats();
    let st = alloc.memory_stats();
    assert_eq!(st.allocated_bytes.all.peak, 0);
    assert_eq!(st.reserved_bytes.all.peak, st.reserved_bytes.all.current);
    alloc.reset_accumulated_stats();
    let st = alloc.memory_stats();
    assert_eq!(st.allocated_bytes.all.allocated, 0);
    assert_eq!(st.num_device_alloc, 0);
}
