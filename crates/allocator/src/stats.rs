//! Statistics in the shape of PyTorch's `torch.cuda.memory_stats()`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Which pool a block or segment belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// Requests of at most [`SMALL_SIZE`](crate::SMALL_SIZE) bytes, packed into
    /// [`SMALL_BUFFER`](crate::SMALL_BUFFER) segments.
    Small,
    /// Larger requests.
    Large,
}

impl PoolKind {
    /// The pool serving a request of `rounded` bytes (already rounded by
    /// [`round_size`](crate::round_size)).
    pub fn for_size(rounded: usize) -> PoolKind {
        if rounded <= crate::SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            PoolKind::Small => 0,
            PoolKind::Large => 1,
        }
    }
}

/// One statistic: its current value, its peak since the last
/// [`reset_peak_stats`](crate::CachingAllocator::reset_peak_stats), and the totals added and
/// removed since the last
/// [`reset_accumulated_stats`](crate::CachingAllocator::reset_accumulated_stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stat {
    /// Current value.
    pub current: u64,
    /// Highest value reached.
    pub peak: u64,
    /// Sum of all increases.
    pub allocated: u64,
    /// Sum of all decreases.
    pub freed: u64,
}

impl Stat {
    #[inline]
    pub(crate) fn increase(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }

    #[inline]
    pub(crate) fn decrease(&mut self, n: u64) {
        debug_assert!(self.current >= n, "statistic would go negative");
        self.current = self.current.saturating_sub(n);
        self.freed += n;
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

/// A statistic for both pools together and for each pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatArray {
    /// Both pools.
    pub all: Stat,
    /// The small pool.
    pub small_pool: Stat,
    /// The large pool.
    pub large_pool: Stat,
}

impl StatArray {
    /// The statistic of one pool.
    pub fn pool(&self, pool: PoolKind) -> &Stat {
        match pool {
            PoolKind::Small => &self.small_pool,
            PoolKind::Large => &self.large_pool,
        }
    }

    #[inline]
    pub(crate) fn increase(&mut self, pool: PoolKind, n: u64) {
        self.all.increase(n);
        match pool {
            PoolKind::Small => self.small_pool.increase(n),
            PoolKind::Large => self.large_pool.increase(n),
        }
    }

    #[inline]
    pub(crate) fn decrease(&mut self, pool: PoolKind, n: u64) {
        self.all.decrease(n);
        match pool {
            PoolKind::Small => self.small_pool.decrease(n),
            PoolKind::Large => self.large_pool.decrease(n),
        }
    }

    fn each_mut(&mut self) -> [&mut Stat; 3] {
        [&mut self.all, &mut self.small_pool, &mut self.large_pool]
    }
}

/// The allocator's statistics, named as in PyTorch's `memory_stats()`.
///
/// *Allocated* blocks are held by live [`Block`](crate::Block) handles. *Active* blocks are
/// allocated or freed-but-pending (their `record_stream` events have not completed), so
/// `active_bytes - allocated_bytes` is the memory waiting for other streams. *Inactive split*
/// blocks are cached free blocks that are part of a split segment (fragmentation). *Reserved*
/// bytes are held in segments obtained from the memory source.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryStats {
    /// Number of allocated blocks.
    pub allocation: StatArray,
    /// Number of segments obtained from the memory source.
    pub segment: StatArray,
    /// Number of active blocks (allocated or pending free).
    pub active: StatArray,
    /// Number of free blocks inside split segments.
    pub inactive_split: StatArray,
    /// Bytes in allocated blocks.
    pub allocated_bytes: StatArray,
    /// Bytes in segments.
    pub reserved_bytes: StatArray,
    /// Bytes in active blocks.
    pub active_bytes: StatArray,
    /// Bytes in free blocks inside split segments.
    pub inactive_split_bytes: StatArray,
    /// Bytes asked for by the active blocks' requests (before rounding).
    pub requested_bytes: StatArray,
    /// Allocated blocks of at least `max_split_size` bytes.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size` bytes.
    pub oversize_segments: Stat,
    /// Failed segment allocations answered by freeing the cache and retrying.
    pub num_alloc_retries: u64,
    /// Requests that failed with [`AllocError::OutOfMemory`](crate::AllocError::OutOfMemory).
    pub num_ooms: u64,
    /// Times the allocator waited for every pending record-stream event.
    pub num_sync_all_streams: u64,
    /// Segments obtained from the memory source.
    pub num_device_alloc: u64,
    /// Segments returned to the memory source.
    pub num_device_free: u64,
    /// The `max_split_size` option in bytes, −1 when unset (as PyTorch reports it: always
    /// present).
    pub max_split_size: i64,
}

