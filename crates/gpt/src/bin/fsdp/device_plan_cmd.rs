//! `fsdp plan --device cuda|cuda:N|host-twin [--ranks N]`: the device memory `fsdp train
//! --device` would use with the same options — one rank's ([`plan_memory`]), or each of
//! several ranks' as threads on the device ([`plan_sharded_memory`]) — after the refusals
//! `fsdp train --device` makes.

use fsdp::human_bytes;
use fsdp::optim::{AdamWConfig, LrSchedule};
use fsdp_allocator::{AllocatorBackend, AllocatorConfig};
use fsdp_device::DType;
use fsdp_gpt::device_plan::plan_memory;
use fsdp_gpt::device_plan_alloc::{plan_allocator, plan_process_allocator, plan_sharded_allocator};
use fsdp_gpt::device_plan_sharded::{plan_process_memory, plan_sharded_memory};
use fsdp_gpt::device_sharded::Prefetch;
use fsdp_gpt::device_train::DeviceTrainConfig;
use fsdp_kernels::gpt::Products;

use crate::args::{DeviceArg, ModelArgs, PlanArgs, TrainArgs};
use crate::device_cmd::{check_device_world_and_dtypes, describe_run, products, refuse_first};
use crate::device_sharded_cmd::check_strategy;
use crate::say;
use crate::setup::{allocator_settings, micro_batch, setup};
use crate::train::clip_option;
use crate::{fail, CliError};

/// `fsdp plan --device cuda|cuda:N|host-twin`: the device memory of `fsdp train --device` with
/// the same options ([`plan_memory`]), after the refusals `fsdp train --device` makes of the
/// world and the dtypes, and of the plan's options that mean nothing there.
pub(crate) fn print_device_plan(args: &PlanArgs) -> Result<(), CliError> {
    let dev = args.device;
    let world = check_device_world_and_dtypes(dev, &args.model, false)?;
    let allowed: &[&str] = if world > 1 {
        &["strategy", "ranks_per_node"]
    } else {
        &[]
    };
    refuse_first(dev, world, [], &args.explicit, allowed)?;
    let cfg = setup(&args.model, world, true)?.cfg;
    micro_batch(args.batch_size, args.grad_accum, world)?;
    let config = DeviceTrainConfig {
        cfg,
        // The optimizer's hyperparameters and schedule change no buffer.
        adamw: AdamWConfig::default(),
        schedule: LrSchedule::Constant,
        decay_2d_only: false,
        grad_clip: clip_option(args.grad_clip)?,
        batch_size: args.batch_size,
        grad_accum: args.grad_accum,
        offload: args.cpu_offload,
        activation_checkpointing: args.model.activation_checkpointing,
        attention: args.model.attention.unwrap_or_default(),
        logits: args.model.logits.unwrap_or_default(),
        reduce_dtype: args.model.reduce_dtype.unwrap_or(DType::F32),
        any_precision: crate::optimizer::device_any_precision(&args.optim, args.model.param_dtype)?,
        // The grad scaler keeps its state in the step's scalars: no buffer of its own.
        grad_scaler: None,
        wrap: crate::device_cmd::device_wrap(&args.model),
    };
    let dtype = args.model.param_dtype;
    if world > 1 {
        return print_sharded_plan(args, &config, world, products(dtype));
    }
    let plan =
        plan_memory(&config, products(dtype)).map_err(|e| fail(format!("--device {dev}: {e}")))?;
    say!(
        "fsdp plan: 1 rank on {dev} (no sharding: the GPT's kernels on one device), {}, {} \
         products",
        describe_run(&cfg, args.batch_size, args.grad_accum),
        products_name(products(dtype))
    );
    say!("{}", plan.to_string().trim_end());
    say!(
        "(the bytes `fsdp train --device {dev}` counts from its second micro-batch on; a CUDA \
         memory pool adds the scratch of single kernels and its rounding)"
    );
    if let DeviceArg::Cuda { .. } = dev {
        print_allocator_plan(args, &config, products(dtype))?;
    }
    if let Some(limit) = args.memory_limit {
        let verdict = if plan.peak <= limit {
            "fits within"
        } else {
            "exceeds: `fsdp train --device` refuses it, as"
        };
        say!(
            "peak {} {verdict} --memory-limit {}",
            human_bytes(plan.peak),
            human_bytes(limit)
        );
    }
    Ok(())
}

/// On CUDA: what the run's caching allocator will report ([`plan_allocator`]), configured as
/// the run's (`--alloc-conf`, else PyTorch's variables); under `backend:cudaMallocAsync` that
/// the driver's pool is not planned beyond the counted bytes.
fn print_allocator_plan(
    args: &PlanArgs,
    config: &DeviceTrainConfig,
    products: Products,
) -> Result<(), CliError> {
    let dev = args.device;
    let Some(alloc) = caching_allocator_settings(&args.model)? else {
        say!("memory: the CUDA driver's stream-ordered pool (backend:cudaMallocAsync): its rounding is not planned");
        return Ok(());
    };
    let plan = plan_allocator(config, products, alloc)
        .map_err(|e| fail(format!("--device {dev}: {e}")))?;
    let settings = alloc.to_pytorch_conf().unwrap_or_default();
    say!(
        "{plan} (the run's caching allocator{}: PyTorch's max_memory_allocated and \
         max_memory_reserved)",
        if settings.is_empty() {
            String::new()
        } else {
            format!(", {settings}")
        }
    );
    Ok(())
}

