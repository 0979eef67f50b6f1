//! Scenarios taken from PyTorch's caching allocator (`CUDACachingAllocator.cpp`,
//! `test/test_cuda.py`), with the figures PyTorch itself reports.

use fsdp_allocator::{AllocatorConfig, HostAllocator, HostSource, MetaAllocator, MetaSource};
use fsdp_device::Stream;

const MIB: usize = 1 << 20;

/// Three 4 MiB blocks of one 20 MiB segment, freed middle, first, last: PyTorch counts the net
/// change of each operation in the inactive-split totals, 2 blocks and 24 MiB in all.
#[test]
fn inactive_split_totals_count_net_changes_like_pytorch() {
    let alloc = MetaAllocator::new(MetaSource::new(1 << 30), AllocatorConfig::default()).unwrap();
    let s = Stream::inline("s");
    let a = alloc.allocate(4 * MIB, &s).unwrap();
    let b = alloc.allocate(4 * MIB, &s).unwrap();
    let c = alloc.allocate(4 * MIB, &s).unwrap();
    let st = alloc.memory_stats();
    // The remainder shrank from 16 to 8 MiB: one block, 8 MiB.
    assert_eq!(st.inactive_split.all.current, 1);
    assert_eq!(st.inactive_split_bytes.all.current, 8 * MIB as u64);
    assert_eq!(st.inactive_split.all.allocated, 1);
    assert_eq!(st.inactive_split_bytes.all.allocated, 16 * MIB as u64);
    assert_eq!(st.inactive_split_bytes.all.freed, 8 * MIB as u64);
    drop(b);
    drop(a);
    drop(c);
    let st = alloc.memory_stats();
    let (n, bytes) = (st.inactive_split.all, st.inactive_split_bytes.all);
    assert_eq!((n.allocated, n.freed, n.current), (2, 2, 0));
    assert_eq!(
        (bytes.allocated, bytes.freed, bytes.current),
        (24 * MIB as u64, 24 * MIB as u64, 0)
    );
    assert_eq!(n.peak, 2);
    assert_eq!(st.inactive_split.large_pool, n);
    assert_eq!(st.inactive_split_bytes.large_pool, bytes);
}

/// `max_split_size` is always in the statistics: −1 when unset, as in PyTorch.
#[test]
fn max_split_size_is_always_reported() {
    let host = HostAllocator::new(HostSource::new(1 << 30), AllocatorConfig::default()).unwrap();
    let st = host.memory_stats();
    assert_eq!(st.max_split_size, -1);
    assert_eq!(st.max_split_size(), None);
    assert_eq!(st.as_map()["max_split_size"], -1);
    let cfg = AllocatorConfig::default().with_max_split_size(64 * MIB);
    let host = HostAllocator::new(HostSource::new(1 << 30), cfg).unwrap();
    assert_eq!(host.memory_stats().as_map()["max_split_size"], 64 << 20);
    assert_eq!(host.memory_stats().max_split_size(), Some(64 << 20));
}

/// PyTorch's `test_cuda` reference for `roundup_power2_divisions`: the next of `div` equal
/// steps between the powers of two around `size` (a power of two stays).
fn power2_div(size: usize, div: usize) -> usize {
    let mut pow2 = 1;
    while pow2 < size {
        pow2 *= 2;
    }
    if pow2 == size {
        return pow2;
    }
    let step = pow2 / 2 / div;
    let mut ret = pow2 / 2;
    while ret < size {
        ret += step;
    }
    ret
}

