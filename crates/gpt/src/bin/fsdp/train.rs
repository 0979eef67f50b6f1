//! `fsdp`: sharded GPT training on the CPU — ranks as threads on the embedded ring backend, or
//! as processes started by `fsdp launch` (TCP backend) or `mpirun` (MPI backend).
//!
//! `fsdp train` trains the reference GPT with FSDP and shows a progress bar and a summary;
//! `fsdp plan` prints the memory and communication plan of the same options; `fsdp launch`
//! starts one process per rank with the launcher's environment (like `torchrun`). Every option
//! is checked before any rank starts, and an invalid one ends with a single `error: ...` line and
//! a non-zero exit status.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use fsdp::optim::{
    decay_2d_only as decay_2d_only_groups, decay_2d_only_group, AdamWConfig, LrSchedule,
};
use fsdp::units::UnitPlan;
use fsdp::wrap::{plan_units, WrapOptions, WrapPolicy};
use fsdp::FsdpError;
use fsdp_collectives::launch::{self, LaunchOptions};
use fsdp_collectives::{init_from_env, ring, Backend, Communicator, InitOptions, LaunchEnv};
use fsdp_device::{Buffer, DType};
use fsdp_gpt::data::{check_stream_len, get_batch, read_token_file, synthetic_corpus};
use fsdp::ParamInit;
use fsdp_gpt::init::gpt2_init;
use fsdp_gpt::model::{param_specs, GptConfig};
use fsdp_gpt::runtime::{BackwardPrefetch, FsdpConfig, FsdpGpt, ScheduleKind, ShardingStrategy};
use fsdp_gpt::tree::gpt_module_tree;
use indicatif::{ProgressBar, ProgressStyle};

/// Length of the generated corpus used when no `--data` file is given.
const SYNTHETIC_LEN: usize = 200_000;

#[derive(Parser, Debug)]
#[command(
    name = "fsdp",
    version,
    about = "Fully sharded data parallel GPT training on the CPU: ranks as threads (ring backend) \
             or as processes (`fsdp launch`, mpirun)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a GPT with FSDP and print a summary.
    Train(TrainArgs),
    /// Print the memory plan: per unit the parameters, the per-rank payload of each collective
    /// and the collectives per step; per rank the predicted peak memory by category.
    Plan(PlanArgs),
    /// Start one process per rank, like `torchrun --nproc-per-node N`: sets RANK, WORLD_SIZE,
    /// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, prefixes each line of output
    /// with the rank, and when one process fails ends the others and exits with its status.
    /// `fsdp launch -n 2 train ...` runs this program's `train` in every process.
    Launch(LaunchArgs),
}

#[derive(Args, Debug)]
struct LaunchArgs {
    /// Processes (ranks) to start on this machine.
    #[arg(long, short = 'n')]
    nproc_per_node: usize,
    /// Address of the rendezvous store, hosted by rank 0.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store (0: pick a free one).
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// The program to start and its arguments (`train ...` or `plan ...`: this program).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

#[derive(Args, Debug)]
struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Global batch size in rows (over all ranks and micro-batches).
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Micro-batches per optimizer step (the plan is for one micro-batch).
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
}

