//! The caching allocator on real CUDA streams (feature `cuda`, GPU): statistics and snapshot as
//! on the host source, `record_stream` against a busy stream (and its negative control), and
//! destroyed streams that still own cached blocks. Without a CUDA driver or GPU each test prints
//! that it skipped and passes.
#![cfg(feature = "cuda")]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, CudaContext, CudaStream};
use fsdp_allocator::cuda::{CudaAllocator, CudaSource};
use fsdp_allocator::{
    AllocatorConfig, CachingAllocator, HostAllocator, HostSource, MemorySource, MemoryStats,
    Snapshot,
};
use fsdp_device::Stream;

const MIB: usize = 1 << 20;

/// The allocator of GPU 0 and two of its streams, or `None` after printing why the test skipped.
fn cuda(test: &str) -> Option<(CudaAllocator, [Arc<CudaStream>; 2])> {
    match CudaSource::new(0) {
        Ok(src) => {
            let s = || {
                Stream::cuda(0, test)
                    .expect("a CUDA stream")
                    .cuda_stream()
                    .expect("a CUDA stream")
                    .clone()
            };
            let streams = [s(), s()];
            Some((
                CudaAllocator::new(src, AllocatorConfig::default()).unwrap(),
                streams,
            ))
        }
        Err(e) => {
            println!("{test}: skipped: no usable GPU ({e})");
            None
        }
    }
}

/// A segment without addresses: (stream index, size, pool, blocks as (offset, size, requested,
/// state)).
type NormSegment = (usize, u64, String, Vec<(u64, u64, u64, String)>);

/// A snapshot without addresses: stream keys as the index of the stream in `keys`, block
/// addresses relative to their segment, segments sorted (their addresses differ between sources).
fn normalized(snap: &Snapshot, keys: &[u64]) -> Vec<NormSegment> {
    let mut segs: Vec<NormSegment> = snap
        .segments
        .iter()
        .map(|s| {
            let stream = keys
                .iter()
                .position(|&k| k == s.stream)
                .expect("a known stream");
            let blocks = s
                .blocks
                .iter()
                .map(|b| {
                    (
                        b.address - s.address,
                        b.size,
                        b.requested_size,
                        format!("{:?}", b.state),
                    )
                })
                .collect();
            (
                stream,
                s.total_size,
                format!("{:?}", s.segment_type),
                blocks,
            )
        })
        .collect();
    segs.sort();
    segs
}

/// A scripted sequence (small and large pools, a split, reuse, a `record_stream` free that
/// completes before the next allocation, `empty_cache`), returning the statistics and the
/// normalised snapshot after each step. `settle(i)` waits until stream `i` is idle.
fn script<S: MemorySource>(
    alloc: &CachingAllocator<S>,
    streams: [&S::Stream; 2],
    settle: impl Fn(usize),
) -> Vec<(MemoryStats, String)> {
    let keys = [S::stream_key(streams[0]), S::stream_key(streams[1])];
    let mut seen = Vec::new();
    let mut step = |alloc: &CachingAllocator<S>| {
        let snap = format!("{:?}", normalized(&alloc.snapshot(), &keys));
        seen.push((alloc.memory_stats(), snap));
    };
    let a = alloc.allocate(1000, streams[0]).unwrap();
    let b = alloc.allocate(3 * MIB, streams[0]).unwrap();
    let c = alloc.allocate(12 * MIB, streams[1]).unwrap();
    step(alloc);
    drop(a);
    let d = alloc.allocate(600, streams[0]).unwrap();
    step(alloc);
    b.record_stream(streams[1]).unwrap();
    drop(b);
    step(alloc);
    settle(1);
    let e = alloc.allocate(2 * MIB, streams[0]).unwrap();
    step(alloc);
    drop((c, d, e));
    step(alloc);
    alloc.empty_cache().unwrap();
    step(alloc);
    seen
}

