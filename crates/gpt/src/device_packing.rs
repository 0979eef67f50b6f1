//! How a unit's tensors are laid out in the one flat buffer a collective moves (FSDP2's
//! copy-in and copy-out): [`Packing`] and its [`Piece`]s, shared by the communicators that pack
//! ([`HostComm`](super::HostComm), `StagedComm`, `PeerComm`).

use fsdp_kernels::gpt::GptOps;

use crate::device_config::DeviceTrainError;

pub(super) fn bad_lengths(what: &str, reason: String) -> DeviceTrainError {
    fsdp::FsdpError::InvalidShape {
        reason: format!("{what}: {reason}"),
    }
    .into()
}

/// The lengths of `bufs`.
pub(crate) fn lens<'b, O: GptOps + 'b>(bufs: impl IntoIterator<Item = &'b O::Buf>) -> Vec<usize> {
    bufs.into_iter().map(|b| O::buf_len(b)).collect()
}

/// How a unit's tensors are packed into one flat buffer a rank (FSDP2's copy-in): each
/// shard's length and offset, and each full tensor's length.
pub(crate) struct Packing {
    /// The shards' lengths.
    pub(crate) lens: Vec<usize>,
    /// The full tensors' lengths (empty where there are none).
    pub(crate) full_lens: Vec<usize>,
    /// Each shard's offset in a rank's packed block.
    pub(crate) offsets: Vec<usize>,
    /// A rank's packed length.
    pub(crate) total: usize,
}

impl Packing {
    /// Shards of lengths `lens`, packed one after the other.
    pub(crate) fn new(lens: Vec<usize>) -> Packing {
        let mut offsets = Vec::with_capacity(lens.len());
        let mut total = 0;
        for &l in &lens {
            offsets.push(total);
            total += l;
        }
        Packing {
            lens,
            full_lens: Vec::new(),
            offsets,
            total,
        }
    }

    /// Shards of lengths `lens` of full tensors of `full_lens` over `world` ranks, checked
    /// to fit (the collective `what` fails otherwise).
    pub(crate) fn of_unit(
        what: &str,
        lens: Vec<usize>,
        full_lens: Vec<usize>,
        world: usize,
    ) -> Result<Packing, DeviceTrainError> {
        check_fit(what, &lens, &full_lens, world)?;
        Ok(Packing {
            full_lens,
            ..Packing::new(lens)
        })
    }

    /// The packing of a unit's all-gather of `shards` into `fulls` over `world` ranks, checked.
    pub(crate) fn all_gather<O: GptOps>(
        shards: &[&O::Buf],
        fulls: &[&mut O::Buf],
        world: usize,
    ) -> Result<Packing, DeviceTrainError> {
        let full_lens = lens::<O>(fulls.iter().map(|f| &**f));
        Packing::of_unit(
            "all-gather",
            lens::<O>(shards.iter().copied()),
            full_lens,
            world,
        )
    }

    /// The packing of a unit's reduce-scatter of `fulls` into `shards` over `world` ranks,
    /// checked.
    pub(crate) fn reduce_scatter<O: GptOps>(
        fulls: &[&O::Buf],
        shards: &[&mut O::Buf],
        world: usize,
    ) -> Result<Packing, DeviceTrainError> {
        let shard_lens = lens::<O>(shards.iter().map(|s| &**s));
        Packing::of_unit(
            "reduce-scatter",
            shard_lens,
            lens::<O>(fulls.iter().copied()),
            world,
        )
    }

    /// The packing of the tensors `idx` of this unit alone (one collective of a dtype).
    pub(crate) fn group(&self, idx: &[usize], world: usize) -> Result<Packing, DeviceTrainError> {
        Packing::of_unit(
            "all-gather",
            idx.iter().map(|&i| self.lens[i]).collect(),
            idx.iter().map(|&i| self.full_lens[i]).collect(),
            world,
        )
    }

    /// Chunk `r` of tensor `i`: where it starts in the full tensor and its length (0 from
    /// the first chunk past the end on).
    pub(crate) fn chunk(&self, i: usize, r: usize) -> (usize, usize) {
        let (s, f) = (self.lens[i], self.full_lens[i]);
        let start = r * s;
        (start, s.min(f.saturating_sub(start)))
    }

    /// The non-empty pieces of full tensor `i` an all-gather over `world` ranks gives it,
    /// rank by rank: each rank's chunk, where it lies in the gathered output (`world` packed
    /// blocks of `total`) and where it goes in the full tensor.
    pub(crate) fn gathered(&self, i: usize, world: usize) -> impl Iterator<Item = Piece> + '_ {
        (0..world)
            .map(move |rank| {
                let (start, len) = self.chunk(i, rank);
                Piece {
                    rank,
                    at: rank * self.total + self.offsets[i],
                    start,
                    len,
                }
            })
            .take_while(|p| p.len > 0)
    }
}

/// One rank's chunk of a full tensor in an all-gather ([`Packing::gathered`]).
pub(crate) struct Piece {
    /// The rank.
    pub(crate) rank: usize,
    /// Where it lies in the gathered output.
    pub(crate) at: usize,
    /// Where it starts in the full tensor.
    pub(crate) start: usize,
    /// Its length.
    pub(crate) len: usize,
}

/// Checks that `fulls[i]` fits `world` shards of `shards[i]`.
fn check_fit(
    what: &str,
    shard: &[usize],
    full: &[usize],
    world: usize,
) -> Result<(), DeviceTrainError> {
    if shard.len() != full.len() {
        return Err(bad_lengths(
            what,
            format!("{} shards for {} tensors", shard.len(), full.len()),
        ));
    }
    for (i, (&s, &f)) in shard.iter().zip(full).enumerate() {
        if f > s * world {
            return Err(bad_lengths(
                what,
                format!("tensor {i} of {f} elements does not fit {world} shards of {s}"),
            ));
        }
    }
    Ok(())
}
