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
//! the communicator's CPU worker [`Stream`] in issue order, the ranks compare descriptions of
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

mod algo;
mod connect;
mod link;
mod wire;

use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fsdp_device::{
    with_element, AccessGuard, Buffer, DType, Device, Storage, Stream, DEFAULT_TIMEOUT,
};

use self::algo::{Ctx, DataError};
use self::link::{AbortState, Links};
use crate::flavors::check::{enqueue_collective, Access, Placement};
use crate::flavors::common::{compare, Chunks, OpDesc};
use crate::store::{StoreOptions, TcpStore};
use crate::{CollectiveError, Communicator, ReduceOp, Result, Work};

/// Options of a tcp communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TcpOptions {
    /// Bound of every wait: connecting, peers reaching a collective, each socket read and write,
    /// buffers becoming free, and the default of [`Work::wait`]. Default: [`DEFAULT_TIMEOUT`]
    /// (300 s).
    pub timeout: Duration,
    /// Bytes per pipelined segment (rounded down to whole elements; at least one element).
    /// Default 512 KiB.
    pub segment_bytes: usize,
    /// The address this rank listens on for its predecessor. Default (`None`): the local address
    /// of the interface that routes to the store's host (loopback for a store on loopback).
    pub listen_ip: Option<IpAddr>,
    /// Bound of connecting to the neighbours (communicator set-up), when it should differ from
    /// [`timeout`](Self::timeout) (`fsdp train --init-timeout`). Default: `None`, the timeout.
    pub connect_timeout: Option<Duration>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            timeout: DEFAULT_TIMEOUT,
            segment_bytes: 512 << 10,
            listen_ip: None,
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

struct Shared {
    rank: usize,
    world: usize,
    /// Name of the group, unique in the store (`g<k>` for the k-th group a rank creates from the
    /// store, `<parent>.<seq>.<color>` for a split).
    group: String,
    opts: TcpOptions,
    store: TcpStore,
    /// `None` for a group of one rank.
    links: Option<Links>,
    abort: Arc<AbortState>,
    /// Sequence number of the next collective, taken together with the enqueue.
    next_seq: Mutex<u64>,
}

impl Shared {
    fn seg_elems(&self, dtype: DType) -> usize {
        (self.opts.segment_bytes / dtype.size_in_bytes()).max(1)
    }

    /// Abort the group for `reason`: later calls fail, and the successor is told (it passes the
    /// notice on around the ring).
    fn abort(&self, seq: u64, reason: String) {
        if self.abort.set(reason.clone()) {
            tracing::warn!(rank = self.rank, group = %self.group, %reason, "tcp communicator aborted");
            if let Some(l) = &self.links {
                l.out().send_abort(seq, self.rank, &reason);
            }
        }
    }
}

/// One rank of a tcp group. Its collectives run on its own communication stream in the order
/// they were issued; every rank must issue the same collectives in the same order (issue them
/// from one thread, or order the threads that do).
pub struct TcpCommunicator {
    shared: Arc<Shared>,
    stream: Stream,
}

impl fmt::Debug for TcpCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TcpCommunicator(rank {}/{}, group {})",
            self.shared.rank, self.shared.world, self.shared.group
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

type Body = Box<
    dyn FnOnce(&Ctx<'_>, &[AccessGuard], &[OpDesc]) -> std::result::Result<(), DataError> + Send,
>;

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
        let abort = Arc::new(AbortState::default());
        let links = connect::connect_ring(&store, &group, rank, world, &opts, abort.clone())?;
        let stream = Stream::cpu_with_timeout(format!("tcp-comm:{rank}/{world}"), opts.timeout);
        tracing::debug!(rank, world, %group, "tcp communicator connected");
        Ok(TcpCommunicator {
            shared: Arc::new(Shared {
                rank,
                world,
                group,
                opts,
                store,
                links,
                abort,
                next_seq: Mutex::new(0),
            }),
            stream,
        })
    }

    /// The options of the group.
    pub fn options(&self) -> &TcpOptions {
        &self.shared.opts
    }

    /// The group's name in the store (unique per group; sub-groups extend their parent's).
    pub fn group_name(&self) -> &str {
        &self.shared.group
    }

    /// Why the communicator was aborted, if it was.
    pub fn aborted(&self) -> Option<String> {
        self.shared.abort.get()
    }

    fn invalid(&self, op: &'static str, reason: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            rank: self.shared.rank,
            op,
            reason,
        }
    }

    /// Issue a collective: take a sequence number, enqueue the task and return its work. When
    /// `check` failed, the task still posts the (invalid) description so that the peers fail at
    /// once instead of waiting, and the error is returned here.
    fn issue(
        &self,
        mut desc: OpDesc,
        check: std::result::Result<Access, String>,
        body: Body,
    ) -> Result<Work> {
        let shared = &self.shared;
        let (rank, op) = (shared.rank, desc.op);
        if let Some(reason) = shared.abort.get() {
            return Err(CollectiveError::Aborted { rank, reason });
        }
        let timeout = shared.opts.timeout;
        let (access, local_error) = match check {
            Ok(a) => (Some(a), None),
            Err(reason) => {
                desc.invalid = Some(reason.clone());
                (None, Some(self.invalid(op, reason)))
            }
        };
        let task_shared = shared.clone();
        let work = enqueue_collective(
            &self.stream,
            &shared.next_seq,
            rank,
            op,
            timeout,
            move |seq| run_collective(&task_shared, seq, desc, access, body),
        )?;
        match local_error {
            Some(e) => Err(e),
            None => Ok(work),
        }
    }

    /// Where this backend's buffers live.
    fn placement(&self) -> Placement {
        Placement::on("tcp", Device::Cpu)
    }
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

