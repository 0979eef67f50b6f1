//! The ring backend: ranks are threads of one process, the project's embedded default.
//!
//! [`new_group`] returns one [`RingCommunicator`] per rank; move each into its own thread. Each
//! communicator owns a CPU worker [`Stream`] (its communication stream) that runs the collectives
//! in issue order with real ring algorithms: all-gather in N-1 steps passing one block to the
//! neighbour, reduce-scatter in N-1 steps reducing as it goes, all-reduce as reduce-scatter then
//! all-gather, broadcast and reduce as pipelined chains; large messages are cut into segments that
//! are pipelined so that moving and reducing overlap (Gloo's and NCCL's segmented rings). Every
//! reduction follows a fixed order, so results are bitwise identical on every rank and in every
//! run.
//!
//! ```
//! use fsdp_collectives::{ring, Communicator, ReduceOp};
//! use fsdp_device::Buffer;
//!
//! let sums = ring::run_ranks(3, ring::RingOptions::default(), |comm| {
//!     let buf = Buffer::from_slice(&[comm.rank() as f32 + 1.0; 4]).unwrap();
//!     comm.all_reduce(&buf, ReduceOp::Sum).unwrap().wait().unwrap();
//!     buf.to_vec::<f32>().unwrap()
//! })
//! .unwrap();
//! assert!(sums.iter().all(|v| v == &vec![6.0; 4]));
//! ```

mod algo;
mod board;

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use fsdp_device::{
    with_element, AccessGuard, Buffer, DType, Device, HostStorage, Storage, Stream, DEFAULT_TIMEOUT,
};

use self::algo::{Chunks, Ctx, DataError};
use self::board::{Board, ExchangeFail, OpDesc, PendingSplit};
use super::check::{enqueue_collective, Access, Placement};
use crate::{CollectiveError, Communicator, ReduceOp, Result, Work};

/// Options of a ring group.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RingOptions {
    /// Bound of every wait: for peers to reach a collective, for data, for buffers to become
    /// free, and the default of [`Work::wait`]. Default: [`DEFAULT_TIMEOUT`] (300 s).
    pub timeout: Duration,
    /// Bytes per pipelined segment (rounded down to whole elements; at least one element).
    /// Default 512 KiB.
    pub segment_bytes: usize,
    /// Scratch slots per rank for partial reductions (at least 2). Default 4.
    pub slots: usize,
}

impl Default for RingOptions {
    fn default() -> Self {
        RingOptions {
            timeout: DEFAULT_TIMEOUT,
            segment_bytes: 512 << 10,
            slots: 4,
        }
    }
}

impl RingOptions {
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
}

/// An address published to the successor. Only dereferenced under the protocol of `algo`.
#[derive(Clone, Copy, Debug)]
struct SendPtr(*const u8);
// SAFETY: the pointer is only an address in transit; the receiving thread dereferences it under
// the publication protocol documented in `algo` (published memory is not written until the
// receiver acknowledges it, and outlives every acknowledgement).
unsafe impl Send for SendPtr {}

#[derive(Debug)]
struct Msg {
    seq: u64,
    ptr: SendPtr,
    bytes: usize,
}

#[derive(Debug)]
enum Ack {
    /// The oldest unacknowledged segment of collective `.0` has been read.
    Done(#[allow(dead_code)] u64),
    /// The sender gave up on collective `.0` and will not read anything more.
    Released(#[allow(dead_code)] u64),
}

/// A rank's channel endpoints in its ring.
pub(crate) struct Links {
    to_next: Sender<Msg>,
    from_prev: Receiver<Msg>,
    ack_to_prev: Sender<Ack>,
    acks_from_next: Receiver<Ack>,
}

fn make_links(world: usize) -> Vec<Links> {
    let data: Vec<(Sender<Msg>, Receiver<Msg>)> = (0..world).map(|_| unbounded()).collect();
    let acks: Vec<(Sender<Ack>, Receiver<Ack>)> = (0..world).map(|_| unbounded()).collect();
    // data[r]: r -> r+1.   acks[r]: r+1 -> r.
    (0..world)
        .map(|r| {
            let prev = (r + world - 1) % world;
            Links {
                to_next: data[r].0.clone(),
                from_prev: data[prev].1.clone(),
                ack_to_prev: acks[prev].0.clone(),
                acks_from_next: acks[r].1.clone(),
            }
        })
        .collect()
}

/// What the communication thread of one rank owns.
struct Runtime {
    links: Links,
    scratch: HostStorage,
}

struct RankShared {
    rank: usize,
    world: usize,
    opts: RingOptions,
    board: Arc<Board>,
    runtime: Mutex<Runtime>,
    /// Sequence number of the next collective, taken together with the enqueue.
    next_seq: Mutex<u64>,
}

impl Drop for RankShared {
    fn drop(&mut self) {
        self.board.depart(self.rank);
    }
}

impl RankShared {
    fn runtime(&self) -> MutexGuard<'_, Runtime> {
        self.runtime.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn seg_elems(&self, dtype: DType) -> usize {
        (self.opts.segment_bytes / dtype.size_in_bytes()).max(1)
    }
}

/// One rank of a ring group. Not `Sync`: use it from one thread (its collectives run on its own
/// communication stream).
pub struct RingCommunicator {
    shared: Arc<RankShared>,
    stream: Stream,
}

impl fmt::Debug for RingCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RingCommunicator(rank {}/{})",
            self.shared.rank, self.shared.world
        )
    }
}

