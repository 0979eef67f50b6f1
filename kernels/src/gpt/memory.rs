//! Counting the device memory of [`GptOps`](super::GptOps): [`Counted`] buffers add their bytes
//! to a shared [`MemoryCounter`] when made and take them off when dropped, so an implementation
//! reports the bytes live now and the most live at once ([`MemoryUse`]).

use std::collections::HashMap;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use fsdp_allocator::{AllocError, MemoryStats, MetaAllocator, MetaBlock};
use fsdp_device::Stream;

/// Bytes of device buffers live now and the most that were live at once (since the
/// operations were made, or since [`MemoryCounter::reset_peak`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUse {
    /// Bytes live now.
    pub allocated: u64,
    /// The most bytes live at once.
    pub peak: u64,
}

/// One buffer made or dropped, as [`MemoryCounter::record_history`] records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryEvent {
    /// `true` when the buffer was made, `false` when it was dropped.
    pub alloc: bool,
    /// The buffer's identity (unique to it, never reused).
    pub id: u64,
    /// Its bytes.
    pub bytes: u64,
    /// When.
    pub at: Instant,
}

/// Bytes live and their peak, shared by every [`Counted`] buffer of one set of operations;
/// with [`record_history`](MemoryCounter::record_history), every buffer made and dropped;
/// with [`mirror_into`](MemoryCounter::mirror_into), a caching allocator's blocks for them.
#[derive(Debug, Default)]
pub struct MemoryCounter {
    allocated: AtomicU64,
    peak: AtomicU64,
    history: Mutex<Option<Vec<MemoryEvent>>>,
    mirror: OnceLock<Mirror>,
}

/// The blocks a [`MemoryCounter`]'s live buffers hold in a caching allocator over a meta
/// source, by buffer identity, and the allocator's first failure.
#[derive(Debug)]
struct Mirror {
    alloc: MetaAllocator,
    stream: Stream,
    blocks: Mutex<HashMap<u64, MetaBlock>>,
    failed: Mutex<Option<AllocError>>,
}

impl MemoryCounter {
    /// A counter at zero, shared.
    pub fn new() -> Arc<MemoryCounter> {
        Arc::new(MemoryCounter::default())
    }

    /// The bytes live now and their peak.
    pub fn usage(&self) -> MemoryUse {
        MemoryUse {
            allocated: self.allocated.load(Ordering::SeqCst),
            peak: self.peak.load(Ordering::SeqCst),
        }
    }

