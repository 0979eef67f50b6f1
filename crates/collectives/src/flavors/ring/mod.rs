//! The ring backend: ranks are threads of one process, the project's embedded default.
//!
//! [`new_group`] returns one [`RingCommunicator`] per rank; move each into its own thread. Each
//! communicator owns a CPU worker [`Stream`](fsdp_device::Stream) (its communication stream) that runs the collectives
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

pub(crate) mod board;
mod threads;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use fsdp_device::DEFAULT_TIMEOUT;

use self::board::{Board, PendingSplit};
use self::threads::{make_links, Links, Threads};
use crate::flavors::engine::{engine_communicator, Engine, EngineParts};
use crate::{CollectiveError, Result};

/// Options of a ring group.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RingOptions {
    /// Bound of every wait: for peers to reach a collective, for data, for buffers to become
    /// free, and the default of [`Work::wait`](crate::Work::wait). Default: [`DEFAULT_TIMEOUT`]
    /// (300 s).
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

/// One rank of a ring group: the ring engine over the in-process transport.
/// Not `Sync`: use it from one thread (its collectives run on its own communication stream).
pub struct RingCommunicator {
    engine: Engine,
    board: Arc<Board>,
    opts: RingOptions,
    /// `ring` for a group of `new_group`, `<parent>.<seq>.<color>` for a split.
    group: String,
}

impl fmt::Debug for RingCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RingCommunicator(rank {}/{})",
            self.engine.rank(),
            self.engine.world_size()
        )
    }
}

/// The checks of a group of ranks as threads (thread ring, CUDA ring): a world of at least one,
/// at least two scratch slots, non-empty segments.
pub(crate) fn check_group(
    op: &'static str,
    world_size: usize,
    slots: usize,
    segment_bytes: usize,
) -> Result<()> {
    let invalid = |reason: String| CollectiveError::InvalidArgument {
        rank: 0,
        op,
        reason,
    };
    if world_size == 0 {
        return Err(invalid("world size must be at least 1".into()));
    }
    if slots < 2 {
        return Err(invalid(format!("slots = {slots} (at least 2 are needed)")));
    }
    if segment_bytes == 0 {
        return Err(invalid("segment_bytes must be positive".into()));
    }
    Ok(())
}

