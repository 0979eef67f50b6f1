//! The collectives of sharded training on a device, on the buffers of its [`GptOps`]:
//! [`DeviceComm`], and [`HostComm`], which runs them for any operations (the kernels' host
//! twins, CUDA) over any [`Communicator`] of `fsdp-collectives` (the ring as threads, TCP as
//! processes), staged through host memory.
//!
//! A unit's collective is one call, as FSDP2 issues one all-gather and one reduce-scatter per
//! parameter group: its shards are packed into one flat buffer rank-major (FSDP2's copy-in
//! and `chunk_cat`), gathered or reduced once, and copied out.

use std::ops::Range;

use fsdp_collectives::{Communicator, ReduceOp};
use fsdp_device::half::{bf16, f16};
use fsdp_device::{Buffer, DType};
use fsdp_kernels::gpt::GptOps;
use fsdp_kernels::host::CastFloat;

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
    /// to `fulls[i]`'s length (the last rank's padding dropped), moved in `dtypes[i]` (FSDP's
    /// `param_dtype` on the wire: f32, or bf16 — the shard rounded to bf16, ties to even,
    /// gathered and widened into the f32 full tensor, so exact for values bf16 holds). Each
    /// `shards[i]` has the same length on every rank, and `fulls[i]` at most `world_size`
    /// times it.
    ///
    /// # Errors
    /// Lengths that do not fit; a dtype other than f32 or bf16, or not one a tensor; the
    /// collective's failure.
    fn all_gather(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        fulls: &mut [&mut O::Buf],
        dtypes: &[DType],
    ) -> Result<(), DeviceTrainError>;
    /// The bytes the communicator holds beside the operations' buffers for its collectives
    /// (staging buffers in the operations' memory, counted in [`GptOps::memory`] too); the
    /// default holds none there.
    fn held_bytes(&self) -> u64 {
        0
    }
    /// Starts the all-gather of `shards` in `dtypes` ahead of its use (FSDP's prefetch): the
    /// collective is issued now, and the next [`all_gather`](Self::all_gather) of the same
    /// shards (the same buffers, in the same dtypes) only completes it into the full tensors.
    /// Every rank prefetches in the same order. Returns whether anything started; the default,
    /// for implementations that run each collective whole, starts nothing.
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather)'s dtypes; the collective's failure.
    fn prefetch_all_gather(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        dtypes: &[DType],
    ) -> Result<bool, DeviceTrainError> {
        let _ = (ops, shards, dtypes);
        Ok(false)
    }
    /// Reduces one unit's gradients to their shards with the ranks' mean: `shards[i]` becomes
    /// chunk `rank` of the mean over ranks of `fulls[i]` zero-padded to `world_size ×
    /// shards[i]` elements, reduced in `dtype` (FSDP's `reduce_dtype`: f32, or bf16 or f16 —
    /// each input rounded to that type, the ranks' values added in rank order in f32 and
    /// rounded after every addition and after the division, as the collectives reduce 16-bit
    /// types, and the result widened).
    ///
    /// # Errors
    /// Lengths that do not fit; a `dtype` other than f32, bf16 or f16; the collective's
    /// failure.
    fn reduce_scatter_avg(
        &self,
        ops: &O,
        fulls: &[&O::Buf],
        shards: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError>;
    /// Replaces each of `bufs` with its mean over ranks (the gradients of replicated
    /// parameters: DDP's, FSDP's `NO_SHARD`), reduced in `dtype` as
    /// [`reduce_scatter_avg`](Self::reduce_scatter_avg).
    ///
    /// # Errors
    /// A `dtype` other than f32, bf16 or f16; the collective's failure.
    fn all_reduce_avg(
        &self,
        ops: &O,
        bufs: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError>;
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

/// The bytes a rank's collectives moved in training, as the engine's summary counts them:
/// each all-gather and reduce-scatter the unit's padded full size (`factor` × its shards) in
/// the dtype it moved, each all-reduce the buffers it reduced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommVolume {
    /// Parameters all-gathered (in the gathers' dtype).
    pub all_gathered: u64,
    /// Gradients reduce-scattered (in the reduction's dtype).
    pub reduce_scattered: u64,
    /// Gradients all-reduced (`NO_SHARD`, and the replicas of a hybrid strategy; in the
    /// reduction's dtype).
    pub all_reduced: u64,
}

impl CommVolume {
    /// A step's share of the bytes of `steps` steps.
    pub fn per_step(self, steps: u64) -> CommVolume {
        let steps = steps.max(1);
        CommVolume {
            all_gathered: self.all_gathered / steps,
            reduce_scattered: self.reduce_scattered / steps,
            all_reduced: self.all_reduced / steps,
        }
    }
}

impl std::ops::AddAssign for CommVolume {
    fn add_assign(&mut self, o: CommVolume) {
        self.all_gathered = self.all_gathered.saturating_add(o.all_gathered);
        self.reduce_scattered = self.reduce_scattered.saturating_add(o.reduce_scattered);
        self.all_reduced = self.all_reduced.saturating_add(o.all_reduced);
    }
}

/// `elements` of `dtype`, in bytes.
pub(crate) fn bytes(elements: usize, dtype: DType) -> u64 {
    (elements as u64).saturating_mul(dtype.size_in_bytes() as u64)
}

/// [`DeviceComm`] for any operations over a [`Communicator`], staged through host memory: each
/// collective copies the unit's buffers out into one host [`Buffer`] (waiting for the device),
/// runs on the communicator and waits for it (its timeout bounds the wait), and copies the
/// result in. The path of ranks as processes; threads over one device use
/// [`PeerComm`](crate::device_peer::PeerComm), which never waits for the device.
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

/// Whether a collective in `dtype` moves bf16 (else f32): the device's collectives gather
/// parameters and reduce gradients in these two.
///
/// # Errors
/// [`FsdpError::InvalidFsdpConfig`](fsdp::FsdpError::InvalidFsdpConfig) for any other dtype,
/// naming `what` (the collective, or the setting).
pub fn reduces_in_bf16(what: &str, dtype: DType) -> Result<bool, fsdp::FsdpError> {
    match dtype {
        DType::F32 => Ok(false),
        DType::BF16 => Ok(true),
        other => Err(fsdp::FsdpError::InvalidFsdpConfig {
            reason: format!("{what} in {other}: the device's collectives move f32 or bf16"),
        }),
    }
}

/// The 16-bit type a reduction in `dtype` moves (bf16 or f16: FSDP's `reduce_dtype`), or
/// `None` for f32.
///
/// # Errors
/// [`FsdpError::InvalidFsdpConfig`](fsdp::FsdpError::InvalidFsdpConfig) for any other dtype,
/// naming `what` (the collective, or the setting).
pub fn reduces_in_half(what: &str, dtype: DType) -> Result<Option<DType>, fsdp::FsdpError> {
    match dtype {
        DType::F32 => Ok(None),
        DType::BF16 | DType::F16 => Ok(Some(dtype)),
        other => Err(fsdp::FsdpError::InvalidFsdpConfig {
            reason: format!("{what} in {other}: the device's reductions move f32, bf16 or f16"),
        }),
    }
}

/// Which of an all-gather's tensors move in bf16 (`dtypes`, one a tensor of `n`).
///
/// # Errors
/// A count other than `n`; a dtype other than f32 or bf16.
pub(crate) fn gathers_in_bf16(dtypes: &[DType], n: usize) -> Result<Vec<bool>, DeviceTrainError> {
    if dtypes.len() != n {
        return Err(bad_lengths(
            "all-gather",
            format!("{} dtypes for {n} tensors", dtypes.len()),
        ));
    }
    Ok(dtypes
        .iter()
        .map(|&d| reduces_in_bf16("all-gather", d))
        .collect::<Result<_, _>>()?)
}

/// An all-gather's tensors grouped by the dtype they move in (`halves`: bf16 or f32), f32's
/// first, each group's indices in order; empty groups left out.
pub(crate) fn dtype_groups(halves: &[bool]) -> Vec<(bool, Vec<usize>)> {
    [false, true]
        .into_iter()
        .map(|h| {
            let idx: Vec<usize> = (0..halves.len()).filter(|&i| halves[i] == h).collect();
            (h, idx)
        })
        .filter(|(_, idx)| !idx.is_empty())
        .collect()
}

/// `values` rounded to `H` (bf16 or f16; ties to even, the cast kernel's rounding).
fn rounded<H: CastFloat + fsdp_device::Element>(
    values: &[f32],
) -> Result<Buffer, DeviceTrainError> {
    let mut out = vec![H::default(); values.len()];
    fsdp_kernels::host::cast(values, &mut out)?;
    Ok(Buffer::from_slice(&out)?)
}

/// `values` widened to f32.
fn widen<H: CastFloat + fsdp_device::Element>(buf: &Buffer) -> Result<Vec<f32>, DeviceTrainError> {
    let values = buf.to_vec::<H>()?;
    let mut out = vec![0.0f32; values.len()];
    fsdp_kernels::host::cast(&values, &mut out)?;
    Ok(out)
}

/// `packed` as a host buffer of f32, or (`half`) its bf16 or f16 rounding.
fn host_buffer(packed: &[f32], half: Option<DType>) -> Result<Buffer, DeviceTrainError> {
    match half {
        Some(DType::BF16) => rounded::<bf16>(packed),
        Some(DType::F16) => rounded::<f16>(packed),
        _ => Ok(Buffer::from_slice(packed)?),
    }
}

/// A host buffer's values as f32 (widened from bf16 or f16, `half`).
fn host_values(buf: &Buffer, half: Option<DType>) -> Result<Vec<f32>, DeviceTrainError> {
    match half {
        Some(DType::BF16) => widen::<bf16>(buf),
        Some(DType::F16) => widen::<f16>(buf),
        _ => Ok(buf.to_vec::<f32>()?),
    }
}

#[path = "device_packing.rs"]
mod packing;
use packing::bad_lengths;
pub(crate) use packing::{lens, Packing};

impl<O: GptOps, C: Communicator + ?Sized> DeviceComm<O> for HostComm<C> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_gather(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        fulls: &mut [&mut O::Buf],
        dtypes: &[DType],
    ) -> Result<(), DeviceTrainError> {
        let halves = gathers_in_bf16(dtypes, shards.len())?;
        let world = DeviceComm::<O>::world_size(self);
        let unit = Packing::all_gather::<O>(shards, fulls, world)?;
        // One collective per dtype: f32's tensors, then bf16's.
        for (half, idx) in dtype_groups(&halves) {
            let p = unit.group(&idx, world)?;
            let mut packed = Vec::with_capacity(p.total);
            for &i in &idx {
                packed.extend(ops.download(shards[i])?);
            }
            let half = half.then_some(DType::BF16);
            let input = host_buffer(&packed, half)?;
            let output = Buffer::zeros(half.unwrap_or(DType::F32), p.total * world)?;
            self.comm.all_gather_base(&input, &output)?.wait()?;
            let gathered = host_values(&output, half)?;
            for (j, &i) in idx.iter().enumerate() {
                let mut values = vec![0.0f32; p.full_lens[j]];
                for c in p.gathered(j, world) {
                    values[c.start..c.start + c.len].copy_from_slice(&gathered[c.at..c.at + c.len]);
                }
                ops.upload_into(&values, fulls[i])?;
            }
        }
        Ok(())
    }

    fn reduce_scatter_avg(
        &self,
        ops: &O,
        fulls: &[&O::Buf],
        shards: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError> {
        let half = reduces_in_half("reduce-scatter", dtype)?;
        let world = DeviceComm::<O>::world_size(self);
        let p = Packing::reduce_scatter::<O>(fulls, shards, world)?;
        let (total, offsets, lens) = (p.total, &p.offsets, &p.lens);
        let mut packed = vec![0.0f32; total * world];
        for (i, full) in fulls.iter().enumerate() {
            let s = lens[i];
            for (r, chunk) in ops.download(full)?.chunks(s.max(1)).enumerate() {
                let to = r * total + offsets[i];
                packed[to..to + chunk.len()].copy_from_slice(chunk);
            }
        }
        let input = host_buffer(&packed, half)?;
        let output = Buffer::zeros(dtype, total)?;
        self.comm
            .reduce_scatter_base(&input, &output, ReduceOp::Avg)?
            .wait()?;
        let reduced = host_values(&output, half)?;
        for (i, shard) in shards.iter_mut().enumerate() {
            ops.upload_into(&reduced[offsets[i]..offsets[i] + lens[i]], shard)?;
        }
        Ok(())
    }

    fn all_reduce_avg(
        &self,
        ops: &O,
        bufs: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError> {
        let half = reduces_in_half("all-reduce", dtype)?;
        let p = Packing::new(lens::<O>(bufs.iter().map(|b| &**b)));
        let (total, offsets, lens) = (p.total, &p.offsets, &p.lens);
        let mut packed = Vec::with_capacity(total);
        for b in bufs.iter() {
            packed.extend(ops.download(b)?);
        }
        let buf = host_buffer(&packed, half)?;
        self.comm.all_reduce(&buf, ReduceOp::Avg)?.wait()?;
        let reduced = host_values(&buf, half)?;
        for (i, b) in bufs.iter_mut().enumerate() {
            ops.upload_into(&reduced[offsets[i]..offsets[i] + lens[i]], b)?;
        }
        Ok(())
    }

    fn all_reduce_scalars(
        &self,
        ops: &O,
        scalars: &mut O::Scalars,
        slots: Range<usize>,
        op: ReduceOp,
    ) -> Result<(), DeviceTrainError> {
        let mut values = ops.wait_scalars(ops.copy_scalars(scalars)?)?;
        let n = values.len();
        let part = values
            .get(slots.clone())
            .ok_or_else(|| bad_lengths("scalars", format!("slots {slots:?} of {n}")))?;
        let buf = Buffer::from_slice(part)?;
        self.comm.all_reduce(&buf, op)?.wait()?;
        values[slots].copy_from_slice(&buf.to_vec::<f64>()?);
        *scalars = ops.scalars(&values)?;
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
        dtypes: &[DType],
    ) -> Result<(), DeviceTrainError> {
        (**self).all_gather(ops, shards, fulls, dtypes)
    }

    fn prefetch_all_gather(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        dtypes: &[DType],
    ) -> Result<bool, DeviceTrainError> {
        (**self).prefetch_all_gather(ops, shards, dtypes)
    }

    fn held_bytes(&self) -> u64 {
        (**self).held_bytes()
    }

    fn reduce_scatter_avg(
        &self,
        ops: &O,
        fulls: &[&O::Buf],
        shards: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError> {
        (**self).reduce_scatter_avg(ops, fulls, shards, dtype)
    }

    fn all_reduce_avg(
        &self,
        ops: &O,
        bufs: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError> {
        (**self).all_reduce_avg(ops, bufs, dtype)
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

/// Reduces a step's scalars over the ranks: the loss averaged (over each node, then over the
/// nodes), and, where the tensors are sharded, each tensor's sum of squares summed over its
/// shards (the nodes hold the same shards).
pub(crate) fn reduce_step_scalars<O: GptOps, C: DeviceComm<O>>(
    comm: &C,
    replicas: Option<&C>,
    factor: usize,
    tensors: usize,
    ops: &O,
    scalars: &mut O::Scalars,
) -> Result<(), DeviceTrainError> {
    use fsdp_kernels::host::{STEP_LOSS, STEP_SQUARES};
    let loss = STEP_LOSS..STEP_LOSS + 1;
    comm.all_reduce_scalars(ops, scalars, loss.clone(), ReduceOp::Avg)?;
    if let Some(r) = replicas {
        r.all_reduce_scalars(ops, scalars, loss, ReduceOp::Avg)?;
    }
    if factor > 1 {
        let squares = STEP_SQUARES..STEP_SQUARES + tensors;
        comm.all_reduce_scalars(ops, scalars, squares, ReduceOp::Sum)?;
    }
    Ok(())
}
