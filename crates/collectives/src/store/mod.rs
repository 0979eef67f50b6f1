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

mod client;
mod ops;
mod server;
#[cfg(test)]
mod tests;
mod torch_wire;
mod wire;

use std::fmt;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fsdp_device::DEFAULT_TIMEOUT;

use crate::auth::JobToken;
use crate::{CollectiveError, Result};

use client::{connect_with_retry, Identity};
use server::Server;

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
    /// The protocol this client speaks (default: [`StoreProtocol::Fsdp`]). The server always
    /// serves both.
    pub protocol: StoreProtocol,
    /// Prepended to every key this handle reads or writes (default [`TCPSTORE_KEY_PREFIX`],
    /// what PyTorch's `TCPStore` prepends, so that a key `k` is the same key for this handle and
    /// for a Python `TCPStore` on the same server).
    pub key_prefix: String,
}

/// What PyTorch's `TCPStore` prepends to every key (its `keyPrefix_`).
pub const TCPSTORE_KEY_PREFIX: &str = "/";

/// The wire protocol a client speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreProtocol {
    /// This crate's protocol: frames with status replies, a greeting with the job's id and the
    /// token's challenge-response, server-side waits with a deadline.
    Fsdp,
    /// PyTorch's `TCPStore` protocol (no authentication): to join a store that PyTorch hosts,
    /// e.g. torchrun's agent store. A handle with it cannot run the server.
    Torch,
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
            protocol: StoreProtocol::Fsdp,
            key_prefix: TCPSTORE_KEY_PREFIX.into(),
        }
    }

    /// These options with another client protocol.
    pub fn with_protocol(mut self, protocol: StoreProtocol) -> Self {
        self.protocol = protocol;
        self
    }

    /// These options with another key prefix (the whole prefix: include
    /// [`TCPSTORE_KEY_PREFIX`] to stay in PyTorch's key space).
    pub fn with_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
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
    /// Prepended to every key.
    key_prefix: String,
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
        if opts.is_server && opts.protocol == StoreProtocol::Torch {
            return Err(invalid(
                "a handle that speaks PyTorch's protocol joins a PyTorch server; it cannot run \
                 the server (ours serves PyTorch clients anyway)"
                    .into(),
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
            protocol: opts.protocol,
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
                key_prefix: opts.key_prefix,
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
}
