//! The rendezvous key-value store: a small TCP server started by rank 0, like PyTorch's
//! `TCPStore`.
//!
//! Rank 0 (the *server*, [`StoreOptions::is_server`]) listens on `host:port` — by convention
//! `MASTER_ADDR:MASTER_PORT` — answers requests on its own threads, and connects to itself as a
//! client too. The other ranks connect with retry and growing back-off until the store's timeout,
//! then fail with [`CollectiveError::Store`] (`op: "connect"`) naming the address and how long
//! they tried. A port that is already taken fails at once with `op: "bind"`.
//!
//! Operations: [`set`](TcpStore::set), [`get`](TcpStore::get) (waits for the key),
//! [`try_get`](TcpStore::try_get), [`add`](TcpStore::add) (an integer counter),
//! [`compare_set`](TcpStore::compare_set), [`wait`](TcpStore::wait) (for several keys, with a
//! timeout), [`check`](TcpStore::check), [`delete_key`](TcpStore::delete_key),
//! [`num_keys`](TcpStore::num_keys) and [`barrier`](TcpStore::barrier) (every rank sets
//! `{name}/{rank}` and waits for all of them; if some never arrive the error,
//! [`CollectiveError::MissingRanks`], lists exactly those ranks).
//!
//! # Guarantees
//! - No wait is unbounded. Waits for keys are served by the server (a condition variable with a
//!   deadline) and end with an error naming the keys that are still missing; every socket has
//!   read and write timeouts; a connection that breaks (the server went away, a peer reset it)
//!   is an error that names the server's address, never a hang.
//! - A handle is `Send + Sync` and cheap to clone. Clones share a small pool of connections:
//!   a call takes an idle connection (or opens one), so a thread blocked in
//!   [`wait`](TcpStore::wait) never blocks another thread's [`set`](TcpStore::set) through the
//!   same handle.
//!
//! The store is meant for rendezvous data — addresses, unique ids, counters, small blobs. Values
//! of up to 1 GiB are accepted, but every byte goes through rank 0's process and is copied a few
//! times on the way: it is no channel for bulk data.
//!
//! # Lifetime of the server
//! The server lives exactly as long as rank 0's store: it stops when the last clone of the
//! handle created with `is_server = true` is dropped. Dropping it closes the listening socket and
//! every connection (clients then get an error naming the address on their next call, or at once
//! if they are waiting); the drop itself is bounded (it waits at most about two seconds for the
//! server's threads to finish). So rank 0 must keep its store alive until the other ranks no
//! longer need it — typically until after a final [`barrier`](TcpStore::barrier).
//!
//! # Wire protocol
//! Frames are a 4-byte big-endian length followed by the payload (at most 1 GiB). A request is
//! an operation code and its fields (byte strings as a 4-byte length and the bytes, integers as
//! 8 bytes big-endian); a reply is a status (ok, error with a message, or timed out with the
//! missing keys) and the result. A connection starts with a greeting carrying a magic string, so
//! that connecting to some other service is an error that says so.
//!
//! # Example
//! Rank 0's server and rank 1's client in one process (port 0 picks a free port):
//! ```
//! use std::time::Duration;
//! use fsdp_collectives::store::{StoreOptions, TcpStore};
//!
//! let t = Duration::from_secs(10);
//! let server = TcpStore::new(StoreOptions::new("127.0.0.1", 0, 0, 2).with_timeout(t))?;
//! let client = TcpStore::new(StoreOptions::new("127.0.0.1", server.port(), 1, 2).with_timeout(t))?;
//!
//! client.set("greeting", b"hello")?;
//! assert_eq!(server.get("greeting")?, b"hello");
//! assert_eq!(server.add("count", 2)?, 2);
//! assert_eq!(client.add("count", 3)?, 5);
//! assert!(client.check(&["greeting", "count"])?);
//!
//! // Both ranks meet at a barrier.
//! let other = std::thread::spawn(move || client.barrier("ready", t));
//! server.barrier("ready", t)?;
//! other.join().unwrap()?;
//! # Ok::<(), fsdp_collectives::CollectiveError>(())
//! ```

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fsdp_device::DEFAULT_TIMEOUT;

use crate::auth::{self, JobToken};
use crate::{CollectiveError, Result};

/// Largest frame accepted on either side.
const MAX_FRAME: usize = 1 << 30;
/// Greeting that identifies the protocol (and its version).
const MAGIC: &[u8] = b"fsdp-collectives-store/2";
/// Labels of the two directions of the challenge-response.
const SERVER_LABEL: &str = "fsdp-store/server-proof";
const CLIENT_LABEL: &str = "fsdp-store/client-proof";
/// How often the acceptor looks for new connections and the stop flag.
const POLL: Duration = Duration::from_millis(50);
/// How often idle connection threads and waits look at the stop flag (a fallback: stopping the
/// server shuts their sockets down and wakes the waits).
const IDLE_POLL: Duration = Duration::from_millis(500);
/// Extra time a client gives the server to answer after a server-side wait's deadline.
const REPLY_MARGIN: Duration = Duration::from_secs(2);
/// Bound of the server's drop: how long it waits for its connection threads to end.
const DROP_GRACE: Duration = Duration::from_secs(2);
/// Longest single connection attempt and longest back-off between attempts.
const CONNECT_SLICE: Duration = Duration::from_secs(2);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// Options of a [`TcpStore`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreOptions {
    /// Host of the server (`MASTER_ADDR`): the server listens on it, clients connect to it.
    pub host: String,
    /// Port of the server (`MASTER_PORT`); for the server, 0 picks a free port (see
    /// [`TcpStore::port`]).
    pub port: u16,
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks (used by [`TcpStore::barrier`]).
    pub world_size: usize,
    /// Whether this process runs the server (default: `rank == 0`).
    pub is_server: bool,
    /// Bound of connecting (with retry), of [`TcpStore::get`] and of every socket read and
    /// write. Default: [`DEFAULT_TIMEOUT`] (300 s).
    pub timeout: Duration,
    /// The job's secret: every connection proves it knows it, and checks that the server does
    /// (see [`crate::auth`]). Default: none (then the server binds only loopback addresses).
    pub token: Option<JobToken>,
    /// The job's id: a client of another job is refused. Default: none (the server makes one
    /// up; a client then accepts the server's).
    pub job_id: Option<String>,
}

