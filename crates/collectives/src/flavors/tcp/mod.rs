//! The tcp backend: ranks are processes — on one machine or several — connected by TCP sockets
//! in a ring, bootstrapped through the rendezvous [`TcpStore`]. What Gloo is to PyTorch: the
//! CPU backend of a multi-process run under `launch`.
//!
//! [`TcpCommunicator::new`] takes the rank and world size from the store; each rank binds a
//! listener on the interface that reaches the store (port 0), publishes its address in the store,
//! connects to its successor and accepts its predecessor. A handshake checks the group, world
//! size and ranks of both ends (a wrong connection is an error), and that both machines agree on
//! byte order and element sizes.
//!
//! The collectives are the ring backend's algorithms over the sockets — same chunks, same
//! segment-major pipelining, same reduction order — so results are **bitwise identical** to the
//! [`ring`](crate::ring) backend's for every operation and element type. As there, they run on
//! the communicator's CPU worker [`Stream`](fsdp_device::Stream) in issue order, the ranks compare descriptions of
//! each call before data moves (a difference fails every rank with the same
//! [`Mismatch`](CollectiveError::Mismatch)), and every wait is bounded by
//! [`TcpOptions::timeout`].
//!
//! Transport: `TCP_NODELAY`; messages are cut into segments of
//! [`segment_bytes`](TcpOptions::segment_bytes); a reader thread per connection drains the
//! predecessor's socket at all times, so all ranks sending at once cannot deadlock. Element data
//! is sent in native byte order (little-endian on every supported platform; the handshake
//! refuses a peer whose order or element sizes differ). A peer that dies or closes its socket
//! fails the others with [`PeerDeparted`](CollectiveError::PeerDeparted) or
//! [`Aborted`](CollectiveError::Aborted) naming it; after any failure the communicator is
//! aborted and every later call returns `Aborted`.
//!
//! # Protocol
//! - Store keys: `fsdp/tcp/instances/<rank>` (a counter: the k-th communicator a rank creates
//!   from the store joins group `g<k>`), `fsdp/tcp/<group>/addr/<rank>` (`ip:port` of the rank's
//!   listener, deleted once its predecessor has connected). A split of group `G` at its
//!   collective `#s` forms group `G.s.<color>` for each color.
//! - Handshake, connector to acceptor: magic, version, a byte-order probe, element sizes, world
//!   size, sender and receiver rank, group name; the acceptor answers "accepted" or why not.
//! - Frames: kind (description, data, abort), collective sequence number, origin rank, payload
//!   length, payload. Protocol integers are little-endian.
//!
//! # Example
//! In real use each rank is a process that meets the others through the store (under `launch`,
//! `MASTER_ADDR`, `MASTER_PORT`, `RANK` and `WORLD_SIZE` give the store's address and the rank):
//! ```no_run
//! use fsdp_collectives::store::{StoreOptions, TcpStore};
//! use fsdp_collectives::{tcp, Communicator, ReduceOp};
//! use fsdp_device::Buffer;
//!
//! let (rank, world) = (0, 2); // from the launcher's environment
//! let store = TcpStore::new(StoreOptions::new("10.0.0.1", 29500, rank, world))?;
//! let comm = tcp::TcpCommunicator::new(&store, tcp::TcpOptions::default())?;
//! let grads = Buffer::from_slice(&[1.0f32; 1024])?;
//! comm.all_reduce(&grads, ReduceOp::Avg)?.wait()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Several ranks as threads of one process, over loopback ([`run_local_ranks`], for tests and
//! examples):
//! ```
//! use fsdp_collectives::{tcp, Communicator, ReduceOp};
//! use fsdp_device::Buffer;
//!
//! // Three ranks as threads over loopback (in real use: one process per rank, see `new`).
//! let sums = tcp::run_local_ranks(3, tcp::TcpOptions::default(), |comm| {
//!     let buf = Buffer::from_slice(&[comm.rank() as f32 + 1.0; 4]).unwrap();
//!     comm.all_reduce(&buf, ReduceOp::Sum).unwrap().wait().unwrap();
//!     buf.to_vec::<f32>().unwrap()
//! })
//! .unwrap();
//! assert!(sums.iter().all(|v| v == &vec![6.0; 4]));
//! ```

mod connect;
mod link;
mod progress;
mod shm;
mod shm_map;
mod shm_region;
mod transport;
pub(crate) mod wire;

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use fsdp_device::DEFAULT_TIMEOUT;

use self::link::AbortState;
pub use self::shm_region::shared_bytes_received;
use self::transport::{Tcp, TcpControl};
use crate::flavors::engine::{engine_communicator, Control, Engine, EngineParts, Transport};
use crate::store::{StoreOptions, TcpStore};
use crate::{CollectiveError, Result};

