//! A cache of freed blocks by size class, for memory that is expensive to allocate and to
//! free: page-locked host memory, whose `cuMemHostAlloc` serialises the device's streams and
//! whose `cuMemFreeHost` synchronises the device. PyTorch's `CachingHostAllocator` keeps freed
//! pinned blocks the same way: a step that reads a loss back or stages a shard through pinned
//! memory then allocates and frees nothing once the cache holds the sizes it uses.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The smallest size class, in bytes.
pub(crate) const MIN_BLOCK: usize = 512;

/// The size class of a request of `bytes`: the next power of two, at least [`MIN_BLOCK`];
/// `None` beyond the largest power of two of `usize`.
pub(crate) fn size_class(bytes: usize) -> Option<usize> {
    bytes.max(MIN_BLOCK).checked_next_power_of_two()
}

/// What a block cache did so far and holds now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockCacheStats {
    /// Blocks allocated because none of their size class was free.
    pub allocations: u64,
    /// Requests served by a freed block.
    pub reuses: u64,
    /// Freed blocks held for reuse.
    pub cached_blocks: usize,
    /// Their bytes (size classes).
    pub cached_bytes: usize,
}

/// Freed blocks of type `B` by size class, reused last in, first out.
pub(crate) struct BlockCache<B> {
    inner: Mutex<Inner<B>>,
}

struct Inner<B> {
    free: BTreeMap<usize, Vec<B>>,
    stats: BlockCacheStats,
}

impl<B> BlockCache<B> {
    /// An empty cache.
    pub(crate) const fn new() -> Self {
        BlockCache {
            inner: Mutex::new(Inner {
                free: BTreeMap::new(),
                stats: BlockCacheStats {
                    allocations: 0,
                    reuses: 0,
                    cached_blocks: 0,
                    cached_bytes: 0,
                },
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<B>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A freed block of size class `class`, if one is held (counted as a reuse); else `None`,
    /// and the caller allocates one (counted as an allocation).
    pub(crate) fn take(&self, class: usize) -> Option<B> {
        let mut inner = self.lock();
        let block = inner.free.get_mut(&class).and_then(Vec::pop);
        match block {
            Some(_) => {
                inner.stats.reuses += 1;
                inner.stats.cached_blocks -= 1;
                inner.stats.cached_bytes -= class;
            }
            None => inner.stats.allocations += 1,
        }
        block
    }

    /// Hold the freed `block` of size class `class` for reuse.
    pub(crate) fn put(&self, class: usize, block: B) {
        let mut inner = self.lock();
        inner.free.entry(class).or_default().push(block);
        inner.stats.cached_blocks += 1;
        inner.stats.cached_bytes += class;
    }

    /// Every freed block, with its size class, taken out of the cache (to be freed).
    pub(crate) fn drain(&self) -> Vec<(usize, B)> {
        let mut inner = self.lock();
        inner.stats.cached_blocks = 0;
        inner.stats.cached_bytes = 0;
        std::mem::take(&mut inner.free)
            .into_iter()
            .flat_map(|(class, blocks)| blocks.into_iter().map(move |b| (class, b)))
            .collect()
    }

    /// The counters.
    pub(crate) fn stats(&self) -> BlockCacheStats {
        self.lock().stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_are_powers_of_two_from_the_minimum() {
        assert_eq!(size_class(0), Some(MIN_BLOCK));
        assert_eq!(size_class(1), Some(MIN_BLOCK));
        assert_eq!(size_class(MIN_BLOCK), Some(MIN_BLOCK));
        assert_eq!(size_class(MIN_BLOCK + 1), Some(2 * MIN_BLOCK));
        assert_eq!(size_class(3 << 20), Some(4 << 20));
        assert_eq!(size_class(1 << 40), Some(1 << 40));
        assert_eq!(size_class(usize::MAX), None);
        for bytes in [5, 600, 4096, 4097, 123_456] {
            let c = size_class(bytes).unwrap();
            assert!(c.is_power_of_two() && c >= bytes && c / 2 < bytes.max(MIN_BLOCK));
        }
    }

    #[test]
    fn freed_blocks_are_reused_by_their_class_last_in_first_out() {
        let cache = BlockCache::new();
        assert_eq!(cache.take(1024), None);
        cache.put(1024, "a");
        cache.put(1024, "b");
        cache.put(4096, "c");
        let s = cache.stats();
        assert_eq!(
            (s.allocations, s.cached_blocks, s.cached_bytes),
            (1, 3, 6144)
        );
        assert_eq!(cache.take(2048), None, "another class is not served");
        assert_eq!(cache.take(1024), Some("b"));
        assert_eq!(cache.take(1024), Some("a"));
        assert_eq!(cache.take(1024), None);
        let s = cache.stats();
        assert_eq!((s.allocations, s.reuses), (3, 2));
        assert_eq!((s.cached_blocks, s.cached_bytes), (1, 4096));
        assert_eq!(cache.drain(), vec![(4096, "c")]);
        assert_eq!(cache.stats().cached_blocks, 0);
        assert_eq!(cache.take(4096), None);
    }
}
