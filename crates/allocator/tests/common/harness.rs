//! The [`Harness`] the scenarios run against, and [`CpuHarness`], the harness of the sources
//! with fsdp-device's CPU streams.

use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use crossbeam_channel::Sender;
use fsdp_allocator::{AllocatorConfig, Block, CachingAllocator, MemorySource};
use fsdp_device::{Event, Stream};

/// Streams and device operations for one memory source.
pub trait Harness {
    /// The source under test.
    type Src: MemorySource;
    /// A point in a stream, recorded by the test itself.
    type Marker;

    /// A fresh allocator over a fresh source.
    fn allocator(&self, config: AllocatorConfig) -> CachingAllocator<Self::Src>;
    /// Stream 0, 1 or 2.
    fn stream(&self, i: usize) -> &<Self::Src as MemorySource>::Stream;
    /// Enqueue on stream `i` work that blocks until [`release`](Harness::release) or `max`.
    fn stall(&self, i: usize, max: Duration);
    /// Let every stalled task of stream `i` finish.
    fn release(&self, i: usize);
    /// Enqueue `d` of simulated work on stream `i`.
    fn busy(&self, i: usize, d: Duration);
    /// Make stream `waiter` wait for the current end of stream `on`.
    fn wait_for(&self, waiter: usize, on: usize);
    /// Record a marker at the current end of stream `i`.
    fn marker(&self, i: usize) -> Self::Marker;
    /// Whether the marker has completed.
    fn marker_done(&self, m: &Self::Marker) -> bool;
    /// Wait for the marker.
    fn marker_wait(&self, m: &Self::Marker, timeout: Duration);
    /// Write `byte` into the first and last [`PATTERN`] bytes of the block (synchronously).
    fn write_pattern(&self, b: &Block<Self::Src>, byte: u8);
    /// Whether the first and last [`PATTERN`] bytes still hold `byte`.
    fn check_pattern(&self, b: &Block<Self::Src>, byte: u8) -> bool;
    /// Wait for everything enqueued on stream `i`.
    fn synchronize(&self, i: usize);

    fn release_all(&self) {
        for i in 0..3 {
            self.release(i);
        }
    }

    fn synchronize_all(&self) {
        for i in 0..3 {
            self.synchronize(i);
        }
    }
}

/// What a [`CpuHarness`] leaves to its memory source: the source, and how the scenarios' bytes
/// are written into and read from its blocks.
pub trait CpuMemory: Default {
    /// The source under test, with fsdp-device's CPU streams and events.
    type Src: MemorySource<Stream = Stream, Event = Event>;
    /// A fresh source of `capacity` bytes.
    fn source(capacity: usize) -> Self::Src;
    /// [`Harness::write_pattern`].
    fn write_pattern(&self, b: &Block<Self::Src>, byte: u8);
    /// [`Harness::check_pattern`].
    fn check_pattern(&self, b: &Block<Self::Src>, byte: u8) -> bool;
}

/// The harness of a source whose streams are fsdp-device's CPU streams: three worker streams
/// and gates to hold them up, over the memory `M`.
pub struct CpuHarness<M: CpuMemory> {
    streams: [Stream; 3],
    gates: [Mutex<Vec<Sender<()>>>; 3],
    capacity: usize,
    memory: M,
}

impl<M: CpuMemory> CpuHarness<M> {
    /// A harness whose allocators get sources of `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        CpuHarness {
            streams: [Stream::cpu("s0"), Stream::cpu("s1"), Stream::cpu("s2")],
            gates: Default::default(),
            capacity,
            memory: M::default(),
        }
    }
}

impl<M: CpuMemory> Harness for CpuHarness<M> {
    type Src = M::Src;
    type Marker = Event;

    fn allocator(&self, config: AllocatorConfig) -> CachingAllocator<M::Src> {
        CachingAllocator::new(M::source(self.capacity), config).unwrap()
    }

    fn stream(&self, i: usize) -> &Stream {
        &self.streams[i]
    }

    fn stall(&self, i: usize, max: Duration) {
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        self.gates[i].lock().unwrap().push(tx);
        self.streams[i]
            .enqueue(move || {
                let _ = rx.recv_timeout(max);
            })
            .unwrap();
    }

    fn release(&self, i: usize) {
        self.gates[i].lock().unwrap().clear();
    }

    fn busy(&self, i: usize, d: Duration) {
        self.streams[i].enqueue(move || thread::sleep(d)).unwrap();
    }

    fn wait_for(&self, waiter: usize, on: usize) {
        let ev = self.streams[on].record_event();
        self.streams[waiter].wait_event(&ev).unwrap();
    }

    fn marker(&self, i: usize) -> Event {
        self.streams[i].record_event()
    }

    fn marker_done(&self, m: &Event) -> bool {
        m.query()
    }

    fn marker_wait(&self, m: &Event, timeout: Duration) {
        m.synchronize_timeout(timeout).unwrap();
    }

    fn write_pattern(&self, b: &Block<M::Src>, byte: u8) {
        self.memory.write_pattern(b, byte);
    }

    fn check_pattern(&self, b: &Block<M::Src>, byte: u8) -> bool {
        self.memory.check_pattern(b, byte)
    }

    fn synchronize(&self, i: usize) {
        self.streams[i].synchronize().unwrap();
    }
}
