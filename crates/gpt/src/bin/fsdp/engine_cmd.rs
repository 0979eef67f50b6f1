//! `fsdp train --device cuda|cuda:N --engine` (and the hidden `--device host-twin --engine`):
//! the training loop of `--device cpu` (`train.rs`: the engine's sharding, clipping,
//! schedules, grad scaler, non-finite rule, checkpoints), with the engine's buffers on the
//! device and the GPT computed there by its kernels (`EngineGpt` over `CudaOps`, or the host
//! twins' `HostOps`): ranks as threads on the one device (the CUDA ring, or the ring on the host
//! twin), or as processes under `fsdp launch`, one GPU each over NCCL (the host twin over
//! TCP).

use fsdp::engine::{ComputeDevice, Fsdp, FsdpConfig, MixedPrecisionPolicy};
use fsdp::optim::OptimizerConfig;
use fsdp::units::UnitPlan;
use fsdp::ParamInit;
use fsdp_collectives::{cuda_ring, ring, Backend, Communicator, LaunchEnv};
use fsdp_device::DType;
use fsdp_gpt::device_train::DeviceTrainError;
use fsdp_gpt::engine_gpt::{EngineGpt, GptOnEngine};
use fsdp_gpt::engine_views::{cuda_ops_on, EngineViews};
use fsdp_gpt::model::GptConfig;
use fsdp_kernels::gpt::{GptPass, HostOps};

use crate::args::{DeviceArg, ModelArgs, OptimizerKind, TrainArgs, TrainBackend};
use crate::device_cmd::{cuda_ordinal, host_products, products};
use crate::setup::DEFAULT_RANKS;
use crate::train_checks::{check_ranks_given, mpi_world_from_env, Mode, RING_UNDER_LAUNCHER};
use crate::{admission, fail, CliError};

/// Where `--engine` runs the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineDevice {
    Cuda(usize),
    HostTwin,
}

impl EngineDevice {
    /// The bound of the host's memory for a run on this device: `--memory-limit` (`limit`) on
    /// the host twin, whose device memory is the host's; on CUDA, where it bounds the device,
    /// none (the host's available memory).
    pub(crate) fn host_memory_limit(self, limit: Option<u64>) -> Option<u64> {
        match self {
            EngineDevice::HostTwin => limit,
            EngineDevice::Cuda(_) => None,
        }
    }
}

/// `--engine`'s device, after checking the options it does not take; `None` without it. Under
/// a launcher `--device cuda` is the GPU of the rank's local rank (torchrun's convention).
///
/// # Errors
/// `--engine` on the CPU, ranks of a host sharing a GPU under a launcher, or an option it does
/// not support.
pub(crate) fn engine_device(args: &TrainArgs) -> Result<Option<EngineDevice>, CliError> {
    if !args.engine {
        return Ok(None);
    }
    let dev =
        match args.device {
            DeviceArg::Cpu => return Err(fail(
                "--engine: only with --device cuda|cuda:N (on --device cpu the engine trains the \
                 reference GPT already)",
            )),
            DeviceArg::Cuda { ordinal, indexed } => {
                let n = match LaunchEnv::from_env()? {
                    Some(env) => launched_gpu(args.device, &env, ordinal, indexed)?,
                    None => ordinal,
                };
                cuda_ordinal(args.device, n)?;
                EngineDevice::Cuda(n)
            }
            DeviceArg::HostTwin => EngineDevice::HostTwin,
        };
    if args.optim.optimizer == OptimizerKind::AnyPrecisionAdamW {
        return Err(fail(
            "--engine: --optimizer anyprecision-adamw is not supported (the engine would keep \
             its shards in --param-dtype, and the GPT's kernels read f32 parameters)",
        ));
    }
    Ok(Some(dev))
}