impl StoreOptions {
    /// Options for `rank` of `world_size` with the server at `host:port`; rank 0 runs the
    /// server; the timeout is [`DEFAULT_TIMEOUT`].
    pub fn new(host: impl Into<String>, port: u16, rank: usize, world_size: usize) -> Self {
        StoreOptions {
            host: host.into(),
            port,
            rank,
            world_size,
            is_server: rank == 0,
            timeout: DEFAULT_TIMEOUT,
            token: None,
            job_id: None,
        }
    }

    /// These options with the job's secret.
    pub fn with_token(mut self, token: Option<JobToken>) -> Self {
        self.token = token;
        self
    }

    /// These options with the job's id.
    pub fn with_job_id(mut self, job_id: Option<String>) -> Self {
        self.job_id = job_id.filter(|j| !j.is_empty());
        self
    }

    /// These options with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These options with the server role given explicitly.
    pub fn with_server(mut self, is_server: bool) -> Self {
        self.is_server = is_server;
        self
    }
}

/// A handle to the rendezvous store (see the [module documentation](self)).
///
/// `Send + Sync`; clones share the connections and, on the server rank, the server.
#[derive(Clone)]
pub struct TcpStore {
    inner: Arc<Inner>,
}

struct Inner {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// `host:port` as given (with the real port), for messages.
    address: String,
    port: u16,
    /// The server address the first connection reached; further connections go there.
    peer: SocketAddr,
    /// Who this client says it is at each greeting.
    me: Identity,
    /// The job's id (the server's).
    job_id: String,
    /// Idle connections. Declared before `server` so that they close first on drop.
    pool: Mutex<Vec<TcpStream>>,
    server: Option<Server>,
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStore")
            .field("address", &self.inner.address)
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.world_size)
            .field("is_server", &self.inner.server.is_some())
            .field("timeout", &self.inner.timeout)
            .finish()
    }
}

impl TcpStore {
    /// Opens the store. The server rank binds `host:port` (port 0: a free port), starts the
    /// server and connects to it; the other ranks connect with retry until
    /// [`timeout`](StoreOptions::timeout).
    ///
    /// Errors: invalid options ([`CollectiveError::InvalidArgument`]), the address cannot be
    /// bound — e.g. already in use — ([`CollectiveError::Store`] with `op: "bind"`), the server
    /// could not be reached in time (`op: "connect"`).
    pub fn new(opts: StoreOptions) -> Result<TcpStore> {
        let rank = opts.rank;
        let invalid = |reason: String| CollectiveError::InvalidArgument {
            rank,
            op: "store",
            reason,
        };
        if opts.world_size == 0 {
            return Err(invalid("world_size must be at least 1".into()));
        }
        if rank >= opts.world_size {
            return Err(invalid(format!(
                "rank {rank} is out of range for world_size {}",
                opts.world_size
            )));
        }
        if opts.timeout.is_zero() {
            return Err(invalid("the timeout must be positive".into()));
        }
        if opts.host.is_empty() {
            return Err(invalid("the host is empty".into()));
        }
        if !opts.is_server && opts.port == 0 {
            return Err(invalid(
                "a client needs the server's port (0 is only valid for the server)".into(),
            ));
        }

        let (server, port, peer) = if opts.is_server {
            let server = Server::start(&opts)?;
            let mut target = server.addr;
            if target.ip().is_unspecified() {
                target.set_ip(match target {
                    SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                });
            }
            (Some(server), target.port(), Some(target))
        } else {
            (None, opts.port, None)
        };
        let address = format!("{}:{}", opts.host, port);
        let me = Identity {
            rank,
            world_size: opts.world_size,
            job_id: match &server {
                Some(s) => Some(s.shared.job_id.clone()),
                None => opts.job_id.clone(),
            },
            token: opts.token.clone(),
        };
        let (stream, peer, job_id) = connect_with_retry(&opts.host, port, peer, &me, opts.timeout)
            .map_err(|reason| CollectiveError::Store {
                rank,
                op: "connect",
                reason,
            })?;
        tracing::debug!(rank, %address, %peer, "store connected");
        Ok(TcpStore {
            inner: Arc::new(Inner {
                rank,
                world_size: opts.world_size,
                timeout: opts.timeout,
                address,
                port,
                peer,
                me,
                job_id,
                pool: Mutex::new(vec![stream]),
                server,
            }),
        })
    }

    /// The server's port (the real one when the server was started with port 0).
    pub fn port(&self) -> u16 {
        self.inner.port
    }

    /// The server's address as `host:port`.
    pub fn address(&self) -> &str {
        &self.inner.address
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.world_size
    }

    /// The store's timeout (bound of [`get`](Self::get) and of socket reads and writes).
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// The job's id (the store host's).
    pub fn job_id(&self) -> &str {
        &self.inner.job_id
    }

    /// The job's secret, if the job has one.
    pub fn job_token(&self) -> Option<&JobToken> {
        self.inner.me.token.as_ref()
    }

    /// Whether this handle runs the server.
    pub fn is_server(&self) -> bool {
        self.inner.server.is_some()
    }

