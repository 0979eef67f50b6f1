//! The command line: clap's structures of `fsdp train`, `fsdp plan` and `fsdp launch`, and the
//! parsers of their option values.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use fsdp_collectives::Backend;
use fsdp_device::DType;
use fsdp_gpt::runtime::{BackwardPrefetch, ShardingStrategy};
use fsdp_kernels::gpt::{Attention, Logits};

#[derive(Parser, Debug)]
#[command(
    name = "fsdp",
    version,
    about = "Fully sharded data parallel GPT training on the CPU: ranks as threads (ring backend) \
             or as processes (`fsdp launch`, mpirun)"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

// Parsed once per run: the size of `TrainArgs` does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Train a GPT with FSDP and print a summary.
    Train(TrainArgs),
    /// Print the memory plan: per unit the parameters, the per-rank payload of each collective
    /// and the collectives per step; per rank the predicted peak memory by category.
    Plan(PlanArgs),
    /// Start one process per rank, like `torchrun --nnodes N --node-rank R --nproc-per-node P`:
    /// sets RANK (R·P + LOCAL_RANK), WORLD_SIZE (N·P), LOCAL_RANK, LOCAL_WORLD_SIZE (P),
    /// GROUP_RANK (R), MASTER_ADDR and MASTER_PORT, prefixes each line of output with the rank,
    /// and when one process fails ends the others and exits with its status. `fsdp launch -n 2
    /// train ...` runs this program's `train` in every process; run it once per node for
    /// several nodes.
    Launch(LaunchArgs),
}

#[derive(Args, Debug)]
pub(crate) struct LaunchArgs {
    /// Processes (ranks) to start on this machine.
    #[arg(long, short = 'n')]
    pub(crate) nproc_per_node: usize,
    /// Nodes (machines) of the job: run `fsdp launch` once on each, with the same options and
    /// its own --node-rank. Off loopback the nodes must share a job token (FSDP_JOB_TOKEN or
    /// FSDP_JOB_TOKEN_FILE).
    #[arg(long, default_value_t = 1)]
    pub(crate) nnodes: usize,
    /// This node's index in 0..--nnodes; node 0's rank 0 hosts the rendezvous store.
    #[arg(long, default_value_t = 0)]
    pub(crate) node_rank: usize,
    /// Address of the rendezvous store, hosted by rank 0 (node 0): an address of node 0 that
    /// every node reaches when --nnodes is more than 1.
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) master_addr: String,
    /// Port of the rendezvous store (0: pick a free one).
    #[arg(long, default_value_t = 29500)]
    pub(crate) master_port: u16,
    /// Timeout of every collective of the ranks, in seconds (passed as FSDP_TIMEOUT; default
    /// 300).
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    pub(crate) timeout: Option<Duration>,
    /// Timeout of the rendezvous and the communicator's set-up, in seconds (passed as
    /// FSDP_INIT_TIMEOUT; default: --timeout).
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    pub(crate) init_timeout: Option<Duration>,
    /// The program to start and its arguments (`train ...` or `plan ...`: this program).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub(crate) command: Vec<OsString>,
}

#[derive(Args, Debug)]
pub(crate) struct PlanArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    #[command(flatten)]
    pub(crate) optim: OptimizerArgs,
    /// Global batch size in rows (over all ranks and micro-batches).
    #[arg(long, default_value_t = 16)]
    pub(crate) batch_size: usize,
    /// Micro-batches per optimizer step (gradients accumulated under no_sync: the plan holds
    /// the unsharded gradients kept between micro-batches).
    #[arg(long, default_value_t = 1)]
    pub(crate) grad_accum: usize,
    /// The memory to check the plan against, as `fsdp train --memory-limit` (default: the
    /// memory available, detected).
    #[arg(long, value_name = "BYTES", value_parser = crate::admission::parse_bytes)]
    pub(crate) memory_limit: Option<u64>,
    /// `cpu` (the default): the sharded engine's plan. `cuda` / `cuda:N`: the device memory of
    /// `fsdp train --device cuda` (one rank without the engine: parameters, gradients,
    /// accumulators, AdamW's moments, the bf16 operand copies with `--param-dtype bf16`, the
    /// activations of a micro-batch, and the peak of a step, predicted exactly as the run
    /// counts it).
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda|cuda:N", value_parser = parse_device)]
    pub(crate) device: DeviceArg,
    /// With --device: the clipping of `fsdp train --grad-clip` (0: none), whose scaled copy of
    /// each gradient is held with the gradient for a moment.
    #[arg(long)]
    pub(crate) grad_clip: Option<f64>,
    /// With --device: the memory of `fsdp train --cpu-offload` (no accumulators, moments or
    /// clipping copies on the device).
    #[arg(long)]
    pub(crate) cpu_offload: bool,
    /// With --device: the device memory of `fsdp train --device … --engine` (the engine's
    /// buffers and the GPT's kernels' in one caching allocator, per rank, for --ranks N as
    /// threads or processes alike; not with --cpu-offload).
    #[arg(long)]
    pub(crate) engine: bool,
    /// The ids of the options given on the command line (not defaults), filled in after
    /// parsing: with --device, the sharded engine's options given are refused.
    #[arg(skip)]
    pub(crate) explicit: Vec<String>,
}

