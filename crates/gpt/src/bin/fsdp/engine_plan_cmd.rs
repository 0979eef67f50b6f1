//! `fsdp plan --device cuda|cuda:N|host-twin --engine [--ranks N]`: the device memory of
//! `fsdp train --device … --engine` with the same options, per rank ([`plan_engine_memory`]:
//! the engine's dry run driven by the GPT's meta operations); `fsdp train --engine`'s admission
//! on it, and the line it prints of its measured peaks beside the plan's.

use fsdp::human_bytes;
use fsdp_gpt::engine_plan::{plan_engine_memory, EngineMemoryPlan, EnginePlanRun};

use crate::admission::{self, overflow, ProcessData, Sharing};
use crate::args::{ModelArgs, OptimizerArgs, PlanArgs, TrainArgs};
use crate::device_cmd::{cuda_stream, free_memory, host_products};
use crate::engine_cmd::{engine_config, EngineDevice};
use crate::host_admission::PLAN;
use crate::optimizer::plan_optimizer;
use crate::say;
use crate::setup::{micro_batch, setup, DEFAULT_RANKS};
use crate::train::clip_option;
use crate::train_checks::Mode;
use crate::{fail, CliError};

/// What the plan of `--engine` is made of: the run's options as `fsdp train` takes them.
pub(crate) struct EnginePlanArgs<'a> {
    pub(crate) dev: EngineDevice,
    pub(crate) model: &'a ModelArgs,
    pub(crate) optim: &'a OptimizerArgs,
    pub(crate) batch_size: usize,
    pub(crate) grad_accum: usize,
    pub(crate) cpu_offload: bool,
    pub(crate) grad_clip: Option<f64>,
    pub(crate) world: usize,
    /// The run's steps (`fsdp plan`: 2, a run's peak).
    pub(crate) steps: usize,
}

/// The plan of one rank of `fsdp train --engine` with `a`'s options.
///
/// # Errors
/// Invalid options (as `fsdp train` refuses them).
pub(crate) fn engine_memory(a: &EnginePlanArgs<'_>) -> Result<EngineMemoryPlan, CliError> {
    let s = setup(a.model, a.world, false)?;
    let micro = micro_batch(a.batch_size, a.grad_accum, a.world)?;
    let mut config = engine_config(s.config, a.model, a.cpu_offload);
    // The peak a run reaches when nothing limits it (the run admits it against its device).
    config.memory_capacity = usize::MAX;
    let dtype = a.model.param_dtype;
    let run = EnginePlanRun {
        cfg: s.cfg,
        units: &s.plan,
        world: a.world,
        config,
        optim: plan_optimizer(a.optim, dtype)?,
        rows: micro / a.world,
        micro_batches: a.grad_accum,
        products: host_products(dtype),
        activation_checkpointing: a.model.activation_checkpointing,
        attention: a.model.attention.unwrap_or_default(),
        logits: a.model.logits.unwrap_or_default(),
        copied_views: a.dev == EngineDevice::HostTwin,
        grad_clip: a.grad_clip,
        steps: a.steps,
    };
    plan_engine_memory(&run).map_err(|e| fail(format!("--engine: {e}")))
}