    /// Starts the peak again from the bytes live now.
    pub fn reset_peak(&self) {
        self.peak
            .store(self.allocated.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// Record every buffer made and dropped from now on (`true`; the events so far are
    /// dropped), or stop (`false`).
    pub fn record_history(&self, on: bool) {
        let mut h = self.history.lock().unwrap_or_else(PoisonError::into_inner);
        *h = on.then(Vec::new);
    }

    /// From now on, every buffer counted here also takes a block of its bytes from `alloc`
    /// (on one stream) until it is dropped: the requests `CudaOps` makes of the device's
    /// caching allocator, decided by the same rules on a meta source (sizes, no memory). So,
    /// run over operations that make the GPU run's buffers in its order ([`MetaOps`](super::MetaOps),
    /// the host twins), `alloc`'s statistics are what the GPU's caching allocator will
    /// report: its peaks of allocated and reserved bytes, its segments. Returns `false` (and
    /// changes nothing) when a mirror is set already.
    pub fn mirror_into(&self, alloc: MetaAllocator) -> bool {
        self.mirror
            .set(Mirror {
                alloc,
                stream: Stream::inline("mirror"),
                blocks: Mutex::new(HashMap::new()),
                failed: Mutex::new(None),
            })
            .is_ok()
    }

    /// The mirror's statistics ([`mirror_into`](MemoryCounter::mirror_into)): `None` without
    /// one.
    ///
    /// # Errors
    /// The first request the mirror's allocator refused (e.g. beyond its source's memory).
    pub fn mirror_stats(&self) -> Option<Result<MemoryStats, AllocError>> {
        let m = self.mirror.get()?;
        let failed = m.failed.lock().unwrap_or_else(PoisonError::into_inner);
        Some(match &*failed {
            Some(e) => Err(e.clone()),
            None => Ok(m.alloc.memory_stats()),
        })
    }

    /// The events recorded since recording began or since the last call, oldest first.
    pub fn take_history(&self) -> Vec<MemoryEvent> {
        let mut h = self.history.lock().unwrap_or_else(PoisonError::into_inner);
        h.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn record(&self, alloc: bool, id: u64, bytes: u64) {
        let mut h = self.history.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(v) = h.as_mut() {
            v.push(MemoryEvent {
                alloc,
                id,
                bytes,
                at: Instant::now(),
            });
        }
    }

    fn add(&self, id: u64, bytes: u64, mirrored: bool) {
        let now = self
            .allocated
            .fetch_add(bytes, Ordering::SeqCst)
            .saturating_add(bytes);
        self.peak.fetch_max(now, Ordering::SeqCst);
        self.record(true, id, bytes);
        if let Some(m) = self.mirror.get().filter(|_| mirrored) {
            match m.alloc.allocate(bytes as usize, &m.stream) {
                Ok(b) => {
                    let mut blocks = m.blocks.lock().unwrap_or_else(PoisonError::into_inner);
                    blocks.insert(id, b);
                }
                Err(e) => {
                    let mut failed = m.failed.lock().unwrap_or_else(PoisonError::into_inner);
                    failed.get_or_insert(e);
                }
            }
        }
    }

    fn sub(&self, id: u64, bytes: u64) {
        self.allocated.fetch_sub(bytes, Ordering::SeqCst);
        self.record(false, id, bytes);
        if let Some(m) = self.mirror.get() {
            let block = {
                let mut blocks = m.blocks.lock().unwrap_or_else(PoisonError::into_inner);
                blocks.remove(&id)
            };
            // Back to the allocator outside the lock.
            drop(block);
        }
    }
}

/// A buffer whose bytes are counted in a [`MemoryCounter`] while it lives; it reads and writes
/// as the buffer it holds (`Deref`).
pub struct Counted<T> {
    inner: ManuallyDrop<T>,
    bytes: u64,
    counter: Arc<MemoryCounter>,
    stamp: Stamp,
    /// What ends `inner` in place of its own `Drop` (see [`Counted::with_release`]).
    release: Option<Release<T>>,
    /// Whether its bytes are in the counter ([`Counted::borrowed`]: not).
    counted: bool,
}

/// How a [`Counted`] buffer's value ends when it is dropped.
type Release<T> = Box<dyn FnOnce(T) + Send + Sync>;

impl<T: fmt::Debug> fmt::Debug for Counted<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Counted")
            .field("inner", &*self.inner)
            .field("bytes", &self.bytes)
            .field("stamp", &self.stamp)
            .field("release", &self.release.is_some())
            .finish()
    }
}

/// The identity of a [`Counted`] buffer's contents: unique to the buffer (never reused, even
/// after it is dropped) and renewed at every mutable borrow, through which every write goes.
/// Two equal stamps therefore name one buffer with nothing written in between: the kept bf16
/// copies of the products' operands use it to skip rounding an operand they already hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stamp {
    id: u64,
    version: u64,
}

/// The next [`Stamp::id`].
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl<T> Counted<T> {
    /// `inner`, of `bytes` bytes on the device, counted in `counter` until dropped.
    pub fn new(inner: T, bytes: u64, counter: &Arc<MemoryCounter>) -> Counted<T> {
        Counted::make(inner, bytes, counter, true)
    }

    /// As [`new`](Self::new), but never [mirrored](MemoryCounter::mirror_into): memory
    /// counted beside the operations' buffers that does not come from their allocator (a
    /// communicator's staging buffers).
    pub fn outside_mirror(inner: T, bytes: u64, counter: &Arc<MemoryCounter>) -> Counted<T> {
        Counted::make(inner, bytes, counter, false)
    }

    /// `inner` **not** counted (0 bytes, no history, no mirror), handed to `release` when
    /// dropped: memory the operations borrow from an owner that counts it itself (a view of
    /// another allocator's buffer, [`CudaOps::view`](super::CudaOps::view)).
    pub(crate) fn borrowed(
        inner: T,
        counter: &Arc<MemoryCounter>,
        release: impl FnOnce(T) + Send + Sync + 'static,
    ) -> Counted<T> {
        Counted {
            inner: ManuallyDrop::new(inner),
            bytes: 0,
            counter: counter.clone(),
            stamp: Stamp {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                version: 0,
            },
            release: Some(Box::new(release)),
            counted: false,
        }
    }

    fn make(inner: T, bytes: u64, counter: &Arc<MemoryCounter>, mirrored: bool) -> Counted<T> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        counter.add(id, bytes, mirrored);
        Counted {
            inner: ManuallyDrop::new(inner),
            bytes,
            counter: counter.clone(),
            stamp: Stamp { id, version: 0 },
            release: None,
            counted: true,
        }
    }

    /// As [`new`](Self::new), but when dropped `inner` is handed to `release` instead of being
    /// dropped: e.g. a slice over a caching allocator's block, which must give the block back
    /// rather than free its address.
    pub fn with_release(
        inner: T,
        bytes: u64,
        counter: &Arc<MemoryCounter>,
        release: impl FnOnce(T) + Send + Sync + 'static,
    ) -> Counted<T> {
        let mut c = Counted::new(inner, bytes, counter);
        c.release = Some(Box::new(release));
        c
    }

    /// What it holds now (see [`Stamp`]).
    pub(crate) fn stamp(&self) -> Stamp {
        self.stamp
    }

    /// The bytes counted for it.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl<T> Deref for Counted<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T> DerefMut for Counted<T> {
    fn deref_mut(&mut self) -> &mut T {
        // Any write may follow.
        self.stamp.version = self.stamp.version.wrapping_add(1);
        &mut self.inner
    }
}

