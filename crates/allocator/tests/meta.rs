//! The allocator over [`MetaSource`] (no memory, fake addresses): every shared scenario holds on
//! it, and it makes exactly the decisions of the allocator over real host memory — the same
//! statistics, block sizes and offsets inside segments, retries and out-of-memory errors — so
//! that a plan run on the meta device predicts the memory of the real run.

mod common;

use std::collections::HashMap;
use std::sync::Mutex;

use common::*;
use fsdp_allocator::{
    AllocError, AllocatorConfig, Block, BlockState, CachingAllocator, HostAllocator, HostSource,
    MemoryLimit, MemorySource, MetaAllocator, MetaBlock, MetaSource, PoolKind, Snapshot,
    SEGMENT_ALIGN,
};
use fsdp_device::{DType, Device, DeviceError, Stream};
use proptest::prelude::*;

/// No memory: the bytes that the scenarios write into blocks are kept in a map keyed by (fake)
/// address, so that overlapping live blocks would still be caught.
#[derive(Default)]
struct MetaMemory(Mutex<HashMap<u64, u8>>);

/// The addresses of the first and last (up to) [`PATTERN`] bytes of the block.
fn pattern_addrs(b: &MetaBlock) -> impl Iterator<Item = u64> {
    let (start, size) = (b.addr(), b.size() as u64);
    let n = (PATTERN as u64).min(size);
    (start..start + n).chain(start + size - n..start + size)
}

impl CpuMemory for MetaMemory {
    type Src = MetaSource;

    fn source(capacity: usize) -> MetaSource {
        MetaSource::new(capacity)
    }

    fn write_pattern(&self, b: &MetaBlock, byte: u8) {
        let mut mem = self.0.lock().unwrap();
        for a in pattern_addrs(b) {
            mem.insert(a, byte);
        }
    }

    fn check_pattern(&self, b: &MetaBlock, byte: u8) -> bool {
        let mem = self.0.lock().unwrap();
        pattern_addrs(b).all(|a| mem.get(&a) == Some(&byte))
    }
}

/// Three worker streams and gates to hold them up, as in the host tests, over no memory.
type MetaHarness = CpuHarness<MetaMemory>;

const BIG: usize = 1 << 36;

// ---- The shared scenarios, on the meta source ----------------------------------------------

proptest! {
    #![proptest_config(proptest_config(12))]

    #[test]
    fn random_ops_keep_every_invariant(ops in prop::collection::vec(op_strategy(), ops_len(300))) {
        let summary = random_ops_scenario(&MetaHarness::new(BIG), &ops);
        prop_assert_eq!(summary.ooms, 0);
    }

    #[test]
    fn random_ops_under_a_memory_limit(ops in prop::collection::vec(op_strategy(), ops_len(250))) {
        random_ops_limited_scenario(&MetaHarness::new(BIG), &ops);
    }
}

#[test]
#[cfg_attr(miri, ignore = "too long for Miri")]
fn paper_scenario_rate_limiter_removes_retries() {
    paper_scenario_both(&MetaHarness::new(BIG), "meta");
}

#[test]
fn out_of_memory_error_and_message() {
    oom_scenario(&MetaHarness::new(BIG));
}

#[test]
fn max_split_size_rules() {
    max_split_scenario(&MetaHarness::new(BIG));
}

#[test]
fn snapshot_json_round_trip() {
    snapshot_scenario(&MetaHarness::new(BIG));
}

#[test]
fn pools_are_per_stream_and_record_stream_holds_blocks() {
    per_stream_scenario(&MetaHarness::new(BIG));
}

// ---- Host and meta side by side --------------------------------------------------------------

/// A block without its address: its segment (size, stream, pool), its offset in the segment, its
/// size, requested size and state.
type Canon = ((u64, u64, PoolKind), u64, u64, u64, BlockState);