/// `fsdp plan --device … --engine`.
///
/// # Errors
/// As [`engine_memory`]; `--engine` on the CPU.
pub(crate) fn print_engine_plan(args: &PlanArgs) -> Result<(), CliError> {
    let dev = match args.device {
        crate::args::DeviceArg::Cpu => {
            return Err(fail(
                "--engine: only with --device cuda|cuda:N (on --device cpu the plan is the \
                 engine's already)",
            ))
        }
        crate::args::DeviceArg::Cuda { ordinal, .. } => EngineDevice::Cuda(ordinal),
        crate::args::DeviceArg::HostTwin => EngineDevice::HostTwin,
    };
    let world = args.model.ranks.unwrap_or(DEFAULT_RANKS);
    let a = EnginePlanArgs {
        dev,
        model: &args.model,
        optim: &args.optim,
        batch_size: args.batch_size,
        grad_accum: args.grad_accum,
        cpu_offload: args.cpu_offload,
        grad_clip: clip_option(args.grad_clip)?,
        world,
        steps: 2,
    };
    let p = engine_memory(&a)?;
    let cfg = setup(&args.model, world, false)?.cfg;
    say!(
        "fsdp plan: {world} rank{} on {} through the engine, {}, GPT {} layers × {} heads × {} \
         wide, batch {} × {} tokens{}",
        if world == 1 { "" } else { "s" },
        args.device,
        crate::args::strategy_name(args.model.strategy),
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        args.batch_size,
        cfg.block_size,
        if args.grad_accum > 1 {
            format!(" in {} micro-batches", args.grad_accum)
        } else {
            String::new()
        }
    );
    say!(
        "device memory per rank: peak allocated {} ({} bytes): the engine's buffers {} at their \
         peak (shards and gradient shards {}, optimizer state {}), the GPT's kernels' buffers \
         {} at theirs, in one caching allocator",
        human_bytes(p.peak_allocated),
        p.peak_allocated,
        human_bytes(p.engine_peak),
        human_bytes(p.sharded_state),
        human_bytes(p.optimizer_state),
        human_bytes(p.activations_peak)
    );
    say!(
        "(a device that runs behind the host returns a reduction's input later: up to {} more, \
         the largest unit's gradient)",
        human_bytes(p.lag_margin)
    );
    if dev == EngineDevice::HostTwin {
        say!("(on the host twin the kernels' buffers are the twins' own, counted apart)");
    }
    say!(
        "host memory per rank: {} ({} bytes) at its peak: the engine's host caching allocator \
         (the shards and gradient shards as built before they are placed, {}) and the optimizer \
         state {}{}",
        human_bytes(p.host_peak),
        p.host_peak,
        if args.cpu_offload {
            "offloaded ones throughout"
        } else {
            "kept in its cache"
        },
        if args.cpu_offload {
            "(offloaded)"
        } else {
            "(built there, then placed on the device)"
        },
        if dev == EngineDevice::HostTwin {
            "; the host twin's device memory besides"
        } else {
            ""
        }
    );
    if let Some(limit) = args.memory_limit {
        let top = p.peak_allocated + p.lag_margin;
        let verdict = if top <= limit {
            "fits within"
        } else {
            "exceeds"
        };
        say!(
            "peak {} (with the margin) {verdict} --memory-limit {}",
            human_bytes(top),
            human_bytes(limit)
        );
    }
    Ok(())
}

/// `fsdp train --engine`'s line on rank 0's device memory beside the plan's: the allocator's
/// peak (on the host twin the engine's buffers alone) and the kernels' count.
pub(crate) fn measured_line(
    dev: EngineDevice,
    name: crate::args::DeviceArg,
    plan: &EngineMemoryPlan,
    peak: u64,
    kernels: Option<u64>,
) -> String {
    let (what, want) = match dev {
        EngineDevice::Cuda(_) => ("peak allocated", plan.peak_allocated),
        EngineDevice::HostTwin => ("the engine's buffers at their peak", plan.engine_peak),
    };
    let kernels = kernels.map_or(String::new(), |k| {
        format!(
            "; the GPT's kernels' buffers {k} bytes (predicted {})",
            plan.activations_peak
        )
    });
    format!(
        "device memory (rank 0): {what} {peak} bytes (predicted {want} to {}: fsdp plan \
         --device {name} --engine){kernels}",
        want + plan.lag_margin
    )
}

/// Admission of `fsdp train --engine` on its device: the plan's peak with its margin, times
/// the ranks sharing the device (threads on one GPU; a process has its own), against
/// `--memory-limit`, else the GPU's free memory (the host twin: its memory is the host's, which
/// [`admit_host`] checks); then on the host ([`admit_host`]). Returns the plan for the run's
/// summary.
///
/// # Errors
/// A run that does not fit, with both figures; invalid options.
pub(crate) fn admit(
    args: &TrainArgs,
    dev: EngineDevice,
    world: usize,
    mode: &Mode,
    sharing: Sharing<'_>,
    (data, start_step): (&ProcessData, usize),
) -> Result<EngineMemoryPlan, CliError> {
    let plan = engine_memory(&EnginePlanArgs {
        dev,
        model: &args.model,
        optim: &args.optim,
        batch_size: args.batch_size,
        grad_accum: args.grad_accum,
        cpu_offload: args.cpu_offload,
        grad_clip: crate::train::grad_clip(args)?,
        world,
        // The steps this run takes (a resumed one from its checkpoint's).
        steps: args.steps.saturating_sub(start_step),
    })?;
    let ranks = match mode {
        Mode::Threads(n) => *n,
        Mode::Process { .. } => 1,
    };
    let device = match (args.memory_limit, dev) {
        (Some(limit), _) => Some((limit, "--memory-limit")),
        (None, EngineDevice::Cuda(n)) => {
            let stream = cuda_stream(args, n, "admission", "--engine")?;
            free_memory(&stream).map(|free| (free, "free on the device"))
        }
        (None, EngineDevice::HostTwin) => None,
    };
    let each = plan.peak_allocated.saturating_add(plan.lag_margin);
    let needed = each.saturating_mul(ranks as u64);
    if let Some((available, what)) = device.filter(|&(a, _)| needed > a) {
        let d = args.device;
        return Err(fail(format!(
            "--device {d} --engine: the run needs {} of device memory at its peak ({ranks} \
             rank{} of {}: the plan's peak and its margin, fsdp plan --device {d} --engine), {} \
             is {what}; --activation-checkpointing, a smaller --batch-size (with --grad-accum), \
             --cpu-offload or ranks as processes on GPUs of their own need less",
            human_bytes(needed),
            if ranks == 1 { "" } else { "s" },
            human_bytes(each),
            human_bytes(available)
        )));
    }
    admit_host(args, dev, &plan, world, sharing, data)?;
    Ok(plan)
}