    /// Sets `key` to `value` (replacing any value) and wakes the ranks waiting for it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.check_size("set", key.len() + value.len())?;
        let req = Enc::new(Op::Set)
            .bytes(key.as_bytes())
            .bytes(value)
            .finish();
        self.request("set", &req, None)?.expect_ok(self, "set")?;
        Ok(())
    }

    /// The value of `key`, waiting up to [`timeout`](Self::timeout) for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.inner.timeout)
    }

    /// The value of `key`, waiting up to `timeout` for it to be set. On timeout:
    /// [`CollectiveError::Store`] (`op: "get"`) naming the key.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.check_size("get", key.len())?;
        let req = Enc::new(Op::Get)
            .bytes(key.as_bytes())
            .u64(millis(timeout))
            .finish();
        match self.request("get", &req, Some(timeout))? {
            Reply::Ok(mut body) => {
                let mut d = Dec::new(&body);
                d.bytes()
                    .and_then(|_| d.end())
                    .map_err(|e| self.protocol("get", e))?;
                // The value is the body after its 4-byte length.
                body.drain(..4);
                Ok(body)
            }
            Reply::TimedOut(_) => Err(self.store_err(
                "get",
                format!(
                    "key {key:?} did not appear within {timeout:?} (store at {})",
                    self.inner.address
                ),
            )),
            Reply::Error(msg) => Err(self.server_err("get", msg)),
        }
    }

    /// The value of `key` if it is set, without waiting.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.check_size("try_get", key.len())?;
        let req = Enc::new(Op::TryGet).bytes(key.as_bytes()).finish();
        let body = self
            .request("try_get", &req, None)?
            .expect_ok(self, "try_get")?;
        let mut d = Dec::new(&body);
        let present = d.u8().map_err(|e| self.protocol("try_get", e))?;
        let value = d.bytes().map_err(|e| self.protocol("try_get", e))?;
        Ok((present != 0).then(|| value.to_vec()))
    }

    /// Adds `delta` to the integer counter `key` (absent counts as 0) and returns the new value.
    /// The value is stored as decimal text, so [`get`](Self::get) of a counter gives e.g. `b"5"`.
    /// A key that holds something else than an integer is an error.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.check_size("add", key.len())?;
        let req = Enc::new(Op::Add).bytes(key.as_bytes()).i64(delta).finish();
        let body = self.request("add", &req, None)?.expect_ok(self, "add")?;
        Dec::new(&body).i64().map_err(|e| self.protocol("add", e))
    }

    /// Atomically replaces the value of `key` by `desired` if it equals `expected`, and returns
    /// the value after the operation (PyTorch's semantics): `desired` when it was swapped, else
    /// the current value. If the key is absent and `expected` is empty, the key is created with
    /// `desired`; if it is absent and `expected` is not empty, nothing is set and `expected` is
    /// returned.
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.check_size("compare_set", key.len() + expected.len() + desired.len())?;
        let req = Enc::new(Op::CompareSet)
            .bytes(key.as_bytes())
            .bytes(expected)
            .bytes(desired)
            .finish();
        let body = self
            .request("compare_set", &req, None)?
            .expect_ok(self, "compare_set")?;
        let mut d = Dec::new(&body);
        Ok(d.bytes()
            .map_err(|e| self.protocol("compare_set", e))?
            .to_vec())
    }

    /// Waits up to `timeout` until every key of `keys` is set. On timeout:
    /// [`CollectiveError::Store`] (`op: "wait"`) naming the keys still missing.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        match self.wait_missing("wait", keys, timeout)? {
            None => Ok(()),
            Some(missing) => Err(self.store_err(
                "wait",
                format!(
                    "keys {missing:?} did not appear within {timeout:?} ({} of {} keys present; \
                     store at {})",
                    keys.len() - missing.len(),
                    keys.len(),
                    self.inner.address
                ),
            )),
        }
    }

    /// Whether every key of `keys` is set (no waiting).
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        self.check_size("check", keys.iter().map(|k| k.len() + 4).sum())?;
        let req = Enc::new(Op::Check).strs(keys).finish();
        let body = self
            .request("check", &req, None)?
            .expect_ok(self, "check")?;
        Ok(Dec::new(&body)
            .u8()
            .map_err(|e| self.protocol("check", e))?
            != 0)
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete_key(&self, key: &str) -> Result<bool> {
        self.check_size("delete_key", key.len())?;
        let req = Enc::new(Op::Delete).bytes(key.as_bytes()).finish();
        let body = self
            .request("delete_key", &req, None)?
            .expect_ok(self, "delete_key")?;
        Ok(Dec::new(&body)
            .u8()
            .map_err(|e| self.protocol("delete_key", e))?
            != 0)
    }

    /// The number of keys in the store (including barrier and counter keys).
    pub fn num_keys(&self) -> Result<usize> {
        let req = Enc::new(Op::NumKeys).finish();
        let body = self
            .request("num_keys", &req, None)?
            .expect_ok(self, "num_keys")?;
        let n = Dec::new(&body)
            .u64()
            .map_err(|e| self.protocol("num_keys", e))?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    /// Waits until every rank `0..world_size` has reached the barrier `name`: sets
    /// `{name}/{rank}`, then waits up to `timeout` for the keys of all ranks. On timeout:
    /// [`CollectiveError::MissingRanks`] listing exactly the ranks whose keys are absent.
    ///
    /// The keys stay in the store, so a barrier name can be used once: use a fresh name (e.g.
    /// with a counter) for each barrier.
    pub fn barrier(&self, name: &str, timeout: Duration) -> Result<()> {
        let keys: Vec<String> = (0..self.inner.world_size)
            .map(|r| format!("{name}/{r}"))
            .collect();
        self.set(&keys[self.inner.rank], b"1")?;
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        match self.wait_missing("barrier", &refs, timeout)? {
            None => Ok(()),
            Some(missing_keys) => {
                let mut missing: Vec<usize> = missing_keys
                    .iter()
                    .filter_map(|k| keys.iter().position(|x| x == k))
                    .collect();
                missing.sort_unstable();
                Err(CollectiveError::MissingRanks {
                    rank: self.inner.rank,
                    missing,
                    waited: timeout,
                    what: format!(
                        "barrier {name:?}: keys {name}/{{rank}} in the store at {}",
                        self.inner.address
                    ),
                })
            }
        }
    }

    /// Server-side wait; `Some(missing keys)` on timeout.
    fn wait_missing(
        &self,
        op: &'static str,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<Option<Vec<String>>> {
        self.check_size(op, keys.iter().map(|k| k.len() + 4).sum())?;
        let req = Enc::new(Op::Wait).strs(keys).u64(millis(timeout)).finish();
        match self.request(op, &req, Some(timeout))? {
            Reply::Ok(_) => Ok(None),
            Reply::TimedOut(missing) => Ok(Some(missing)),
            Reply::Error(msg) => Err(self.server_err(op, msg)),
        }
    }

    /// Sends one request and reads its reply. `wait` is the server-side wait of the request,
    /// if any: the reply is awaited that long plus a margin; otherwise up to the store's timeout.
    fn request(&self, op: &'static str, req: &[u8], wait: Option<Duration>) -> Result<Reply> {
        let reply_within = match wait {
            Some(w) => w.saturating_add(REPLY_MARGIN),
            None => self.inner.timeout,
        };
        let mut conn = self.take_conn(op)?;
        let result = write_frame(&mut conn, req)
            .map_err(|e| format!("sending the request failed: {e}"))
            .and_then(|()| {
                read_frame(&mut conn, Some(deadline_after(reply_within)), None).map_err(|e| match e
                {
                    FrameError::TimedOut => format!("no reply within {reply_within:?}"),
                    e => e.to_string(),
                })
            })
            .and_then(|frame| Reply::decode(frame).map_err(|e| format!("bad reply: {e}")));
        match result {
            Ok(reply) => {
                lock(&self.inner.pool).push(conn);
                Ok(reply)
            }
            // The connection is in an unknown state: drop it.
            Err(e) => Err(self.store_err(
                op,
                format!(
                    "connection to the store server at {} (rank 0) failed: {e}",
                    self.inner.address
                ),
            )),
        }
    }

    /// An idle connection, or a new one to the server.
    fn take_conn(&self, op: &'static str) -> Result<TcpStream> {
        if let Some(conn) = lock(&self.inner.pool).pop() {
            return Ok(conn);
        }
        let deadline = deadline_after(self.inner.timeout);
        let stream = TcpStream::connect_timeout(&self.inner.peer, self.inner.timeout)
            .map_err(|e| e.to_string())
            .and_then(|s| {
                handshake(s, &self.inner.me, deadline)
                    .map(|(s, _)| s)
                    .map_err(|e| e.message())
            });
        stream.map_err(|e| {
            self.store_err(
                op,
                format!(
                    "cannot open another connection to the store server at {} ({}): {e}",
                    self.inner.address, self.inner.peer
                ),
            )
        })
    }

    fn check_size(&self, op: &'static str, bytes: usize) -> Result<()> {
        if bytes > MAX_FRAME - 64 {
            return Err(CollectiveError::InvalidArgument {
                rank: self.inner.rank,
                op,
                reason: format!(
                    "{bytes} bytes of keys and values exceed the store's limit of {} bytes per \
                     request",
                    MAX_FRAME - 64
                ),
            });
        }
        Ok(())
    }

    fn store_err(&self, op: &'static str, reason: String) -> CollectiveError {
        CollectiveError::Store {
            rank: self.inner.rank,
            op,
            reason,
        }
    }

    fn server_err(&self, op: &'static str, msg: String) -> CollectiveError {
        self.store_err(
            op,
            format!("the store server at {} reports: {msg}", self.inner.address),
        )
    }

    fn protocol(&self, op: &'static str, e: String) -> CollectiveError {
        self.store_err(
            op,
            format!(
                "malformed reply from the store server at {}: {e}",
                self.inner.address
            ),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Connecting.

/// Connects to the server with retry and back-off until `timeout`; `known` skips resolution.
fn connect_with_retry(
    host: &str,
    port: u16,
    known: Option<SocketAddr>,
    me: &Identity,
    timeout: Duration,
) -> std::result::Result<(TcpStream, SocketAddr, String), String> {
    let start = Instant::now();
    let deadline = deadline_after(timeout);
    let mut backoff = Duration::from_millis(10);
    let mut attempts = 0u32;
    let mut last_error = String::from("no attempt made");
    loop {
        attempts += 1;
        let addrs: Vec<SocketAddr> = match known {
            Some(a) => vec![a],
            None => match (host, port).to_socket_addrs() {
                Ok(a) => a.collect(),
                Err(e) => {
                    last_error = format!("cannot resolve {host:?}: {e}");
                    Vec::new()
                }
            },
        };
        for addr in addrs {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(&addr, remaining.min(CONNECT_SLICE)) {
                Ok(stream) => match handshake(stream, me, deadline) {
                    Ok((stream, job)) => return Ok((stream, addr, job)),
                    // Refused (another job, a wrong token, another WORLD_SIZE): retrying
                    // cannot help.
                    Err(HandshakeError::Refused(e)) => {
                        return Err(format!("the store server at {addr} ({host}:{port}): {e}"))
                    }
                    Err(HandshakeError::Failed(e)) => last_error = format!("{addr}: {e}"),
                },
                Err(e) => last_error = format!("{addr}: {e}"),
            }
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(format!(
                "could not connect to the store server at {host}:{port} (rank 0, MASTER_ADDR:\
                 MASTER_PORT) after trying for {:?} ({attempts} attempts); last error: \
                 {last_error}",
                start.elapsed()
            ));
        }
        std::thread::sleep(backoff.min(remaining));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Who a client says it is at the greeting.
#[derive(Clone, Debug)]
struct Identity {
    rank: usize,
    world_size: usize,
    job_id: Option<String>,
    token: Option<JobToken>,
}

/// Why a greeting failed.
enum HandshakeError {
    /// The other side refused (or failed to prove itself): final.
    Refused(String),
    /// The connection failed: worth another try.
    Failed(String),
}

impl HandshakeError {
    fn message(self) -> String {
        match self {
            HandshakeError::Refused(m) | HandshakeError::Failed(m) => m,
        }
    }
}

/// Configures a fresh connection and runs the greeting: hello with a nonce; the server's nonce,
/// job id and proof; this client's proof; the server's verdict. Returns the server's job id.
fn handshake(
    mut stream: TcpStream,
    me: &Identity,
    deadline: Instant,
) -> std::result::Result<(TcpStream, String), HandshakeError> {
    use HandshakeError::{Failed, Refused};
    let io_timeout = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream
        .set_nodelay(true)
        .map_err(|e| Failed(e.to_string()))?;
    stream
        .set_write_timeout(Some(io_timeout))
        .map_err(|e| Failed(e.to_string()))?;
    let cnonce = auth::nonce();
    let hello = Enc::new(Op::Hello)
        .bytes(MAGIC)
        .u64(me.rank as u64)
        .u64(me.world_size as u64)
        .bytes(me.job_id.as_deref().unwrap_or("").as_bytes())
        .u8(me.token.is_some().into())
        .bytes(&cnonce)
        .finish();
    let exchange = |stream: &mut TcpStream,
                    msg: &[u8]|
     -> std::result::Result<Vec<u8>, HandshakeError> {
        write_frame(stream, msg).map_err(|e| Failed(format!("greeting failed: {e}")))?;
        let frame = read_frame(stream, Some(deadline), None).map_err(|e| match e {
            FrameError::TimedOut => {
                Failed("no answer to the greeting (is this a store server?)".into())
            }
            e => Failed(format!("greeting failed: {e}")),
        })?;
        match Reply::decode(frame) {
            Ok(Reply::Ok(body)) => Ok(body),
            Ok(Reply::Error(msg)) => Err(Refused(format!("the server refused this rank: {msg}"))),
            _ => Err(Failed(
                "unexpected answer to the greeting (is this a store server?)".into(),
            )),
        }
    };
    let body = exchange(&mut stream, &hello)?;
    let bad = |e: String| Failed(format!("malformed answer to the greeting: {e}"));
    let mut d = Dec::new(&body);
    let snonce = d.bytes().map_err(bad)?.to_vec();
    let server_job = String::from_utf8_lossy(d.bytes().map_err(bad)?).into_owned();
    let server_token = d.u8().map_err(bad)? != 0;
    let sproof = d.bytes().map_err(bad)?.to_vec();
    match (me.token.is_some(), server_token) {
        (true, false) => {
            return Err(Refused(
                "the store has no job token but this rank has one (FSDP_JOB_TOKEN): it belongs to another job"
                    .into(),
            ))
        }
        (false, true) => {
            return Err(Refused(
                "the store requires the job token and this rank has none: set FSDP_JOB_TOKEN (or FSDP_JOB_TOKEN_FILE) to the job's token"
                    .into(),
            ))
        }
        _ => {}
    }
    if let Some(mine) = &me.job_id {
        if *mine != server_job {
            return Err(Refused(format!(
                "the store belongs to job {server_job}, this rank is of job {mine} (two jobs \
                 started on one port?)"
            )));
        }
    }
    let proof = auth::tag(
        me.token.as_ref(),
        CLIENT_LABEL,
        &[&snonce, &cnonce, server_job.as_bytes()],
    );
    // The server judges this proof first (so that it logs a wrong token), then the client
    // judges the server's.
    exchange(&mut stream, &proof)?;
    if !auth::verify(
        me.token.as_ref(),
        SERVER_LABEL,
        &[&cnonce, &snonce, server_job.as_bytes()],
        &sproof,
    ) {
        return Err(Refused(
            "the server did not prove that it knows the job token: it is another job's store, \
             or the tokens differ"
                .into(),
        ));
    }
    Ok((stream, server_job))
}

// ---------------------------------------------------------------------------------------------
// The server.

struct Shared {
    keys: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    stop: AtomicBool,
    live_conns: Mutex<usize>,
    conns_done: Condvar,
    /// A handle to every open connection, to shut them down when the server stops.
    open: Mutex<HashMap<u64, TcpStream>>,
    io_timeout: Duration,
    /// The server's rank and world size, the job's id and token.
    rank: usize,
    world_size: usize,
    job_id: String,
    token: Option<JobToken>,
    /// Set when a rank of this job was refused for a reason that dooms the job (another
    /// WORLD_SIZE): every wait then fails at once with it.
    fatal: Mutex<Option<String>>,
}

struct Server {
    shared: Arc<Shared>,
    addr: SocketAddr,
    acceptor: Option<JoinHandle<()>>,
}

impl Server {
    fn start(opts: &StoreOptions) -> Result<Server> {
        let bind_err = |reason: String| CollectiveError::Store {
            rank: opts.rank,
            op: "bind",
            reason,
        };
        let address = format!("{}:{}", opts.host, opts.port);
        let addrs: Vec<SocketAddr> = (opts.host.as_str(), opts.port)
            .to_socket_addrs()
            .map_err(|e| bind_err(format!("cannot resolve {address}: {e}")))?
            .collect();
        if opts.token.is_none() {
            if let Some(open) = addrs.iter().find(|a| !a.ip().is_loopback()) {
                return Err(bind_err(format!(
                    "refusing to listen on {address} ({open}) without a job token: it is not a \
                     loopback address, so anyone who reaches it could join the job; set \
                     FSDP_JOB_TOKEN (or FSDP_JOB_TOKEN_FILE) on every rank"
                )));
            }
        }
        let mut last = None;
        let mut listener = None;
        for addr in &addrs {
            match TcpListener::bind(addr) {
                Ok(l) => {
                    listener = Some(l);
                    break;
                }
                Err(e) => last = Some((addr, e)),
            }
        }
        let listener = match (listener, last) {
            (Some(l), _) => l,
            (None, Some((addr, e))) if e.kind() == io::ErrorKind::AddrInUse => {
                return Err(bind_err(format!(
                    "cannot listen on {address} ({addr}): the address is already in use \
                     (another program or store holds the port; choose another MASTER_PORT)"
                )))
            }
            (None, Some((addr, e))) => {
                return Err(bind_err(format!(
                    "cannot listen on {address} ({addr}): {e}"
                )))
            }
            (None, None) => {
                return Err(bind_err(format!("{address} resolves to no address")));
            }
        };
        let addr = listener
            .local_addr()
            .and_then(|a| listener.set_nonblocking(true).map(|()| a))
            .map_err(|e| bind_err(format!("cannot configure the socket on {address}: {e}")))?;
        let shared = Arc::new(Shared {
            keys: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            live_conns: Mutex::new(0),
            conns_done: Condvar::new(),
            open: Mutex::new(HashMap::new()),
            io_timeout: opts.timeout,
            rank: opts.rank,
            world_size: opts.world_size,
            job_id: opts.job_id.clone().unwrap_or_else(auth::generate_job_id),
            token: opts.token.clone(),
            fatal: Mutex::new(None),
        });
        let acceptor = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("store-server-{}", addr.port()))
                .spawn(move || accept_loop(listener, shared))
                .map_err(|e| bind_err(format!("cannot start the server thread: {e}")))?
        };
        tracing::debug!(%addr, "store server listening");
        Ok(Server {
            shared,
            addr,
            acceptor: Some(acceptor),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            // Under the lock, so that no waiter misses the wake-up.
            let _keys = lock(&self.shared.keys);
            self.shared.changed.notify_all();
        }
        // The acceptor polls the stop flag every POLL: this join is short.
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        // Wake the connection threads blocked in reads (and tell their clients at once).
        for conn in lock(&self.shared.open).values() {
            let _ = conn.shutdown(Shutdown::Both);
        }
        // Connection threads end within IDLE_POLL at most; wait for them, but boundedly.
        let deadline = deadline_after(DROP_GRACE);
        let mut live = lock(&self.shared.live_conns);
        while *live > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    live = *live,
                    "store server dropped while connection threads are still busy"
                );
                break;
            }
            live = self
                .shared
                .conns_done
                .wait_timeout(live, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut next_id = 0u64;
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let id = next_id;
                next_id += 1;
                *lock(&shared.live_conns) += 1;
                if let Ok(handle) = stream.try_clone() {
                    lock(&shared.open).insert(id, handle);
                }
                let guard = ConnGuard(Arc::clone(&shared), id);
                let spawned = std::thread::Builder::new()
                    .name(format!("store-conn-{peer}"))
                    .spawn(move || {
                        let guard = guard;
                        serve_connection(stream, peer, &guard.0);
                    });
                if let Err(e) = spawned {
                    // The closure (and with it the guard and the stream) is dropped.
                    tracing::warn!(%peer, error = %e, "store server cannot start a thread");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::warn!(error = %e, "store server accept failed");
                std::thread::sleep(POLL);
            }
        }
    }
}

/// Counts a connection thread out, even if it panics.
struct ConnGuard(Arc<Shared>, u64);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        lock(&self.0.open).remove(&self.1);
        let mut live = lock(&self.0.live_conns);
        *live = live.saturating_sub(1);
        self.0.conns_done.notify_all();
    }
}

