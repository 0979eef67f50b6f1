//! Any [`Storage`] made stream-ordered: [`OrderedStorage`] and [`Buffer::stream_ordered`].
//!
//! A caching allocator's block, a host allocation or any other storage becomes memory that
//! work uses through [`Buffer::use_on`] on streams of its device, ordered by the events of a
//! [`StreamOrder`] (as device memory is), instead of access tickets. Dropping the last buffer
//! over it does not release the memory at once: the inner storage is handed to the reaper
//! thread with the events of the work issued on it, and dropped (for an allocator block:
//! returned to its allocator) only once that work has completed. That is FSDP2's "held
//! references" instead of `record_stream`: memory used on several streams needs no declaration
//! of each stream, and is never reused while a stream still reads or writes it.
//!
//! Host access ([`Buffer::read`], [`Buffer::write`]) refuses a stream-ordered buffer even in
//! host memory: a host guard would not order itself against the stream work. Use a stream.

use std::fmt;
use std::sync::Arc;

use crate::{reaper, Buffer, DType, Device, DeviceError, Storage, StreamOrder};

/// A [`Storage`] ordered by stream events instead of access tickets: work uses its buffers
/// through [`Buffer::use_on`], and dropping the last one hands the inner storage to the reaper
/// thread, which drops it (for an allocator block: returns it to its allocator) once the work
/// issued on it has completed — FSDP2's held references instead of `record_stream`. Host
/// access refuses its buffers, even in host memory.
pub struct OrderedStorage {
    /// `None` only once dropped (handed to the reaper).
    inner: Option<Box<dyn Storage>>,
    order: Arc<StreamOrder>,
    device: Device,
    byte_len: usize,
}

impl fmt::Debug for OrderedStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OrderedStorage")
            .field("device", &self.device)
            .field("byte_len", &self.byte_len)
            .field("order", &self.order)
            .finish()
    }
}

impl OrderedStorage {
    /// `inner`, ordered by a new [`StreamOrder`] with no recorded work.
    ///
    /// # Errors
    /// [`DeviceError::InvalidArgument`] when `inner` is already stream-ordered (its own order
    /// would be bypassed) or is on [`Device::Meta`] (no memory to order).
    pub fn new(inner: Box<dyn Storage>) -> Result<OrderedStorage, DeviceError> {
        if inner.stream_order().is_some() {
            return Err(DeviceError::InvalidArgument(
                "an OrderedStorage over a storage that is already stream-ordered".into(),
            ));
        }
        let device = inner.device();
        if device == Device::Meta {
            return Err(DeviceError::InvalidArgument(
                "an OrderedStorage over meta storage (it has no memory to order)".into(),
            ));
        }
        Ok(OrderedStorage {
            order: Arc::new(StreamOrder::new()),
            device,
            byte_len: inner.byte_len(),
            inner: Some(inner),
        })
    }
}

impl Drop for OrderedStorage {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            reaper::release_after(self.order.events(), Box::new(inner));
        }
    }
}

// SAFETY: the address, length and alignment are the inner storage's, which this value owns
// until it drops; then the inner storage (and so the memory) lives on in the reaper until
// every use recorded in the order has completed, so no stream work issued through
// `Buffer::use_on` outlives it. Host access refuses stream-ordered buffers, so only stream
// work touches the bytes.
unsafe impl Storage for OrderedStorage {
    fn device(&self) -> Device {
        self.device
    }
    fn byte_len(&self) -> usize {
        self.byte_len
    }
    fn as_ptr(&self) -> *mut u8 {
        self.inner
            .as_ref()
            .map_or(std::ptr::null_mut(), |s| s.as_ptr())
    }
    fn stream_order(&self) -> Option<Arc<StreamOrder>> {
        Some(self.order.clone())
    }
    fn is_page_locked(&self) -> bool {
        self.inner.as_ref().is_some_and(|s| s.is_page_locked())
    }
}

impl Buffer {
    /// A buffer of `dtype` over `storage` made stream-ordered ([`OrderedStorage`]): work uses
    /// it through [`Buffer::use_on`], and the storage is dropped only once the work issued on
    /// it has completed.
    ///
    /// ```
    /// use fsdp_device::{AccessMode, Buffer, DType, HostStorage, Stream};
    /// let stream = Stream::cpu("work");
    /// let buf = Buffer::stream_ordered(Box::new(HostStorage::zeroed(16).unwrap()), DType::F32)
    ///     .unwrap();
    /// let u = buf.use_on(&stream, AccessMode::Exclusive).unwrap();
    /// let p = u.device_ptr() as usize;
    /// stream
    ///     .enqueue(move || {
    ///         // SAFETY: 4 f32 of host memory that only this stream's work touches.
    ///         unsafe { std::ptr::write_bytes(p as *mut f32, 0, 4) }
    ///     })
    ///     .unwrap();
    /// u.finish();
    /// // Host access is refused: a host guard would not wait for the stream.
    /// assert!(buf.read::<f32>().is_err());
    /// ```
    ///
    /// # Errors
    /// As [`OrderedStorage::new`] and [`Buffer::from_storage`].
    pub fn stream_ordered(storage: Box<dyn Storage>, dtype: DType) -> Result<Buffer, DeviceError> {
        Buffer::from_storage(Box::new(OrderedStorage::new(storage)?), dtype)
    }
}

#[cfg(test)]
#[path = "ordered_tests.rs"]
mod tests;
