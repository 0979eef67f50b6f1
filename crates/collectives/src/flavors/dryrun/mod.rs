//! The dry-run backend: collectives that check their arguments exactly as the other backends do
//! and then complete at once, moving no data.
//!
//! It exists for the FSDP *plan*, which drives the real engine without data — parameters on the
//! meta device ([`Buffer::meta`](fsdp_device::Buffer::meta)), a caching allocator over no memory —
//! to learn its schedule and memory use. A [`DryRunCommunicator`] accepts buffers on any device
//! (meta, host or CUDA), applies the rules of every backend (one element type per call,
//! `output = world × input` for all-gather base and `input = world × output` for reduce-scatter
//! base, overlaps only in the in-place forms, roots below the world size, one output per rank for
//! the unequal all-gather) and returns a [`Work`] that is already complete. It has no peers: each
//! rank's communicator stands alone, so differences between ranks' calls are not detected, and
//! [`split`](Communicator::split) cannot learn the other ranks' colors — build sub-groups directly
//! with [`DryRunCommunicator::new`] and the hybrid mesh with [`dry_run_mesh`].
//!
//! ```
//! use fsdp_collectives::{dryrun, Communicator, ReduceOp};
//! use fsdp_device::{Buffer, DType};
//!
//! // Rank 1 of 4, with 1 GiB shards that exist only as sizes.
//! let comm = dryrun::DryRunCommunicator::new(1, 4).unwrap();
//! let shard = Buffer::meta(DType::BF16, 1 << 29).unwrap();
//! let full = Buffer::meta(DType::BF16, 4 << 29).unwrap();
//! let work = comm.all_gather_base(&shard, &full).unwrap();
//! assert!(work.is_completed());
//! // Wrong sizes are the error every backend gives.
//! let err = comm.reduce_scatter_base(&shard, &full, ReduceOp::Sum).unwrap_err();
//! assert!(err.to_string().contains("input has 536870912 elements, expected world size 4"));
//!
//! // The 2 x 2 hybrid mesh that `mesh_2d` gives rank 1.
//! let mesh = dryrun::dry_run_mesh(1, 2, 2).unwrap();
//! assert_eq!((mesh.shard.rank(), mesh.replicate.rank()), (1, 0));
//! ```

use std::fmt;

use fsdp_device::{Buffer, Stream};

use super::check::{Access, Check, Placement};
use crate::{CollectiveError, Communicator, HybridMesh, ReduceOp, Result, Work};

/// The argument checks of every backend, without the device's.
const PLACEMENT: Placement = Placement::any_device("dryrun");

/// One rank of a group that only checks arguments: every collective completes at once and moves
/// no data. See the [module documentation](self).
pub struct DryRunCommunicator {
    rank: usize,
    world: usize,
    stream: Stream,
}

impl fmt::Debug for DryRunCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DryRunCommunicator(rank {}/{})", self.rank, self.world)
    }
}

impl DryRunCommunicator {
    /// Rank `rank` of a group of `world_size` ranks. Fails unless `rank < world_size`.
    pub fn new(rank: usize, world_size: usize) -> Result<DryRunCommunicator> {
        let invalid = |reason: String| CollectiveError::InvalidArgument {
            rank,
            op: "DryRunCommunicator::new",
            reason,
        };
        if world_size == 0 {
            return Err(invalid("world size must be at least 1".into()));
        }
        if rank >= world_size {
            return Err(invalid(format!("rank {rank} >= world size {world_size}")));
        }
        Ok(DryRunCommunicator {
            rank,
            world: world_size,
            stream: Stream::inline(format!("dryrun:{rank}/{world_size}")),
        })
    }

    /// A completed work if the arguments passed the checks, else the error the other backends
    /// give. The checks' access tickets are given up at once: nothing touches the buffers.
    fn issue(&self, op: &'static str, check: Check<Access>) -> Result<Work> {
        match check {
            Ok(_access) => Ok(Work::completed(op, self.rank)),
            Err(reason) => Err(CollectiveError::InvalidArgument {
                rank: self.rank,
                op,
                reason,
            }),
        }
    }
}

impl Communicator for DryRunCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    /// An inline CPU stream; nothing is ever enqueued on it.
    fn stream(&self) -> &Stream {
        &self.stream
    }

    fn all_gather_base(&self, input: &Buffer, output: &Buffer) -> Result<Work> {
        let check = PLACEMENT.all_gather_base(self.rank, self.world, input, output);
        self.issue("all_gather_base", check)
    }

    fn reduce_scatter_base(&self, input: &Buffer, output: &Buffer, _op: ReduceOp) -> Result<Work> {
        let check = PLACEMENT.reduce_scatter_base(self.rank, self.world, input, output);
        self.issue("reduce_scatter_base", check)
    }

    fn all_reduce(&self, buf: &Buffer, _op: ReduceOp) -> Result<Work> {
        self.issue("all_reduce", PLACEMENT.all_reduce(buf))
    }

    fn broadcast(&self, buf: &Buffer, root: usize) -> Result<Work> {
        let check = PLACEMENT.broadcast(self.rank, self.world, buf, root);
        self.issue("broadcast", check)
    }

    fn reduce(&self, buf: &Buffer, _op: ReduceOp, root: usize) -> Result<Work> {
        let check = PLACEMENT.reduce(self.rank, self.world, buf, root);
        self.issue("reduce", check)
    }

    fn barrier(&self) -> Result<Work> {
        self.issue("barrier", Ok(Access::none()))
    }

    fn all_gather(&self, input: &Buffer, outputs: &[Buffer]) -> Result<Work> {
        let check = PLACEMENT.all_gather(self.rank, self.world, input, outputs);
        self.issue("all_gather", check)
    }

    /// Only what this rank can know alone: `None` joins no group, and a group of one rank splits
    /// into itself. A larger group cannot be split — the sub-group depends on the other ranks'
    /// colors and keys, which a dry run never sees — and gives an
    /// [`InvalidArgument`](CollectiveError::InvalidArgument) error: build each sub-group with
    /// [`DryRunCommunicator::new`]`(rank_in_group, group_size)`, the hybrid mesh with
    /// [`dry_run_mesh`].
    fn split(&self, color: Option<u32>, _key: usize) -> Result<Option<Box<dyn Communicator>>> {
        if color.is_none() {
            return Ok(None);
        }
        if self.world == 1 {
            return Ok(Some(Box::new(DryRunCommunicator::new(0, 1)?)));
        }
        Err(CollectiveError::InvalidArgument {
            rank: self.rank,
            op: "split",
            reason: format!(
                "a dry-run group of {} ranks cannot be split: the sub-group depends on the other \
                 ranks' colors and keys, which a dry run never sees; build dry-run groups \
                 directly with DryRunCommunicator::new(rank, size), and the hybrid mesh with \
                 dryrun::dry_run_mesh",
                self.world
            ),
        })
    }
}

