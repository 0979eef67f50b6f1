//! The ring engine: one core for every ring backend, over pluggable transports (rustls' shape:
//! one protocol, providers underneath).
//!
//! The engine owns everything the ring backends have in common — issuing a collective on the
//! communication stream, taking the buffers' guards, the validation exchange of call
//! descriptions, the schedule, segmentation and reduction order ([`algo`]), the error mapping and
//! the abort protocol. A [`Transport`] moves one segment at a time between a rank and its ring
//! neighbours:
//! - threads of one process ([`ring`](crate::ring)): the successor *pulls* published addresses,
//!   each byte crosses once;
//! - processes on one host (`shm`): slots in a shared mapping under `/dev/shm`, futex wake-ups,
//!   and cross-memory attach (`process_vm_readv`) for single-copy moves where the kernel allows;
//! - processes anywhere ([`tcp`](crate::tcp)): frames over TCP sockets.
//!
//! Since the schedule and the reduction kernels exist once, results are bitwise identical over
//! every transport by construction (chunk `c` of a reduction accumulates from rank `c + 1` around
//! the ring, the chunk's owner applying the final step).

pub(crate) mod algo;
mod chunks;
mod collectives;
mod communicator;
pub(crate) mod recorder;
pub(crate) mod schedule;
#[cfg(test)]
pub(crate) mod test_fault;

pub(crate) use self::communicator::engine_communicator;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fsdp_device::{AccessGuard, DType, Device, Stream};

use self::recorder::{FlightRecorder, ProgressBoard, RecorderParts};
use super::check::{enqueue_collective, Access, Placement};
use super::desc::{check_exchanged, OpDesc};
use crate::{CollectiveError, Result, Work};

/// Why the description exchange or the data phase failed.
#[derive(Debug)]
pub(crate) enum DataError {
    Timeout { waiting_for: String },
    Departed { peer: usize, why: String },
    Aborted { reason: String },
    Protocol { reason: String },
}

impl DataError {
    /// Rank `next` gave up on collective `seq` (its release message came), with the reason the
    /// group was `aborted` for when there is one.
    pub(crate) fn gave_up(next: usize, seq: u64, aborted: Option<String>) -> DataError {
        let gave_up = format!("rank {next} gave up on collective #{seq}");
        DataError::Aborted {
            reason: match aborted {
                Some(reason) => format!("{gave_up}: {reason}"),
                None => gave_up,
            },
        }
    }
}

/// How the ranks of a group learn that it was aborted. Shared between the communicator (which
/// checks it before issuing) and its transport.
pub(crate) trait Control: Send + Sync {
    /// Why the group was aborted, if it was.
    fn aborted(&self) -> Option<String>;
    /// Abort the group (the first reason wins) and tell the peers.
    fn abort(&self, seq: u64, reason: String);
}

/// Moves segments between a rank and its ring neighbours during one collective.
///
/// Contract of the data calls (what makes the engine's `unsafe` sound): memory passed to
/// [`send`](Transport::send) stays readable and unwritten until [`drain`](Transport::drain)
/// returned (or [`release`](Transport::release) returned true); the pointer given to a `recv`
/// closure is valid, aligned to 8 bytes at least, for the bytes asked for, during the call.
pub(crate) trait Transport: Send {
    /// Post this rank's description of collective `seq` and return every rank's, by rank.
    fn exchange(
        &mut self,
        seq: u64,
        own: &OpDesc,
        deadline: Instant,
    ) -> std::result::Result<Vec<OpDesc>, DataError>;

    /// Start the data phase of collective `seq`, bounded by `deadline`.
    fn begin(&mut self, seq: u64, deadline: Instant);

    /// Send `bytes` at `src` to the successor.
    ///
    /// # Safety
    /// `src` must be readable for `bytes` bytes and stay unwritten until `drain` (or a
    /// successful `release`).
    unsafe fn send(&mut self, src: *const u8, bytes: usize) -> std::result::Result<(), DataError>;

    /// Receive the predecessor's next segment (`bytes` long) and let `f` read it.
    fn recv(
        &mut self,
        bytes: usize,
        f: &mut dyn FnMut(*const u8),
    ) -> std::result::Result<(), DataError>;

