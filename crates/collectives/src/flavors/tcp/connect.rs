//! Building a rank's ring connections through the store.
//!
//! Each rank binds a listener (port 0), publishes `ip:port` under `fsdp/tcp/<group>/addr/<rank>`,
//! connects to its successor and sends its hello without waiting, then accepts its predecessor,
//! checks its hello and answers, and finally reads its successor's answer. Writing the hello
//! before accepting is what keeps a ring of ranks that all connect first from waiting on each
//! other. Every step is bounded by one deadline.
//!
//! Then both sides prove that they know the job's token ([`crate::auth`]; an empty key when the
//! job has none): the connector's hello carries a nonce, the acceptor's answer carries its own
//! nonce and its HMAC over both, the connector checks it and answers with its HMAC, and the
//! acceptor's last byte accepts or refuses it. The context of each HMAC names the group, the
//! world and the two ranks, so a proof cannot be replayed on another link. A link whose peer
//! fails to prove itself is refused, and the refusal is logged with the peer's address.

use std::io::{self, Read};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::link::{read_by, write_all_by, AbortState, Links};
use super::wire::{self, Hello};
use super::TcpOptions;
use crate::auth::{self, JobToken, NONCE_BYTES, TAG_BYTES};
use crate::store::TcpStore;
use crate::{CollectiveError, Result};

/// How often an idle accept looks again.
const ACCEPT_POLL: Duration = Duration::from_millis(2);

const ACCEPTOR_LABEL: &str = "fsdp-link/acceptor-proof";
const CONNECTOR_LABEL: &str = "fsdp-link/connector-proof";

/// What the link's proofs are bound to: the group, its size and the link's direction.
fn link_context(group: &str, world: usize, from: usize, to: usize) -> String {
    format!("{group}/{world}/{from}->{to}")
}

fn read_array<const N: usize>(s: &mut TcpStream, deadline: Instant) -> io::Result<[u8; N]> {
    read_by(s, deadline)?;
    let mut a = [0u8; N];
    s.read_exact(&mut a)?;
    Ok(a)
}

fn addr_key(group: &str, rank: usize) -> String {
    format!("fsdp/tcp/{group}/addr/{rank}")
}

/// The local address of the interface that routes to the store's host: the address other ranks
/// can reach this one on, if they can reach the store. Loopback when nothing better is known.
fn listen_ip(store: &TcpStore, opts: &TcpOptions) -> IpAddr {
    if let Some(ip) = opts.listen_ip {
        return ip;
    }
    let routed = || -> io::Result<IpAddr> {
        let target = store
            .address()
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::other("the store's address did not resolve"))?;
        if target.ip().is_loopback() {
            return Ok(target.ip());
        }
        let any: SocketAddr = if target.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        // A UDP "connect" sends nothing; it only picks the route and thereby the local address.
        let probe = UdpSocket::bind(any)?;
        probe.connect(target)?;
        Ok(probe.local_addr()?.ip())
    };
    match routed() {
        Ok(ip) if !ip.is_unspecified() => ip,
        _ => Ipv4Addr::LOCALHOST.into(),
    }
}

