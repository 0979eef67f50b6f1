//! Memory sources: where the allocator's segments come from, and the streams and events that
//! `record_stream` uses.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use fsdp_device::{Device, DeviceError, Event, Stream};

use crate::AllocError;

/// Alignment of every segment a source hands out (the allocator's blocks are multiples of 512
/// bytes from a segment's start, so they keep it).
pub const SEGMENT_ALIGN: usize = 512;

/// A provider of raw memory segments, with the stream and event types of its device.
///
/// # Safety
/// The allocator hands the memory out as [`Block`](crate::Block)s that implement
/// [`fsdp_device::Storage`], so implementors guarantee that:
/// - [`allocate`](MemorySource::allocate) returns the address of `bytes` bytes, aligned to
///   [`SEGMENT_ALIGN`], that nothing else uses until they are passed to
///   [`free`](MemorySource::free); for [`Device::Cpu`] these are host bytes valid for reads and
///   writes and initialised (so that a [`Buffer`](fsdp_device::Buffer) may read them); for a
///   CUDA device, a device address; for [`Device::Meta`] the address is only an identifier,
///   never dereferenced (no bytes need exist: the allocator itself never reads or writes segment
///   memory, and buffers over meta blocks refuse host access), but distinct live segments must
///   still not overlap, since blocks are told apart and split by address;
/// - [`stream_key`](MemorySource::stream_key) gives distinct keys to distinct live streams;
/// - an event reports complete ([`query_event`](MemorySource::query_event) returns `true` or
///   [`synchronize_event`](MemorySource::synchronize_event) returns `Ok`) only once all work
///   enqueued on its stream before [`record_event`](MemorySource::record_event) has finished;
/// - with [`supports_expandable_segments`](MemorySource::supports_expandable_segments),
///   [`reserve_address_range`](MemorySource::reserve_address_range) returns a
///   [`SEGMENT_ALIGN`]-aligned range that overlaps no other range or segment, and after
///   [`map_range`](MemorySource::map_range) returns `Ok` its bytes are memory as
///   [`allocate`](MemorySource::allocate)'s (initialised host bytes for [`Device::Cpu`]) until
///   they are unmapped.
pub unsafe trait MemorySource: Send + Sync + 'static {
    /// The device's stream type.
    type Stream: Clone + Send + Sync + 'static;
    /// The device's event type.
    type Event: Send + Sync + 'static;

    /// The device the memory lives on.
    fn device(&self) -> Device;

    /// Total capacity in bytes (the base of a fractional memory limit).
    fn total_memory(&self) -> usize;

    /// Bytes the source could still provide (for out-of-memory messages).
    fn free_memory(&self) -> usize;

    /// Obtain a segment of `bytes` bytes. Lack of memory is reported as
    /// [`AllocError::SourceOutOfMemory`], which the allocator answers by freeing its cache and
    /// retrying.
    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>, AllocError>;

    /// Return a segment.
    ///
    /// # Safety
    /// `ptr` and `bytes` come from one successful [`allocate`](MemorySource::allocate) call, are
    /// freed once, and no work of any stream uses the memory any more.
    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize);

    /// The key of the stream's pool; blocks are only reused by requests on the same stream.
    fn stream_key(stream: &Self::Stream) -> u64;

    /// Reject a stream that does not belong to this source's device.
    fn validate_stream(&self, stream: &Self::Stream) -> Result<(), AllocError> {
        let _ = stream;
        Ok(())
    }

    /// Record an event at the current end of `stream`.
    fn record_event(&self, stream: &Self::Stream) -> Result<Self::Event, AllocError>;

    /// Called after cached memory was released, with whether a stream key still owns segments
    /// or pending record-stream events. A source that keeps its streams alive while they own
    /// memory (so that their keys cannot be reused by new streams) drops the others here.
    fn retain_streams(&self, _owns: &dyn Fn(u64) -> bool) {}

    /// Whether the event has completed, without waiting.
    fn query_event(&self, event: &Self::Event) -> Result<bool, AllocError>;

    /// Wait for the event, up to `timeout` ([`AllocError::Timeout`] past it).
    fn synchronize_event(&self, event: &Self::Event, timeout: Duration) -> Result<(), AllocError>;

    /// Whether the source can reserve address ranges and map memory into them (expandable
    /// segments). The default: no, and the other virtual-memory methods fail.
    fn supports_expandable_segments(&self) -> bool {
        false
    }

    /// Reserve `bytes` of address space with no memory behind it.
    fn reserve_address_range(&self, bytes: usize) -> Result<NonNull<u8>, AllocError> {
        Err(AllocError::InvalidArgument(format!(
            "{} has no virtual memory to reserve {bytes} bytes in",
            self.device()
        )))
    }

    /// Map `bytes` of memory at `offset` of a reserved range (lack of memory:
    /// [`AllocError::SourceOutOfMemory`]).
    ///
    /// # Safety
    /// `base` comes from [`reserve_address_range`](MemorySource::reserve_address_range) of a
    /// range that holds `offset..offset + bytes`, none of it mapped; both are multiples of the
    /// allocator's page size (2 MiB or 20 MiB).
    unsafe fn map_range(
        &self,
        base: NonNull<u8>,
        offset: usize,
        bytes: usize,
    ) -> Result<(), AllocError> {
        let _ = (base, offset);
        Err(AllocError::SourceOutOfMemory { bytes })
    }

    /// Unmap memory mapped by [`map_range`](MemorySource::map_range).
    ///
    /// # Safety
    /// `offset..offset + bytes` of the range at `base` was mapped by `map_range` calls (whole
    /// pages), and no work of any stream uses it any more.
    unsafe fn unmap_range(&self, base: NonNull<u8>, offset: usize, bytes: usize) {
        let _ = (base, offset, bytes);
    }

    /// Give back a reserved range.
    ///
    /// # Safety
    /// `base` and `bytes` come from one `reserve_address_range` call, nothing of it is mapped,
    /// and it is released once.
    unsafe fn release_address_range(&self, base: NonNull<u8>, bytes: usize) {
        let _ = (base, bytes);
    }
}

