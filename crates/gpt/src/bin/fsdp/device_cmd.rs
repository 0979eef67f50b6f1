//! `fsdp train --device cuda|cuda:N`: one rank on one GPU without the sharded engine, through
//! [`DeviceTrainer`] over [`CudaOps`] (the GPT's NVRTC kernels and cuBLAS on one CUDA stream,
//! AdamW on the device). The hidden `--device host-twin` runs the same trainer over
//! [`HostOps`] (the kernels' host twins), so the whole path runs without a GPU.
//!
//! It trains what `fsdp train --ranks 1` trains (the same seeded weights or `--init-from`'s,
//! the same batches, AdamW with the schedule, the weight-decay groups, clipping, gradient
//! accumulation, `--skip-nonfinite`) and writes the same outputs (`--loss-log`, `--save`);
//! the options it does not support are refused by name before anything starts.

use std::time::Instant;

use fsdp::checkpoint::FullOptimizerState;
use fsdp_collectives::LaunchEnv;
use fsdp_device::DType;
use fsdp_gpt::device_plan::plan_memory;
use fsdp_gpt::device_plan_alloc::{plan_allocator, plan_sharded_allocator, AllocatorPlan};
use fsdp_gpt::device_plan_sharded::plan_sharded_memory;
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig, DeviceTrainer};
use fsdp_gpt::model::GptConfig;
use fsdp_kernels::gpt::{CudaMemory, CudaOps, GptOps, HostOps, HostProducts, Products};

use crate::args::{DeviceArg, TrainArgs};
use crate::checkpointing::Checkpointer;
use crate::device_plan_cmd::{caching_allocator_settings, planned_allocator};
use crate::device_report::{admit, Tally};
use crate::optimizer::adamw_options;
use crate::output::{save_checkpoint, LossLog};
use crate::paths::check_output_paths;
use crate::progress::{say_done, Progress};
use crate::resume::{Resolved, ResumePoint};
use crate::say;
use crate::setup::{micro_batch, setup};
use crate::train::{grad_clip, load_tokens};
use crate::train_checks::{grad_scaler_config, initial_params, lr_schedule};
use crate::{fail, CliError};

use crate::device_checks::check_device_options;
pub(crate) use crate::device_checks::{check_device_world_and_dtypes, device_wrap, refuse_first};

/// Everything a device run needs, checked before the device is opened.
pub(crate) struct Run {
    pub(crate) cfg: GptConfig,
    pub(crate) config: DeviceTrainConfig,
    pub(crate) params: std::collections::HashMap<String, Vec<f32>>,
    pub(crate) tokens: Vec<u16>,
    /// `fsdp plan --device`'s peak of this run.
    pub(crate) predicted_peak: u64,
    /// On CUDA with the caching allocator (one rank): what the plan predicts it reports.
    pub(crate) predicted_allocator: Option<AllocatorPlan>,
    /// On CUDA with the caching allocator: the bytes it is predicted to reserve at its peak,
    /// for every rank on the device together.
    pub(crate) predicted_reserved: Option<u64>,
    /// Device memory beside the caching allocator's at the same time (NCCL's staging buffers
    /// of a process), for admission.
    pub(crate) beside_allocator: u64,
    /// With `--resume`: the checkpoint, its optimizer state.
    pub(crate) resume: Option<(ResumePoint, FullOptimizerState)>,
    /// With `--checkpoint-dir`: the checkpoints to write.
    pub(crate) checkpointer: Option<Checkpointer>,
}

/// The products of `--param-dtype`: bf16 or f16 operands, else f32.
pub(crate) fn products(dtype: DType) -> Products {
    match dtype {
        DType::BF16 => Products::Bf16,
        DType::F16 => Products::F16,
        _ => Products::F32,
    }
}

/// The model and batch of a device run, as its first line gives them: `GPT L layers × H heads
/// × E wide (N parameters), batch B × T tokens[ in K micro-batches]`.
pub(crate) fn describe_run(cfg: &GptConfig, batch_size: usize, accum: usize) -> String {
    format!(
        "GPT {} layers × {} heads × {} wide ({} parameters), batch {batch_size} × {} tokens{}",
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.num_params(),
        cfg.block_size,
        if accum > 1 {
            format!(" in {accum} micro-batches")
        } else {
            String::new()
        }
    )
}

/// A stream on CUDA device `n` named `name`, every wait on it bounded by `--timeout` (a
/// step's outcome, a copy); its errors prefixed with `what`.
pub(crate) fn cuda_stream(
    args: &TrainArgs,
    n: usize,
    name: &str,
    what: &str,
) -> Result<fsdp_device::Stream, CliError> {
    match args.timeout {
        Some(t) => fsdp_device::Stream::cuda_with_timeout(n, name, t),
        None => fsdp_device::Stream::cuda(n, name),
    }
    .map_err(|e| fail(format!("{what}: {e}")))
}

