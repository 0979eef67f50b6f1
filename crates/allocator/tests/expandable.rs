//! Expandable segments (PyTorch's `expandable_segments:True`) on the host (`mmap` reservation,
//! pages committed with `mprotect`) and on the meta source: PyTorch's fragmentation scenario —
//! requests that grow, each allocated before the previous one is freed, then shrink — reserves
//! far fewer bytes than ordinary segments, with the same statistics semantics.
//!
//! `cargo test -p fsdp-allocator --test expandable -- --nocapture` prints the figures.

use fsdp_allocator::{
    AllocatorConfig, BlockState, CachingAllocator, HostAllocator, HostSource, MemoryLimit,
    MemorySource, MetaAllocator, MetaSource, Snapshot,
};
use fsdp_device::Stream;

const MIB: usize = 1 << 20;

/// Reserved bytes (peak, at the end) and allocated peak of the scenario, and the final
/// snapshot. Each block is written and read back where the source has bytes.
fn growing_then_shrinking<S: MemorySource<Stream = Stream>>(
    alloc: &CachingAllocator<S>,
    touch: bool,
) -> (u64, u64, u64, Snapshot) {
    let s = Stream::inline("compute");
    let sizes: Vec<usize> = (0..20).map(|i| (21 + i) * MIB + 4096).collect();
    let mut prev = None;
    let mut i = 0u8;
    for &size in sizes.iter().chain(sizes.iter().rev()) {
        let b = alloc.allocate(size, &s).unwrap();
        if touch {
            i = i.wrapping_add(1);
            // SAFETY: the handle owns `size` bytes at `as_ptr` (host memory).
            unsafe {
                std::ptr::write_bytes(b.as_ptr(), i, size);
                assert_eq!(*b.as_ptr().add(size - 1), i);
            }
        }
        prev = Some(b);
        check(alloc);
    }
    drop(prev);
    let st = alloc.memory_stats();
    let snap = alloc.snapshot();
    (
        st.reserved_bytes.all.peak,
        st.reserved_bytes.all.current,
        st.allocated_bytes.all.peak,
        snap,
    )
}

/// The statistics agree with the snapshot: reserved bytes are the segments' (mapped) sizes,
/// allocated and active bytes the blocks'; with expandable segments no segment is counted and
/// no inactive split either (as in PyTorch).
fn check<S: MemorySource>(alloc: &CachingAllocator<S>) {
    let st = alloc.memory_stats();
    let snap = alloc.snapshot();
    assert_eq!(st.reserved_bytes.all.current, snap.reserved_bytes());
    let expandable = snap.segments.iter().all(|s| s.is_expandable);
    let ordinary = snap.segments.iter().filter(|s| !s.is_expandable).count() as u64;
    assert_eq!(st.segment.all.current, ordinary);
    if expandable {
        assert_eq!(st.inactive_split.all.current, 0);
        assert_eq!(st.inactive_split_bytes.all.current, 0);
    }
    for seg in &snap.segments {
        assert_eq!(
            seg.blocks.iter().map(|b| b.size).sum::<u64>(),
            seg.total_size,
            "blocks tile the mapped part"
        );
        if seg.is_expandable {
            assert_eq!(seg.total_size % (20 * MIB) as u64, 0, "whole large pages");
        }
    }
    let allocated: u64 = snap
        .blocks()
        .filter(|(_, b)| b.state == BlockState::ActiveAllocated)
        .map(|(_, b)| b.size)
        .sum();
    assert_eq!(st.allocated_bytes.all.current, allocated);
    for s in [
        &st.reserved_bytes.all,
        &st.allocated_bytes.all,
        &st.active_bytes.all,
    ] {
        assert_eq!(s.allocated - s.freed, s.current);
    }
}

