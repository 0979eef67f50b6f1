//! Checkers: the structural invariants of a snapshot and the agreement of the statistics with
//! it.

use std::collections::HashMap;

use fsdp_allocator::{
    Block, BlockState, CachingAllocator, MemorySource, MemoryStats, PoolKind, SegmentSnapshot,
    Snapshot, Stat, StatArray, SMALL_BUFFER,
};

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
