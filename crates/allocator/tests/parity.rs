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