/// The [`HybridMesh`] that [`mesh_2d`](crate::mesh_2d)`(comm, replicate_size, shard_size)` gives
/// global rank `rank`, as dry-run groups: ranks are laid out row-major, so rank `g` is rank
/// `g % shard_size` of a shard group of `shard_size` ranks and rank `g / shard_size` of a
/// replicate group of `replicate_size` ranks.
///
/// ```
/// use fsdp_collectives::{dryrun::dry_run_mesh, Communicator};
/// let mesh = dry_run_mesh(4, 3, 2).unwrap(); // rank 4 of a 3 x 2 mesh: row 2, column 0
/// assert_eq!((mesh.shard.rank(), mesh.shard.world_size()), (0, 2));
/// assert_eq!((mesh.replicate.rank(), mesh.replicate.world_size()), (2, 3));
/// ```
pub fn dry_run_mesh(rank: usize, replicate_size: usize, shard_size: usize) -> Result<HybridMesh> {
    let invalid = |reason: String| CollectiveError::InvalidArgument {
        rank,
        op: "dry_run_mesh",
        reason,
    };
    let world = match replicate_size.checked_mul(shard_size) {
        Some(w) if w > 0 => w,
        _ => {
            return Err(invalid(format!(
                "a {replicate_size} x {shard_size} mesh has no ranks or too many"
            )))
        }
    };
    if rank >= world {
        return Err(invalid(format!(
            "rank {rank} is outside a {replicate_size} x {shard_size} mesh of {world} ranks"
        )));
    }
    Ok(HybridMesh {
        shard: Box::new(DryRunCommunicator::new(rank % shard_size, shard_size)?),
        replicate: Box::new(DryRunCommunicator::new(rank / shard_size, replicate_size)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_device::DType;

    #[test]
    fn groups_are_checked() {
        let c = DryRunCommunicator::new(2, 3).unwrap();
        assert_eq!((c.rank(), c.world_size()), (2, 3));
        assert!(c.stream().is_inline());
        assert_eq!(format!("{c:?}"), "DryRunCommunicator(rank 2/3)");
        for (rank, world, why) in [(0, 0, "at least 1"), (3, 3, "rank 3 >= world size 3")] {
            let e = DryRunCommunicator::new(rank, world).unwrap_err();
            assert!(
                matches!(&e, CollectiveError::InvalidArgument { op: "DryRunCommunicator::new", reason, .. } if reason.contains(why)),
                "{e}"
            );
        }
    }

    #[test]
    fn split_knows_only_what_one_rank_can() {
        let c = DryRunCommunicator::new(1, 4).unwrap();
        assert!(c.split(None, 0).unwrap().is_none());
        let e = c.split(Some(0), 1).err().unwrap();
        assert!(
            matches!(&e, CollectiveError::InvalidArgument { rank: 1, op: "split", reason } if reason.contains("DryRunCommunicator::new(rank, size)")),
            "{e}"
        );
        let one = DryRunCommunicator::new(0, 1).unwrap();
        let sub = one.split(Some(7), 3).unwrap().unwrap();
        assert_eq!((sub.rank(), sub.world_size()), (0, 1));
        // So mesh_2d works on a 1 x 1 dry-run group.
        let mesh = crate::mesh_2d(&one, 1, 1).unwrap();
        assert_eq!(
            (mesh.shard.world_size(), mesh.replicate.world_size()),
            (1, 1)
        );
    }

    #[test]
    fn mesh_arguments_are_checked() {
        for (rank, r, s, why) in [
            (0, 0, 2, "no ranks"),
            (0, 2, 0, "no ranks"),
            (0, usize::MAX, 2, "too many"),
            (4, 2, 2, "rank 4 is outside a 2 x 2 mesh of 4 ranks"),
        ] {
            let e = dry_run_mesh(rank, r, s).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
        }
    }

    #[test]
    fn tickets_are_given_up_at_once() {
        let c = DryRunCommunicator::new(0, 2).unwrap();
        let buf = Buffer::zeros(DType::F32, 4).unwrap();
        c.all_reduce(&buf, ReduceOp::Sum).unwrap();
        // Nothing holds the buffer: host access is immediate and sees it unchanged.
        let held = buf.write::<f32>().unwrap();
        drop(held);
        assert_eq!(buf.to_vec::<f32>().unwrap(), vec![0.0; 4]);
    }
}
