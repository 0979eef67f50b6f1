//! Stream-ordered buffers over allocator blocks (`Block::into_ordered_buffer`) on CPU streams:
//! a block returns to the allocator only after the work issued on it, on any stream, completed.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use fsdp_allocator::{AllocatorConfig, HostAllocator, HostSource};
use fsdp_device::{AccessMode, DType, Stream};

fn allocated(alloc: &HostAllocator) -> u64 {
    alloc.memory_stats().allocation.all.current
}

#[test]
#[cfg_attr(
    miri,
    ignore = "under Miri a release waits in place (no reaper thread): this drop would wait for the gate it opens"
)]
fn an_ordered_block_is_reused_only_after_its_work_completed() {
    let alloc = HostAllocator::new(HostSource::new(1 << 30), AllocatorConfig::default()).unwrap();
    let (home, other) = (Stream::cpu("home"), Stream::cpu("other"));
    let block = alloc.allocate(4096, &home).unwrap();
    let first = block.addr();
    let buf = block.into_ordered_buffer(DType::F32).unwrap();
    assert_eq!(buf.len(), 1024);

    // Work on a stream the allocator was never told of writes the block, held up by a gate.
    let (go, gate) = mpsc::channel::<()>();
    let u = buf.use_on(&other, AccessMode::Exclusive).unwrap();
    let p = u.device_ptr() as usize;
    other
        .enqueue(move || {
            gate.recv_timeout(Duration::from_secs(20)).unwrap();
            // SAFETY: 1024 f32 of the block, which lives until this work completed.
            unsafe { std::slice::from_raw_parts_mut(p as *mut f32, 1024).fill(1.5) }
        })
        .unwrap();
    u.finish();
    drop(buf);

    // Still allocated: a new block of the same size on the same stream is another one.
    assert_eq!(allocated(&alloc), 1);
    let second = alloc.allocate(4096, &home).unwrap();
    assert_ne!(second.addr(), first, "reused under pending work");
    drop(second);

    go.send(()).unwrap();
    let start = Instant::now();
    while allocated(&alloc) != 0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the block never returned"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Back in its stream's pool, merged with the rest of its segment: the next allocation
    // there takes it.
    let again = alloc.allocate(4096, &home).unwrap();
    assert_eq!(again.addr(), first);
}

#[test]
fn ordered_blocks_refuse_host_access() {
    let alloc = HostAllocator::new(HostSource::new(1 << 30), AllocatorConfig::default()).unwrap();
    let home = Stream::cpu("home");
    let buf = alloc
        .allocate(64, &home)
        .unwrap()
        .into_ordered_buffer(DType::F32)
        .unwrap();
    let e = buf.read::<f32>().unwrap_err().to_string();
    assert!(e.contains("stream-ordered"), "{e}");
}
