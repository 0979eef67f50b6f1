//! `fsdp train`: checks every option, starts the ranks (threads on the ring backend, or this
//! process as one rank under a launcher), trains and writes the outputs.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use fsdp::engine::{GradScaler, GradScalerState, StepOutcome};
use fsdp::optim::{decay_2d_only as decay_2d_only_groups, decay_2d_only_group};
use fsdp::{human_bytes, ParamInit};
use fsdp_collectives::{init_from_env, init_with_store, ring, Backend, Communicator, InitOptions};
use fsdp_gpt::data::{check_stream_len, get_batch, read_token_file, synthetic_corpus};
use fsdp_gpt::device_train::DeviceTrainError;
use fsdp_gpt::engine_gpt::GptOnEngine;
use fsdp_gpt::engine_plan::EngineMemoryPlan;
use fsdp_gpt::init::gpt2_init;
use fsdp_gpt::model::GptConfig;
use fsdp_gpt::runtime::{FsdpGpt, ScheduleKind};

use crate::admission::{self, Sharing};
use crate::args::{strategy_name, DeviceArg, TrainArgs};
use crate::checkpointing::Checkpointer;
use crate::host_admission::HostGroup;
use crate::output::{gather_rank_stats, print_summary, write_outputs, LossLog, RankReport};
use crate::paths::{check_output_paths, output_error, rank_trace_path};
use crate::progress::{nonfinite, Progress};
use crate::resume::{self, Resolved};
use crate::say;
use crate::setup::Setup;
use crate::train_checks::{
    admit_run, grad_scaler_config, initial_params, lr_schedule, train_mode, Admitted, Mode,
};
use crate::{fail, CliError};

/// A rank's error of a pass: the engine's as on every path, the kernels' naming the rank.
fn on_rank_error(rank: usize) -> impl Fn(DeviceTrainError) -> CliError {
    move |e| match e {
        DeviceTrainError::Fsdp(e) => admission::on_rank(rank)(e),
        e => fail(format!("rank {rank}: {e}")),
    }
}

/// Length of the generated corpus used when no `--data` file is given.
pub(crate) const SYNTHETIC_LEN: usize = 200_000;

/// `--grad-clip`, validated: `None` for no clipping (`--grad-clip 0` too, as nanoGPT's
/// `grad_clip = 0.0`).
pub(crate) fn grad_clip(args: &TrainArgs) -> Result<Option<f64>, CliError> {
    clip_option(args.grad_clip)
}

/// A `--grad-clip` value: `None` for none or 0; refused unless finite and ≥ 0.
pub(crate) fn clip_option(clip: Option<f64>) -> Result<Option<f64>, CliError> {
    match clip {
        Some(c) if !(c.is_finite() && c >= 0.0) => Err(fail(format!(
            "--grad-clip {c}: must be a finite number ≥ 0 (0: no clipping)"
        ))),
        Some(0.0) => Ok(None),
        c => Ok(c),
    }
}

/// The training tokens: `--data`'s file (checked against the block size and the vocabulary),
/// else the generated corpus of `--seed`.
pub(crate) fn load_tokens(args: &TrainArgs, cfg: &GptConfig) -> Result<Vec<u16>, CliError> {
    let t = cfg.block_size;
    Ok(match &args.data {
        Some(path) => {
            let toks = read_token_file(path)?;
            check_stream_len(toks.len(), t)
                .map_err(|e| fail(format!("data file {} is too short: {e}", path.display())))?;
            if let Some(&bad) = toks.iter().find(|&&x| usize::from(x) >= cfg.vocab_size) {
                return Err(fail(format!(
                    "data file {} holds token {bad}, outside the vocabulary of {}",
                    path.display(),
                    cfg.vocab_size
                )));
            }
            toks
        }
        None => synthetic_corpus(SYNTHETIC_LEN, cfg.vocab_size as u16, args.seed),
    })
}