fn serve_connection(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    let configured = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_nodelay(true))
        .and_then(|()| stream.set_write_timeout(Some(shared.io_timeout)));
    if let Err(e) = configured {
        tracing::warn!(%peer, error = %e, "store server cannot configure a connection");
        return;
    }
    if !server_greeting(&mut stream, peer, shared) {
        let _ = stream.shutdown(Shutdown::Both);
        return;
    }
    loop {
        let frame = match read_frame(&mut stream, None, Some((&shared.stop, shared.io_timeout))) {
            Ok(f) => f,
            Err(FrameError::Closed) | Err(FrameError::Stopped) => break,
            Err(e) => {
                tracing::debug!(%peer, error = %e, "store connection dropped");
                break;
            }
        };
        let reply = handle(shared, &frame);
        if let Err(e) = write_frame(&mut stream, &reply.encode()) {
            tracing::debug!(%peer, error = %e, "store server cannot reply");
            break;
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// The server's side of the greeting (see [`handshake`]); `false` when the client was
/// refused (told why, and logged with its address).
fn server_greeting(stream: &mut TcpStream, peer: SocketAddr, shared: &Shared) -> bool {
    let refuse = |stream: &mut TcpStream, msg: String| {
        tracing::warn!(%peer, reason = %msg, "store refused a connection");
        let _ = write_frame(stream, &Reply::Error(msg).encode());
        false
    };
    let frame = match read_frame(stream, None, Some((&shared.stop, shared.io_timeout))) {
        Ok(f) => f,
        Err(FrameError::Closed) | Err(FrameError::Stopped) => return false,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "store connection dropped before its greeting");
            return false;
        }
    };
    let hello = (|| -> std::result::Result<_, String> {
        let mut d = Dec::new(&frame);
        if d.u8()? != Op::Hello as u8 || d.bytes()? != MAGIC {
            return Err(String::new());
        }
        let rank = d.u64()?;
        let world = d.u64()?;
        let job = String::from_utf8_lossy(d.bytes()?).into_owned();
        let has_token = d.u8()? != 0;
        let cnonce = d.bytes()?.to_vec();
        d.end()?;
        Ok((rank, world, job, has_token, cnonce))
    })();
    let Ok((rank, world, job, has_token, cnonce)) = hello else {
        return refuse(
            stream,
            format!(
                "not a client of this store (expected the greeting {:?})",
                String::from_utf8_lossy(MAGIC)
            ),
        );
    };
    match (shared.token.is_some(), has_token) {
        (true, false) => {
            return refuse(
                stream,
                format!(
                    "rank {rank} has no job token and this store requires one: set \
                     FSDP_JOB_TOKEN (or FSDP_JOB_TOKEN_FILE) to the job's token"
                ),
            )
        }
        (false, true) => {
            return refuse(
                stream,
                format!("rank {rank} has a job token and this store has none: another job?"),
            )
        }
        _ => {}
    }
    let snonce = auth::nonce();
    let job_id = shared.job_id.as_bytes();
    let sproof = auth::tag(
        shared.token.as_ref(),
        SERVER_LABEL,
        &[&cnonce, &snonce, job_id],
    );
    let challenge = Reply::Ok(
        Enc::body()
            .bytes(&snonce)
            .bytes(job_id)
            .u8(shared.token.is_some().into())
            .bytes(&sproof)
            .finish(),
    );
    if write_frame(stream, &challenge.encode()).is_err() {
        return false;
    }
    let proof = match read_frame(stream, Some(deadline_after(shared.io_timeout)), None) {
        Ok(p) => p,
        // The client gave up (it refused the server, or went away).
        Err(e) => {
            tracing::debug!(%peer, error = %e, "store client left during its greeting");
            return false;
        }
    };
    if !auth::verify(
        shared.token.as_ref(),
        CLIENT_LABEL,
        &[&snonce, &cnonce, job_id],
        &proof,
    ) {
        return refuse(
            stream,
            format!("rank {rank} did not prove that it knows the job token (wrong token)"),
        );
    }
    if !job.is_empty() && job != shared.job_id {
        return refuse(
            stream,
            format!(
                "rank {rank} is of job {job}, this store belongs to job {} (two jobs started on \
                 one port?)",
                shared.job_id
            ),
        );
    }
    if world != shared.world_size as u64 {
        let msg = format!(
            "rank {rank} says WORLD_SIZE {world}, rank {} (the store's host) says {}",
            shared.rank, shared.world_size
        );
        {
            let _keys = lock(&shared.keys);
            lock(&shared.fatal).get_or_insert_with(|| msg.clone());
            shared.changed.notify_all();
        }
        return refuse(stream, msg);
    }
    write_frame(stream, &Reply::Ok(Vec::new()).encode()).is_ok()
}

