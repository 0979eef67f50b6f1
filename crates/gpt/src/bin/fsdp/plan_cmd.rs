//! `fsdp plan`: the memory and communication plan of the options, and whether the ranks fit in
//! the memory available (as threads of one process, as `fsdp train` runs them). With the
//! optimizer's lines: its state per rank and per shard element, and the sharded state per
//! parameter (the parameter in the dtype of the shards and its optimizer state). With
//! `--device cuda` (or `host-twin`): the device trainer's memory instead
//! ([`print_device_plan`](crate::device_plan_cmd::print_device_plan)).

use fsdp_gpt::runtime::FsdpConfig;

use crate::admission::{available, Prediction, ProcessData, Sharing};
use crate::args::{DeviceArg, PlanArgs};
use crate::optimizer::{describe, plan_optimizer, sharded_state_line};
use crate::say;
use crate::setup::{micro_batch, setup, Setup, DEFAULT_RANKS};
use crate::train::SYNTHETIC_LEN;
use crate::{fail, CliError};

pub(crate) fn print_plan(args: &PlanArgs) -> Result<(), CliError> {
    if args.engine {
        return crate::engine_plan_cmd::print_engine_plan(args);
    }
    if args.device != DeviceArg::Cpu {
        return crate::device_plan_cmd::print_device_plan(args);
    }
    if args.cpu_offload {
        return Err(fail(
            "--cpu-offload: only with --device (the sharded engine's plan is of host memory)",
        ));
    }
    if let Some(option) = args.model.device_only_option() {
        return Err(fail(format!(
            "{option}: only with --device (the sharded engine's plan is of the CPU GPT)"
        )));
    }
    if args.grad_clip.is_some() {
        return Err(fail(
            "--grad-clip: only with --device (the sharded engine's plan does not depend on it)",
        ));
    }
    let world = args.model.ranks.unwrap_or(DEFAULT_RANKS);
    let optim = plan_optimizer(&args.optim, args.model.param_dtype)?;
    let Setup { cfg, config, plan } = setup(&args.model, world, false)?;
    let micro = micro_batch(args.batch_size, args.grad_accum, world)?;
    // The peak the allocator reaches when nothing limits it (training gives it the admitted
    // share of the memory available).
    let unbounded = FsdpConfig {
        memory_capacity: usize::MAX,
        ..config
    };
    let p = fsdp_gpt::plan::plan_with_optimizer(
        &cfg,
        world,
        &unbounded,
        &plan,
        micro / world,
        cfg.block_size,
        args.grad_accum,
        &optim,
    )?;
    print!("{p}");
    let param_dtype = args.model.param_dtype;
    let per_element = optim.state_bytes_per_element();
    let shard_elements: usize = p.units.iter().map(|u| u.shard_numel).sum();
    let state = p.per_rank.first().map_or(0, |m| m.optimizer_state);
    say!("optimizer: {}", describe(&optim, param_dtype));
    say!(
        "optimizer state: {state} bytes per rank ({per_element} bytes per shard element × \
         {shard_elements} elements)"
    );
    say!("{}", sharded_state_line(&optim, param_dtype));
    let data = ProcessData::new(None, SYNTHETIC_LEN, cfg.num_params(), false, None, false)?;
    let prediction = Prediction::new(&p, world, Sharing::Threads, &data)?;
    say!();
    say!(
        "{}",
        prediction.report(available(args.memory_limit).as_ref())
    );
    Ok(())
}
