//! PyTorch's TCPStore wire protocol (`torch.distributed.TCPStore`, c10d's `TCPStore.cpp`,
//! `TCPStoreBackend.cpp` and `TCPStoreLibUvBackend.cpp`), the client's and the server's side.
//!
//! There are no frames: a query is one byte (its [`Query`] code) followed by its fields;
//! integers are little-endian (the hosts' native order, as PyTorch sends them), byte strings are
//! a `u64` length and the bytes, key lists a `u64` count and the keys. A client's first query is
//! `VALIDATE` with the magic number [`VALIDATION_MAGIC`] (no reply), then `PING` with a nonce
//! that the server echoes. Replies carry no status: `SET`, `APPEND` and `MULTI_SET` have none,
//! `WAIT` answers `STOP_WAITING` when every key is set, and a client that gives up sends
//! `CANCEL_WAIT`, answered `WAIT_CANCELED` (after a `STOP_WAITING` if the keys came first).
//!
//! The codes are those since `VALIDATE` was inserted at 0 (which renumbered the others by one);
//! later versions appended codes after `PING` (queues, key listing, barrier), which this server
//! does not serve: a client that sends one is disconnected with a logged reason.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::server::Shared;
use super::wire::{deadline_after, lock, read_full, read_some, FrameError};
use super::MAX_FRAME;

/// The magic number of the `VALIDATE` query (`validationMagicNumber`).
pub(super) const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// The query codes (c10d's `QueryType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Query {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    Append = 9,
    MultiGet = 10,
    MultiSet = 11,
    CancelWait = 12,
    Ping = 13,
}

impl Query {
    fn from_u8(v: u8) -> Option<Query> {
        use Query::*;
        Some(match v {
            0 => Validate,
            1 => Set,
            2 => CompareSet,
            3 => Get,
            4 => Add,
            5 => Check,
            6 => Wait,
            7 => GetNumKeys,
            8 => DeleteKey,
            9 => Append,
            10 => MultiGet,
            11 => MultiSet,
            12 => CancelWait,
            13 => Ping,
            _ => return None,
        })
    }
}

/// `CheckResponseType`.
const READY: u8 = 0;
const NOT_READY: u8 = 1;
/// `WaitResponseType`.
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;
/// How often a server-side wait looks at the socket for `CANCEL_WAIT` and at the stop flag.
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// Encoder of one query (or reply).
pub(super) struct Msg(Vec<u8>);

impl Msg {
    pub(super) fn query(q: Query) -> Msg {
        Msg(vec![q as u8])
    }

    fn reply() -> Msg {
        Msg(Vec::new())
    }

    fn u8(mut self, v: u8) -> Msg {
        self.0.push(v);
        self
    }

    pub(super) fn u32(mut self, v: u32) -> Msg {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(super) fn i64(mut self, v: i64) -> Msg {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(super) fn bytes(mut self, v: &[u8]) -> Msg {
        self.0.extend_from_slice(&(v.len() as u64).to_le_bytes());
        self.0.extend_from_slice(v);
        self
    }

    pub(super) fn keys(mut self, keys: &[String]) -> Msg {
        self.0.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            self = self.bytes(k.as_bytes());
        }
        self
    }

    pub(super) fn send(self, s: &mut TcpStream) -> Result<(), String> {
        s.write_all(&self.0)
            .and_then(|()| s.flush())
            .map_err(|e| format!("sending failed: {e}"))
    }
}

/// Reads exactly `buf.len()` bytes by `deadline`.
fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), String> {
    read_full(s, buf, Some(deadline), None).map_err(|e| match e {
        FrameError::TimedOut => "no reply in time".to_string(),
        FrameError::Truncated | FrameError::Closed => {
            "the connection was closed by the store server".to_string()
        }
        e => e.to_string(),
    })
}

pub(super) fn read_u8(s: &mut TcpStream, deadline: Instant) -> Result<u8, String> {
    let mut b = [0u8; 1];
    read_by(s, &mut b, deadline)?;
    Ok(b[0])
}