/// Executes one request.
fn handle(shared: &Shared, frame: &[u8]) -> Reply {
    match execute(shared, frame) {
        Ok(reply) => reply,
        Err(msg) => Reply::Error(msg),
    }
}

fn execute(shared: &Shared, frame: &[u8]) -> std::result::Result<Reply, String> {
    let mut d = Dec::new(frame);
    let op = Op::from_u8(d.u8()?)?;
    let reply = match op {
        Op::Hello => Reply::Ok(Vec::new()),
        Op::Set => {
            let key = d.string()?;
            let value = d.bytes()?.to_vec();
            d.end()?;
            lock(&shared.keys).insert(key, value);
            shared.changed.notify_all();
            Reply::Ok(Vec::new())
        }
        Op::Get => {
            let key = d.string()?;
            let timeout = Duration::from_millis(d.u64()?);
            d.end()?;
            match wait_for(shared, std::slice::from_ref(&key), timeout) {
                Ok(keys) => Reply::Ok(Enc::body().bytes(&keys[&key]).finish()),
                Err(reply) => reply,
            }
        }
        Op::TryGet => {
            let key = d.string()?;
            d.end()?;
            let keys = lock(&shared.keys);
            match keys.get(&key) {
                Some(v) => Reply::Ok(Enc::body().u8(1).bytes(v).finish()),
                None => Reply::Ok(Enc::body().u8(0).bytes(&[]).finish()),
            }
        }
        Op::Add => {
            let key = d.string()?;
            let delta = d.i64()?;
            d.end()?;
            let mut keys = lock(&shared.keys);
            let current = match keys.get(&key) {
                None => 0,
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| {
                        format!("add: key {key:?} holds a value that is not an integer")
                    })?,
            };
            let new = current
                .checked_add(delta)
                .ok_or_else(|| format!("add: {current} + {delta} overflows (key {key:?})"))?;
            keys.insert(key, new.to_string().into_bytes());
            shared.changed.notify_all();
            Reply::Ok(Enc::body().i64(new).finish())
        }
        Op::CompareSet => {
            let key = d.string()?;
            let expected = d.bytes()?;
            let desired = d.bytes()?;
            d.end()?;
            let mut keys = lock(&shared.keys);
            let after = match keys.get_mut(&key) {
                None if expected.is_empty() => {
                    keys.insert(key, desired.to_vec());
                    shared.changed.notify_all();
                    desired
                }
                None => expected,
                Some(v) if v.as_slice() == expected => {
                    *v = desired.to_vec();
                    shared.changed.notify_all();
                    desired
                }
                Some(v) => {
                    let current = v.clone();
                    return Ok(Reply::Ok(Enc::body().bytes(&current).finish()));
                }
            };
            Reply::Ok(Enc::body().bytes(after).finish())
        }
        Op::Wait => {
            let wanted = d.strings()?;
            let timeout = Duration::from_millis(d.u64()?);
            d.end()?;
            match wait_for(shared, &wanted, timeout) {
                Ok(_) => Reply::Ok(Vec::new()),
                Err(reply) => reply,
            }
        }
        Op::Check => {
            let wanted = d.strings()?;
            d.end()?;
            let keys = lock(&shared.keys);
            let all = wanted.iter().all(|k| keys.contains_key(k));
            Reply::Ok(Enc::body().u8(all.into()).finish())
        }
        Op::Delete => {
            let key = d.string()?;
            d.end()?;
            let existed = lock(&shared.keys).remove(&key).is_some();
            Reply::Ok(Enc::body().u8(existed.into()).finish())
        }
        Op::NumKeys => {
            d.end()?;
            let n = lock(&shared.keys).len();
            Reply::Ok(Enc::body().u64(n as u64).finish())
        }
    };
    Ok(reply)
}