/// Create a group of `world_size` ranks: element `r` of the result is rank `r`.
pub fn new_group(world_size: usize, opts: RingOptions) -> Result<Vec<RingCommunicator>> {
    let invalid = |reason: String| CollectiveError::InvalidArgument {
        rank: 0,
        op: "ring::new_group",
        reason,
    };
    if world_size == 0 {
        return Err(invalid("world size must be at least 1".into()));
    }
    if opts.slots < 2 {
        return Err(invalid(format!(
            "slots = {} (at least 2 are needed)",
            opts.slots
        )));
    }
    if opts.segment_bytes == 0 {
        return Err(invalid("segment_bytes must be positive".into()));
    }
    let board = Arc::new(Board::new(world_size));
    make_links(world_size)
        .into_iter()
        .enumerate()
        .map(|(rank, links)| {
            RingCommunicator::from_parts(rank, world_size, opts.clone(), board.clone(), links)
        })
        .collect()
}

/// Run `f` on every rank of a new group, one thread per rank, and collect the results in rank
/// order. A panic in any rank is propagated once every thread has finished.
pub fn run_ranks<R: Send>(
    world_size: usize,
    opts: RingOptions,
    f: impl Fn(RingCommunicator) -> R + Sync,
) -> Result<Vec<R>> {
    let comms = new_group(world_size, opts)?;
    let f = &f;
    Ok(std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::Builder::new()
                    .name(format!("rank{}", c.rank()))
                    .spawn_scoped(s, move || f(c))
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    }))
}