/// A capacity limit and the bytes handed out under it: the accounting of [`HostSource`] and
/// [`MetaSource`].
pub(crate) struct Capacity {
    pub(crate) capacity: usize,
    used: AtomicUsize,
}

impl Capacity {
    pub(crate) fn new(capacity: usize) -> Capacity {
        Capacity {
            capacity,
            used: AtomicUsize::new(0),
        }
    }

    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub(crate) fn free(&self) -> usize {
        self.capacity.saturating_sub(self.used())
    }

    /// Reserve `bytes`, or fail with [`AllocError::SourceOutOfMemory`] (reserving nothing).
    pub(crate) fn reserve(&self, bytes: usize) -> Result<(), AllocError> {
        if bytes == 0 {
            return Err(AllocError::InvalidArgument(
                "a segment of 0 bytes".to_string(),
            ));
        }
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                u.checked_add(bytes).filter(|&u| u <= self.capacity)
            })
            .map(|_| ())
            .map_err(|_| AllocError::SourceOutOfMemory { bytes })
    }

    /// Give back `bytes` reserved before.
    pub(crate) fn unreserve(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// The `Debug` of the source `name`, which shows its capacity and use.
    pub(crate) fn debug(&self, f: &mut fmt::Formatter<'_>, name: &str) -> fmt::Result {
        f.debug_struct(name)
            .field("capacity", &self.capacity)
            .field("used", &self.used())
            .finish()
    }
}

/// The [`MemorySource`] items of [`HostSource`] and [`MetaSource`] that do not depend on their
/// memory: their capacity (a [`Capacity`] in the field `limit`), and their streams and events,
/// fsdp-device's CPU [`Stream`]s (keyed by their process-unique ids) and [`Event`]s. Expanded
/// inside each `unsafe impl`, whose `// SAFETY:` comment answers for these items too.
macro_rules! capacity_and_cpu_streams {
    () => {
        type Stream = Stream;
        type Event = Event;

        fn total_memory(&self) -> usize {
            self.limit.capacity
        }

        fn free_memory(&self) -> usize {
            self.limit.free()
        }

        fn stream_key(stream: &Stream) -> u64 {
            stream.id().as_u64()
        }

        fn validate_stream(&self, stream: &Stream) -> Result<(), AllocError> {
            if stream.device() == Device::Cpu {
                Ok(())
            } else {
                Err(AllocError::InvalidArgument(format!(
                    "stream `{}` runs on {}, not on the host",
                    stream.name(),
                    stream.device()
                )))
            }
        }

        fn record_event(&self, stream: &Stream) -> Result<Event, AllocError> {
            Ok(stream.record_event())
        }

        fn query_event(&self, event: &Event) -> Result<bool, AllocError> {
            Ok(event.query())
        }

        fn synchronize_event(&self, event: &Event, timeout: Duration) -> Result<(), AllocError> {
            match event.synchronize_timeout(timeout) {
                // A failed task has finished too: the memory is no longer in use.
                Ok(()) | Err(DeviceError::StreamFailed { .. }) => Ok(()),
                Err(DeviceError::Timeout { what, waited }) => {
                    Err(AllocError::Timeout { what, waited })
                }
                Err(e) => Err(e.into()),
            }
        }
    };
}
pub(crate) use capacity_and_cpu_streams;

