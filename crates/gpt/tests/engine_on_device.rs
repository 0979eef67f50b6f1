//! The reference GPT trained by the engine with its unsharded parameters and gradients on a
//! device (`Fsdp::new_on`, the host twin of a device with a millisecond of latency per
//! operation; the GPT computing on host copies of the device's buffers through `HostCompute`,
//! which `FsdpGpt` uses when its engine has a device): every loss and every parameter bit for
//! bit the host engine's — FULL_SHARD at worlds 1–3, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD over
//! 2×2, bf16 parameters, activation checkpointing, forward prefetch.

mod common;

use std::time::Duration;

use fsdp::engine::{ComputeDevice, Fsdp, MixedPrecisionPolicy, ParamInit};
use fsdp_collectives::{ring, Communicator};
use fsdp_device::DType;
use fsdp_gpt::data::get_batch;
use fsdp_gpt::runtime::{FsdpConfig, FsdpGpt, ShardingStrategy};
use fsdp_gpt::tree::gpt_block_plan;

use common::training::{ring_options, Setup};

const STEPS: u64 = 4;
const BATCH: usize = 12;
const SEQ: usize = 16;

/// Rank 0's losses and parameters, as bits, on the host engine or on the host twin.
fn run(
    s: &Setup<fsdp::optim::AdamWConfig>,
    world: usize,
    config: FsdpConfig,
    on_device: bool,
) -> (Vec<u32>, Vec<(String, Vec<u32>)>) {
    let plan = gpt_block_plan(&s.cfg);
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let mut gpt = if on_device {
            let latency = Duration::from_millis(1);
            let dev = ComputeDevice::host_twin_with_latency(1 << 28, Default::default(), latency)
                .unwrap();
            let init = ParamInit::Full(&s.init);
            let fsdp = Fsdp::new_on(Box::new(comm), dev, &plan, init, config, s.opt).unwrap();
            FsdpGpt::from_engine(fsdp, s.cfg).unwrap()
        } else {
            s.engine(comm, &plan, config)
        };
        let mut losses = Vec::new();
        for k in 0..STEPS {
            let batch = get_batch(&s.tokens, k, BATCH, SEQ, rank, world).unwrap();
            losses.push(gpt.step(&batch, BATCH * SEQ).unwrap().to_bits());
        }
        let mut params: Vec<(String, Vec<u32>)> = gpt
            .full_params()
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
            .collect();
        params.sort();
        (losses, params)
    })
    .unwrap();
    out.swap_remove(0)
}

#[test]
fn the_gpt_on_a_device_trains_the_host_engines_bits() {
    let s = Setup::new(2, 7, 42, common::adamw());
    let mut configs = vec![
        (1, FsdpConfig::new(ShardingStrategy::FullShard)),
        (2, FsdpConfig::new(ShardingStrategy::FullShard)),
        (3, FsdpConfig::new(ShardingStrategy::FullShard)),
        (2, FsdpConfig::new(ShardingStrategy::ShardGradOp)),
        (2, FsdpConfig::new(ShardingStrategy::NoShard)),
        (
            4,
            FsdpConfig {
                ranks_per_node: Some(2),
                ..FsdpConfig::new(ShardingStrategy::HybridShard)
            },
        ),
    ];
    let mut bf16 = FsdpConfig::new(ShardingStrategy::FullShard);
    bf16.mixed_precision = MixedPrecisionPolicy::new(DType::BF16, None);
    bf16.forward_prefetch = true;
    configs.push((2, bf16));
    let mut checkpointed = FsdpConfig::new(ShardingStrategy::FullShard);
    checkpointed.activation_checkpointing = true;
    configs.push((2, checkpointed));
    for (world, config) in configs {
        let what = format!("world {world}, {config:?}");
        let (host, dev) = (run(&s, world, config, false), run(&s, world, config, true));
        assert_eq!(dev.0, host.0, "{what}: losses");
        assert_eq!(dev.1, host.1, "{what}: parameters");
        let loss = |b: u32| f32::from_bits(b);
        assert!(loss(host.0[STEPS as usize - 1]) < loss(host.0[0]), "{what}");
    }
}
