//! The collectives of sharded training on a device, on the buffers of its [`GptOps`]:
//! [`DeviceComm`], and [`HostComm`], which runs them for the kernels' host twins
//! ([`HostOps`]) over any [`Communicator`] of `fsdp-collectives` (the ring as threads, TCP as
//! processes).
//!
//! A unit's collective is one call, as FSDP2 issues one all-gather and one reduce-scatter per
//! parameter group: its shards are packed into one flat buffer rank-major (FSDP2's copy-in
//! and `chunk_cat`), gathered or reduced once, and copied out.

use std::ops::Range;

use fsdp_collectives::{Communicator, ReduceOp};
use fsdp_device::{Buffer, DType};
use fsdp_kernels::gpt::{GptOps, HostBuf, HostOps};

use crate::device_config::DeviceTrainError;

/// The collectives a sharded device trainer needs, on `O`'s buffers. Every rank calls each
/// one in the same order with buffers of the same lengths; every call completes (or fails on
/// every rank) within the communicator's timeout.
pub trait DeviceComm<O: GptOps> {
    /// This rank.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// Unshards one unit: `fulls[i]` becomes every rank's `shards[i]`, rank after rank, cut
    /// to `fulls[i]`'s length (the last rank's padding dropped). Each `shards[i]` has the same
    /// length on every rank, and `fulls[i]` at most `world_size` times it.
    ///
    /// # Errors
    /// Lengths that do not fit; the collective's failure.
    fn all_gather(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        fulls: &mut [&mut O::Buf],
    ) -> Result<(), DeviceTrainError>;
    /// Reduces one unit's gradients to their shards with the ranks' mean: `shards[i]` becomes
    /// chunk `rank` of the mean over ranks of `fulls[i]` zero-padded to `world_size ×
    /// shards[i]` elements.
    ///
    /// # Errors
    /// Lengths that do not fit; the collective's failure.
    fn reduce_scatter_avg(
        &self,
        ops: &O,
        fulls: &[&O::Buf],
        shards: &mut [&mut O::Buf],
    ) -> Result<(), DeviceTrainError>;
    /// Replaces each of `bufs` with its mean over ranks (the gradients of replicated
    /// parameters: DDP's, FSDP's `NO_SHARD`).
    ///
    /// # Errors
    /// The collective's failure.
    fn all_reduce_avg(&self, ops: &O, bufs: &mut [&mut O::Buf]) -> Result<(), DeviceTrainError>;
    /// Reduces the step's scalars in the slots `slots` over ranks with `op` (`Sum` or `Avg`).
    ///
    /// # Errors
    /// Slots outside the scalars; the collective's failure.
    fn all_reduce_scalars(
        &self,
        ops: &O,
        scalars: &mut O::Scalars,
        slots: Range<usize>,
        op: ReduceOp,
    ) -> Result<(), DeviceTrainError>;
}

/// [`DeviceComm`] for the host twins over a [`Communicator`]: each collective copies the
/// unit's buffers into one host [`Buffer`], runs on the communicator and waits for it (its
/// timeout bounds the wait), and copies the result out.
pub struct HostComm<C: ?Sized> {
    comm: Box<C>,
}

impl<C: Communicator + ?Sized> HostComm<C> {
    /// Collectives over `comm`.
    pub fn new(comm: Box<C>) -> HostComm<C> {
        HostComm { comm }
    }

    /// The communicator.
    pub fn communicator(&self) -> &C {
        &self.comm
    }
}

fn bad_lengths(what: &str, reason: String) -> DeviceTrainError {
    fsdp::FsdpError::InvalidShape {
        reason: format!("{what}: {reason}"),
    }
    .into()
}

/// The packed length of shards of lengths `lens`, and each one's offset.
fn packing(lens: &[usize]) -> (usize, Vec<usize>) {
    let mut offsets = Vec::with_capacity(lens.len());
    let mut total = 0;
    for &l in lens {
        offsets.push(total);
        total += l;
    }
    (total, offsets)
}

