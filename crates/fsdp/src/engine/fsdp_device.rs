//! [`Fsdp::new_on`]: the engine on a [`ComputeDevice`] (its working set there, and its shards
//! and optimizer state unless offloaded), and what it refuses there.

use fsdp_allocator::MemoryStats;
use fsdp_collectives::Communicator;

use super::super::config::FsdpConfig;
use super::super::device::ComputeDevice;
use super::super::materialize::ParamInit;
use super::Fsdp;
use crate::optim::OptimizerConfig;
use crate::units::UnitPlan;
use crate::FsdpError;

impl Fsdp {
    /// Build this rank's engine as [`Fsdp::new`] does, on `device` (PyTorch FSDP's
    /// `device_id`): the unsharded parameters and gradients are there and the model computes
    /// there; the shards, gradient shards and optimizer state are moved there and the optimizer
    /// steps there, unless [`FsdpConfig::offload_params`] keeps them in host memory
    /// (`CPUOffload(offload_params=True)`; see [`ComputeDevice`]). The model reads its parameters with
    /// [`Params::buffer`](super::super::Params::buffer) and adds its gradients with
    /// [`Grads::grad_buffer`](super::super::Grads::grad_buffer), issuing its work on
    /// [`Params::compute_stream`](super::super::Params::compute_stream).
    ///
    /// ```
    /// use fsdp::engine::{ComputeDevice, Fsdp, FsdpConfig, ParamInit};
    /// use fsdp::optim::SgdConfig;
    /// use fsdp::units::{ParamSpec, UnitPlan, UnitSpec};
    /// use fsdp_collectives::ring;
    ///
    /// let plan = UnitPlan {
    ///     units: vec![UnitSpec { name: String::new(), params: vec![ParamSpec::new("w", vec![4])] }],
    ///     ignored: vec![],
    /// };
    /// let dims = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
    ///     let device = ComputeDevice::host_twin(1 << 26, Default::default()).unwrap();
    ///     let mut fsdp = Fsdp::new_on(
    ///         Box::new(comm), device, &plan, ParamInit::Zeros, FsdpConfig::default(),
    ///         SgdConfig::with_momentum(0.1, 0.0),
    ///     )
    ///     .unwrap();
    ///     fsdp.pre_forward(0).unwrap();
    ///     let views = fsdp.param_views(&[0]).unwrap();
    ///     let w = fsdp.param_id("w").unwrap();
    ///     // On the device the parameters are buffers, not host slices.
    ///     assert!(views.get(w).is_err());
    ///     views.buffer_of(w).unwrap().len()
    /// })
    /// .unwrap();
    /// assert_eq!(dims, vec![4, 4]);
    /// ```
    ///
    /// # Errors
    /// Those of [`Fsdp::new`]; [`FsdpError::InvalidFsdpConfig`] for a communicator on another
    /// device or one that does not order stream-ordered buffers
    /// ([`Communicator::orders_stream_ordered_buffers`]), and on CUDA for
    /// AnyPrecisionAdamW with the shards on the device whose momentum, variance and
    /// compensation dtypes are not one of f32 and bf16; a failing copy or allocation there.
    pub fn new_on(
        comm: Box<dyn Communicator>,
        device: ComputeDevice,
        plan: &UnitPlan,
        init: ParamInit<'_>,
        config: FsdpConfig,
        optim: impl Into<OptimizerConfig>,
    ) -> Result<Self, FsdpError> {
        check_device(comm.as_ref(), &device)?;
        Fsdp::new(comm, plan, init, config, optim)?.placed_on(device)
    }

    /// This engine, just built on the host, moved onto `device`: its working set there, its
    /// shards, gradient shards and optimizer state too unless offloaded.
    pub(crate) fn placed_on(mut self, device: ComputeDevice) -> Result<Self, FsdpError> {
        self.ctx.device = Some(device);
        self.place_shards()?;
        Ok(self)
    }

    /// The device of the unsharded parameters and gradients ([`Fsdp::new_on`]), if not the
    /// host.
    pub fn compute_device(&self) -> Option<&ComputeDevice> {
        self.ctx.device.as_ref()
    }

    /// How many times the limiter ([`FsdpConfig::limit_all_gathers`]) waited on the host for
    /// the device's work on a freed unit's gathered parameters before an all-gather (FSDP1's
    /// rate limiter, which waits on free events): 0 on the host, where a freed unit's memory
    /// is free at once.
    pub fn limiter_free_waits(&self) -> u64 {
        self.ctx.free_waits
    }

    /// How many times the engine blocked the host on a collective or on the device so far: a
    /// wait for a collective's [`Work`](fsdp_collectives::Work) (on the host engine, every
    /// all-gather and reduction), the limiter waiting for freed memory, and on a device every
    /// host synchronisation (the gradient norm, state dicts, [`synchronize`](Self::synchronize),
    /// the end of backward with offloaded shards). On a device the all-gathers and reductions
    /// are not waited for on the host: the model's and the optimizer's work waits for them on
    /// the device. So a steady-state step with the shards on the device (no limiter reached, no
    /// norm read) adds nothing here; its loss read-back is the model's. With a grad scaler
    /// there, [`unscale_grads`](Self::unscale_grads) reading the overflow counts one, and so
    /// does a step that finds the decision of two steps before not yet done; the caller's reads
    /// of the step count and the scaler's numbers ([`optimizer_steps`](Self::optimizer_steps),
    /// [`GradScaler::scale`](super::GradScaler::scale), …) wait as `DeviceScalar::value` does,
    /// uncounted.
    pub fn host_waits(&self) -> u64 {
        self.ctx
            .host_waits
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Wait on the host for everything issued on the device and every collective the engine
    /// did not wait for (PyTorch's `torch.cuda.synchronize()`), and report their errors. On the
    /// host engine, nothing is pending: it returns at once.
    ///
    /// On a device a failed collective is known to the host only when it checks: at the next
    /// unshard or optimizer step (without blocking), or at a host synchronisation (the norm,
    /// state dicts and checkpoints, this call), which then fails. Nothing is saved after a
    /// failure, but parameters stepped after it must not be trusted: restart from the last
    /// checkpoint, as after NCCL's asynchronous errors.
    ///
    /// # Errors
    /// A failed or timed-out collective; a device stream that failed or timed out.
    pub fn synchronize(&self) -> Result<(), FsdpError> {
        self.ctx.synchronize()
    }

    /// The device allocator's statistics ([`Fsdp::new_on`]); `None` on the host (see
    /// [`memory_stats`](Fsdp::memory_stats)).
    pub fn device_memory_stats(&self) -> Option<MemoryStats> {
        self.ctx.device.as_ref().map(ComputeDevice::memory_stats)
    }
}

/// What the engine refuses on `device` before anything is built.
fn check_device(comm: &dyn Communicator, device: &ComputeDevice) -> Result<(), FsdpError> {
    let rank = comm.rank();
    let refuse = |reason: String| {
        Err(FsdpError::InvalidFsdpConfig {
            reason: format!("rank {rank}: {reason}"),
        })
    };
    if comm.device() != device.device() {
        return refuse(format!(
            "the communicator moves buffers on {}, the compute device is {}",
            comm.device(),
            device.device()
        ));
    }
    if !comm.orders_stream_ordered_buffers() {
        return refuse(format!(
            "the communicator does not order stream-ordered buffers, which the engine keeps \
             on {} (the ring backends, the CUDA ring, MPI and NCCL do)",
            device.device()
        ));
    }
    Ok(())
}
