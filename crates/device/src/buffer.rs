//! Buffers that streams can safely work on asynchronously.
//!
//! A [`Buffer`] is a typed-at-run-time, one-dimensional view of a [`Storage`] (a host allocation,
//! an allocator block, or device memory). Work handed to a stream takes [`AccessTicket`]s when it
//! is *issued* and turns them into [`AccessGuard`]s when it *runs*; tickets on overlapping ranges
//! are granted in the order they were taken, shared ones together, exclusive ones alone. Host code
//! that reads a buffer ([`Buffer::read`]) therefore waits for the stream work issued before it,
//! exactly as a CUDA user would synchronise — but here forgetting to do so cannot cause a data
//! race: it is a wait, bounded by a timeout.
//!
//! The storage lives as long as any clone, slice, ticket or guard of the buffer, so a stream task
//! that owns a guard keeps the memory alive even if the caller drops or forgets every handle.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use crate::storage::{HostStorage, MetaStorage, Storage, HOST_ALIGN};
use crate::{DType, Device, DeviceError, Element, StreamOrder, DEFAULT_TIMEOUT};
use tickets::AccessLock;
pub use tickets::{AccessGuard, AccessMode, AccessTicket, ReadGuard, WriteGuard};

#[path = "tickets.rs"]
mod tickets;

/// Bytes of `len` elements of `dtype`; an overflow is an invalid argument naming both.
pub(crate) fn byte_size(dtype: DType, len: usize) -> Result<usize, DeviceError> {
    len.checked_mul(dtype.size_in_bytes()).ok_or_else(|| {
        DeviceError::InvalidArgument(format!("{len} elements of {dtype} overflow usize"))
    })
}

static NEXT_STORAGE_ID: AtomicU64 = AtomicU64::new(1);

struct Shared {
    id: u64,
    storage: Box<dyn Storage>,
    access: AccessLock,
}

