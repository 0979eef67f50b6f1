//! The backend-independent interface.

use std::fmt;
use std::sync::Arc;

use fsdp_device::{Buffer, Device, Stream};

use crate::{ReduceOp, Result, Work};

/// A group of ranks that run collectives together (NCCL's `ncclComm_t`, PyTorch's
/// `ProcessGroup`).
///
/// Every collective is *issued* by the call: arguments are checked on this rank (an error is
/// returned at once, and the peers are told so that they fail too instead of waiting), the buffers
/// are queued for access in program order, and the work is enqueued on the communicator's
/// [`stream`](Communicator::stream). The returned [`Work`] completes when the stream has run it.
/// Before any data moves, the ranks compare what they issued; a difference in operation, element
/// type, length, reduce op or root fails the collective on every rank with a
/// [`Mismatch`](crate::CollectiveError::Mismatch) naming the ranks and the calls.
///
/// Buffers are [`Buffer`]s of the backend's device. Semantics are NCCL's:
/// - `all_gather_base`: `output[r*n..(r+1)*n] = input` of rank `r`, with `n = input.len()`.
/// - `reduce_scatter_base`: `output = ⊕_i input_i[r*n..(r+1)*n]`, `n = output.len()`.
/// - `all_reduce`: every rank's `buf = ⊕_i buf_i`.
/// - `broadcast`: every rank's `buf = buf_root`.
/// - `reduce`: `buf_root = ⊕_i buf_i`; other ranks' buffers are unchanged.
pub trait Communicator: Send {
    /// This rank's index in the group, `0..world_size`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// The stream collectives are enqueued on.
    fn stream(&self) -> &Stream;

    /// The device this group's buffers live on. By default the [`stream`](Self::stream)'s; a
    /// group whose host thread issues work for a device says so (the CUDA ring: its
    /// collectives are ordered on a host worker stream and run on the rank's CUDA stream).
    fn device(&self) -> Device {
        self.stream().device()
    }

    /// Equal-size all-gather into one preallocated output of `world_size × input.len()`.
    fn all_gather_base(&self, input: &Buffer, output: &Buffer) -> Result<Work>;

    /// Equal-size reduce-scatter: `input.len() == world_size × output.len()`.
    fn reduce_scatter_base(&self, input: &Buffer, output: &Buffer, op: ReduceOp) -> Result<Work>;

    /// All-reduce in place.
    fn all_reduce(&self, buf: &Buffer, op: ReduceOp) -> Result<Work>;

    /// Broadcast `root`'s buffer to every rank, in place.
    fn broadcast(&self, buf: &Buffer, root: usize) -> Result<Work>;

    /// Reduce every rank's buffer into `root`'s, in place.
    fn reduce(&self, buf: &Buffer, op: ReduceOp, root: usize) -> Result<Work>;

    /// Complete once every rank has reached the barrier.
    fn barrier(&self) -> Result<Work>;

    /// All-gather of inputs whose lengths may differ across ranks: `outputs[i]` receives rank
    /// `i`'s input, so `outputs.len() == world_size` and `outputs[rank].len() == input.len()`.
    /// Implemented by padding every input to the largest length and running
    /// [`all_gather_base`](Communicator::all_gather_base) into a temporary buffer, then copying
    /// out — which is why equal-size collectives into one flat buffer are the fast path.
    fn all_gather(&self, input: &Buffer, outputs: &[Buffer]) -> Result<Work>;

    /// Split the group into sub-groups (`ncclCommSplit`): the ranks that pass the same `color`
    /// form a new group, ordered by `(key, rank)`; `None` joins no group. Every rank of this
    /// group must call it. Blocks until the split is done.
    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Box<dyn Communicator>>>;

    /// A handle that aborts this group from any thread, as `ncclCommAbort` does, with a reason
    /// its peers report: every rank's pending and later collectives fail with
    /// [`Aborted`](crate::CollectiveError::Aborted) naming it (for which
    /// [`caused_by_peer`](crate::CollectiveError::caused_by_peer) holds). `None` where the
    /// backend cannot tell its peers (the default; NCCL and MPI).
    fn abort_handle(&self) -> Option<AbortHandle> {
        None
    }

    /// Whether this group's peers read host buffers in place when they lie in
    /// [`SharedHostStorage`](fsdp_device::shared::SharedHostStorage) — the shared-memory
    /// transport of processes on one host does (one copy per hop instead of a cross-memory
    /// attach) — so that an owner of buffers it moves often (FSDP's engine) allocates them
    /// there, as NCCL users allocate with `ncclMemAlloc`. Default `false`.
    fn prefers_shared_host_memory(&self) -> bool {
        false
    }

    /// Whether collectives on stream-ordered buffers (`fsdp_device::Buffer::stream_ordered`,
    /// device memory used through `Buffer::use_on`) are ordered by their streams' events: the
    /// collective runs after the work that conflicts with it, and its end is recorded as the
    /// buffers' newest use. The ring engine's backends (threads, shared memory, TCP, the CUDA
    /// ring), MPI (its CPU stream waits) and NCCL (waits on the GPU) do (the conformance suite
    /// checks it on the host backends); a backend that does not may only be given such buffers
    /// once their work has completed. Default `false`.
    fn orders_stream_ordered_buffers(&self) -> bool {
        false
    }
}

/// Aborts a communicator's group from any thread; see [`Communicator::abort_handle`]. Cheap to
/// clone; the first reason given to any rank of the group wins.
///
/// ```
/// use fsdp_collectives::ring::{new_group, RingOptions};
/// use fsdp_collectives::{CollectiveError, Communicator};
/// use fsdp_device::{Buffer, DType};
/// let comms = new_group(2, RingOptions::default()).unwrap();
/// let handle = comms[1].abort_handle().expect("the ring backend can abort");
/// handle.abort("rank 1: stopped by SIGTERM");
/// let buf = Buffer::zeros(DType::F32, 4).unwrap();
/// match comms[0].all_reduce(&buf, fsdp_collectives::ReduceOp::Sum).and_then(|w| w.wait()) {
///     Err(e @ CollectiveError::Aborted { .. }) => {
///         assert!(e.to_string().contains("stopped by SIGTERM") && e.caused_by_peer())
///     }
///     other => panic!("{other:?}"),
/// }
/// ```
#[derive(Clone)]
pub struct AbortHandle {
    rank: usize,
    abort: Arc<dyn Fn(String) + Send + Sync>,
}

impl AbortHandle {
    /// A handle for rank `rank` that calls `abort` with the reason.
    pub fn new(rank: usize, abort: impl Fn(String) + Send + Sync + 'static) -> AbortHandle {
        AbortHandle {
            rank,
            abort: Arc::new(abort),
        }
    }

    /// The rank whose communicator it aborts.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Aborts the group and tells the peers why (best effort, bounded: it never waits longer
    /// than a write's short deadline).
    pub fn abort(&self, reason: impl Into<String>) {
        (self.abort)(reason.into())
    }
}

impl fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AbortHandle")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}
