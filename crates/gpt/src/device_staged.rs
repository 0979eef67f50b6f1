//! [`StagedComm`]: the collectives of sharded training over a [`Communicator`] whose buffers
//! live where the operations' do — NCCL's on the operations' GPU (`CudaOps`), the ring's or
//! TCP's in host memory (the host twins). A unit's buffers are packed into one staging buffer
//! of the communicator by the operations themselves ([`StagingOps`]: FSDP2's copy-in), the
//! collective runs once on it, and the result is copied out into the unit's buffers
//! ([`PeerOps::copy_from_peer`](fsdp_kernels::gpt::PeerOps::copy_from_peer)). On a GPU
//! nothing waits on the host: the communicator's stream waits for an event after the
//! packing, and the operations' stream for the collective's end event before the copies out
//! (`ProcessGroupNCCL`'s current-stream ordering).
//!
//! An all-gather can be issued ahead of its use
//! ([`prefetch_all_gather`](DeviceComm::prefetch_all_gather)): it runs on the communicator's
//! stream (the ring's thread on the host) while the operations compute, on a pair of staging
//! buffers of its own, and the all-gather of the same shards completes it.
//!
//! A reduction in bf16 packs the unit's gradients rounded to bf16 (the cast kernel into the
//! staging address), runs the communicator's bf16 collective, and widens the result out; an
//! all-gather runs one collective per dtype of the unit's tensors, its bf16 ones packed
//! rounded and widened out the same way.
//!
//! The staging buffers (`device_staged_slots.rs`) are kept between calls and grown to the
//! largest unit: an input and an output of f32, one of f64 for the step's scalars, the
//! prefetch's pair, and, once a collective in bf16 has run, pairs of bf16 (one for prefetches).
//! They are counted in the operations' memory ([`StagingOps::count`]), so the operations'
//! peak is the device's.

use std::cell::{Cell, RefCell};
use std::ops::Range;

use fsdp_collectives::{Communicator, ReduceOp, Work};
use fsdp_device::{AccessMode, Buffer, DType, Device};
use fsdp_kernels::gpt::{PeerPtr, StagingOps};
use fsdp_kernels::host::ReduceKind;

use crate::device_comm::{
    dtype_groups, gathers_in_bf16, lens, reduces_in_half, DeviceComm, Packing,
};

#[path = "device_staged_slots.rs"]
mod slots;
use crate::device_config::DeviceTrainError;
use slots::{Gather, Prefetched, Slot, Staging};

/// [`DeviceComm`] over a communicator whose buffers are in the operations' memory (module
/// docs): NCCL for `CudaOps` on a GPU, any host communicator for the host twins.
pub struct StagedComm<C: ?Sized> {
    staging: RefCell<Staging>,
    /// The all-gather started by [`prefetch_all_gather`](DeviceComm::prefetch_all_gather).
    prefetched: RefCell<Option<Prefetched>>,
    /// Prefetched all-gathers used by the all-gather of their shards, and completed unused.
    prefetch_counts: Cell<(u64, u64)>,
    comm: Box<C>,
}

impl<C: Communicator + ?Sized> StagedComm<C> {
    /// Collectives over `comm`, staged in buffers on its stream's device: device memory
    /// (zeroed on the operations' stream) where that is a GPU, host memory otherwise, sizes
    /// only for meta operations.
    pub fn new(comm: Box<C>) -> StagedComm<C> {
        StagedComm {
            staging: RefCell::new(Staging::default()),
            prefetched: RefCell::new(None),
            prefetch_counts: Cell::new((0, 0)),
            comm,
        }
    }

    /// The communicator.
    pub fn communicator(&self) -> &C {
        &self.comm
    }

    /// The all-gathers started by
    /// [`prefetch_all_gather`](DeviceComm::prefetch_all_gather) so far: those the all-gather
    /// of their shards used, and those completed unused (another all-gather or prefetch came
    /// first).
    pub fn prefetched_gathers(&self) -> (u64, u64) {
        self.prefetch_counts.get()
    }