/// The model, the sharding and the wrap policy (shared by the subcommands). `fsdp train` takes
/// the five model sizes not given from `--resume`'s checkpoint or `--init-from`'s file (its
/// metadata, else its tensor shapes; `--n-head` only from metadata), else the defaults.
#[derive(Args, Debug, Clone)]
pub(crate) struct ModelArgs {
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    pub(crate) n_layer: usize,
    /// Attention heads per block.
    #[arg(long, default_value_t = 4)]
    pub(crate) n_head: usize,
    /// Embedding width.
    #[arg(long, default_value_t = 128)]
    pub(crate) n_embd: usize,
    /// Context length (also the training sequence length).
    #[arg(long, default_value_t = 64)]
    pub(crate) block_size: usize,
    /// Vocabulary size (at most 65536: tokens are u16).
    #[arg(long, default_value_t = 256)]
    pub(crate) vocab_size: usize,
    /// Number of ranks: threads on the ring backend (default 4). Under a launcher the world
    /// size comes from the launcher, and this option, if given, must agree with it.
    #[arg(long)]
    pub(crate) ranks: Option<usize>,
    /// full-shard, shard-grad-op, no-shard, hybrid-shard or hybrid-shard-zero2.
    #[arg(long, default_value = "full-shard", value_parser = parse_strategy)]
    pub(crate) strategy: ShardingStrategy,
    /// Ranks per node for the hybrid strategies: each node's ranks shard, the nodes replicate
    /// (default: the launcher's LOCAL_WORLD_SIZE under `fsdp launch`, torchrun or mpirun; all
    /// ranks on one node otherwise).
    #[arg(long)]
    pub(crate) ranks_per_node: Option<usize>,
    /// Backward prefetch: pre, post or none.
    #[arg(long, default_value = "pre", value_parser = parse_prefetch)]
    pub(crate) backward_prefetch: BackwardPrefetch,
    /// Prefetch the next unit's all-gather in forward (from the second step).
    #[arg(long)]
    pub(crate) forward_prefetch: bool,
    /// At most N all-gathered buffers in flight, or `off`.
    #[arg(long, default_value = "2", value_parser = parse_limit)]
    pub(crate) limit_all_gathers: Limit,
    /// Wrap policy: `block` (one unit per transformer block) or `size:N` (modules of at
    /// least N parameters).
    #[arg(long, default_value = "block", value_parser = parse_wrap)]
    pub(crate) wrap: Wrap,
    /// Activation checkpointing of every transformer block: a block keeps only its input in
    /// forward and is recomputed right before its backward, with the parameters already
    /// gathered for it (no extra all-gather; the same losses and weights, bitwise). Lowers the
    /// activations' peak from every block's saved activations to their inputs plus one block's.
    #[arg(long)]
    pub(crate) activation_checkpointing: bool,
    /// With --device: how each block's attention holds its T × T scores and probabilities:
    /// `chunked` (the default: 64 MiB of (sequence, head) pairs at a time, computed again in
    /// backward instead of kept, as flash attention does; `chunked:N` for N MiB) or
    /// `materialized` (every pair's probabilities kept from forward for backward: more memory,
    /// no recomputation) — the same losses either way on the host twins, bitwise — or `fused`
    /// (flash attention on tensor cores: no T × T matrix at all, each row's log-sum-exp kept;
    /// bf16 or f16 products only, on CUDA heads of 32 or 64 values; within 16-bit rounding of the
    /// others).
    #[arg(long)]
    pub(crate) attention: Option<Attention>,
    /// With --device: how the head holds its tokens × vocabulary logits: `chunked` (the
    /// default: 256 MiB of logits at a time, each chunk's cross-entropy and backward before
    /// the next's; `chunked:N` for N MiB) or `whole` (every token's logits at once). The same losses either way on
    /// the host twins, bitwise; the tied embedding's gradient is summed chunk by chunk.
    #[arg(long)]
    pub(crate) logits: Option<Logits>,
    /// Mixed precision: the dtype parameters are all-gathered and read in (f32, bf16 or f16;
    /// the sharded master weights and the optimizer stay f32, except under --optimizer
    /// anyprecision-adamw, which stores the shards in this dtype: f32 or bf16). Default f32;
    /// bf16 with --device cuda.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub(crate) param_dtype: DType,
    /// Mixed precision: the dtype gradients are reduced in (f32, bf16 or f16; default: the
    /// parameter dtype, as PyTorch).
    #[arg(long, value_parser = parse_dtype)]
    pub(crate) reduce_dtype: Option<DType>,
    /// The caching allocator's options in PyTorch's `PYTORCH_CUDA_ALLOC_CONF` syntax, for
    /// every rank (e.g. `expandable_segments:True,max_split_size_mb:128,
    /// roundup_power2_divisions:[256:1,>:4],garbage_collection_threshold:0.6`). Default: the
    /// `PYTORCH_ALLOC_CONF` environment variable, else `PYTORCH_CUDA_ALLOC_CONF`.
    #[arg(long, value_name = "CONF")]
    pub(crate) alloc_conf: Option<String>,
}