/// Create a group of `world_size` ranks: element `r` of the result is rank `r`.
pub fn new_group(world_size: usize, opts: RingOptions) -> Result<Vec<RingCommunicator>> {
    check_group(
        "ring::new_group",
        world_size,
        opts.slots,
        opts.segment_bytes,
    )?;
    let board = Arc::new(Board::new(world_size));
    make_links(world_size)
        .into_iter()
        .enumerate()
        .map(|(rank, links)| {
            RingCommunicator::from_parts(
                rank,
                world_size,
                opts.clone(),
                board.clone(),
                links,
                "ring".into(),
            )
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
                    .name(format!("rank{}", c.engine.rank()))
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

impl RingCommunicator {
    fn from_parts(
        rank: usize,
        world: usize,
        opts: RingOptions,
        board: Arc<Board>,
        links: Links,
        group: String,
    ) -> Result<RingCommunicator> {
        let transport = Threads::new(
            rank,
            world,
            board.clone(),
            links,
            opts.segment_bytes,
            opts.slots,
        )
        .map_err(|source| CollectiveError::Device { rank, source })?;
        let engine = Engine::new(EngineParts {
            rank,
            world,
            backend: "ring",
            stream_name: format!("ring-comm:{rank}/{world}"),
            timeout: opts.timeout,
            segment_bytes: opts.segment_bytes,
            device: fsdp_device::Device::Cpu,
            transport: Box::new(transport),
            control: board.clone(),
            root_group: !group.contains('.'),
            group: group.clone(),
            progress: Some(board.clone()),
        });
        Ok(RingCommunicator {
            engine,
            board,
            opts,
            group,
        })
    }

    /// The options of the group.
    pub fn options(&self) -> &RingOptions {
        &self.opts
    }

    /// [`Communicator::split`](crate::Communicator::split) returning the concrete type.
    pub fn split_ring(&self, color: Option<u32>, key: usize) -> Result<Option<RingCommunicator>> {
        let Some(plan) = self.engine.split_plan(color, key)? else {
            return Ok(None);
        };
        let (new_rank, new_world) = (plan.new_rank, plan.new_world);
        let (sub_board, links) = self.board.with_split(
            (plan.seq, plan.color),
            || PendingSplit {
                board: Arc::new(Board::new(new_world)),
                links: make_links(new_world).into_iter().map(Some).collect(),
            },
            |p| (p.board.clone(), p.links[new_rank].take()),
        );
        let links = links.expect("each member takes its links once");
        let group = format!("{}.{}.{}", self.group, plan.seq, plan.color);
        RingCommunicator::from_parts(
            new_rank,
            new_world,
            self.opts.clone(),
            sub_board,
            links,
            group,
        )
        .map(Some)
    }
}

engine_communicator!(RingCommunicator, split_ring);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flavors::engine::test_fault::{all_gather_with_body, faulty_all_gather};
    use crate::flavors::engine::{Body, DataError};
    use crate::Communicator;
    use fsdp_device::{Buffer, DType};
    use std::time::Instant;

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
                        let injected = || {
                            Err(DataError::Protocol {
                                reason: "injected failure".into(),
                            })
                        };
                        let r = faulty_all_gather(
                            &comm.engine,
                            "ring",
                            comm.rank(),
                            comm.world_size(),
                            1,
                            injected,
                            Duration::from_secs(40),
                        );
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

    /// A rank that fails while its predecessor waits for it to read a segment (in `drain`) tells
    /// the predecessor with its release message. The predecessor returns at once with the
    /// failure and frees its buffers, rather than wait out its timeout for a second release
    /// message. The failing rank's communicator stays alive until both ranks are done, so no
    /// closed channel cuts the wait short.
    #[test]
    // Wall-clock bounds (a 300 ms failure against a 5 s timeout), not unsafe code.
    #[cfg_attr(miri, ignore)]
    fn failure_while_predecessor_waits_for_ack_releases_at_once() {
        let timeout = Duration::from_secs(5);
        let opts = RingOptions::default()
            .with_timeout(timeout)
            .with_segment_bytes(16);
        let comms = new_group(2, opts).unwrap();
        let done = std::sync::Barrier::new(2);
        let results: Vec<(Result<()>, Duration, bool)> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let done = &done;
                    s.spawn(move || {
                        let rank = comm.rank();
                        let input = Buffer::from_slice(&[1.0f32; 64]).unwrap();
                        let output = Buffer::zeros(DType::F32, 128).unwrap();
                        let body: Body = if rank == 0 {
                            // Publish 4 elements of the input, then wait for rank 1 to read them.
                            Box::new(|t, guards, _, _| {
                                // SAFETY: the input's guard is held for the whole collective and
                                // the input is never written.
                                unsafe { t.send(guards[0].as_ptr(), 16)? };
                                t.drain()
                            })
                        } else {
                            // Fail once rank 0 waits for the acknowledgement.
                            Box::new(|_, _, _, _| {
                                std::thread::sleep(Duration::from_millis(300));
                                Err(DataError::Protocol {
                                    reason: "injected failure".into(),
                                })
                            })
                        };
                        let t0 = Instant::now();
                        let r = all_gather_with_body(
                            &comm.engine,
                            "ring",
                            (rank, 2),
                            (&input, &output),
                            body,
                            Duration::from_secs(40),
                        );
                        let took = t0.elapsed();
                        // Leaked guards would keep both buffers from being written.
                        let short = Duration::from_millis(100);
                        let freed = input.write_timeout::<f32>(short).is_ok()
                            && output.write_timeout::<f32>(short).is_ok();
                        // Keep this communicator (and its channels) until both ranks are done.
                        done.wait();
                        drop(comm);
                        (r, took, freed)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (r, took, freed)) in results.iter().enumerate() {
            let err = r.as_ref().unwrap_err();
            assert!(
                *took < Duration::from_secs(2),
                "rank {rank} took {took:?}: {err}"
            );
            assert!(freed, "rank {rank} leaked its buffers: {err}");
            assert!(
                matches!(err, CollectiveError::Aborted { .. }),
                "rank {rank}: {err:?}"
            );
            assert!(
                err.to_string().contains("injected failure"),
                "rank {rank}: {err}"
            );
        }
        let waiter = results[0].0.as_ref().unwrap_err().to_string();
        assert!(waiter.contains("rank 1"), "{waiter}");
    }
}
