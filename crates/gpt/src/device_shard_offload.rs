//! CPU offload's side of [`ShardedUnits`](super::ShardedUnits): a unit's shards copied in
//! from the host's staging memory before they are gathered (or, replicated, copied in as the
//! unit's parameters).

use fsdp_device::DType;
use fsdp_kernels::gpt::GptOps;
use fsdp_kernels::KernelError;

use crate::device_comm::DeviceComm;
use crate::device_config::DeviceTrainError;
use crate::device_units::UnitSpan;

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

/// Under CPU offload: unit `u`'s shards (of lengths `lens`) copied in from their staging
/// memory `staged` (or the prefetched copy in `copied_in` taken) and gathered in `dtypes` into
/// `fulls` over `comm` (replicated, `factor` 1: copied into `fulls` directly); the device
/// shards are freed after.
pub(super) fn host_unshard<O: GptOps, C: DeviceComm<O> + ?Sized>(
    (comm, ops, factor, dtypes): (&C, &O, usize, &[DType]),
    staged: Vec<&mut O::Staging>,
    lens: Vec<usize>,
    copied_in: &mut Option<(usize, Vec<O::Buf>)>,
    (u, unit): (usize, &UnitSpan),
    mut fulls: Vec<&mut O::Buf>,
) -> Result<(), DeviceTrainError> {
    if factor == 1 {
        for (s, f) in staged.into_iter().zip(fulls) {
            ops.copy_in(s, f)?;
        }
        return Ok(());
    }
    let shards = match copied_in.take() {
        Some((k, shards)) if k == u => shards,
        Some((k, _)) => {
            return Err(KernelError::InvalidArgument {
                kernel: "fsdp units",
                reason: format!("the prefetched all-gather of unit {k} is unused at {unit}'s"),
            }
            .into())
        }
        None => copy_in(ops, staged, &lens)?,
    };
    comm.all_gather(ops, &shards.iter().collect::<Vec<_>>(), &mut fulls, dtypes)
}
