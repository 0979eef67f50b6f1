//! The allocator over real host memory, with fsdp-device's CPU streams and events.

mod common;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use fsdp_allocator::{
    AllocError, AllocatorConfig, HostAllocator, HostBlock, HostSource, MemoryLimit, MemoryStats,
    SEGMENT_ALIGN,
};
use fsdp_device::{AccessMode, DType, Stream};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

/// Real host memory: the scenarios' bytes go into the blocks themselves.
#[derive(Default)]
struct HostMemory;

impl CpuMemory for HostMemory {
    type Src = HostSource;

    fn source(capacity: usize) -> HostSource {
        HostSource::new(capacity)
    }

    fn write_pattern(&self, b: &HostBlock, byte: u8) {
        // SAFETY: the handle owns `b.size()` bytes of host memory at `as_ptr()`.
        unsafe { write_host_pattern(b.as_ptr(), b.size(), byte) }
    }

    fn check_pattern(&self, b: &HostBlock, byte: u8) -> bool {
        // SAFETY: as in write_pattern; the bytes were initialised (zeroed segments, then
        // written), and nothing else writes them while the handle lives.
        unsafe { check_host_pattern(b.as_ptr(), b.size(), byte) }
    }
}

/// Three worker streams and gates to hold them up, over real host memory.
type HostHarness = CpuHarness<HostMemory>;

const BIG: usize = 1 << 36; // virtual capacity: pages are only touched where tests write

proptest! {
    #![proptest_config(ProptestConfig {
        max_shrink_iters: 200,
        ..proptest_config(24)
    })]

    /// Thousands of random allocate / free / record_stream / stall / release / empty_cache
    /// operations on three streams, with every invariant checked after each.
    #[test]
    fn random_ops_keep_every_invariant(ops in prop::collection::vec(op_strategy(), ops_len(300))) {
        let summary = random_ops_scenario(&HostHarness::new(BIG), &ops);
        prop_assert_eq!(summary.ooms, 0);
    }

    /// The same under a tight memory limit (and `max_split_size`).
    #[test]
    fn random_ops_under_a_memory_limit(ops in prop::collection::vec(op_strategy(), ops_len(250))) {
        random_ops_limited_scenario(&HostHarness::new(BIG), &ops);
    }
}

#[test]
#[cfg_attr(miri, ignore = "too long for Miri")]
fn random_ops_report() {
    // A fixed long run, to print what the random workload exercises.
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let ops = prop::collection::vec(op_strategy(), 2000)
        .new_tree(&mut runner)
        .unwrap()
        .current();
    let h = HostHarness::new(BIG);
    let alloc = h.allocator(
        AllocatorConfig::default()
            .with_memory_limit(MemoryLimit::Bytes(160 * MIB))
            .with_sync_timeout(Duration::from_secs(30)),
    );
    let t0 = Instant::now();
    let summary = run_ops(&h, &alloc, &ops, Duration::from_millis(3));
    let s = alloc.memory_stats();
    println!(
        "2000 random ops in {:?}: {} allocations, {} OOMs, num_alloc_retries = {}, \
         num_sync_all_streams = {}, segments allocated = {}, peak reserved = {} MiB",
        t0.elapsed(),
        summary.allocs,
        summary.ooms,
        s.num_alloc_retries,
        s.num_sync_all_streams,
        s.num_device_alloc,
        s.reserved_bytes.all.peak >> 20
    );
    assert!(s.num_alloc_retries > 0);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "a timing scenario: interpreted, the CPU no longer runs ahead of the streams"
)]
fn paper_scenario_rate_limiter_removes_retries() {
    paper_scenario_both(&HostHarness::new(BIG), "host");
}

#[test]
fn out_of_memory_error_and_message() {
    oom_scenario(&HostHarness::new(BIG));
}

#[test]
fn source_capacity_is_out_of_memory_too() {
    let h = HostHarness::new(32 * MIB);
    let alloc = h.allocator(AllocatorConfig::default());
    let err = alloc.allocate(40 * MIB, h.stream(0)).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with(
            "cpu out of memory. Tried to allocate 40.00 MiB. Device cpu has a total \
                         capacity of 32.00 MiB of which 32.00 MiB is free. Of the"
        ),
        "{msg}"
    );
    assert!(!msg.contains("allowed;"), "{msg}");
    assert_eq!(alloc.memory_stats().num_ooms, 1);
    assert_eq!(alloc.source().used(), 0);
}

