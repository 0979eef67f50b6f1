//! A rank's two connections in the ring: it sends to its successor and receives from its
//! predecessor.
//!
//! Receiving is done by a reader thread that always drains the predecessor's socket into a
//! channel, whatever the communication thread is doing. Sends are plain blocking writes from the
//! communication thread: since every rank's reader keeps reading, a write can only stall while
//! the successor's process is stalled, so every rank sending a large segment at once cannot
//! deadlock. What a rank can send ahead of its successor is bounded by the ring algorithms
//! themselves (each send after the first of a segment waits for a receive), so the channel holds
//! at most about `world` segments.
//!
//! Failures travel around the ring: a rank that fails sends an abort frame with its reason to its
//! successor, whose reader thread marks its own communicator aborted and forwards the frame.
//! Starting at the successor of whatever failed, the abort therefore reaches every live rank
//! within one trip around the ring, even when the rank that failed is a dead process.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};

use super::wire::{
    self, Header, Payload, PayloadPool, HEADER_BYTES, KIND_ABORT, KIND_DATA, KIND_DESC,
};

/// How often the reader thread looks at its stop flag while the socket is idle.
const READER_POLL: Duration = Duration::from_millis(200);
/// How long a best-effort abort notice may take to write.
const ABORT_WRITE: Duration = Duration::from_secs(1);

/// Whether (and why) a communicator was aborted; shared by its communication thread and its
/// reader thread.
#[derive(Default)]
pub(crate) struct AbortState {
    reason: Mutex<Option<String>>,
}

impl AbortState {
    pub fn get(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Record `reason` if nothing was recorded yet; true if this call recorded it.
    pub fn set(&self, reason: String) -> bool {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(reason);
            true
        } else {
            false
        }
    }
}

/// What the reader thread delivers.
pub(crate) enum Incoming {
    /// A description or data frame.
    Frame(Header, Payload),
    /// The predecessor's connection ended (cleanly or not): why.
    Closed(String),
    /// A peer aborted the group: its reason.
    Abort(String),
}

/// Why a send failed.
pub(crate) enum SendFail {
    /// The collective's time was already spent before the write started.
    NoTime,
    /// The successor did not take the data in time.
    Timeout,
    /// The successor's connection is gone: the OS error.
    Departed(String),
}

/// Why a receive failed.
pub(crate) enum RecvFail {
    Timeout,
    Closed(String),
    Aborted(String),
}

/// The sending half, shared with the reader thread (which forwards abort notices).
pub(crate) struct Outgoing {
    stream: Mutex<TcpStream>,
}

impl Outgoing {
    fn lock(&self) -> MutexGuard<'_, TcpStream> {
        self.stream.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Write one frame, giving up at `deadline`.
    pub fn send(&self, header: &Header, payload: &[u8], deadline: Instant) -> Result<(), SendFail> {
        let mut s = self.lock();
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(SendFail::NoTime);
        }
        s.set_write_timeout(Some(left))
            .map_err(|e| SendFail::Departed(e.to_string()))?;
        match wire::write_frame(&mut *s, header, payload) {
            Ok(()) => Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(SendFail::Timeout)
            }
            Err(e) => Err(SendFail::Departed(e.to_string())),
        }
    }

    /// Best effort: tell the successor the group is aborted.
    pub fn send_abort(&self, seq: u64, origin: usize, reason: &str) {
        let header = Header {
            kind: KIND_ABORT,
            seq,
            origin: origin as u32,
            len: reason.len() as u64,
        };
        let _ = self.send(&header, reason.as_bytes(), Instant::now() + ABORT_WRITE);
    }
}

/// A rank's links to its neighbours.
pub(crate) struct Links {
    rank: usize,
    abort: Arc<AbortState>,
    out: Arc<Outgoing>,
    out_sock: TcpStream,
    in_sock: TcpStream,
    incoming: Receiver<Incoming>,
    stop: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
}