impl<T> Drop for Counted<T> {
    fn drop(&mut self) {
        // SAFETY: `inner` is taken once, here, as the buffer is dropped; nothing reads it after.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        match self.release.take() {
            Some(release) => release(inner),
            None => drop(inner),
        }
        if self.counted {
            self.counter.sub(self.stamp.id, self.bytes);
        }
    }
}

/// Bytes of `len` elements of `T`.
pub(crate) fn bytes_of<T>(len: usize) -> u64 {
    (len as u64).saturating_mul(std::mem::size_of::<T>() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_buffers_add_and_remove_their_bytes() {
        let c = MemoryCounter::new();
        let a = Counted::new(vec![0.0f32; 10], 40, &c);
        let b = Counted::new(vec![0u32; 5], 20, &c);
        assert_eq!(
            c.usage(),
            MemoryUse {
                allocated: 60,
                peak: 60
            }
        );
        drop(a);
        assert_eq!(
            c.usage(),
            MemoryUse {
                allocated: 20,
                peak: 60
            }
        );
        c.reset_peak();
        assert_eq!(
            c.usage(),
            MemoryUse {
                allocated: 20,
                peak: 20
            }
        );
        let d = Counted::new((), 8, &c);
        assert_eq!((b.len(), d.bytes()), (5, 8));
        drop((b, d));
        assert_eq!(
            c.usage(),
            MemoryUse {
                allocated: 0,
                peak: 28
            }
        );
    }

    #[test]
    fn a_mirror_holds_a_block_per_counted_buffer() {
        let c = MemoryCounter::new();
        let meta = fsdp_allocator::MetaAllocator::new(
            fsdp_allocator::MetaSource::new(1 << 30),
            Default::default(),
        )
        .unwrap();
        assert!(c.mirror_into(meta.clone()));
        assert!(!c.mirror_into(meta.clone()), "one mirror");
        let a = Counted::new((), 1000, &c);
        let staging = Counted::outside_mirror((), 4096, &c);
        let b = Counted::new((), 3 << 20, &c);
        let st = meta.memory_stats();
        // 1000 bytes round to 1024; the staging is counted but takes no block.
        assert_eq!(st.allocated_bytes.all.current, 1024 + (3 << 20));
        assert_eq!(st.allocation.all.current, 2);
        assert_eq!(c.usage().allocated, 1000 + 4096 + (3 << 20));
        drop((a, staging));
        assert_eq!(meta.memory_stats().allocated_bytes.all.current, 3 << 20);
        drop(b);
        let st = c.mirror_stats().unwrap().unwrap();
        assert_eq!(st.allocated_bytes.all.current, 0);
        assert_eq!(st.allocated_bytes.all.peak, 1024 + (3 << 20));
        assert!(MemoryCounter::new().mirror_stats().is_none());
    }

    #[test]
    fn a_release_ends_the_value_in_place_of_its_drop() {
        let c = MemoryCounter::new();
        let released = Arc::new(Mutex::new(Vec::new()));
        let into = released.clone();
        let mut a = Counted::with_release(vec![1u32, 2], 8, &c, move |v: Vec<u32>| {
            into.lock().unwrap().push(v)
        });
        a.push(3);
        assert_eq!((a.len(), c.usage().allocated), (3, 8));
        drop(a);
        // The value reached the release whole (not dropped first), and its bytes went.
        assert_eq!(*released.lock().unwrap(), vec![vec![1, 2, 3]]);
        assert_eq!(c.usage().allocated, 0);
        // Without a release the value is dropped as usual (a value with a heap part, for Miri).
        drop(Counted::new(String::from("dropped"), 7, &c));
        assert_eq!(
            c.usage(),
            MemoryUse {
                allocated: 0,
                peak: 8
            }
        );
    }
}