/// Describe a failure of the exchange or the data phase as this crate's error, and abort the
/// group.
fn fail(shared: &Shared, op: &'static str, seq: u64, e: DataError) -> CollectiveError {
    let rank = shared.rank;
    let err = match e {
        DataError::Timeout { waiting_for } => CollectiveError::Timeout {
            rank,
            op,
            seq,
            waited: shared.opts.timeout,
            waiting_for,
        },
        DataError::Departed { peer, why } => {
            tracing::debug!(rank, peer, %why, "tcp: peer connection lost");
            match shared.abort.get() {
                // The peer left because the group was aborted: report that.
                Some(reason) => CollectiveError::Aborted { rank, reason },
                None => CollectiveError::PeerDeparted {
                    rank,
                    peer,
                    op,
                    seq,
                },
            }
        }
        DataError::Aborted { reason } => CollectiveError::Aborted { rank, reason },
        DataError::Protocol { reason } => CollectiveError::Aborted {
            rank,
            reason: format!("protocol error in {op} (collective #{seq}): {reason}"),
        },
    };
    shared.abort(seq, err.to_string());
    err
}

/// The stream task of one collective: take the buffers, compare descriptions with the peers, move
/// the data.
fn run_collective(
    shared: &Shared,
    seq: u64,
    mut desc: OpDesc,
    access: Option<Access>,
    body: Body,
) -> Result<()> {
    let (rank, world, op) = (shared.rank, shared.world, desc.op);
    if let Some(reason) = shared.abort.get() {
        return Err(CollectiveError::Aborted { rank, reason });
    }
    let timeout = shared.opts.timeout;
    // One budget for the whole collective: buffers, description exchange and data.
    let deadline = Instant::now() + timeout;
    let mut local_failure = None;
    let guards = match access {
        Some(a) => match a.acquire(timeout) {
            Ok(g) => g,
            Err(why) => {
                desc.invalid = Some(format!("its buffers stayed busy: {why}"));
                local_failure = Some(why);
                Vec::new()
            }
        },
        None => Vec::new(),
    };
    let ctx = Ctx::new(rank, world, seq, deadline, shared.links.as_ref());
    let descs = ctx.exchange(&desc).map_err(|e| fail(shared, op, seq, e))?;
    if let Some(why) = local_failure {
        return Err(CollectiveError::Device {
            rank,
            source: fsdp_device::DeviceError::Timeout {
                what: format!("access to the buffers of {op}: {why}"),
                waited: timeout,
            },
        });
    }
    compare(&descs).map_err(|details| CollectiveError::Mismatch { rank, seq, details })?;
    body(&ctx, &guards, &descs).map_err(|e| fail(shared, op, seq, e))
}