#[test]
fn config_is_validated() {
    let src = || HostSource::new(128 * MIB);
    let frac = AllocatorConfig::default().with_memory_limit(MemoryLimit::Fraction(0.5));
    let alloc = HostAllocator::new(src(), frac).unwrap();
    assert_eq!(alloc.memory_limit(), Some(64 * MIB));
    alloc
        .set_memory_limit(Some(MemoryLimit::Bytes(MIB)))
        .unwrap();
    assert_eq!(alloc.memory_limit(), Some(MIB));
    assert!(alloc.allocate(2 * MIB, &Stream::inline("x")).is_err());
    alloc.set_memory_limit(None).unwrap();
    assert!(alloc.allocate(2 * MIB, &Stream::inline("x")).is_ok());
    for f in [1.5, -0.1, f64::NAN] {
        let cfg = AllocatorConfig::default().with_memory_limit(MemoryLimit::Fraction(f));
        assert!(matches!(
            HostAllocator::new(src(), cfg),
            Err(AllocError::InvalidConfig(_))
        ));
    }
    assert!(matches!(
        alloc.set_memory_limit(Some(MemoryLimit::Fraction(2.0))),
        Err(AllocError::InvalidConfig(_))
    ));
    let cfg = AllocatorConfig::default().with_max_split_size(20 * MIB);
    let err = HostAllocator::new(src(), cfg).unwrap_err();
    assert!(err.to_string().contains("max_split_size"), "{err}");
}

#[test]
fn max_split_size_rules() {
    max_split_scenario(&HostHarness::new(BIG));
}

#[test]
fn snapshot_json_round_trip() {
    snapshot_scenario(&HostHarness::new(BIG));
}

#[test]
fn pools_are_per_stream_and_record_stream_holds_blocks() {
    per_stream_scenario(&HostHarness::new(BIG));
}

#[test]
fn pool_constants() {
    let h = HostHarness::new(BIG);
    let alloc = h.allocator(AllocatorConfig::default());
    let s = h.stream(0);
    let reserved = |a: &HostAllocator| a.memory_stats().reserved_bytes;
    let a = alloc.allocate(1, s).unwrap();
    assert_eq!((a.size(), a.requested_size()), (512, 1));
    assert_eq!(a.addr() as usize % SEGMENT_ALIGN, 0);
    assert_eq!(reserved(&alloc).small_pool.current, 2 * MIB as u64);
    let b = alloc.allocate(MIB, s).unwrap(); // still small, from the same segment
    assert_eq!(reserved(&alloc).small_pool.current, 2 * MIB as u64);
    let c = alloc.allocate(MIB + 1, s).unwrap(); // large: a 20 MiB segment, split
    assert_eq!(c.size(), MIB + 512);
    assert_eq!(reserved(&alloc).large_pool.current, 20 * MIB as u64);
    let d = alloc.allocate(MIB, s).unwrap(); // small again: the first segment's rest is too short
    assert_eq!(reserved(&alloc).small_pool.current, 4 * MIB as u64);
    // On another stream (whose pool is empty), 10 MiB + 1 gets a segment of its own size
    // rounded to 2 MiB (12 MiB), split: the 2 MiB - 512 rest is more than 1 MiB.
    let e = alloc.allocate(10 * MIB + 1, h.stream(1)).unwrap();
    assert_eq!(e.size(), 10 * MIB + 512);
    assert_eq!(reserved(&alloc).large_pool.current, 32 * MIB as u64);
    // The 20 MiB segment's 18.5 MiB rest serves an 18 MiB request; 0.5 MiB is not split off.
    let f = alloc.allocate(18 * MIB, s).unwrap();
    assert_eq!(f.size(), 18 * MIB + (MIB - 512));
    // Small pool: a rest of 512 bytes is split off.
    let g = alloc.allocate(2 * MIB - MIB - 1024, s).unwrap();
    check_invariants(&alloc, &[&a, &b, &c, &d, &e, &f, &g]);
    assert!(alloc
        .snapshot()
        .blocks()
        .any(|(_, b)| b.size == 512 && b.state == fsdp_allocator::BlockState::Inactive));
}