/// The model, the sharding and the wrap policy (shared by the subcommands).
#[derive(Args, Debug, Clone)]
struct ModelArgs {
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    n_layer: usize,
    /// Attention heads per block.
    #[arg(long, default_value_t = 4)]
    n_head: usize,
    /// Embedding width.
    #[arg(long, default_value_t = 128)]
    n_embd: usize,
    /// Context length (also the training sequence length).
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// Vocabulary size (at most 65536: tokens are u16).
    #[arg(long, default_value_t = 256)]
    vocab_size: usize,
    /// Number of ranks: threads on the ring backend (default 4). Under a launcher the world
    /// size comes from the launcher, and this option, if given, must agree with it.
    #[arg(long)]
    ranks: Option<usize>,
    /// full-shard, shard-grad-op, no-shard, hybrid-shard or hybrid-shard-zero2.
    #[arg(long, default_value = "full-shard", value_parser = parse_strategy)]
    strategy: ShardingStrategy,
    /// Ranks per node for the hybrid strategies (default: all ranks on one node).
    #[arg(long)]
    ranks_per_node: Option<usize>,
    /// Backward prefetch: pre, post or none.
    #[arg(long, default_value = "pre", value_parser = parse_prefetch)]
    backward_prefetch: BackwardPrefetch,
    /// Prefetch the next unit's all-gather in forward (from the second step).
    #[arg(long)]
    forward_prefetch: bool,
    /// At most N all-gathered buffers in flight, or `off`.
    #[arg(long, default_value = "2", value_parser = parse_limit)]
    limit_all_gathers: Limit,
    /// Wrap policy: `block` (one unit per transformer block) or `size:N` (modules of at
    /// least N parameters).
    #[arg(long, default_value = "block", value_parser = parse_wrap)]
    wrap: Wrap,
}

#[derive(Args, Debug)]
struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Global batch size in rows (over all ranks and micro-batches).
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Micro-batches per optimizer step (gradients accumulated under no_sync).
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 250)]
    steps: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// AdamW beta1.
    #[arg(long, default_value_t = 0.9)]
    beta1: f64,
    /// AdamW beta2.
    #[arg(long, default_value_t = 0.95)]
    beta2: f64,
    /// AdamW epsilon.
    #[arg(long, default_value_t = 1e-8)]
    eps: f64,
    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f64,
    /// Decay only the parameters of 2 or more dimensions (nanoGPT's `configure_optimizers`:
    /// weights decay; biases and LayerNorm parameters do not).
    #[arg(long)]
    decay_2d_only: bool,
    /// Learning-rate schedule: `constant`, or `cosine` (nanoGPT's `get_lr`: linear warmup for
    /// --warmup-iters steps, cosine decay to --min-lr at --lr-decay-iters, then --min-lr).
    #[arg(long, default_value = "constant", value_parser = parse_schedule_kind)]
    lr_schedule: ScheduleKindArg,
    /// Warmup steps of the cosine schedule.
    #[arg(long, default_value_t = 0)]
    warmup_iters: u64,
    /// Step at which the cosine schedule reaches --min-lr (default: --steps).
    #[arg(long)]
    lr_decay_iters: Option<u64>,
    /// Final learning rate of the cosine schedule (default: --lr / 10, as nanoGPT).
    #[arg(long)]
    min_lr: Option<f64>,
    /// Clip the global gradient norm to this value (default: no clipping).
    #[arg(long)]
    grad_clip: Option<f64>,
    /// Seed of the initial weights and of the generated corpus.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Training tokens: little-endian u16 (nanoGPT's train.bin); default: a generated corpus.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Initial weights (safetensors, nanoGPT names and shapes).
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Write the final weights here (safetensors, nanoGPT names and shapes).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Write a CSV of step, loss, tokens/s and rank 0's peak allocated bytes.
    #[arg(long)]
    loss_log: Option<PathBuf>,
    /// Write a Chrome trace (JSON) of compute and communication per rank (under a launcher,
    /// each rank N > 0 writes its own file, named with `.rankN` before the extension).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Communication backend: `ring` (ranks as threads of this process; the default), `tcp`
    /// (ranks as processes; the default under `fsdp launch` or torchrun) or `mpi` (under
    /// `mpirun`; the default there when this program is built with the feature `mpi`).
    #[arg(long, value_parser = parse_backend)]
    backend: Option<TrainBackend>,
}

/// `--lr-schedule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScheduleKindArg {
    Constant,
    Cosine,
}

fn parse_schedule_kind(s: &str) -> Result<ScheduleKindArg, String> {
    match s {
        "constant" => Ok(ScheduleKindArg::Constant),
        "cosine" => Ok(ScheduleKindArg::Cosine),
        other => Err(format!("`{other}`: expected constant or cosine")),
    }
}