/// Pointer to a guard's first element.
fn ptr(g: &AccessGuard) -> *mut u8 {
    g.as_ptr()
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn stream(&self) -> &Stream {
        &self.stream
    }

    fn all_gather_base(&self, input: &Buffer, output: &Buffer) -> Result<Work> {
        let (world, rank) = (self.shared.world, self.shared.rank);
        let n = input.len();
        let mut desc = OpDesc::new("all_gather_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        let check = self.placement().all_gather_base(rank, world, input, output);
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let seg = self.shared.seg_elems(input.dtype());
        let dtype = input.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            let out = ptr(&guards[guards.len() - 1]);
            let chunks = Chunks::equal(world, n, seg);
            let own = if in_place {
                out.wrapping_add(chunks.start(rank) * dtype.size_in_bytes())
            } else {
                ptr(&guards[0])
            };
            // SAFETY: guards give this rank exclusive use of the output and shared use of the
            // input for the whole call; sizes were checked at issue time.
            with_element!(dtype, T => unsafe { algo::all_gather::<T>(ctx, own, out, &chunks) })
        });
        self.issue(desc, check, body)
    }

    fn reduce_scatter_base(&self, input: &Buffer, output: &Buffer, op: ReduceOp) -> Result<Work> {
        let (world, rank) = (self.shared.world, self.shared.rank);
        let n = output.len();
        let mut desc = OpDesc::new("reduce_scatter_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let check = self
            .placement()
            .reduce_scatter_base(rank, world, input, output);
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let seg = self.shared.seg_elems(input.dtype());
        let dtype = input.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            let inp = ptr(&guards[0]);
            let chunks = Chunks::equal(world, n, seg);
            let out = if in_place {
                inp.wrapping_add(chunks.start(rank) * dtype.size_in_bytes())
            } else {
                ptr(&guards[1])
            };
            // SAFETY: guards cover input (shared, or exclusive in place) and output (exclusive).
            with_element!(dtype, T => unsafe { algo::reduce_scatter::<T>(ctx, op, inp, out, &chunks) })
        });
        self.issue(desc, check, body)
    }

    fn all_reduce(&self, buf: &Buffer, op: ReduceOp) -> Result<Work> {
        let (world, rank) = (self.shared.world, self.shared.rank);
        let total = buf.len();
        let mut desc = OpDesc::new("all_reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.reduce = Some(op);
        let check = self.placement().all_reduce(buf);
        let seg = self.shared.seg_elems(buf.dtype());
        let dtype = buf.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            let p = ptr(&guards[0]);
            let chunks = Chunks::balanced(world, total, seg);
            let own = p.wrapping_add(chunks.start(rank) * dtype.size_in_bytes());
            // SAFETY: exclusive guard over the whole buffer; reduce-scatter in place, then
            // all-gather in place — the ring backend's all-reduce, in the same order.
            with_element!(dtype, T => unsafe {
                algo::reduce_scatter::<T>(ctx, op, p, own, &chunks)?;
                algo::all_gather::<T>(ctx, own, p, &chunks)
            })
        });
        self.issue(desc, check, body)
    }

    fn broadcast(&self, buf: &Buffer, root: usize) -> Result<Work> {
        let rank = self.shared.rank;
        let total = buf.len();
        let mut desc = OpDesc::new("broadcast");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.root = Some(root);
        let check = self
            .placement()
            .broadcast(rank, self.shared.world, buf, root);
        let seg = self.shared.seg_elems(buf.dtype());
        let dtype = buf.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            let p = ptr(&guards[0]);
            // SAFETY: the root only reads its buffer (shared guard); others own theirs.
            with_element!(dtype, T => unsafe { algo::broadcast::<T>(ctx, p, total, root, seg) })
        });
        self.issue(desc, check, body)
    }

    fn reduce(&self, buf: &Buffer, op: ReduceOp, root: usize) -> Result<Work> {
        let rank = self.shared.rank;
        let total = buf.len();
        let mut desc = OpDesc::new("reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.reduce = Some(op);
        desc.root = Some(root);
        let check = self.placement().reduce(rank, self.shared.world, buf, root);
        let seg = self.shared.seg_elems(buf.dtype());
        let dtype = buf.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            let p = ptr(&guards[0]);
            // SAFETY: non-root ranks only read their buffer; the root owns its exclusively.
            with_element!(dtype, T => unsafe { algo::reduce::<T>(ctx, op, p, total, root, seg) })
        });
        self.issue(desc, check, body)
    }

    fn barrier(&self) -> Result<Work> {
        // The description exchange alone is the barrier: it completes once every rank posted.
        let body: Body = Box::new(|_, _, _| Ok(()));
        self.issue(OpDesc::new("barrier"), Ok(Access::none()), body)
    }

    fn all_gather(&self, input: &Buffer, outputs: &[Buffer]) -> Result<Work> {
        let (world, rank) = (self.shared.world, self.shared.rank);
        let sizes: Vec<usize> = outputs.iter().map(Buffer::len).collect();
        let mut desc = OpDesc::new("all_gather");
        desc.dtype = Some(input.dtype());
        desc.count = input.len();
        desc.sizes = Some(sizes.clone());
        let check = self.placement().all_gather(rank, world, input, outputs);
        let dtype = input.dtype();
        let esz = dtype.size_in_bytes();
        let max = sizes.iter().copied().max().unwrap_or(0);
        let seg = self.shared.seg_elems(dtype);
        let body: Body = Box::new(move |ctx, guards, _| {
            // Pad every input to the largest, all-gather base into one flat buffer, copy out.
            let tmp = fsdp_device::HostStorage::zeroed(max * esz * (world + 1)).map_err(|e| {
                DataError::Protocol {
                    reason: e.to_string(),
                }
            })?;
            let padded_in = tmp.as_ptr();
            let flat = padded_in.wrapping_add(max * esz);
            // SAFETY: `tmp` is private to this task and sized for the padded input plus the flat
            // output; guards[0] is this rank's input of sizes[rank] elements.
            unsafe { std::ptr::copy_nonoverlapping(ptr(&guards[0]), padded_in, sizes[rank] * esz) };
            let chunks = Chunks::equal(world, max, seg);
            // SAFETY: as for all_gather_base, with private input and output.
            with_element!(dtype, T => unsafe { algo::all_gather::<T>(ctx, padded_in, flat, &chunks) })?;
            for (i, g) in guards[1..].iter().enumerate() {
                // SAFETY: exclusive guard over outputs[i] (sizes[i] elements); block i of the
                // flat buffer holds at least that many.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        flat.wrapping_add(i * max * esz),
                        ptr(g),
                        sizes[i] * esz,
                    )
                };
            }
            Ok(())
        });
        self.issue(desc, check, body)
    }

    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Box<dyn Communicator>>> {
        Ok(self
            .split_tcp(color, key)?
            .map(|c| Box::new(c) as Box<dyn Communicator>))
    }
}

