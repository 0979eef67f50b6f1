//! The block handles: [`Block`]'s accessors, record-stream, buffers and drop, [`SharedBlock`],
//! and the [`Storage`] of both.

use std::fmt;
use std::sync::Arc;

use fsdp_device::{Buffer, DType, Device, Storage};

use super::{Block, CachingAllocator};
use crate::{AllocError, MemorySource, PoolKind};

impl<S: MemorySource> fmt::Debug for Block<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Block")
            .field("device", &self.device())
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("size", &self.size)
            .field("requested", &self.requested)
            .field("stream", &self.stream)
            .field("pool", &self.pool)
            .finish()
    }
}

impl<S: MemorySource> Block<S> {
    /// Size in bytes after rounding (what the block occupies).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes asked for.
    pub fn requested_size(&self) -> usize {
        self.requested
    }

    /// The address (host or device, per [`device`](Block::device)). It stays valid while the
    /// handle lives; work on other streams that uses it past the drop must be declared with
    /// [`record_stream`](Block::record_stream) (or keep the handle alive).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.0
    }

    /// The address as a number.
    pub fn addr(&self) -> u64 {
        self.ptr.0.addr() as u64
    }

    /// The key of the stream it was allocated on (its pool).
    pub fn stream(&self) -> u64 {
        self.stream
    }

    /// The pool it came from.
    pub fn pool(&self) -> PoolKind {
        self.pool
    }

    /// The device of the memory.
    pub fn device(&self) -> Device {
        self.shared.source.device()
    }

    /// The allocator it belongs to.
    pub fn allocator(&self) -> CachingAllocator<S> {
        CachingAllocator {
            shared: self.shared.clone(),
        }
    }

    /// Declare that `stream` uses the block: when the block is freed, an event is recorded on
    /// `stream`, and the memory is reused only once it completes. Uses on the allocation stream
    /// need no event and are ignored.
    pub fn record_stream(&self, stream: &S::Stream) -> Result<(), AllocError> {
        let key = S::stream_key(stream);
        if key == self.stream {
            return Ok(());
        }
        let mut st = self.shared.lock();
        // Under the state lock, as in `allocate`.
        self.shared.source.validate_stream(stream)?;
        let uses = &mut st.blk_mut(self.id).uses;
        if !uses.iter().flat_map(|u| u.iter()).any(|(k, _)| *k == key) {
            let mut v = uses.take().map(Vec::from).unwrap_or_default();
            v.push((key, stream.clone()));
            *uses = Some(v.into_boxed_slice());
        }
        Ok(())
    }

    /// A buffer of `requested_size / dtype.size_in_bytes()` elements over the block, which it
    /// owns.
    pub fn into_buffer(self, dtype: DType) -> Result<Buffer, AllocError> {
        Ok(Buffer::from_storage(Box::new(self), dtype)?)
    }

    /// A stream-ordered buffer over the block ([`Buffer::stream_ordered`]): work on any stream
    /// of its device uses it through [`Buffer::use_on`], ordered by events, and the block
    /// returns to the allocator only once the last buffer over it is gone **and** the work
    /// issued on it has completed. That is FSDP2's held references instead of
    /// [`record_stream`](Block::record_stream): no stream needs declaring, and the memory is
    /// counted as allocated until then.
    ///
    /// # Errors
    /// As [`Buffer::stream_ordered`] (a meta source's blocks have no memory to order).
    pub fn into_ordered_buffer(self, dtype: DType) -> Result<Buffer, AllocError> {
        Ok(Buffer::stream_ordered(Box::new(self), dtype)?)
    }

    /// A buffer over a shared block: the memory returns to the allocator once `this` and every
    /// buffer are gone, and `this` can still [`record_stream`](Block::record_stream).
    pub fn shared_buffer(this: &Arc<Self>, dtype: DType) -> Result<Buffer, AllocError> {
        Ok(Buffer::from_storage(
            Box::new(SharedBlock(this.clone())),
            dtype,
        )?)
    }
}

impl<S: MemorySource> Drop for Block<S> {
    fn drop(&mut self) {
        let sh = &*self.shared;
        sh.lock().free(&sh.source, self.id);
    }
}

// SAFETY: the `requested` bytes at `ptr` (within the block's `size`) belong to this handle
// alone until it drops: the allocator hands a block to one handle and reuses it only after the
// drop and the completion of every record-stream event. The address is fixed, a multiple of 512
// from a SEGMENT_ALIGN-aligned segment start, and for host sources points to initialised host
// memory; for meta sources it is an identifier only, and `device` reports Device::Meta, so the
// buffers over it never dereference it (MemorySource's contract).
unsafe impl<S: MemorySource> Storage for Block<S> {
    fn device(&self) -> Device {
        self.shared.source.device()
    }
    fn byte_len(&self) -> usize {
        self.requested
    }
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.0
    }
}

/// A shared [`Block`] as a [`Storage`] (see [`Block::shared_buffer`]).
pub struct SharedBlock<S: MemorySource>(pub Arc<Block<S>>);

impl<S: MemorySource> fmt::Debug for SharedBlock<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SharedBlock").field(&self.0).finish()
    }
}

// SAFETY: as for Block, which the Arc keeps alive (and its memory reserved) while this lives.
unsafe impl<S: MemorySource> Storage for SharedBlock<S> {
    fn device(&self) -> Device {
        self.0.device()
    }
    fn byte_len(&self) -> usize {
        self.0.requested
    }
    fn as_ptr(&self) -> *mut u8 {
        self.0.ptr.0
    }
}