impl ModelArgs {
    /// The first of the options only the device's GPT has (`--attention`, `--logits`) that
    /// is given, for the CPU engine's refusal.
    pub(crate) fn device_only_option(&self) -> Option<&'static str> {
        [
            ("--attention", self.attention.is_some()),
            ("--logits", self.logits.is_some()),
        ]
        .into_iter()
        .find_map(|(option, given)| given.then_some(option))
    }
}

/// The optimizer (shared by `fsdp train` and `fsdp plan`, whose memory depends on it).
#[derive(Args, Debug, Clone)]
pub(crate) struct OptimizerArgs {
    /// `adamw` (torch.optim.AdamW on f32 master shards: 8 bytes of state per element) or
    /// `anyprecision-adamw` (torchdistx's AnyPrecisionAdamW: the shards stored in
    /// --param-dtype, so with bf16 pure-bf16 training without f32 master weights; moments and
    /// Kahan compensation in --optimizer-state-dtype). --lr, --beta1, --beta2, --eps and
    /// --weight-decay apply to both.
    #[arg(long, default_value = "adamw", value_parser = parse_optimizer)]
    pub(crate) optimizer: OptimizerKind,
    /// AnyPrecisionAdamW: Kahan summation of the parameter update into a compensation buffer,
    /// so that updates below the parameter's precision accumulate (default: on).
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    pub(crate) kahan_summation: Option<bool>,
    /// AnyPrecisionAdamW: the dtype of its momentum, variance and compensation buffers, bf16
    /// or f32 (default: bf16).
    #[arg(long, value_name = "bf16|f32", value_parser = parse_state_dtype)]
    pub(crate) optimizer_state_dtype: Option<DType>,
}

/// `--optimizer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OptimizerKind {
    AdamW,
    AnyPrecisionAdamW,
}

fn parse_optimizer(s: &str) -> Result<OptimizerKind, String> {
    crate::optimizer::kind_from_option(s)
        .ok_or_else(|| "expected adamw or anyprecision-adamw".into())
}

fn parse_state_dtype(s: &str) -> Result<DType, String> {
    match s {
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f32" | "fp32" | "float32" => Ok(DType::F32),
        _ => Err("expected bf16 or f32".into()),
    }
}