impl TcpCommunicator {
    /// [`Communicator::split`] returning the concrete type. The ranks exchange `(color, key)` as
    /// a collective on this group; the members of each color then connect a new ring through the
    /// store, under a name unique to this group, this split and the color.
    pub fn split_tcp(&self, color: Option<u32>, key: usize) -> Result<Option<TcpCommunicator>> {
        let rank = self.shared.rank;
        let mut desc = OpDesc::new("split");
        desc.split = Some((color, key));
        let (tx, rx) = crossbeam_channel::bounded::<(u64, Vec<OpDesc>)>(1);
        let body: Body = Box::new(move |ctx, _, descs| {
            let _ = tx.send((ctx.seq, descs.to_vec()));
            Ok(())
        });
        let work = self.issue(desc, Ok(Access::none()), body)?;
        work.wait()?;
        let (seq, descs) = rx.try_recv().map_err(|_| CollectiveError::Aborted {
            rank,
            reason: "split ended without a result".into(),
        })?;
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<(usize, usize)> = descs
            .iter()
            .enumerate()
            .filter_map(|(r, d)| match d.split {
                Some((Some(c), key)) if c == color => Some((key, r)),
                _ => None,
            })
            .collect();
        members.sort();
        let new_world = members.len();
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == rank)
            .ok_or_else(|| CollectiveError::Aborted {
                rank,
                reason: "split: this rank is missing from its own color".into(),
            })?;
        let group = format!("{}.{seq}.{color}", self.shared.group);
        TcpCommunicator::connect(
            self.shared.store.clone(),
            group,
            new_rank,
            new_world,
            self.shared.opts.clone(),
        )
        .map(Some)
        .map_err(|e| retag_rank(e, rank))
    }
}

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
            let world = comm.world_size();
            let input = Buffer::from_slice(&[1.0f32; 64]).unwrap();
            let output = Buffer::zeros(DType::F32, 64 * world).unwrap();
            let mut desc = OpDesc::new("all_gather_base");
            desc.dtype = Some(DType::F32);
            desc.count = 64;
            let access = comm
                .placement()
                .all_gather_base(comm.rank(), world, &input, &output)
                .unwrap();
            let rank = comm.rank();
            let body: Body = Box::new(move |ctx, guards, _| {
                if rank == 1 {
                    std::thread::sleep(Duration::from_millis(1200));
                }
                let chunks = Chunks::equal(3, 64, 4);
                // SAFETY: guards held as in all_gather_base.
                unsafe { algo::all_gather::<f32>(ctx, ptr(&guards[0]), ptr(&guards[1]), &chunks) }
            });
            let r = comm
                .issue(desc, Ok(access), body)
                .and_then(|w| w.wait_timeout(Duration::from_secs(5)));
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
