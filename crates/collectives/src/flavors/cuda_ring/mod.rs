//! The CUDA ring (feature `cuda`): the ring backend on CUDA buffers, ranks as threads of one
//! process on one GPU. It works on any GPU whatever the NCCL version, and it is the reference
//! the NCCL backend is tested against: its results are bitwise those of the host thread ring
//! ([`ring`](crate::ring)).
//!
//! [`new_group`] returns one [`CudaRingCommunicator`] per rank; move each into its own thread.
//! Each rank has its own CUDA stream ([`CudaRingCommunicator::cuda_stream`]). A collective runs
//! the ring engine's shared schedule (the same steps, segments and reduction order as the host
//! ring): each step is a device-to-device copy (`cuMemcpyDtoDAsync`) or a reduction kernel of
//! `fsdp-kernels` (the host ring's arithmetic) enqueued on the rank's stream, and the
//! dependencies between ranks — "data ready" and "slot consumed" — are CUDA events that the
//! peer's stream waits for on the GPU. The host threads only exchange event handles and device
//! addresses, and the description of each call through the group's board (the host ring's
//! mismatch check); every host wait has the group's timeout.
//!
//! Like the NCCL backend, a communicator issues collectives on a CPU stream
//! ([`Communicator::stream`](crate::Communicator::stream)): its worker takes the buffers'
//! access tickets, enqueues the schedule, records an end event on the CUDA stream and polls it
//! (with the timeout) before it releases the buffers and completes the [`Work`](crate::Work). Buffers written by other CUDA
//! streams must be complete before the collective is issued, unless they are stream-ordered
//! (`Buffer::stream_ordered`, a caching allocator's `into_ordered_buffer`): the CPU stream then
//! waits for their writers' events before the task, and records the collective's end as their
//! newest use, which later users wait for (on the host, as for every CPU event).
//!
//! Offered: `all_gather_base`, `reduce_scatter_base`, `all_reduce`, `broadcast`, `reduce` and
//! `barrier`, for f32, f64, bf16 and f16 with every [`ReduceOp`](crate::ReduceOp). Not offered
//! (an [`InvalidArgument`](CollectiveError::InvalidArgument) error): `all_gather` of unequal
//! outputs and `split`.

mod collectives;
mod links;
mod rank;
mod transport;

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fsdp_device::{Device, Stream, DEFAULT_TIMEOUT};

use self::links::make_links;
use self::rank::Rank;
use self::transport::{CudaTransport, SharedRank};
use crate::flavors::engine::{Engine, EngineParts};
use crate::flavors::ring::board::Board;
use crate::{CollectiveError, Result};

/// Options of a CUDA ring group.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CudaRingOptions {
    /// Bound of every wait: for peers to reach a collective and enqueue their steps, for buffers
    /// to become free, for the GPU to finish, and the default of
    /// [`Work::wait`](crate::Work::wait). Default: [`DEFAULT_TIMEOUT`] (300 s).
    pub timeout: Duration,
    /// Bytes per pipelined segment (rounded down to whole elements; at least one element).
    /// Default 4 MiB.
    pub segment_bytes: usize,
    /// Scratch slots per rank for the partial reductions it forwards (at least 2). Default 4.
    pub slots: usize,
}

impl Default for CudaRingOptions {
    fn default() -> Self {
        CudaRingOptions {
            timeout: DEFAULT_TIMEOUT,
            segment_bytes: 4 << 20,
            slots: 4,
        }
    }
}

impl CudaRingOptions {
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

/// One rank of a CUDA ring group. Not `Sync`: use it from one thread.
pub struct CudaRingCommunicator {
    engine: Engine,
    rank: SharedRank,
    cuda_stream: Stream,
    opts: CudaRingOptions,
}

impl fmt::Debug for CudaRingCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CudaRingCommunicator(rank {}/{} on {})",
            self.engine.rank(),
            self.engine.world_size(),
            self.cuda_stream.device()
        )
    }
}

/// Create a group of `world_size` ranks on CUDA device `ordinal`: element `r` of the result is
/// rank `r`, with its own CUDA stream.
///
/// # Errors
/// [`CollectiveError::InvalidArgument`] for a world of 0, fewer than 2 slots or empty segments;
/// [`CollectiveError::Device`] when CUDA is not available, the device does not exist or a stream
/// or the scratch cannot be created.
pub fn new_group(
    ordinal: usize,
    world_size: usize,
    opts: CudaRingOptions,
) -> Result<Vec<CudaRingCommunicator>> {
    crate::flavors::ring::check_group(
        "cuda_ring::new_group",
        world_size,
        opts.slots,
        opts.segment_bytes,
    )?;
    let board = Arc::new(Board::new(world_size));
    make_links(world_size)
        .into_iter()
        .enumerate()
        .map(|(rank, links)| {
            let device = |source| CollectiveError::Device { rank, source };
            let cuda_stream = Stream::cuda_with_timeout(
                ordinal,
                format!("cuda-ring:{rank}/{world_size}"),
                opts.timeout,
            )
            .map_err(device)?;
            let state = Rank::new(
                (rank, world_size),
                cuda_stream.clone(),
                board.clone(),
                links,
                (opts.slots, opts.segment_bytes),
            )
            .map_err(device)?;
            let state = Arc::new(Mutex::new(state));
            let engine = Engine::new(EngineParts {
                rank,
                world: world_size,
                backend: "cuda-ring",
                stream_name: format!("cuda-ring-comm:{rank}/{world_size}"),
                timeout: opts.timeout,
                segment_bytes: opts.segment_bytes,
                device: Device::Cuda(ordinal),
                transport: Box::new(CudaTransport {
                    rank: state.clone(),
                    board: board.clone(),
                    index: rank,
                }),
                control: board.clone(),
                group: "cuda-ring".into(),
                root_group: true,
                progress: Some(board.clone()),
            });
            Ok(CudaRingCommunicator {
                engine,
                rank: state,
                cuda_stream,
                opts: opts.clone(),
            })
        })
        .collect()
}

/// Run `f` on every rank of a new group on device `ordinal`, one thread per rank, and collect
/// the results in rank order. A panic in any rank is propagated once every thread has finished.
///
/// # Errors
/// As [`new_group`].
pub fn run_ranks<R: Send>(
    ordinal: usize,
    world_size: usize,
    opts: CudaRingOptions,
    f: impl Fn(CudaRingCommunicator) -> R + Sync,
) -> Result<Vec<R>> {
    let comms = new_group(ordinal, world_size, opts)?;
    let f = &f;
    Ok(std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::Builder::new()
                    .name(format!("cuda-rank{}", c.engine.rank()))
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

impl CudaRingCommunicator {
    /// The options of the group.
    pub fn options(&self) -> &CudaRingOptions {
        &self.opts
    }

    /// This rank's CUDA stream, on which its collectives run.
    pub fn cuda_stream(&self) -> &Stream {
        &self.cuda_stream
    }
}
