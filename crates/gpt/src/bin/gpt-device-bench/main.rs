//! `gpt-device-bench`: trains GPT-2 124M and 350M (or the models given) on one device at world
//! 1 and prints, per model, the median step time after warm-up, tokens/s, the peak device
//! memory (counted, planned, and the peak of the memory the buffers come from: the caching
//! allocator's, or the driver's pool under `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`,
//! with its statistics) and MFU — model FLOPs
//! (`6·N + 12·L·T·C` per token, as `benches/torch_fsdp2_gpt.py`) against the GPU's dense bf16
//! peak and against an 8192³ bf16 GEMM measured in the same run. `--device host-twin` runs the
//! same path on the kernels' host twins (no MFU), e.g. `--model tiny` as a smoke test.
//!
//! With `--ranks N` it then trains the same global batch as N ranks, threads over the one
//! device (`ShardedDeviceTrainer` over `PeerComm`, `--strategy`), and prints rank 0's median
//! step and its ratio to the world-1 step measured just before (issue 16's aim: at most 1.1).
//! With `--engine` it also trains the model through the `fsdp` engine (`EngineGpt`: the same
//! operations driven by the engine's hooks, its FULL_SHARD buffers on the device, world 1) and
//! prints that step's ratio to the device trainer's measured just before.
//!
//! ```text
//! gpt-device-bench [--device cuda|cuda:N|host-twin] [--model 124m,350m] [--products bf16|f16|f32]
//!                  [--batch 8] [--steps 20] [--warmup 3] [--cpu-offload] [--activation-checkpointing] [--peak-tflops T]
//!                  [--ranks N [--strategy full-shard|shard-grad-op|no-shard]] [--engine]
//! ```

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use fsdp::engine::GradScalerConfig;
use fsdp::human_bytes;
use fsdp::optim::{AdamWConfig, LrSchedule};
use fsdp::ShardingStrategy;
use fsdp_allocator::{AllocatorBackend, AllocatorConfig};
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_bench::{model_flops_per_token, time_steps, Reads, StepTimes, TimedTrainer};
use fsdp_gpt::device_comm::CommVolume;
use fsdp_gpt::device_peer::PeerComm;
use fsdp_gpt::device_plan::plan_memory;
use fsdp_gpt::device_plan_alloc::plan_allocator;
use fsdp_gpt::device_sharded::ShardedDeviceTrainer;
use fsdp_gpt::device_train::DeviceTrainError;
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig, DeviceTrainer};
use fsdp_gpt::model::GptConfig;
use fsdp_kernels::gemm::{Blas, MatMul};
use fsdp_kernels::gpt::{
    Attention, CudaMemory, CudaOps, GptOps, HostOps, HostProducts, Logits, MemoryUse, PeerOps,
    Products,
};
use fsdp_kernels::host::AnyPrecision;

mod engine;
use engine::run_engine;

