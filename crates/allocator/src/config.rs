//! The options of a [`CachingAllocator`](crate::CachingAllocator) (PyTorch's
//! `PYTORCH_CUDA_ALLOC_CONF` and `set_per_process_memory_fraction`).

use std::time::Duration;

use fsdp_device::DEFAULT_TIMEOUT;

use crate::{AllocError, LARGE_BUFFER, MIN_BLOCK_SIZE};

/// A cap on the bytes the allocator keeps in segments (like PyTorch's
/// `set_per_process_memory_fraction`). Requests that would pass it are treated as if the source
/// had run out of memory: the cache is freed and the request retried, then it fails.
///
/// Equality and hashing compare a fraction by its bits (so that the type is `Eq`).
#[derive(Clone, Copy, Debug)]
pub enum MemoryLimit {
    /// At most this many bytes.
    Bytes(usize),
    /// At most this fraction (0 to 1) of the source's
    /// [`total_memory`](crate::MemorySource::total_memory).
    Fraction(f64),
}

/// Options of a [`CachingAllocator`](crate::CachingAllocator).
///
/// ```
/// use fsdp_allocator::{AllocatorConfig, MemoryLimit};
/// let config = AllocatorConfig::default()
///     .with_memory_limit(MemoryLimit::Fraction(0.5))
///     .with_max_split_size(64 << 20);
/// assert_eq!(config.max_split_size, Some(64 << 20));
/// ```
///
/// Equality and hashing compare the fractions by their bits (so that the options can be part
/// of an `Eq + Hash` configuration such as FSDP's).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct AllocatorConfig {
    /// A cap on reserved bytes; none by default.
    pub memory_limit: Option<MemoryLimit>,
    /// Blocks of at least this size are never split, and cached blocks of at least this size
    /// serve only requests of at least this size that waste less than
    /// [`LARGE_BUFFER`](crate::LARGE_BUFFER). Must exceed `LARGE_BUFFER` (as in PyTorch's
    /// `max_split_size_mb > 20`). None (unlimited) by default.
    pub max_split_size: Option<usize>,
    /// How long the allocator waits for record-stream events when it must free its cache
    /// (out-of-memory retry, [`empty_cache`](crate::CachingAllocator::empty_cache), drop).
    /// Default: [`fsdp_device::DEFAULT_TIMEOUT`].
    pub sync_timeout: Duration,
    /// PyTorch's `roundup_power2_divisions`: for a request in the power-of-two interval of
    /// index `i` (`i = log2(size / 1 MiB)`, clamped to 0 below 2 MiB and to the last entry
    /// above), an entry `d` > 1 rounds the size up to the next of `d` equal divisions between
    /// two powers of two (84 MiB with 4 divisions: 96 MiB), once the size exceeds `512 * d`
    /// bytes; a power of two stays as it is. Entries are 0 (off, the default), 1 (off), or
    /// powers of two.
    pub roundup_power2_divisions: [usize; ROUNDUP_POWER2_INTERVALS],
    /// PyTorch's `garbage_collection_threshold` (strictly between 0 and 1): when a request
    /// misses the cache and the reserved bytes exceed this fraction of the memory limit, cached
    /// whole large-pool segments are given back, the oldest (least recently cached, counted in
    /// cache lookups) first, until the reserved bytes are under it — without waiting for
    /// streams, before trying a new segment. As in PyTorch, it acts only when a
    /// [`memory_limit`](Self::memory_limit) is set. None by default.
    pub garbage_collection_threshold: Option<f64>,
    /// PyTorch's `expandable_segments`: each stream's pool (small and large) gets one
    /// segment, a reserved address range whose pages are mapped as it grows (in units of
    /// [`SMALL_BUFFER`](crate::SMALL_BUFFER) or [`LARGE_BUFFER`](crate::LARGE_BUFFER)), so that
    /// growing requests extend one block instead of leaving a trail of cached segments. Used
    /// when the source supports it ([`MemorySource::supports_expandable_segments`](crate::MemorySource::supports_expandable_segments));
    /// off by default.
    pub expandable_segments: bool,
}

impl PartialEq for MemoryLimit {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (MemoryLimit::Bytes(a), MemoryLimit::Bytes(b)) => a == b,
            (MemoryLimit::Fraction(a), MemoryLimit::Fraction(b)) => a.to_bits() == b.to_bits(),
            _ => false,
        }
    }
}

impl Eq for MemoryLimit {}

impl std::hash::Hash for MemoryLimit {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        match self {
            MemoryLimit::Bytes(b) => (0u8, *b as u64).hash(state),
            MemoryLimit::Fraction(f) => (1u8, f.to_bits()).hash(state),
        }
    }
}

impl AllocatorConfig {
    /// The fields, with the threshold as bits: what equality and hashing compare.
    #[allow(clippy::type_complexity)]
    fn key(
        &self,
    ) -> (
        Option<MemoryLimit>,
        Option<usize>,
        Duration,
        [usize; ROUNDUP_POWER2_INTERVALS],
        Option<u64>,
        bool,
    ) {
        // Destructured, so that a new field cannot be forgotten here.
        let AllocatorConfig {
            memory_limit,
            max_split_size,
            sync_timeout,
            roundup_power2_divisions,
            garbage_collection_threshold,
            expandable_segments,
        } = *self;
        (
            memory_limit,
            max_split_size,
            sync_timeout,
            roundup_power2_divisions,
            garbage_collection_threshold.map(f64::to_bits),
            expandable_segments,
        )
    }
}

