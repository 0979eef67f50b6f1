//! Training the tied-weight MLP example on the engine with its unsharded parameters and
//! gradients on a device (`Fsdp::new_on`, the model run by copies through `HostCompute`: the
//! host engine's arithmetic exactly) or in host memory, one rank's run. Shared by
//! `device_engine` (the host twin of a device) and `gpu_engine` (CUDA).

use std::time::Duration;

use fsdp::engine::{ComputeDevice, FsdpConfig, HostCompute, ParamInit, ScheduleEvent};
use fsdp::optim::OptimizerConfig;
use fsdp::wrap::plan_units;
use fsdp::Fsdp;
use fsdp_collectives::{ring, Communicator};

use crate::common::{adamw, bits, ring_options, Bits, GLOBAL};
use crate::tied_mlp::{self, TiedMlp};

/// Optimizer steps of a run.
pub const STEPS: usize = 3;

/// What a rank's run gives: the losses, the final parameters (bits), the schedule, the host
/// pool's peak allocated bytes and the device's.
pub struct Outcome {
    pub losses: Vec<u32>,
    /// The norms the gradients were clipped by, if they were (read after the last step).
    pub norms: Vec<f64>,
    pub params: Bits,
    pub schedule: Vec<ScheduleEvent>,
    pub host_peak: u64,
    pub device_peak: Option<u64>,
    /// How often the limiter waited for a freed unit's work on the device.
    pub limiter_waits: u64,
}

/// One rank's run of `world`: `STEPS` steps of `micro` micro-batches each (the first ones under
/// `no_sync`) on the host engine (`device` `None`) or on `device`, the model's spans on it
/// lingering for `lag` (`HostCompute::with_lag`). On a device, its memory is checked to hold
/// after the steps, once the deferred frees ran, what it held before them: nothing with
/// `offload_params`, else the shards, gradient shards and optimizer state. The host pool's
/// peak is taken from after the engine was built.
pub fn train_rank(
    comm: Box<dyn Communicator>,
    device: Option<ComputeDevice>,
    lag: Option<Duration>,
    world: usize,
    config: FsdpConfig,
    micro: usize,
) -> Outcome {
    let optim = adamw().into();
    train_rank_with(comm, device, lag, world, config, micro, optim, None)
}

/// [`train_rank`] with the optimizer `optim`, the gradients clipped to `max_norm` each step
/// when it is set (on a device by `clip_grad_norm_async`, the norms read after the last step).
#[allow(clippy::too_many_arguments)]
pub fn train_rank_with(
    comm: Box<dyn Communicator>,
    device: Option<ComputeDevice>,
    lag: Option<Duration>,
    world: usize,
    config: FsdpConfig,
    micro: usize,
    optim: OptimizerConfig,
    max_norm: Option<f64>,
) -> Outcome {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    let model = TiedMlp {
        global: GLOBAL * micro,
    };
    let rank = comm.rank();
    let init = ParamInit::Full(&init);
    let on_device = device.is_some();
    let mut fsdp = match device {
        Some(dev) => Fsdp::new_on(comm, dev, &plan, init, config, optim).unwrap(),
        None => Fsdp::new(comm, &plan, init, config, optim).unwrap(),
    };
    // What the device holds between steps: the shards, gradient shards and optimizer state
    // (nothing with `offload_params`). The host pool's peak counts from here.
    let resident = fsdp.device_memory_stats().map(|s| {
        fsdp_device::wait_for_releases(Duration::from_secs(30)).unwrap();
        let now = fsdp
            .device_memory_stats()
            .unwrap()
            .allocated_bytes
            .all
            .current;
        assert!(s.allocated_bytes.all.current >= now);
        now
    });
    fsdp.reset_peak_memory_stats();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for _ in 0..STEPS {
        let mut loss = 0.0;
        for m in 0..micro {
            let batch = tied_mlp::batch(GLOBAL * micro, rank + m * world, world * micro);
            fsdp.set_no_sync(m + 1 < micro);
            loss += if on_device {
                let mut on = HostCompute::new(&model);
                if let Some(lag) = lag {
                    on = on.with_lag(lag);
                }
                fsdp.forward_backward(&on, &batch).unwrap()
            } else {
                fsdp.forward_backward(&model, &batch).unwrap()
            };
        }
        if let Some(max_norm) = max_norm {
            norms.push(fsdp.clip_grad_norm_async(max_norm).unwrap());
        }
        fsdp.optimizer_step().unwrap();
        losses.push(loss.to_bits());
    }
    let norms = norms.iter().map(|n| n.value().unwrap()).collect();
    // The collectives the host did not wait for hold their buffers until they are known done.
    fsdp.synchronize().unwrap();
    let device_peak = fsdp.device_memory_stats().map(|s| {
        fsdp_device::wait_for_releases(Duration::from_secs(30)).unwrap();
        let now = fsdp.device_memory_stats().unwrap();
        assert_eq!(
            Some(now.allocated_bytes.all.current),
            resident,
            "rank {rank}: the device holds more than the shards and their state after the steps"
        );
        assert_eq!(resident == Some(0), config.offload_params);
        s.allocated_bytes.all.peak
    });
    Outcome {
        losses,
        norms,
        params: bits(&fsdp.full_state_dict().unwrap()),
        schedule: fsdp.schedule().to_vec(),
        host_peak: fsdp.memory_stats().allocated_bytes.all.peak,
        device_peak,
        limiter_waits: fsdp.limiter_free_waits(),
    }
}

/// Rank 0's [`train_rank_with`] of `world` ranks (threads over the ring) on the host engine:
/// the reference of the device runs.
pub fn host_run(
    world: usize,
    config: FsdpConfig,
    optim: OptimizerConfig,
    max_norm: Option<f64>,
) -> Outcome {
    ring::run_ranks(world, ring_options(), |comm| {
        train_rank_with(
            Box::new(comm),
            None,
            None,
            world,
            config,
            1,
            optim,
            max_norm,
        )
    })
    .unwrap()
    .swap_remove(0)
}