/// The GPT's operations on `stream` with the products of `--param-dtype` (`bf16`), their
/// buffers from the memory `--alloc-conf` chooses (else PyTorch's variables: the device's
/// caching allocator, or the driver's pool under `backend:cudaMallocAsync`:
/// [`caching_allocator_settings`]); errors prefixed with `what`.
pub(crate) fn cuda_ops(
    stream: fsdp_device::Stream,
    args: &TrainArgs,
    what: &str,
) -> Result<CudaOps, CliError> {
    let ordinal = match stream.device() {
        fsdp_device::Device::Cuda(n) => n,
        other => return Err(fail(format!("{what}: a stream of {other}, not of a GPU"))),
    };
    let memory = match caching_allocator_settings(&args.model)? {
        Some(config) => {
            CudaMemory::caching(ordinal, config).map_err(|e| fail(format!("{what}: {e}")))?
        }
        None => CudaMemory::Driver,
    };
    let dtype = args.model.param_dtype;
    Ok(CudaOps::with_memory(stream, memory)
        .map_err(|e| fail(format!("{what}: {e}")))?
        .with_products(products(dtype)))
}

/// The free memory of `stream`'s GPU, where the driver tells it.
pub(crate) fn free_memory(stream: &fsdp_device::Stream) -> Option<u64> {
    stream
        .cuda_stream()
        .and_then(|s| s.context().mem_get_info().ok())
        .map(|(free, _)| free as u64)
}

/// Checks that CUDA device `n` exists.
pub(crate) fn cuda_ordinal(dev: DeviceArg, n: usize) -> Result<(), CliError> {
    let count = fsdp_device::cuda::device_count()
        .map_err(|e| fail(format!("--device {dev}: no CUDA device ({e})")))?;
    if n >= count {
        return Err(fail(format!(
            "--device {dev}: no CUDA device {n} (the driver reports {count})"
        )));
    }
    Ok(())
}

/// The host twins' products of `--param-dtype`: bf16 or f16 operands, else f32.
pub(crate) fn host_products(dtype: DType) -> HostProducts {
    match dtype {
        DType::BF16 => HostProducts::Bf16Operands,
        DType::F16 => HostProducts::F16Operands,
        _ => HostProducts::F32,
    }
}