#[test]
fn cuda_memory_stats_and_snapshot_match_the_host() {
    let Some((alloc, streams)) = cuda("cuda_memory_stats_and_snapshot_match_the_host") else {
        return;
    };
    let on_cuda = script(&alloc, [&streams[0], &streams[1]], |i| {
        streams[i].synchronize().unwrap();
    });
    let host = HostAllocator::new(HostSource::new(1 << 30), AllocatorConfig::default()).unwrap();
    let hs = [Stream::cpu("h0"), Stream::cpu("h1")];
    let on_host = script(&host, [&hs[0], &hs[1]], |i| hs[i].synchronize().unwrap());
    assert_eq!(on_cuda.len(), on_host.len());
    for (i, (c, h)) in on_cuda.iter().zip(&on_host).enumerate() {
        assert_eq!(c.0, h.0, "statistics differ after step {i}");
        assert_eq!(c.1, h.1, "snapshots differ after step {i}");
    }
    let last = &on_cuda.last().unwrap().0;
    assert_eq!(
        last.reserved_bytes.all.current, 0,
        "empty_cache released everything"
    );
}

/// Device memory (from `cuMemAlloc`, outside the allocator and holding no stream) that keeps a
/// stream busy for a while with memsets.
struct Busy {
    ctx: Arc<CudaContext>,
    ptr: u64,
    rounds: usize,
}

const BUSY_BYTES: usize = 256 * MIB;

impl Busy {
    /// Size the work on `s`: memsets of 256 MiB, doubling their number until one batch takes at
    /// least `ms` milliseconds.
    fn new(s: &Arc<CudaStream>, ms: u64) -> Busy {
        let ctx = s.context().clone();
        ctx.bind_to_thread().unwrap();
        // SAFETY: the context is current; the memory is freed once, in Drop.
        let ptr = unsafe { result::malloc_sync(BUSY_BYTES) }.unwrap();
        let mut busy = Busy {
            ctx,
            ptr,
            rounds: 4,
        };
        loop {
            let t = Instant::now();
            busy.launch(s);
            s.synchronize().unwrap();
            if t.elapsed() >= Duration::from_millis(ms) || busy.rounds >= 1 << 16 {
                return busy;
            }
            busy.rounds *= 2;
        }
    }

