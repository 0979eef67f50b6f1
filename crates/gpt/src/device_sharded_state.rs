//! Saving and restoring a [`ShardedDeviceTrainer`]'s state in the formats of the one-rank
//! trainer ([`DeviceTrainer`](crate::device_train::DeviceTrainer)) and the engine: AdamW's
//! moments gathered whole from the ranks' shards ([`FullOptimizerState`]), a checkpoint in the
//! engine's sharded format written by one rank (world 1: any world, the engine's or a
//! device's, resumes from it), and a saved state loaded back as each rank's shards.

use std::collections::HashMap;
use std::path::Path;

use fsdp::checkpoint::FullOptimizerState;
use fsdp::engine::GradScalerState;
use fsdp_device::DType;
use fsdp_kernels::gpt::{param_shapes, Block, GptOps, HostBuf, Weights};
use fsdp_kernels::host::{unpack_state, STEP_SCALE};
use fsdp_kernels::KernelError;

use crate::device_comm::DeviceComm;
use crate::device_config::DeviceTrainError;
use crate::device_shard::shard_len;
use crate::device_sharded::{ShardSide, ShardedDeviceTrainer};
use crate::device_state::{
    adamw_state, checked_moments, tensor_lens, upload_state, write_state, StateBuffers,
};

impl<O: GptOps, C: DeviceComm<O>> ShardedDeviceTrainer<O, C> {
    /// Device copies of host shards `w` (CPU offload's), in [`param_shapes`] order.
    fn on_device(&self, w: &Weights<HostBuf>) -> Result<Weights<O::Buf>, DeviceTrainError> {
        self.widened(w, |b| Ok(b.to_vec()), DType::F32)
    }

    /// Device copies in f32 of the shards `w` stored in `dtype` (the optimizer state's), each
    /// read by `read`, in [`param_shapes`] order.
    fn widened<B>(
        &self,
        w: &Weights<B>,
        read: impl Fn(&B) -> Result<Vec<f32>, KernelError>,
        dtype: DType,
    ) -> Result<Weights<O::Buf>, DeviceTrainError> {
        let ops = self.pass.ops();
        let mut bufs = Vec::new();
        for ((_, b), len) in w.named().into_iter().zip(tensor_lens(&self.config)) {
            let n = shard_len(len, self.factor);
            bufs.push(ops.upload(&unpack_state(&read(b)?, n, dtype)?)?);
        }
        let mut bufs = bufs.into_iter();
        Ok(Weights::try_build(&self.config.dims(), |name, _| {
            bufs.next().ok_or_else(|| KernelError::InvalidArgument {
                kernel: "offload",
                reason: format!("no shard of {name}"),
            })
        })?)
    }

    /// Every parameter on the host, by name (after every step enqueued): each unit gathered
    /// from the ranks' shards. Every rank calls it.
    ///
    /// # Errors
    /// Collective and copy failures.
    pub fn full_params(&self) -> Result<HashMap<String, Vec<f32>>, DeviceTrainError> {
        match (&self.shards, &self.optim) {
            (Some(w), _) => self.gather(w),
            // CPU offload: the host's master shards, copied to the device to be gathered.
            (None, ShardSide::Host(h, _)) => self.gather(&self.on_device(&h.params)?),
            (None, ShardSide::Device(_)) => Err(KernelError::InvalidArgument {
                kernel: "sharded trainer",
                reason: "no parameter shards".into(),
            }
            .into()),
        }
    }

    /// The full tensors of the shards `w` (shaped as the parameters' shards), by name: each
    /// unit gathered from the ranks. Every rank calls it.
    pub(crate) fn gather(
        &self,
        w: &Weights<O::Buf>,
    ) -> Result<HashMap<String, Vec<f32>>, DeviceTrainError> {
        let ops = self.ops();
        let d = self.config.dims();
        let mut out = HashMap::new();
        let mut keep = |name: String, b: &O::Buf| -> Result<(), DeviceTrainError> {
            out.insert(name, ops.download(b)?);
            Ok(())
        };
        if self.factor == 1 {
            for (name, b) in w.named() {
                keep(name, b)?;
            }
            return Ok(out);
        }
        // One unit at a time, downloaded and freed before the next is gathered.
        let names: Vec<String> = param_shapes(&d).into_iter().map(|(n, _)| n).collect();
        let (first, rest) = names.split_at(2);
        let (blocks, last) = rest.split_at(rest.len() - 2);
        let mut root = Weights::try_build_root(&d, |_, len| ops.empty(len))?;
        self.comm.all_gather(
            ops,
            &w.root_bufs(),
            &mut root.root_bufs_mut(),
            &[DType::F32; 4],
        )?;
        for (name, b) in first.iter().chain(last).zip(root.root_bufs()) {
            keep(name.clone(), b)?;
        }
        drop(root);
        for (l, names) in blocks.chunks(12).enumerate() {
            let mut full = Block::try_build(d.n_embd, |_, len| ops.empty(len))?;
            self.comm.all_gather(
                ops,
                &w.blocks[l].bufs(),
                &mut full.bufs_mut(),
                &[DType::F32; 12],
            )?;
            for (name, b) in names.iter().zip(full.bufs()) {
                keep(name.clone(), b)?;
            }
        }
        Ok(out)
    }

