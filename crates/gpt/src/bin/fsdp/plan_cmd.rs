//! `fsdp plan`: the memory and communication plan of the options.

use crate::args::PlanArgs;
use crate::setup::{micro_batch, setup, Setup, DEFAULT_RANKS};
use crate::CliError;

pub(crate) fn print_plan(args: &PlanArgs) -> Result<(), CliError> {
    let world = args.model.ranks.unwrap_or(DEFAULT_RANKS);
    let Setup { cfg, config, plan } = setup(&args.model, world)?;
    let micro = micro_batch(args.batch_size, args.grad_accum, world)?;
    let p = fsdp_gpt::plan::plan(&cfg, world, &config, &plan, micro / world, cfg.block_size)?;
    print!("{p}");
    Ok(())
}
