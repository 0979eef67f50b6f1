//! The block and segment tables of [`State`]: lookups, slot reuse and free-pool keys.

use super::{BlockEntry, BlockId, FreeKey, Segment, State};
use crate::MemorySource;

impl<S: MemorySource> State<S> {
    #[inline]
    pub(super) fn blk(&self, id: BlockId) -> &BlockEntry<S::Stream> {
        self.blocks[id]
            .as_ref()
            .expect("block ids in use refer to live entries")
    }

    #[inline]
    pub(super) fn blk_mut(&mut self, id: BlockId) -> &mut BlockEntry<S::Stream> {
        self.blocks[id]
            .as_mut()
            .expect("block ids in use refer to live entries")
    }

    pub(super) fn seg(&self, id: usize) -> &Segment {
        self.segments[id]
            .as_ref()
            .expect("segment ids in use refer to live segments")
    }

    #[inline]
    /// A slot for a new segment (a freed one reused, else a new one) and the serial number of
    /// its first block.
    pub(super) fn new_segment_slot(&mut self) -> (usize, u64) {
        let seg_id = match self.free_segment_ids.pop() {
            Some(i) => i,
            None => {
                self.segments.push(None);
                self.segments.len() - 1
            }
        };
        let serial = self.next_serial;
        self.next_serial += 1;
        (seg_id, serial)
    }

    pub(super) fn add_block(&mut self, e: BlockEntry<S::Stream>) -> BlockId {
        match self.free_ids.pop() {
            Some(id) => {
                self.blocks[id] = Some(e);
                id
            }
            None => {
                self.blocks.push(Some(e));
                self.blocks.len() - 1
            }
        }
    }

    #[inline]
    pub(super) fn remove_block(&mut self, id: BlockId) -> BlockEntry<S::Stream> {
        let e = self.blocks[id].take().expect("removed block is live");
        self.free_ids.push(id);
        e
    }

    #[inline]
    pub(super) fn key(b: &BlockEntry<S::Stream>) -> FreeKey {
        (b.stream, b.size, b.serial, b.addr)
    }

    pub(super) fn remove_free(&mut self, id: BlockId) {
        let b = self.blk(id);
        let (pool, key) = (b.pool.index(), Self::key(b));
        self.pools[pool].remove(&key);
    }

    #[inline]
    pub(super) fn is_oversize(&self, size: usize) -> bool {
        self.max_split_size.is_some_and(|m| size >= m)
    }

    pub(super) fn is_unsplit(&self, id: BlockId) -> bool {
        let b = self.blk(id);
        b.prev.is_none() && b.next.is_none()
    }
}
