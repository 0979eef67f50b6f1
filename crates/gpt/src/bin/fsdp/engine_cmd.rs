//! `fsdp train --device cuda|cuda:N --engine` (and the hidden `--device host-twin --engine`):
//! the training loop of `--device cpu` (`train.rs`: the engine's sharding, clipping,
//! schedules, grad scaler, non-finite rule, checkpoints), with the engine's buffers on the
//! device and the GPT computed there by its kernels (`EngineGpt` over `CudaOps`, or the host
//! twins' `HostOps`), ranks as threads on the one device.

use fsdp::engine::{ComputeDevice, Fsdp, FsdpConfig, MixedPrecisionPolicy};
use fsdp::optim::OptimizerConfig;
use fsdp::units::UnitPlan;
use fsdp::ParamInit;
use fsdp_collectives::{cuda_ring, ring, Communicator, LaunchEnv};
use fsdp_device::DType;
use fsdp_gpt::device_train::DeviceTrainError;
use fsdp_gpt::engine_gpt::{EngineGpt, GptOnEngine};
use fsdp_gpt::engine_views::EngineViews;
use fsdp_gpt::model::GptConfig;
use fsdp_kernels::gpt::{CudaMemory, CudaOps, GptPass, HostOps};

use crate::args::{DeviceArg, OptimizerKind, TrainArgs};
use crate::device_cmd::{cuda_ordinal, host_products, products};
use crate::{admission, fail, CliError};

/// Where `--engine` runs the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineDevice {
    Cuda(usize),
    HostTwin,
}

/// `--engine`'s device, after checking the options it does not take; `None` without it.
///
/// # Errors
/// `--engine` on the CPU, under a launcher, or with an option it does not support.
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
            DeviceArg::Cuda { ordinal, .. } => {
                cuda_ordinal(args.device, ordinal)?;
                EngineDevice::Cuda(ordinal)
            }
            DeviceArg::HostTwin => EngineDevice::HostTwin,
        };
    if LaunchEnv::from_env()?.is_some() {
        return Err(fail(
            "--engine: ranks as processes are not supported (the engine on a device needs a \
             communicator that orders its stream-ordered buffers: the CUDA ring of --ranks N \
             threads)",
        ));
    }
    if args.backend.is_some() {
        return Err(fail(
            "--engine: --backend is not supported (its ranks are threads on the CUDA ring)",
        ));
    }
    if args.optim.optimizer == OptimizerKind::AnyPrecisionAdamW {
        return Err(fail(
            "--engine: --optimizer anyprecision-adamw is not supported (the engine would keep \
             its shards in --param-dtype, and the GPT's kernels read f32 parameters)",
        ));
    }
    if args.model.alloc_conf.is_some() && dev == EngineDevice::HostTwin {
        return Err(fail("--device host-twin: --alloc-conf is not supported"));
    }
    Ok(Some(dev))
}

/// The engine's configuration on a device: the parameters gathered in f32, which the kernels
/// read in place (`--param-dtype` chooses the products' operands), reduced in
/// `--reduce-dtype` (default f32), the shards offloaded with `--cpu-offload`.
pub(crate) fn engine_config(mut config: FsdpConfig, args: &TrainArgs) -> FsdpConfig {
    let reduce = args.model.reduce_dtype.unwrap_or(DType::F32);
    config.mixed_precision = MixedPrecisionPolicy::new(DType::F32, Some(reduce));
    config.offload_params = args.cpu_offload;
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
            "(with --engine the activations are the host twins' buffers: counted in neither \
             column)"
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
            let device = ComputeDevice::cuda(n, allocator).map_err(|e| on_rank(e.to_string()))?;
            // The activations from the engine's own caching allocator: one pool, one set of
            // statistics.
            let memory = device
                .cuda_allocator()
                .cloned()
                .map(CudaMemory::Caching)
                .ok_or_else(|| on_rank("no caching allocator".into()))?;
            let ops = CudaOps::with_memory(device.compute_stream().clone(), memory)
                .map_err(|e| on_rank(e.to_string()))?
                .with_products(products(dtype));
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