/// A block of a segment: (offset, size, requested size, state).
type CanonBlock = (u64, u64, u64, BlockState);
/// A segment: (size, stream, pool, blocks).
type CanonSegment = (u64, u64, PoolKind, Vec<CanonBlock>);

/// Every segment with its blocks, sorted: the snapshot with the addresses taken out.
fn canonical(snap: &Snapshot) -> Vec<CanonSegment> {
    let mut segs: Vec<_> = snap
        .segments
        .iter()
        .map(|s| {
            let blocks = s
                .blocks
                .iter()
                .map(|b| (b.address - s.address, b.size, b.requested_size, b.state))
                .collect();
            (s.total_size, s.stream, s.segment_type, blocks)
        })
        .collect();
    segs.sort_by_key(|(size, stream, pool, blocks)| {
        (*size, *stream, *pool as u8, format!("{blocks:?}"))
    });
    segs
}

/// The live block `b` as seen in `snap`, without its address.
fn locate<S: MemorySource>(snap: &Snapshot, b: &Block<S>) -> Canon {
    for s in &snap.segments {
        for blk in &s.blocks {
            if blk.address == b.addr() {
                return (
                    (s.total_size, s.stream, s.segment_type),
                    blk.address - s.address,
                    blk.size,
                    blk.requested_size,
                    blk.state,
                );
            }
        }
    }
    panic!("block {b:?} is not in the snapshot");
}

/// An error with the device taken out (the messages differ only in "cpu" / "meta").
fn devless(e: &AllocError) -> String {
    match e {
        AllocError::OutOfMemory {
            requested,
            allocation_size,
            allocated,
            reserved,
            device_total,
            device_free,
            limit,
            ..
        } => {
            format!(
                "oom {requested} {allocation_size} {allocated} {reserved} {device_total} \
                 {device_free} {limit:?}"
            )
        }
        e => e.to_string(),
    }
}

/// One step of the side-by-side workload.
#[derive(Clone, Debug)]
enum Step {
    Alloc { stream: usize, size: usize },
    Free { pick: usize },
    Record { pick: usize, stream: usize },
    EmptyCache,
}

/// Sizes from 1 B to 40 MiB, spread over every pool rule: small, large below 10 MiB, large of
/// their own size, and powers of two (exact fits).
fn size_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 1usize..=64 << 10,
        4 => (64 << 10)..=MIB,
        3 => MIB + 1..10 * MIB,
        2 => 10 * MIB..=40 * MIB,
        1 => (0u32..=25).prop_map(|k| 1usize << k),
    ]
}

fn step_strategy() -> impl Strategy<Value = Step> {
    prop_oneof![
        45 => (0..2usize, size_strategy()).prop_map(|(stream, size)| Step::Alloc { stream, size }),
        35 => any::<usize>().prop_map(|pick| Step::Free { pick }),
        10 => (any::<usize>(), 0..2usize).prop_map(|(pick, stream)| Step::Record { pick, stream }),
        1 => Just(Step::EmptyCache),
    ]
}

