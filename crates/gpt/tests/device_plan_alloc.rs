//! The caching allocator's statistics of a device run, predicted (`plan_allocator`: the
//! trainer over meta operations, every buffer mirrored into an allocator on a meta source)
//! against the same run on the kernels' host twins with its buffers mirrored into an
//! allocator of the same settings: the requests are the run's own, so peak allocated, peak
//! reserved, the segments and the device allocations must be equal — for f32 and bf16
//! products, two micro-batches, activation checkpointing, CPU offload, the materialized
//! attention and whole logits, and on expandable segments. `CudaOps` makes the host twins'
//! requests (one model code; only kernels' scratch goes elsewhere), which
//! `tests/gpu_device_train.rs` checks against the GPU's allocator itself.

mod common;

use common::device::{device_config, peer_comms, staged_trainer};
use fsdp::optim::LrSchedule;
use fsdp_allocator::{AllocatorConfig, MetaAllocator, MetaSource};
use fsdp_collectives::ring;
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_plan::plan_memory;
use fsdp_gpt::device_plan_alloc::{
    plan_allocator, plan_process_allocator, plan_sharded_allocator, AllocatorPlan, PLANNED_STEPS,
};
use fsdp_gpt::device_sharded::{Prefetch, ShardedDeviceTrainer};
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig, DeviceTrainer};
use fsdp_gpt::runtime::ShardingStrategy;
use fsdp_kernels::gpt::{Attention, HostOps, HostProducts, Logits, Products};

/// The shared device run (2 layers, 2 heads, 32 wide, 16 tokens, vocabulary 64), clipped,
/// with a batch of `batch` rows in `accum` micro-batches.
fn config(batch: usize, accum: usize) -> DeviceTrainConfig {
    DeviceTrainConfig {
        batch_size: batch,
        ..device_config(LrSchedule::Constant, false, Some(1.0), accum)
    }
}

/// The host twins' run of `c` for the planned steps, its buffers mirrored into an allocator
/// of `alloc`'s settings: that allocator's statistics, the counted peak, and the most blocks
/// live at once.
fn measure(c: &DeviceTrainConfig, bf16: bool, alloc: AllocatorConfig) -> (AllocatorPlan, u64, u64) {
    let ops = HostOps::with_products(if bf16 {
        HostProducts::Bf16Operands
    } else {
        HostProducts::F32
    });
    let meta = MetaAllocator::new(MetaSource::new(1 << 40), alloc).unwrap();
    assert!(ops.memory_counter().mirror_into(meta.clone()));
    let params = seeded_params(&c.cfg, 5).unwrap();
    let tokens = synthetic_corpus(20_000, c.cfg.vocab_size as u16, 5);
    let mut tr = DeviceTrainer::new(ops, *c, &params).unwrap();
    for step in 0..PLANNED_STEPS {
        tr.enqueue_step(&tokens, step).unwrap();
    }
    tr.flush().unwrap();
    let s = meta.memory_stats();
    let measured = AllocatorPlan::from_stats(&s);
    (measured, tr.peak_bytes(), s.allocation.all.peak)
}

fn check(name: &str, c: &DeviceTrainConfig, bf16: bool, alloc: AllocatorConfig) -> AllocatorPlan {
    let products = if bf16 { Products::Bf16 } else { Products::F32 };
    let planned = plan_allocator(c, products, alloc).unwrap();
    let (measured, counted, blocks) = measure(c, bf16, alloc);
    println!("{name}: {planned} (counted peak {counted})");
    assert_eq!(
        planned, measured,
        "{name}: planned vs the host twins' requests"
    );
    // Every counted buffer is one block, rounded up to 512 bytes: the allocated peak covers
    // the counted one by less than 512 bytes a live block, and the reserved peak covers it.
    assert_eq!(counted, plan_memory(c, products).unwrap().peak, "{name}");
    assert!(planned.peak_allocated >= counted, "{name}: {planned}");
    assert!(
        planned.peak_allocated - counted < 512 * blocks,
        "{name}: more than {blocks} blocks' rounding: {planned} vs {counted}"
    );
    assert!(planned.peak_reserved >= planned.peak_allocated, "{name}");
    assert!(planned.device_allocations > 0, "{name}: {planned}");
    planned
}

#[test]
fn the_allocator_plan_is_the_runs_requests() {
    let d = AllocatorConfig::default();
    check("f32", &config(4, 1), false, d);
    check("bf16, 2 micro-batches", &config(4, 2), true, d);
    let mut c = config(4, 1);
    c.activation_checkpointing = true;
    check("bf16, checkpointing", &c, true, d);
    let mut c = config(4, 2);
    c.offload = true;
    check("bf16, cpu offload", &c, true, d);
    let mut c = config(4, 1);
    c.attention = Attention::Materialized;
    c.logits = Logits::Whole;
    check("bf16, materialized attention, whole logits", &c, true, d);
}

