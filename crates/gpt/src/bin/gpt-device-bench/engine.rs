//! `gpt-device-bench --engine`: the same model trained through the `fsdp` engine (`EngineGpt`,
//! FULL_SHARD at world 1, the engine's buffers on the device), with the device trainer's
//! options as `fsdp train --engine` takes them.

use fsdp::engine::{ComputeDevice, Fsdp, FsdpConfig, ParamInit};
use fsdp::optim::{decay_2d_only, decay_2d_only_group};
use fsdp::ShardingStrategy;
use fsdp_allocator::AllocatorConfig;
use fsdp_collectives::{cuda_ring, ring, Communicator};
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_bench::{time_engine_steps, StepTimes};
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig};
use fsdp_gpt::engine_gpt::EngineGpt;
use fsdp_gpt::engine_views::{cuda_ops_on, EngineViews};
use fsdp_gpt::tree::gpt_block_plan;
use fsdp_kernels::gpt::{GptPass, HostOps, HostProducts, Products};

use crate::Args;

/// One rank's `--engine` run: `config`'s model on `fsdp`'s device through the engine.
fn engine_times<O: EngineViews>(
    comm: Box<dyn Communicator>,
    dev: ComputeDevice,
    ops: O,
    config: &DeviceTrainConfig,
    args: &Args,
) -> Result<StepTimes, String> {
    let cfg = config.cfg;
    let params = seeded_params(&cfg, 1337).map_err(|e| e.to_string())?;
    let tokens = synthetic_corpus(200_000, cfg.vocab_size as u16, 1337);
    // The device trainer's options, as `fsdp train --engine` takes them: its shards offloaded
    // or not, nanoGPT's decay groups.
    let mut fsdp_config = FsdpConfig::new(ShardingStrategy::FullShard);
    fsdp_config.offload_params = config.offload;
    let init = ParamInit::Full(&params);
    let plan = gpt_block_plan(&cfg);
    let mut fsdp = Fsdp::new_on(comm, dev, &plan, init, fsdp_config, config.adamw)
        .map_err(|e| e.to_string())?;
    if config.decay_2d_only {
        fsdp.set_param_groups(decay_2d_only(config.adamw.weight_decay), |_, shape| {
            decay_2d_only_group(shape)
        })
        .map_err(|e| e.to_string())?;
    }
    let mut pass = GptPass::new(ops, cfg.dims()).map_err(|e| e.to_string())?;
    pass.set_attention(args.attention);
    pass.set_logits(args.logits);
    pass.set_activation_checkpointing(args.activation_checkpointing);
    let mut gpt = EngineGpt::new(fsdp, pass).map_err(|e| e.to_string())?;
    let (rows, clip) = (args.batch, config.grad_clip);
    time_engine_steps(&mut gpt, &tokens, rows, args.steps, args.warmup, clip)
        .map_err(|e| e.to_string())
}

/// `--engine`: the model trained through the engine at world 1 on the device (CUDA `n`, or
/// the host twin).
pub(crate) fn run_engine(
    cuda_ordinal: Option<usize>,
    ops: (Products, HostProducts),
    config: &DeviceTrainConfig,
    args: &Args,
) -> Result<StepTimes, String> {
    let timeout = std::time::Duration::from_secs(600);
    let mut out = match cuda_ordinal {
        Some(n) => {
            let opts = cuda_ring::CudaRingOptions::default().with_timeout(timeout);
            cuda_ring::run_ranks(n, 1, opts, |comm| {
                // `PYTORCH_CUDA_ALLOC_CONF`'s options, one caching allocator for the engine's
                // buffers and the kernels' (as `fsdp train --engine`).
                let alloc = AllocatorConfig::from_env_with_backend()
                    .map_err(|e| e.to_string())?
                    .0;
                let dev = ComputeDevice::cuda(n, alloc).map_err(|e| e.to_string())?;
                let cuda = cuda_ops_on(&dev, ops.0).map_err(|e| e.to_string())?;
                let times = engine_times(Box::new(comm), dev.clone(), cuda, config, args);
                // The next model starts from an empty cache.
                if let Some(a) = dev.cuda_allocator() {
                    a.empty_cache().map_err(|e| e.to_string())?;
                }
                times
            })
        }
        None => ring::run_ranks(
            1,
            ring::RingOptions::default().with_timeout(timeout),
            |comm| {
                let dev = ComputeDevice::host_twin(1 << 32, AllocatorConfig::default())
                    .map_err(|e| e.to_string())?;
                engine_times(
                    Box::new(comm),
                    dev,
                    HostOps::with_products(ops.1),
                    config,
                    args,
                )
            },
        ),
    }
    .map_err(|e| e.to_string())?;
    out.pop().ok_or_else(|| "no rank".to_string())?
}