    /// Queue the memsets on `s` (returns at once).
    fn launch(&self, s: &Arc<CudaStream>) {
        self.ctx.bind_to_thread().unwrap();
        for _ in 0..self.rounds {
            // SAFETY: `ptr` holds BUSY_BYTES of device memory until Drop, which synchronises
            // the context first.
            unsafe { result::memset_d8_async(self.ptr, 0, BUSY_BYTES, s.cu_stream()) }.unwrap();
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: queued memsets finish before the memory is freed (the context is
        // synchronised; the test is the only user of this GPU's streams then).
        unsafe {
            let _ = result::ctx::synchronize();
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// Queue a long memset of the block's first byte range on `s` after the busy work.
fn write_block_on(s: &Arc<CudaStream>, addr: u64, bytes: usize) {
    s.context().bind_to_thread().unwrap();
    // SAFETY: `addr` is a live block of at least `bytes` bytes of device memory of this
    // context, held by the caller until the memset is queued and (with record_stream) done.
    unsafe { result::memset_d8_async(addr, 0xab, bytes, s.cu_stream()) }.unwrap();
}

#[test]
fn cuda_record_stream_keeps_the_block_until_the_stream_finished() {
    let Some((alloc, [a, b])) =
        cuda("cuda_record_stream_keeps_the_block_until_the_stream_finished")
    else {
        return;
    };
    let busy = Busy::new(&b, 200);
    for with_record in [true, false] {
        alloc.empty_cache().unwrap();
        let blk = alloc.allocate(4 * MIB, &a).unwrap();
        let first = blk.addr();
        // Stream B: a long run of memsets, then a write of the block.
        busy.launch(&b);
        write_block_on(&b, first, 4 * MIB);
        let done = b.record_event(None).unwrap();
        if with_record {
            blk.record_stream(&b).unwrap();
        }
        drop(blk);
        let again = alloc.allocate(4 * MIB, &a).unwrap();
        let b_finished = done.try_is_complete().unwrap();
        assert!(!b_finished, "the busy work was too short to show anything");
        if with_record {
            assert_ne!(
                again.addr(),
                first,
                "a block still used by stream B was handed out"
            );
            drop(again);
            b.synchronize().unwrap();
            alloc.process_events().unwrap();
            let after = alloc.allocate(4 * MIB, &a).unwrap();
            assert_eq!(
                after.addr(),
                first,
                "the block came back once stream B finished"
            );
        } else {
            // Negative control: without record_stream the allocator cannot know about B.
            assert_eq!(again.addr(), first, "the cached block is reused at once");
            drop(again);
            b.synchronize().unwrap();
        }
    }
}

#[test]
fn cuda_destroyed_stream_keeps_its_blocks_from_new_streams() {
    let Some((alloc, _)) = cuda("cuda_destroyed_stream_keeps_its_blocks_from_new_streams") else {
        return;
    };
    let ctx = alloc.source().context().clone();
    let old = ctx.new_stream().unwrap();
    let busy = Busy::new(&old, 100);
    let blk = alloc.allocate(8 * MIB, &old).unwrap();
    let (addr, old_key) = (blk.addr(), CudaSource::stream_key(&old));
    busy.launch(&old);
    write_block_on(&old, addr, 8 * MIB);
    drop(blk); // cached in the old stream's pool, still written by its queued work
    let weak = Arc::downgrade(&old);
    drop(old);
    assert!(
        weak.upgrade().is_some(),
        "the allocator keeps the stream alive"
    );
    // New streams never get the old key (so never its pool) while it is held.
    let mut keys = BTreeMap::new();
    for i in 0..64 {
        let s = ctx.new_stream().unwrap();
        let key = CudaSource::stream_key(&s);
        assert_ne!(
            key, old_key,
            "new stream {i} got the handle of a live stream"
        );
        let got = alloc.allocate(8 * MIB, &s).unwrap();
        assert_ne!(
            got.addr(),
            addr,
            "new stream {i} got a block of the old stream"
        );
        keys.insert(key, s);
    }
    drop(keys);
    // Once its work finished and its memory was released, the stream is let go.
    weak.upgrade().unwrap().synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert!(
        weak.upgrade().is_none(),
        "the stream is dropped once it owns no memory"
    );
    assert_eq!(alloc.source().streams_held(), 0);
}

#[test]
fn cuda_release_completed_does_not_wait_for_pending_events() {
    let Some((alloc, [a, b])) = cuda("cuda_release_completed_does_not_wait_for_pending_events")
    else {
        return;
    };
    let busy = Busy::new(&b, 200);
    let blk = alloc.allocate(4 * MIB, &a).unwrap();
    busy.launch(&b);
    write_block_on(&b, blk.addr(), 4 * MIB);
    let done = b.record_event(None).unwrap();
    blk.record_stream(&b).unwrap();
    drop(blk);
    // Nothing is releasable (the only segment holds a pending block), so no cuMemFree (which
    // may synchronise the device) is made: the call must return while B still runs.
    let t = Instant::now();
    alloc.release_completed().unwrap();
    let took = t.elapsed();
    assert!(
        !done.try_is_complete().unwrap(),
        "release_completed waited for stream B"
    );
    assert!(
        took < Duration::from_millis(50),
        "release_completed took {took:?}"
    );
    let st = alloc.memory_stats();
    assert_eq!(st.reserved_bytes.all.current, 20 * MIB as u64, "{st:?}");
    assert_eq!(
        st.active.all.current, 1,
        "the block is still pending: {st:?}"
    );
    // Once B finished, the same call returns the block and frees its segment.
    b.synchronize().unwrap();
    alloc.release_completed().unwrap();
    let st = alloc.memory_stats();
    assert_eq!(st.reserved_bytes.all.current, 0, "{st:?}");
    assert_eq!(alloc.source().streams_held(), 0);
}