type Body =
    Box<dyn FnOnce(&mut Ctx<'_>, &[AccessGuard]) -> std::result::Result<(), DataError> + Send>;

impl RingCommunicator {
    fn from_parts(
        rank: usize,
        world: usize,
        opts: RingOptions,
        board: Arc<Board>,
        links: Links,
    ) -> Result<RingCommunicator> {
        let slot_bytes = opts.segment_bytes.next_multiple_of(fsdp_device::HOST_ALIGN);
        let scratch = if world > 2 {
            HostStorage::zeroed(slot_bytes * opts.slots)
        } else {
            HostStorage::zeroed(0)
        }
        .map_err(|source| CollectiveError::Device { rank, source })?;
        let stream = Stream::cpu_with_timeout(format!("ring-comm:{rank}/{world}"), opts.timeout);
        Ok(RingCommunicator {
            shared: Arc::new(RankShared {
                rank,
                world,
                opts,
                board,
                runtime: Mutex::new(Runtime { links, scratch }),
                next_seq: Mutex::new(0),
            }),
            stream,
        })
    }

    /// The options of the group.
    pub fn options(&self) -> &RingOptions {
        &self.shared.opts
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
        if let Some(reason) = shared.board.aborted() {
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
        Placement::on("ring", Device::Cpu)
    }
}

/// Describe a failed exchange as this crate's error (and abort the group when peers are lost).
fn exchange_error(
    shared: &RankShared,
    op: &'static str,
    seq: u64,
    fail: ExchangeFail,
) -> CollectiveError {
    let rank = shared.rank;
    match fail {
        ExchangeFail::Timeout { missing, waited } => {
            let waiting_for = format!(
                "rank{} {missing:?} did not reach this collective",
                if missing.len() == 1 { "" } else { "s" }
            );
            shared.board.abort(format!(
                "rank {rank} timed out in {op} (collective #{seq}): {waiting_for}"
            ));
            CollectiveError::Timeout {
                rank,
                op,
                seq,
                waited,
                waiting_for,
            }
        }
        ExchangeFail::Departed { peer } => {
            shared.board.abort(format!(
                "rank {peer} left the group before collective #{seq}"
            ));
            CollectiveError::PeerDeparted {
                rank,
                peer,
                op,
                seq,
            }
        }
        ExchangeFail::Aborted { reason } => CollectiveError::Aborted { rank, reason },
    }
}

fn data_error(shared: &RankShared, op: &'static str, seq: u64, e: DataError) -> CollectiveError {
    let rank = shared.rank;
    let err = match e {
        DataError::Timeout { waiting_for } => CollectiveError::Timeout {
            rank,
            op,
            seq,
            waited: shared.opts.timeout,
            waiting_for,
        },
        DataError::Departed { peer } => CollectiveError::PeerDeparted {
            rank,
            peer,
            op,
            seq,
        },
        DataError::Aborted { reason } => CollectiveError::Aborted { rank, reason },
        DataError::Protocol { reason } => CollectiveError::Aborted {
            rank,
            reason: format!("protocol error in {op} (collective #{seq}): {reason}"),
        },
    };
    shared.board.abort(err.to_string());
    err
}

/// The stream task of one collective: take the buffers, compare descriptions with the peers, move
/// the data.
fn run_collective(
    shared: &RankShared,
    seq: u64,
    mut desc: OpDesc,
    access: Option<Access>,
    body: Body,
) -> Result<()> {
    let (rank, world, op) = (shared.rank, shared.world, desc.op);
    let timeout = shared.opts.timeout;
    // One budget for the whole collective: buffers, rendezvous and data.
    let deadline = Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
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
    let descs = shared
        .board
        .exchange(rank, seq, desc, left())
        .map_err(|f| exchange_error(shared, op, seq, f))?;
    if let Some(why) = local_failure {
        return Err(CollectiveError::Device {
            rank,
            source: fsdp_device::DeviceError::Timeout {
                what: format!("access to the buffers of {op}: {why}"),
                waited: timeout,
            },
        });
    }
    board::compare(&descs).map_err(|details| CollectiveError::Mismatch { rank, seq, details })?;
    let mut rt = shared.runtime();
    let Runtime { links, scratch } = &mut *rt;
    let mut ctx = Ctx::new(
        rank,
        world,
        seq,
        left(),
        &shared.board,
        links,
        scratch.as_ptr(),
        shared
            .opts
            .segment_bytes
            .next_multiple_of(fsdp_device::HOST_ALIGN),
        shared.opts.slots,
        descs,
    );
    let body_ctx = &mut ctx;
    let result = body(body_ctx, &guards);
    match result {
        Ok(()) => Ok(()),
        Err(e) => {
            let err = data_error(shared, op, seq, e);
            if !ctx.release(timeout) {
                // A peer may still read these buffers: leak them rather than free them under it.
                std::mem::forget(guards);
                tracing::error!(
                    rank,
                    seq,
                    "peer did not release this rank's buffers; leaking them"
                );
            }
            Err(err)
        }
    }
}

/// Pointer to a guard's first element.
fn ptr(g: &AccessGuard) -> *mut u8 {
    g.as_ptr()
}

impl Communicator for RingCommunicator {
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
        let body: Body = Box::new(move |ctx, guards| {
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
        let body: Body = Box::new(move |ctx, guards| {
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
        let body: Body = Box::new(move |ctx, guards| {
            let p = ptr(&guards[0]);
            let chunks = Chunks::balanced(world, total, seg);
            let own = p.wrapping_add(chunks.start(rank) * dtype.size_in_bytes());
            // SAFETY: exclusive guard over the whole buffer; reduce-scatter in place, then
            // all-gather in place (each phase drains its acknowledgements before the next).
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
        let body: Body = Box::new(move |ctx, guards| {
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
        let body: Body = Box::new(move |ctx, guards| {
            let p = ptr(&guards[0]);
            // SAFETY: non-root ranks only read their buffer; the root owns its exclusively.
            with_element!(dtype, T => unsafe { algo::reduce::<T>(ctx, op, p, total, root, seg) })
        });
        self.issue(desc, check, body)
    }

    fn barrier(&self) -> Result<Work> {
        let body: Body = Box::new(|_, _| Ok(()));
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
        let body: Body = Box::new(move |ctx, guards| {
            // Pad every input to the largest, all-gather base into one flat buffer, copy out.
            let tmp =
                HostStorage::zeroed(max * esz * (world + 1)).map_err(|e| DataError::Protocol {
                    reason: e.to_string(),
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
            .split_ring(color, key)?
            .map(|c| Box::new(c) as Box<dyn Communicator>))
    }
}

impl RingCommunicator {
    /// [`Communicator::split`] returning the concrete type.
    pub fn split_ring(&self, color: Option<u32>, key: usize) -> Result<Option<RingCommunicator>> {
        let rank = self.shared.rank;
        let mut desc = OpDesc::new("split");
        desc.split = Some((color, key));
        let (tx, rx) = crossbeam_channel::bounded::<Result<Option<RingCommunicator>>>(1);
        let opts = self.shared.opts.clone();
        let board = self.shared.board.clone();
        // The split runs as a collective whose body builds the sub-group from the exchanged
        // (color, key) pairs.
        let body: Body = Box::new(move |ctx, _| {
            let result = build_split(ctx, &board, opts, color, rank);
            let _ = tx.send(result);
            Ok(())
        });
        let work = self.issue_split(desc, body)?;
        let waited = work.wait();
        match rx.try_recv() {
            Ok(r) => r,
            Err(_) => Err(waited.err().unwrap_or(CollectiveError::Aborted {
                rank,
                reason: "split ended without a result".into(),
            })),
        }
    }

    fn issue_split(&self, desc: OpDesc, body: Body) -> Result<Work> {
        self.issue(desc, Ok(Access::none()), body)
    }
}

/// Build (or join) the sub-group of `color` after the split's exchange.
fn build_split(
    ctx: &Ctx<'_>,
    board: &Board,
    opts: RingOptions,
    color: Option<u32>,
    rank: usize,
) -> Result<Option<RingCommunicator>> {
    let Some(color) = color else {
        return Ok(None);
    };
    let descs = ctx.exchanged_descs();
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
        .expect("this rank is a member of its own color");
    let (sub_board, links) = board.with_split(
        (ctx.seq, color),
        || PendingSplit {
            board: Arc::new(Board::new(new_world)),
            links: make_links(new_world).into_iter().map(Some).collect(),
        },
        |p| (p.board.clone(), p.links[new_rank].take()),
    );
    let links = links.expect("each member takes its links once");
    RingCommunicator::from_parts(new_rank, new_world, opts, sub_board, links).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank that fails in the middle of the data phase (after its peers published addresses
    /// into their buffers) aborts the group; every rank returns an error quickly and the
    /// release handshake lets each free its buffers.
    #[test]
    fn failure_during_data_phase_aborts_and_releases() {
        let opts = RingOptions::default()
            .with_timeout(Duration::from_secs(20))
            .with_segment_bytes(16);
        let comms = new_group(3, opts).unwrap();
        let results: Vec<(Result<()>, Duration)> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    s.spawn(move || {
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
                        let body: Body = Box::new(move |ctx, guards| {
                            if rank == 1 {
                                return Err(DataError::Protocol {
                                    reason: "injected failure".into(),
                                });
                            }
                            let chunks = Chunks::equal(3, 64, 4);
                            // SAFETY: guards held as in all_gather_base.
                            unsafe {
                                algo::all_gather::<f32>(
                                    ctx,
                                    ptr(&guards[0]),
                                    ptr(&guards[1]),
                                    &chunks,
                                )
                            }
                        });
                        let r = comm.issue(desc, Ok(access), body).and_then(|w| w.wait());
                        // The group is aborted for every later call.
                        assert!(matches!(
                            comm.barrier(),
                            Err(CollectiveError::Aborted { .. })
                        ));
                        (r, t0.elapsed())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (r, took)) in results.iter().enumerate() {
            let err = r.as_ref().unwrap_err();
            assert!(
                err.to_string().contains("injected failure"),
                "rank {rank}: {err}"
            );
            assert!(*took < Duration::from_secs(3), "rank {rank} took {took:?}");
        }
    }
}
