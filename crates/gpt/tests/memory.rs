//! Per-rank peak allocated bytes (the caching allocator's statistics, which hold the shards,
//! gradient shards and every unsharded parameter and gradient buffer; the AdamW state and the
//! activations are plain vectors and not counted) order FULL_SHARD < SHARD_GRAD_OP < NO_SHARD
//! on an 8-block model at world 4, and FULL_SHARD's peak stays within the seeds' bound.

mod common;

use std::time::Duration;

use fsdp::units::UnitSpec;
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::{get_batch, synthetic_corpus};
use fsdp_gpt::model::{init_params, named_params, GptConfig};
use fsdp_gpt::runtime::{FsdpConfig, FsdpGpt, ShardingStrategy};
use fsdp_gpt::tree::gpt_block_plan;

const WORLD: usize = 4;

/// The largest per-rank peak of allocated bytes over two steps.
fn peak(cfg: GptConfig, strategy: ShardingStrategy) -> u64 {
    let init = named_params(&cfg, init_params(&cfg, 5)).unwrap();
    let tokens = synthetic_corpus(4_000, 96, 3);
    let opt = common::adamw();
    let plan = gpt_block_plan(&cfg);
    let opts = ring::RingOptions::default().with_timeout(Duration::from_secs(60));
    ring::run_ranks(WORLD, opts, |comm| {
        let rank = comm.rank();
        let config = FsdpConfig::new(strategy);
        let mut fsdp = FsdpGpt::new(Box::new(comm), cfg, &plan, &init, config, opt).unwrap();
        for k in 0..2 {
            let batch = get_batch(&tokens, k, 4, 8, rank, WORLD).unwrap();
            fsdp.step(&batch, 4 * 8).unwrap();
        }
        fsdp.memory_stats().allocated_bytes.all.peak
    })
    .unwrap()
    .into_iter()
    .max()
    .unwrap()
}

#[test]
fn full_shard_uses_less_than_shard_grad_op_less_than_no_shard() {
    let cfg = GptConfig::new(8, 2, 32, 16, 96).unwrap();
    let full = peak(cfg, ShardingStrategy::FullShard);
    let grad_op = peak(cfg, ShardingStrategy::ShardGradOp);
    let no_shard = peak(cfg, ShardingStrategy::NoShard);
    println!("peak allocated bytes per rank: FULL_SHARD {full}, SHARD_GRAD_OP {grad_op}, NO_SHARD {no_shard}");
    assert!(full < grad_op && grad_op < no_shard);

    // The seeds' bound: sharded parameters and gradients (the optimizer state is not in the
    // allocator) + two unsharded units' parameters and gradients: here the root unit (kept
    // unsharded from forward to the end of backward, its gradient alive from the head to the
    // embedding) plus two blocks' parameters (current and prefetched under BACKWARD_PRE) and
    // two blocks' gradients (the current one and the previous one, whose reduce-scatter may
    // still be in flight). The runtime allocates a block's gradient only after waiting for the
    // block's all-gather; the communication stream runs AG(i-1), RS(i), AG(i-2), RS(i-1), ...
    // in issue order, so by then every older reduce-scatter has released its gradient. Each
    // buffer rounds up to 512 bytes.
    let plan = gpt_block_plan(&cfg);
    let bytes = |n: usize| (4 * n).next_multiple_of(512) as u64;
    let padded = |u: &UnitSpec| u.numel().next_multiple_of(WORLD);
    let sharded: u64 = plan
        .units
        .iter()
        .map(|u| 2 * bytes(padded(u) / WORLD))
        .sum();
    let root = 2 * bytes(padded(&plan.units[0]));
    let block = bytes(padded(&plan.units[1]));
    let bound = sharded + root + 2 * block + 2 * block;
    println!("FULL_SHARD bound {bound}");
    assert!(full <= bound, "FULL_SHARD peak {full} > bound {bound}");
}