pub(super) fn read_u32(s: &mut TcpStream, deadline: Instant) -> Result<u32, String> {
    let mut b = [0u8; 4];
    read_by(s, &mut b, deadline)?;
    Ok(u32::from_le_bytes(b))
}

pub(super) fn read_i64(s: &mut TcpStream, deadline: Instant) -> Result<i64, String> {
    let mut b = [0u8; 8];
    read_by(s, &mut b, deadline)?;
    Ok(i64::from_le_bytes(b))
}

pub(super) fn read_bytes(s: &mut TcpStream, deadline: Instant) -> Result<Vec<u8>, String> {
    let n = read_i64(s, deadline)? as u64;
    if n > MAX_FRAME as u64 {
        return Err(format!(
            "a value of {n} bytes exceeds the limit of {MAX_FRAME}"
        ));
    }
    let mut v = vec![0u8; n as usize];
    read_by(s, &mut v, deadline)?;
    Ok(v)
}

// ---------------------------------------------------------------------------------------------
// The client's side.

/// Configures a fresh connection to a PyTorch server and greets it: `VALIDATE`, then `PING`
/// with a nonce that must come back.
pub(super) fn client_greeting(s: &mut TcpStream, deadline: Instant) -> Result<(), String> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_nodelay(true)
        .and_then(|()| s.set_write_timeout(Some(left)))
        .map_err(|e| e.to_string())?;
    let nonce = std::process::id();
    Msg::query(Query::Validate).u32(VALIDATION_MAGIC).send(s)?;
    Msg::query(Query::Ping).u32(nonce).send(s)?;
    match read_u32(s, deadline) {
        Ok(n) if n == nonce => Ok(()),
        Ok(n) => Err(format!(
            "answer {n:#x} to PING {nonce:#x}: not a PyTorch TCPStore server"
        )),
        Err(e) => Err(format!(
            "no answer to PING ({e}): is this a PyTorch TCPStore server?"
        )),
    }
}

/// `WAIT` for `keys` up to `timeout`; `Some(missing)` when it ran out (after `CANCEL_WAIT`,
/// with the keys still missing found by `CHECK`). `reply_margin` bounds the server's answers.
pub(super) fn client_wait(
    s: &mut TcpStream,
    keys: &[String],
    timeout: Duration,
    reply_margin: Duration,
) -> Result<Option<Vec<String>>, String> {
    Msg::query(Query::Wait).keys(keys).send(s)?;
    let mut b = [0u8; 1];
    match read_full(s, &mut b, Some(deadline_after(timeout)), None) {
        Ok(()) if b[0] == STOP_WAITING => return Ok(None),
        Ok(()) => return Err(format!("unexpected answer {} to WAIT", b[0])),
        Err(FrameError::TimedOut) => {}
        Err(e) => return Err(e.to_string()),
    }
    let deadline = deadline_after(reply_margin);
    Msg::query(Query::CancelWait).send(s)?;
    match read_u8(s, deadline)? {
        WAIT_CANCELED => {}
        STOP_WAITING => {
            // The keys came before the cancel arrived: the cancel is still answered.
            if read_u8(s, deadline)? != WAIT_CANCELED {
                return Err("no WAIT_CANCELED after CANCEL_WAIT".into());
            }
            return Ok(None);
        }
        other => return Err(format!("unexpected answer {other} to CANCEL_WAIT")),
    }
    let mut missing = Vec::new();
    for k in keys {
        Msg::query(Query::Check)
            .keys(std::slice::from_ref(k))
            .send(s)?;
        if read_u8(s, deadline)? != READY {
            missing.push(k.clone());
        }
    }
    Ok(Some(missing))
}

/// `CHECK` of `keys`.
pub(super) fn client_check(
    s: &mut TcpStream,
    keys: &[String],
    deadline: Instant,
) -> Result<bool, String> {
    Msg::query(Query::Check).keys(keys).send(s)?;
    match read_u8(s, deadline)? {
        READY => Ok(true),
        NOT_READY => Ok(false),
        other => Err(format!("unexpected answer {other} to CHECK")),
    }
}

// ---------------------------------------------------------------------------------------------
// The server's side.