impl PartialEq for AllocatorConfig {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for AllocatorConfig {}

impl std::hash::Hash for AllocatorConfig {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

/// Number of power-of-two intervals of
/// [`roundup_power2_divisions`](AllocatorConfig::roundup_power2_divisions) (as in PyTorch).
pub const ROUNDUP_POWER2_INTERVALS: usize = 16;

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            memory_limit: None,
            max_split_size: None,
            sync_timeout: DEFAULT_TIMEOUT,
            roundup_power2_divisions: [0; ROUNDUP_POWER2_INTERVALS],
            garbage_collection_threshold: None,
            expandable_segments: false,
        }
    }
}

impl AllocatorConfig {
    /// The defaults: no limit, no `max_split_size`, the default timeout.
    pub fn new() -> Self {
        Self::default()
    }

    /// Set a memory limit.
    pub fn with_memory_limit(mut self, limit: MemoryLimit) -> Self {
        self.memory_limit = Some(limit);
        self
    }

    /// Set `max_split_size` (bytes).
    pub fn with_max_split_size(mut self, bytes: usize) -> Self {
        self.max_split_size = Some(bytes);
        self
    }

    /// Set the timeout of waits for record-stream events.
    pub fn with_sync_timeout(mut self, timeout: Duration) -> Self {
        self.sync_timeout = timeout;
        self
    }

    /// Round every request up to `divisions` divisions of its power-of-two interval
    /// (PyTorch's `roundup_power2_divisions:N`).
    pub fn with_roundup_power2_divisions(mut self, divisions: usize) -> Self {
        self.roundup_power2_divisions = [divisions; ROUNDUP_POWER2_INTERVALS];
        self
    }

    /// Divisions per power-of-two interval (PyTorch's `roundup_power2_divisions:[64:8,...]`:
    /// the entry of index `log2(k)` applies to sizes from `k` MiB to `2k` MiB).
    pub fn with_roundup_power2_divisions_per_interval(
        mut self,
        divisions: [usize; ROUNDUP_POWER2_INTERVALS],
    ) -> Self {
        self.roundup_power2_divisions = divisions;
        self
    }

    /// Set `garbage_collection_threshold` (a fraction strictly between 0 and 1).
    pub fn with_garbage_collection_threshold(mut self, fraction: f64) -> Self {
        self.garbage_collection_threshold = Some(fraction);
        self
    }

    /// Turn expandable segments on or off.
    pub fn with_expandable_segments(mut self, on: bool) -> Self {
        self.expandable_segments = on;
        self
    }

    /// A request's size after rounding (PyTorch's `round_size`): at least
    /// [`MIN_BLOCK_SIZE`](crate::MIN_BLOCK_SIZE), a multiple of it, rounded further by
    /// [`roundup_power2_divisions`](Self::roundup_power2_divisions). `None` if it overflows.
    pub fn round_size(&self, size: usize) -> Option<usize> {
        let base = crate::round_size(size)?;
        if size < MIN_BLOCK_SIZE {
            return Some(base);
        }
        let log = size.ilog2() as usize;
        let index = log.saturating_sub(20).min(ROUNDUP_POWER2_INTERVALS - 1);
        let divisions = self.roundup_power2_divisions[index];
        if divisions <= 1 || size <= MIN_BLOCK_SIZE * divisions || size.is_power_of_two() {
            return Some(base);
        }
        let floor = 1usize << log;
        let step = floor >> divisions.ilog2();
        if step == 0 {
            return floor.checked_mul(2);
        }
        let down = size & !(step - 1);
        if down == size {
            Some(size)
        } else {
            down.checked_add(step)
        }
    }

    pub(crate) fn validate(&self) -> Result<(), AllocError> {
        for (i, &d) in self.roundup_power2_divisions.iter().enumerate() {
            if d > 1 && !d.is_power_of_two() {
                return Err(AllocError::InvalidConfig(format!(
                    "roundup_power2_divisions must be 0, 1 or a power of two, got {d} (interval \
                     {i})"
                )));
            }
        }
        if let Some(t) = self.garbage_collection_threshold {
            if !(t > 0.0 && t < 1.0) {
                return Err(AllocError::InvalidConfig(format!(
                    "garbage_collection_threshold must lie strictly between 0 and 1, got {t}"
                )));
            }
        }
        if let Some(m) = self.max_split_size {
            if m <= LARGE_BUFFER {
                return Err(AllocError::InvalidConfig(format!(
                    "max_split_size must exceed {LARGE_BUFFER} bytes (20 MiB), got {m}"
                )));
            }
        }
        Ok(())
    }
}

pub(crate) fn resolve_limit(
    limit: Option<MemoryLimit>,
    total: usize,
) -> Result<Option<usize>, AllocError> {
    match limit {
        None => Ok(None),
        Some(MemoryLimit::Bytes(b)) => Ok(Some(b)),
        Some(MemoryLimit::Fraction(f)) => {
            if (0.0..=1.0).contains(&f) {
                Ok(Some((f * total as f64).floor() as usize))
            } else {
                Err(AllocError::InvalidConfig(format!(
                    "memory fraction must lie in [0, 1], got {f}"
                )))
            }
        }
    }
}
