//! `fsdp train --device cuda|cuda:N|host-twin --ranks N [--strategy S]`: sharded training on
//! one device, one rank per thread, through [`ShardedDeviceTrainer`] over [`PeerComm`] (each
//! rank on its own CUDA stream reading its peers' buffers, ordered by events; or the kernels'
//! host twins, the same protocol on the host). It trains what `fsdp train --ranks N
//! --strategy S` trains and writes the same outputs (`--loss-log`, `--save`); rank 0 reports.

use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use fsdp::{human_bytes, ShardingStrategy};
use fsdp_device::DEFAULT_TIMEOUT;
use fsdp_gpt::device_comm::DeviceComm;
use fsdp_gpt::device_peer::PeerComm;
use fsdp_gpt::device_sharded::ShardedDeviceTrainer;
use fsdp_gpt::device_train::DeviceTrainError;
use fsdp_kernels::gpt::{GptOps, PeerOps};

use crate::args::{DeviceArg, TrainArgs};
use crate::device_cmd::{describe_run, Run};
use crate::device_report::Tally;
use crate::output::{save_checkpoint, LossLog};
use crate::progress::{say_done, Progress};
use crate::say;
use crate::{fail, CliError};

/// The ranks per node of `world` ranks with `strategy`: the hybrid strategies take
/// `--ranks-per-node` (nodes simulated on the one device), which must divide the world;
/// the others none.
pub(crate) fn check_strategy(
    dev: DeviceArg,
    strategy: ShardingStrategy,
    ranks_per_node: Option<usize>,
    world: usize,
) -> Result<Option<usize>, CliError> {
    match (strategy.is_hybrid(), ranks_per_node) {
        (true, None) => Err(fail(format!(
            "--device {dev}: --strategy {} with {world} ranks on one device needs \
             --ranks-per-node (the ranks of each simulated node)",
            if strategy == ShardingStrategy::HybridShard {
                "hybrid-shard"
            } else {
                "hybrid-shard-zero2"
            }
        ))),
        (true, Some(n)) if n == 0 || world % n != 0 => Err(fail(format!(
            "--device {dev}: --ranks {world} is not divisible by --ranks-per-node {n}"
        ))),
        (true, n) => Ok(n),
        (false, _) => Ok(None),
    }
}

/// What each rank returns.
pub(crate) struct RankEnd {
    peak: u64,
    steps: u64,
    tally: Tally,
    /// With `--trace`: the rank's spans.
    trace: Vec<fsdp::trace::TraceEvent>,
    /// What the rank's device memory reports of itself ([`GptOps::memory_report`]).
    memory: Option<String>,
    /// The bytes its collectives moved in training.
    volume: fsdp_gpt::device_comm::CommVolume,
    /// Its grad scaler's final state.
    scaler: Option<fsdp::engine::GradScalerState>,
}

/// What the ranks of a run (this process's) share: the options, the run, where it starts, its
/// progress and rank 0's loss log.
pub(crate) struct Shared<'a> {
    args: &'a TrainArgs,
    run: &'a Run,
    start_step: usize,
    skipped: usize,
    pub(crate) progress: Progress,
    log: Mutex<Option<LossLog>>,
}