    /// Receive the predecessor's next segment into `dst`.
    ///
    /// # Safety
    /// `dst` must be this rank's memory, writable for `bytes` bytes, accessed by no one else.
    unsafe fn recv_copy(
        &mut self,
        dst: *mut u8,
        bytes: usize,
    ) -> std::result::Result<(), DataError> {
        self.recv(bytes, &mut |p| {
            // SAFETY: `p` holds `bytes` received bytes; `dst` is ours (caller's contract).
            unsafe { copy(p, dst, bytes) }
        })
    }

    /// Receive the predecessor's next segment, let `f(received, out)` write `bytes` bytes into
    /// memory of the transport, and send that to the successor.
    fn recv_forward(
        &mut self,
        bytes: usize,
        f: &mut dyn FnMut(*const u8, *mut u8),
    ) -> std::result::Result<(), DataError>;

    /// Wait until the successor no longer needs anything this rank sent.
    fn drain(&mut self) -> std::result::Result<(), DataError>;

    /// After a failure: stop reading the predecessor's memory and wait (at most `grace`) until
    /// the successor stopped reading ours. False if that could not be established (the caller
    /// then leaks its buffers rather than free them under a reader).
    fn release(&mut self, grace: Duration) -> bool;

    /// Whether the peers read segments of
    /// [`SharedHostStorage`](fsdp_device::shared::SharedHostStorage) buffers in place.
    fn reads_shared_regions(&self) -> bool {
        false
    }
}

/// Copy `bytes` from `src` to `dst` (nothing if they are the same place).
///
/// # Safety
/// `src` readable and `dst` writable for `bytes` bytes, not overlapping unless equal, with no
/// concurrent writer.
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, bytes: usize) {
    if bytes > 0 && !std::ptr::eq(src, dst) {
        // SAFETY: guaranteed by the caller.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) }
    }
}

/// Sends an encoded description (with its origin) to the successor.
pub(crate) type SendDesc<'a> = dyn FnMut(usize, &[u8]) -> std::result::Result<(), DataError> + 'a;
/// Receives the predecessor's next description (given the origin expected): `(origin, bytes)`.
pub(crate) type RecvDesc<'a> =
    dyn FnMut(usize) -> std::result::Result<(usize, Vec<u8>), DataError> + 'a;

/// Pass every rank's description around the ring (for transports without a shared board):
/// `send(origin, bytes)` sends an encoded description to the successor, `recv()` returns the
/// predecessor's next one with its origin. Each rank sends its own before waiting for any, so a
/// rank that never arrives is the one every waiting rank misses first.
pub(crate) fn exchange_around_ring(
    rank: usize,
    world: usize,
    own: &OpDesc,
    send: &mut SendDesc<'_>,
    recv: &mut RecvDesc<'_>,
) -> std::result::Result<Vec<OpDesc>, DataError> {
    let (n, r) = (world, rank);
    let mut descs: Vec<Option<OpDesc>> = vec![None; n];
    descs[r] = Some(own.clone());
    if n > 1 {
        send(r, &own.encode())?;
    }
    for s in 1..n {
        let origin = (r + n - s) % n;
        let (got, bytes) = recv(origin)?;
        if got != origin {
            return Err(DataError::Protocol {
                reason: format!("expected the description of rank {origin}, got one of rank {got}"),
            });
        }
        let d = OpDesc::decode(&bytes).map_err(|reason| DataError::Protocol {
            reason: format!("description of rank {origin}: {reason}"),
        })?;
        descs[origin] = Some(d);
        if s + 1 < n {
            send(origin, &bytes)?;
        }
    }
    Ok(descs.into_iter().map(|d| d.expect("filled")).collect())
}