/// A one-dimensional run of elements of one [`DType`] in a [`Storage`]. Cloning and slicing
/// share the storage.
///
/// ```
/// use fsdp_device::Buffer;
/// let buf = Buffer::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).unwrap();
/// let tail = buf.slice(2..4).unwrap();
/// tail.write::<f32>().unwrap()[0] = 30.0;
/// assert_eq!(buf.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 30.0, 4.0]);
/// ```
#[derive(Clone)]
pub struct Buffer {
    shared: Arc<Shared>,
    dtype: DType,
    /// Offset from the storage base, in elements.
    offset: usize,
    /// Length in elements.
    len: usize,
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("storage", &self.shared.id)
            .field("device", &self.device())
            .field("dtype", &self.dtype)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Buffer {
    /// A zero-filled host buffer.
    pub fn zeros(dtype: DType, len: usize) -> Result<Buffer, DeviceError> {
        let bytes = len
            .checked_mul(dtype.size_in_bytes())
            .ok_or(DeviceError::OutOfMemory { bytes: usize::MAX })?;
        Buffer::from_storage(Box::new(HostStorage::zeroed(bytes)?), dtype)
    }

    /// A host buffer holding a copy of `data`.
    pub fn from_slice<T: Element>(data: &[T]) -> Result<Buffer, DeviceError> {
        let buf = Buffer::zeros(T::DTYPE, data.len())?;
        buf.write::<T>()?.copy_from_slice(data);
        Ok(buf)
    }

    /// A buffer of `len` elements of `dtype` on [`Device::Meta`]: it has a length, a byte size,
    /// slices and access tickets, but no memory ([`MetaStorage`]); reading or writing its
    /// elements is an error.
    pub fn meta(dtype: DType, len: usize) -> Result<Buffer, DeviceError> {
        Buffer::from_storage(Box::new(MetaStorage::new(byte_size(dtype, len)?)), dtype)
    }

    /// A buffer over `storage`, as many whole elements of `dtype` as fit.
    pub fn from_storage(storage: Box<dyn Storage>, dtype: DType) -> Result<Buffer, DeviceError> {
        let addr = storage.as_ptr() as usize;
        if addr % dtype.size_in_bytes().max(8) != 0 && storage.byte_len() > 0 {
            return Err(DeviceError::InvalidArgument(format!(
                "storage address {addr:#x} is not aligned to 8 bytes"
            )));
        }
        let len = storage.byte_len() / dtype.size_in_bytes();
        Ok(Buffer {
            shared: Arc::new(Shared {
                id: NEXT_STORAGE_ID.fetch_add(1, Ordering::Relaxed),
                storage,
                access: AccessLock::default(),
            }),
            dtype,
            offset: 0,
            len,
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }

    /// Where the memory lives.
    pub fn device(&self) -> Device {
        self.shared.storage.device()
    }

    /// The stream order shared by every view of a stream-ordered storage (device memory), `None`
    /// for storage ordered by access tickets.
    pub fn stream_order(&self) -> Option<Arc<StreamOrder>> {
        self.shared.storage.stream_order()
    }

    /// Whether the storage is page-locked host memory (see [`Storage::is_page_locked`]).
    pub fn is_page_locked(&self) -> bool {
        self.shared.storage.is_page_locked()
    }

    /// Address of the first element of this view (not dereferenced here).
    pub(crate) fn element_ptr(&self) -> *mut u8 {
        let base = self.shared.storage.as_ptr();
        base.wrapping_add(self.offset * self.dtype.size_in_bytes())
    }

    /// Byte range of this view inside its storage.
    pub fn byte_range(&self) -> Range<usize> {
        let start = self.offset * self.dtype.size_in_bytes();
        start..start + self.byte_len()
    }

    /// Whether two buffers view the same storage (they may still be disjoint).
    pub fn same_storage(&self, other: &Buffer) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Whether two buffers share at least one byte.
    pub fn overlaps(&self, other: &Buffer) -> bool {
        let (a, b) = (self.byte_range(), other.byte_range());
        self.same_storage(other) && a.start < b.end && b.start < a.end
    }

    /// Among the buffers of one operation, the first written one that shares a byte with
    /// another (a later written one, or any read one), with that other: an operation given
    /// them would write memory it also reads or writes through another view. Reads may
    /// overlap each other; empty views overlap nothing.
    pub fn overlapping_write<'a>(
        reads: &[&'a Buffer],
        writes: &[&'a Buffer],
    ) -> Option<(&'a Buffer, &'a Buffer)> {
        writes.iter().enumerate().find_map(|(i, w)| {
            let others = reads.iter().chain(writes.iter().skip(i + 1));
            others
                .into_iter()
                .find(|o| o.overlaps(w) && o.byte_len() > 0)
                .map(|o| (*w, *o))
        })
    }

    /// A view of `range` (in elements) of this buffer.
    pub fn slice(&self, range: Range<usize>) -> Result<Buffer, DeviceError> {
        if range.start > range.end || range.end > self.len {
            return Err(DeviceError::InvalidArgument(format!(
                "slice {range:?} out of a buffer of {} elements",
                self.len
            )));
        }
        Ok(Buffer {
            shared: self.shared.clone(),
            dtype: self.dtype,
            offset: self.offset + range.start,
            len: range.end - range.start,
        })
    }

    /// Take a place in the access order of this buffer's range. The ticket is granted once every
    /// conflicting ticket taken before it has been released.
    pub fn access(&self, mode: AccessMode) -> AccessTicket {
        AccessTicket::new(self, mode)
    }

    fn check_dtype<T: Element>(&self) -> Result<(), DeviceError> {
        if self.dtype != T::DTYPE {
            return Err(DeviceError::DTypeMismatch {
                actual: self.dtype,
                requested: T::DTYPE,
            });
        }
        if let Device::Cuda(_) = self.device() {
            return Err(DeviceError::Unsupported {
                op: "host access to a device buffer (copy it into a pinned buffer with \
                     copy_to_host_async)",
                device: self.device().to_string(),
            });
        }
        if self.device() != Device::Cpu {
            return Err(DeviceError::Unsupported {
                op: "host access to a buffer",
                device: self.device().to_string(),
            });
        }
        if self.stream_order().is_some() {
            return Err(DeviceError::Unsupported {
                op: "host access to a stream-ordered buffer (its work runs on streams: use \
                     Buffer::use_on)",
                device: self.device().to_string(),
            });
        }
        Ok(())
    }

    /// Read the elements on the host, after the stream work issued on this range before the call
    /// (waits up to [`DEFAULT_TIMEOUT`]).
    pub fn read<T: Element>(&self) -> Result<ReadGuard<T>, DeviceError> {
        self.read_timeout(DEFAULT_TIMEOUT)
    }

    /// [`read`](Buffer::read) with an explicit timeout.
    pub fn read_timeout<T: Element>(&self, timeout: Duration) -> Result<ReadGuard<T>, DeviceError> {
        self.check_dtype::<T>()?;
        let guard = self.access(AccessMode::Shared).acquire(timeout)?;
        Ok(ReadGuard::new(guard))
    }

    /// Write the elements on the host, after the stream work issued on this range before the call
    /// (waits up to [`DEFAULT_TIMEOUT`]).
    pub fn write<T: Element>(&self) -> Result<WriteGuard<T>, DeviceError> {
        self.write_timeout(DEFAULT_TIMEOUT)
    }

    /// [`write`](Buffer::write) with an explicit timeout.
    pub fn write_timeout<T: Element>(
        &self,
        timeout: Duration,
    ) -> Result<WriteGuard<T>, DeviceError> {
        self.check_dtype::<T>()?;
        let guard = self.access(AccessMode::Exclusive).acquire(timeout)?;
        Ok(WriteGuard::new(guard))
    }

    /// Copy the elements out.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, DeviceError> {
        Ok(self.read::<T>()?.to_vec())
    }

    /// Copy `data` in; its length must equal the buffer's.
    pub fn copy_from_slice<T: Element>(&self, data: &[T]) -> Result<(), DeviceError> {
        if data.len() != self.len {
            return Err(DeviceError::InvalidArgument(format!(
                "copy of {} elements into a buffer of {}",
                data.len(),
                self.len
            )));
        }
        self.write::<T>()?.copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Stream;

    #[test]
    fn slices_share_storage_and_check_bounds() {
        let b = Buffer::from_slice(&[1.0f64, 2.0, 3.0]).unwrap();
        assert!(b.slice(2..4).is_err());
        let s = b.slice(1..3).unwrap();
        assert!(s.same_storage(&b) && s.overlaps(&b));
        assert!(!b.slice(0..1).unwrap().overlaps(&s));
        assert_eq!(s.to_vec::<f64>().unwrap(), vec![2.0, 3.0]);
        assert!(matches!(
            s.read::<f32>(),
            Err(DeviceError::DTypeMismatch { .. })
        ));
    }

    #[test]
    fn host_read_waits_for_issued_stream_write() {
        let buf = Buffer::zeros(DType::F32, 4).unwrap();
        let stream = Stream::cpu("w");
        let ticket = buf.access(AccessMode::Exclusive);
        stream
            .enqueue(move || {
                let g = ticket.acquire(Duration::from_secs(5)).unwrap();
                std::thread::sleep(Duration::from_millis(20));
                let p = g.as_ptr() as *mut f32;
                for i in 0..4 {
                    // SAFETY: exclusive guard over 4 f32 of host memory.
                    unsafe { p.add(i).write(i as f32 + 1.0) };
                }
            })
            .unwrap();
        // Issued after the stream write: sees its result.
        assert_eq!(buf.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn disjoint_ranges_do_not_wait_and_conflicts_time_out() {
        let buf = Buffer::zeros(DType::F32, 8).unwrap();
        let left = buf.slice(0..4).unwrap();
        let right = buf.slice(4..8).unwrap();
        let held = left.write::<f32>().unwrap();
        right.write::<f32>().unwrap()[0] = 1.0;
        let err = buf
            .read_timeout::<f32>(Duration::from_millis(20))
            .unwrap_err();
        assert!(matches!(err, DeviceError::Timeout { .. }));
        drop(held);
        assert_eq!(buf.to_vec::<f32>().unwrap()[4], 1.0);
    }

    #[test]
    fn meta_buffers_have_sizes_but_refuse_host_access() {
        let buf = Buffer::meta(DType::F32, 1 << 40).unwrap();
        assert_eq!(buf.device(), Device::Meta);
        assert_eq!(buf.device().to_string(), "meta");
        assert_eq!((buf.len(), buf.byte_len()), (1 << 40, 4 << 40));
        let tail = buf.slice(8..16).unwrap();
        assert!(tail.same_storage(&buf) && tail.overlaps(&buf));
        assert_eq!(tail.byte_range(), 32..64);
        let unsupported = |e: DeviceError| {
            assert_eq!(
                e,
                DeviceError::Unsupported {
                    op: "host access to a buffer",
                    device: "meta".into()
                }
            );
            assert_eq!(
                e.to_string(),
                "host access to a buffer is not supported on meta"
            );
        };
        unsupported(tail.read::<f32>().unwrap_err());
        unsupported(tail.write::<f32>().unwrap_err());
        unsupported(tail.to_vec::<f32>().unwrap_err());
        unsupported(tail.copy_from_slice(&[0.0f32; 8]).unwrap_err());
        unsupported(
            tail.read_timeout::<f32>(Duration::from_millis(1))
                .unwrap_err(),
        );
        unsupported(
            tail.write_timeout::<f32>(Duration::from_millis(1))
                .unwrap_err(),
        );
        // The other checks still come first.
        assert!(matches!(
            tail.read::<f64>(),
            Err(DeviceError::DTypeMismatch { .. })
        ));
        assert!(matches!(
            tail.copy_from_slice(&[0.0f32; 3]),
            Err(DeviceError::InvalidArgument(_))
        ));
        // Tickets order work on meta buffers like on any other (nothing dereferences them).
        let g = tail
            .access(AccessMode::Exclusive)
            .acquire(Duration::from_secs(1))
            .unwrap();
        assert!(matches!(
            buf.access(AccessMode::Shared)
                .acquire(Duration::from_millis(10)),
            Err(DeviceError::Timeout { .. })
        ));
        assert_eq!(g.as_ptr().addr(), HOST_ALIGN + 32);
        drop(g);
        assert!(buf
            .access(AccessMode::Shared)
            .acquire(Duration::from_millis(10))
            .is_ok());
        // Sizes that do not fit are errors, empty ones are fine.
        assert!(matches!(
            Buffer::meta(DType::F64, usize::MAX / 4),
            Err(DeviceError::InvalidArgument(_))
        ));
        assert!(Buffer::meta(DType::BF16, 0).unwrap().is_empty());
        let storage = MetaStorage::new(24);
        assert_eq!((storage.device(), storage.byte_len()), (Device::Meta, 24));
        assert_eq!(storage.as_ptr().addr() % HOST_ALIGN, 0);
        assert!(!storage.as_ptr().is_null());
        let b = Buffer::from_storage(Box::new(storage), DType::F64).unwrap();
        assert_eq!(b.len(), 3);
    }

    #[test]
    fn storage_outlives_handles_while_guard_held() {
        let buf = Buffer::from_slice(&[5.0f32; 16]).unwrap();
        let g = buf
            .access(AccessMode::Shared)
            .acquire(Duration::from_secs(1))
            .unwrap();
        drop(buf);
        // SAFETY: the guard keeps the storage alive; 16 f32 were written.
        let v = unsafe { *(g.as_ptr() as *const f32).add(15) };
        assert_eq!(v, 5.0);
    }
}
