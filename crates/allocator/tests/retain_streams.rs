//! `MemorySource::retain_streams` on the host: a source that holds every stream it has seen (as
//! the CUDA source does, so that a destroyed stream's key is never reused while it owns memory)
//! is told after each release of cached memory which streams still own segments or pending
//! record-stream events.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Mutex;
use std::time::Duration;

use fsdp_allocator::{AllocError, AllocatorConfig, CachingAllocator, HostSource, MemorySource};
use fsdp_device::{Device, Event, Stream};

const MIB: usize = 1 << 20;

/// The host source, holding its streams as `CudaSource` does.
struct Holding {
    inner: HostSource,
    held: Mutex<BTreeMap<u64, Stream>>,
}

impl Holding {
    fn held(&self) -> Vec<u64> {
        self.held.lock().unwrap().keys().copied().collect()
    }
}

// SAFETY: every memory and event call is forwarded to the host source, which upholds the
// contract; stream keys are the host source's (process-unique stream ids).
unsafe impl MemorySource for Holding {
    type Stream = Stream;
    type Event = Event;

    fn device(&self) -> Device {
        self.inner.device()
    }
    fn total_memory(&self) -> usize {
        self.inner.total_memory()
    }
    fn free_memory(&self) -> usize {
        self.inner.free_memory()
    }
    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>, AllocError> {
        self.inner.allocate(bytes)
    }
    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize) {
        // SAFETY: forwarded from the allocator, which upholds `free`'s contract.
        unsafe { self.inner.free(ptr, bytes) }
    }
    fn stream_key(stream: &Stream) -> u64 {
        HostSource::stream_key(stream)
    }
    fn validate_stream(&self, stream: &Stream) -> Result<(), AllocError> {
        self.inner.validate_stream(stream)?;
        self.held
            .lock()
            .unwrap()
            .entry(Self::stream_key(stream))
            .or_insert_with(|| stream.clone());
        Ok(())
    }
    fn record_event(&self, stream: &Stream) -> Result<Event, AllocError> {
        self.inner.record_event(stream)
    }
    fn retain_streams(&self, owns: &dyn Fn(u64) -> bool) {
        self.held.lock().unwrap().retain(|k, _| owns(*k));
    }
    fn query_event(&self, event: &Event) -> Result<bool, AllocError> {
        self.inner.query_event(event)
    }
    fn synchronize_event(&self, event: &Event, timeout: Duration) -> Result<(), AllocError> {
        self.inner.synchronize_event(event, timeout)
    }
}

#[test]
fn streams_are_held_while_they_own_segments_or_pending_events() {
    let source = Holding {
        inner: HostSource::new(1 << 30),
        held: Mutex::new(BTreeMap::new()),
    };
    let alloc = CachingAllocator::new(source, AllocatorConfig::default()).unwrap();
    let key = |s: &Stream| Holding::stream_key(s);
    let (s1, s2, s3) = (Stream::cpu("s1"), Stream::cpu("s2"), Stream::cpu("s3"));
    let kept = alloc.allocate(4 * MIB, &s1).unwrap();
    let cached = alloc.allocate(4 * MIB, &s2).unwrap();
    drop(cached);
    // s3 is busy until the gate closes; a block used there is freed with record_stream.
    let (gate, wait) = crossbeam_channel::bounded::<()>(0);
    s3.enqueue(move || {
        let _ = wait.recv_timeout(Duration::from_secs(20));
    })
    .unwrap();
    let used = alloc.allocate(MIB, &s1).unwrap();
    used.record_stream(&s3).unwrap();
    drop(used);
    let mut all = vec![key(&s1), key(&s2), key(&s3)];
    all.sort_unstable();
    assert_eq!(alloc.source().held(), all, "every stream seen is held");

    // s2's only segment is cached: released with it. s1 owns a segment in use; s3 a pending
    // record-stream event.
    alloc.release_completed().unwrap();
    let mut owners = vec![key(&s1), key(&s3)];
    owners.sort_unstable();
    assert_eq!(alloc.source().held(), owners);

    drop(gate);
    s3.synchronize().unwrap();
    drop(kept);
    alloc.release_completed().unwrap();
    assert!(alloc.source().held().is_empty(), "no stream owns memory");
    assert_eq!(alloc.memory_stats().reserved_bytes.all.current, 0);
}