/// Whether a connection speaks PyTorch's protocol: its first bytes are `VALIDATE` and the
/// magic number's first byte (ours begin with a frame length, whose second byte is 0).
pub(super) fn looks_like_torch(first: &[u8]) -> bool {
    first.len() >= 2 && first[0] == Query::Validate as u8 && first[1] == VALIDATION_MAGIC as u8
}

/// Serves a PyTorch client until it leaves, breaks the protocol, or the server stops. A store
/// with a job token refuses it (PyTorch's protocol cannot prove the token).
pub(super) fn serve(mut s: TcpStream, peer: SocketAddr, shared: &Shared) {
    let refuse = |why: String| {
        tracing::warn!(%peer, reason = %why, "store refused a PyTorch client");
    };
    if shared.token.is_some() {
        refuse(
            "this store requires the job token (FSDP_JOB_TOKEN) and PyTorch's TCPStore protocol \
             cannot prove it: PyTorch clients are accepted only by stores without a token"
                .into(),
        );
        return;
    }
    let io = shared.io_timeout;
    let mut validated = false;
    loop {
        let mut cmd = [0u8; 1];
        match read_some(&mut s, &mut cmd, None, Some(&shared.stop), true) {
            Ok(_) => {}
            Err(FrameError::Closed) | Err(FrameError::Stopped) => return,
            Err(e) => {
                tracing::debug!(%peer, error = %e, "PyTorch store connection dropped");
                return;
            }
        }
        let deadline = deadline_after(io);
        let query = Query::from_u8(cmd[0]);
        if !validated && query != Some(Query::Validate) {
            return refuse(format!(
                "its first query is {} instead of VALIDATE: not a PyTorch TCPStore client",
                cmd[0]
            ));
        }
        let result = match query {
            None => Err(format!(
                "query code {} is not served (this store serves VALIDATE..PING, 0..13)",
                cmd[0]
            )),
            Some(q) => serve_query(&mut s, q, shared, deadline),
        };
        match result {
            Ok(()) => validated = true,
            Err(why) => return refuse(why),
        }
    }
}

fn read_key(s: &mut TcpStream, deadline: Instant) -> Result<String, String> {
    String::from_utf8(read_bytes(s, deadline)?).map_err(|_| "a key is not valid UTF-8".into())
}

fn read_keys(s: &mut TcpStream, deadline: Instant) -> Result<Vec<String>, String> {
    let n = read_i64(s, deadline)? as u64;
    if n > (MAX_FRAME / 8) as u64 {
        return Err(format!("{n} keys in one query"));
    }
    (0..n).map(|_| read_key(s, deadline)).collect()
}

