//! A buffer's access order: the [`AccessTicket`]s taken when work is issued, granted in the
//! order they were taken (shared ones together, exclusive ones alone, on overlapping ranges),
//! as [`AccessGuard`]s, and the host views over a guard ([`ReadGuard`], [`WriteGuard`]).

use std::fmt;
use std::ops::{Deref, DerefMut, Range};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Buffer;
use crate::{DeviceError, Element};

/// How a ticket accesses its range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessMode {
    /// Read-only; shared with other readers.
    Shared,
    /// Read-write; alone.
    Exclusive,
}

#[derive(Debug)]
struct Request {
    id: u64,
    mode: AccessMode,
    range: Range<usize>,
}

impl Request {
    fn conflicts(&self, other: &Request) -> bool {
        let overlap = self.range.start < other.range.end && other.range.start < self.range.end;
        overlap && (self.mode == AccessMode::Exclusive || other.mode == AccessMode::Exclusive)
    }
}

#[derive(Default, Debug)]
struct LockState {
    next_id: u64,
    waiting: Vec<Request>,
    active: Vec<Request>,
}

#[derive(Default)]
pub(super) struct AccessLock {
    state: Mutex<LockState>,
    cv: Condvar,
}

impl AccessLock {
    fn lock(&self) -> MutexGuard<'_, LockState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A place in a buffer's access order, taken when work is issued. See [`Buffer::access`].
/// Dropping it unacquired gives up the place.
pub struct AccessTicket {
    buffer: Buffer,
    id: u64,
    mode: AccessMode,
    granted: bool,
}

impl fmt::Debug for AccessTicket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "AccessTicket({:?} {:?} of {:?})",
            self.id, self.mode, self.buffer
        )
    }
}

impl AccessTicket {
    /// Takes a place in the access order of `buffer`'s range (see [`Buffer::access`]).
    pub(super) fn new(buffer: &Buffer, mode: AccessMode) -> AccessTicket {
        let lock = &buffer.shared.access;
        let mut st = lock.lock();
        let id = st.next_id;
        st.next_id += 1;
        st.waiting.push(Request {
            id,
            mode,
            range: buffer.byte_range(),
        });
        AccessTicket {
            buffer: buffer.clone(),
            id,
            mode,
            granted: false,
        }
    }

    /// The buffer the ticket is for.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// The mode asked for.
    pub fn mode(&self) -> AccessMode {
        self.mode
    }

    /// Wait until every conflicting earlier ticket has been released, up to `timeout`.
    pub fn acquire(mut self, timeout: Duration) -> Result<AccessGuard, DeviceError> {
        let lock = &self.buffer.shared.access;
        let deadline = Instant::now() + timeout;
        let mut st = lock.lock();
        loop {
            let pos = st
                .waiting
                .iter()
                .position(|r| r.id == self.id)
                .expect("a live ticket is always queued until granted");
            let me = &st.waiting[pos];
            let blocked = st.active.iter().any(|a| a.conflicts(me))
                || st.waiting[..pos].iter().any(|w| w.conflicts(me));
            if !blocked {
                let req = st.waiting.remove(pos);
                st.active.push(req);
                self.granted = true;
                drop(st);
                return Ok(AccessGuard {
                    buffer: self.buffer.clone(),
                    id: self.id,
                    mode: self.mode,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(DeviceError::Timeout {
                    what: format!(
                        "{:?} access to {:?} (earlier work on it has not finished)",
                        self.mode, self.buffer
                    ),
                    waited: timeout,
                });
            }
            st = lock
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for AccessTicket {
    fn drop(&mut self) {
        if !self.granted {
            let lock = &self.buffer.shared.access;
            let mut st = lock.lock();
            st.waiting.retain(|r| r.id != self.id);
            drop(st);
            lock.cv.notify_all();
        }
    }
}

/// Granted access to a buffer's range; released on drop. Stream work holds one for each buffer it
/// touches, which keeps the storage alive while the work runs.
pub struct AccessGuard {
    buffer: Buffer,
    id: u64,
    mode: AccessMode,
}

impl fmt::Debug for AccessGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AccessGuard({:?} of {:?})", self.mode, self.buffer)
    }
}

impl AccessGuard {
    /// The buffer the guard is for.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// The granted mode.
    pub fn mode(&self) -> AccessMode {
        self.mode
    }

    /// Address of the first element (host or device address, per the buffer's device; for
    /// [`Device::Meta`](crate::Device::Meta) an identifier that must never be dereferenced). Valid while the guard
    /// lives; writing through it is allowed only for an exclusive guard.
    pub fn as_ptr(&self) -> *mut u8 {
        self.buffer.element_ptr()
    }
}

impl Drop for AccessGuard {
    fn drop(&mut self) {
        let lock = &self.buffer.shared.access;
        let mut st = lock.lock();
        st.active.retain(|r| r.id != self.id);
        drop(st);
        lock.cv.notify_all();
    }
}

/// Shared host access to a buffer's elements.
pub struct ReadGuard<T: Element> {
    guard: AccessGuard,
    _t: std::marker::PhantomData<T>,
}

impl<T: Element> ReadGuard<T> {
    /// The elements under `guard`, a shared guard on a host buffer of `T`.
    pub(super) fn new(guard: AccessGuard) -> ReadGuard<T> {
        ReadGuard {
            guard,
            _t: std::marker::PhantomData,
        }
    }
}

impl<T: Element> Deref for ReadGuard<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        let len = self.guard.buffer.len;
        // SAFETY: check_dtype ensured a host buffer of T; the storage holds `len` initialised
        // (zeroed or written) elements at this aligned address; the shared guard excludes writers
        // of this range until it is dropped, and the slice borrows the guard.
        unsafe { std::slice::from_raw_parts(self.guard.as_ptr() as *const T, len) }
    }
}

impl<T: Element> fmt::Debug for ReadGuard<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: Element> fmt::Debug for WriteGuard<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Exclusive host access to a buffer's elements.
pub struct WriteGuard<T: Element> {
    guard: AccessGuard,
    _t: std::marker::PhantomData<T>,
}

impl<T: Element> WriteGuard<T> {
    /// The elements under `guard`, an exclusive guard on a host buffer of `T`.
    pub(super) fn new(guard: AccessGuard) -> WriteGuard<T> {
        WriteGuard {
            guard,
            _t: std::marker::PhantomData,
        }
    }
}

impl<T: Element> Deref for WriteGuard<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        let len = self.guard.buffer.len;
        // SAFETY: as for ReadGuard; the exclusive guard excludes every other access.
        unsafe { std::slice::from_raw_parts(self.guard.as_ptr() as *const T, len) }
    }
}

impl<T: Element> DerefMut for WriteGuard<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let len = self.guard.buffer.len;
        // SAFETY: the exclusive guard excludes every other access to this range while it lives,
        // and the slice mutably borrows the guard; T is Pod, so any bytes are a valid T.
        unsafe { std::slice::from_raw_parts_mut(self.guard.as_ptr() as *mut T, len) }
    }
}
