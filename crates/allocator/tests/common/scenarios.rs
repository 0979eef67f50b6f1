//! Fixed scenarios: the FSDP paper's producer/consumer pattern, out-of-memory errors,
//! `max_split_size`, snapshots and per-stream pools.

use std::time::Duration;

use fsdp_allocator::{AllocError, AllocatorConfig, BlockState, MemoryLimit, MemoryStats, Snapshot};

use super::{check_invariants, Harness, KIB, MIB};

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