impl Default for MemoryStats {
    fn default() -> Self {
        MemoryStats {
            allocation: StatArray::default(),
            segment: StatArray::default(),
            active: StatArray::default(),
            inactive_split: StatArray::default(),
            allocated_bytes: StatArray::default(),
            reserved_bytes: StatArray::default(),
            active_bytes: StatArray::default(),
            inactive_split_bytes: StatArray::default(),
            requested_bytes: StatArray::default(),
            oversize_allocations: Stat::default(),
            oversize_segments: Stat::default(),
            num_alloc_retries: 0,
            num_ooms: 0,
            num_sync_all_streams: 0,
            num_device_alloc: 0,
            num_device_free: 0,
            max_split_size: -1,
        }
    }
}

impl MemoryStats {
    /// The `max_split_size` option, if set.
    pub fn max_split_size(&self) -> Option<u64> {
        u64::try_from(self.max_split_size).ok()
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    pub(crate) fn reset_peak(&mut self) {
        for a in self.arrays_mut() {
            for s in a.each_mut() {
                s.reset_peak();
            }
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    pub(crate) fn reset_accumulated(&mut self) {
        for a in self.arrays_mut() {
            for s in a.each_mut() {
                s.reset_accumulated();
            }
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }

    /// The statistics as a flat map with PyTorch's keys, e.g. `"allocated_bytes.all.current"`,
    /// `"active.large_pool.peak"`, `"num_alloc_retries"`, `"max_split_size"` (−1 when unset).
    /// Values saturate at `i64::MAX`.
    pub fn as_map(&self) -> BTreeMap<String, i64> {
        let v = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
        let mut m = BTreeMap::new();
        let arrays: [(&str, &StatArray); 9] = [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ];
        let mut put = |prefix: String, s: &Stat| {
            m.insert(format!("{prefix}.current"), v(s.current));
            m.insert(format!("{prefix}.peak"), v(s.peak));
            m.insert(format!("{prefix}.allocated"), v(s.allocated));
            m.insert(format!("{prefix}.freed"), v(s.freed));
        };
        for (name, a) in arrays {
            put(format!("{name}.all"), &a.all);
            put(format!("{name}.small_pool"), &a.small_pool);
            put(format!("{name}.large_pool"), &a.large_pool);
        }
        put("oversize_allocations".into(), &self.oversize_allocations);
        put("oversize_segments".into(), &self.oversize_segments);
        m.insert("num_alloc_retries".into(), v(self.num_alloc_retries));
        m.insert("num_ooms".into(), v(self.num_ooms));
        m.insert("num_sync_all_streams".into(), v(self.num_sync_all_streams));
        m.insert("num_device_alloc".into(), v(self.num_device_alloc));
        m.insert("num_device_free".into(), v(self.num_device_free));
        m.insert("max_split_size".into(), self.max_split_size);
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = StatArray::default();
        s.increase(PoolKind::Small, 10);
        s.increase(PoolKind::Large, 5);
        s.decrease(PoolKind::Small, 4);
        assert_eq!(s.all.current, 11);
        assert_eq!(s.all.peak, 15);
        assert_eq!(s.small_pool.allocated - s.small_pool.freed, 6);
        let mut m = MemoryStats {
            allocated_bytes: s,
            ..Default::default()
        };
        m.reset_peak();
        assert_eq!(m.allocated_bytes.all.peak, 11);
        let map = m.as_map();
        assert_eq!(map["allocated_bytes.large_pool.current"], 5);
        assert_eq!(map["num_alloc_retries"], 0);
        assert_eq!(map["max_split_size"], -1, "always present, -1 when unset");
        assert_eq!(m.max_split_size(), None);
        m.reset_accumulated();
        assert_eq!(m.allocated_bytes.all.allocated, 0);
        assert_eq!(m.allocated_bytes.all.current, 11);
    }
}