/// Real host memory (zero-initialised, [`SEGMENT_ALIGN`]-aligned, its pages touched only when
/// used) with a capacity limit; its
/// streams and events are [`fsdp_device::Stream`] and [`fsdp_device::Event`].
pub struct HostSource {
    limit: Capacity,
}

impl fmt::Debug for HostSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.limit.debug(f, "HostSource")
    }
}

/// Bytes before a host segment holding the offset back to the raw allocation.
const HEADER: usize = std::mem::size_of::<usize>();

/// The raw allocation behind a host segment of `bytes` bytes. Its 16-byte alignment (not
/// SEGMENT_ALIGN) lets `alloc_zeroed` use `calloc`, whose large blocks are fresh zero pages:
/// reserving a segment does not touch its memory (an over-aligned layout would be zeroed by
/// hand, page by page).
fn raw_layout(bytes: usize) -> Option<Layout> {
    Layout::from_size_align(bytes.checked_add(SEGMENT_ALIGN)?, 16).ok()
}

impl HostSource {
    /// A source that hands out at most `capacity` bytes at a time.
    pub fn new(capacity: usize) -> HostSource {
        HostSource {
            limit: Capacity::new(capacity),
        }
    }

    /// The capacity given at creation.
    pub fn capacity(&self) -> usize {
        self.limit.capacity
    }

    /// Bytes currently handed out.
    pub fn used(&self) -> usize {
        self.limit.used()
    }
}

// SAFETY: segments are SEGMENT_ALIGN-aligned ranges inside zeroed allocations of the global
// allocator, so they are initialised host memory owned by the caller until `free`; stream keys
// (from `capacity_and_cpu_streams!`) are fsdp-device's process-unique stream ids; host events
// complete only when their stream's work up to the recorded point has run (a panicked task also
// counts as run: it no longer touches memory).
unsafe impl MemorySource for HostSource {
    capacity_and_cpu_streams!();

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>, AllocError> {
        self.limit.reserve(bytes)?;
        let oom = AllocError::SourceOutOfMemory { bytes };
        let Some(layout) = raw_layout(bytes) else {
            self.limit.unreserve(bytes);
            return Err(oom);
        };
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(raw) = NonNull::new(raw) else {
            self.limit.unreserve(bytes);
            return Err(oom);
        };
        // The segment starts at the first SEGMENT_ALIGN boundary at least one header past the
        // raw start: raw is 16-aligned, so that offset lies in [16, SEGMENT_ALIGN] and the
        // segment ends within the SEGMENT_ALIGN extra bytes.
        let offset =
            (raw.as_ptr().addr() + HEADER).next_multiple_of(SEGMENT_ALIGN) - raw.as_ptr().addr();
        let seg = raw.as_ptr().wrapping_add(offset);
        // SAFETY: seg - HEADER >= raw and seg - HEADER + HEADER <= raw + layout.size(), so the
        // header lies inside the allocation; seg is SEGMENT_ALIGN-aligned, so the header is
        // aligned for usize.
        unsafe { seg.sub(HEADER).cast::<usize>().write(offset) };
        Ok(NonNull::new(seg).unwrap_or(raw))
    }

    fn supports_expandable_segments(&self) -> bool {
        // Miri does not model mmap/mprotect.
        !cfg!(miri)
    }

    fn reserve_address_range(&self, bytes: usize) -> Result<NonNull<u8>, AllocError> {
        crate::vmm::reserve(bytes)
    }

    unsafe fn map_range(
        &self,
        base: NonNull<u8>,
        offset: usize,
        bytes: usize,
    ) -> Result<(), AllocError> {
        self.limit.reserve(bytes)?;
        // SAFETY: forwarded from the caller: the pages lie in a range reserved by `reserve`.
        let mapped = unsafe { crate::vmm::commit(base, offset, bytes) };
        if mapped.is_err() {
            self.limit.unreserve(bytes);
        }
        mapped
    }

    unsafe fn unmap_range(&self, base: NonNull<u8>, offset: usize, bytes: usize) {
        // SAFETY: forwarded from the caller: committed pages that nothing uses.
        unsafe { crate::vmm::decommit(base, offset, bytes) };
        self.limit.unreserve(bytes);
    }

