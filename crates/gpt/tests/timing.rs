//! Step times and peak memory of the runtime's configurations (not a pass/fail test: run with
//! `cargo test -p fsdp --test timing -- --ignored --nocapture`). Ranks are threads and the
//! communication streams are worker threads, so the figures depend on the cores available.

mod common;

use std::time::{Duration, Instant};

use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::{get_batch, synthetic_corpus};
use fsdp_gpt::model::{init_params, named_params, GptConfig};
use fsdp_gpt::runtime::{
    BackwardPrefetch, CrossStreamSafety, FsdpConfig, FsdpGpt, ShardingStrategy,
};
use fsdp_gpt::tree::gpt_block_plan;

#[test]
#[ignore = "timing report, run explicitly"]
fn step_times() {
    let cfg = GptConfig::new(4, 4, 128, 64, 512).unwrap();
    let init = named_params(&cfg, init_params(&cfg, 0)).unwrap();
    let tokens = synthetic_corpus(50_000, 512, 1);
    let opt = common::adamw();
    let plan = gpt_block_plan(&cfg);
    let (rows, seq, steps) = (8, 64, 6);
    let world = 2;
    println!(
        "model: {} parameters, {} units; world {world}, batch {rows}x{seq}",
        cfg.num_params(),
        plan.units.len()
    );
    let mut configs = Vec::new();
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
    ] {
        configs.push(FsdpConfig::new(strategy));
    }
    for prefetch in [BackwardPrefetch::Post, BackwardPrefetch::None] {
        configs.push(FsdpConfig {
            backward_prefetch: prefetch,
            ..FsdpConfig::new(ShardingStrategy::FullShard)
        });
    }
    configs.push(FsdpConfig {
        forward_prefetch: true,
        ..FsdpConfig::new(ShardingStrategy::FullShard)
    });
    configs.push(FsdpConfig {
        limit_all_gathers: None,
        forward_prefetch: true,
        ..FsdpConfig::new(ShardingStrategy::FullShard)
    });
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::NoShard] {
        configs.push(FsdpConfig {
            cross_stream: CrossStreamSafety::RecordStream,
            ..FsdpConfig::new(strategy)
        });
    }
    for config in configs {
        let out = ring::run_ranks(world, ring::RingOptions::default(), |comm| {
            let rank = comm.rank();
            let mut fsdp = FsdpGpt::new(Box::new(comm), cfg, &plan, &init, config, opt).unwrap();
            let mut times = Vec::new();
            for k in 0..steps {
                let batch = get_batch(&tokens, k, rows, seq, rank, world).unwrap();
                let t = Instant::now();
                fsdp.step(&batch, rows * seq).unwrap();
                times.push(t.elapsed());
            }
            let stats = fsdp.memory_stats();
            // The first step records the order and warms the allocator: leave it out.
            let mean = times[1..].iter().sum::<Duration>() / (steps as u32 - 1);
            (
                mean,
                stats.allocated_bytes.all.peak,
                stats.reserved_bytes.all.peak,
                stats.active_bytes.all.peak,
                stats.num_alloc_retries,
            )
        })
        .unwrap();
        let (mean, peak, reserved, active, retries) = out[0];
        println!(
            "{:?} bwd {:?} fwd_prefetch {} limit {:?} {:?}: {:.1} ms/step, peak allocated {} \
             KiB, active {} KiB, reserved {} KiB, retries {}",
            config.strategy,
            config.backward_prefetch,
            config.forward_prefetch,
            config.limit_all_gathers,
            config.cross_stream,
            mean.as_secs_f64() * 1e3,
            peak >> 10,
            active >> 10,
            reserved >> 10,
            retries
        );
    }
}
