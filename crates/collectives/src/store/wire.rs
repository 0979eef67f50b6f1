//! Our own protocol's framing and encoding: length-prefixed frames, requests, replies.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::Result;

use super::{TcpStore, IDLE_POLL, MAX_FRAME};
// ---------------------------------------------------------------------------------------------
// Framing and encoding.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Op {
    Hello = 1,
    Set = 2,
    Get = 3,
    TryGet = 4,
    Add = 5,
    CompareSet = 6,
    Wait = 7,
    Check = 8,
    Delete = 9,
    NumKeys = 10,
    Append = 11,
    MultiGet = 12,
    MultiSet = 13,
}

impl Op {
    pub(super) fn from_u8(v: u8) -> std::result::Result<Op, String> {
        Ok(match v {
            1 => Op::Hello,
            2 => Op::Set,
            3 => Op::Get,
            4 => Op::TryGet,
            5 => Op::Add,
            6 => Op::CompareSet,
            7 => Op::Wait,
            8 => Op::Check,
            9 => Op::Delete,
            10 => Op::NumKeys,
            11 => Op::Append,
            12 => Op::MultiGet,
            13 => Op::MultiSet,
            other => return Err(format!("unknown operation code {other}")),
        })
    }
}

pub(super) const REPLY_OK: u8 = 0;
pub(super) const REPLY_ERROR: u8 = 1;
pub(super) const REPLY_TIMED_OUT: u8 = 2;
pub(super) const REPLY_STOPPING: u8 = 3;

/// A reply of the server.
#[derive(Debug)]
pub(super) enum Reply {
    /// Success, with the operation's result.
    Ok(Vec<u8>),
    /// The request was refused, with the server's message.
    Error(String),
    /// A wait ran out; the keys still missing.
    TimedOut(Vec<String>),
    /// The server is stopping (rank 0's store was dropped), with what the request waited for.
    Stopping(String),
}

impl Reply {
    pub(super) fn encode(&self) -> Vec<u8> {
        match self {
            Reply::Ok(body) => {
                let mut v = Vec::with_capacity(1 + body.len());
                v.push(REPLY_OK);
                v.extend_from_slice(body);
                v
            }
            Reply::Error(msg) => {
                let mut e = Enc::body().u8(REPLY_ERROR);
                e = e.bytes(msg.as_bytes());
                e.finish()
            }
            Reply::TimedOut(missing) => {
                let refs: Vec<&str> = missing.iter().map(String::as_str).collect();
                Enc::body().u8(REPLY_TIMED_OUT).strs(&refs).finish()
            }
            Reply::Stopping(msg) => Enc::body()
                .u8(REPLY_STOPPING)
                .bytes(msg.as_bytes())
                .finish(),
        }
    }

    pub(super) fn decode(frame: Vec<u8>) -> std::result::Result<Reply, String> {
        let mut d = Dec::new(&frame);
        match d.u8()? {
            REPLY_OK => {
                let mut body = frame;
                body.drain(..1);
                Ok(Reply::Ok(body))
            }
            REPLY_ERROR => Ok(Reply::Error(d.string()?)),
            REPLY_TIMED_OUT => Ok(Reply::TimedOut(d.strings()?)),
            REPLY_STOPPING => Ok(Reply::Stopping(d.string()?)),
            other => Err(format!("unknown reply status {other}")),
        }
    }

    /// The body of an `Ok` reply; anything else is an error of `op`.
    pub(super) fn expect_ok(self, store: &TcpStore, op: &'static str) -> Result<Vec<u8>> {
        match self {
            Reply::Ok(body) => Ok(body),
            Reply::Error(msg) => Err(store.server_err(op, msg)),
            Reply::Stopping(msg) => Err(store.server_stopping(op, msg)),
            Reply::TimedOut(keys) => {
                Err(store.protocol(op, format!("unexpected timeout reply (keys {keys:?})")))
            }
        }
    }
}

pub(super) struct Enc(Vec<u8>);

impl Enc {
    pub(super) fn new(op: Op) -> Enc {
        Enc(vec![op as u8])
    }

    pub(super) fn body() -> Enc {
        Enc(Vec::new())
    }

    pub(super) fn u8(mut self, v: u8) -> Enc {
        self.0.push(v);
        self
    }

    pub(super) fn u32(mut self, v: u32) -> Enc {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn u64(mut self, v: u64) -> Enc {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn i64(mut self, v: i64) -> Enc {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn bytes(mut self, v: &[u8]) -> Enc {
        // Lengths are checked against MAX_FRAME (< 4 GiB) before encoding.
        self.0.extend_from_slice(&(v.len() as u32).to_be_bytes());
        self.0.extend_from_slice(v);
        self
    }

    pub(super) fn strs(mut self, v: &[&str]) -> Enc {
        self.0.extend_from_slice(&(v.len() as u32).to_be_bytes());
        for s in v {
            self = self.bytes(s.as_bytes());
        }
        self
    }

    pub(super) fn finish(self) -> Vec<u8> {
        self.0
    }
}

pub(super) struct Dec<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Dec<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Dec<'a> {
        Dec { buf, pos: 0 }
    }

    pub(super) fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                format!(
                    "message truncated: {n} bytes wanted at offset {} of {}",
                    self.pos,
                    self.buf.len()
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    pub(super) fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    pub(super) fn u32(&mut self) -> std::result::Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub(super) fn u64(&mut self) -> std::result::Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }

    pub(super) fn i64(&mut self) -> std::result::Result<i64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(i64::from_be_bytes(a))
    }