impl Links {
    /// Links over two handshaken connections; starts the reader thread.
    pub fn start(
        rank: usize,
        to_next: TcpStream,
        from_prev: TcpStream,
        abort: Arc<AbortState>,
        max_payload: usize,
    ) -> io::Result<Links> {
        to_next.set_nodelay(true)?;
        from_prev.set_nodelay(true)?;
        from_prev.set_read_timeout(Some(READER_POLL))?;
        let out_sock = to_next.try_clone()?;
        let in_sock = from_prev.try_clone()?;
        let out = Arc::new(Outgoing {
            stream: Mutex::new(to_next),
        });
        let (tx, rx) = unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (out, stop, abort) = (out.clone(), stop.clone(), abort.clone());
            std::thread::Builder::new()
                .name(format!("tcp-reader:{rank}"))
                .spawn(move || reader_loop(rank, from_prev, out, abort, tx, stop, max_payload))?
        };
        Ok(Links {
            rank,
            abort,
            out,
            out_sock,
            in_sock,
            incoming: rx,
            stop,
            reader: Some(reader),
        })
    }

    pub fn out(&self) -> &Outgoing {
        &self.out
    }

    /// Why the communicator was aborted (by this rank or by a notice from a peer), if it was.
    pub fn aborted(&self) -> Option<String> {
        self.abort.get()
    }

    /// The next frame from the predecessor, waiting until `deadline`.
    pub fn recv(&self, deadline: Instant) -> Result<(Header, Payload), RecvFail> {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self.incoming.recv_timeout(wait) {
            Ok(Incoming::Frame(h, p)) => Ok((h, p)),
            Ok(Incoming::Closed(why)) => Err(RecvFail::Closed(why)),
            Ok(Incoming::Abort(why)) => Err(RecvFail::Aborted(why)),
            Err(RecvTimeoutError::Timeout) => Err(RecvFail::Timeout),
            Err(RecvTimeoutError::Disconnected) => Err(RecvFail::Closed(
                "the connection's reader thread ended".into(),
            )),
        }
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.out_sock.shutdown(Shutdown::Both);
        let _ = self.in_sock.shutdown(Shutdown::Both);
        if let Some(h) = self.reader.take() {
            // The reader wakes at least every READER_POLL and sees the stop flag (or the
            // shut-down socket), so this join is bounded.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        tracing::trace!(rank = self.rank, "tcp links closed");
    }
}

/// Fill `buf` from `s`. `Ok(false)` when the connection ended before the first byte (a clean end
/// between frames); stops early, with `Ok(false)`, once `stop` is set.
fn read_full(s: &mut TcpStream, buf: &mut [u8], stop: &AtomicBool) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed in the middle of a frame",
                ))
            }
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn reader_loop(
    rank: usize,
    mut s: TcpStream,
    out: Arc<Outgoing>,
    abort: Arc<AbortState>,
    tx: Sender<Incoming>,
    stop: Arc<AtomicBool>,
    max_payload: usize,
) {
    let closed = |why: String| {
        let _ = tx.send(Incoming::Closed(why));
    };
    let pool = Arc::new(PayloadPool::default());
    loop {
        let mut h = [0u8; HEADER_BYTES];
        match read_full(&mut s, &mut h, &stop) {
            Ok(true) => {}
            Ok(false) => {
                if !stop.load(Ordering::Relaxed) {
                    closed("the connection was closed".into());
                }
                return;
            }
            Err(e) => return closed(e.to_string()),
        }
        let header = Header::decode(&h);
        let len = match usize::try_from(header.len) {
            Ok(l) if l <= max_payload => l,
            _ => {
                return closed(format!(
                    "protocol error: a frame of {} bytes (at most {max_payload} expected)",
                    header.len
                ))
            }
        };
        if !matches!(header.kind, KIND_DESC | KIND_DATA | KIND_ABORT) {
            return closed(format!(
                "protocol error: unknown frame kind {}",
                header.kind
            ));
        }
        let mut payload = pool.take(len);
        match read_full(&mut s, payload.as_bytes_mut(), &stop) {
            Ok(true) => {}
            Ok(false) if len == 0 => {}
            Ok(false) => {
                if !stop.load(Ordering::Relaxed) {
                    closed("connection closed in the middle of a frame".into());
                }
                return;
            }
            Err(e) => return closed(e.to_string()),
        }
        if header.kind == KIND_ABORT {
            let reason = String::from_utf8_lossy(payload.as_bytes()).into_owned();
            if abort.set(reason.clone()) {
                // First news of it here: pass it on around the ring.
                out.send_abort(header.seq, header.origin as usize, &reason);
            }
            tracing::debug!(rank, %reason, "tcp: abort notice received");
            let _ = tx.send(Incoming::Abort(reason));
            continue;
        }
        if tx.send(Incoming::Frame(header, payload)).is_err() {
            return;
        }
    }
}

/// Write all of `bytes` with a deadline (handshakes).
pub(crate) fn write_all_by(s: &mut TcpStream, bytes: &[u8], deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    s.set_write_timeout(Some(left))?;
    s.write_all(bytes)
}

/// Set the read timeout of a handshake read to what is left until `deadline`.
pub(crate) fn read_by(s: &TcpStream, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    s.set_read_timeout(Some(left))
}
