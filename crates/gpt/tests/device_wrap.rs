//! Size-based wrap policies on the device (`DeviceTrainConfig::wrap`, `fsdp train --device …
//! --wrap size:N`) on the host twins: the units change when tensors are gathered and freed
//! and how the collectives group them, never a bit of the training.
//!
//! The test model (2 layers, 32 wide, 16 tokens, a vocabulary of 64) has 28,032 elements: a
//! block 12,704 (`attn` 4,224 of which `c_attn` 3,168; `mlp` 8,352 of which `c_fc` 4,224 and
//! `c_proj` 4,128), `wte` 2,048, `wpe` 512, `ln_f` 64. So `size:12704` is the block plan,
//! `size:5000` wraps each block's `mlp` and leaves the rest of the blocks to the root,
//! `size:3000` wraps each block's three large linear layers (three units a block), and
//! `size:30000` wraps nothing but the root.

use fsdp::optim::LrSchedule;
use fsdp_collectives::ring;
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_comm::{CommVolume, DeviceComm};
use fsdp_gpt::device_plan_sharded::plan_sharded_memory;
use fsdp_gpt::device_sharded::{Prefetch, ShardedDeviceTrainer};
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig};
use fsdp_gpt::device_units::DeviceWrap;
use fsdp_gpt::runtime::ShardingStrategy;
use fsdp_kernels::gpt::{param_shapes, GptOps, HostOps, Products};

mod common;
use common::device::{device_config, on_peer_trainers, param_bits, staged_trainer};

const STEPS: usize = 4;

fn size(n: usize) -> DeviceWrap {
    DeviceWrap::Size { min_num_params: n }
}

fn config(wrap: DeviceWrap, accum: usize) -> DeviceTrainConfig {
    DeviceTrainConfig {
        wrap,
        ..device_config(LrSchedule::Constant, true, Some(0.5), accum)
    }
}

/// One rank's outcomes (loss and norm bits, applied), final parameters' bits, peak and the
/// bytes its collectives moved.
type Run = (
    Vec<(u32, u64, bool)>,
    Vec<(String, Vec<u32>)>,
    u64,
    CommVolume,
);

/// `c` on `world` ranks of `PeerComm` as threads, what `fsdp train --device … --ranks N`
/// runs (a hybrid strategy in two nodes).
fn run(c: DeviceTrainConfig, world: usize, strategy: ShardingStrategy) -> Vec<Run> {
    let params = seeded_params(&c.cfg, 3).unwrap();
    let tokens = synthetic_corpus(20_000, 64, 3);
    let rpn = strategy.is_hybrid().then_some(world / 2);
    let go = |mut t| outcomes(&mut t, &tokens);
    on_peer_trainers((world, rpn), c, strategy, &params, HostOps::new, go)
}

fn outcomes<C: DeviceComm<HostOps>>(
    t: &mut ShardedDeviceTrainer<HostOps, C>,
    tokens: &[u16],
) -> Run {
    let o = (0..STEPS)
        .map(|s| {
            let o = t.step(tokens, s).unwrap();
            (o.loss.to_bits(), o.grad_norm.to_bits(), o.applied)
        })
        .collect();
    let p = param_bits(t.full_params().unwrap());
    (o, p, t.ops().memory().peak, t.comm_volume())
}

/// Every strategy at 2 ranks (the hybrid one at 4, in two nodes), under each size policy:
/// the block plan's bits, and the plan's memory is the counted peak.
#[test]
fn every_wrap_trains_the_block_plans_bits() {
    let cases = [
        (2, ShardingStrategy::FullShard),
        (2, ShardingStrategy::ShardGradOp),
        (2, ShardingStrategy::NoShard),
        (4, ShardingStrategy::HybridShard),
    ];
    for (world, strategy) in cases {
        let block = run(config(DeviceWrap::Block, 2), world, strategy);
        for wrap in [size(12_704), size(5_000), size(3_000), size(30_000)] {
            let c = config(wrap, 2);
            let runs = run(c, world, strategy);
            for (r, (a, b)) in block.iter().zip(&runs).enumerate() {
                let what = format!("{wrap:?}, {world} ranks, {strategy:?}, rank {r}");
                assert_eq!(a.0, b.0, "{what}: outcomes");
                assert!(a.1 == b.1, "{what}: parameters");
            }
            let rpn = strategy.is_hybrid().then_some(world / 2);
            let plan = plan_sharded_memory(&c, Products::F32, world, strategy, rpn).unwrap();
            assert_eq!(
                plan.peak, runs[0].2,
                "{wrap:?}, {strategy:?}: plan against peak"
            );
            if wrap == size(12_704) {
                assert_eq!(runs[0].2, block[0].2, "{strategy:?}: the block plan's peak");
                assert_eq!(
                    runs[0].3, block[0].3,
                    "{strategy:?}: the block plan's bytes"
                );
            }
        }
    }
}