/// Dense bf16 peaks (TFLOP/s, without sparsity) by device name, as `torch_fsdp2_gpt.py`.
const BF16_PEAK_TFLOPS: [(&str, f64); 6] = [
    ("H200", 989.4),
    ("H100 SXM", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("A100", 312.0),
    ("L40S", 362.0),
];

#[derive(Parser, Debug)]
#[command(
    name = "gpt-device-bench",
    about = "GPT-2 training step on one device: tokens/s, memory, MFU"
)]
struct Args {
    /// `cuda`, `cuda:N`, or `host-twin` (the kernels' host twins).
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Models, comma-separated: tiny, 124m, 350m.
    #[arg(long, value_delimiter = ',', default_value = "124m,350m")]
    model: Vec<String>,
    /// Products: bf16 (bf16 operands, f32 sums), f16 (f16 operands with the grad scaler) or
    /// f32.
    #[arg(long, default_value = "bf16")]
    products: String,
    /// Rows of a step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Steps to run.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Steps left out of the median at the start.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// CPU offload: the master parameters and the optimizer on the host.
    #[arg(long)]
    cpu_offload: bool,
    /// Activation checkpointing: each block's forward run again before its backward.
    #[arg(long)]
    activation_checkpointing: bool,
    /// The attention's T × T matrices: `chunked` (computed again in backward; `chunked:N` in
    /// chunks of N MiB), `materialized` (kept from forward) or `fused` (flash attention on
    /// tensor cores: none at all; 16-bit products).
    #[arg(long, default_value = "chunked")]
    attention: Attention,
    /// The head's logits: `chunked` (a chunk of tokens at a time; `chunked:N` of N MiB) or
    /// `whole`.
    #[arg(long, default_value = "chunked")]
    logits: Logits,
    /// Read each step's outcome before enqueuing the next (the host waits for the device every
    /// step), instead of one step late as `fsdp train --device` does: the baseline of the
    /// one-late reads.
    #[arg(long)]
    wait_each_step: bool,
    /// After the timed steps, this many more read at once, each timed in its two parts: the
    /// host's enqueuing, and its wait for the device after it (`StepTimes::enqueue`), at world
    /// 1 and for rank 0 of `--ranks` — which of the two sets the pace. 0: none.
    #[arg(long, default_value_t = 5)]
    split_steps: usize,
    /// Dense bf16 peak of the GPU in TFLOP/s (default: by its name).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Train the same global batch as this many ranks, threads over the device.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// The sharding of `--ranks`: full-shard, shard-grad-op or no-shard.
    #[arg(long, default_value = "full-shard")]
    strategy: String,
    /// The dtype `--ranks` reduce their gradients in: f32, bf16 or f16.
    #[arg(long, default_value = "f32", value_parser = reduce_dtype)]
    reduce_dtype: fsdp_device::DType,
    /// The optimizer: adamw (f32 moments), or anyprecision-adamw (torchdistx's, bf16 moments
    /// and Kahan compensation, the parameters' values in the products' dtype: with bf16
    /// products pure bf16, whose ranks all-gather in bf16).
    #[arg(long, default_value = "adamw", value_parser = optimizer, action = clap::ArgAction::Set)]
    optimizer: bool,
    /// Also train through the fsdp engine (`EngineGpt`, world 1, the buffers on the device,
    /// the shards too unless --cpu-offload; nanoGPT's decay groups) and print its step's ratio
    /// to the device trainer's. Not with --optimizer anyprecision-adamw, --products f16 or
    /// --wait-each-step.
    #[arg(long)]
    engine: bool,
    /// Accepted and ignored (`cargo bench` passes it).
    #[arg(long, hide = true)]
    bench: bool,
}

fn reduce_dtype(s: &str) -> Result<fsdp_device::DType, String> {
    match s {
        "f32" => Ok(fsdp_device::DType::F32),
        "bf16" => Ok(fsdp_device::DType::BF16),
        "f16" => Ok(fsdp_device::DType::F16),
        other => Err(format!("--reduce-dtype {other}: expected f32, bf16 or f16")),
    }
}

/// Whether `--optimizer` is AnyPrecisionAdamW.
fn optimizer(s: &str) -> Result<bool, String> {
    match s {
        "adamw" => Ok(false),
        "anyprecision-adamw" => Ok(true),
        other => Err(format!(
            "--optimizer {other}: expected adamw or anyprecision-adamw"
        )),
    }
}

fn strategy(s: &str) -> Result<ShardingStrategy, String> {
    match s {
        "full-shard" => Ok(ShardingStrategy::FullShard),
        "shard-grad-op" => Ok(ShardingStrategy::ShardGradOp),
        "no-shard" => Ok(ShardingStrategy::NoShard),
        other => Err(format!(
            "--strategy {other}: expected full-shard, shard-grad-op or no-shard"
        )),
    }
}