    unsafe fn release_address_range(&self, base: NonNull<u8>, bytes: usize) {
        // SAFETY: forwarded from the caller.
        unsafe { crate::vmm::release(base, bytes) };
    }

    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize) {
        // SAFETY: by the caller's contract `ptr` came from `allocate(bytes)`, which wrote the
        // offset to the raw allocation in the header before it and allocated `raw_layout(bytes)`
        // (valid then, so valid now) there; it is freed once.
        unsafe {
            let header = ptr.as_ptr().sub(HEADER);
            let offset = header.cast::<usize>().read();
            let raw = ptr.as_ptr().sub(offset);
            if let Some(layout) = raw_layout(bytes) {
                std::alloc::dealloc(raw, layout);
            }
        }
        self.limit.unreserve(bytes);
    }
}

/// No memory at all, for [`Device::Meta`] (the FSDP plan's allocator): segments are *fake
/// addresses* — distinct, [`SEGMENT_ALIGN`]-aligned, never overlapping, never dereferenced —
/// handed out under a capacity limit exactly as [`HostSource`] hands out memory, so that a
/// [`CachingAllocator`](crate::CachingAllocator) over it makes the same decisions (splits,
/// merges, cache hits, retries, out-of-memory errors) and keeps the same
/// [`MemoryStats`](crate::MemoryStats) as one over a `HostSource` of the same capacity. Its
/// streams and events are [`fsdp_device::Stream`] and [`fsdp_device::Event`], and blocks turn into
/// [`Device::Meta`] buffers, whose host access is an error.
///
/// Addresses come from a counter that starts at [`MetaSource::BASE`] and only grows (a freed
/// range is not handed out again), so an address is never reused within one source; the
/// counter cannot run out on a 64-bit target.
///
/// ```
/// use fsdp_allocator::{AllocatorConfig, MetaAllocator, MetaSource};
/// use fsdp_device::{DType, Device, Stream};
///
/// // 80 GiB of "memory" on a machine that has none to spare.
/// let alloc = MetaAllocator::new(MetaSource::new(80 << 30), AllocatorConfig::default())?;
/// let block = alloc.allocate(30 << 30, &Stream::inline("compute"))?;
/// assert_eq!(alloc.memory_stats().reserved_bytes.all.current, 30 << 30);
/// let buf = block.into_buffer(DType::F32)?;
/// assert_eq!((buf.device(), buf.len()), (Device::Meta, (30 << 30) / 4));
/// assert!(buf.to_vec::<f32>().is_err()); // no data to read
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct MetaSource {
    limit: Capacity,
    /// The next address to hand out.
    next: AtomicUsize,
}

impl fmt::Debug for MetaSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.limit.debug(f, "MetaSource")
    }
}

impl MetaSource {
    /// The first address handed out (a multiple of [`SEGMENT_ALIGN`], far from 0).
    pub const BASE: usize = 1 << 28;

    /// A source that hands out at most `capacity` bytes at a time.
    pub fn new(capacity: usize) -> MetaSource {
        MetaSource {
            limit: Capacity::new(capacity),
            next: AtomicUsize::new(Self::BASE),
        }
    }

    /// The capacity given at creation.
    pub fn capacity(&self) -> usize {
        self.limit.capacity
    }

    /// Bytes currently handed out.
    pub fn used(&self) -> usize {
        self.limit.used()
    }
}

// SAFETY: Device::Meta asks only for distinct, non-overlapping, SEGMENT_ALIGN-aligned addresses:
// each segment is a fresh range [a, a + bytes) of a counter that starts at a multiple of
// SEGMENT_ALIGN, advances by whole multiples of it and never goes back, so no two segments ever
// overlap; nothing dereferences them (the allocator only computes with addresses, and a Block's
// Storage reports Device::Meta, whose buffers refuse host access). Stream keys and events are
// HostSource's (the same `capacity_and_cpu_streams!` items): process-unique stream ids, and
// events that complete only once their stream's work up to the recorded point has run.
unsafe impl MemorySource for MetaSource {
    capacity_and_cpu_streams!();

