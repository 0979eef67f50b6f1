//! The reference GPT trained by the engine on a device (`Fsdp::new_on`, the host twin of a
//! device with a millisecond of latency per operation; the GPT computing on host copies of the
//! device's buffers through `HostCompute`, which `FsdpGpt` uses when its engine has a device),
//! its shards and AdamW state on the device or offloaded to host memory: every loss and every
//! parameter bit for bit the host engine's — FULL_SHARD at worlds 1–3, SHARD_GRAD_OP,
//! NO_SHARD, HYBRID_SHARD over 2×2 (also offloaded), bf16 parameters, activation
//! checkpointing, forward prefetch, FULL_SHARD at world 4 offloaded. On a GPU, the same over
//! the CUDA ring with `ComputeDevice::cuda` (bitwise too: the CUDA ring and the cast kernels
//! are bitwise the host's); without one that test prints why it skipped.

mod common;

use fsdp::engine::{ComputeDevice, Fsdp, MixedPrecisionPolicy, ParamInit};
use fsdp::optim::AdamWConfig;
use fsdp_collectives::Communicator;
use fsdp_device::DType;
use fsdp_gpt::data::get_batch;
use fsdp_gpt::runtime::{FsdpConfig, FsdpGpt, ShardingStrategy};
use fsdp_gpt::tree::gpt_block_plan;

use common::training::{rank0_on, Place, Setup};

const STEPS: u64 = 4;
const BATCH: usize = 12;
const SEQ: usize = 16;

/// A run's losses and parameters, as bits.
type Bits = (Vec<u32>, Vec<(String, Vec<u32>)>);

/// Rank 0's run on the host engine, the host twin or GPU 0.
fn run(s: &Setup<AdamWConfig>, world: usize, config: FsdpConfig, place: Place) -> Bits {
    rank0_on(place, world, |comm, dev| train(s, comm, dev, world, config))
}

/// One rank's run of `STEPS` steps.
fn train(
    s: &Setup<AdamWConfig>,
    comm: Box<dyn Communicator>,
    dev: Option<ComputeDevice>,
    world: usize,
    config: FsdpConfig,
) -> Bits {
    let plan = gpt_block_plan(&s.cfg);
    let rank = comm.rank();
    let init = ParamInit::Full(&s.init);
    let fsdp = match dev {
        Some(dev) => Fsdp::new_on(comm, dev, &plan, init, config, s.opt).unwrap(),
        None => Fsdp::new(comm, &plan, init, config, s.opt).unwrap(),
    };
    let mut gpt = FsdpGpt::from_engine(fsdp, s.cfg).unwrap();
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
    // The rest keep the shards on the device; these two offload them to host memory.
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::HybridShard] {
        let mut offloaded = FsdpConfig::new(strategy);
        offloaded.offload_params = true;
        offloaded.ranks_per_node = Some(2);
        configs.push((4, offloaded));
    }
    for (world, config) in configs {
        let what = format!("world {world}, {config:?}");
        let host = run(&s, world, config, Place::Host);
        let dev = run(&s, world, config, Place::HostTwin);
        assert_eq!(dev.0, host.0, "{what}: losses");
        assert_eq!(dev.1, host.1, "{what}: parameters");
        let loss = |b: u32| f32::from_bits(b);
        assert!(loss(host.0[STEPS as usize - 1]) < loss(host.0[0]), "{what}");
    }
}

#[test]
fn the_gpt_on_cuda_trains_the_host_engines_bits() {
    let skip = match fsdp_device::cuda::device_count() {
        Err(e) => Some(e.to_string()),
        Ok(0) => Some("no CUDA device".into()),
        Ok(_) => ComputeDevice::cuda(0, Default::default())
            .err()
            .map(|e| e.to_string()),
    };
    if let Some(why) = skip {
        println!("the_gpt_on_cuda_trains_the_host_engines_bits: skipped: no GPU ({why})");
        return;
    }
    let s = Setup::new(2, 7, 42, common::adamw());
    for (param, world, strategy) in [
        (DType::F32, 1, ShardingStrategy::FullShard),
        (DType::F32, 2, ShardingStrategy::FullShard),
        (DType::F32, 2, ShardingStrategy::NoShard),
        (DType::BF16, 2, ShardingStrategy::FullShard),
        (DType::F32, 4, ShardingStrategy::ShardGradOp),
    ] {
        let mut config = FsdpConfig::new(strategy);
        config.mixed_precision = MixedPrecisionPolicy::new(param, None);
        let host = run(&s, world, config, Place::Host);
        for offload_params in [false, true] {
            config.offload_params = offload_params;
            let what = format!("world {world}, {strategy:?}, {param}, offload {offload_params}");
            let gpu = run(&s, world, config, Place::Gpu);
            assert_eq!(gpu.0, host.0, "{what}: losses");
            assert_eq!(gpu.1, host.1, "{what}: parameters");
        }
    }
}