/// `world` ranks as threads, rank `r` on `ops(r)`, each timed as [`run`] times one: rank 0's
/// times and the bytes its collectives moved a step, and every rank's memory.
fn run_sharded<O: PeerOps>(
    ops: impl Fn(usize) -> Result<O, String> + Sync,
    config: DeviceTrainConfig,
    args: &Args,
    world: usize,
) -> Result<(StepTimes, Option<StepTimes>, CommVolume, Vec<MemoryUse>), String>
where
    O::Event: 'static,
{
    let strategy = strategy(&args.strategy)?;
    let params = seeded_params(&config.cfg, 1337).map_err(|e| e.to_string())?;
    let tokens = synthetic_corpus(200_000, config.cfg.vocab_size as u16, 1337);
    let comms = PeerComm::<O>::group(world, std::time::Duration::from_secs(600));
    type End = (StepTimes, Option<StepTimes>, CommVolume, MemoryUse);
    let rank = |r: usize, comm: PeerComm<O>| -> Result<End, String> {
        let mut t = ShardedDeviceTrainer::new(ops(r)?, comm, config, strategy, &params)
            .map_err(|e| format!("rank {r}: {e}"))?;
        let times = time_steps(&mut t, &tokens, args.steps, args.warmup, Reads::OneLate)
            .map_err(|e| format!("rank {r}: {e}"))?;
        let per_step = t.comm_volume().per_step(args.steps as u64);
        let split = split_steps(&mut t, &tokens, args).map_err(|e| format!("rank {r}: {e}"))?;
        Ok((times, split, per_step, t.memory()))
    };
    let ends: Vec<Result<End, String>> = std::thread::scope(|s| {
        let rank = &rank;
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, c)| s.spawn(move || rank(r, c)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a rank's thread panicked".into()))
            })
            .collect()
    });
    let mut first = None;
    let mut memory = Vec::with_capacity(world);
    for end in ends {
        let (t, split, v, m) = end?;
        first.get_or_insert((t, split, v));
        memory.push(m);
    }
    let (times, split, volume) = first.ok_or("no rank")?;
    Ok((times, split, volume, memory))
}

/// (n_layer, n_head, n_embd, block_size, vocab_size) as `torch_fsdp2_gpt.py`'s MODELS.
fn model(name: &str) -> Result<GptConfig, String> {
    let (l, h, e, t, v) = match name {
        "tiny" => (2, 2, 32, 16, 96),
        "124m" => (12, 12, 768, 1024, 50304),
        "350m" => (24, 16, 1024, 1024, 50304),
        other => return Err(format!("--model {other}: expected tiny, 124m or 350m")),
    };
    Ok(GptConfig {
        n_layer: l,
        n_head: h,
        n_embd: e,
        block_size: t,
        vocab_size: v,
    })
}

/// Median TFLOP/s of an `n`³ bf16 product with f32 sums (cuBLAS) on `ops`' stream.
fn gemm_tflops(ops: &CudaOps, n: usize, reps: usize) -> Result<f64, String> {
    let cuda = ops
        .stream()
        .cuda_stream()
        .ok_or("not a CUDA stream")?
        .clone();
    let blas = Blas::new(cuda.clone()).map_err(|e| e.to_string())?;
    let a = cuda
        .alloc_zeros::<fsdp_device::half::bf16>(n * n)
        .map_err(|e| format!("{e:?}"))?;
    let b = cuda
        .alloc_zeros::<fsdp_device::half::bf16>(n * n)
        .map_err(|e| format!("{e:?}"))?;
    let mut c = cuda
        .alloc_zeros::<fsdp_device::half::bf16>(n * n)
        .map_err(|e| format!("{e:?}"))?;
    let g = MatMul::new(n, n, n, false, false);
    let mut times = Vec::with_capacity(reps);
    for i in 0..reps + 3 {
        let t0 = Instant::now();
        blas.matmul(&g, &a, &b, &mut c).map_err(|e| e.to_string())?;
        cuda.synchronize().map_err(|e| format!("{e:?}"))?;
        if i >= 3 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (n as f64).powi(3) / times[times.len() / 2] / 1e12)
}

struct Outcome {
    times: StepTimes,
    /// The steps read at once (`--split-steps`).
    split: Option<StepTimes>,
    counted: MemoryUse,
    pool: Option<MemoryUse>,
    /// Where the buffers came from and what that memory reports.
    memory: Option<(String, String)>,
}