/// Run `steps` on a host and a meta allocator of the same capacity and configuration, on the
/// same two streams (inline: record-stream events complete at once, so nothing depends on
/// timing), and check after every step that they agree on everything but addresses: the
/// result of each call, every statistic, the segments and blocks, and where each live block
/// sits in its segment. Returns (allocations, out-of-memory errors, retries).
fn host_and_meta_agree(
    capacity: usize,
    config: AllocatorConfig,
    steps: &[Step],
) -> (usize, usize, u64) {
    let host = HostAllocator::new(HostSource::new(capacity), config).unwrap();
    let meta = MetaAllocator::new(MetaSource::new(capacity), config).unwrap();
    let streams = [Stream::inline("a"), Stream::inline("b")];
    let mut live: Vec<(Block<HostSource>, MetaBlock)> = Vec::new();
    let (mut allocs, mut ooms) = (0, 0);
    for (i, step) in steps.iter().enumerate() {
        match *step {
            Step::Alloc { stream, size } => {
                let h = host.allocate(size, &streams[stream]);
                let m = meta.allocate(size, &streams[stream]);
                match (h, m) {
                    (Ok(h), Ok(m)) => {
                        assert_eq!(m.device(), Device::Meta);
                        assert_eq!(m.addr() as usize % SEGMENT_ALIGN, 0);
                        assert_eq!(
                            (h.size(), h.requested_size(), h.pool()),
                            (m.size(), m.requested_size(), m.pool()),
                            "step {i}: {step:?}"
                        );
                        allocs += 1;
                        live.push((h, m));
                    }
                    (Err(h), Err(m)) => {
                        assert!(matches!(h, AllocError::OutOfMemory { .. }), "{h}");
                        assert_eq!(devless(&h), devless(&m), "step {i}: {step:?}");
                        assert!(m.to_string().starts_with("meta out of memory"), "{m}");
                        ooms += 1;
                    }
                    (h, m) => panic!("step {i} ({step:?}): host gave {h:?}, meta gave {m:?}"),
                }
            }
            Step::Free { pick } => {
                if !live.is_empty() {
                    let pair = live.swap_remove(pick % live.len());
                    drop(pair);
                }
            }
            Step::Record { pick, stream } => {
                if !live.is_empty() {
                    let n = live.len();
                    let (h, m) = &live[pick % n];
                    h.record_stream(&streams[stream]).unwrap();
                    m.record_stream(&streams[stream]).unwrap();
                }
            }
            Step::EmptyCache => {
                host.empty_cache().unwrap();
                meta.empty_cache().unwrap();
            }
        }
        assert_eq!(
            host.memory_stats(),
            meta.memory_stats(),
            "step {i}: {step:?}"
        );
        let (hs, ms) = (host.snapshot(), meta.snapshot());
        assert_eq!(canonical(&hs), canonical(&ms), "step {i}: {step:?}");
        for (h, m) in &live {
            assert_eq!(locate(&hs, h), locate(&ms, m), "step {i}: {step:?}");
        }
    }
    assert_eq!(host.source().used(), meta.source().used());
    drop(live);
    host.empty_cache().unwrap();
    meta.empty_cache().unwrap();
    assert_eq!(host.memory_stats(), meta.memory_stats());
    assert_eq!((host.source().used(), meta.source().used()), (0, 0));
    let retries = meta.memory_stats().num_alloc_retries;
    (allocs, ooms, retries)
}

proptest! {
    #![proptest_config(proptest_config(24))]

    /// Plenty of memory: caching, splitting and merging.
    #[test]
    fn same_decisions_as_host_memory(steps in prop::collection::vec(step_strategy(), ops_len(400))) {
        host_and_meta_agree(4 << 30, AllocatorConfig::default(), &steps);
    }

    /// At the source's capacity: retries and out-of-memory errors.
    #[test]
    fn same_decisions_at_the_capacity(steps in prop::collection::vec(step_strategy(), ops_len(400))) {
        host_and_meta_agree(128 * MIB, AllocatorConfig::default(), &steps);
    }

    /// Under a memory limit with `max_split_size`: oversize blocks released first.
    #[test]
    fn same_decisions_under_a_limit_with_max_split_size(
        steps in prop::collection::vec(step_strategy(), ops_len(400))
    ) {
        let config = AllocatorConfig::default()
            .with_memory_limit(MemoryLimit::Bytes(100 * MIB))
            .with_max_split_size(24 * MIB);
        host_and_meta_agree(4 << 30, config, &steps);
    }
}

#[test]
#[cfg_attr(miri, ignore = "too long for Miri")]
fn a_long_run_at_the_capacity_exercises_retries_and_out_of_memory() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let steps = prop::collection::vec(step_strategy(), ops_len(3000))
        .new_tree(&mut runner)
        .unwrap()
        .current();
    let (allocs, ooms, retries) = host_and_meta_agree(96 * MIB, AllocatorConfig::default(), &steps);
    println!("3000 steps: {allocs} allocations, {ooms} out-of-memory errors, {retries} retries");
    assert!(allocs > 500 && ooms > 0 && retries > ooms as u64);
}