/// Checks that `fulls[i]` fits `world` shards of `shards[i]`.
pub(crate) fn check_fit(
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

impl<C: Communicator + ?Sized> DeviceComm<HostOps> for HostComm<C> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_gather(
        &self,
        _: &HostOps,
        shards: &[&HostBuf],
        fulls: &mut [&mut HostBuf],
    ) -> Result<(), DeviceTrainError> {
        let world = self.world_size();
        let lens: Vec<usize> = shards.iter().map(|s| s.len()).collect();
        let full_lens: Vec<usize> = fulls.iter().map(|f| f.len()).collect();
        check_fit("all-gather", &lens, &full_lens, world)?;
        let (total, offsets) = packing(&lens);
        let mut packed = Vec::with_capacity(total);
        for s in shards {
            packed.extend_from_slice(s);
        }
        let input = Buffer::from_slice(&packed)?;
        let output = Buffer::zeros(DType::F32, total * world)?;
        self.comm.all_gather_base(&input, &output)?.wait()?;
        let gathered = output.to_vec::<f32>()?;
        for (i, full) in fulls.iter_mut().enumerate() {
            let (s, f) = (lens[i], full.len());
            let full: &mut [f32] = full;
            for r in 0..world {
                let start = r * s;
                if start >= f {
                    break;
                }
                let n = s.min(f - start);
                let from = r * total + offsets[i];
                full[start..start + n].copy_from_slice(&gathered[from..from + n]);
            }
        }
        Ok(())
    }

    fn reduce_scatter_avg(
        &self,
        _: &HostOps,
        fulls: &[&HostBuf],
        shards: &mut [&mut HostBuf],
    ) -> Result<(), DeviceTrainError> {
        let world = self.world_size();
        let lens: Vec<usize> = shards.iter().map(|s| s.len()).collect();
        let full_lens: Vec<usize> = fulls.iter().map(|f| f.len()).collect();
        check_fit("reduce-scatter", &lens, &full_lens, world)?;
        let (total, offsets) = packing(&lens);
        let mut packed = vec![0.0f32; total * world];
        for (i, full) in fulls.iter().enumerate() {
            let s = lens[i];
            for (r, chunk) in full.chunks(s.max(1)).enumerate() {
                let to = r * total + offsets[i];
                packed[to..to + chunk.len()].copy_from_slice(chunk);
            }
        }
        let input = Buffer::from_slice(&packed)?;
        let output = Buffer::zeros(DType::F32, total)?;
        self.comm
            .reduce_scatter_base(&input, &output, ReduceOp::Avg)?
            .wait()?;
        let reduced = output.to_vec::<f32>()?;
        for (i, shard) in shards.iter_mut().enumerate() {
            let shard: &mut [f32] = shard;
            shard.copy_from_slice(&reduced[offsets[i]..offsets[i] + lens[i]]);
        }
        Ok(())
    }

    fn all_reduce_avg(
        &self,
        _: &HostOps,
        bufs: &mut [&mut HostBuf],
    ) -> Result<(), DeviceTrainError> {
        let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let (total, offsets) = packing(&lens);
        let mut packed = Vec::with_capacity(total);
        for b in bufs.iter() {
            packed.extend_from_slice(b);
        }
        let buf = Buffer::from_slice(&packed)?;
        self.comm.all_reduce(&buf, ReduceOp::Avg)?.wait()?;
        let reduced = buf.to_vec::<f32>()?;
        for (i, b) in bufs.iter_mut().enumerate() {
            let b: &mut [f32] = b;
            b.copy_from_slice(&reduced[offsets[i]..offsets[i] + lens[i]]);
        }
        Ok(())
    }

    fn all_reduce_scalars(
        &self,
        _: &HostOps,
        scalars: &mut <HostOps as GptOps>::Scalars,
        slots: Range<usize>,
        op: ReduceOp,
    ) -> Result<(), DeviceTrainError> {
        let n = scalars.len();
        let values = scalars
            .get(slots.clone())
            .ok_or_else(|| bad_lengths("scalars", format!("slots {slots:?} of {n}")))?;
        let buf = Buffer::from_slice(values)?;
        self.comm.all_reduce(&buf, op)?.wait()?;
        let reduced = buf.to_vec::<f64>()?;
        let scalars: &mut Vec<f64> = scalars;
        scalars[slots].copy_from_slice(&reduced);
        Ok(())
    }
}

impl<O: GptOps, T: DeviceComm<O> + ?Sized> DeviceComm<O> for Box<T> {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn all_gather(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        fulls: &mut [&mut O::Buf],
    ) -> Result<(), DeviceTrainError> {
        (**self).all_gather(ops, shards, fulls)
    }

    fn reduce_scatter_avg(
        &self,
        ops: &O,
        fulls: &[&O::Buf],
        shards: &mut [&mut O::Buf],
    ) -> Result<(), DeviceTrainError> {
        (**self).reduce_scatter_avg(ops, fulls, shards)
    }

    fn all_reduce_avg(&self, ops: &O, bufs: &mut [&mut O::Buf]) -> Result<(), DeviceTrainError> {
        (**self).all_reduce_avg(ops, bufs)
    }

    fn all_reduce_scalars(
        &self,
        ops: &O,
        scalars: &mut O::Scalars,
        slots: Range<usize>,
        op: ReduceOp,
    ) -> Result<(), DeviceTrainError> {
        (**self).all_reduce_scalars(ops, scalars, slots, op)
    }
}
