//! Random workloads: the [`Op`]s, their strategy, and [`run_ops`], which checks every step.

use std::time::Duration;

use fsdp_allocator::{
    AllocError, AllocatorConfig, Block, BlockState, CachingAllocator, MemoryLimit, MemorySource,
    SMALL_SIZE,
};
use proptest::prelude::*;

use super::{check_invariants, Harness, MIB};

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
