//! Stream ordering of buffers by events (the way cudarc's `CudaSlice` orders itself).
//!
//! Device memory cannot be ordered by CPU access tickets: the work that touches it runs on a
//! GPU stream, long after the host thread that issued it moved on. A [`StreamOrder`] instead
//! remembers, per storage, the [`Event`] recorded after the last write and the events recorded
//! after the reads issued since that write (at most one per stream: a newer read on a stream
//! replaces the older one, which the stream's own order already puts before it). Before work is
//! issued on a stream, the stream waits ([`Stream::wait_event`], GPU-side between CUDA streams)
//! for what it conflicts with:
//!
//! - a read waits for the last write;
//! - a write waits for the last write and for every read since it;
//! - nothing waits for its own stream.
//!
//! After the work is issued an event is recorded on the stream and stored (a write clears the
//! reads). Everything here is written against [`Stream`]/[`Event`], so it orders CPU worker
//! streams exactly as CUDA streams (the tests run it on CPU streams).
//!
//! Granularity is the whole storage: every slice of a storage shares one `StreamOrder`, so two
//! writers of disjoint slices on different streams are serialised. That is coarser than needed
//! and never reorders work, but it can deadlock work that must run concurrently: two ranks of
//! one process whose collectives write disjoint slices of one storage wait for each other's
//! collective (each needs the other) until their timeout. Give each rank storage of its own.
//!
//! The issue order is the order of the calls: several host threads that issue work on the same
//! storage at once must order their issuing themselves, as with CUDA.
//!
//! [`Buffer::use_on`] wraps the two calls around the caller's work ([`StreamUse`]).

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::{AccessMode, Buffer, DeviceError, Event, Stream, StreamId};

#[derive(Default)]
struct OrderState {
    /// The stream and event of the last write.
    write: Option<(StreamId, Event)>,
    /// The newest read of each stream since the last write.
    reads: Vec<(StreamId, Event)>,
}

/// The events of the last write and of the reads since it, for one storage (module docs).
#[derive(Default)]
pub struct StreamOrder {
    state: Mutex<OrderState>,
}

impl fmt::Debug for StreamOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("StreamOrder")
            .field("write", &st.write)
            .field("reads", &st.reads)
            .finish()
    }
}

impl StreamOrder {
    /// An order with no recorded work.
    pub fn new() -> StreamOrder {
        StreamOrder::default()
    }

    fn lock(&self) -> MutexGuard<'_, OrderState> {
        // A poisoned lock only means a panic elsewhere while holding it; the events stay valid.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Make `stream` wait for the last write (unless `stream` made it).
    ///
    /// # Errors
    /// As [`Stream::wait_event`] (a timeout or failure of a host-side wait).
    pub fn before_read(&self, stream: &Stream) -> Result<(), DeviceError> {
        let write = self.lock().write.clone();
        match write {
            Some((id, ev)) if id != stream.id() => stream.wait_event(&ev),
            _ => Ok(()),
        }
    }

    /// Make `stream` wait for the last write and every read since it (except its own).
    ///
    /// # Errors
    /// As [`Stream::wait_event`].
    pub fn before_write(&self, stream: &Stream) -> Result<(), DeviceError> {
        let waits: Vec<Event> = {
            let st = self.lock();
            st.write
                .iter()
                .chain(st.reads.iter())
                .filter(|(id, _)| *id != stream.id())
                .map(|(_, ev)| ev.clone())
                .collect()
        };
        waits.iter().try_for_each(|ev| stream.wait_event(ev))
    }

    /// Record that a read was issued on `stream` (an event at its current end), and return it.
    /// The order keeps its own copy of the point: recording the returned event again does not
    /// move it.
    pub fn after_read(&self, stream: &Stream) -> Event {
        let ev = stream.record_event();
        let mut st = self.lock();
        st.reads.retain(|(id, _)| *id != stream.id());
        st.reads.push((stream.id(), ev.snapshot()));
        ev
    }

    /// Record that a write was issued on `stream`, forget the reads before it, and return the
    /// event.
    pub fn after_write(&self, stream: &Stream) -> Event {
        let ev = stream.record_event();
        let mut st = self.lock();
        st.reads.clear();
        st.write = Some((stream.id(), ev.snapshot()));
        ev
    }