/// The learning-rate schedule of the options, validated.
fn lr_schedule(args: &TrainArgs) -> Result<LrSchedule, CliError> {
    let cosine_only =
        args.warmup_iters > 0 || args.lr_decay_iters.is_some() || args.min_lr.is_some();
    let s = match args.lr_schedule {
        ScheduleKindArg::Constant if cosine_only => {
            return Err(fail(
                "--warmup-iters, --lr-decay-iters and --min-lr need --lr-schedule cosine",
            ))
        }
        ScheduleKindArg::Constant => LrSchedule::Constant,
        ScheduleKindArg::Cosine => LrSchedule::Cosine {
            warmup_iters: args.warmup_iters,
            lr_decay_iters: args.lr_decay_iters.unwrap_or(args.steps as u64),
            min_lr: args.min_lr.unwrap_or(args.lr / 10.0),
        },
    };
    s.validate()?;
    Ok(s)
}

/// `--backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TrainBackend {
    Ring,
    Process(Backend),
}

fn parse_backend(s: &str) -> Result<TrainBackend, String> {
    if s == "ring" {
        return Ok(TrainBackend::Ring);
    }
    match s.parse::<Backend>() {
        Ok(Backend::Nccl) => Err(
            "nccl needs CUDA buffers, and the trainer's runtime computes \
                                  on the CPU: use tcp or mpi"
                .into(),
        ),
        Ok(b) => Ok(TrainBackend::Process(b)),
        Err(_) => Err("expected ring, tcp or mpi".into()),
    }
}

/// `--limit-all-gathers`.
#[derive(Debug, Clone, Copy)]
struct Limit(Option<usize>);

/// `--wrap`.
#[derive(Debug, Clone, Copy)]
enum Wrap {
    Block,
    Size(usize),
}

fn parse_strategy(s: &str) -> Result<ShardingStrategy, String> {
    Ok(match s {
        "full-shard" => ShardingStrategy::FullShard,
        "shard-grad-op" => ShardingStrategy::ShardGradOp,
        "no-shard" => ShardingStrategy::NoShard,
        "hybrid-shard" => ShardingStrategy::HybridShard,
        "hybrid-shard-zero2" => ShardingStrategy::HybridShardZero2,
        _ => {
            return Err(
                "unknown strategy (expected full-shard, shard-grad-op, no-shard, \
                        hybrid-shard or hybrid-shard-zero2)"
                    .into(),
            )
        }
    })
}

fn parse_prefetch(s: &str) -> Result<BackwardPrefetch, String> {
    Ok(match s {
        "pre" => BackwardPrefetch::Pre,
        "post" => BackwardPrefetch::Post,
        "none" => BackwardPrefetch::None,
        _ => return Err("expected pre, post or none".into()),
    })
}

fn parse_limit(s: &str) -> Result<Limit, String> {
    if s == "off" {
        return Ok(Limit(None));
    }
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(Limit(Some(n))),
        _ => Err("expected a number of at least 1 or `off`".into()),
    }
}

fn parse_wrap(s: &str) -> Result<Wrap, String> {
    if s == "block" {
        return Ok(Wrap::Block);
    }
    match s.strip_prefix("size:").map(str::parse::<usize>) {
        Some(Ok(n)) if n >= 1 => Ok(Wrap::Size(n)),
        _ => Err("expected `block` or `size:N` with N at least 1".into()),
    }
}

fn strategy_name(s: ShardingStrategy) -> &'static str {
    match s {
        ShardingStrategy::FullShard => "FULL_SHARD",
        ShardingStrategy::ShardGradOp => "SHARD_GRAD_OP",
        ShardingStrategy::NoShard => "NO_SHARD",
        ShardingStrategy::HybridShard => "HYBRID_SHARD",
        ShardingStrategy::HybridShardZero2 => "HYBRID_SHARD_ZERO2",
    }
}

/// An error for the user: printed as one `error: ...` line.
#[derive(Debug)]
struct CliError(String);

impl From<FsdpError> for CliError {
    fn from(e: FsdpError) -> Self {
        CliError(e.to_string())
    }
}