impl<'a> Shared<'a> {
    /// Opens the run (rank 0 prints its lines and opens the loss log when `leader`).
    pub(crate) fn open(
        args: &'a TrainArgs,
        run: &'a Run,
        how: &str,
        leader: bool,
    ) -> Result<Shared<'a>, CliError> {
        let (cfg, steps) = (&run.cfg, args.steps);
        let (start_step, skipped) = run
            .resume
            .as_ref()
            .map_or((0, 0), |(r, _)| (r.step, r.skipped));
        if leader {
            let units = run.config.wrap.units(cfg)?.len();
            say!(
                "fsdp train: {how} ({:?}: the GPT's kernels, {units} FSDP units gathered and \
                 reduced between the ranks), {}",
                args.model.strategy,
                describe_run(cfg, args.batch_size, args.grad_accum)
            );
            if run.config.offload {
                say!(
                    "optimizer: AdamW on each rank's shards in host memory (f32 shards, \
                     accumulators and moments, the step on the host: CPU offload; each unit's \
                     shards are copied to the device while it is gathered)"
                );
            } else {
                say!(
                    "optimizer: AdamW on each rank's shards (f32 parameters and moments, on the \
                     device)"
                );
            }
            crate::device_report::say_layers(args.model.param_dtype, &run.config);
            let reduce = run.config.reduce_dtype;
            let name = crate::run_config::dtype_option(reduce);
            say!(
                "reductions: the gradients in {name}{}",
                if reduce == fsdp_device::DType::F32 {
                    String::new()
                } else {
                    format!(
                        " (each unit's rounded to {name} before its collective, the means widened \
                         into f32 accumulators)"
                    )
                }
            );
            if let Some((r, _)) = &run.resume {
                say!(
                    "resuming from {} at step {} of {steps}",
                    r.path.display(),
                    r.step
                );
            }
        }
        // A resumed run continues its checkpoint's loss log from its step.
        let loss_log = match (&run.resume, leader) {
            (_, false) => None,
            (Some((r, _)), true) => args
                .loss_log
                .as_deref()
                .map(|p| LossLog::resume(p, r.step))
                .transpose()?,
            (None, true) => args.loss_log.as_deref().map(LossLog::create).transpose()?,
        };
        let progress = Progress::new(steps, args.skip_nonfinite);
        progress.start_at(start_step);
        Ok(Shared {
            args,
            run,
            start_step,
            skipped,
            progress,
            log: Mutex::new(loss_log),
        })
    }

    /// Rank `rank`'s training with `trainer`, to its end: the steps (rank 0 reports them, every
    /// rank counts the non-finite ones), the checkpoints, `--save` and rank 0's memory snapshot.
    pub(crate) fn train<O: GptOps, C: DeviceComm<O>>(
        &self,
        rank: usize,
        mut trainer: ShardedDeviceTrainer<O, C>,
    ) -> Result<RankEnd, CliError> {
        let (args, run) = (self.args, self.run);
        let dev = args.device;
        let err = move |e: DeviceTrainError| {
            crate::fail_device(&format!("--device {dev}: rank {rank}"), e)
        };
        let global_tokens = args.batch_size * run.cfg.block_size;
        trainer.set_skip_nonfinite(Some(args.skip_nonfinite as u64));
        if args.trace.is_some() {
            trainer.set_tracing(true).map_err(err)?;
        }
        if args.memory_snapshot.is_some() {
            trainer.record_memory_history(true);
        }
        if let (0, Some(m)) = (rank, trainer.ops().memory_source()) {
            say!("memory: {m}");
        }
        let mut tally = Tally::default();
        if let Some((r, state)) = &run.resume {
            trainer
                .load_optimizer_state(state, self.skipped as u64)
                .map_err(err)?;
            if let Some(s) = crate::device_cmd::resumed_scaler(r, &run.config)? {
                trainer.set_grad_scaler_state(s).map_err(err)?;
            }
            tally.skipped = self.skipped;
        }
        let take = |r, tally: &mut Tally, peak| -> Result<(), CliError> {
            if rank == 0 {
                let mut log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
                tally.report(r, &self.progress, log.as_mut(), global_tokens, peak)
            } else {
                // Every rank reads the same outcomes: each stops at the same step.
                match crate::device_report::skipped_for(&r.outcome) {
                    Some(what) => self.progress.count_skip(r.step, &what, &mut tally.skipped),
                    None => Ok(()),
                }
            }
        };
        for step in self.start_step..args.steps {
            if let Some(r) = trainer.enqueue_step(&run.tokens, step).map_err(err)? {
                take(r, &mut tally, trainer.memory().peak)?;
            }
            if let Some(c) = run.checkpointer.as_ref().filter(|c| c.due(step + 1)) {
                // The step's outcome first (the count it saves), then every rank gathers
                // and rank 0 writes.
                if let Some(r) = trainer.flush().map_err(err)? {
                    take(r, &mut tally, trainer.memory().peak)?;
                }
                if rank == 0 {
                    c.save_one(step + 1, tally.skipped, |dir| {
                        trainer.save_checkpoint(Some(dir)).map_err(err)
                    })?;
                } else {
                    trainer.save_checkpoint(None).map_err(err)?;
                }
            }
        }
        if let Some(r) = trainer.flush().map_err(err)? {
            take(r, &mut tally, trainer.memory().peak)?;
        }
        if let Some(path) = &args.save {
            // Every rank gathers; rank 0 writes.
            let params = trainer.full_params().map_err(err)?;
            if rank == 0 {
                save_checkpoint(path, &run.cfg, &params)?;
            }
        }
        if let (0, Some(path)) = (rank, &args.memory_snapshot) {
            // Rank 0's, as the engine writes rank 0's.
            trainer
                .memory_snapshot(&dev.to_string())
                .write_pickle(path)
                .map_err(|e| fail(format!("--memory-snapshot: {e}")))?;
        }
        Ok(RankEnd {
            peak: trainer.memory().peak,
            steps: trainer.optimizer_steps(),
            tally,
            trace: trainer.trace_events(),
            memory: trainer.ops().memory_report(),
            volume: trainer.comm_volume(),
            scaler: trainer.grad_scaler_state(),
        })
    }

    /// Closes the run after the ranks `ends` (this process's, rank 0 first) ran for `elapsed`:
    /// the loss log, the trace, the summary.
    pub(crate) fn finish(
        self,
        mut ends: Vec<RankEnd>,
        elapsed: std::time::Duration,
        what: &str,
        world: usize,
    ) -> Result<(), CliError> {
        let (args, run) = (self.args, self.run);
        let dev = args.device;
        self.progress.finish();
        if let Some(log) = self
            .log
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
        {
            log.finish()?;
        }
        if let Some(path) = &args.trace {
            let per_rank: Vec<_> = ends
                .iter_mut()
                .map(|e| std::mem::take(&mut e.trace))
                .collect();
            fsdp::trace::write_chrome_trace(path, &per_rank)
                .map_err(|e| crate::paths::output_error("--trace", e))?;
        }
        let Some(end) = ends.first() else {
            return Err(fail("no rank ran"));
        };
        let global_tokens = args.batch_size * run.cfg.block_size;
        say_done(
            args.steps - self.start_step,
            elapsed,
            global_tokens,
            end.tally.first,
            end.tally.last,
        );
        let peaks: Vec<String> = ends.iter().map(|e| e.peak.to_string()).collect();
        say!(
            "device: {dev}, {what}, {} optimizer steps, peak device memory per rank {} bytes{}",
            end.steps,
            peaks.join(", "),
            if run.predicted_peak > 0 {
                format!(
                    " (predicted {}: fsdp plan --device {dev} --ranks {})",
                    run.predicted_peak, world
                )
            } else {
                String::new()
            }
        );
        let v = end.volume;
        let bf16_products = args.model.param_dtype == fsdp_device::DType::BF16;
        let params = match run.config.gather_dtype() {
            fsdp_device::DType::BF16 => "parameters in bf16",
            // The blocks' weights only products read, which read them in bf16 anyway.
            _ if bf16_products => "the blocks' product weights in bf16, the rest in f32",
            _ => "parameters in f32",
        };
        say!(
            "rank 0's collectives moved: all-gathered {}, reduce-scattered {}, all-reduced {} \
             ({params}, gradients in {})",
            human_bytes(v.all_gathered),
            human_bytes(v.reduce_scattered),
            human_bytes(v.all_reduced),
            crate::run_config::dtype_option(run.config.reduce_dtype)
        );
        if let Some(m) = &end.memory {
            // Rank 0's: the device's, where ranks share one GPU's allocator.
            let predicted = run
                .predicted_reserved
                .map(|r| format!(" (predicted peak reserved {r}: fsdp plan --device {dev})"))
                .unwrap_or_default();
            say!("rank 0's device memory: {m}{predicted}");
        }
        self.progress.say_skipped(end.tally.skipped);
        crate::train::say_grad_scaler(end.scaler);
        Ok(())
    }
}