    /// Runs `f` with the address of `buf` as `ops` reach it: a stream-ordered device buffer
    /// used on the operations' stream, or a host buffer under an access guard.
    fn with_ptr<O: StagingOps, R>(
        &self,
        ops: &O,
        buf: &Buffer,
        mode: AccessMode,
        f: impl FnOnce(PeerPtr) -> Result<R, DeviceTrainError>,
    ) -> Result<R, DeviceTrainError> {
        let len = buf.len();
        match (buf.stream_order(), ops.device_stream()) {
            (Some(_), Some(stream)) => {
                let usage = buf.use_on(stream, mode)?;
                let r = f(PeerPtr {
                    addr: usage.device_ptr() as usize,
                    len,
                });
                usage.finish();
                r
            }
            (None, None) if buf.device() == Device::Meta && ops.is_meta() => {
                f(PeerPtr { addr: 0, len })
            }
            (None, None) if buf.device() == Device::Cpu => {
                let guard = buf.access(mode).acquire(self.comm.stream().timeout())?;
                f(PeerPtr {
                    addr: guard.as_ptr().expose_provenance(),
                    len,
                })
            }
            _ => Err(self.misplaced(buf.device(), ops)),
        }
    }

    /// The error of staging buffers on `device` for operations that cannot reach them.
    fn misplaced<O: StagingOps>(&self, device: Device, ops: &O) -> DeviceTrainError {
        fsdp::FsdpError::InvalidShape {
            reason: format!(
                "rank {}: the communicator's buffers are on {device} but the operations run {}: \
                 stage through the host (HostComm) instead",
                self.comm.rank(),
                match ops.device_stream() {
                    Some(s) => format!("on stream `{}` of {}", s.name(), s.device()),
                    None => "on the host".into(),
                }
            ),
        }
        .into()
    }

    /// Issues the collective `f` after the operations' work so far.
    fn launch<O: StagingOps>(
        &self,
        ops: &O,
        f: impl FnOnce(&C) -> fsdp_collectives::Result<Work>,
    ) -> Result<Work, DeviceTrainError> {
        if let Some(s) = ops.device_stream() {
            self.comm.stream().wait_event(&s.record_event())?;
        }
        Ok(f(&self.comm)?)
    }

    /// Orders the operations' later work after `work` (on a GPU, without a host wait).
    fn complete<O: StagingOps>(&self, ops: &O, work: &Work) -> Result<(), DeviceTrainError> {
        work.wait()?;
        if let Some(s) = ops.device_stream() {
            s.wait_event(work.event())?;
        }
        Ok(())
    }

    /// Runs the collective `f` after the operations' work so far, and orders the operations'
    /// later work after it.
    fn run<O: StagingOps>(
        &self,
        ops: &O,
        f: impl FnOnce(&C) -> fsdp_collectives::Result<Work>,
    ) -> Result<(), DeviceTrainError> {
        let work = self.launch(ops, f)?;
        self.complete(ops, &work)
    }

    /// `bufs` packed one after the other (`p`) into `len` elements of the staging buffer
    /// `slot` (`len` ≥ `p.total`; the rest is left as it is), rounded to bf16 or f16 where the
    /// slot is of that type.
    fn pack<O: StagingOps>(
        &self,
        ops: &O,
        bufs: &[&O::Buf],
        p: &Packing,
        slot: Slot,
        len: usize,
    ) -> Result<Buffer, DeviceTrainError> {
        let buf = self.buffer(ops, slot, len)?;
        self.with_ptr(ops, &buf, AccessMode::Exclusive, |to| {
            for (i, b) in bufs.iter().enumerate() {
                // SAFETY: `to` is the staging buffer (of its dtype), held for this copy
                // (`with_ptr`).
                unsafe { pack_into(ops, b, 0, to, p.offsets[i], p.lens[i], buf.dtype())? };
            }
            Ok(())
        })?;
        Ok(buf)
    }

