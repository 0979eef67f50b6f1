//! The client's side of our own protocol: connecting with retry and back-off, the greeting
//! (job id and token challenge-response), and one request's round trip.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::auth::{self, JobToken};
use crate::{CollectiveError, Result};

use super::torch_wire;
use super::wire::{deadline_after, lock, read_frame, write_frame, Dec, Enc, FrameError, Op, Reply};
use super::{
    StoreProtocol, TcpStore, CLIENT_LABEL, CONNECT_SLICE, MAGIC, MAX_BACKOFF, MAX_FRAME,
    REPLY_MARGIN, SERVER_LABEL,
};

impl TcpStore {
    /// Sends one request and reads its reply. `wait` is the server-side wait of the request,
    /// if any: the reply is awaited that long plus a margin; otherwise up to the store's timeout.
    pub(super) fn request(
        &self,
        op: &'static str,
        req: &[u8],
        wait: Option<Duration>,
    ) -> Result<Reply> {
        let reply_within = match wait {
            Some(w) => w.saturating_add(REPLY_MARGIN),
            None => self.inner.timeout,
        };
        let mut conn = self.take_conn(op)?;
        // The failure's text, and whether it says that the server went away.
        let result = write_frame(&mut conn, req)
            .map_err(|e| {
                let lost = server_gone(e.kind());
                (format!("sending the request failed: {e}"), lost)
            })
            .and_then(|()| {
                read_frame(&mut conn, Some(deadline_after(reply_within)), None).map_err(|e| match e
                {
                    FrameError::TimedOut => (format!("no reply within {reply_within:?}"), false),
                    FrameError::Closed | FrameError::Truncated | FrameError::Stopped => {
                        (e.to_string(), true)
                    }
                    FrameError::Io(ref io) => (e.to_string(), server_gone(io.kind())),
                    e => (e.to_string(), false),
                })
            })
            .and_then(|frame| Reply::decode(frame).map_err(|e| (format!("bad reply: {e}"), false)));
        match result {
            Ok(reply) => {
                lock(&self.inner.pool).push(conn);
                Ok(reply)
            }
            // The connection is in an unknown state: drop it.
            Err((e, lost)) => {
                let reason = format!(
                    "connection to the store server at {} (rank 0) failed: {e}",
                    self.inner.address
                );
                Err(if lost {
                    self.store_lost(op, reason)
                } else {
                    self.store_err(op, reason)
                })
            }
        }
    }

    /// Runs `f` on a connection to a PyTorch server (PyTorch's protocol), with a deadline of
    /// `wait` plus a margin when the query waits on the server, else of the store's timeout.
    pub(super) fn torch_call<T>(
        &self,
        op: &'static str,
        wait: Option<Duration>,
        f: impl FnOnce(&mut TcpStream, Instant) -> std::result::Result<T, String>,
    ) -> Result<T> {
        let within = match wait {
            Some(w) => w.saturating_add(REPLY_MARGIN),
            None => self.inner.timeout,
        };
        let mut conn = self.take_conn(op)?;
        let _ = conn.set_write_timeout(Some(within.max(Duration::from_millis(1))));
        match f(&mut conn, deadline_after(within)) {
            Ok(v) => {
                lock(&self.inner.pool).push(conn);
                Ok(v)
            }
            Err(e) => Err(self.store_err(
                op,
                format!(
                    "connection to the PyTorch store server at {} failed: {e}",
                    self.inner.address
                ),
            )),
        }
    }

    /// An idle connection, or a new one to the server.
    pub(super) fn take_conn(&self, op: &'static str) -> Result<TcpStream> {
        if let Some(conn) = lock(&self.inner.pool).pop() {
            return Ok(conn);
        }
        let deadline = deadline_after(self.inner.timeout);
        // This handle reached the server before: a refused or reset connection now means that
        // the server went away.
        let stream = TcpStream::connect_timeout(&self.inner.peer, self.inner.timeout)
            .map_err(|e| (e.to_string(), server_gone(e.kind())))
            .and_then(|s| {
                handshake(s, &self.inner.me, deadline)
                    .map(|(s, _)| s)
                    .map_err(|e| (e.message(), false))
            });
        stream.map_err(|(e, lost)| {
            let reason = format!(
                "cannot open another connection to the store server at {} ({}): {e}",
                self.inner.address, self.inner.peer
            );
            if lost {
                self.store_lost(op, reason)
            } else {
                self.store_err(op, reason)
            }
        })
    }

    pub(super) fn check_size(&self, op: &'static str, bytes: usize) -> Result<()> {
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

    pub(super) fn store_err(&self, op: &'static str, reason: String) -> CollectiveError {
        CollectiveError::Store {
            rank: self.inner.rank,
            op,
            reason,
        }
    }

    /// The server went away (see [`CollectiveError::StoreLost`]).
    pub(super) fn store_lost(&self, op: &'static str, reason: String) -> CollectiveError {
        CollectiveError::StoreLost {
            rank: self.inner.rank,
            op,
            reason,
        }
    }

    /// The server answered that it is stopping.
    pub(super) fn server_stopping(&self, op: &'static str, msg: String) -> CollectiveError {
        self.store_lost(
            op,
            format!("the store server at {} reports: {msg}", self.inner.address),
        )
    }

    pub(super) fn server_err(&self, op: &'static str, msg: String) -> CollectiveError {
        self.store_err(
            op,
            format!("the store server at {} reports: {msg}", self.inner.address),
        )
    }

    pub(super) fn protocol(&self, op: &'static str, e: String) -> CollectiveError {
        self.store_err(
            op,
            format!(
                "malformed reply from the store server at {}: {e}",
                self.inner.address
            ),
        )
    }
}
/// Whether a socket error on a connection to the server means that the server went away.
fn server_gone(kind: std::io::ErrorKind) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        kind,
        ConnectionRefused | ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof
    )
}

// ---------------------------------------------------------------------------------------------
// Connecting.

/// Connects to the server with retry and back-off until `timeout`; `known` skips resolution.
pub(super) fn connect_with_retry(
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
pub(super) struct Identity {
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) job_id: Option<String>,
    pub(super) token: Option<JobToken>,
    pub(super) protocol: StoreProtocol,
}

/// Why a greeting failed.
pub(super) enum HandshakeError {
    /// The other side refused (or failed to prove itself): final.
    Refused(String),
    /// The connection failed: worth another try.
    Failed(String),
}

impl HandshakeError {
    pub(super) fn message(self) -> String {
        match self {
            HandshakeError::Refused(m) | HandshakeError::Failed(m) => m,
        }
    }
}

/// Configures a fresh connection and runs the greeting: hello with a nonce; the server's nonce,
/// job id and proof; this client's proof; the server's verdict. Returns the server's job id.
pub(super) fn handshake(
    mut stream: TcpStream,
    me: &Identity,
    deadline: Instant,
) -> std::result::Result<(TcpStream, String), HandshakeError> {
    use HandshakeError::{Failed, Refused};
    if me.protocol == StoreProtocol::Torch {
        return match torch_wire::client_greeting(&mut stream, deadline) {
            Ok(()) => Ok((stream, me.job_id.clone().unwrap_or_else(|| "torch".into()))),
            Err(e) => Err(Failed(e)),
        };
    }
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
