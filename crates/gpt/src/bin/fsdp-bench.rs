//! `fsdp-bench`: trains the same GPT for a few steps single-process (whole tensors, no
//! sharding) and with every sharding strategy at world 1, 2 and 4 (ranks are threads on the
//! ring backend), and prints the median step time, tokens/s and peak allocated bytes per rank,
//! each with its ratio to the single-process run.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use fsdp::engine::{MixedPrecisionPolicy, ScheduleKind};
use fsdp::optim::{AdamWConfig, AdamWState};
use fsdp::{human_bytes, FsdpError};
use fsdp_collectives::{ring, Communicator};
use fsdp_device::DType;
use fsdp_gpt::data::{get_batch, synthetic_corpus};
use fsdp_gpt::model::{forward_backward, init_params, named_params, zeros_like_params, GptConfig};
use fsdp_gpt::runtime::{FsdpConfig, FsdpGpt, ShardingStrategy};
use fsdp_gpt::tree::gpt_block_plan;

#[derive(Parser, Debug)]
#[command(
    name = "fsdp-bench",
    about = "Step time of FSDP strategies against single-process training"
)]
struct Args {
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    n_layer: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    n_head: usize,
    /// Embedding width.
    #[arg(long, default_value_t = 128)]
    n_embd: usize,
    /// Context (and sequence) length.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 256)]
    vocab_size: usize,
    /// Global batch size (divisible by 4).
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Timed steps per configuration (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Instead of the strategies: FULL_SHARD at world 4 with f32 parameters against the
    /// mixed-precision policies (bf16 and f16 parameters, reduced in f32 or their own dtype):
    /// median step time and the bytes all-gathered and reduce-scattered per step and rank.
    #[arg(long)]
    mixed_precision: bool,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

const OPT: AdamWConfig = AdamWConfig {
    lr: 1e-3,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    weight_decay: 0.1,
};

/// Median step seconds and the bytes of parameters + gradients (the whole tensors).
fn single_process(
    cfg: &GptConfig,
    params: &HashMap<String, Vec<f32>>,
    tokens: &[u16],
    b: usize,
    steps: usize,
) -> Result<(f64, u64), FsdpError> {
    let mut params = params.clone();
    let mut grads = zeros_like_params(cfg);
    let mut states: HashMap<String, AdamWState> = params
        .iter()
        .map(|(k, v)| (k.clone(), AdamWState::new(v.len())))
        .collect();
    let mut times = Vec::new();
    for k in 0..=steps {
        let t0 = Instant::now();
        for g in grads.values_mut() {
            g.fill(0.0);
        }
        let batch = get_batch(tokens, k as u64, b, cfg.block_size, 0, 1)?;
        forward_backward(cfg, &params, &mut grads, &batch, b * cfg.block_size)?;
        for (name, p) in params.iter_mut() {
            if let (Some(s), Some(g)) = (states.get_mut(name), grads.get(name)) {
                s.step(&OPT, p, g)?;
            }
        }
        if k > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let bytes = 2 * cfg.num_params() as u64 * 4;
    Ok((median(&mut times), bytes))
}

/// Rank 0's per-step bytes all-gathered and reduce-scattered (the last step's schedule).
fn step_bytes(m: &FsdpGpt) -> (u64, u64) {
    let (mut ag, mut rs) = (0u64, 0u64);
    for e in m.schedule() {
        let Some(g) = m.param_groups().get(e.unit) else {
            continue;
        };
        let n = g.layout().padded_numel() as u64;
        match e.kind {
            ScheduleKind::AllGather => ag += n * g.dtypes().param.size_in_bytes() as u64,
            ScheduleKind::ReduceScatter => rs += n * g.dtypes().reduce.size_in_bytes() as u64,
            _ => {}
        }
    }
    (ag, rs)
}

/// Median step seconds (rank 0), the largest per-rank peak allocated bytes, and rank 0's
/// bytes all-gathered and reduce-scattered in one step.
fn fsdp_run(
    cfg: &GptConfig,
    params: &HashMap<String, Vec<f32>>,
    tokens: &[u16],
    b: usize,
    steps: usize,
    world: usize,
    config: FsdpConfig,
) -> Result<(f64, u64, (u64, u64)), FsdpError> {
    let plan = gpt_block_plan(cfg);
    let per_rank = ring::run_ranks(world, ring::RingOptions::default(), |comm| {
        let rank = comm.rank();
        let mut m = FsdpGpt::new(Box::new(comm), *cfg, &plan, params, config, OPT)?;
        let mut times = Vec::new();
        let mut bytes = (0, 0);
        for k in 0..=steps {
            let t0 = Instant::now();
            let batch = get_batch(tokens, k as u64, b, cfg.block_size, rank, world)?;
            m.step(&batch, b * cfg.block_size)?;
            bytes = step_bytes(&m);
            m.clear_schedule();
            if k > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        Ok::<_, FsdpError>((
            median(&mut times),
            m.memory_stats().allocated_bytes.all.peak,
            bytes,
        ))
    })?;
    let mut out = Vec::with_capacity(world);
    for r in per_rank {
        out.push(r?);
    }
    let peak = out.iter().map(|r| r.1).max().unwrap_or(0);
    Ok((out[0].0, peak, out[0].2))
}

/// FULL_SHARD at world 4: f32 against the mixed-precision policies.
fn precision_table(
    cfg: &GptConfig,
    params: &HashMap<String, Vec<f32>>,
    tokens: &[u16],
    a: &Args,
) -> Result<(), FsdpError> {
    println!(
        "| param dtype | reduce dtype | step (ms) | step ratio | all-gathered / step | \
         reduce-scattered / step | all-gather ratio | peak allocated / rank |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let policies = [
        (DType::F32, DType::F32),
        (DType::BF16, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F32),
        (DType::F16, DType::F16),
    ];
    let mut base = None;
    for (p, r) in policies {
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = MixedPrecisionPolicy::new(p, Some(r));
        let (t, mem, (ag, rs)) = fsdp_run(cfg, params, tokens, a.batch_size, a.steps, 4, config)?;
        let (t0, ag0) = *base.get_or_insert((t, ag));
        println!(
            "| {p} | {r} | {:.1} | {:.2} | {} | {} | {:.2} | {} |",
            t * 1e3,
            t / t0,
            human_bytes(ag),
            human_bytes(rs),
            ag as f64 / ag0 as f64,
            human_bytes(mem)
        );
    }
    Ok(())
}

fn name(s: ShardingStrategy) -> &'static str {
    match s {
        ShardingStrategy::FullShard => "FULL_SHARD",
        ShardingStrategy::ShardGradOp => "SHARD_GRAD_OP",
        ShardingStrategy::NoShard => "NO_SHARD",
        ShardingStrategy::HybridShard => "HYBRID_SHARD",
        ShardingStrategy::HybridShardZero2 => "HYBRID_SHARD_ZERO2",
    }
}

fn run(a: &Args) -> Result<(), FsdpError> {
    let cfg = GptConfig::new(a.n_layer, a.n_head, a.n_embd, a.block_size, a.vocab_size)?;
    if a.batch_size % 4 != 0 || a.batch_size == 0 || a.steps == 0 || a.vocab_size > 65536 {
        return Err(FsdpError::InvalidShape {
            reason: "--batch-size must be a positive multiple of 4, --steps at least 1 and \
                     --vocab-size at most 65536"
                .into(),
        });
    }
    let params = named_params(&cfg, init_params(&cfg, 0))?;
    let tokens = synthetic_corpus(200_000, a.vocab_size as u16, 0);
    let b = a.batch_size;
    let step_tokens = (b * cfg.block_size) as f64;
    println!(
        "GPT {} layers, {} heads, width {}, T {}, vocab {} ({} parameters); global batch {} × {}; \
         median of {} steps after 1 warm-up; {} CPU threads available",
        a.n_layer,
        a.n_head,
        a.n_embd,
        a.block_size,
        a.vocab_size,
        cfg.num_params(),
        b,
        cfg.block_size,
        a.steps,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    if a.mixed_precision {
        return precision_table(&cfg, &params, &tokens, a);
    }
    let (t_ref, mem_ref) = single_process(&cfg, &params, &tokens, b, a.steps)?;
    println!(
        "| configuration | world | step (ms) | tokens/s | peak allocated / rank | step ratio | tokens/s ratio | memory ratio |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| single process (whole tensors) | 1 | {:.1} | {:.0} | {} KiB* | 1.00 | 1.00 | 1.00 |",
        t_ref * 1e3,
        step_tokens / t_ref,
        mem_ref / 1024
    );
    for s in ShardingStrategy::ALL {
        for world in [1usize, 2, 4] {
            let mut config = FsdpConfig::new(s);
            let label = if s.is_hybrid() && world > 1 {
                config.ranks_per_node = Some(world / 2);
                format!("{} ({} nodes × {})", name(s), 2, world / 2)
            } else {
                name(s).to_string()
            };
            let (t, mem, _) = fsdp_run(&cfg, &params, &tokens, b, a.steps, world, config)?;
            println!(
                "| {label} | {world} | {:.1} | {:.0} | {} KiB | {:.2} | {:.2} | {:.2} |",
                t * 1e3,
                step_tokens / t,
                mem / 1024,
                t / t_ref,
                t_ref / t,
                mem as f64 / mem_ref as f64
            );
        }
    }
    println!(
        "* single process: parameters + gradients as whole f32 tensors (what the FSDP ranks' \
         allocators hold in sharded/unsharded form); AdamW state and activations are outside \
         the allocator in both."
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