/// `fsdp train --device cuda|cuda:N|host-twin`.
pub(crate) fn train_on_device(args: &TrainArgs) -> Result<(), CliError> {
    check_device_options(args)?;
    // `--init-from` fills in the model sizes not given; `--resume` every option not given
    // (the ranks and the strategy among them), checked again once filled in.
    let Resolved {
        args,
        resume,
        checkpoints,
    } = crate::resume::resolve(args)?;
    let args = &args;
    let world = check_device_options(args)?;
    let cfg = setup(&args.model, world, true)?.cfg;
    micro_batch(args.batch_size, args.grad_accum, world)?;
    if args.steps == 0 {
        return Err(fail("--steps must be at least 1"));
    }
    let config = DeviceTrainConfig {
        cfg,
        adamw: adamw_options(args),
        schedule: lr_schedule(args)?,
        decay_2d_only: args.decay_2d_only,
        grad_clip: grad_clip(args)?,
        batch_size: args.batch_size,
        grad_accum: args.grad_accum,
        offload: args.cpu_offload,
        activation_checkpointing: args.model.activation_checkpointing,
        attention: args.model.attention.unwrap_or_default(),
        logits: args.model.logits.unwrap_or_default(),
        reduce_dtype: args.model.reduce_dtype.unwrap_or(DType::F32),
        any_precision: crate::optimizer::device_any_precision(&args.optim, args.model.param_dtype)?,
        grad_scaler: grad_scaler_config(args)?,
        wrap: device_wrap(&args.model),
    };
    config.validate()?;
    let tokens = load_tokens(args, &cfg)?;
    // A resumed run starts from the checkpoint's parameters and optimizer state at its step.
    let (params, resume) = match resume {
        Some(r) => {
            r.check_tokens(tokens.len())?;
            let (p, o) = r.load(&cfg)?;
            (p, Some((r, o)))
        }
        None => match initial_params(args, &cfg)? {
            Some(p) => (p, None),
            None => (seeded_params(&cfg, args.seed)?, None),
        },
    };
    check_output_paths(args, 1, false)?;
    let checkpointer = checkpoints
        .as_ref()
        .map(|plan| Checkpointer::new(plan, args, tokens.len(), world));
    // Under a launcher rank 0 prepares the directory and writes the checkpoints.
    let leader = LaunchEnv::from_env()?.is_none_or(|env| env.rank == 0);
    if let (Some(c), true) = (&checkpointer, leader) {
        c.prepare()?;
    }
    let run = Run {
        cfg,
        config,
        params,
        tokens,
        predicted_peak: 0,
        predicted_allocator: None,
        predicted_reserved: None,
        beside_allocator: 0,
        resume,
        checkpointer,
    };
    let dev = args.device;
    let dtype = args.model.param_dtype;
    if let Some(env) = LaunchEnv::from_env()? {
        // Ranks as processes: this process is one of them (no plan: it is of ranks as threads).
        return crate::device_process_cmd::train_launched(args, run, &env, dtype);
    }
    if world > 1 {
        let strategy = args.model.strategy;
        let rpn = args.model.ranks_per_node.filter(|_| strategy.is_hybrid());
        let plan = plan_sharded_memory(&run.config, products(dtype), world, strategy, rpn)
            .map_err(|e| fail(format!("--device {dev}: {e}")))?;
        let run = Run {
            predicted_peak: plan.peak,
            ..run
        };
        return match dev {
            DeviceArg::Cuda { ordinal: n, .. } => {
                cuda_ordinal(dev, n)?;
                // What the ranks' one caching allocator will reserve.
                let predicted_reserved = match planned_allocator(args)? {
                    Some(alloc) => Some(
                        plan_sharded_allocator(
                            &run.config,
                            products(dtype),
                            world,
                            strategy,
                            rpn,
                            alloc,
                        )
                        .map_err(|e| fail(format!("--device {dev}: {e}")))?
                        .peak_reserved(),
                    ),
                    None => None,
                };
                let run = Run {
                    predicted_reserved,
                    ..run
                };
                let what = format!("--device {dev}");
                let stream = cuda_stream(args, n, "fsdp train admission", &what)?;
                admit(args, &run, free_memory(&stream), world)?;
                crate::device_sharded_cmd::train_sharded(args, &run, world, |rank| {
                    let what = format!("--device {dev}: rank {rank}");
                    let name = format!("fsdp train rank {rank}");
                    cuda_ops(cuda_stream(args, n, &name, &what)?, args, &what)
                })
            }
            DeviceArg::HostTwin => {
                admit(args, &run, None, world)?;
                crate::device_sharded_cmd::train_sharded(args, &run, world, |_| {
                    Ok(HostOps::with_products(host_products(dtype)))
                })
            }
            DeviceArg::Cpu => Err(fail("--device cpu runs the sharded engine")),
        };
    }
    let plan = plan_memory(&run.config, products(dtype))
        .map_err(|e| fail(format!("--device {dev}: {e}")))?;
    let run = Run {
        predicted_peak: plan.peak,
        ..run
    };
    match dev {
        DeviceArg::Cuda { ordinal: n, .. } => {
            cuda_ordinal(dev, n)?;
            // What the caching allocator will reserve, planned with its settings.
            let predicted_allocator = match planned_allocator(args)? {
                Some(alloc) => Some(
                    plan_allocator(&run.config, products(dtype), alloc)
                        .map_err(|e| fail(format!("--device {dev}: {e}")))?,
                ),
                None => None,
            };
            let run = Run {
                predicted_reserved: predicted_allocator.map(|p| p.peak_reserved),
                predicted_allocator,
                ..run
            };
            let what = format!("--device {dev}");
            let stream = cuda_stream(args, n, "fsdp train", &what)?;
            // Admission: the plan's peak against the GPU's free memory (or --memory-limit),
            // before the model allocates anything.
            admit(args, &run, free_memory(&stream), 1)?;
            let ops = cuda_ops(stream, args, &what)?;
            train_with(ops, args, &run)
        }
        DeviceArg::HostTwin => {
            admit(args, &run, None, 1)?;
            train_with(HostOps::with_products(host_products(dtype)), args, &run)
        }
        DeviceArg::Cpu => Err(fail("--device cpu runs the sharded engine")),
    }
}

