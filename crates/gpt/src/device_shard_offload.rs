//! CPU offload's side of [`ShardedUnits`](super::ShardedUnits): a unit's shards copied in
//! from the host's staging memory before they are gathered (or, replicated, copied in as the
//! unit's parameters).

use fsdp_device::DType;
use fsdp_kernels::gpt::{GptDims, GptOps, Unit, Weights};
use fsdp_kernels::KernelError;

use super::{not_held, unit_shard_lens};
use crate::device_comm::DeviceComm;
use crate::device_config::DeviceTrainError;

/// Copies the host staging shards `staged` into new device buffers of lengths `lens`.
pub(super) fn copy_in<O: GptOps>(
    ops: &O,
    staged: Vec<&mut O::Staging>,
    lens: &[usize],
) -> Result<Vec<O::Buf>, DeviceTrainError> {
    let mut shards = Vec::with_capacity(staged.len());
    for (s, &n) in staged.into_iter().zip(lens) {
        let mut b = ops.empty(n)?;
        ops.copy_in(s, &mut b)?;
        shards.push(b);
    }
    Ok(shards)
}

/// Under CPU offload: `unit`'s shards copied in from `staging` (or the prefetched copy in
/// `copied_in` taken) and gathered in `dtypes` into `fulls` over `comm` (replicated, `factor`
/// 1: copied into `fulls` directly); the device shards are freed after.
pub(super) fn host_unshard<O: GptOps, C: DeviceComm<O> + ?Sized>(
    (comm, ops, factor, dims, dtypes): (&C, &O, usize, &GptDims, &[DType]),
    staging: &mut Weights<O::Staging>,
    copied_in: &mut Option<(usize, Vec<O::Buf>)>,
    unit: Unit,
    mut fulls: Vec<&mut O::Buf>,
) -> Result<(), DeviceTrainError> {
    let staged: Vec<&mut O::Staging> = match unit {
        Unit::Root => staging.root_bufs_mut().into_iter().collect(),
        Unit::Block(l) => staging
            .blocks
            .get_mut(l)
            .ok_or_else(|| not_held(&format!("block {l}")))?
            .bufs_mut(),
    };
    if factor == 1 {
        for (s, f) in staged.into_iter().zip(fulls) {
            ops.copy_in(s, f)?;
        }
        return Ok(());
    }
    let shards = match (unit, copied_in.take()) {
        (Unit::Block(l), Some((k, shards))) if k == l => shards,
        (_, Some((k, _))) => {
            return Err(KernelError::InvalidArgument {
                kernel: "fsdp units",
                reason: format!("block {k}'s prefetched all-gather is unused at {unit:?}'s"),
            }
            .into())
        }
        (_, None) => copy_in(ops, staged, &unit_shard_lens(dims, factor, unit)?)?,
    };
    comm.all_gather(ops, &shards.iter().collect::<Vec<_>>(), &mut fulls, dtypes)
}