#[test]
fn the_allocator_plan_follows_the_allocators_settings() {
    let c = config(8, 1);
    let default = check("default", &c, true, AllocatorConfig::default());
    let expandable = AllocatorConfig::from_pytorch_conf("expandable_segments:True").unwrap();
    let e = check("expandable segments", &c, true, expandable);
    // The blocks are rounded alike (their sizes do not depend on the segments); the segments
    // are reserved otherwise.
    assert_eq!(e.peak_allocated, default.peak_allocated);
    assert!(default.segments > 0, "{default}");
    // The settings are the run's: a bad one is an error, not a default.
    let mut bad = AllocatorConfig::default();
    bad.garbage_collection_threshold = Some(2.0);
    assert!(plan_allocator(&c, Products::Bf16, bad).is_err());
}

/// Each rank's allocator statistics over the planned steps of `c` on `world` host-twin ranks
/// as threads (a hybrid strategy in nodes of `rpn`), each rank's buffers mirrored into an
/// allocator of its own.
fn measure_sharded(
    c: DeviceTrainConfig,
    world: usize,
    s: ShardingStrategy,
    rpn: Option<usize>,
) -> Vec<AllocatorPlan> {
    let params = seeded_params(&c.cfg, 1).unwrap();
    let tokens = synthetic_corpus(20_000, c.cfg.vocab_size as u16, 1);
    let comms = peer_comms::<HostOps>(world, rpn);
    std::thread::scope(|sc| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|(comm, replicas)| {
                let (params, tokens) = (&params, &tokens);
                sc.spawn(move || {
                    let ops = HostOps::with_products(HostProducts::Bf16Operands);
                    let meta = MetaAllocator::new(MetaSource::new(1 << 40), Default::default());
                    let meta = meta.unwrap();
                    assert!(ops.memory_counter().mirror_into(meta.clone()));
                    let mut t = match replicas {
                        Some(r) => ShardedDeviceTrainer::new_hybrid(ops, comm, r, c, s, params),
                        None => ShardedDeviceTrainer::new(ops, comm, c, s, params),
                    }
                    .unwrap();
                    for step in 0..PLANNED_STEPS {
                        t.enqueue_step(tokens, step).unwrap();
                    }
                    t.flush().unwrap();
                    AllocatorPlan::from_stats(&meta.memory_stats())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn the_sharded_allocator_plan_is_each_ranks_requests() {
    for (world, s, rpn, accum, ckpt) in [
        (2, ShardingStrategy::FullShard, None, 1, false),
        (2, ShardingStrategy::ShardGradOp, None, 2, true),
        (2, ShardingStrategy::NoShard, None, 1, false),
        (4, ShardingStrategy::HybridShard, Some(2), 1, false),
    ] {
        let c = DeviceTrainConfig {
            activation_checkpointing: ckpt,
            ..config(8, accum)
        };
        let planned =
            plan_sharded_allocator(&c, Products::Bf16, world, s, rpn, Default::default()).unwrap();
        let measured = measure_sharded(c, world, s, rpn);
        println!("{world} ranks {s:?}: {planned}");
        assert_eq!(planned.ranks, measured, "{world} ranks {s:?}");
        assert!(planned.peak_reserved() >= planned.peak_allocated_at_most());
    }
}

/// Rank 0's allocator statistics over the planned steps of `c` on `world` host-twin ranks
/// over `StagedComm` on the ring (NCCL's path as processes), its buffers mirrored (not the
/// staging buffers, which are the communicator's).
fn measure_process(
    c: DeviceTrainConfig,
    world: usize,
    s: ShardingStrategy,
    rpn: Option<usize>,
    prefetch: Prefetch,
) -> AllocatorPlan {
    let params = seeded_params(&c.cfg, 1).unwrap();
    let tokens = synthetic_corpus(20_000, c.cfg.vocab_size as u16, 1);
    let out = ring::run_ranks(world, ring::RingOptions::default(), |comm| {
        let ops = HostOps::with_products(HostProducts::Bf16Operands);
        let meta = MetaAllocator::new(MetaSource::new(1 << 40), Default::default()).unwrap();
        assert!(ops.memory_counter().mirror_into(meta.clone()));
        let mut t = staged_trainer(ops, comm, world, rpn, c, s, &params);
        t.set_prefetch(prefetch);
        for step in 0..PLANNED_STEPS {
            t.enqueue_step(&tokens, step).unwrap();
        }
        t.flush().unwrap();
        AllocatorPlan::from_stats(&meta.memory_stats())
    })
    .unwrap();
    out[0]
}

#[test]
fn the_process_allocator_plan_is_rank_zeros_requests() {
    for (world, s, rpn, prefetch) in [
        (2, ShardingStrategy::FullShard, None, Prefetch::default()),
        (2, ShardingStrategy::FullShard, None, Prefetch::NONE),
        (
            4,
            ShardingStrategy::HybridShard,
            Some(2),
            Prefetch::default(),
        ),
    ] {
        let c = config(8, 1);
        let how = (world, s, rpn, prefetch);
        let planned = plan_process_allocator(&c, Products::Bf16, how, Default::default()).unwrap();
        let measured = measure_process(c, world, s, rpn, prefetch);
        println!("{world} processes {s:?} {prefetch:?}: {planned}");
        assert_eq!(planned, measured, "{world} processes {s:?}");
    }
}