/// The GPU of a rank under a launcher: `cuda:N`'s, or the local rank's with `cuda`; NCCL takes
/// one GPU per rank, so the ranks of a host must not share one.
///
/// # Errors
/// Ranks of this host sharing a GPU; no CUDA device.
fn launched_gpu(
    dev: DeviceArg,
    env: &LaunchEnv,
    ordinal: usize,
    indexed: bool,
) -> Result<usize, CliError> {
    let count = fsdp_device::cuda::device_count()
        .map_err(|e| fail(format!("--device {dev}: no CUDA device ({e})")))?;
    let local = env.local_world_size;
    if local > 1 && (indexed || local > count) {
        return Err(fail(format!(
            "--device {dev} --engine: the {local} ranks of this host would share {} GPU{}, and \
             NCCL takes one GPU per rank: run them as threads (--ranks {local}, the CUDA ring) \
             or give each rank a GPU",
            if indexed { 1 } else { count },
            if indexed || count == 1 { "" } else { "s" }
        )));
    }
    Ok(if indexed { ordinal } else { env.local_rank })
}

/// How `--engine`'s ranks run: as threads on the one device (no launcher; `--backend` ring or
/// none), or this process as one rank of a launch — over NCCL on a GPU, over TCP on the host
/// twin (the backends that order the engine's stream-ordered buffers there).
///
/// # Errors
/// A backend the engine's device does not run with; `--ranks` other than the launcher's
/// world; `mpirun`.
pub(crate) fn engine_mode(dev: EngineDevice, args: &TrainArgs) -> Result<Mode, CliError> {
    let backend = match args.backend {
        None | Some(TrainBackend::Ring) => None,
        Some(TrainBackend::Process(b)) => Some(b),
    };
    let Some(env) = LaunchEnv::from_env()? else {
        if mpi_world_from_env().is_some() || backend.is_some() {
            return Err(fail(
                "--engine: ranks as processes run under fsdp launch (nccl on --device cuda, tcp \
                 on the host twin); without it the ranks are threads (--backend ring)",
            ));
        }
        return Ok(Mode::Threads(args.model.ranks.unwrap_or(DEFAULT_RANKS)));
    };
    if args.backend == Some(TrainBackend::Ring) {
        return Err(fail(RING_UNDER_LAUNCHER));
    }
    let backend = match (dev, backend) {
        (EngineDevice::Cuda(_), None | Some(Backend::Nccl)) => Backend::Nccl,
        (EngineDevice::HostTwin, None | Some(Backend::Tcp)) => Backend::Tcp,
        (_, Some(b)) => {
            return Err(fail(format!(
                "--device {} --engine under a launcher: --backend {b} is not supported ({})",
                args.device,
                match dev {
                    EngineDevice::Cuda(_) => "nccl: the engine's buffers are on the GPU",
                    EngineDevice::HostTwin => "tcp",
                }
            )))
        }
    };
    check_ranks_given(args.model.ranks, env.world_size)?;
    Ok(Mode::Process {
        backend,
        world: env.world_size,
    })
}

/// The engine's configuration on a device: the parameters gathered in f32, which the kernels
/// read in place (`--param-dtype` chooses the products' operands), reduced in
/// `--reduce-dtype` (default f32), the shards offloaded with `--cpu-offload`.
pub(crate) fn engine_config(
    mut config: FsdpConfig,
    model: &ModelArgs,
    cpu_offload: bool,
) -> FsdpConfig {
    let reduce = model.reduce_dtype.unwrap_or(DType::F32);
    config.mixed_precision = MixedPrecisionPolicy::new(DType::F32, Some(reduce));
    config.offload_params = cpu_offload;
    config
}

/// How `--engine` names its device in the run's first line.
pub(crate) fn describe(dev: EngineDevice, args: &TrainArgs) -> String {
    let products = match args.model.param_dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    };
    let place = match dev {
        EngineDevice::Cuda(_) => format!("{}", args.device),
        EngineDevice::HostTwin => "the host twin of a device".into(),
    };
    format!(
        "on {place} through the engine (the GPT's kernels on its f32 buffers, {products} \
         products{})",
        if args.cpu_offload {
            ", shards offloaded"
        } else {
            ""
        }
    )
}