/// Bytes of the shards over `factor` ranks of the tensors whose names pass `keep`, gathered
/// whole, in f32: `Σ ⌈n / factor⌉ · factor · 4`.
fn padded_bytes(c: &DeviceTrainConfig, factor: usize, keep: impl Fn(&str) -> bool) -> u64 {
    param_shapes(&c.dims())
        .into_iter()
        .filter(|(name, _)| keep(name))
        .map(|(_, shape)| (shape.iter().product::<usize>().div_ceil(factor) * factor * 4) as u64)
        .sum()
}

/// `FULL_SHARD` at 2 ranks moves what its units say, in closed form: the block plan gathers
/// each block twice a micro-batch (forward, and backward after resharding) and the root
/// once; the root alone (`size:30000`) gathers everything once and holds it throughout, so
/// its peak is higher; `size:3000` gathers its layers' units twice and the root, which holds
/// the rest of the blocks, once. Every gradient is reduce-scattered once either way.
#[test]
fn the_units_decide_the_gathers_and_the_peak() {
    let accum = 2u64;
    let c = config(DeviceWrap::Block, accum as usize);
    let all = padded_bytes(&c, 2, |_| true);
    let blocks = padded_bytes(&c, 2, |n| n.starts_with("transformer.h."));
    // What `size:3000` leaves of the blocks to the root: the layer norms and `attn.c_proj`.
    let large = ["attn.c_attn.", "mlp.c_fc.", "mlp.c_proj."];
    let layers = padded_bytes(&c, 2, |n| large.iter().any(|l| n.contains(l)));
    let block = run(c, 2, ShardingStrategy::FullShard).remove(0);
    let root = run(config(size(30_000), 2), 2, ShardingStrategy::FullShard).remove(0);
    let per_step = |v: CommVolume| v.per_step(STEPS as u64);
    assert_eq!(per_step(block.3).all_gathered, accum * (all + blocks));
    assert_eq!(per_step(root.3).all_gathered, accum * all);
    assert_eq!(per_step(block.3).reduce_scattered, accum * all);
    assert_eq!(per_step(root.3).reduce_scattered, accum * all);
    assert!(
        root.2 > block.2,
        "root alone {} vs blocks {}",
        root.2,
        block.2
    );
    // Units of layers are gathered twice; the rest of the blocks, in the root, once.
    let split = run(config(size(3_000), 2), 2, ShardingStrategy::FullShard).remove(0);
    assert_eq!(per_step(split.3).all_gathered, accum * (all + layers));
}

/// Several units a block over `StagedComm` (NCCL's path) with both prefetches and CPU
/// offload, whose prefetched copies in must meet their own all-gathers: the block plan's
/// bits.
#[test]
fn prefetching_units_of_layers_under_offload_changes_no_bit() {
    let params = seeded_params(&config(DeviceWrap::Block, 1).cfg, 3).unwrap();
    let tokens = synthetic_corpus(20_000, 64, 3);
    let both = Prefetch {
        forward: true,
        backward: true,
    };
    let go = |wrap: DeviceWrap, offload: bool| {
        let c = DeviceTrainConfig {
            offload,
            ..config(wrap, 2)
        };
        ring::run_ranks(2, ring::RingOptions::default(), |comm| {
            let s = ShardingStrategy::FullShard;
            let mut t = staged_trainer(HostOps::new(), comm, 2, None, c, s, &params);
            t.set_prefetch(both);
            outcomes(&mut t, &tokens)
        })
        .unwrap()
    };
    let base = go(DeviceWrap::Block, false);
    for wrap in [size(3_000), size(5_000)] {
        for offload in [false, true] {
            for (r, (a, b)) in base.iter().zip(go(wrap, offload)).enumerate() {
                let what = format!("{wrap:?}, offload {offload}, rank {r}");
                assert_eq!(a.0, b.0, "{what}: outcomes");
                assert!(a.1 == b.1, "{what}: parameters");
            }
        }
    }
}

/// A threshold that splits the tied `wte` from `lm_head` is the wrap policy's error, before
/// anything is made.
#[test]
fn a_policy_that_splits_the_tie_is_refused() {
    let e = config(size(2_048), 1).validate().unwrap_err().to_string();
    assert!(
        e.contains("lm_head.weight") && e.contains("transformer.wte"),
        "{e}"
    );
}