pub(crate) fn train(args: &TrainArgs) -> Result<(), CliError> {
    // `--device cuda` (and the host twins' hidden `--device host-twin`): the GPT's device
    // trainer, unless `--engine` asks for the engine on the device.
    let engine_device = crate::engine_cmd::engine_device(args)?;
    if args.device != DeviceArg::Cpu && engine_device.is_none() {
        return crate::device_cmd::train_on_device(args);
    }
    if args.cpu_offload && engine_device.is_none() {
        return Err(fail(
            "--cpu-offload: only with --device cuda (on --device cpu every buffer is in host \
             memory already)",
        ));
    }
    if let Some(option) = args
        .model
        .device_only_option()
        .filter(|_| engine_device.is_none())
    {
        return Err(fail(format!(
            "{option}: only with --device cuda (the CPU reference GPT's layers are its own)"
        )));
    }
    // ---- Validate everything before any rank starts.
    // The options not given come from --resume's checkpoint or --init-from's file.
    let Resolved {
        args,
        resume,
        checkpoints,
    } = resume::resolve(args)?;
    let args = &args;
    let mode = match engine_device {
        Some(dev) => crate::engine_cmd::engine_mode(dev, args)?,
        None => train_mode(args)?,
    };
    let world = match &mode {
        Mode::Threads(n) => *n,
        Mode::Process { world, .. } => *world,
    };
    let mut init_options = InitOptions::from_env()?;
    if let Some(t) = args.timeout {
        init_options.timeout = t;
    }
    if let Some(t) = args.init_timeout {
        init_options.init_timeout = Some(t);
    }
    if let Some(crate::engine_cmd::EngineDevice::Cuda(n)) = engine_device {
        // NCCL on the engine's GPU (`cuda:N`'s, not necessarily the local rank's).
        init_options = init_options.with_cuda_device(n);
    }
    // Under a launcher (not mpirun) the ranks meet at the rendezvous store now, before anything
    // is allocated: the ranks of this host add up their predicted memory there.
    let host = match &mode {
        Mode::Process { backend, .. } if *backend != Backend::Mpi => {
            Some(HostGroup::join(init_options.effective_init_timeout())?)
        }
        _ => None,
    };
    let sharing = match (&mode, &host) {
        (Mode::Threads(_), _) => Sharing::Threads,
        (Mode::Process { .. }, Some(h)) => Sharing::Host(h),
        (Mode::Process { .. }, None) => Sharing::Launched,
    };
    // The engine on a device is admitted on its device plan, and on the host on the same
    // plan's host figures; the others on the host engine's plan against the host's memory.
    let on_device_plan = |a: Admitted| -> Result<(Admitted, Option<EngineMemoryPlan>), CliError> {
        let plan = match engine_device {
            Some(dev) => {
                let start = resume.as_ref().map_or(0, |r| r.step);
                Some(crate::engine_plan_cmd::admit(
                    args,
                    dev,
                    world,
                    &mode,
                    sharing,
                    (&a.data, start),
                )?)
            }
            None => None,
        };
        Ok((a, plan))
    };
    let admitted =
        admit_run(args, world, sharing, resume.is_some(), engine_device).and_then(on_device_plan);
    // A rank that stops here tells the other ranks of its host, which would wait for it.
    if let (Err(e), Some(h)) = (&admitted, &host) {
        h.abandon(e);
    }
    let (
        Admitted {
            setup: Setup { cfg, config, plan },
            optim: opt,
            micro,
            global_tokens,
            capacity,
            ..
        },
        engine_plan,
    ) = admitted?;
    let t = cfg.block_size;
    let grad_clip = grad_clip(args)?;
    let skip_nonfinite = args.skip_nonfinite;
    let scaler = grad_scaler_config(args)?;
    let schedule = lr_schedule(args)?;
    let decay_2d_only = args.decay_2d_only;
    let tokens = load_tokens(args, &cfg)?;
    if let Some(r) = &resume {
        r.check_tokens(tokens.len())?;
    }
    // A resumed run starts from the checkpoint's parameters and optimizer state at its step.
    let (params, resume_optimizer) = match &resume {
        Some(r) => {
            let (p, o) = r.load(&cfg)?;
            (Some(p), Some(o))
        }
        None => (initial_params(args, &cfg)?, None),
    };
    let (start_step, start_skipped) = resume.as_ref().map_or((0, 0), |r| (r.step, r.skipped));
    // A resumed run with the scaler on continues from the checkpoint's scale.
    let scaler_state = match (&resume, &scaler) {
        (Some(r), Some(_)) => r.grad_scaler_state()?,
        _ => None,
    };
    let checkpointer = checkpoints
        .as_ref()
        .map(|plan| Checkpointer::new(plan, args, tokens.len(), world));
    let seed = args.seed;
    // Check the output paths now rather than after training: what each names (a directory or a
    // device is never replaced) and that its directory is writable.
    check_output_paths(args, world, matches!(mode, Mode::Process { .. }))?;

    // ---- Train.
    let steps = args.steps;
    let accum = args.grad_accum;
    let want_params = args.save.is_some();
    let mut config = config;
    config.memory_capacity = capacity;
    config.trace = args.trace.is_some();
    if engine_device.is_some() {
        config = crate::engine_cmd::engine_config(config, &args.model, args.cpu_offload);
    }
    let progress = Progress::new(steps, skip_nonfinite);
    // Under a launcher this process is one rank: meet the others now (validation is done).
    let process_comm = match &mode {
        Mode::Threads(_) => None,
        Mode::Process { backend, .. } => {
            let comm = match &host {
                Some(h) => init_with_store(*backend, h.store(), h.env(), &init_options)?,
                None => init_from_env(*backend, &init_options)?,
            };
            if comm.world_size() != world {
                return Err(fail(format!(
                    "rank {}: the {backend} backend has {} ranks, the launcher said {world}",
                    comm.rank(),
                    comm.world_size()
                )));
            }
            Some(comm)
        }
    };
    let leader = process_comm.as_ref().is_none_or(|c| c.rank() == 0);
    if let (true, Some(c)) = (leader, &checkpointer) {
        c.prepare()?;
    }
    // Rank 0 writes the loss log as training goes, so a run that stops keeps its finished steps
    // (a resumed run keeps the lines of the steps before its start).
    let loss_log = match (&args.loss_log, &resume) {
        (Some(path), None) if leader => Some(Mutex::new(LossLog::create(path)?)),
        (Some(path), Some(r)) if leader => Some(Mutex::new(LossLog::resume(path, r.step)?)),
        _ => None,
    };
    let mem_now: Vec<AtomicU64> = (0..world).map(|_| AtomicU64::new(0)).collect();
    if leader {
        say!(
            "fsdp train: {} ranks{}, {}, GPT {} layers × {} heads × {} wide ({} parameters, {} \
         units), batch {} × {} tokens{}",
            world,
            engine_device
                .map(|d| format!(" {}", crate::engine_cmd::describe(d, args)))
                .unwrap_or_default(),
            strategy_name(config.strategy),
            cfg.n_layer,
            cfg.n_head,
            cfg.n_embd,
            cfg.num_params(),
            plan.units.len(),
            args.batch_size,
            t,
            if accum > 1 {
                format!(" in {accum} micro-batches")
            } else {
                String::new()
            }
        );
        say!(
            "optimizer: {}; {}",
            crate::optimizer::describe(&opt, config.mixed_precision.param_dtype),
            crate::optimizer::sharded_state_line(&opt, config.mixed_precision.param_dtype)
        );
        if config.allocator != fsdp_allocator::AllocatorConfig::default() {
            // The options each rank's caching allocator runs with, in PyTorch's syntax.
            let text = config
                .allocator
                .to_pytorch_conf()
                .unwrap_or_else(|_| format!("{:?}", config.allocator));
            println!("allocator: {text}");
        }
        if let Some(r) = &resume {
            say!(
                "resuming from {} at step {} of {steps}",
                r.path.display(),
                r.step
            );
        }
    }
    progress.start_at(start_step);
    let start = Instant::now();
    let skipped_steps = AtomicUsize::new(0);
    let final_scaler: Mutex<Option<GradScalerState>> = Mutex::new(None);
    let kernel_peak: Mutex<Option<u64>> = Mutex::new(None);
    let run = |comm: Box<dyn Communicator>| -> Result<RankReport, CliError> {
        let rank = comm.rank();
        crate::signals::abort_on_signal(comm.as_ref());
        let rule = gpt2_init(cfg.n_layer);
        let init = match &params {
            Some(p) => ParamInit::Full(p),
            None => ParamInit::Seeded { seed, rule: &rule },
        };
        let mut model: Box<dyn GptOnEngine> = match engine_device {
            Some(dev) => {
                let run = crate::engine_cmd::EngineRun {
                    cfg,
                    plan: &plan,
                    config,
                    opt,
                    args,
                    timeout: init_options.timeout,
                };
                crate::engine_cmd::engine_model(dev, comm, init, &run)?
            }
            None => Box::new(
                FsdpGpt::with_init(comm, cfg, &plan, init, config, opt)
                    .map_err(admission::on_rank(rank))?,
            ),
        };
        if rank == 0 && args.memory_snapshot.is_some() {
            model.record_memory_history(Some(fsdp_allocator::HistoryConfig::default()));
        }
        if args.trace.is_some() {
            model.set_model_tracing(true).map_err(on_rank_error(rank))?;
        }
        model.set_lr_schedule(schedule)?;
        model.set_grad_scaler(scaler)?;
        if let Some(state) = scaler_state {
            model.set_grad_scaler_state(state)?;
        }
        if decay_2d_only {
            model.set_param_groups(decay_2d_only_groups(args.weight_decay), |_, shape| {
                decay_2d_only_group(shape)
            })?;
        }
        if let Some(state) = &resume_optimizer {
            model
                .load_optimizer_state(state)
                .map_err(admission::on_rank(rank))?;
        }
        // A run resumed after skipped steps may skip only what is left of --skip-nonfinite:
        // past it the engine halts on the device, so that no step issued after the one the
        // host stops at applies (the host reads each outcome one step late there).
        model.set_skip_nonfinite(Some(
            args.skip_nonfinite.saturating_sub(start_skipped) as u64
        ));
        // Grown step by step: --steps is the user's number, not a size to reserve.
        let mut losses = Vec::new();
        let (mut ag, mut rs, mut ar) = (0u64, 0u64, 0u64);
        let mut skipped = start_skipped;
        // The step whose outcome comes next, and when the one before it arrived.
        let mut reported = start_step;
        let mut arrived = Instant::now();
        let mut report = |outcome: StepOutcome,
                          model: &mut Box<dyn GptOnEngine>,
                          skipped: &mut usize|
         -> Result<(), CliError> {
            let step = reported;
            reported += 1;
            let loss = outcome.loss;
            // The non-finite rule's step was skipped (its loss recorded below as it is).
            if let Some(what) = nonfinite(loss, outcome.grad_norm, outcome.found_inf) {
                progress.count_skip(step, &what, skipped)?;
                if rank == 0 {
                    progress.skipped(step, &what, *skipped);
                }
            }
            let dt = arrived.elapsed().as_secs_f64();
            arrived = Instant::now();
            let stats = rank_memory(model.as_ref());
            mem_now[rank].store(stats.allocated_bytes.all.peak, Ordering::Relaxed);
            losses.push((loss, dt, stats.allocated_bytes.all.peak));
            if let (0, Some(log)) = (rank, &loss_log) {
                let peak = stats.allocated_bytes.all.peak;
                let mut log = log.lock().unwrap_or_else(PoisonError::into_inner);
                log.step(step, loss, global_tokens as f64 / dt, peak);
            }
            if rank == 0 {
                let mem: Vec<String> = mem_now
                    .iter()
                    .map(|a| match a.load(Ordering::Relaxed) {
                        0 => "-".to_string(),
                        b => human_bytes(b),
                    })
                    .collect();
                let tps = global_tokens as f64 / dt;
                let msg = format!(
                    "step {step} loss {loss:.4} {tps:.0} tok/s peak alloc/rank [{}]",
                    mem.join(", ")
                );
                progress.status(step, msg);
            }
            Ok(())
        };
        for step in start_step..steps {
            let batches = (0..accum)
                .map(|m| get_batch(&tokens, (step * accum + m) as u64, micro, t, rank, world))
                .collect::<Result<Vec<_>, _>>()
                .map_err(admission::on_rank(rank))?;
            // Gradients accumulate unreduced (no_sync) but for the last micro-batch; the
            // optimizer step applies only if the step is finite. The engine on a device
            // decides that there and tells the step's outcome one step late.
            let outcomes = model
                .train_step(&batches, global_tokens, grad_clip)
                .map_err(on_rank_error(rank))?;
            for o in outcomes {
                report(o, &mut model, &mut skipped)?;
            }
            // Communication volume from the recorded schedule and the units' layouts and
            // dtypes (mixed precision: parameters gathered in `param_dtype`, gradients reduced
            // in `reduce_dtype`).
            for e in model.schedule() {
                let Some(g) = model.param_groups().get(e.unit) else {
                    continue;
                };
                let (layout, d) = (g.layout(), g.dtypes());
                let bytes = |n: usize, t: fsdp_device::DType| {
                    (n as u64).saturating_mul(t.size_in_bytes() as u64)
                };
                match e.kind {
                    ScheduleKind::AllGather => {
                        ag = ag.saturating_add(bytes(layout.padded_numel(), d.param))
                    }
                    ScheduleKind::ReduceScatter => {
                        rs = rs.saturating_add(bytes(layout.padded_numel(), d.reduce))
                    }
                    ScheduleKind::AllReduce => {
                        ar = ar.saturating_add(bytes(layout.shard_numel(), d.reduce))
                    }
                    ScheduleKind::Free => {}
                }
            }
            model.clear_schedule();
            if let Some(c) = checkpointer.as_ref().filter(|c| c.due(step + 1)) {
                // The checkpoint holds the step's outcome: read it first.
                for o in model.flush_steps().map_err(on_rank_error(rank))? {
                    report(o, &mut model, &mut skipped)?;
                }
                c.save(&model, step + 1, skipped)?;
            }
        }
        for o in model.flush_steps().map_err(on_rank_error(rank))? {
            report(o, &mut model, &mut skipped)?;
        }
        let final_params = if want_params {
            let p = model.full_state_dict()?;
            (rank == 0).then_some(p)
        } else {
            None
        };
        if rank == 0 {
            skipped_steps.store(skipped, Ordering::Relaxed);
            *final_scaler.lock().unwrap_or_else(PoisonError::into_inner) =
                model.grad_scaler().map(GradScaler::state);
            *kernel_peak.lock().unwrap_or_else(PoisonError::into_inner) =
                model.kernel_memory_peak();
        }
        if let (0, Some(path)) = (rank, &args.memory_snapshot) {
            let snapshot = model.memory_snapshot().ok_or_else(|| {
                fail("--memory-snapshot: the rank's memory pool keeps no snapshot")
            })?;
            snapshot
                .write_pickle(path)
                .map_err(|e| fail(format!("--memory-snapshot: {e}")))?;
        }
        let stats = rank_memory(model.as_ref());
        let mut trace = model.trace_events();
        trace.extend(model.model_trace_events());
        Ok(RankReport {
            trace,
            losses,
            peak_allocated: stats.allocated_bytes.all.peak,
            peak_reserved: stats.reserved_bytes.all.peak,
            num_alloc_retries: stats.num_alloc_retries,
            activations: model.activation_stats(),
            all_gathered: ag,
            reduce_scattered: rs,
            all_reduced: ar,
            final_params,
        })
    };
    let mut reports = Vec::with_capacity(world);
    let elapsed;
    let mut shared_line = None;
    match process_comm {
        None => {
            let results = match engine_device {
                Some(dev) => crate::engine_cmd::run_ranks(dev, world, init_options.timeout, run)?,
                None => ring::run_ranks(world, ring::RingOptions::default(), |c| run(Box::new(c)))?,
            };
            elapsed = start.elapsed();
            for r in results {
                reports.push(r?);
            }
        }
        Some(comm) => {
            // A second group over the same ranks carries the end-of-run statistics, since the
            // model owns the first.
            let stats_comm = comm
                .split(Some(0), comm.rank())?
                .ok_or_else(|| fail("splitting the statistics group returned no group"))?;
            let rank = comm.rank();
            // The engine allocates in shared host memory when the peers read it in place.
            // (On a device the engine's buffers are the device's, in no shared memory.)
            let shared = comm.prefers_shared_host_memory() && engine_device.is_none();
            let mut own = run(comm)?;
            elapsed = start.elapsed();
            if shared {
                shared_line = Some(format!(
                    "host memory: shared with the ranks of this node (rank 0 read {:.1} MiB of \
                     their buffers in place)",
                    fsdp_collectives::tcp::shared_bytes_received() as f64 / (1u64 << 20) as f64
                ));
            }
            let others = gather_rank_stats(stats_comm.as_ref(), &own)?;
            if let Some(path) = &args.trace {
                if rank > 0 {
                    let per_rank = vec![std::mem::take(&mut own.trace)];
                    fsdp::trace::write_chrome_trace(&rank_trace_path(path, rank), &per_rank)
                        .map_err(|e| output_error("--trace", e))?;
                }
            }
            if rank != 0 {
                progress.finish();
                return Ok(());
            }
            reports.push(own);
            reports.extend(others.into_iter().skip(1));
        }
    }
    progress.finish();

    // ---- Outputs.
    write_outputs(args, &cfg, &mut reports)?;
    if let Some(log) = loss_log {
        log.into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .finish()?;
    }
    print_summary(&reports, elapsed, global_tokens, steps - start_step);
    if let Some(dev) = engine_device {
        say!("{}", crate::engine_cmd::activations_line(dev));
        if let (Some(plan), Some(r)) = (&engine_plan, reports.first()) {
            let kernels = kernel_peak
                .into_inner()
                .unwrap_or_else(PoisonError::into_inner);
            say!(
                "{}",
                crate::engine_plan_cmd::measured_line(
                    dev,
                    args.device,
                    plan,
                    r.peak_allocated,
                    kernels
                )
            );
        }
    }
    if let Some(line) = shared_line {
        say!("{line}");
    }
    progress.say_skipped(skipped_steps.load(Ordering::Relaxed));
    say_grad_scaler(
        final_scaler
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner),
    );
    Ok(())
}

/// A rank's memory statistics: its device's caching allocator with the engine on a device
/// (the engine's buffers, and on CUDA the kernels' too), else the engine's host allocator.
fn rank_memory(model: &dyn GptOnEngine) -> fsdp_allocator::MemoryStats {
    match model.compute_device() {
        Some(d) => d.memory_stats(),
        None => model.memory_stats(),
    }
}

/// The summary's line on the grad scaler's final state, if a scaler ran.
pub(crate) fn say_grad_scaler(state: Option<GradScalerState>) {
    if let Some(s) = state {
        say!(
            "grad scaler: final scale {}, {} overflowing step(s) skipped (no optimizer step; \
             scale backed off)",
            show_scale(s.scale),
            s.skipped_steps
        );
    }
}

/// A scale as the summary shows it: an integer in full (`65536`), else in scientific notation.
fn show_scale(s: f32) -> String {
    if s.fract() == 0.0 && s.abs() < 1e9 {
        format!("{s}")
    } else {
        format!("{s:e}")
    }
}