    fn device(&self) -> Device {
        Device::Meta
    }

    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>, AllocError> {
        self.limit.reserve(bytes)?;
        let span = bytes.checked_next_multiple_of(SEGMENT_ALIGN);
        let addr = span.and_then(|span| {
            self.next
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |a| {
                    a.checked_add(span)
                })
                .ok()
        });
        match addr.and_then(|a| NonNull::new(std::ptr::without_provenance_mut::<u8>(a))) {
            Some(ptr) => Ok(ptr),
            None => {
                // The address counter ran out (only possible on a small address space).
                self.limit.unreserve(bytes);
                Err(AllocError::SourceOutOfMemory { bytes })
            }
        }
    }

    unsafe fn free(&self, _ptr: NonNull<u8>, bytes: usize) {
        // Nothing to release but the capacity: the address is never handed out again.
        self.limit.unreserve(bytes);
    }

    fn supports_expandable_segments(&self) -> bool {
        true
    }

    fn reserve_address_range(&self, bytes: usize) -> Result<NonNull<u8>, AllocError> {
        // A fresh range of the counter, as for a segment, with no capacity taken.
        let span = bytes.checked_next_multiple_of(SEGMENT_ALIGN);
        let addr = span.and_then(|span| {
            self.next
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |a| {
                    a.checked_add(span)
                })
                .ok()
        });
        addr.and_then(|a| NonNull::new(std::ptr::without_provenance_mut::<u8>(a)))
            .ok_or(AllocError::SourceOutOfMemory { bytes })
    }

    unsafe fn map_range(
        &self,
        _base: NonNull<u8>,
        _offset: usize,
        bytes: usize,
    ) -> Result<(), AllocError> {
        self.limit.reserve(bytes)
    }

    unsafe fn unmap_range(&self, _base: NonNull<u8>, _offset: usize, bytes: usize) {
        self.limit.unreserve(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_source_respects_capacity_and_alignment() {
        let src = HostSource::new(4 << 20);
        let a = src.allocate(2 << 20).unwrap();
        assert_eq!(a.as_ptr() as usize % SEGMENT_ALIGN, 0);
        let b = src.allocate(2 << 20).unwrap();
        assert_eq!(src.used(), 4 << 20);
        assert!(matches!(
            src.allocate(512),
            Err(AllocError::SourceOutOfMemory { bytes: 512 })
        ));
        assert!(matches!(
            src.allocate(usize::MAX),
            Err(AllocError::SourceOutOfMemory { .. })
        ));
        assert!(src.allocate(0).is_err());
        // SAFETY: both came from `allocate` with these sizes and are freed once.
        unsafe {
            src.free(a, 2 << 20);
            src.free(b, 2 << 20);
        }
        assert_eq!(src.used(), 0);
        assert_eq!(src.free_memory(), 4 << 20);
    }

    #[test]
    fn meta_source_hands_out_distinct_aligned_fake_addresses_within_capacity() {
        let src = MetaSource::new(4 << 20);
        assert_eq!(src.device(), Device::Meta);
        let a = src.allocate(2 << 20).unwrap();
        let b = src.allocate(1000).unwrap(); // rounded up to SEGMENT_ALIGN for the next one
        let c = src.allocate(512).unwrap();
        assert_eq!(a.as_ptr().addr(), MetaSource::BASE);
        assert_eq!(b.as_ptr().addr(), MetaSource::BASE + (2 << 20));
        assert_eq!(c.as_ptr().addr(), MetaSource::BASE + (2 << 20) + 1024);
        for p in [a, b, c] {
            assert_eq!(p.as_ptr().addr() % SEGMENT_ALIGN, 0);
        }
        assert_eq!(src.used(), (2 << 20) + 1512);
        assert!(matches!(
            src.allocate(2 << 20),
            Err(AllocError::SourceOutOfMemory { bytes }) if bytes == 2 << 20
        ));
        assert!(matches!(
            src.allocate(usize::MAX),
            Err(AllocError::SourceOutOfMemory { .. })
        ));
        assert!(matches!(
            src.allocate(0),
            Err(AllocError::InvalidArgument(_))
        ));
        assert_eq!(src.used(), (2 << 20) + 1512, "failures reserve nothing");
        // SAFETY: each came from `allocate` with this size and is freed once.
        unsafe {
            src.free(a, 2 << 20);
            src.free(b, 1000);
            src.free(c, 512);
        }
        assert_eq!((src.used(), src.free_memory()), (0, 4 << 20));
        // Freed addresses are not handed out again.
        let d = src.allocate(4 << 20).unwrap();
        assert_eq!(d.as_ptr().addr(), MetaSource::BASE + (2 << 20) + 1536);
        // SAFETY: as above.
        unsafe { src.free(d, 4 << 20) };
        // The counter running out is an out-of-memory error that reserves nothing.
        let src = MetaSource::new(usize::MAX);
        src.next.store(usize::MAX - 1023, Ordering::Relaxed);
        assert!(matches!(
            src.allocate(2048),
            Err(AllocError::SourceOutOfMemory { bytes: 2048 })
        ));
        assert_eq!(src.used(), 0);
        assert!(src.validate_stream(&Stream::inline("x")).is_ok());
    }
}