#[test]
#[cfg_attr(miri, ignore = "mmap")]
fn expandable_segments_reserve_less_on_the_fragmentation_scenario() {
    let cap = 64 << 30;
    let host = |exp| {
        let cfg = AllocatorConfig::default().with_expandable_segments(exp);
        HostAllocator::new(HostSource::new(cap), cfg).unwrap()
    };
    let (plain_peak, plain_end, plain_alloc, plain_snap) =
        growing_then_shrinking(&host(false), true);
    let exp_alloc = host(true);
    let (exp_peak, exp_end, exp_alloc_peak, exp_snap) = growing_then_shrinking(&exp_alloc, true);
    println!(
        "fragmentation scenario (20 growing requests 21..40 MiB, then shrinking, each allocated \
         before the previous is freed): reserved peak {} MiB without expandable segments, {} MiB \
         with; at the end {} MiB vs {} MiB; allocated peak {} MiB in both; segments {} vs {} \
         expandable",
        plain_peak >> 20,
        exp_peak >> 20,
        plain_end >> 20,
        exp_end >> 20,
        plain_alloc >> 20,
        plain_snap.segments.len(),
        exp_snap.segments.len()
    );
    assert_eq!(plain_alloc, exp_alloc_peak, "the same allocations");
    assert!(exp_peak * 3 < plain_peak, "{exp_peak} vs {plain_peak}");
    assert!(exp_end < plain_end);
    assert_eq!(
        exp_snap.segments.len(),
        1,
        "one segment for the stream's large pool"
    );
    assert!(exp_snap.segments[0].is_expandable);
    // empty_cache unmaps every free page and gives the range back.
    exp_alloc.empty_cache().unwrap();
    let st = exp_alloc.memory_stats();
    assert_eq!(st.reserved_bytes.all.current, 0);
    assert!(exp_alloc.snapshot().segments.is_empty());
    assert_eq!(exp_alloc.source().used(), 0);
}

#[test]
fn meta_makes_the_same_decisions_with_expandable_segments() {
    let cfg = AllocatorConfig::default().with_expandable_segments(true);
    let meta = MetaAllocator::new(MetaSource::new(64 << 30), cfg).unwrap();
    let (peak, end, alloc, snap) = growing_then_shrinking(&meta, false);
    if cfg!(miri) {
        return;
    }
    let host = HostAllocator::new(HostSource::new(64 << 30), cfg).unwrap();
    let (hpeak, hend, halloc, hsnap) = growing_then_shrinking(&host, false);
    assert_eq!((peak, end, alloc), (hpeak, hend, halloc));
    let sizes = |s: &Snapshot| -> Vec<Vec<(u64, BlockState)>> {
        s.segments
            .iter()
            .map(|seg| seg.blocks.iter().map(|b| (b.size, b.state)).collect())
            .collect()
    };
    assert_eq!(sizes(&snap), sizes(&hsnap));
    assert_eq!(meta.memory_stats(), host.memory_stats());
}

/// Growth stops at the memory limit: the free tail is unmapped and the request retried, then
/// it fails with PyTorch's error; nothing is lost.
#[test]
#[cfg_attr(miri, ignore = "mmap")]
fn expandable_segments_respect_the_limit_and_give_pages_back_on_retry() {
    let cfg = AllocatorConfig::default()
        .with_expandable_segments(true)
        .with_memory_limit(MemoryLimit::Bytes(100 * MIB));
    let alloc = HostAllocator::new(HostSource::new(1 << 30), cfg).unwrap();
    let s = Stream::inline("s");
    let a = alloc.allocate(30 * MIB, &s).unwrap(); // maps 40 MiB
    let b = alloc.allocate(30 * MIB, &s).unwrap(); // 10 free + 20 more mapped: 60 MiB
    assert_eq!(
        alloc.memory_stats().reserved_bytes.all.current,
        60 * MIB as u64
    );
    drop(b); // a free tail of 30 MiB
             // 50 MiB: tail 30 + 20 mapped = 80 MiB, within the limit.
    let c = alloc.allocate(50 * MIB, &s).unwrap();
    assert_eq!(
        alloc.memory_stats().reserved_bytes.all.current,
        80 * MIB as u64
    );
    assert_eq!(
        c.addr(),
        a.addr() + 30 * MIB as u64,
        "extends the same range"
    );
    // 30 MiB more would pass 100 MiB: fails after the retry.
    let err = alloc.allocate(30 * MIB, &s).unwrap_err();
    assert!(err.to_string().contains("out of memory"), "{err}");
    let st = alloc.memory_stats();
    assert_eq!((st.num_ooms, st.num_alloc_retries), (1, 1));
    check(&alloc);
    drop(a);
    drop(c);
    // All free: the retry path (or empty_cache) unmaps everything.
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.memory_stats().reserved_bytes.all.current, 0);
    assert_eq!(alloc.source().used(), 0);
    let again = alloc.allocate(90 * MIB, &s).unwrap();
    assert_eq!(
        alloc.memory_stats().reserved_bytes.all.current,
        100 * MIB as u64
    );
    drop(again);
}