/// Waits until every key in `wanted` is present, up to `timeout`; on timeout the keys still
/// missing, as a [`Reply::TimedOut`]; when the server stops, a [`Reply::Error`] that says so.
fn wait_for<'a>(
    shared: &'a Shared,
    wanted: &[String],
    timeout: Duration,
) -> std::result::Result<MutexGuard<'a, HashMap<String, Vec<u8>>>, Reply> {
    let deadline = deadline_after(timeout);
    let mut keys = lock(&shared.keys);
    loop {
        let missing: Vec<String> = wanted
            .iter()
            .filter(|k| !keys.contains_key(*k))
            .cloned()
            .collect();
        if missing.is_empty() {
            return Ok(keys);
        }
        if let Some(fatal) = lock(&shared.fatal).clone() {
            return Err(Reply::Error(format!(
                "the job cannot start: {fatal} (while keys {missing:?} were awaited)"
            )));
        }
        if shared.stop.load(Ordering::SeqCst) {
            return Err(Reply::Error(format!(
                "the server is stopping (rank 0's store was dropped) while keys {missing:?} \
                 were awaited"
            )));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Reply::TimedOut(missing));
        }
        keys = shared
            .changed
            .wait_timeout(keys, left.min(IDLE_POLL))
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

// ---------------------------------------------------------------------------------------------
// Framing and encoding.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Op {
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
}