    /// Copies `from`'s packed elements (`p`) out into `bufs` (widened from bf16 or f16 where
    /// `from` is of that type).
    fn unpack<O: StagingOps>(
        &self,
        ops: &O,
        from: &Buffer,
        p: &Packing,
        bufs: &mut [&mut O::Buf],
    ) -> Result<(), DeviceTrainError> {
        let dtype = from.dtype();
        let half = matches!(dtype, DType::BF16 | DType::F16);
        self.with_ptr(ops, from, AccessMode::Shared, |from| {
            for (i, b) in bufs.iter_mut().enumerate() {
                let (at, n) = (p.offsets[i], p.lens[i]);
                // SAFETY: `from` is a staging buffer (of its dtype) written by the collective
                // the operations were ordered after, and held for this copy (`with_ptr`).
                unsafe {
                    if half {
                        ops.widen_half_ptr(dtype, from, at, b, 0, n)?
                    } else {
                        ops.copy_from_peer(from, at, b, 0, n)?
                    }
                };
            }
            Ok(())
        })
    }

    /// Issues the all-gather of `shards`, one collective per dtype (`halves`: which move in
    /// bf16): each group packed into its staging input and gathered into its staging output
    /// (the prefetch's pairs when `prefetch`).
    fn start_gather<O: StagingOps>(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        halves: &[bool],
        prefetch: bool,
    ) -> Result<Vec<Gather>, DeviceTrainError> {
        let world = self.comm.world_size();
        let mut gathers = Vec::new();
        for (half, idx) in dtype_groups(halves) {
            let group: Vec<&O::Buf> = idx.iter().map(|&i| shards[i]).collect();
            let p = Packing::new(lens::<O>(group.iter().copied()));
            let (slot_in, slot_out) = Slot::gather(prefetch, half);
            let input = self.pack(ops, &group, &p, slot_in, p.total)?;
            let output = self.buffer(ops, slot_out, p.total * world)?;
            let work = self.launch(ops, |c| c.all_gather_base(&input, &output))?;
            gathers.push(Gather {
                half,
                idx,
                output,
                work,
            });
        }
        Ok(gathers)
    }

    /// Completes the pending prefetch, if any, that is not of `key` (shards and dtypes);
    /// returns the one that is.
    fn take_prefetched<O: StagingOps>(
        &self,
        ops: &O,
        key: Option<(&[PeerPtr], &[DType])>,
    ) -> Result<Option<Prefetched>, DeviceTrainError> {
        match self.prefetched.borrow_mut().take() {
            Some(p) if Some((p.key.as_slice(), p.dtypes.as_slice())) == key => {
                let (used, unused) = self.prefetch_counts.get();
                self.prefetch_counts.set((used + 1, unused));
                Ok(Some(p))
            }
            Some(p) => {
                let (used, unused) = self.prefetch_counts.get();
                self.prefetch_counts.set((used, unused + 1));
                // Never used: completed so that its staging buffers can be written again.
                for g in &p.gathers {
                    self.complete(ops, &g.work)?;
                }
                Ok(None)
            }
            None => Ok(None),
        }
    }
}

/// Enqueues `len` elements of `src` from `src_offset` into the staging memory `to` (of
/// `dtype`: f32 copied, bf16 or f16 rounded) from `at`.
///
/// # Safety
/// As [`StagingOps::copy_to_ptr`], for `to` of `dtype`.
unsafe fn pack_into<O: StagingOps>(
    ops: &O,
    src: &O::Buf,
    src_offset: usize,
    to: PeerPtr,
    at: usize,
    len: usize,
    dtype: DType,
) -> Result<(), DeviceTrainError> {
    // SAFETY: the caller's contract.
    unsafe {
        match dtype {
            DType::BF16 | DType::F16 => {
                ops.cast_to_half_ptr(dtype, src, src_offset, to, at, len)?
            }
            _ => ops.copy_to_ptr(src, src_offset, to, at, len)?,
        }
    }
    Ok(())
}