/// Options of a tcp communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TcpOptions {
    /// Bound of every wait: connecting, peers reaching a collective, each socket read and write,
    /// buffers becoming free, and the default of [`Work::wait`](crate::Work::wait). Default: [`DEFAULT_TIMEOUT`]
    /// (300 s).
    pub timeout: Duration,
    /// Bytes per pipelined segment (rounded down to whole elements; at least one element).
    /// Default 512 KiB.
    pub segment_bytes: usize,
    /// The address this rank listens on for its predecessor. Default (`None`): the local address
    /// of the interface that routes to the store's host (loopback for a store on loopback).
    pub listen_ip: Option<IpAddr>,
    /// How the ranks' data moves. Default: [`ProcessTransport::Auto`].
    pub transport: ProcessTransport,
    /// Bound of connecting to the neighbours (communicator set-up), when it should differ from
    /// [`timeout`](Self::timeout) (`fsdp train --init-timeout`). Default: `None`, the timeout.
    pub connect_timeout: Option<Duration>,
}

/// The transport of a process group: the same ring engine moves the data either through shared
/// memory (processes of one node) or through TCP sockets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProcessTransport {
    /// `FSDP_TRANSPORT` (`shm` or `tcp`) if set; otherwise shared memory when every rank of the
    /// group runs on one node (the same `GROUP_RANK`, as `fsdp launch` sets it), TCP otherwise.
    #[default]
    Auto,
    /// TCP sockets (any hosts).
    Tcp,
    /// Shared memory under `/dev/shm` (ranks of one host).
    Shm,
}

impl ProcessTransport {
    /// `shm` or `tcp` (`Auto` has no name).
    pub fn name(self) -> &'static str {
        match self {
            ProcessTransport::Shm => "shm",
            _ => "tcp",
        }
    }
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            timeout: DEFAULT_TIMEOUT,
            segment_bytes: 512 << 10,
            listen_ip: None,
            transport: ProcessTransport::Auto,
            connect_timeout: None,
        }
    }
}

impl TcpOptions {
    /// These options with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These options with another segment size.
    pub fn with_segment_bytes(mut self, bytes: usize) -> Self {
        self.segment_bytes = bytes;
        self
    }

    /// These options with another transport.
    pub fn with_transport(mut self, transport: ProcessTransport) -> Self {
        self.transport = transport;
        self
    }

    /// These options with another bound of connecting (communicator set-up).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }

    /// These options with another listening address.
    pub fn with_listen_ip(mut self, ip: IpAddr) -> Self {
        self.listen_ip = Some(ip);
        self
    }
}

/// One rank of a tcp group: the ring engine over a process transport. Its
/// collectives run on its own communication stream in the order they were issued; every rank
/// must issue the same collectives in the same order (issue them from one thread, or order the
/// threads that do).
pub struct TcpCommunicator {
    engine: Engine,
    /// Name of the group, unique in the store (`g<k>` for the k-th group a rank creates from the
    /// store, `<parent>.<seq>.<color>` for a split).
    group: String,
    opts: TcpOptions,
    store: TcpStore,
    transport: ProcessTransport,
}

impl fmt::Debug for TcpCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TcpCommunicator(rank {}/{}, group {})",
            self.engine.rank(),
            self.engine.world_size(),
            self.group
        )
    }
}