/// What the engine needs to set up a communicator.
pub(crate) struct EngineParts {
    pub rank: usize,
    pub world: usize,
    /// The backend's name, as errors show it (`ring`, `tcp`).
    pub backend: &'static str,
    /// The communication stream's name.
    pub stream_name: String,
    pub timeout: Duration,
    pub segment_bytes: usize,
    /// The device of the buffers the collectives take.
    pub device: Device,
    pub transport: Box<dyn Transport>,
    pub control: Arc<dyn Control>,
    /// The group's name (dumps of sub-groups carry it) and whether every rank starts with it.
    pub group: String,
    pub root_group: bool,
    /// Where the ranks publish their progress for the flight recorder.
    pub progress: Option<Arc<dyn ProgressBoard>>,
}

struct Core {
    rank: usize,
    world: usize,
    backend: &'static str,
    timeout: Duration,
    segment_bytes: usize,
    device: Device,
    transport: Mutex<Box<dyn Transport>>,
    control: Arc<dyn Control>,
    /// Sequence number of the next collective, taken together with the enqueue.
    next_seq: Mutex<u64>,
    recorder: Option<Arc<FlightRecorder>>,
}

impl Core {
    fn transport(&self) -> MutexGuard<'_, Box<dyn Transport>> {
        self.transport.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn seg_elems(&self, dtype: DType) -> usize {
        (self.segment_bytes / dtype.size_in_bytes()).max(1)
    }

    /// On the first failure: dump the flight recorder and return `reason` with what the dump
    /// found (the rank that is behind, where the dump is).
    fn dumped(&self, reason: String) -> String {
        match self.recorder.as_ref().and_then(|r| r.dump(&reason)) {
            Some(found) => format!("{reason}; {found}"),
            None => reason,
        }
    }

    /// The communicator was aborted: the error, after a dump.
    fn aborted_error(&self, reason: String) -> CollectiveError {
        CollectiveError::Aborted {
            rank: self.rank,
            reason: self.dumped(reason),
        }
    }
}

/// The body of a collective: runs on the stream with the transport and the buffers' guards.
pub(crate) type Body = Box<
    dyn FnOnce(
            &mut dyn Transport,
            &[AccessGuard],
            Ctx,
            &[OpDesc],
        ) -> std::result::Result<(), DataError>
        + Send,
>;

/// Who runs a collective body, and where.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ctx {
    pub rank: usize,
    pub world: usize,
    pub seq: u64,
}

/// One rank of a ring group over some transport: the backends wrap it.
pub(crate) struct Engine {
    core: Arc<Core>,
    stream: Stream,
    /// The transport's peers read shared host regions in place.
    shared_regions: bool,
}

impl Engine {
    pub fn new(parts: EngineParts) -> Engine {
        let stream = Stream::cpu_with_timeout(parts.stream_name, parts.timeout);
        let recorder = FlightRecorder::from_env(RecorderParts {
            rank: parts.rank,
            world: parts.world,
            backend: parts.backend,
            group: parts.group,
            root_group: parts.root_group,
            progress: parts.progress,
        });
        let shared_regions = parts.transport.reads_shared_regions();
        Engine {
            core: Arc::new(Core {
                rank: parts.rank,
                world: parts.world,
                backend: parts.backend,
                timeout: parts.timeout,
                segment_bytes: parts.segment_bytes,
                device: parts.device,
                transport: Mutex::new(parts.transport),
                control: parts.control,
                next_seq: Mutex::new(0),
                recorder,
            }),
            stream,
            shared_regions,
        }
    }

    /// Whether the transport's peers read shared host regions in place.
    pub fn reads_shared_regions(&self) -> bool {
        self.shared_regions
    }

    pub fn rank(&self) -> usize {
        self.core.rank
    }

    /// Aborts the group through the transport's control (which tells the peers), at the
    /// sequence number of the next collective.
    pub fn abort_handle(&self) -> crate::AbortHandle {
        let core = Arc::downgrade(&self.core);
        crate::AbortHandle::new(self.core.rank, move |reason| {
            if let Some(core) = core.upgrade() {
                let seq = *core.next_seq.lock().unwrap_or_else(|e| e.into_inner());
                core.control.abort(seq, reason);
            }
        })
    }

    pub fn world_size(&self) -> usize {
        self.core.world
    }

    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Why the group was aborted, if it was.
    pub fn aborted(&self) -> Option<String> {
        self.core.control.aborted()
    }