#[test]
fn blocks_back_device_buffers() {
    let h = HostHarness::new(BIG);
    let alloc = h.allocator(AllocatorConfig::default());
    let comm = h.stream(0);
    let buf = alloc.allocate_buffer(DType::F32, 1000, comm).unwrap();
    assert_eq!(buf.len(), 1000);
    buf.copy_from_slice(&(0..1000).map(|i| i as f32).collect::<Vec<_>>())
        .unwrap();
    assert_eq!(buf.to_vec::<f32>().unwrap()[999], 999.0);
    assert_eq!(alloc.memory_stats().allocation.all.current, 1);
    drop(buf);
    assert_eq!(alloc.memory_stats().allocation.all.current, 0);
    assert!(matches!(
        alloc.allocate_buffer(DType::F64, usize::MAX / 4, comm),
        Err(AllocError::InvalidArgument(_))
    ));

    // A shared block: work on another stream uses it through a buffer; the CPU frees its
    // handle first, recording the use.
    let compute = h.stream(1);
    let block = Arc::new(alloc.allocate(4096, comm).unwrap());
    let buf = HostBlock::shared_buffer(&block, DType::F64).unwrap();
    assert_eq!(buf.len(), 512);
    h.stall(1, Duration::from_secs(20));
    let ticket = buf.access(AccessMode::Exclusive);
    compute
        .enqueue(move || {
            let g = ticket.acquire(Duration::from_secs(20)).unwrap();
            // SAFETY: exclusive access to 512 f64 of host memory.
            unsafe { (g.as_ptr() as *mut f64).write(7.0) };
        })
        .unwrap();
    block.record_stream(compute).unwrap();
    drop(block);
    // The buffer (and the stream task's ticket) still hold the block.
    assert_eq!(alloc.memory_stats().allocation.all.current, 1);
    h.release(1);
    assert_eq!(buf.to_vec::<f64>().unwrap()[0], 7.0);
    drop(buf);
    h.synchronize(1);
    alloc.process_events().unwrap();
    let st = alloc.memory_stats();
    assert_eq!(st.active.all.current, 0, "{st:?}");
    check_invariants::<HostSource>(&alloc, &[]);
}