#[derive(Args, Debug, Clone)]
pub(crate) struct TrainArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    #[command(flatten)]
    pub(crate) optim: OptimizerArgs,
    /// Global batch size in rows (over all ranks and micro-batches).
    #[arg(long, default_value_t = 16)]
    pub(crate) batch_size: usize,
    /// Micro-batches per optimizer step (gradients accumulated under no_sync).
    #[arg(long, default_value_t = 1)]
    pub(crate) grad_accum: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 250)]
    pub(crate) steps: usize,
    /// Learning rate (of either --optimizer).
    #[arg(long, default_value_t = 3e-3)]
    pub(crate) lr: f64,
    /// Decay of the first moment (betas[0]).
    #[arg(long, default_value_t = 0.9)]
    pub(crate) beta1: f64,
    /// Decay of the second moment (betas[1]).
    #[arg(long, default_value_t = 0.95)]
    pub(crate) beta2: f64,
    /// Epsilon, added to the denominator.
    #[arg(long, default_value_t = 1e-8)]
    pub(crate) eps: f64,
    /// Decoupled weight decay.
    #[arg(long, default_value_t = 0.1)]
    pub(crate) weight_decay: f64,
    /// Decay only the parameters of 2 or more dimensions (nanoGPT's `configure_optimizers`:
    /// weights decay; biases and LayerNorm parameters do not).
    #[arg(long)]
    pub(crate) decay_2d_only: bool,
    /// Learning-rate schedule: `constant`, or `cosine` (nanoGPT's `get_lr`: linear warmup for
    /// --warmup-iters steps, cosine decay to --min-lr at --lr-decay-iters, then --min-lr).
    #[arg(long, default_value = "constant", value_parser = parse_schedule_kind)]
    pub(crate) lr_schedule: ScheduleKindArg,
    /// Warmup steps of the cosine schedule.
    #[arg(long, default_value_t = 0)]
    pub(crate) warmup_iters: u64,
    /// Step at which the cosine schedule reaches --min-lr (default: --steps).
    #[arg(long)]
    pub(crate) lr_decay_iters: Option<u64>,
    /// Final learning rate of the cosine schedule (default: --lr / 10, as nanoGPT).
    #[arg(long)]
    pub(crate) min_lr: Option<f64>,
    /// Clip the global gradient norm to this value; 0 means no clipping, as nanoGPT's
    /// `grad_clip = 0.0` (default: no clipping).
    #[arg(long)]
    pub(crate) grad_clip: Option<f64>,
    /// Skip up to N steps whose global loss or gradient norm is NaN or infinite (no optimizer
    /// step; their gradients are discarded, as PyTorch's GradScaler skips an overflowing step)
    /// instead of stopping; the (N+1)-th such step stops the run with an error (0: the first
    /// one does).
    #[arg(long, default_value_t = 0)]
    pub(crate) skip_nonfinite: usize,
    /// Dynamic loss scaling for fp16, as PyTorch's ShardedGradScaler: `on` or `off` (default:
    /// on with --param-dtype f16, off otherwise). Gradients are multiplied by the scale before
    /// their reduction and unscaled on the shards; a step whose gradients overflow on any rank
    /// is skipped on every rank (not counted against --skip-nonfinite) and the scale halved;
    /// after --growth-interval steps without overflow it doubles.
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    pub(crate) grad_scaler: Option<bool>,
    /// The grad scaler's initial scale (default 65536, i.e. 2^16).
    #[arg(long, value_name = "SCALE", allow_negative_numbers = true)]
    pub(crate) init_scale: Option<f64>,
    /// Steps without overflow after which the grad scaler doubles its scale (default 2000).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub(crate) growth_interval: Option<u32>,
    /// Seed of the initial weights and of the generated corpus.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Training tokens: little-endian u16 (nanoGPT's train.bin); default: a generated corpus.
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// Initial weights (safetensors, nanoGPT names and shapes).
    #[arg(long)]
    pub(crate) init_from: Option<PathBuf>,
    /// Write the final weights here (safetensors, nanoGPT names and shapes).
    #[arg(long)]
    pub(crate) save: Option<PathBuf>,
    /// Write a CSV of step, loss, tokens/s and rank 0's peak allocated bytes.
    #[arg(long)]
    pub(crate) loss_log: Option<PathBuf>,
    /// Write a Chrome trace (JSON) of compute and communication per rank (under a launcher,
    /// each rank N > 0 writes its own file, named with `.rankN` before the extension).
    #[arg(long)]
    pub(crate) trace: Option<PathBuf>,
    /// Record rank 0's memory history (every allocation, free and segment of its caching
    /// allocator, with the engine's frames such as "unit 3 (h.0) all-gather") and write its
    /// snapshot here at the end, in the pickle layout of PyTorch's
    /// `torch.cuda.memory._snapshot()`: draw it with
    /// `python -m torch.cuda._memory_viz trace_plot FILE -o out.html`.
    #[arg(long, value_name = "FILE")]
    pub(crate) memory_snapshot: Option<PathBuf>,
    /// Communication backend: `ring` (ranks as threads of this process; the default), `tcp`
    /// (ranks as processes; the default under `fsdp launch` or torchrun), `mpi` (under
    /// `mpirun`; the default there when this program is built with the feature `mpi`) or
    /// `nccl` (`--device cuda` under a launcher, one GPU per rank: the default there when
    /// every rank of a host has a GPU of its own).
    #[arg(long, value_parser = parse_backend)]
    pub(crate) backend: Option<TrainBackend>,
    /// Where the model trains: `cpu` (the default: the sharded engine, any --ranks) or `cuda`
    /// / `cuda:N` (one GPU, one rank, without the sharded engine: the GPT's NVRTC kernels and
    /// cuBLAS on one CUDA stream, AdamW on the device; by default (`--param-dtype bf16`)
    /// products of bf16-rounded operands with f32 sums (every other layer f32, as
    /// `torch.autocast`), with `--param-dtype f32` all in f32; the options of sharding,
    /// checkpointing, tracing and memory admission are refused); with `--engine`, through the
    /// sharded engine on the device instead.
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda|cuda:N", value_parser = parse_device)]
    pub(crate) device: DeviceArg,
    /// With --device: CPU offload (PyTorch's `CPUOffload(offload_params=True)`): the master
    /// parameters, the gradient accumulators and AdamW's moments in host memory, the optimizer
    /// step on the host; the device keeps the working parameters (updated after each step), one
    /// micro-batch's gradients and the activations. The same training as without it.
    #[arg(long)]
    pub(crate) cpu_offload: bool,
    /// With --device: train through the fsdp engine instead of the GPT's device trainer: the
    /// engine's buffers on the device (its sharding: every --strategy, --ranks N as threads on
    /// the one device over the CUDA ring, or under fsdp launch a process per GPU over NCCL;
    /// clipping, schedules, the grad scaler, the non-finite rule decided on the device, sharded
    /// checkpoints) and the GPT's kernels reading its unsharded parameters in place (gathered
    /// in f32; --param-dtype chooses the products' operands); admitted on `fsdp plan --device
    /// … --engine`. Not with --optimizer anyprecision-adamw.
    #[arg(long)]
    pub(crate) engine: bool,
    /// Timeout of every collective, in seconds: a peer that does not reach a collective in
    /// time fails it on every rank (default: FSDP_TIMEOUT, else 300); with --device cuda, of
    /// every wait for the GPU (a step's outcome, a copy).
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    pub(crate) timeout: Option<Duration>,
    /// Timeout of the rendezvous (every rank meeting at the store) and of the communicator's
    /// set-up, in seconds (default: FSDP_INIT_TIMEOUT, else --timeout).
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    pub(crate) init_timeout: Option<Duration>,
    /// Memory available to this run, replacing the detected figure (the smaller of
    /// /proc/meminfo's MemAvailable and the cgroup limit's headroom): in bytes, or with a
    /// suffix K, M, G, T (powers of 1024), e.g. 512M or 2G. Thread mode: for this process;
    /// under a launcher: for the ranks of this host. Before any allocation the plan's
    /// prediction (every rank's allocator peak, optimizer state and activations) is checked
    /// against it, and each rank's allocator gets its share as capacity. With --device: the
    /// device memory available, replacing the GPU's free memory, against which the plan's peak
    /// (fsdp plan --device) is checked.
    #[arg(long, value_name = "BYTES", value_parser = crate::admission::parse_bytes)]
    pub(crate) memory_limit: Option<u64>,
    /// Write a sharded checkpoint (parameters, optimizer state, step, data position and the
    /// run's options) into DIR/step-K every --checkpoint-every steps; each is complete or absent.
    #[arg(long, value_name = "DIR")]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (with --checkpoint-dir; on --resume, the checkpoint's by
    /// default).
    #[arg(long, value_name = "N")]
    pub(crate) checkpoint_every: Option<usize>,
    /// Complete checkpoints kept in --checkpoint-dir: older ones are removed once a new one is
    /// complete.
    #[arg(long, value_name = "K", default_value_t = 2)]
    pub(crate) keep_checkpoints: usize,
    /// Continue the run of the newest complete checkpoint DIR/step-K, at any number of ranks:
    /// the options not given are the checkpoint's, those given that define the run must agree
    /// with it, and checkpoints go on into DIR unless --checkpoint-dir says otherwise.
    #[arg(long, value_name = "DIR")]
    pub(crate) resume: Option<PathBuf>,
    /// The ids of the options given on the command line (not defaults), filled in after
    /// parsing: options not given may be taken from --resume's checkpoint or --init-from's file.
    #[arg(skip)]
    pub(crate) explicit: Vec<String>,
}

