//! `fsdp plan`: the memory and communication plan of the options, and whether the ranks fit in
//! the memory available (as threads of one process, as `fsdp train` runs them).

use fsdp_gpt::runtime::FsdpConfig;

use crate::admission::{available, Prediction, ProcessData, Sharing};
use crate::args::PlanArgs;
use crate::setup::{micro_batch, setup, Setup, DEFAULT_RANKS};
use crate::train::SYNTHETIC_LEN;
use crate::CliError;

pub(crate) fn print_plan(args: &PlanArgs) -> Result<(), CliError> {
    let world = args.model.ranks.unwrap_or(DEFAULT_RANKS);
    let Setup { cfg, config, plan } = setup(&args.model, world)?;
    let micro = micro_batch(args.batch_size, args.grad_accum, world)?;
    // The peak the allocator reaches when nothing limits it (training gives it the admitted
    // share of the memory available).
    let unbounded = FsdpConfig {
        memory_capacity: usize::MAX,
        ..config
    };
    let p = fsdp_gpt::plan::plan_accumulated(
        &cfg,
        world,
        &unbounded,
        &plan,
        micro / world,
        cfg.block_size,
        args.grad_accum,
    )?;
    print!("{p}");
    let data = ProcessData::new(None, SYNTHETIC_LEN, cfg.num_params(), false, false, false)?;
    let prediction = Prediction::new(&p, world, Sharing::Threads, &data)?;
    println!();
    println!(
        "{}",
        prediction.report(available(args.memory_limit).as_ref())
    );
    Ok(())
}