/// Trains `run` on `world` ranks as threads, rank `r` on the operations `ops(r)` (made in its
/// thread), `strategy` from the command line.
pub(crate) fn train_sharded<O: PeerOps>(
    args: &TrainArgs,
    run: &Run,
    world: usize,
    ops: impl Fn(usize) -> Result<O, CliError> + Sync,
) -> Result<(), CliError>
where
    O::Event: 'static,
{
    let dev = args.device;
    let strategy: ShardingStrategy = args.model.strategy;
    let shared = Shared::open(
        args,
        run,
        &format!("{world} ranks on {dev} as threads"),
        true,
    )?;
    let timeout = args.timeout.unwrap_or(DEFAULT_TIMEOUT);
    let rpn = check_strategy(dev, strategy, args.model.ranks_per_node, world)?;
    // Each rank's shard group and, under a hybrid strategy, its replicas in the other nodes.
    let comms: Vec<(PeerComm<O>, Option<PeerComm<O>>)> = match rpn {
        Some(n) => PeerComm::mesh(world, n, timeout)
            .ok_or_else(|| fail(format!("--ranks {world} do not make nodes of {n}")))?
            .into_iter()
            .map(|(s, r)| (s, Some(r)))
            .collect(),
        None => PeerComm::group(world, timeout)
            .into_iter()
            .map(|c| (c, None))
            .collect(),
    };
    let start = Instant::now();
    let rank_run = |rank: usize,
                    (comm, replicas): (PeerComm<O>, Option<PeerComm<O>>)|
     -> Result<RankEnd, CliError> {
        let ops = ops(rank)?;
        let (c, p) = (run.config, &run.params);
        let trainer = match replicas {
            Some(r) => ShardedDeviceTrainer::new_hybrid(ops, comm, r, c, strategy, p),
            None => ShardedDeviceTrainer::new(ops, comm, c, strategy, p),
        }
        .map_err(|e| crate::fail_device(&format!("--device {dev}: rank {rank}"), e))?;
        shared.train(rank, trainer)
    };
    let results: Vec<Result<RankEnd, CliError>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let rank_run = &rank_run;
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(s, move || rank_run(rank, comm))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Err(e) => Err(fail(format!("--device {dev}: rank {rank}: no thread: {e}"))),
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(fail(format!(
                        "--device {dev}: rank {rank}'s thread panicked"
                    )))
                }),
            })
            .collect()
    });
    let elapsed = start.elapsed();
    let mut ends = Vec::with_capacity(world);
    for r in results {
        ends.push(r?);
    }
    shared.finish(ends, elapsed, &format!("{world} ranks"), world)
}