/// PyTorch's `test_set_allocator_settings`: 21 Mi f32 (84 MiB) take 84 MiB plain, 96 MiB with
/// `roundup_power2_divisions:4`, 88 MiB with `[64:8,...]`; the requested bytes stay 84 MiB.
#[test]
fn roundup_power2_divisions_follow_pytorch() {
    let nbytes = 4 * 21 * MIB;
    let s = Stream::inline("s");
    let run = |cfg: AllocatorConfig| {
        let alloc = MetaAllocator::new(MetaSource::new(1 << 30), cfg).unwrap();
        let _b = alloc.allocate(nbytes, &s).unwrap();
        let st = alloc.memory_stats();
        (
            st.allocated_bytes.all.current as usize,
            st.requested_bytes.all.current as usize,
        )
    };
    assert_eq!(run(AllocatorConfig::default()), (nbytes, nbytes));
    let div4 = AllocatorConfig::default().with_roundup_power2_divisions(4);
    assert_eq!(run(div4), (power2_div(nbytes, 4), nbytes));
    assert_eq!(power2_div(nbytes, 4), 96 * MIB);
    // [64:8,128:2,256:2,512:2,1024:1,>:1]: the entry of index log2(64) = 6 covers 64..128 MiB.
    let mut per = [1; fsdp_allocator::ROUNDUP_POWER2_INTERVALS];
    per[6] = 8;
    per[7] = 2;
    per[8] = 2;
    per[9] = 2;
    let div8 = AllocatorConfig::default().with_roundup_power2_divisions_per_interval(per);
    assert_eq!(run(div8), (power2_div(nbytes, 8), nbytes));
    assert_eq!(power2_div(nbytes, 8), 88 * MIB);

    // Against the reference over many sizes and divisions.
    for div in [2, 4, 8, 16] {
        let cfg = AllocatorConfig::default().with_roundup_power2_divisions(div);
        let n = if cfg!(miri) { 40 } else { 4000 };
        for size in (1..n).map(|i| i * 7919 + (i % 13) * 100_003) {
            let want = if size <= 512 * div {
                fsdp_allocator::round_size(size).unwrap()
            } else {
                power2_div(size, div)
            };
            assert_eq!(cfg.round_size(size), Some(want), "size {size} div {div}");
        }
    }
    // Divisions must be powers of two.
    let bad = AllocatorConfig::default().with_roundup_power2_divisions(3);
    let err = MetaAllocator::new(MetaSource::new(1 << 30), bad).unwrap_err();
    assert!(
        err.to_string().contains("roundup_power2_divisions"),
        "{err}"
    );
}

/// `garbage_collection_threshold` (with a memory fraction, as in PyTorch): on a cache miss
/// above the threshold, cached whole segments at least as old as the average are given back
/// before a new segment is tried — no retry, no stream synchronisation. Ages count the pool's
/// cache lookups since each block was cached (PyTorch's `gc_count`).
#[test]
fn garbage_collection_frees_the_oldest_cached_segments_first() {
    let run = |gc: Option<f64>, fraction: bool| {
        let mut cfg = AllocatorConfig::default();
        if fraction {
            cfg = cfg.with_memory_limit(fsdp_allocator::MemoryLimit::Fraction(1.0));
        }
        if let Some(t) = gc {
            cfg = cfg.with_garbage_collection_threshold(t);
        }
        let alloc = MetaAllocator::new(MetaSource::new(200 * MIB), cfg).unwrap();
        let s = Stream::inline("s");
        let a = alloc.allocate(30 * MIB, &s).unwrap(); // lookup 1
        let b = alloc.allocate(40 * MIB, &s).unwrap(); // lookup 2
        let c = alloc.allocate(24 * MIB, &s).unwrap(); // lookup 3; 94 MiB reserved
        let a_addr = a.addr();
        drop(a); // cached at lookup count 3
        let f = alloc.allocate(32 * MIB, &s).unwrap(); // lookup 4, a miss; 126 MiB reserved
        drop(b); // cached at 4
        drop(f); // cached at 4
                 // Lookup 5 misses: ages A 2, B 1, F 1 (average 4/3): only A goes, which is enough.
        let g = alloc.allocate(50 * MIB, &s).unwrap();
        let st = alloc.memory_stats();
        let cached: Vec<u64> = alloc
            .snapshot()
            .segments
            .iter()
            .filter(|seg| seg.allocated_size == 0)
            .map(|seg| seg.total_size >> 20)
            .collect();
        let a_kept = alloc
            .snapshot()
            .segments
            .iter()
            .any(|seg| seg.address == a_addr);
        drop((c, g));
        (
            st.reserved_bytes.all.current >> 20,
            st.num_device_free,
            st.num_alloc_retries,
            cached,
            a_kept,
        )
    };
    // Threshold 0.5 of 200 MiB: 126 MiB reserved is 26 MiB over.
    let (reserved, freed, retries, mut cached, a_kept) = run(Some(0.5), true);
    cached.sort();
    assert_eq!((reserved, freed, retries), (146, 1, 0));
    assert_eq!(cached, [32, 40], "B and F stay cached");
    assert!(!a_kept, "the oldest (A) was given back");
    // Without a memory fraction the threshold does nothing (as in PyTorch), nor without it.
    for (gc, fraction) in [(Some(0.5), false), (None, true)] {
        let (reserved, freed, retries, _, a_kept) = run(gc, fraction);
        assert_eq!((reserved, freed, retries), (176, 0, 0), "{gc:?} {fraction}");
        assert!(a_kept);
    }
    // A threshold out of (0, 1) is refused.
    for t in [0.0, 1.0, -0.5, f64::NAN] {
        let cfg = AllocatorConfig::default().with_garbage_collection_threshold(t);
        let err = MetaAllocator::new(MetaSource::new(MIB), cfg).unwrap_err();
        assert!(
            err.to_string().contains("garbage_collection_threshold"),
            "{err}"
        );
    }
}