impl Op {
    fn from_u8(v: u8) -> std::result::Result<Op, String> {
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
            other => return Err(format!("unknown operation code {other}")),
        })
    }
}

const REPLY_OK: u8 = 0;
const REPLY_ERROR: u8 = 1;
const REPLY_TIMED_OUT: u8 = 2;

/// A reply of the server.
#[derive(Debug)]
enum Reply {
    /// Success, with the operation's result.
    Ok(Vec<u8>),
    /// The request was refused, with the server's message.
    Error(String),
    /// A wait ran out; the keys still missing.
    TimedOut(Vec<String>),
}

impl Reply {
    fn encode(&self) -> Vec<u8> {
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
        }
    }

    fn decode(frame: Vec<u8>) -> std::result::Result<Reply, String> {
        let mut d = Dec::new(&frame);
        match d.u8()? {
            REPLY_OK => {
                let mut body = frame;
                body.drain(..1);
                Ok(Reply::Ok(body))
            }
            REPLY_ERROR => Ok(Reply::Error(d.string()?)),
            REPLY_TIMED_OUT => Ok(Reply::TimedOut(d.strings()?)),
            other => Err(format!("unknown reply status {other}")),
        }
    }

    /// The body of an `Ok` reply; anything else is an error of `op`.
    fn expect_ok(self, store: &TcpStore, op: &'static str) -> Result<Vec<u8>> {
        match self {
            Reply::Ok(body) => Ok(body),
            Reply::Error(msg) => Err(store.server_err(op, msg)),
            Reply::TimedOut(keys) => {
                Err(store.protocol(op, format!("unexpected timeout reply (keys {keys:?})")))
            }
        }
    }
}