    /// [`before_read`](Self::before_read) or [`before_write`](Self::before_write), by `mode`.
    ///
    /// # Errors
    /// As [`Stream::wait_event`].
    pub fn before(&self, stream: &Stream, mode: AccessMode) -> Result<(), DeviceError> {
        match mode {
            AccessMode::Shared => self.before_read(stream),
            AccessMode::Exclusive => self.before_write(stream),
        }
    }

    /// [`after_read`](Self::after_read) or [`after_write`](Self::after_write), by `mode`.
    pub fn after(&self, stream: &Stream, mode: AccessMode) -> Event {
        match mode {
            AccessMode::Shared => self.after_read(stream),
            AccessMode::Exclusive => self.after_write(stream),
        }
    }

    /// The events of all recorded work not known to be superseded: the last write and the reads
    /// since. Once they have all completed, no issued work uses the storage any more.
    pub fn events(&self) -> Vec<Event> {
        let st = self.lock();
        st.write
            .iter()
            .chain(st.reads.iter())
            .map(|(_, ev)| ev.snapshot())
            .collect()
    }

    /// Whether every recorded event has completed (queries, never blocks).
    pub fn is_idle(&self) -> bool {
        self.events().iter().all(Event::query)
    }
}

/// Work on one stream that uses a stream-ordered buffer; see [`Buffer::use_on`]. Dropping it
/// (or [`finish`](StreamUse::finish)) records the use after whatever the caller enqueued.
pub struct StreamUse {
    buffer: Buffer,
    order: Arc<StreamOrder>,
    stream: Stream,
    mode: AccessMode,
    done: bool,
}

impl fmt::Debug for StreamUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "StreamUse({:?} of {:?} on {:?})",
            self.mode, self.buffer, self.stream
        )
    }
}

impl StreamUse {
    /// The buffer used.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// The stream the work is issued on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The access mode.
    pub fn mode(&self) -> AccessMode {
        self.mode
    }

    /// Address of the buffer's first element (a device address for device buffers). Work that
    /// uses it must be enqueued on [`stream`](StreamUse::stream) before the use is finished;
    /// writing through it is allowed only for [`AccessMode::Exclusive`].
    pub fn as_ptr(&self) -> *mut u8 {
        self.buffer.element_ptr()
    }

    /// The address as a CUDA device pointer (`CUdeviceptr`).
    pub fn device_ptr(&self) -> u64 {
        self.as_ptr() as usize as u64
    }

    /// Record the use after the work enqueued so far on the stream; the event returned completes
    /// with that work.
    pub fn finish(mut self) -> Event {
        self.record()
    }

    fn record(&mut self) -> Event {
        self.done = true;
        self.order.after(&self.stream, self.mode)
    }
}

impl Drop for StreamUse {
    fn drop(&mut self) {
        if !self.done {
            self.record();
        }
    }
}

impl Buffer {
    /// Start work on `stream` that reads ([`AccessMode::Shared`]) or writes
    /// ([`AccessMode::Exclusive`]) this buffer: the stream first waits for the conflicting work
    /// recorded in the storage's [`StreamOrder`]; the returned guard gives the address and, when
    /// finished or dropped, records the use. Only storages that are stream-ordered (device memory,
    /// [`Storage::stream_order`](crate::Storage::stream_order)) accept it, on a stream of their
    /// device.
    ///
    /// # Errors
    /// [`DeviceError::Unsupported`] for a buffer ordered by access tickets (host and meta
    /// storage: use [`Buffer::access`]); [`DeviceError::InvalidArgument`] when the stream is on
    /// another device; the errors of [`Stream::wait_event`].
    pub fn use_on(&self, stream: &Stream, mode: AccessMode) -> Result<StreamUse, DeviceError> {
        let order = self
            .stream_order()
            .ok_or_else(|| DeviceError::Unsupported {
                op: "stream-ordered use of a buffer ordered by access tickets (use Buffer::access)",
                device: self.device().to_string(),
            })?;
        if stream.device() != self.device() {
            return Err(DeviceError::InvalidArgument(format!(
                "a buffer on {} used on stream `{}` of {}",
                self.device(),
                stream.name(),
                stream.device()
            )));
        }
        order.before(stream, mode)?;
        Ok(StreamUse {
            buffer: self.clone(),
            order,
            stream: stream.clone(),
            mode,
            done: false,
        })
    }
}

#[cfg(test)]
#[path = "order_tests.rs"]
mod tests;