/// Trains on `ops`.
fn train_with<O: GptOps>(ops: O, args: &TrainArgs, run: &Run) -> Result<(), CliError> {
    let dev = args.device;
    let on_device =
        |e: fsdp_gpt::device_train::DeviceTrainError| fail(format!("--device {dev}: {e}"));
    let (cfg, steps, accum) = (&run.cfg, args.steps, args.grad_accum);
    let t = cfg.block_size;
    let global_tokens = args.batch_size * t;
    let mut trainer = DeviceTrainer::new(ops, run.config, &run.params).map_err(on_device)?;
    let mut loss_log = match &run.resume {
        Some(_) => None,
        None => args.loss_log.as_deref().map(LossLog::create).transpose()?,
    };
    say!(
        "fsdp train: 1 rank on {dev} (no sharding: the GPT's kernels on one device), {}",
        describe_run(cfg, args.batch_size, accum)
    );
    if run.config.offload {
        say!(
            "optimizer: AdamW (f32 master parameters, accumulators and moments in host memory, \
             the step on the host: CPU offload; the device keeps the working parameters)"
        );
    } else {
        say!("optimizer: AdamW (f32 parameters, f32 moments, on the device)");
    }
    crate::device_report::say_layers(args.model.param_dtype, &run.config);
    if let Some(m) = trainer.ops().memory_source() {
        say!("memory: {m}");
    }
    let progress = Progress::new(steps, args.skip_nonfinite);
    let mut start_step = 0;
    let mut tally = Tally::default();
    if let Some((r, state)) = &run.resume {
        trainer
            .load_optimizer_state(state, r.skipped as u64)
            .map_err(on_device)?;
        if let Some(s) = resumed_scaler(r, &run.config)? {
            trainer.set_grad_scaler_state(s).map_err(on_device)?;
        }
        say!(
            "resuming from {} at step {} of {steps}",
            r.path.display(),
            r.step
        );
        (start_step, tally.skipped) = (r.step, r.skipped);
        loss_log = args
            .loss_log
            .as_deref()
            .map(|p| LossLog::resume(p, r.step))
            .transpose()?;
    }
    progress.start_at(start_step);
    if args.trace.is_some() {
        trainer.set_tracing(true).map_err(on_device)?;
    }
    if args.memory_snapshot.is_some() {
        trainer.record_memory_history(true);
    }
    // The device halts at the step past --skip-nonfinite itself: the steps enqueued after it
    // (the outcome is read one step late) apply nothing.
    trainer.set_skip_nonfinite(Some(args.skip_nonfinite as u64));
    let start = Instant::now();
    tally.arrived_at = Instant::now();
    // Each step is enqueued while the device runs the one before; its outcome is read (and
    // logged) when the next is enqueued, so no step waits for the host. A checkpoint waits
    // for its step's outcome and state.
    for step in start_step..steps {
        let r = trainer.enqueue_step(&run.tokens, step).map_err(on_device)?;
        let peak = trainer.peak_bytes();
        if let Some(r) = r {
            tally.report(r, &progress, loss_log.as_mut(), global_tokens, peak)?;
        }
        if let Some(c) = run.checkpointer.as_ref().filter(|c| c.due(step + 1)) {
            if let Some(r) = trainer.flush().map_err(on_device)? {
                tally.report(r, &progress, loss_log.as_mut(), global_tokens, peak)?;
            }
            c.save_one(step + 1, tally.skipped, |dir| {
                trainer.save_checkpoint(dir).map_err(on_device)
            })?;
        }
    }
    if let Some(r) = trainer.flush().map_err(on_device)? {
        let peak = trainer.peak_bytes();
        tally.report(r, &progress, loss_log.as_mut(), global_tokens, peak)?;
    }
    let Tally {
        first,
        last,
        skipped,
        ..
    } = tally;
    let elapsed = start.elapsed();
    progress.finish();
    if let Some(path) = &args.save {
        let params = trainer.full_params().map_err(on_device)?;
        save_checkpoint(path, cfg, &params)?;
    }
    if let Some(log) = loss_log {
        log.finish()?;
    }
    if let Some(path) = &args.memory_snapshot {
        trainer
            .memory_snapshot(&dev.to_string())
            .write_pickle(path)
            .map_err(|e| fail(format!("--memory-snapshot: {e}")))?;
    }
    if let Some(path) = &args.trace {
        fsdp::trace::write_chrome_trace(path, &[trainer.trace_events()])
            .map_err(|e| crate::paths::output_error("--trace", e))?;
    }
    say_done(steps, elapsed, global_tokens, first, last);
    say!(
        "device: {dev}, {} optimizer steps, peak device memory {} bytes (predicted {}: fsdp \
         plan --device {dev}){}",
        trainer.optimizer_steps(),
        trainer.peak_bytes(),
        run.predicted_peak,
        match (trainer.ops().memory_report(), &run.predicted_allocator) {
            (Some(r), Some(p)) => format!(
                "; {r} (predicted {} and {}: fsdp plan --device {dev})",
                p.peak_allocated, p.peak_reserved
            ),
            (Some(r), None) => format!("; {r}"),
            _ => String::new(),
        }
    );
    progress.say_skipped(skipped);
    crate::train::say_grad_scaler(trainer.grad_scaler_state());
    Ok(())
}

/// The grad scaler's state to resume with from the checkpoint `r`: `None` when the run has no
/// scaler (or the checkpoint predates recording it: the scaler starts anew).
///
/// # Errors
/// The checkpoint's run had a scaler but holds no state; an unreadable state.
pub(crate) fn resumed_scaler(
    r: &ResumePoint,
    config: &DeviceTrainConfig,
) -> Result<Option<fsdp::engine::GradScalerState>, CliError> {
    match config.scaler_rule() {
        None => Ok(None),
        Some(_) => r.grad_scaler_state(),
    }
}