fn run<O: GptOps>(
    ops: O,
    config: DeviceTrainConfig,
    args: &Args,
    after: impl Fn(&O) -> Option<MemoryUse>,
) -> Result<Outcome, String> {
    let params = seeded_params(&config.cfg, 1337).map_err(|e| e.to_string())?;
    let mut trainer = DeviceTrainer::new(ops, config, &params).map_err(|e| e.to_string())?;
    let tokens = synthetic_corpus(200_000, config.cfg.vocab_size as u16, 1337);
    let reads = if args.wait_each_step {
        Reads::AtOnce
    } else {
        Reads::OneLate
    };
    let times = time_steps(&mut trainer, &tokens, args.steps, args.warmup, reads)
        .map_err(|e| e.to_string())?;
    let split = match reads {
        Reads::AtOnce => Some(times.clone()),
        Reads::OneLate => split_steps(&mut trainer, &tokens, args).map_err(|e| e.to_string())?,
    };
    let ops = trainer.ops();
    Ok(Outcome {
        times,
        split,
        counted: trainer.memory(),
        pool: after(ops),
        memory: ops.memory_source().zip(ops.memory_report()),
    })
}

/// `--split-steps` more steps of `trainer`, each read at once and timed in its two parts.
fn split_steps<T: TimedTrainer>(
    trainer: &mut T,
    tokens: &[u16],
    args: &Args,
) -> Result<Option<StepTimes>, DeviceTrainError> {
    if args.split_steps == 0 {
        return Ok(None);
    }
    // One step of warm-up: the first after the one-late steps finds the queue empty.
    let n = args.split_steps + 1;
    time_steps(trainer, tokens, n, 1, Reads::AtOnce).map(Some)
}

/// The line saying who set the pace of `split`'s steps (read at once: the host enqueued each,
/// then waited for the device's queued work).
fn split_line(split: &StepTimes) -> Option<String> {
    let (enqueue, drain) = split.split_medians()?;
    let (e, d) = (enqueue.as_secs_f64() * 1e3, drain.as_secs_f64() * 1e3);
    let pace = if d < 0.05 * (e + d) {
        "the host sets the pace: the device ends right after the last launch"
    } else {
        "the device sets the pace: its queued work outlasts the enqueuing"
    };
    Some(format!(
        "read at once ({} steps): the host enqueues a step in {e:.2} ms, then waits {d:.2} ms \
         for the device ({pace})",
        split.steps.len().saturating_sub(split.warmup)
    ))
}