/// What the summary's activations are with `--engine`: the kernels' buffers, which the
/// engine does not see.
pub(crate) fn activations_line(dev: EngineDevice) -> &'static str {
    match dev {
        EngineDevice::Cuda(_) => {
            "(with --engine the activations are the GPT's kernels' buffers, taken from the \
             engine's caching allocator: counted in peak allocated, not in activations)"
        }
        EngineDevice::HostTwin => {
            "(with --engine the activations are the host twins' buffers, counted apart: the \
             device memory line)"
        }
    }
}

/// What every rank's `--engine` model is built from.
pub(crate) struct EngineRun<'a> {
    pub(crate) cfg: GptConfig,
    pub(crate) plan: &'a UnitPlan,
    pub(crate) config: FsdpConfig,
    pub(crate) opt: OptimizerConfig,
    pub(crate) args: &'a TrainArgs,
    /// The bound of every wait (`--timeout`): the device's streams' too.
    pub(crate) timeout: std::time::Duration,
}

/// One rank's engine on `dev` with the GPT's kernels.
///
/// # Errors
/// The device, the engine or the kernels failing to start, naming the rank.
pub(crate) fn engine_model(
    dev: EngineDevice,
    comm: Box<dyn Communicator>,
    init: ParamInit<'_>,
    run: &EngineRun<'_>,
) -> Result<Box<dyn GptOnEngine>, CliError> {
    let rank = comm.rank();
    let device_arg = run.args.device;
    let on_rank = |e: String| fail(format!("--device {device_arg} --engine: rank {rank}: {e}"));
    let (allocator, dtype) = (run.config.allocator, run.args.model.param_dtype);
    match dev {
        EngineDevice::Cuda(n) => {
            let device = ComputeDevice::cuda_with_timeout(n, allocator, run.timeout)
                .map_err(|e| on_rank(e.to_string()))?;
            // The activations from the engine's own caching allocator: one pool, one set of
            // statistics.
            let ops = cuda_ops_on(&device, products(dtype)).map_err(|e| on_rank(e.to_string()))?;
            build(device, ops, comm, init, run)
        }
        EngineDevice::HostTwin => {
            let device = ComputeDevice::host_twin(run.config.memory_capacity, allocator)
                .map_err(|e| on_rank(e.to_string()))?;
            build(
                device,
                HostOps::with_products(host_products(dtype)),
                comm,
                init,
                run,
            )
        }
    }
    .map_err(|e| match e {
        DeviceTrainError::Fsdp(e) => admission::on_rank(rank)(e),
        e => on_rank(e.to_string()),
    })
}

fn build<O: EngineViews + 'static>(
    device: ComputeDevice,
    ops: O,
    comm: Box<dyn Communicator>,
    init: ParamInit<'_>,
    run: &EngineRun<'_>,
) -> Result<Box<dyn GptOnEngine>, DeviceTrainError> {
    let fsdp = Fsdp::new_on(comm, device, run.plan, init, run.config, run.opt)?;
    let model = &run.args.model;
    let mut pass = GptPass::new(ops, run.cfg.dims())?;
    pass.set_activation_checkpointing(model.activation_checkpointing);
    if let Some(a) = model.attention {
        pass.set_attention(a);
    }
    if let Some(l) = model.logits {
        pass.set_logits(l);
    }
    Ok(Box::new(EngineGpt::new(fsdp, pass)?))
}

/// Runs `world` ranks as threads on `dev` (the CUDA ring on a GPU, the ring on the host twin),
/// each calling `run` with its communicator.
///
/// # Errors
/// The communicators failing to start.
pub(crate) fn run_ranks<R: Send>(
    dev: EngineDevice,
    world: usize,
    timeout: std::time::Duration,
    run: impl Fn(Box<dyn Communicator>) -> R + Sync,
) -> Result<Vec<R>, CliError> {
    Ok(match dev {
        EngineDevice::Cuda(n) => {
            let opts = cuda_ring::CudaRingOptions::default().with_timeout(timeout);
            cuda_ring::run_ranks(n, world, opts, |c| run(Box::new(c)))?
        }
        EngineDevice::HostTwin => {
            let opts = ring::RingOptions::default().with_timeout(timeout);
            ring::run_ranks(world, opts, |c| run(Box::new(c)))?
        }
    })
}
