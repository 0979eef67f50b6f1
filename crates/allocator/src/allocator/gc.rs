//! `garbage_collection_threshold` (PyTorch's `garbage_collect_cached_blocks`).

use super::{BlockId, State};
use crate::{MemorySource, PoolKind};

impl<S: MemorySource> State<S> {
    /// Whether garbage collection runs: a threshold is set, and so is a memory limit (as in
    /// PyTorch, where it needs a memory fraction).
    #[inline]
    pub(super) fn gc_active(&self) -> bool {
        self.gc_threshold.is_some() && self.limit.is_some()
    }

    /// Give back cached whole large-pool segments while the reserved bytes exceed the
    /// threshold: rounds that free every block at least as old as the average (age: cache
    /// lookups of the pool since the block was cached), until enough is reclaimed or nothing
    /// is freed. No stream is waited for.
    pub(super) fn garbage_collect(&mut self, source: &S) {
        let (Some(t), Some(limit)) = (self.gc_threshold, self.limit) else {
            return;
        };
        let threshold = (t * limit as f64) as usize;
        let reserved = self.stats.reserved_bytes.all.current as usize;
        if reserved <= threshold {
            return;
        }
        let target = reserved - threshold;
        let large = PoolKind::Large.index();
        let now = self.gc_calls[large];
        let age = |st: &Self, id: BlockId| (now - st.blk(id).gc_base) as f64;
        let freeable = |st: &Self| -> Vec<BlockId> {
            st.pools[large]
                .ids()
                .into_iter()
                .filter(|&id| st.is_unsplit(id) && !st.seg(st.blk(id).segment).is_expandable())
                .collect()
        };
        let mut candidates = freeable(self);
        let mut total_age: f64 = candidates.iter().map(|&id| age(self, id)).sum();
        let mut reclaimed = 0;
        while reclaimed < target && !candidates.is_empty() {
            let threshold_age = total_age / candidates.len() as f64;
            let mut freed = false;
            // In pool order (stream, size, age of segment), as PyTorch walks its block set.
            for id in std::mem::take(&mut candidates) {
                let a = age(self, id);
                if a >= threshold_age {
                    freed = true;
                    reclaimed += self.blk(id).size;
                    total_age -= a;
                    self.release_block(source, id);
                } else {
                    candidates.push(id);
                }
            }
            if !freed {
                break;
            }
        }
    }
}