/// The shards' addresses and lengths, which identify a prefetched all-gather.
fn key_of<O: StagingOps>(ops: &O, shards: &[&O::Buf]) -> Vec<PeerPtr> {
    shards.iter().map(|s| ops.peer_ptr(s)).collect()
}

impl<O: StagingOps, C: Communicator + ?Sized> DeviceComm<O> for StagedComm<C> {
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
        let world = self.comm.world_size();
        let unit = Packing::all_gather::<O>(shards, fulls, world)?;
        let key = key_of(ops, shards);
        let gathers = match self.take_prefetched(ops, Some((&key, dtypes)))? {
            Some(p) => p.gathers,
            None => self.start_gather(ops, shards, &halves, false)?,
        };
        for g in gathers {
            self.complete(ops, &g.work)?;
            let p = unit.group(&g.idx, world)?;
            self.with_ptr(ops, &g.output, AccessMode::Shared, |from| {
                for (j, &i) in g.idx.iter().enumerate() {
                    let full = &mut *fulls[i];
                    for c in p.gathered(j, world) {
                        // SAFETY: `from` is the staging output (of its dtype), written by the
                        // collective the operations were ordered after, and held for this
                        // copy (`with_ptr`).
                        unsafe {
                            if g.half {
                                let b = DType::BF16;
                                ops.widen_half_ptr(b, from, c.at, full, c.start, c.len)?
                            } else {
                                ops.copy_from_peer(from, c.at, full, c.start, c.len)?
                            }
                        };
                    }
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    fn held_bytes(&self) -> u64 {
        self.staging_bytes() as u64
    }

    fn prefetch_all_gather(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        dtypes: &[DType],
    ) -> Result<bool, DeviceTrainError> {
        let halves = gathers_in_bf16(dtypes, shards.len())?;
        self.take_prefetched(ops, None)?;
        let key = key_of(ops, shards);
        let gathers = self.start_gather(ops, shards, &halves, true)?;
        *self.prefetched.borrow_mut() = Some(Prefetched {
            key,
            dtypes: dtypes.to_vec(),
            gathers,
        });
        Ok(true)
    }

    fn reduce_scatter_avg(
        &self,
        ops: &O,
        fulls: &[&O::Buf],
        shards: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError> {
        let half = reduces_in_half("reduce-scatter", dtype)?;
        let world = self.comm.world_size();
        let p = Packing::reduce_scatter::<O>(fulls, shards, world)?;
        let (slot_in, slot_out) = Slot::reduction(half);
        let input = self.buffer(ops, slot_in, p.total * world)?;
        let output = self.buffer(ops, slot_out, p.total)?;
        self.with_ptr(ops, &input, AccessMode::Exclusive, |to| {
            for (i, full) in fulls.iter().enumerate() {
                for r in 0..world {
                    let (start, n) = p.chunk(i, r);
                    let at = r * p.total + p.offsets[i];
                    // SAFETY: `to` is the staging input (of `dtype`), held for these writes
                    // (`with_ptr`).
                    unsafe {
                        if n > 0 {
                            pack_into(ops, full, start, to, at, n, dtype)?;
                        }
                        ops.zero_ptr(to, at + n, p.lens[i] - n, dtype)?;
                    }
                }
            }
            Ok(())
        })?;
        self.run(ops, |c| {
            c.reduce_scatter_base(&input, &output, ReduceOp::Avg)
        })?;
        self.unpack(ops, &output, &p, shards)
    }

    fn all_reduce_avg(
        &self,
        ops: &O,
        bufs: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError> {
        let half = reduces_in_half("all-reduce", dtype)?;
        let p = Packing::new(lens::<O>(bufs.iter().map(|b| &**b)));
        let refs: Vec<&O::Buf> = bufs.iter().map(|b| &**b).collect();
        let buf = self.pack(ops, &refs, &p, Slot::reduction(half).0, p.total)?;
        self.run(ops, |c| c.all_reduce(&buf, ReduceOp::Avg))?;
        self.unpack(ops, &buf, &p, bufs)
    }

    fn all_reduce_scalars(
        &self,
        ops: &O,
        scalars: &mut O::Scalars,
        slots: Range<usize>,
        op: ReduceOp,
    ) -> Result<(), DeviceTrainError> {
        let n = ops.scalars_ptr(scalars).len;
        if slots.start > slots.end || slots.end > n {
            return Err(fsdp::FsdpError::InvalidShape {
                reason: format!("scalars: slots {slots:?} of {n}"),
            }
            .into());
        }
        let len = slots.len();
        let buf = self.buffer(ops, Slot::Scalars, len)?;
        self.with_ptr(ops, &buf, AccessMode::Exclusive, |to| {
            // SAFETY: `to` is the f64 staging buffer, held for this copy (`with_ptr`).
            unsafe { ops.copy_scalars_to_ptr(scalars, slots.start, to, 0, len)? };
            Ok(())
        })?;
        self.run(ops, |c| c.all_reduce(&buf, op))?;
        self.with_ptr(ops, &buf, AccessMode::Shared, |from| {
            // One source: a copy back into the slots.
            // SAFETY: as in `all_gather`.
            unsafe {
                ops.reduce_scalars_from_peers(
                    ReduceKind::Sum,
                    &[(from, 0)],
                    scalars,
                    slots.start,
                    len,
                )?
            };
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_collectives::ring;
    use fsdp_kernels::gpt::{GptOps, HostOps};

    /// Two ranks of the ring gather, reduce-scatter (a tensor shorter than the world's
    /// shards: its padding zeroed in the reused staging input) and all-reduce scalars
    /// through host staging buffers. (Under Miri: the packing writes and the copies out by
    /// address stay in the staging buffers, under their access guards.)
    #[test]
    fn two_ranks_stage_a_unit_through_the_ring() {
        ring::run_ranks(2, ring::RingOptions::default(), |c| {
            let comm = StagedComm::new(Box::new(c));
            let ops = HostOps::new();
            let rank = DeviceComm::<HostOps>::rank(&comm);
            let r = rank as f32;
            let shards = [
                ops.upload(&[r, r + 0.5]).unwrap(),
                ops.upload(&[r]).unwrap(),
            ];
            let mut fulls = [ops.zeros(4).unwrap(), ops.zeros(1).unwrap()];
            let mut outs: Vec<_> = fulls.iter_mut().collect();
            comm.all_gather(&ops, &[&shards[0], &shards[1]], &mut outs, &[DType::F32; 2])
                .unwrap();
            assert_eq!(fulls[0].to_vec(), [0.0, 0.5, 1.0, 1.5]);
            assert_eq!(fulls[1].to_vec(), [0.0]);
            let own = [
                ops.upload(&[r; 4]).unwrap(),
                ops.upload(&[2.0 * r + 1.0]).unwrap(),
            ];
            let mut red = [ops.zeros(2).unwrap(), ops.zeros(1).unwrap()];
            let mut outs: Vec<_> = red.iter_mut().collect();
            comm.reduce_scatter_avg(&ops, &[&own[0], &own[1]], &mut outs, DType::F32)
                .unwrap();
            assert_eq!(red[0].to_vec(), [0.5, 0.5]);
            // Rank 1's chunk of the one-element tensor is padding (zero, not the staging
            // buffer's earlier contents).
            let want = if rank == 0 { 2.0 } else { 0.0 };
            assert_eq!(red[1].to_vec(), [want]);
            let mut scalars = ops.scalars(&[r.into(), 1.0, 5.0]).unwrap();
            comm.all_reduce_scalars(&ops, &mut scalars, 0..2, ReduceOp::Sum)
                .unwrap();
            assert_eq!(scalars.to_vec(), [1.0, 2.0, 5.0]);
            let e = comm
                .all_reduce_scalars(&ops, &mut scalars, 2..4, ReduceOp::Sum)
                .unwrap_err();
            assert!(e.to_string().contains("slots 2..4 of 3"), "{e}");
            assert!(comm.staging_bytes() >= 4 * 4 + 4 * 2 + 8 * 2);
        })
        .unwrap();
    }
}