/// The settings of the caching allocator `--device cuda` takes its buffers from
/// ([`allocator_settings`]); `None` under `backend:cudaMallocAsync` (the driver's pool).
pub(crate) fn caching_allocator_settings(
    m: &ModelArgs,
) -> Result<Option<AllocatorConfig>, CliError> {
    let (alloc, backend) = allocator_settings(m, true)?;
    Ok((backend != AllocatorBackend::CudaMallocAsync).then_some(alloc))
}

/// The caching allocator's settings for the run's plan of it, `None` without one to plan:
/// under `backend:cudaMallocAsync`, and under `--cpu-offload` (whose planning run would hold
/// the optimizer's host side in real host memory beside the run's own: `fsdp plan --device
/// cuda --cpu-offload` plans it; the run is admitted on its counted bytes).
pub(crate) fn planned_allocator(args: &TrainArgs) -> Result<Option<AllocatorConfig>, CliError> {
    let settings = caching_allocator_settings(&args.model)?;
    Ok(settings.filter(|_| !args.cpu_offload))
}

/// `fsdp plan --device … --ranks N`: one rank's device memory ([`plan_sharded_memory`]).
pub(crate) fn print_sharded_plan(
    args: &PlanArgs,
    config: &DeviceTrainConfig,
    world: usize,
    products: Products,
) -> Result<(), CliError> {
    let dev = args.device;
    let rpn = check_strategy(dev, args.model.strategy, args.model.ranks_per_node, world)?;
    let plan = plan_sharded_memory(config, products, world, args.model.strategy, rpn)
        .map_err(|e| fail(format!("--device {dev}: {e}")))?;
    say!(
        "fsdp plan: {world} ranks on {dev} as threads ({:?}), {}, {} products",
        args.model.strategy,
        describe_run(&config.cfg, args.batch_size, args.grad_accum),
        products_name(products)
    );
    say!("{}", plan.to_string().trim_end());
    let units = config.wrap.units(&config.cfg)?;
    say!(
        "units: {} (each gathered and freed whole; unsharded over its span of the pass)",
        units.len()
    );
    for u in &units {
        say!("  {u}");
    }
    if let DeviceArg::Cuda { .. } = dev {
        if let Some(alloc) = caching_allocator_settings(&args.model)? {
            let a =
                plan_sharded_allocator(config, products, world, args.model.strategy, rpn, alloc)
                    .map_err(|e| fail(format!("--device {dev}: {e}")))?;
            say!("{a}");
        }
    }
    let all = plan.peak.saturating_mul(world as u64);
    say!(
        "the {world} ranks share the device: {all} bytes ({}) at their peaks (each rank's is \
         what `fsdp train --device {dev} --ranks {world}` counts; a CUDA memory pool adds the \
         scratch of single kernels and its rounding)",
        human_bytes(all)
    );
    if let Some(limit) = args.memory_limit {
        let verdict = if all <= limit {
            "fits within"
        } else {
            "exceeds: `fsdp train --device` refuses it, as"
        };
        say!(
            "{} {verdict} --memory-limit {}",
            human_bytes(all),
            human_bytes(limit)
        );
    }
    let procs = plan_process_memory(
        config,
        products,
        world,
        args.model.strategy,
        rpn,
        Prefetch::default(),
    )
    .map_err(|e| fail(format!("--device {dev}: {e}")))?;
    say!(
        "as {world} processes under `fsdp launch` (a GPU each, --backend nccl): {} bytes ({}) \
         a rank at its peak, of which {} bytes ({}) are the collectives' staging buffers",
        procs.peak,
        human_bytes(procs.peak),
        procs.staging,
        human_bytes(procs.staging)
    );
    if let DeviceArg::Cuda { .. } = dev {
        if let Some(alloc) = caching_allocator_settings(&args.model)? {
            let how = (world, args.model.strategy, rpn, Prefetch::default());
            let a = plan_process_allocator(config, products, how, alloc)
                .map_err(|e| fail(format!("--device {dev}: {e}")))?;
            say!("  a rank's {a} (the staging buffers are NCCL's, beside it)");
        }
    }
    Ok(())
}

/// How the plan's products are named on its first line: `bf16-operand`, `f16-operand` or
/// `f32`.
fn products_name(products: Products) -> &'static str {
    match products.half() {
        Some(fsdp_device::DType::BF16) => "bf16-operand",
        Some(_) => "f16-operand",
        None => "f32",
    }
}