/// Admission of `fsdp train --engine` on the host: each rank's engine's host memory
/// ([`EngineMemoryPlan::host_peak`]; on the host twin its device's memory too: the segments
/// of the engine's buffers at their peak with the margin, and the kernels' buffers, counted
/// apart; the optimizer state placed on it counted once), times the ranks sharing the host (under a
/// launcher added up through the store), and the process's data (`data`: the corpus,
/// checkpoints, `--save`'s gathered parameters), against the host's memory: `--memory-limit`
/// on the host twin, whose device memory is the host's; on CUDA, where `--memory-limit` bounds
/// the device, the host's available memory.
///
/// # Errors
/// A run that does not fit, with the figures; an overflow.
fn admit_host(
    args: &TrainArgs,
    dev: EngineDevice,
    plan: &EngineMemoryPlan,
    world: usize,
    sharing: Sharing<'_>,
    data: &ProcessData,
) -> Result<(), CliError> {
    // On the host twin its device's memory is the host's too; the optimizer state placed there
    // leaves the host (its device's segments hold it), so it is counted once.
    let (twin, placed) = match (dev, args.cpu_offload) {
        (EngineDevice::HostTwin, offload) => (
            plan.engine_reserved
                .checked_add(plan.lag_margin)
                .and_then(|b| b.checked_add(plan.activations_peak))
                .ok_or_else(|| overflow("the host twin's device memory"))?,
            if offload { 0 } else { plan.host_state },
        ),
        (EngineDevice::Cuda(_), _) => (0, 0),
    };
    let each = twin
        .checked_add(plan.host_peak - placed)
        .ok_or_else(|| overflow("the engine's host memory"))?;
    let (ranks, who) = sharing.ranks(world);
    let own = each
        .checked_mul(ranks as u64)
        .and_then(|b| b.checked_add(data.bytes(ranks)?))
        .ok_or_else(|| overflow("the ranks' host memory"))?;
    let limit = dev.host_memory_limit(args.memory_limit);
    let (total, available, who) = match sharing {
        Sharing::Host(h) => {
            let shares = h.exchange(PLAN, own, admission::available(limit))?;
            let (total, available) = h.add_up(&shares)?;
            (total, available, h.who())
        }
        _ => (own, admission::available(limit), who),
    };
    let Some(available) = available.filter(|a| total > a.bytes) else {
        return Ok(());
    };
    let d = args.device;
    let twin = match dev {
        EngineDevice::HostTwin => format!(
            "; the host twin's device memory {} (the segments of the engine's buffers at their \
             peak with the margin, and the kernels' buffers{})",
            human_bytes(twin),
            if placed > 0 {
                ", the optimizer state counted there once"
            } else {
                ""
            }
        ),
        EngineDevice::Cuda(_) => String::new(),
    };
    Err(sharing.refuse(format!(
        "--device {d} --engine: not enough host memory: the run needs {} ({total} bytes) for \
         {who}, available {} ({} bytes, {}). Each rank: its engine's host memory {} (the shards \
         and gradient shards as built before they are placed, offloaded ones throughout, and the \
         optimizer state: fsdp plan --device {d} --engine){twin}. The process: the data {}. \
         Fewer ranks on this host or a smaller model need less",
        human_bytes(total),
        human_bytes(available.bytes),
        available.bytes,
        available.source,
        human_bytes(plan.host_peak),
        human_bytes(data.bytes(ranks).unwrap_or(u64::MAX)),
    )))
}