/// Connect `rank` of the ring `group` of `world` ranks; `None` for a group of one.
pub(crate) fn connect_ring(
    store: &TcpStore,
    group: &str,
    rank: usize,
    world: usize,
    opts: &TcpOptions,
    abort: Arc<AbortState>,
) -> Result<Option<Links>> {
    if world == 1 {
        return Ok(None);
    }
    let timeout = opts.connect_timeout.unwrap_or(opts.timeout);
    let token: Option<JobToken> = store.job_token().cloned();
    let token = token.as_ref();
    let deadline = Instant::now() + timeout;
    let next = (rank + 1) % world;
    let prev = (rank + world - 1) % world;
    let backend = |op: &'static str, reason: String| CollectiveError::Backend {
        rank,
        backend: "tcp",
        op,
        reason,
    };

    let ip = listen_ip(store, opts);
    let listener = TcpListener::bind((ip, 0))
        .map_err(|e| backend("bind", format!("cannot listen on {ip} (port 0): {e}")))?;
    let my_addr = listener
        .local_addr()
        .map_err(|e| backend("bind", e.to_string()))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| backend("bind", e.to_string()))?;
    store.set(&addr_key(group, rank), my_addr.to_string().as_bytes())?;

    // The successor's address.
    let key = addr_key(group, next);
    let left = deadline.saturating_duration_since(Instant::now());
    let next_addr = match store.get_timeout(&key, left) {
        Ok(v) => v,
        Err(CollectiveError::Store {
            op: "get", reason, ..
        }) if reason.contains("did not appear") => {
            return Err(CollectiveError::MissingRanks {
                rank,
                missing: vec![next],
                waited: timeout,
                what: format!(
                    "key {key} in the store (the listening address of rank {next}, group {group})"
                ),
            })
        }
        Err(e) => return Err(e),
    };
    let next_addr: SocketAddr = std::str::from_utf8(&next_addr)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            backend(
                "connect",
                format!("key {key} holds {next_addr:?}, not a socket address"),
            )
        })?;

    // Connect and say hello (without waiting for the answer).
    let mut to_next = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(CollectiveError::MissingRanks {
                rank,
                missing: vec![next],
                waited: timeout,
                what: format!("rank {next} to accept a connection at {next_addr} (group {group})"),
            });
        }
        match TcpStream::connect_timeout(&next_addr, left) {
            Ok(s) => break s,
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                std::thread::sleep(ACCEPT_POLL.min(left));
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => continue,
            Err(e) => {
                return Err(backend(
                    "connect",
                    format!("connecting to rank {next} at {next_addr}: {e}"),
                ))
            }
        }
    };
    let hello = Hello {
        group: group.to_string(),
        world: world as u64,
        from: rank as u64,
        to: next as u64,
    };
    let cnonce = auth::nonce();
    write_all_by(
        &mut to_next,
        &[hello.encode(), cnonce.to_vec()].concat(),
        deadline,
    )
    .map_err(|e| {
        backend(
            "connect",
            format!("sending the handshake to rank {next} at {next_addr}: {e}"),
        )
    })?;

    // Accept the predecessor and check who it is.
    let mut from_prev = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(CollectiveError::MissingRanks {
                        rank,
                        missing: vec![prev],
                        waited: timeout,
                        what: format!("a connection from rank {prev} to {my_addr} (group {group})"),
                    });
                }
                std::thread::sleep(ACCEPT_POLL);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(backend("accept", format!("on {my_addr}: {e}"))),
        }
    };
    let peer = from_prev
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "an unknown address".into());
    from_prev
        .set_nonblocking(false)
        .map_err(|e| backend("accept", e.to_string()))?;
    read_by(&from_prev, deadline).map_err(|e| backend("accept", e.to_string()))?;
    let expected = Hello {
        group: group.to_string(),
        world: world as u64,
        from: prev as u64,
        to: rank as u64,
    };
    let mut prev_nonce = [0u8; NONCE_BYTES];
    let refusal = match Hello::read(&mut from_prev).and_then(|h| {
        match from_prev.read_exact(&mut prev_nonce) {
            Ok(()) => Ok(h),
            Err(e) => Err(format!("reading the handshake's nonce: {e}")),
        }
    }) {
        Err(why) => Some(why),
        Ok(h) if h != expected => Some(format!(
            "expected rank {prev} of group {group} (world {world}) connecting to rank {rank}, \
             got rank {} of group {} (world {}) connecting to rank {}",
            h.from, h.group, h.world, h.to
        )),
        Ok(_) => None,
    };
    let snonce = auth::nonce();
    let prev_ctx = link_context(group, world, prev, rank);
    let mut answer = wire::encode_reply(refusal.as_deref());
    if refusal.is_none() {
        answer.extend_from_slice(&snonce);
        answer.extend_from_slice(&auth::tag(
            token,
            ACCEPTOR_LABEL,
            &[&prev_nonce, &snonce, prev_ctx.as_bytes()],
        ));
    }
    let _ = write_all_by(&mut from_prev, &answer, deadline);
    if let Some(why) = refusal {
        tracing::warn!(rank, %peer, reason = %why, "tcp: refused a data-link connection");
        return Err(backend(
            "accept",
            format!("refused the connection from {peer}: {why}"),
        ));
    }

    // The successor's answer.
    read_by(&to_next, deadline).map_err(|e| backend("connect", e.to_string()))?;
    match wire::read_reply(&mut to_next) {
        Ok(None) => {}
        Ok(Some(why)) => {
            return Err(backend(
                "connect",
                format!("rank {next} at {next_addr} refused the connection: {why}"),
            ))
        }
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            return Err(CollectiveError::MissingRanks {
                rank,
                missing: vec![next],
                waited: timeout,
                what: format!("rank {next} to answer the handshake (group {group})"),
            })
        }
        Err(e) => {
            return Err(backend(
                "connect",
                format!("reading the answer of rank {next} at {next_addr}: {e}"),
            ))
        }
    }
    // The successor's proof, and ours.
    let next_ctx = link_context(group, world, rank, next);
    let proved = read_array::<NONCE_BYTES>(&mut to_next, deadline)
        .and_then(|sn| read_array::<TAG_BYTES>(&mut to_next, deadline).map(|proof| (sn, proof)));
    let (next_nonce, next_proof) = proved.map_err(|e| {
        backend(
            "connect",
            format!("reading the proof of rank {next} at {next_addr}: {e}"),
        )
    })?;
    if !auth::verify(
        token,
        ACCEPTOR_LABEL,
        &[&cnonce, &next_nonce, next_ctx.as_bytes()],
        &next_proof,
    ) {
        tracing::warn!(rank, peer = %next_addr, "tcp: a data-link peer failed to prove the job token");
        return Err(backend(
            "connect",
            format!(
                "the listener at {next_addr} (rank {next}'s address) did not prove that it knows \
                 the job token: wrong or missing FSDP_JOB_TOKEN"
            ),
        ));
    }
    let my_proof = auth::tag(
        token,
        CONNECTOR_LABEL,
        &[&next_nonce, &cnonce, next_ctx.as_bytes()],
    );
    write_all_by(&mut to_next, &my_proof, deadline).map_err(|e| {
        backend(
            "connect",
            format!("sending the proof to rank {next} at {next_addr}: {e}"),
        )
    })?;
    // The predecessor's proof.
    let prev_proof = read_array::<TAG_BYTES>(&mut from_prev, deadline)
        .map_err(|e| backend("accept", format!("reading the proof of {peer}: {e}")))?;
    let prev_ok = auth::verify(
        token,
        CONNECTOR_LABEL,
        &[&snonce, &prev_nonce, prev_ctx.as_bytes()],
        &prev_proof,
    );
    let _ = write_all_by(&mut from_prev, &[u8::from(!prev_ok)], deadline);
    if !prev_ok {
        tracing::warn!(rank, %peer, "tcp: refused a data-link connection: wrong job token");
        return Err(backend(
            "accept",
            format!(
                "refused the connection from {peer}: it did not prove that it knows the job \
                 token (wrong or missing FSDP_JOB_TOKEN)"
            ),
        ));
    }
    // The successor's verdict on our proof.
    let verdict = read_array::<1>(&mut to_next, deadline).map_err(|e| {
        backend(
            "connect",
            format!("reading the verdict of rank {next} at {next_addr}: {e}"),
        )
    })?;
    if verdict[0] != 0 {
        return Err(backend(
            "connect",
            format!("rank {next} at {next_addr} refused the connection: wrong job token"),
        ));
    }
    // The predecessor has read our address (it connected): the key is no longer needed.
    let _ = store.delete_key(&addr_key(group, rank));

    let max_payload = opts.segment_bytes.max(8) + (1 << 20) + world * 16;
    Links::start(rank, to_next, from_prev, abort, max_payload)
        .map_err(|e| backend("connect", format!("starting the connection reader: {e}")))
        .map(Some)
}
