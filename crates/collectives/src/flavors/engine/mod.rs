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

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fsdp_device::{with_element, AccessGuard, Buffer, DType, Device, HostStorage, Storage, Stream};

use self::algo::Chunks;
use super::check::{enqueue_collective, Access, Placement};
use super::common::{compare, OpDesc};
use crate::{CollectiveError, ReduceOp, Result, Work};

/// Why the description exchange or the data phase failed.
#[derive(Debug)]
pub(crate) enum DataError {
    Timeout { waiting_for: String },
    Departed { peer: usize, why: String },
    Aborted { reason: String },
    Protocol { reason: String },
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
    use super::tcp::wire::{decode_desc, encode_desc};
    let (n, r) = (world, rank);
    let mut descs: Vec<Option<OpDesc>> = vec![None; n];
    descs[r] = Some(own.clone());
    if n > 1 {
        send(r, &encode_desc(own))?;
    }
    for s in 1..n {
        let origin = (r + n - s) % n;
        let (got, bytes) = recv(origin)?;
        if got != origin {
            return Err(DataError::Protocol {
                reason: format!("expected the description of rank {origin}, got one of rank {got}"),
            });
        }
        let d = decode_desc(&bytes).map_err(|reason| DataError::Protocol {
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
    pub transport: Box<dyn Transport>,
    pub control: Arc<dyn Control>,
}

struct Core {
    rank: usize,
    world: usize,
    backend: &'static str,
    timeout: Duration,
    segment_bytes: usize,
    transport: Mutex<Box<dyn Transport>>,
    control: Arc<dyn Control>,
    /// Sequence number of the next collective, taken together with the enqueue.
    next_seq: Mutex<u64>,
}

impl Core {
    fn transport(&self) -> MutexGuard<'_, Box<dyn Transport>> {
        self.transport.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn seg_elems(&self, dtype: DType) -> usize {
        (self.segment_bytes / dtype.size_in_bytes()).max(1)
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
}

/// The outcome of a split's exchange: the sub-group this rank joins.
pub(crate) struct SplitPlan {
    /// The collective's sequence number in the parent group (unique per split).
    pub seq: u64,
    pub color: u32,
    pub new_rank: usize,
    pub new_world: usize,
}

impl Engine {
    pub fn new(parts: EngineParts) -> Engine {
        let stream = Stream::cpu_with_timeout(parts.stream_name, parts.timeout);
        Engine {
            core: Arc::new(Core {
                rank: parts.rank,
                world: parts.world,
                backend: parts.backend,
                timeout: parts.timeout,
                segment_bytes: parts.segment_bytes,
                transport: Mutex::new(parts.transport),
                control: parts.control,
                next_seq: Mutex::new(0),
            }),
            stream,
        }
    }

    pub fn rank(&self) -> usize {
        self.core.rank
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

    fn placement(&self) -> Placement {
        Placement::on(self.core.backend, Device::Cpu)
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
            return Err(CollectiveError::Aborted { rank, reason });
        }
        let (access, local_error) = match check {
            Ok(a) => (Some(a), None),
            Err(reason) => {
                desc.invalid = Some(reason.clone());
                (
                    None,
                    Some(CollectiveError::InvalidArgument { rank, op, reason }),
                )
            }
        };
        let task_core = core.clone();
        let work = enqueue_collective(
            &self.stream,
            &core.next_seq,
            rank,
            op,
            core.timeout,
            move |seq| run_collective(&task_core, seq, desc, access, body),
        )?;
        match local_error {
            Some(e) => Err(e),
            None => Ok(work),
        }
    }

    pub fn all_gather_base(&self, input: &Buffer, output: &Buffer) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let n = input.len();
        let mut desc = OpDesc::new("all_gather_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        let check = self.placement().all_gather_base(rank, world, input, output);
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let seg = self.core.seg_elems(input.dtype());
        let dtype = input.dtype();
        let body: Body = Box::new(move |t, guards, ctx, _| {
            let out = ptr(&guards[guards.len() - 1]);
            let chunks = Chunks::equal(world, n, seg);
            let own = if in_place {
                out.wrapping_add(chunks.start(rank) * dtype.size_in_bytes())
            } else {
                ptr(&guards[0])
            };
            // SAFETY: guards give this rank exclusive use of the output and shared use of the
            // input for the whole call; sizes were checked at issue time.
            with_element!(dtype, T => unsafe { algo::all_gather::<T>(t, ctx, own, out, &chunks) })
        });
        self.issue(desc, check, body)
    }

    pub fn reduce_scatter_base(
        &self,
        input: &Buffer,
        output: &Buffer,
        op: ReduceOp,
    ) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let n = output.len();
        let mut desc = OpDesc::new("reduce_scatter_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let check = self
            .placement()
            .reduce_scatter_base(rank, world, input, output);
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let seg = self.core.seg_elems(input.dtype());
        let dtype = input.dtype();
        let body: Body = Box::new(move |t, guards, ctx, _| {
            let inp = ptr(&guards[0]);
            let chunks = Chunks::equal(world, n, seg);
            let out = if in_place {
                inp.wrapping_add(chunks.start(rank) * dtype.size_in_bytes())
            } else {
                ptr(&guards[1])
            };
            // SAFETY: guards cover input (shared, or exclusive in place) and output (exclusive).
            with_element!(dtype, T => unsafe {
                algo::reduce_scatter::<T>(t, ctx, op, inp, out, &chunks)
            })
        });
        self.issue(desc, check, body)
    }

    pub fn all_reduce(&self, buf: &Buffer, op: ReduceOp) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let total = buf.len();
        let mut desc = OpDesc::new("all_reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.reduce = Some(op);
        let check = self.placement().all_reduce(buf);
        let seg = self.core.seg_elems(buf.dtype());
        let dtype = buf.dtype();
        let body: Body = Box::new(move |t, guards, ctx, _| {
            let p = ptr(&guards[0]);
            let chunks = Chunks::balanced(world, total, seg);
            let own = p.wrapping_add(chunks.start(rank) * dtype.size_in_bytes());
            // SAFETY: exclusive guard over the whole buffer; reduce-scatter in place, then
            // all-gather in place (each phase drains before the next).
            with_element!(dtype, T => unsafe {
                algo::reduce_scatter::<T>(t, ctx, op, p, own, &chunks)?;
                algo::all_gather::<T>(t, ctx, own, p, &chunks)
            })
        });
        self.issue(desc, check, body)
    }

    pub fn broadcast(&self, buf: &Buffer, root: usize) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let total = buf.len();
        let mut desc = OpDesc::new("broadcast");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.root = Some(root);
        let check = self.placement().broadcast(rank, world, buf, root);
        let seg = self.core.seg_elems(buf.dtype());
        let dtype = buf.dtype();
        let body: Body = Box::new(move |t, guards, ctx, _| {
            let p = ptr(&guards[0]);
            // SAFETY: the root only reads its buffer (shared guard); others own theirs.
            with_element!(dtype, T => unsafe { algo::broadcast::<T>(t, ctx, p, total, root, seg) })
        });
        self.issue(desc, check, body)
    }

    pub fn reduce(&self, buf: &Buffer, op: ReduceOp, root: usize) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let total = buf.len();
        let mut desc = OpDesc::new("reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.reduce = Some(op);
        desc.root = Some(root);
        let check = self.placement().reduce(rank, world, buf, root);
        let seg = self.core.seg_elems(buf.dtype());
        let dtype = buf.dtype();
        let body: Body = Box::new(move |t, guards, ctx, _| {
            let p = ptr(&guards[0]);
            // SAFETY: non-root ranks only read their buffer; the root owns its exclusively.
            with_element!(dtype, T => unsafe { algo::reduce::<T>(t, ctx, op, p, total, root, seg) })
        });
        self.issue(desc, check, body)
    }

    pub fn barrier(&self) -> Result<Work> {
        // The description exchange alone is the barrier: it completes once every rank posted.
        let body: Body = Box::new(|_, _, _, _| Ok(()));
        self.issue(OpDesc::new("barrier"), Ok(Access::none()), body)
    }

    pub fn all_gather(&self, input: &Buffer, outputs: &[Buffer]) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let sizes: Vec<usize> = outputs.iter().map(Buffer::len).collect();
        let mut desc = OpDesc::new("all_gather");
        desc.dtype = Some(input.dtype());
        desc.count = input.len();
        desc.sizes = Some(sizes.clone());
        let check = self.placement().all_gather(rank, world, input, outputs);
        let dtype = input.dtype();
        let esz = dtype.size_in_bytes();
        let max = sizes.iter().copied().max().unwrap_or(0);
        let seg = self.core.seg_elems(dtype);
        let body: Body = Box::new(move |t, guards, ctx, _| {
            // Pad every input to the largest, all-gather base into one flat buffer, copy out.
            let tmp =
                HostStorage::zeroed(max * esz * (world + 1)).map_err(|e| DataError::Protocol {
                    reason: e.to_string(),
                })?;
            let padded_in = tmp.as_ptr();
            let flat = padded_in.wrapping_add(max * esz);
            // SAFETY: `tmp` is private to this task and sized for the padded input plus the flat
            // output; guards[0] is this rank's input of sizes[rank] elements.
            unsafe { copy(ptr(&guards[0]), padded_in, sizes[rank] * esz) };
            let chunks = Chunks::equal(world, max, seg);
            // SAFETY: as for all_gather_base, with private input and output.
            with_element!(dtype, T => unsafe {
                algo::all_gather::<T>(t, ctx, padded_in, flat, &chunks)
            })?;
            for (i, g) in guards[1..].iter().enumerate() {
                // SAFETY: exclusive guard over outputs[i] (sizes[i] elements); block i of the
                // flat buffer holds at least that many.
                unsafe { copy(flat.wrapping_add(i * max * esz), ptr(g), sizes[i] * esz) };
            }
            Ok(())
        });
        self.issue(desc, check, body)
    }

    /// The collective half of `split`: every rank posts `(color, key)`; returns the sub-group
    /// this rank joins (`None` for no color). The backend then builds it.
    pub fn split_plan(&self, color: Option<u32>, key: usize) -> Result<Option<SplitPlan>> {
        let rank = self.core.rank;
        let mut desc = OpDesc::new("split");
        desc.split = Some((color, key));
        let (tx, rx) = crossbeam_channel::bounded::<(u64, Vec<OpDesc>)>(1);
        let body: Body = Box::new(move |_, _, ctx, descs| {
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
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == rank)
            .ok_or_else(|| CollectiveError::Aborted {
                rank,
                reason: "split: this rank is missing from its own color".into(),
            })?;
        Ok(Some(SplitPlan {
            seq,
            color,
            new_rank,
            new_world: members.len(),
        }))
    }
}

/// Describe a failure of the exchange or the data phase as this crate's error, and abort the
/// group.
fn fail(core: &Core, op: &'static str, seq: u64, e: DataError) -> CollectiveError {
    let rank = core.rank;
    let err = match e {
        DataError::Timeout { waiting_for } => CollectiveError::Timeout {
            rank,
            op,
            seq,
            waited: core.timeout,
            waiting_for,
        },
        DataError::Departed { peer, why } => {
            tracing::debug!(rank, peer, %why, "ring: peer lost");
            match core.control.aborted() {
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
    core.control.abort(seq, err.to_string());
    err
}

/// The stream task of one collective: take the buffers, compare descriptions with the peers, move
/// the data.
fn run_collective(
    core: &Core,
    seq: u64,
    mut desc: OpDesc,
    access: Option<Access>,
    body: Body,
) -> Result<()> {
    let (rank, world, op) = (core.rank, core.world, desc.op);
    if let Some(reason) = core.control.aborted() {
        return Err(CollectiveError::Aborted { rank, reason });
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
    let descs = t
        .exchange(seq, &desc, deadline)
        .map_err(|e| fail(core, op, seq, e))?;
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

/// Pointer to a guard's first element.
fn ptr(g: &AccessGuard) -> *mut u8 {
    g.as_ptr()
}

/// Implement [`Communicator`](crate::Communicator) for a backend type wrapping an [`Engine`] in
/// its `engine` field; `$split` is its inherent split returning `Result<Option<Self>>`.
macro_rules! engine_communicator {
    ($ty:ty, $split:ident) => {
        impl $crate::Communicator for $ty {
            fn rank(&self) -> usize {
                self.engine.rank()
            }
            fn world_size(&self) -> usize {
                self.engine.world_size()
            }
            fn stream(&self) -> &fsdp_device::Stream {
                self.engine.stream()
            }
            fn all_gather_base(
                &self,
                input: &fsdp_device::Buffer,
                output: &fsdp_device::Buffer,
            ) -> $crate::Result<$crate::Work> {
                self.engine.all_gather_base(input, output)
            }
            fn reduce_scatter_base(
                &self,
                input: &fsdp_device::Buffer,
                output: &fsdp_device::Buffer,
                op: $crate::ReduceOp,
            ) -> $crate::Result<$crate::Work> {
                self.engine.reduce_scatter_base(input, output, op)
            }
            fn all_reduce(
                &self,
                buf: &fsdp_device::Buffer,
                op: $crate::ReduceOp,
            ) -> $crate::Result<$crate::Work> {
                self.engine.all_reduce(buf, op)
            }
            fn broadcast(
                &self,
                buf: &fsdp_device::Buffer,
                root: usize,
            ) -> $crate::Result<$crate::Work> {
                self.engine.broadcast(buf, root)
            }
            fn reduce(
                &self,
                buf: &fsdp_device::Buffer,
                op: $crate::ReduceOp,
                root: usize,
            ) -> $crate::Result<$crate::Work> {
                self.engine.reduce(buf, op, root)
            }
            fn barrier(&self) -> $crate::Result<$crate::Work> {
                self.engine.barrier()
            }
            fn all_gather(
                &self,
                input: &fsdp_device::Buffer,
                outputs: &[fsdp_device::Buffer],
            ) -> $crate::Result<$crate::Work> {
                self.engine.all_gather(input, outputs)
            }
            fn split(
                &self,
                color: Option<u32>,
                key: usize,
            ) -> $crate::Result<Option<Box<dyn $crate::Communicator>>> {
                Ok(self
                    .$split(color, key)?
                    .map(|c| Box::new(c) as Box<dyn $crate::Communicator>))
            }
        }
    };
}
pub(crate) use engine_communicator;