/// `--lr-schedule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScheduleKindArg {
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

/// `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeviceArg {
    /// The CPU, through the sharded engine.
    Cpu,
    /// CUDA device `ordinal`, one rank without the engine; `indexed`: spelled `cuda:N` (else
    /// `cuda`, device 0), for the messages.
    Cuda { ordinal: usize, indexed: bool },
    /// Not shown in the help: the device trainer on the kernels' host twins (`HostOps`), so
    /// that the `--device cuda` path runs end to end without a GPU (tests).
    HostTwin,
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceArg::Cpu => write!(f, "cpu"),
            DeviceArg::Cuda {
                ordinal,
                indexed: true,
            } => write!(f, "cuda:{ordinal}"),
            DeviceArg::Cuda { .. } => write!(f, "cuda"),
            DeviceArg::HostTwin => write!(f, "host-twin"),
        }
    }
}

fn parse_device(s: &str) -> Result<DeviceArg, String> {
    match s {
        "cpu" => Ok(DeviceArg::Cpu),
        "cuda" => Ok(DeviceArg::Cuda {
            ordinal: 0,
            indexed: false,
        }),
        "host-twin" => Ok(DeviceArg::HostTwin),
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(ordinal)) => Ok(DeviceArg::Cuda {
                ordinal,
                indexed: true,
            }),
            _ => Err("expected cpu, cuda or cuda:N".into()),
        },
    }
}