    pub(crate) fn placement(&self) -> Placement {
        Placement::on(self.core.backend, self.core.device)
    }

    /// Issue a collective: take a sequence number, enqueue the task and return its work. When
    /// `check` failed, the task still posts the (invalid) description so that the peers fail at
    /// once instead of waiting, and the error is returned here.
    pub fn issue(
        &self,
        mut desc: OpDesc,
        check: std::result::Result<Access, String>,
        body: Body,
    ) -> Result<Work> {
        let core = &self.core;
        let (rank, op) = (core.rank, desc.op);
        if let Some(reason) = core.control.aborted() {
            return Err(core.aborted_error(reason));
        }
        let (access, local_error) = desc.take_check(rank, check);
        if let Some(r) = &core.recorder {
            // The sequence number enqueue_collective takes (issues on one communicator are
            // serialised by its owner, which is `Send` but not `Sync`).
            let seq = *core.next_seq.lock().unwrap_or_else(|e| e.into_inner());
            r.scheduled(seq, &desc);
        }
        let task_core = core.clone();
        let work = enqueue_collective(
            &self.stream,
            &core.next_seq,
            rank,
            op,
            core.timeout,
            access,
            move |seq, access| run_collective(&task_core, seq, desc, access, body),
        )?;
        match local_error {
            Some(e) => Err(e),
            None => Ok(work),
        }
    }
}

/// Describe a failure of the exchange or the data phase as this crate's error, and abort the
/// group.
fn fail(core: &Core, op: &'static str, seq: u64, e: DataError) -> CollectiveError {
    let rank = core.rank;
    if let Some(r) = &core.recorder {
        // Failed before the dump below shows it.
        r.ended(seq, false);
    }
    let err = match e {
        DataError::Timeout { waiting_for } => CollectiveError::Timeout {
            rank,
            op,
            seq,
            waited: core.timeout,
            waiting_for: core.dumped(waiting_for),
        },
        DataError::Departed { peer, why } => {
            tracing::debug!(rank, peer, %why, "ring: peer lost");
            match core.control.aborted() {
                // The peer left because the group was aborted: report that.
                Some(reason) => core.aborted_error(reason),
                None => {
                    core.dumped(format!("rank {peer} left during {op} (collective #{seq})"));
                    CollectiveError::PeerDeparted {
                        rank,
                        peer,
                        op,
                        seq,
                    }
                }
            }
        }
        DataError::Aborted { reason } => core.aborted_error(reason),
        DataError::Protocol { reason } => core.aborted_error(format!(
            "protocol error in {op} (collective #{seq}): {reason}"
        )),
    };
    core.control.abort(seq, err.to_string());
    err
}

/// The stream task of one collective: take the buffers, compare descriptions with the peers, move
/// the data.
fn run_collective(
    core: &Core,
    seq: u64,
    desc: OpDesc,
    access: Option<Access>,
    body: Body,
) -> Result<()> {
    if let Some(r) = &core.recorder {
        r.started(seq, desc.op);
    }
    let out = run_started(core, seq, desc, access, body);
    if let Some(r) = &core.recorder {
        r.ended(seq, out.is_ok());
    }
    out
}

/// [`run_collective`] once it is recorded as started.
fn run_started(
    core: &Core,
    seq: u64,
    mut desc: OpDesc,
    access: Option<Access>,
    body: Body,
) -> Result<()> {
    let (rank, world, op) = (core.rank, core.world, desc.op);
    if let Some(reason) = core.control.aborted() {
        return Err(core.aborted_error(reason));
    }
    let timeout = core.timeout;
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
    let mut transport = core.transport();
    let t: &mut dyn Transport = &mut **transport;
    desc.seq = seq;
    let descs = t
        .exchange(seq, &desc, deadline)
        .map_err(|e| fail(core, op, seq, e))?;
    check_exchanged(rank, seq, &descs, local_failure, timeout)?;
    t.begin(seq, deadline);
    match body(t, &guards, Ctx { rank, world, seq }, &descs) {
        Ok(()) => Ok(()),
        Err(e) => {
            let err = fail(core, op, seq, e);
            if !t.release(timeout) {
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