    pub(super) fn bytes(&mut self) -> std::result::Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    pub(super) fn string(&mut self) -> std::result::Result<String, String> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| "a key is not valid UTF-8".to_string())
    }

    pub(super) fn strings(&mut self) -> std::result::Result<Vec<String>, String> {
        let n = self.u32()? as usize;
        // Each string takes at least 4 bytes: refuse counts the frame cannot hold.
        if n > (self.buf.len() - self.pos) / 4 {
            return Err(format!("message truncated: {n} keys announced"));
        }
        (0..n).map(|_| self.string()).collect()
    }

    pub(super) fn end(&self) -> std::result::Result<(), String> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(format!(
                "{} unexpected trailing bytes in the request",
                self.buf.len() - self.pos
            ))
        }
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(super) enum FrameError {
    /// The peer closed the connection before a frame began.
    Closed,
    /// The peer closed the connection in the middle of a frame.
    Truncated,
    /// The deadline passed.
    TimedOut,
    /// The server is stopping.
    Stopped,
    /// The announced length exceeds [`MAX_FRAME`].
    TooLarge(usize),
    /// Another socket error.
    Io(io::Error),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::Closed => f.write_str(
                "the connection was closed by the other side (the store server stopped: \
                 rank 0's store was dropped or its process exited)",
            ),
            FrameError::Truncated => f.write_str("the connection was closed in mid-message"),
            FrameError::TimedOut => f.write_str("timed out"),
            FrameError::Stopped => f.write_str("the server is stopping"),
            FrameError::TooLarge(n) => {
                write!(f, "a message of {n} bytes exceeds the limit of {MAX_FRAME}")
            }
            FrameError::Io(e) => write!(f, "{e}"),
        }
    }
}

pub(super) fn write_frame(stream: &mut TcpStream, payload: &[u8]) -> io::Result<()> {
    let header = (payload.len() as u32).to_be_bytes();
    if payload.len() <= 64 << 10 {
        // One segment for small messages.
        let mut frame = Vec::with_capacity(4 + payload.len());
        frame.extend_from_slice(&header);
        frame.extend_from_slice(payload);
        stream.write_all(&frame)?;
    } else {
        // No copy of large ones.
        stream.write_all(&header)?;
        stream.write_all(payload)?;
    }
    stream.flush()
}

/// Reads one frame. `deadline` bounds the whole frame; with `idle = Some((stop, io_timeout))`
/// (the server) the wait for a frame to begin is unbounded but ends when `stop` is set, and
/// once a frame has begun the rest must arrive within `io_timeout`.
pub(super) fn read_frame(
    stream: &mut TcpStream,
    deadline: Option<Instant>,
    idle: Option<(&AtomicBool, Duration)>,
) -> std::result::Result<Vec<u8>, FrameError> {
    let mut header = [0u8; 4];
    let stop = idle.map(|(s, _)| s);
    let first = read_some(stream, &mut header, deadline, stop, true)?;
    let deadline = match (deadline, idle) {
        (Some(d), _) => Some(d),
        (None, Some((_, t))) => Some(deadline_after(t)),
        (None, None) => None,
    };
    read_full(stream, &mut header[first..], deadline, stop)?;
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let mut payload = vec![0u8; len];
    read_full(stream, &mut payload, deadline, stop)?;
    Ok(payload)
}

pub(super) fn read_full(
    stream: &mut TcpStream,
    mut buf: &mut [u8],
    deadline: Option<Instant>,
    stop: Option<&AtomicBool>,
) -> std::result::Result<(), FrameError> {
    while !buf.is_empty() {
        let n = read_some(stream, buf, deadline, stop, false)?;
        buf = &mut buf[n..];
    }
    Ok(())
}

/// One successful read of at least one byte, waiting until `deadline` (and, with `stop`, in
/// slices of [`IDLE_POLL`] that look at the flag).
pub(super) fn read_some(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
    stop: Option<&AtomicBool>,
    at_frame_start: bool,
) -> std::result::Result<usize, FrameError> {
    loop {
        if stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
            return Err(FrameError::Stopped);
        }
        let slice = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(FrameError::TimedOut);
                }
                if stop.is_some() {
                    left.min(IDLE_POLL)
                } else {
                    left
                }
            }
            None => IDLE_POLL,
        };
        stream
            .set_read_timeout(Some(slice.max(Duration::from_millis(1))))
            .map_err(FrameError::Io)?;
        match stream.read(buf) {
            Ok(0) if at_frame_start => return Err(FrameError::Closed),
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => return Ok(n),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Small helpers.

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The protected data (a map, a counter, idle sockets) stays consistent even if a holder
    // panicked: each update is a single call.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `now + d`, saturating far in the future instead of overflowing.
pub(super) fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