impl From<fsdp_collectives::CollectiveError> for CliError {
    fn from(e: fsdp_collectives::CollectiveError) -> Self {
        CliError(e.to_string())
    }
}

fn fail(msg: impl Into<String>) -> CliError {
    CliError(msg.into())
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion)
                || matches!(
                    e.kind(),
                    ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
                )
            {
                let _ = e.print();
                return if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                    ExitCode::from(2)
                } else {
                    ExitCode::SUCCESS
                };
            }
            // clap's first line is the error itself ("error: ..."); the rest is usage help.
            let text = e.render().to_string();
            let line = text.lines().next().unwrap_or("error: invalid arguments");
            eprintln!("{line}");
            return ExitCode::from(2);
        }
    };
    let r = match cli.command {
        Command::Train(args) => train(&args),
        Command::Plan(args) => print_plan(&args),
        Command::Launch(args) => return run_launch(args),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError(msg)) => {
            // One line, whatever the message holds.
            eprintln!("error: {}", msg.replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

/// The model configuration, the FSDP configuration and the unit plan, validated.
struct Setup {
    cfg: GptConfig,
    config: FsdpConfig,
    plan: UnitPlan,
}

/// Ranks when none are given and no launcher says otherwise.
const DEFAULT_RANKS: usize = 4;

fn setup(m: &ModelArgs, world: usize) -> Result<Setup, CliError> {
    if world == 0 {
        return Err(fail("--ranks must be at least 1"));
    }
    if m.vocab_size > usize::from(u16::MAX) + 1 {
        return Err(fail(format!(
            "--vocab-size {} is larger than 65536 (tokens are u16)",
            m.vocab_size
        )));
    }
    let cfg = GptConfig::new(m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size)?;
    let mut config = FsdpConfig::new(m.strategy);
    config.backward_prefetch = m.backward_prefetch;
    config.forward_prefetch = m.forward_prefetch;
    config.limit_all_gathers = m.limit_all_gathers.0;
    match (m.strategy.is_hybrid(), m.ranks_per_node) {
        (true, Some(0)) => return Err(fail("--ranks-per-node must be at least 1")),
        (true, Some(n)) if world % n != 0 => {
            return Err(fail(format!(
                "--ranks {world} is not divisible by --ranks-per-node {n}"
            )))
        }
        (true, n) => config.ranks_per_node = n,
        (false, Some(_)) => {
            return Err(fail(format!(
                "--ranks-per-node applies only to hybrid strategies, not {}",
                strategy_name(m.strategy)
            )))
        }
        (false, None) => {}
    }
    let policy = match m.wrap {
        Wrap::Block => WrapPolicy::module_type(["Block"]),
        Wrap::Size(n) => WrapPolicy::size(n),
    };
    let plan = plan_units(&gpt_module_tree(&cfg), &WrapOptions::new(policy))?;
    Ok(Setup { cfg, config, plan })
}

/// What each rank reports at the end.
struct RankReport {
    /// Per step: the global loss, the step's seconds and the peak allocated bytes so far.
    losses: Vec<(f32, f64, u64)>,
    peak_allocated: u64,
    peak_reserved: u64,
    num_alloc_retries: u64,
    all_gathered: u64,
    reduce_scattered: u64,
    all_reduced: u64,
    final_params: Option<HashMap<String, Vec<f32>>>,
    trace: Vec<fsdp::trace::TraceEvent>,
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Write `contents` to `path` atomically: a temporary file in the same directory, fsync,
/// rename.
fn write_atomic(path: &Path, contents: &[u8]) -> Result<(), CliError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| fail(format!("{} is not a file path", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let io = |e: std::io::Error| fail(format!("cannot write {}: {e}", path.display()));
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(contents).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(e)
    })
}

/// The initial parameters of a checkpoint, or `None` for the sharded seeded initialisation
/// (each rank draws only its own shards; the same model at every world size).
fn initial_params(
    args: &TrainArgs,
    cfg: &GptConfig,
) -> Result<Option<HashMap<String, Vec<f32>>>, CliError> {
    match &args.init_from {
        Some(path) => Ok(Some(load_checkpoint(path, cfg)?)),
        None => {
            // Check the rule covers every parameter before any rank starts.
            let rule = gpt2_init(cfg.n_layer);
            for p in param_specs(cfg) {
                rule(&p.name, &p.shape)?;
            }
            Ok(None)
        }
    }
}

fn load_checkpoint(path: &Path, cfg: &GptConfig) -> Result<HashMap<String, Vec<f32>>, CliError> {
    Ok(fsdp_gpt::checkpoint::load_full(path, cfg)?)
}

fn save_checkpoint(
    path: &Path,
    cfg: &GptConfig,
    params: &HashMap<String, Vec<f32>>,
) -> Result<(), CliError> {
    Ok(fsdp_gpt::checkpoint::save_full(path, cfg, params)?)
}

/// Rows per micro-batch (all ranks) for `batch_size` rows in `grad_accum` micro-batches on
/// `world` ranks.
fn micro_batch(batch_size: usize, grad_accum: usize, world: usize) -> Result<usize, CliError> {
    if batch_size == 0 {
        return Err(fail("--batch-size must be at least 1"));
    }
    if grad_accum == 0 {
        return Err(fail("--grad-accum must be at least 1"));
    }
    if batch_size % grad_accum != 0 {
        return Err(fail(format!(
            "--batch-size {batch_size} is not divisible by --grad-accum {grad_accum}"
        )));
    }
    let micro = batch_size / grad_accum;
    if micro % world != 0 {
        return Err(fail(format!(
            "--batch-size {batch_size} ({micro} rows per micro-batch) is not divisible by \
             --ranks {world}"
        )));
    }
    Ok(micro)
}

fn print_plan(args: &PlanArgs) -> Result<(), CliError> {
    let world = args.model.ranks.unwrap_or(DEFAULT_RANKS);
    let Setup { cfg, config, plan } = setup(&args.model, world)?;
    let micro = micro_batch(args.batch_size, args.grad_accum, world)?;
    let p = fsdp_gpt::plan::plan(&cfg, world, &config, &plan, micro / world, cfg.block_size)?;
    print!("{p}");
    Ok(())
}

fn train(args: &TrainArgs) -> Result<(), CliError> {
    // ---- Validate everything before any rank starts.
    let mode = train_mode(args)?;
    let world = match &mode {
        Mode::Threads(n) => *n,
        Mode::Process { world, .. } => *world,
    };
    let Setup { cfg, config, plan } = setup(&args.model, world)?;
    let t = cfg.block_size;
    let micro = micro_batch(args.batch_size, args.grad_accum, world)?;
    if args.steps == 0 {
        return Err(fail("--steps must be at least 1"));
    }
    if let Some(c) = args.grad_clip {
        if !(c.is_finite() && c > 0.0) {
            return Err(fail("--grad-clip must be a positive number"));
        }
    }
    let opt = AdamWConfig {
        lr: args.lr,
        beta1: args.beta1,
        beta2: args.beta2,
        eps: args.eps,
        weight_decay: args.weight_decay,
    };
    opt.validate()?;
    let schedule = lr_schedule(args)?;
    let decay_2d_only = args.decay_2d_only;
    let tokens = match &args.data {
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
    };
    let params = initial_params(args, &cfg)?;
    let seed = args.seed;
    // Check the output paths' directories now rather than after training.
    for p in [&args.save, &args.loss_log, &args.trace]
        .into_iter()
        .flatten()
    {
        if let Some(d) = p.parent() {
            if !d.as_os_str().is_empty() && !d.is_dir() {
                return Err(fail(format!(
                    "{}: directory {} does not exist",
                    p.display(),
                    d.display()
                )));
            }
        }
    }

    // ---- Train.
    let global_tokens = args.batch_size * t;
    let steps = args.steps;
    let accum = args.grad_accum;
    let want_params = args.save.is_some();
    let mut config = config;
    config.trace = args.trace.is_some();
    let tty = std::io::stderr().is_terminal();
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    // Under a launcher this process is one rank: meet the others now (validation is done).
    let process_comm = match &mode {
        Mode::Threads(_) => None,
        Mode::Process { backend, .. } => {
            let comm = init_from_env(*backend, &InitOptions::default())?;
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
    let mem_now: Vec<AtomicU64> = (0..world).map(|_| AtomicU64::new(0)).collect();
    if leader {
        println!(
        "fsdp train: {} ranks, {}, GPT {} layers × {} heads × {} wide ({} parameters, {} units), \
         batch {} × {} tokens{}",
        world,
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
    }
    let start = Instant::now();
    let run = |comm: Box<dyn Communicator>| -> Result<RankReport, FsdpError> {
        let rank = comm.rank();
        let rule = gpt2_init(cfg.n_layer);
        let init = match &params {
            Some(p) => ParamInit::Full(p),
            None => ParamInit::Seeded { seed, rule: &rule },
        };
        let mut model = FsdpGpt::with_init(comm, cfg, &plan, init, config, opt)?;
        model.set_lr_schedule(schedule)?;
        if decay_2d_only {
            model.set_param_groups(decay_2d_only_groups(opt.weight_decay), |_, shape| {
                decay_2d_only_group(shape)
            })?;
        }
        let mut losses = Vec::with_capacity(steps);
        let (mut ag, mut rs, mut ar) = (0u64, 0u64, 0u64);
        for step in 0..steps {
            let t0 = Instant::now();
            let mut loss = 0.0f32;
            for m in 0..accum {
                let k = (step * accum + m) as u64;
                let batch = get_batch(&tokens, k, micro, t, rank, world)?;
                let l = if m + 1 < accum {
                    model.no_sync(|f| f.forward_backward(&batch, global_tokens))?
                } else {
                    model.forward_backward(&batch, global_tokens)?
                };
                loss += l;
            }
            if let Some(c) = args.grad_clip {
                model.clip_grad_norm(c)?;
            }
            model.optimizer_step()?;
            let dt = t0.elapsed().as_secs_f64();
            // Communication volume from the recorded schedule and the units' layouts.
            for e in model.schedule() {
                let Some(layout) = model.layout(e.unit) else {
                    continue;
                };
                let bytes = |n: usize| (n * std::mem::size_of::<f32>()) as u64;
                match e.kind {
                    ScheduleKind::AllGather => ag += bytes(layout.padded_numel()),
                    ScheduleKind::ReduceScatter => rs += bytes(layout.padded_numel()),
                    ScheduleKind::AllReduce => ar += bytes(layout.shard_numel()),
                    ScheduleKind::Free => {}
                }
            }
            model.clear_schedule();
            let stats = model.memory_stats();
            mem_now[rank].store(stats.allocated_bytes.all.peak, Ordering::Relaxed);
            losses.push((loss, dt, stats.allocated_bytes.all.peak));
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
                if tty {
                    bar.set_message(msg);
                    bar.inc(1);
                } else if step == 0 || (step + 1) % (steps / 10).max(1) == 0 {
                    println!("{msg}");
                }
            }
        }
        let final_params = if want_params {
            let p = model.full_params()?;
            (rank == 0).then_some(p)
        } else {
            None
        };
        let stats = model.memory_stats();
        let trace = model.trace_events();
        Ok(RankReport {
            trace,
            losses,
            peak_allocated: stats.allocated_bytes.all.peak,
            peak_reserved: stats.reserved_bytes.all.peak,
            num_alloc_retries: stats.num_alloc_retries,
            all_gathered: ag,
            reduce_scattered: rs,
            all_reduced: ar,
            final_params,
        })
    };
    let mut reports = Vec::with_capacity(world);
    let elapsed;
    match process_comm {
        None => {
            let results =
                ring::run_ranks(world, ring::RingOptions::default(), |c| run(Box::new(c)))?;
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
            let mut own = run(comm)?;
            elapsed = start.elapsed();
            let others = gather_rank_stats(stats_comm.as_ref(), &own)?;
            if let Some(path) = &args.trace {
                if rank > 0 {
                    let per_rank = vec![std::mem::take(&mut own.trace)];
                    fsdp::trace::write_chrome_trace(&rank_path(path, rank), &per_rank)?;
                }
            }
            if rank != 0 {
                bar.finish_and_clear();
                return Ok(());
            }
            reports.push(own);
            reports.extend(others.into_iter().skip(1));
        }
    }
    bar.finish_and_clear();

    // ---- Outputs.
    let rank0 = &reports[0];
    if let Some(path) = &args.loss_log {
        let mut csv = String::from("step,loss,tokens_per_s,peak_allocated_bytes_rank0\n");
        for (i, (loss, dt, peak)) in rank0.losses.iter().enumerate() {
            csv.push_str(&format!(
                "{i},{loss:.8},{:.1},{peak}\n",
                global_tokens as f64 / dt
            ));
        }
        write_atomic(path, csv.as_bytes())?;
    }
    if let Some(path) = &args.save {
        let params = rank0
            .final_params
            .as_ref()
            .ok_or_else(|| fail("rank 0 returned no parameters"))?;
        save_checkpoint(path, &cfg, params)?;
    }
    if let Some(path) = &args.trace {
        // Under a launcher only rank 0's events are here (the others wrote their own files).
        let per_rank: Vec<Vec<fsdp::trace::TraceEvent>> = reports
            .iter_mut()
            .map(|r| std::mem::take(&mut r.trace))
            .filter(|t| !t.is_empty())
            .collect();
        fsdp::trace::write_chrome_trace(path, &per_rank)?;
    }
    print_summary(&reports, elapsed, global_tokens, steps);
    Ok(())
}

/// How `train` runs its ranks.
enum Mode {
    /// Ranks as threads of this process on the ring backend.
    Threads(usize),
    /// This process is one rank of `world`, started by a launcher or by mpirun.
    Process { backend: Backend, world: usize },
}

/// The world size under mpirun, from the variables that Open MPI (`OMPI_COMM_WORLD_SIZE`) and
/// PMI-based launchers such as MPICH's (`PMI_SIZE`) set.
fn mpi_world_from_env() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
}

fn train_mode(args: &TrainArgs) -> Result<Mode, CliError> {
    let launched = LaunchEnv::from_env()?;
    let backend = match args.backend {
        Some(b) => b,
        None if launched.is_some() => TrainBackend::Process(Backend::Tcp),
        None if cfg!(feature = "mpi") && mpi_world_from_env().is_some() => {
            TrainBackend::Process(Backend::Mpi)
        }
        None => TrainBackend::Ring,
    };
    let given = args.model.ranks;
    let (backend, world) = match backend {
        TrainBackend::Ring => return Ok(Mode::Threads(given.unwrap_or(DEFAULT_RANKS))),
        TrainBackend::Process(Backend::Mpi) => {
            let world = mpi_world_from_env().ok_or_else(|| {
                fail("--backend mpi: not started by mpirun (OMPI_COMM_WORLD_SIZE / PMI_SIZE unset)")
            })?;
            (Backend::Mpi, world)
        }
        TrainBackend::Process(b) => match &launched {
            Some(env) => (b, env.world_size),
            None => {
                return Err(fail(format!(
                    "--backend {b}: RANK and WORLD_SIZE are not set; start the ranks with \
                     `fsdp launch --nproc-per-node N train ...`"
                )))
            }
        },
    };
    if let Some(n) = given {
        if n != world {
            return Err(fail(format!(
                "--ranks {n} disagrees with the launcher's world size {world}"
            )));
        }
    }
    Ok(Mode::Process { backend, world })
}

/// `path` with `.rankN` before its extension.
fn rank_path(path: &Path, rank: usize) -> PathBuf {
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// Every rank's memory and traffic figures, gathered on every rank (for rank 0's summary).
fn gather_rank_stats(
    comm: &dyn Communicator,
    own: &RankReport,
) -> Result<Vec<RankReport>, CliError> {
    // f64 holds these integers exactly (all far below 2^53).
    let mine = [
        own.peak_allocated,
        own.peak_reserved,
        own.num_alloc_retries,
        own.all_gathered,
        own.reduce_scattered,
        own.all_reduced,
    ]
    .map(|v| v as f64);
    let world = comm.world_size();
    let input = Buffer::from_slice(&mine).map_err(|e| fail(e.to_string()))?;
    let output = Buffer::zeros(DType::F64, mine.len() * world).map_err(|e| fail(e.to_string()))?;
    comm.all_gather_base(&input, &output)?.wait()?;
    let all = output.to_vec::<f64>().map_err(|e| fail(e.to_string()))?;
    Ok(all
        .chunks(mine.len())
        .map(|v| RankReport {
            losses: Vec::new(),
            peak_allocated: v[0] as u64,
            peak_reserved: v[1] as u64,
            num_alloc_retries: v[2] as u64,
            all_gathered: v[3] as u64,
            reduce_scattered: v[4] as u64,
            all_reduced: v[5] as u64,
            final_params: None,
            trace: Vec::new(),
        })
        .collect())
}

/// `fsdp launch`: the exit status is the first failed rank's, or success.
fn run_launch(args: LaunchArgs) -> ExitCode {
    let mut command = args.command.into_iter();
    let Some(first) = command.next() else {
        eprintln!("error: launch: no program given");
        return ExitCode::FAILURE;
    };
    let mut rest: Vec<OsString> = command.collect();
    // `train ...` / `plan ...`: this program's subcommands.
    let program = if first == "train" || first == "plan" {
        match std::env::current_exe() {
            Ok(exe) => {
                rest.insert(0, first);
                exe.into_os_string()
            }
            Err(e) => {
                eprintln!("error: launch: cannot find this program's path: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        first
    };
    if args.nproc_per_node == 0 {
        eprintln!("error: launch: --nproc-per-node must be at least 1");
        return ExitCode::FAILURE;
    }
    let opts = LaunchOptions::new(args.nproc_per_node, program)
        .with_args(rest)
        .with_master(args.master_addr, args.master_port);
    match launch::run(&opts) {
        Ok(report) => {
            if let Some((rank, status)) = report.first_failure() {
                eprintln!("error: launch: rank {rank} failed ({status}); the others were ended");
            }
            // Statuses outside 0..=255 (none on Unix) become 1.
            ExitCode::from(u8::try_from(report.exit_code()).unwrap_or(1))
        }
        Err(e) => {
            eprintln!("error: launch: {}", e.to_string().replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

fn print_summary(reports: &[RankReport], elapsed: Duration, global_tokens: usize, steps: usize) {
    let losses = &reports[0].losses;
    let first = losses.first().map_or(f32::NAN, |l| l.0);
    let last = losses.last().map_or(f32::NAN, |l| l.0);
    let secs = elapsed.as_secs_f64();
    println!(
        "done: {steps} steps in {secs:.1} s ({:.0} tokens/s); loss {first:.4} -> {last:.4}",
        (global_tokens * steps) as f64 / secs
    );
    println!(
        "{:>4}  {:>14}  {:>14}  {:>11}  {:>16}  {:>16}  {:>16}",
        "rank",
        "peak allocated",
        "peak reserved",
        "alloc retries",
        "all-gathered",
        "reduce-scattered",
        "all-reduced"
    );
    for (rank, r) in reports.iter().enumerate() {
        println!(
            "{:>4}  {:>14}  {:>14}  {:>11}  {:>16}  {:>16}  {:>16}",
            rank,
            human_bytes(r.peak_allocated),
            human_bytes(r.peak_reserved),
            r.num_alloc_retries,
            human_bytes(r.all_gathered),
            human_bytes(r.reduce_scattered),
            human_bytes(r.all_reduced)
        );
    }
}