/// Run `f` on every rank of a new tcp group over loopback, one thread per rank, and collect the
/// results in rank order: a store is hosted on `127.0.0.1` (a free port) for the rendezvous.
/// For tests and examples; real runs have one process per rank ([`TcpCommunicator::new`]).
/// A panic in any rank is propagated once every thread has finished.
pub fn run_local_ranks<T: Send>(
    world_size: usize,
    opts: TcpOptions,
    f: impl Fn(TcpCommunicator) -> T + Sync,
) -> Result<Vec<T>> {
    if world_size == 0 {
        return Err(CollectiveError::InvalidArgument {
            rank: 0,
            op: "tcp::run_local_ranks",
            reason: "world size must be at least 1".into(),
        });
    }
    let store_opts = |rank, port| {
        StoreOptions::new("127.0.0.1", port, rank, world_size).with_timeout(opts.timeout)
    };
    // The server lives until every rank is done (sub-groups rendezvous through it too).
    let server = TcpStore::new(store_opts(0, 0))?;
    let port = server.port();
    let f = &f;
    let opts = &opts;
    let server = &server;
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                std::thread::Builder::new()
                    .name(format!("tcp-rank{rank}"))
                    .spawn_scoped(s, move || {
                        let store = if rank == 0 {
                            server.clone()
                        } else {
                            TcpStore::new(store_opts(rank, port))?
                        };
                        let comm = TcpCommunicator::new(&store, opts.clone())?;
                        Ok(f(comm))
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    results.into_iter().collect()
}

impl TcpCommunicator {
    /// Join the group of every rank of `store`: rank and world size are the store's. Every rank
    /// must call it (the k-th call on each rank forms the k-th group). Blocks until this rank is
    /// connected to its neighbours, at most [`timeout`](TcpOptions::timeout).
    ///
    /// Errors: invalid options; a neighbour that never published its address or never connected
    /// ([`MissingRanks`](CollectiveError::MissingRanks) naming it); a refused handshake or a
    /// socket error ([`Backend`](CollectiveError::Backend) with backend `"tcp"`); store errors.
    pub fn new(store: &TcpStore, opts: TcpOptions) -> Result<TcpCommunicator> {
        let (rank, world) = (store.rank(), store.world_size());
        check_options(rank, &opts)?;
        let k = store.add(&format!("fsdp/tcp/instances/{rank}"), 1)?;
        TcpCommunicator::connect(store.clone(), format!("g{k}"), rank, world, opts)
    }

    fn connect(
        store: TcpStore,
        group: String,
        rank: usize,
        world: usize,
        opts: TcpOptions,
    ) -> Result<TcpCommunicator> {
        let kind = choose_transport(&store, &group, rank, world, opts.transport)?;
        // The backend errors name: the transport actually used.
        let backend = if kind == ProcessTransport::Shm && world > 1 {
            "shm"
        } else {
            "tcp"
        };
        let (transport, control): (Box<dyn Transport>, Arc<dyn Control>) = match kind {
            ProcessTransport::Shm if world > 1 => {
                let (t, c) = shm::connect(
                    &store,
                    &group,
                    rank,
                    world,
                    opts.segment_bytes,
                    opts.timeout,
                )?;
                (Box::new(t), Arc::new(c))
            }
            _ => {
                let abort = Arc::new(AbortState::default());
                let links =
                    connect::connect_ring(&store, &group, rank, world, &opts, abort.clone())?
                        .map(Arc::new);
                let control = TcpControl {
                    rank,
                    group: group.clone(),
                    abort,
                    links: links.clone(),
                };
                (Box::new(Tcp::new(rank, world, links)), Arc::new(control))
            }
        };
        tracing::debug!(rank, world, %group, transport = kind.name(), "communicator connected");
        let engine = Engine::new(EngineParts {
            rank,
            world,
            backend,
            stream_name: format!("{}-comm:{rank}/{world}", kind.name()),
            timeout: opts.timeout,
            segment_bytes: opts.segment_bytes,
            device: fsdp_device::Device::Cpu,
            transport,
            control,
            root_group: !group.contains('.'),
            group: group.clone(),
            progress: Some(Arc::new(progress::StoreProgress::new(
                &store, &group, rank, world,
            ))),
        });
        Ok(TcpCommunicator {
            engine,
            group,
            opts,
            store,
            transport: kind,
        })
    }

    /// The transport this group's data moves over (`Shm` or `Tcp`).
    pub fn transport(&self) -> ProcessTransport {
        self.transport
    }

    /// The options of the group.
    pub fn options(&self) -> &TcpOptions {
        &self.opts
    }

    /// The group's name in the store (unique per group; sub-groups extend their parent's).
    pub fn group_name(&self) -> &str {
        &self.group
    }

    /// Why the communicator was aborted, if it was.
    pub fn aborted(&self) -> Option<String> {
        self.engine.aborted()
    }
}

/// Resolve [`ProcessTransport::Auto`]: `FSDP_TRANSPORT`, else shared memory when every rank
/// posts the same node (`GROUP_RANK`) to the store.
fn choose_transport(
    store: &TcpStore,
    group: &str,
    rank: usize,
    world: usize,
    asked: ProcessTransport,
) -> Result<ProcessTransport> {
    if asked != ProcessTransport::Auto {
        return Ok(asked);
    }
    match std::env::var("FSDP_TRANSPORT").ok().as_deref() {
        Some("shm") => return Ok(ProcessTransport::Shm),
        Some("tcp") => return Ok(ProcessTransport::Tcp),
        Some(other) if !other.is_empty() => {
            return Err(CollectiveError::InvalidArgument {
                rank,
                op: "tcp::TcpCommunicator::new",
                reason: format!("FSDP_TRANSPORT={other:?} (expected shm or tcp)"),
            })
        }
        _ => {}
    }
    // Ranks not started by a launcher (no node identity) talk TCP, as they always did.
    let node = std::env::var("GROUP_RANK").unwrap_or_default();
    if world == 1 || node.is_empty() {
        return Ok(ProcessTransport::Tcp);
    }
    store.set(&format!("fsdp/tcp/{group}/node/{rank}"), node.as_bytes())?;
    let mut same = true;
    for r in 0..world {
        let theirs = store.get(&format!("fsdp/tcp/{group}/node/{r}"))?;
        same &= theirs == node.as_bytes();
    }
    Ok(if same {
        ProcessTransport::Shm
    } else {
        ProcessTransport::Tcp
    })
}

fn check_options(rank: usize, opts: &TcpOptions) -> Result<()> {
    let invalid = |reason: String| CollectiveError::InvalidArgument {
        rank,
        op: "tcp::TcpCommunicator::new",
        reason,
    };
    if opts.segment_bytes == 0 {
        return Err(invalid("segment_bytes must be positive".into()));
    }
    if opts.timeout.is_zero() {
        return Err(invalid("the timeout must be positive".into()));
    }
    Ok(())
}

impl TcpCommunicator {
    /// [`Communicator::split`](crate::Communicator::split) returning the concrete type. The ranks
    /// exchange `(color, key)` as a collective on this group; the members of each color then
    /// connect a new ring through the store, under a name unique to this group, this split and
    /// the color.
    pub fn split_tcp(&self, color: Option<u32>, key: usize) -> Result<Option<TcpCommunicator>> {
        let rank = self.engine.rank();
        let Some(plan) = self.engine.split_plan(color, key)? else {
            return Ok(None);
        };
        let group = format!("{}.{}.{}", self.group, plan.seq, plan.color);
        TcpCommunicator::connect(
            self.store.clone(),
            group,
            plan.new_rank,
            plan.new_world,
            self.opts.clone(),
        )
        .map(Some)
        .map_err(|e| retag_rank(e, rank))
    }
}

engine_communicator!(TcpCommunicator, split_tcp);

/// Errors of connecting a sub-group carry the sub-group rank; report this group's rank instead,
/// naming the sub-group rank in the text where it matters.
fn retag_rank(e: CollectiveError, rank: usize) -> CollectiveError {
    match e {
        CollectiveError::MissingRanks {
            missing,
            waited,
            what,
            ..
        } => CollectiveError::MissingRanks {
            rank,
            missing,
            waited,
            what: format!("{what} (ranks of the new sub-group)"),
        },
        CollectiveError::Backend {
            backend,
            op,
            reason,
            ..
        } => CollectiveError::Backend {
            rank,
            backend,
            op,
            reason,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flavors::engine::test_fault::faulty_all_gather;
    use crate::Communicator;
    use std::time::Instant;

    /// A rank that stalls in the middle of the data phase (after the description exchange): its
    /// successor times out naming the data it waited for, the abort travels around the ring,
    /// every rank fails within about one timeout, and the group stays aborted.
    #[test]
    #[cfg_attr(miri, ignore = "Miri does not support sockets")]
    fn stall_in_the_data_phase_times_out_naming_the_data() {
        let timeout = Duration::from_millis(400);
        let opts = TcpOptions::default()
            .with_timeout(timeout)
            .with_segment_bytes(16);
        let res = run_local_ranks(3, opts, |comm| {
            let t0 = Instant::now();
            let stall = || {
                std::thread::sleep(Duration::from_millis(1200));
                Ok(())
            };
            let r = faulty_all_gather(
                &comm.engine,
                "tcp",
                comm.rank(),
                comm.world_size(),
                1,
                stall,
                Duration::from_secs(5),
            );
            let took = t0.elapsed();
            assert!(matches!(
                comm.barrier(),
                Err(CollectiveError::Aborted { .. })
            ));
            (r, took)
        })
        .unwrap();
        // Rank 2 waits for rank 1's data and times out (or, if rank 0 timed out a moment
        // earlier, gets its notice); rank 0 waits for rank 2's; rank 1 learns of the abort from
        // the notice that went round the ring while it stalled. Every message names the data
        // that did not arrive.
        let timeouts = res
            .iter()
            .filter(|(r, _)| matches!(r, Err(CollectiveError::Timeout { .. })))
            .count();
        assert!(timeouts >= 1, "{res:?}");
        assert!(
            matches!(&res[1].0, Err(CollectiveError::Aborted { .. })),
            "rank 1: {:?}",
            res[1].0
        );
        for (rank, (r, took)) in res.iter().enumerate() {
            let err = r.as_ref().unwrap_err();
            assert!(
                err.to_string().contains("data from rank"),
                "rank {rank}: {err}"
            );
            let bound = if rank == 1 { 3000 } else { 1500 };
            assert!(
                *took < Duration::from_millis(bound),
                "rank {rank} took {took:?}"
            );
        }
    }
}
