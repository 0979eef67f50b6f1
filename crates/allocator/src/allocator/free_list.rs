//! The cached free blocks of one pool, kept in [`FreeKey`] order.

use std::collections::BTreeMap;

use super::{BlockId, FreeKey};

/// The cached free blocks of one pool in [`FreeKey`] order: a sorted vector while short (the
/// common case: a binary search and a short move, no node allocations), a B-tree once long.
#[derive(Default)]
pub(super) struct FreeList {
    vec: Vec<(FreeKey, BlockId)>,
    tree: Option<BTreeMap<FreeKey, BlockId>>,
}

impl FreeList {
    /// Above this many entries the vector becomes a tree...
    const TO_TREE: usize = 256;
    /// ...and below this many the tree becomes a vector again.
    const TO_VEC: usize = 64;

    #[inline]
    pub(super) fn insert(&mut self, key: FreeKey, id: BlockId) {
        match &mut self.tree {
            Some(t) => {
                t.insert(key, id);
            }
            None => {
                let i = self.vec.partition_point(|(k, _)| *k < key);
                self.vec.insert(i, (key, id));
                if self.vec.len() > Self::TO_TREE {
                    self.tree = Some(self.vec.drain(..).collect());
                }
            }
        }
    }

    #[inline]
    pub(super) fn remove(&mut self, key: &FreeKey) {
        match &mut self.tree {
            Some(t) => {
                t.remove(key);
                if t.len() < Self::TO_VEC {
                    self.vec.extend(t.iter().map(|(k, v)| (*k, *v)));
                    self.tree = None;
                }
            }
            None => {
                if let Ok(i) = self.vec.binary_search_by(|(k, _)| k.cmp(key)) {
                    self.vec.remove(i);
                }
            }
        }
    }

    /// The first entry at or after `key`.
    #[inline]
    pub(super) fn first_from(&self, key: FreeKey) -> Option<(FreeKey, BlockId)> {
        match &self.tree {
            Some(t) => t.range(key..).next().map(|(k, v)| (*k, *v)),
            None => {
                let i = self.vec.partition_point(|(k, _)| *k < key);
                self.vec.get(i).copied()
            }
        }
    }

    /// The entries in `lo..hi`, in order.
    pub(super) fn range(&self, lo: FreeKey, hi: FreeKey) -> Vec<(FreeKey, BlockId)> {
        match &self.tree {
            Some(t) => t.range(lo..hi).map(|(k, v)| (*k, *v)).collect(),
            None => {
                let a = self.vec.partition_point(|(k, _)| *k < lo);
                let b = self.vec.partition_point(|(k, _)| *k < hi);
                self.vec[a..b.max(a)].to_vec()
            }
        }
    }

    pub(super) fn ids(&self) -> Vec<BlockId> {
        match &self.tree {
            Some(t) => t.values().copied().collect(),
            None => self.vec.iter().map(|(_, id)| *id).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_list_matches_a_btree_through_vector_and_tree_forms() {
        let mut list = FreeList::default();
        let mut model: BTreeMap<FreeKey, BlockId> = BTreeMap::new();
        let mut x = 12345u64;
        let mut next = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            x >> 33
        };
        let check = |list: &FreeList, model: &BTreeMap<FreeKey, BlockId>, probe: FreeKey| {
            assert_eq!(
                list.first_from(probe),
                model.range(probe..).next().map(|(k, v)| (*k, *v))
            );
            let hi = (probe.0, probe.1 + 4096, 0, 0);
            let want: Vec<_> = model.range(probe..hi).map(|(k, v)| (*k, *v)).collect();
            assert_eq!(list.range(probe, hi), want);
            assert_eq!(list.ids(), model.values().copied().collect::<Vec<_>>());
        };
        // Grow past TO_TREE, shrink below TO_VEC, twice.
        for round in 0..2 {
            for i in 0..600 {
                let key = (
                    next() % 3,
                    (next() % 64) as usize * 512,
                    next() % 4,
                    i * 512 + round,
                );
                list.insert(key, i);
                model.insert(key, i);
                if i % 50 == 0 {
                    check(
                        &list,
                        &model,
                        (next() % 3, (next() % 64) as usize * 512, 0, 0),
                    );
                }
            }
            assert!(list.tree.is_some());
            let keys: Vec<FreeKey> = model.keys().copied().collect();
            for (j, k) in keys.iter().enumerate() {
                if j % 20 != 0 {
                    list.remove(k);
                    model.remove(k);
                }
                if j % 40 == 0 {
                    check(
                        &list,
                        &model,
                        (next() % 3, (next() % 64) as usize * 512, 0, 0),
                    );
                }
            }
            assert!(list.tree.is_none());
            check(&list, &model, (0, 0, 0, 0));
        }
    }
}