    /// The bytes its communicators hold for their collectives beside the operations' buffers
    /// ([`DeviceComm::held_bytes`]: NCCL's staging buffers, counted in
    /// [`memory`](Self::memory) too).
    pub fn collective_bytes(&self) -> u64 {
        self.comm.held_bytes() + self.replicas.as_ref().map_or(0, DeviceComm::held_bytes)
    }

    /// AdamW's state after every step enqueued so far, whole (each moment gathered from the
    /// ranks' shards): what the one-rank trainer and the engine save. Every rank calls it.
    ///
    /// # Errors
    /// [`DeviceTrainError::Unread`] while an enqueued step's outcome is unread (the count is
    /// not known yet); collective and copy failures.
    pub fn optimizer_state(&self) -> Result<FullOptimizerState, DeviceTrainError> {
        if let Some((step, ..)) = &self.pending {
            return Err(DeviceTrainError::Unread { step: *step });
        }
        let d = self.config.state_dtype();
        let ops = self.pass.ops();
        let mut buffers: StateBuffers = Vec::new();
        match &self.optim {
            // f32 state is gathered where it is; bf16 is widened into f32 shards first.
            ShardSide::Device(o) => {
                for (kind, w) in o.moments.kinds() {
                    let whole = if d == DType::F32 {
                        self.gather(w)?
                    } else {
                        self.gather(&self.widened(w, |b| ops.download(b), d)?)?
                    };
                    buffers.push((kind, whole));
                }
            }
            // CPU offload: the host's shards, copied to the device to be gathered.
            ShardSide::Host(h, _) => {
                for (kind, w) in h.optim.moments.kinds() {
                    let whole = self.gather(&self.widened(w, |b| Ok(b.to_vec()), d)?)?;
                    buffers.push((kind, whole));
                }
            }
        }
        Ok(adamw_state(&self.config, self.known_steps, buffers))
    }

    /// Continues from a saved optimizer state (whole moments: a checkpoint's, the engine's or
    /// a device trainer's), each rank taking its shards, with the optimizer steps taken and
    /// the non-finite steps `skipped` so far. Every rank calls it with the same state.
    ///
    /// # Errors
    /// [`DeviceTrainError::Unread`] while an enqueued step is unread; a state of another
    /// optimizer, with AdamW's step count unequal to the optimizer steps taken, or missing or
    /// mis-sizing a moment (naming it; checked before anything changes); copy failures.
    pub fn load_optimizer_state(
        &mut self,
        state: &FullOptimizerState,
        skipped: u64,
    ) -> Result<(), DeviceTrainError> {
        if let Some((step, ..)) = &self.pending {
            return Err(DeviceTrainError::Unread { step: *step });
        }
        let values = checked_moments(state, &self.config)?;
        let d = self.config.state_dtype();
        let shard = self.comm.rank() % self.factor;
        let ops = self.pass.ops();
        let factor = self.factor;
        let tensors = param_shapes(&self.config.dims()).len();
        let steps = state.optimizer_steps;
        let scalars = self.config.start_scalars(tensors, steps, skipped, None);
        match &mut self.optim {
            ShardSide::Device(o) => upload_state(ops, &mut o.moments, &values, d, shard, factor)?,
            ShardSide::Host(h, _) => {
                let h = &mut **h;
                upload_state(&h.ops, &mut h.optim.moments, &values, d, shard, factor)?;
                h.scalars.copy_from_slice(&scalars);
            }
        }
        self.scalars = ops.scalars(&scalars)?;
        self.known_steps = state.optimizer_steps;
        self.scaler_state = self.config.initial_scaler_state();
        Ok(())
    }

    /// Continues with the grad scaler's saved state, as
    /// [`DeviceTrainer::set_grad_scaler_state`](crate::device_train::DeviceTrainer::set_grad_scaler_state)
    /// (every rank the same state).
    ///
    /// # Errors
    /// [`DeviceTrainError::Unread`] while an enqueued step is unread; no grad scaler
    /// configured, or a scale that is not finite and positive; copy failures.
    pub fn set_grad_scaler_state(
        &mut self,
        state: GradScalerState,
    ) -> Result<(), DeviceTrainError> {
        if let Some((step, ..)) = &self.pending {
            return Err(DeviceTrainError::Unread { step: *step });
        }
        let slots = crate::device_state::scaler_slots(&self.config, state)?;
        let ops = self.pass.ops();
        ops.write_scalars(&mut self.scalars, STEP_SCALE, &slots)?;
        if let ShardSide::Host(h, _) = &mut self.optim {
            h.ops.write_scalars(&mut h.scalars, STEP_SCALE, &slots)?;
        }
        self.scaler_state = Some(state);
        Ok(())
    }

    /// The grad scaler's state as far as the outcomes read say: `None` without a scaler.
    pub fn grad_scaler_state(&self) -> Option<GradScalerState> {
        self.scaler_state
    }

    /// Gathers the parameters and the optimizer state and, on the rank given a directory,
    /// writes them there as a checkpoint in the engine's sharded format (world 1); the other
    /// ranks pass `None`. Every rank calls it.
    ///
    /// # Errors
    /// As [`optimizer_state`](Self::optimizer_state); a failed write.
    pub fn save_checkpoint(&self, dir: Option<&Path>) -> Result<(), DeviceTrainError> {
        let o = self.optimizer_state()?;
        let params = self.full_params()?;
        match dir {
            Some(dir) => {
                write_state(dir, &self.config, &params, &o)?;
                crate::device_state::save_scaler(dir, &self.config, self.scaler_state)
            }
            None => Ok(()),
        }
    }
}