/// `--grad-scaler`, `--kahan-summation`.
fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err("expected on or off".into()),
    }
}

/// `--backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TrainBackend {
    Ring,
    Process(Backend),
}

fn parse_backend(s: &str) -> Result<TrainBackend, String> {
    if s == "ring" {
        return Ok(TrainBackend::Ring);
    }
    match s.parse::<Backend>() {
        Ok(b) => Ok(TrainBackend::Process(b)),
        Err(_) => Err("expected ring, tcp, nccl or mpi".into()),
    }
}

/// `--timeout`, `--init-timeout`: seconds.
fn parse_seconds(s: &str) -> Result<Duration, String> {
    fsdp_collectives::parse_seconds(s)
}

/// `--limit-all-gathers`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limit(pub(crate) Option<usize>);

/// `--wrap`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Wrap {
    Block,
    Size(usize),
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    match s {
        "f32" | "fp32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "fp16" | "float16" => Ok(DType::F16),
        _ => Err(format!("unknown dtype {s:?} (expected f32, bf16 or f16)")),
    }
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

pub(crate) fn strategy_name(s: ShardingStrategy) -> &'static str {
    match s {
        ShardingStrategy::FullShard => "FULL_SHARD",
        ShardingStrategy::ShardGradOp => "SHARD_GRAD_OP",
        ShardingStrategy::NoShard => "NO_SHARD",
        ShardingStrategy::HybridShard => "HYBRID_SHARD",
        ShardingStrategy::HybridShardZero2 => "HYBRID_SHARD_ZERO2",
    }
}
