//! The 2-D device mesh of hybrid sharding.

use crate::{CollectiveError, Communicator, Result};

/// The two process groups of a `replicate × shard` mesh (PyTorch's
/// `init_device_mesh(..., (replicate, shard))` for `HYBRID_SHARD`).
///
/// Ranks are laid out row-major: rank `g` sits at `(g / shard_size, g % shard_size)`. Ranks of one
/// row (one "node") form the shard group; ranks of one column form the replicate group.
pub struct HybridMesh {
    /// The ranks this rank shards parameters with (same row), ordered by global rank.
    pub shard: Box<dyn Communicator>,
    /// The ranks holding the same shard as this rank (same column), ordered by global rank.
    pub replicate: Box<dyn Communicator>,
}

impl std::fmt::Debug for HybridMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HybridMesh(shard {}/{}, replicate {}/{})",
            self.shard.rank(),
            self.shard.world_size(),
            self.replicate.rank(),
            self.replicate.world_size()
        )
    }
}

/// Build the `(shard group, replicate group)` pair of a `replicate_size × shard_size` mesh over
/// `comm`. Every rank of `comm` must call it.
///
/// ```
/// use fsdp_collectives::{mesh_2d, ring, Communicator};
/// let coords = ring::run_ranks(4, ring::RingOptions::default(), |comm| {
///     let mesh = mesh_2d(&comm, 2, 2).unwrap();
///     (mesh.shard.rank(), mesh.replicate.rank())
/// })
/// .unwrap();
/// assert_eq!(coords, vec![(0, 0), (1, 0), (0, 1), (1, 1)]);
/// ```
pub fn mesh_2d(
    comm: &dyn Communicator,
    replicate_size: usize,
    shard_size: usize,
) -> Result<HybridMesh> {
    let world = comm.world_size();
    let rank = comm.rank();
    if replicate_size == 0
        || shard_size == 0
        || replicate_size.checked_mul(shard_size) != Some(world)
    {
        return Err(CollectiveError::InvalidArgument {
            rank,
            op: "mesh_2d",
            reason: format!(
                "a {replicate_size} x {shard_size} mesh needs {} ranks, the group has {world}",
                replicate_size.saturating_mul(shard_size)
            ),
        });
    }
    let row = (rank / shard_size) as u32;
    let col = (rank % shard_size) as u32;
    let missing = |what| CollectiveError::InvalidArgument {
        rank,
        op: "mesh_2d",
        reason: format!("split returned no {what} group"),
    };
    let shard = comm
        .split(Some(row), rank)?
        .ok_or_else(|| missing("shard"))?;
    let replicate = comm
        .split(Some(col), rank)?
        .ok_or_else(|| missing("replicate"))?;
    Ok(HybridMesh { shard, replicate })
}