struct Enc(Vec<u8>);

impl Enc {
    fn new(op: Op) -> Enc {
        Enc(vec![op as u8])
    }

    fn body() -> Enc {
        Enc(Vec::new())
    }

    fn u8(mut self, v: u8) -> Enc {
        self.0.push(v);
        self
    }

    fn u64(mut self, v: u64) -> Enc {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    fn i64(mut self, v: i64) -> Enc {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    fn bytes(mut self, v: &[u8]) -> Enc {
        // Lengths are checked against MAX_FRAME (< 4 GiB) before encoding.
        self.0.extend_from_slice(&(v.len() as u32).to_be_bytes());
        self.0.extend_from_slice(v);
        self
    }

    fn strs(mut self, v: &[&str]) -> Enc {
        self.0.extend_from_slice(&(v.len() as u32).to_be_bytes());
        for s in v {
            self = self.bytes(s.as_bytes());
        }
        self
    }

    fn finish(self) -> Vec<u8> {
        self.0
    }
}

struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    fn new(buf: &'a [u8]) -> Dec<'a> {
        Dec { buf, pos: 0 }
    }

    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
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

    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> std::result::Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }

    fn i64(&mut self) -> std::result::Result<i64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(i64::from_be_bytes(a))
    }

    fn bytes(&mut self) -> std::result::Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| "a key is not valid UTF-8".to_string())
    }

    fn strings(&mut self) -> std::result::Result<Vec<String>, String> {
        let n = self.u32()? as usize;
        // Each string takes at least 4 bytes: refuse counts the frame cannot hold.
        if n > (self.buf.len() - self.pos) / 4 {
            return Err(format!("message truncated: {n} keys announced"));
        }
        (0..n).map(|_| self.string()).collect()
    }

    fn end(&self) -> std::result::Result<(), String> {
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
enum FrameError {
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

fn write_frame(stream: &mut TcpStream, payload: &[u8]) -> io::Result<()> {
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
fn read_frame(
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

fn read_full(
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
fn read_some(
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The protected data (a map, a counter, idle sockets) stays consistent even if a holder
    // panicked: each update is a single call.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `now + d`, saturating far in the future instead of overflowing.
fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_round_trips() {
        let req = Enc::new(Op::Wait).strs(&["a", "bc", ""]).u64(7).finish();
        let mut d = Dec::new(&req);
        assert_eq!(d.u8().unwrap(), Op::Wait as u8);
        assert_eq!(d.strings().unwrap(), vec!["a", "bc", ""]);
        assert_eq!(d.u64().unwrap(), 7);
        d.end().unwrap();
        for reply in [
            Reply::Ok(vec![1, 2, 3]),
            Reply::Error("no".into()),
            Reply::TimedOut(vec!["k/1".into(), "k/2".into()]),
        ] {
            let back = Reply::decode(reply.encode()).unwrap();
            assert_eq!(format!("{back:?}"), format!("{reply:?}"));
        }
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        // Truncated fields, absurd counts, unknown codes.
        assert!(Dec::new(&[0, 0, 0, 9, 1]).bytes().is_err());
        assert!(Dec::new(&[255, 255, 255, 255]).strings().is_err());
        assert!(Op::from_u8(99).is_err());
        assert!(Reply::decode(vec![]).is_err());
        assert!(Reply::decode(vec![7]).is_err());
        let shared = Shared {
            keys: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            live_conns: Mutex::new(0),
            conns_done: Condvar::new(),
            open: Mutex::new(HashMap::new()),
            io_timeout: Duration::from_secs(1),
            rank: 0,
            world_size: 1,
            job_id: "test".into(),
            token: None,
            fatal: Mutex::new(None),
        };
        assert!(matches!(handle(&shared, &[]), Reply::Error(_)));
        assert!(matches!(
            handle(&shared, &[Op::Set as u8, 0, 0]),
            Reply::Error(_)
        ));
        let trailing = Enc::new(Op::NumKeys).u8(0).finish();
        assert!(matches!(handle(&shared, &trailing), Reply::Error(_)));
        // A counter over a non-integer value is refused, and overflow too.
        let set = Enc::new(Op::Set).bytes(b"k").bytes(b"x").finish();
        assert!(matches!(handle(&shared, &set), Reply::Ok(_)));
        let add = Enc::new(Op::Add).bytes(b"k").i64(1).finish();
        assert!(matches!(handle(&shared, &add), Reply::Error(m) if m.contains("not an integer")));
        let add = Enc::new(Op::Add).bytes(b"n").i64(i64::MAX).finish();
        assert!(matches!(handle(&shared, &add), Reply::Ok(_)));
        let add = Enc::new(Op::Add).bytes(b"n").i64(1).finish();
        assert!(matches!(handle(&shared, &add), Reply::Error(m) if m.contains("overflows")));
    }
}