#[test]
fn waits_never_hang() {
    let h = HostHarness::new(BIG);
    let alloc = h.allocator(
        AllocatorConfig::default()
            .with_memory_limit(MemoryLimit::Bytes(40 * MIB))
            .with_sync_timeout(Duration::from_millis(50)),
    );
    let (s0, s1) = (h.stream(0), h.stream(1));
    h.stall(1, Duration::from_secs(20));
    let a = alloc.allocate(30 * MIB, s0).unwrap();
    a.record_stream(s1).unwrap();
    drop(a);
    let t0 = Instant::now();
    let err = alloc.empty_cache().unwrap_err();
    assert!(matches!(err, AllocError::Timeout { .. }), "{err}");
    let err = alloc.allocate(30 * MIB, s1).unwrap_err();
    assert!(matches!(err, AllocError::Timeout { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    h.release(1);
    h.synchronize(1);
    let b = alloc.allocate(30 * MIB, s1).unwrap();
    check_invariants(&alloc, &[&b]);
}

#[test]
fn stream_work_may_free_blocks_while_the_allocator_waits() {
    // The out-of-memory retry waits for record-stream events; the stream work before them
    // drops a block (taking the allocator's lock). The wait must not hold the lock.
    let h = HostHarness::new(BIG);
    let alloc = h.allocator(
        AllocatorConfig::default()
            .with_memory_limit(MemoryLimit::Bytes(60 * MIB))
            .with_sync_timeout(Duration::from_secs(10)),
    );
    let (s0, s1) = (h.stream(0), h.stream(1));
    let held = alloc.allocate(4 * MIB, s1).unwrap();
    h.stall(1, Duration::from_millis(100));
    s1.enqueue(move || drop(held)).unwrap();
    let a = alloc.allocate(30 * MIB, s0).unwrap();
    a.record_stream(s1).unwrap();
    drop(a);
    let t0 = Instant::now();
    let b = alloc.allocate(30 * MIB, s0).unwrap(); // 30 + 20 + 30 > 60: retry
    assert!(t0.elapsed() < Duration::from_secs(5));
    let st = alloc.memory_stats();
    assert_eq!((st.num_alloc_retries, st.num_ooms), (1, 0));
    check_invariants(&alloc, &[&b]);
}

#[test]
#[cfg_attr(miri, ignore = "too long for Miri")]
fn many_threads_share_one_allocator() {
    let h = HostHarness::new(BIG);
    let alloc = h.allocator(AllocatorConfig::default());
    let shared = Stream::cpu("shared");
    thread::scope(|scope| {
        for t in 0..4u64 {
            let alloc = alloc.clone();
            let shared = shared.clone();
            scope.spawn(move || {
                let own = Stream::inline(format!("t{t}"));
                let mut held: Vec<HostBlock> = Vec::new();
                let mut x = t * 7919 + 1;
                for i in 0..3000u64 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let size = ((x >> 33) % (3 * MIB as u64)) as usize;
                    let stream = if i % 3 == 0 { &shared } else { &own };
                    let b = alloc.allocate(size, stream).unwrap();
                    let tag = (t as u8) << 4 | (i % 16) as u8;
                    // SAFETY: the handle owns at least one byte of host memory here.
                    unsafe { b.as_ptr().write(tag) };
                    if i % 5 == 0 {
                        b.record_stream(&shared).unwrap();
                    }
                    held.push(b);
                    if held.len() > 8 {
                        let b = held.swap_remove((x % 8) as usize);
                        drop(b);
                    }
                    for b in &held {
                        // SAFETY: as above; no other thread touches a live block.
                        let v = unsafe { b.as_ptr().read() };
                        assert_eq!(v >> 4, t as u8, "a block was handed to two threads");
                    }
                }
            });
        }
    });
    alloc.process_events().unwrap();
    check_invariants::<HostSource>(&alloc, &[]);
    let st: MemoryStats = alloc.memory_stats();
    assert_eq!(st.allocation.all.allocated, 12_000);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.source().used(), 0);
}

#[test]
fn dropping_the_allocator_waits_for_pending_blocks() {
    let h = HostHarness::new(BIG);
    let alloc = h.allocator(AllocatorConfig::default());
    let source_used = {
        let a = alloc.allocate(MIB, h.stream(0)).unwrap();
        h.busy(1, Duration::from_millis(30));
        a.record_stream(h.stream(1)).unwrap();
        drop(a);
        alloc.source().used()
    };
    assert_eq!(source_used, 2 * MIB);
    assert!(!h.stream(1).query());
    drop(alloc); // waits for stream 1's work before freeing the segment
    assert!(h.stream(1).query());
}

#[test]
fn hundreds_of_free_blocks_in_one_pool() {
    // Beyond a few hundred cached blocks the pool's free list changes representation.
    let h = HostHarness::new(BIG);
    let alloc = h.allocator(AllocatorConfig::default());
    let s = h.stream(0);
    let mut blocks: Vec<Option<HostBlock>> = (0..1200)
        .map(|_| Some(alloc.allocate(512, s).unwrap()))
        .collect();
    for b in blocks.iter_mut().skip(1).step_by(2) {
        b.take(); // 600 separate 512-byte holes
    }
    let st = alloc.memory_stats();
    assert_eq!(st.inactive_split.small_pool.current, 600); // the last hole joined the rest
    let live: Vec<&HostBlock> = blocks.iter().flatten().collect();
    check_invariants(&alloc, &live);
    // Best fit: the holes, lowest address first, before the segment's large rest.
    let first_hole = blocks[1]
        .is_none()
        .then(|| blocks[0].as_ref().unwrap().addr() + 512);
    let refill: Vec<HostBlock> = (0..500).map(|_| alloc.allocate(512, s).unwrap()).collect();
    assert_eq!(Some(refill[0].addr()), first_hole);
    let mut live: Vec<&HostBlock> = blocks.iter().flatten().collect();
    live.extend(refill.iter());
    check_invariants(&alloc, &live);
    drop(refill);
    blocks.clear();
    check_invariants::<HostSource>(&alloc, &[]);
    assert_eq!(alloc.snapshot().segments[0].blocks.len(), 1);
}