fn serve_query(
    s: &mut TcpStream,
    q: Query,
    shared: &Shared,
    deadline: Instant,
) -> Result<(), String> {
    let set = |key: String, value: Vec<u8>| {
        lock(&shared.keys).insert(key, value);
        shared.changed.notify_all();
    };
    match q {
        Query::Validate => {
            let magic = read_u32(s, deadline)?;
            if magic != VALIDATION_MAGIC {
                return Err(format!("VALIDATE with magic {magic:#x}"));
            }
            Ok(())
        }
        Query::Ping => {
            let nonce = read_u32(s, deadline)?;
            Msg::reply().u32(nonce).send(s)
        }
        Query::Set => {
            let key = read_key(s, deadline)?;
            let value = read_bytes(s, deadline)?;
            set(key, value);
            Ok(())
        }
        Query::MultiSet => {
            let n = read_i64(s, deadline)?;
            for _ in 0..n {
                let key = read_key(s, deadline)?;
                let value = read_bytes(s, deadline)?;
                set(key, value);
            }
            Ok(())
        }
        Query::Append => {
            let key = read_key(s, deadline)?;
            let value = read_bytes(s, deadline)?;
            lock(&shared.keys).entry(key).or_default().extend(value);
            shared.changed.notify_all();
            Ok(())
        }
        Query::Get => {
            let key = read_key(s, deadline)?;
            // PyTorch's clients wait for the key first; an absent key reads as empty.
            let value = lock(&shared.keys).get(&key).cloned().unwrap_or_default();
            Msg::reply().bytes(&value).send(s)
        }
        Query::MultiGet => {
            let keys = read_keys(s, deadline)?;
            let mut reply = Msg::reply();
            {
                let map = lock(&shared.keys);
                for k in &keys {
                    reply = reply.bytes(map.get(k).map_or(&[][..], Vec::as_slice));
                }
            }
            reply.send(s)
        }
        Query::Add => {
            let key = read_key(s, deadline)?;
            let delta = read_i64(s, deadline)?;
            let new = {
                let mut map = lock(&shared.keys);
                let current = match map.get(&key) {
                    None => 0,
                    Some(v) => std::str::from_utf8(v)
                        .ok()
                        .and_then(|t| t.parse::<i64>().ok())
                        .ok_or_else(|| format!("ADD to key {key:?}, which is not an integer"))?,
                };
                let new = current.wrapping_add(delta);
                map.insert(key, new.to_string().into_bytes());
                new
            };
            shared.changed.notify_all();
            Msg::reply().i64(new).send(s)
        }
        Query::CompareSet => {
            let key = read_key(s, deadline)?;
            let expected = read_bytes(s, deadline)?;
            let desired = read_bytes(s, deadline)?;
            let after = {
                let mut map = lock(&shared.keys);
                match map.get_mut(&key) {
                    None if expected.is_empty() => {
                        map.insert(key, desired.clone());
                        desired
                    }
                    None => expected,
                    Some(v) if *v == expected => {
                        *v = desired.clone();
                        desired
                    }
                    Some(v) => v.clone(),
                }
            };
            shared.changed.notify_all();
            Msg::reply().bytes(&after).send(s)
        }
        Query::Check => {
            let keys = read_keys(s, deadline)?;
            let map = lock(&shared.keys);
            let ready = keys.iter().all(|k| map.contains_key(k));
            drop(map);
            Msg::reply()
                .u8(if ready { READY } else { NOT_READY })
                .send(s)
        }
        Query::GetNumKeys => {
            let n = lock(&shared.keys).len();
            Msg::reply().i64(n as i64).send(s)
        }
        Query::DeleteKey => {
            let key = read_key(s, deadline)?;
            let existed = lock(&shared.keys).remove(&key).is_some();
            Msg::reply().i64(existed.into()).send(s)
        }
        Query::Wait => {
            let keys = read_keys(s, deadline)?;
            serve_wait(s, &keys, shared)
        }
        // Not waiting: the cancel of a wait that was answered already.
        Query::CancelWait => Msg::reply().u8(WAIT_CANCELED).send(s),
    }
}

/// Waits until every key is set (answers `STOP_WAITING`) or the client sends `CANCEL_WAIT`
/// (answers `WAIT_CANCELED`); ends with an error when the server stops or the client leaves.
fn serve_wait(s: &mut TcpStream, keys: &[String], shared: &Shared) -> Result<(), String> {
    let mut map = lock(&shared.keys);
    loop {
        if keys.iter().all(|k| map.contains_key(k)) {
            drop(map);
            return Msg::reply().u8(STOP_WAITING).send(s);
        }
        if shared.stop.load(Ordering::SeqCst) {
            return Err("the server is stopping".into());
        }
        map = shared
            .changed
            .wait_timeout(map, WAIT_SLICE)
            .unwrap_or_else(|e| e.into_inner())
            .0;
        if keys.iter().all(|k| map.contains_key(k)) {
            continue;
        }
        drop(map);
        // Anything from the client while it waits must be CANCEL_WAIT.
        if let Some(b) = poll_byte(s)? {
            if b != Query::CancelWait as u8 {
                return Err(format!(
                    "query {b} while waiting (only CANCEL_WAIT is valid)"
                ));
            }
            return Msg::reply().u8(WAIT_CANCELED).send(s);
        }
        map = lock(&shared.keys);
    }
}

/// One byte from the client if one is there, without waiting.
fn poll_byte(s: &mut TcpStream) -> Result<Option<u8>, String> {
    let mut b = [0u8; 1];
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let r = s.read(&mut b);
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    match r {
        Ok(0) => Err("the client left while waiting".into()),
        Ok(_) => Ok(Some(b[0])),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e.to_string()),
    }
}