fn main() -> ExitCode {
    let args = Args::parse();
    match bench(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpt-device-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn bench(args: &Args) -> Result<(), String> {
    let (products, twin) = match args.products.as_str() {
        "bf16" => (Products::Bf16, HostProducts::Bf16Operands),
        "f16" => (Products::F16, HostProducts::F16Operands),
        "f32" => (Products::F32, HostProducts::F32),
        other => return Err(format!("--products {other}: expected bf16, f16 or f32")),
    };
    let bf16 = products == Products::Bf16;
    if products == Products::F16 && args.optimizer {
        return Err("--products f16: AnyPrecisionAdamW keeps bf16 or f32 parameters".into());
    }
    if args.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    // What the engine's run does not do as the device trainer's: refused rather than timed
    // as something else.
    if args.engine {
        if args.optimizer {
            return Err(
                "--engine: --optimizer (AnyPrecisionAdamW) is not supported: the \
                        engine's run trains f32 AdamW, as fsdp train --engine"
                    .into(),
            );
        }
        if products == Products::F16 {
            return Err(
                "--engine: --products f16 is not supported: the engine's run has no \
                        grad scaler"
                    .into(),
            );
        }
        if args.wait_each_step {
            return Err(
                "--engine: --wait-each-step is not supported: the engine's run reads \
                        each step's outcome one step late"
                    .into(),
            );
        }
    }
    let cuda_ordinal = match args.device.as_str() {
        "host-twin" => None,
        "cuda" => Some(0),
        d => Some(
            d.strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| format!("--device {d}: expected cuda, cuda:N or host-twin"))?,
        ),
    };
    let mut gemm = None;
    let mut peak = args.peak_tflops;
    for name in &args.model {
        let cfg = model(name)?;
        let config = DeviceTrainConfig {
            cfg,
            adamw: AdamWConfig::default(),
            schedule: LrSchedule::Constant,
            decay_2d_only: true,
            grad_clip: Some(1.0),
            batch_size: args.batch,
            grad_accum: 1,
            offload: args.cpu_offload,
            activation_checkpointing: args.activation_checkpointing,
            attention: args.attention,
            logits: args.logits,
            reduce_dtype: args.reduce_dtype,
            any_precision: args.optimizer.then_some(AnyPrecision {
                param: if bf16 {
                    fsdp_device::DType::BF16
                } else {
                    fsdp_device::DType::F32
                },
                state: fsdp_device::DType::BF16,
                kahan: true,
            }),
            // f16 products train with the grad scaler (torch.amp's recipe), at its defaults.
            grad_scaler: (products == Products::F16).then(GradScalerConfig::default),
            wrap: Default::default(),
        };
        config.validate().map_err(|e| e.to_string())?;
        let plan = plan_memory(&config, products).map_err(|e| e.to_string())?;
        let (outcome, gpu) = match cuda_ordinal {
            Some(n) => {
                let stream = fsdp_device::Stream::cuda(n, "gpt-device-bench")
                    .map_err(|e| format!("--device {}: {e}", args.device))?;
                let ops = CudaOps::new(stream)
                    .map_err(|e| e.to_string())?
                    .with_products(products);
                let gpu = ops
                    .stream()
                    .cuda_stream()
                    .and_then(|s| s.context().name().ok())
                    .unwrap_or_else(|| format!("CUDA device {n}"));
                if gemm.is_none() {
                    gemm = Some(gemm_tflops(&ops, 8192, 20)?);
                }
                peak = peak.or_else(|| {
                    BF16_PEAK_TFLOPS
                        .iter()
                        .find(|(k, _)| gpu.contains(k))
                        .map(|&(_, v)| v)
                });
                let outcome = run(ops, config, args, CudaOps::pool_memory)?;
                // The next model starts from an empty cache: its allocator's figures are its
                // own, as the plan's are.
                if let CudaMemory::Caching(a) =
                    CudaMemory::from_env(n).map_err(|e| e.to_string())?
                {
                    a.empty_cache().map_err(|e| e.to_string())?;
                }
                (outcome, gpu)
            }
            None => {
                let outcome = run(HostOps::with_products(twin), config, args, |_| None)?;
                (outcome, "host twin".to_string())
            }
        };
        let t = &outcome.times;
        let achieved = t.tflops(&cfg);
        println!(
            "gpt-device-bench {name} ({} parameters, {:.3e} model FLOPs/token) on {gpu}, \
             batch {}×{}, products {}{}{}, attention {}, logits {}: median step {:.2} ms over {} \
             steps after {} warm-up, {:.0} tokens/s, {achieved:.1} TFLOP/s; loss {:.4} -> {:.4}",
            cfg.num_params(),
            model_flops_per_token(&cfg),
            args.batch,
            cfg.block_size,
            args.products,
            if args.cpu_offload {
                ", CPU offload"
            } else {
                ""
            },
            if args.activation_checkpointing {
                ", activation checkpointing"
            } else {
                ""
            },
            args.attention,
            args.logits,
            t.median().as_secs_f64() * 1e3,
            t.steps.len().saturating_sub(t.warmup),
            t.warmup.min(t.steps.len()),
            t.tokens_per_s(),
            t.losses.first().copied().unwrap_or(f32::NAN),
            t.losses.last().copied().unwrap_or(f32::NAN),
        );
        if let Some(line) = outcome.split.as_ref().and_then(split_line) {
            println!("  {line}");
            println!("RESULT gpt-device-bench {name} pace world 1: {line}");
        }
        println!(
            "  peak memory: {} counted, {} planned{}",
            human_bytes(outcome.counted.peak),
            human_bytes(plan.peak),
            outcome
                .pool
                .map(|p| format!(", {} the allocator's peak", human_bytes(p.peak)))
                .unwrap_or_default()
        );
        if let Some((source, report)) = &outcome.memory {
            // What `fsdp plan --device cuda` predicts of the caching allocator.
            let predicted = match AllocatorConfig::from_env_with_backend() {
                Ok((c, AllocatorBackend::Native)) => {
                    let p = plan_allocator(&config, products, c).map_err(|e| e.to_string())?;
                    format!(
                        " (predicted: peak allocated {} bytes, peak reserved {} bytes)",
                        p.peak_allocated, p.peak_reserved
                    )
                }
                _ => String::new(),
            };
            println!("  memory: {source}; {report}{predicted}");
        }
        if let Some(g) = gemm {
            let vs_peak = peak
                .map(|p| {
                    format!(
                        "{:.1}% of the dense bf16 peak ({p} TFLOP/s)",
                        achieved / p * 100.0
                    )
                })
                .unwrap_or_else(|| "no dense bf16 peak known for this GPU (--peak-tflops)".into());
            println!(
                "  MFU: {vs_peak}, {:.1}% of an 8192³ bf16 GEMM measured now ({g:.0} TFLOP/s)",
                achieved / g * 100.0
            );
        }
        let optim = if args.optimizer {
            " anyprecision-adamw"
        } else {
            ""
        };
        println!(
            "RESULT gpt-device-bench {name} {} attention {} logits {}{optim}: median step \
             {:.2} ms, {:.0} tokens/s",
            args.products,
            args.attention,
            args.logits,
            t.median().as_secs_f64() * 1e3,
            t.tokens_per_s()
        );
        if args.engine {
            let e = run_engine(cuda_ordinal, (products, twin), &config, args)?;
            let ratio = e.median().as_secs_f64() / t.median().as_secs_f64();
            println!(
                "  through the fsdp engine (EngineGpt, FULL_SHARD at world 1, buffers on the \
                 device{}): median step {:.2} ms, {:.0} tokens/s; loss {:.4} -> {:.4}",
                if args.cpu_offload {
                    ", shards offloaded"
                } else {
                    ""
                },
                e.median().as_secs_f64() * 1e3,
                e.tokens_per_s(),
                e.losses.first().copied().unwrap_or(f32::NAN),
                e.losses.last().copied().unwrap_or(f32::NAN),
            );
            println!(
                "RESULT gpt-device-bench {name} {} engine: median step {:.2} ms, {ratio:.3}× \
                 the device trainer's step",
                args.products,
                e.median().as_secs_f64() * 1e3,
            );
        }
        if args.ranks > 1 {
            let world = args.ranks;
            let (times, split, volume, memory) = match cuda_ordinal {
                Some(n) => run_sharded(
                    |r| {
                        let stream = fsdp_device::Stream::cuda(n, format!("rank {r}"))
                            .map_err(|e| format!("rank {r}: {e}"))?;
                        Ok(CudaOps::new(stream)
                            .map_err(|e| format!("rank {r}: {e}"))?
                            .with_products(products))
                    },
                    config,
                    args,
                    world,
                )?,
                None => run_sharded(|_| Ok(HostOps::with_products(twin)), config, args, world)?,
            };
            let ratio = times.median().as_secs_f64() / t.median().as_secs_f64();
            let peaks: Vec<String> = memory.iter().map(|m| human_bytes(m.peak)).collect();
            println!(
                "  {world} ranks as threads on {gpu} ({}): median step {:.2} ms per global \
                 batch of {}×{} (rank 0), {:.0} tokens/s; peak memory per rank {}; loss {:.4} \
                 -> {:.4}",
                args.strategy,
                times.median().as_secs_f64() * 1e3,
                args.batch,
                cfg.block_size,
                times.tokens_per_s(),
                peaks.join(", "),
                times.losses.first().copied().unwrap_or(f32::NAN),
                times.losses.last().copied().unwrap_or(f32::NAN),
            );
            if let Some(line) = split.as_ref().and_then(split_line) {
                println!("  rank 0, {line}");
                println!("RESULT gpt-device-bench {name} pace world {world} rank 0: {line}");
            }
            println!(
                "  rank 0's collectives a step: all-gathered {}, reduce-scattered {}, \
                 all-reduced {}",
                human_bytes(volume.all_gathered),
                human_bytes(volume.reduce_scattered),
                human_bytes(volume.all_reduced)
            );
            let reduced = match args.reduce_dtype {
                fsdp_device::DType::BF16 => " reduce bf16",
                fsdp_device::DType::F16 => " reduce f16",
                _ => "",
            };
            println!(
                "RESULT gpt-device-bench {name} {} world {world} {}{reduced}{optim}: median step \
                 {:.2} ms, {ratio:.3}× the world-1 step (aim: at most 1.1)",
                args.products,
                args.strategy,
                times.median().as_secs_f64() * 1e3,
            );
        }
    }
    Ok(())
}
