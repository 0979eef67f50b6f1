//! The store's server: the listener, one thread per connection, the greeting of our own
//! clients (PyTorch clients are served by [`super::torch_wire`]), and the requests.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::auth::{self, JobToken};
use crate::{CollectiveError, Result};

use super::torch_wire;
use super::wire::{deadline_after, lock, read_frame, write_frame, Dec, Enc, FrameError, Op, Reply};
use super::{StoreOptions, CLIENT_LABEL, DROP_GRACE, IDLE_POLL, MAGIC, POLL, SERVER_LABEL};
// ---------------------------------------------------------------------------------------------
// The server.

pub(super) struct Shared {
    pub(super) keys: Mutex<HashMap<String, Vec<u8>>>,
    pub(super) changed: Condvar,
    pub(super) stop: AtomicBool,
    pub(super) live_conns: Mutex<usize>,
    pub(super) conns_done: Condvar,
    /// A handle to every open connection, to shut them down when the server stops.
    pub(super) open: Mutex<HashMap<u64, TcpStream>>,
    pub(super) io_timeout: Duration,
    /// The server's rank and world size, the job's id and token.
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) job_id: String,
    pub(super) token: Option<JobToken>,
    /// Set when a rank of this job was refused for a reason that dooms the job (another
    /// WORLD_SIZE): every wait then fails at once with it.
    pub(super) fatal: Mutex<Option<String>>,
}

pub(super) struct Server {
    pub(super) shared: Arc<Shared>,
    pub(super) addr: SocketAddr,
    pub(super) acceptor: Option<JoinHandle<()>>,
}

impl Server {
    pub(super) fn start(opts: &StoreOptions) -> Result<Server> {
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

pub(super) fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
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
pub(super) struct ConnGuard(Arc<Shared>, u64);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        lock(&self.0.open).remove(&self.1);
        let mut live = lock(&self.0.live_conns);
        *live = live.saturating_sub(1);
        self.0.conns_done.notify_all();
    }
}

pub(super) fn serve_connection(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    let configured = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_nodelay(true))
        .and_then(|()| stream.set_write_timeout(Some(shared.io_timeout)));
    if let Err(e) = configured {
        tracing::warn!(%peer, error = %e, "store server cannot configure a connection");
        return;
    }
    match peek_start(&mut stream, shared) {
        Some(first) if torch_wire::looks_like_torch(&first) => {
            torch_wire::serve(stream, peer, shared);
            return;
        }
        Some(_) => {}
        None => return,
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

/// The first two bytes of a connection, without consuming them; `None` when the client left,
/// the server stopped, or nothing came within the I/O timeout.
fn peek_start(stream: &mut TcpStream, shared: &Shared) -> Option<[u8; 2]> {
    let deadline = deadline_after(shared.io_timeout);
    let mut buf = [0u8; 2];
    let _ = stream.set_read_timeout(Some(IDLE_POLL));
    while !shared.stop.load(Ordering::SeqCst) && Instant::now() < deadline {
        match stream.peek(&mut buf) {
            Ok(0) => return None,
            Ok(2) => return Some(buf),
            // One byte so far: give the second a moment.
            Ok(_) => std::thread::sleep(Duration::from_millis(1)),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => return None,
        }
    }
    None
}

/// The server's side of the greeting (see [`handshake`]); `false` when the client was
/// refused (told why, and logged with its address).
pub(super) fn server_greeting(stream: &mut TcpStream, peer: SocketAddr, shared: &Shared) -> bool {
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
pub(super) fn handle(shared: &Shared, frame: &[u8]) -> Reply {
    match execute(shared, frame) {
        Ok(reply) => reply,
        Err(msg) => Reply::Error(msg),
    }
}

pub(super) fn execute(shared: &Shared, frame: &[u8]) -> std::result::Result<Reply, String> {
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
        Op::MultiGet => {
            let wanted = d.strings()?;
            let timeout = Duration::from_millis(d.u64()?);
            d.end()?;
            match wait_for(shared, &wanted, timeout) {
                Ok(keys) => {
                    let mut e = Enc::body().u32(wanted.len() as u32);
                    for k in &wanted {
                        e = e.bytes(&keys[k]);
                    }
                    Reply::Ok(e.finish())
                }
                Err(reply) => reply,
            }
        }
        Op::Append => {
            let key = d.string()?;
            let value = d.bytes()?;
            d.end()?;
            lock(&shared.keys)
                .entry(key)
                .or_default()
                .extend_from_slice(value);
            shared.changed.notify_all();
            Reply::Ok(Vec::new())
        }
        Op::MultiSet => {
            let n = d.u64()?;
            let mut pairs = Vec::new();
            for _ in 0..n {
                let key = d.string()?;
                pairs.push((key, d.bytes()?.to_vec()));
            }
            d.end()?;
            lock(&shared.keys).extend(pairs);
            shared.changed.notify_all();
            Reply::Ok(Vec::new())
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
/// missing, as a [`Reply::TimedOut`]; when the server stops, a [`Reply::Stopping`] that says so.
pub(super) fn wait_for<'a>(
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
            return Err(Reply::Stopping(format!(
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