#[test]
fn out_of_memory_and_retries_match_at_the_capacity() {
    fn run<S: MemorySource<Stream = Stream>>(alloc: &CachingAllocator<S>) -> Vec<String> {
        let s = Stream::inline("s");
        let mut log = Vec::new();
        let a = alloc.allocate(30 * MIB, &s).unwrap(); // a 30 MiB segment
        drop(a); // cached
        let b = alloc.allocate(40 * MIB, &s).unwrap(); // 30 + 40 > 64: free the cache, retry
        let st = alloc.memory_stats();
        log.push(format!("{:?}", (st.num_alloc_retries, st.num_ooms)));
        let err = alloc.allocate(40 * MIB, &s).unwrap_err(); // 40 + 40 > 64 even after a retry
        log.push(devless(&err));
        let st = alloc.memory_stats();
        log.push(format!("{:?}", (st.num_alloc_retries, st.num_ooms)));
        drop(b);
        log.push(format!("{:?}", alloc.memory_stats()));
        log
    }
    let host = HostAllocator::new(HostSource::new(64 * MIB), AllocatorConfig::default()).unwrap();
    let meta = MetaAllocator::new(MetaSource::new(64 * MIB), AllocatorConfig::default()).unwrap();
    let (h, m) = (run(&host), run(&meta));
    assert_eq!(h, m);
    assert_eq!(h[0], "(1, 0)");
    assert_eq!(h[2], "(2, 1)");
    let err = meta.allocate(80 * MIB, &Stream::inline("s")).unwrap_err();
    assert!(
        err.to_string().starts_with(
            "meta out of memory. Tried to allocate 80.00 MiB. Device meta has a total capacity \
             of 64.00 MiB of which 64.00 MiB is free."
        ),
        "{err}"
    );
}

#[test]
fn meta_blocks_are_meta_buffers_that_refuse_host_access() {
    let alloc = MetaAllocator::new(MetaSource::new(BIG), AllocatorConfig::default()).unwrap();
    let s = Stream::inline("s");
    let buf = alloc.allocate_buffer(DType::F32, 1000, &s).unwrap();
    assert_eq!(
        (buf.device(), buf.len(), buf.byte_len()),
        (Device::Meta, 1000, 4000)
    );
    assert_eq!(alloc.memory_stats().allocated_bytes.all.current, 4096);
    let err = buf.to_vec::<f32>().unwrap_err();
    assert_eq!(
        err,
        DeviceError::Unsupported {
            op: "host access to a buffer",
            device: "meta".into()
        }
    );
    assert_eq!(
        err.to_string(),
        "host access to a buffer is not supported on meta"
    );
    assert!(buf.read::<f32>().is_err());
    assert!(buf.write::<f32>().is_err());
    assert!(buf.copy_from_slice(&[0.0f32; 1000]).is_err());
    // Slices and access tickets work as on any buffer.
    let half = buf.slice(500..1000).unwrap();
    assert!(half.overlaps(&buf));
    drop((buf, half));
    assert_eq!(alloc.memory_stats().allocated_bytes.all.current, 0);

    // A shared block's buffers are meta too, and the block stays allocated while they live.
    let block = std::sync::Arc::new(alloc.allocate(8192, &s).unwrap());
    let shared = MetaBlock::shared_buffer(&block, DType::F64).unwrap();
    assert_eq!((shared.device(), shared.len()), (Device::Meta, 1024));
    assert!(shared.to_vec::<f64>().is_err());
    drop(block);
    assert_eq!(alloc.memory_stats().allocation.all.current, 1);
    drop(shared);
    assert_eq!(alloc.memory_stats().allocation.all.current, 0);
}
