//! `plan_sharded_memory` (one rank's device memory in sharded training, from a run over the
//! counting `MetaOps`) against the peak the host twins count in the same training over
//! `PeerComm` (what `fsdp train --device … --ranks N` runs): equal to the byte, for every
//! strategy (the hybrid ones in two nodes of two), with and without activation checkpointing,
//! with f32 and bf16 products, gradients reduced in f32 and in bf16, at 2 and 4 ranks, with 1
//! and 2 micro-batches. And each strategy's peak where it should be:
//! `FULL_SHARD` below `SHARD_GRAD_OP` below `NO_SHARD`.

use fsdp::optim::LrSchedule;
use fsdp_collectives::ring;
use fsdp_device::DType;
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_plan_sharded::{plan_process_memory, plan_sharded_memory};
use fsdp_gpt::device_sharded::Prefetch;
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig};
use fsdp_gpt::runtime::ShardingStrategy;
use fsdp_kernels::gpt::{GptOps, HostOps, HostProducts, Products};

mod common;
use common::device::{device_config, on_peer_trainers, staged_trainer};

/// Rank 0's counted peak over 3 steps of `c` on `world` host-twin ranks (a hybrid strategy
/// in nodes of `rpn`).
fn measured(
    c: DeviceTrainConfig,
    world: usize,
    s: ShardingStrategy,
    rpn: Option<usize>,
    bf16: bool,
) -> u64 {
    let params = seeded_params(&c.cfg, 1).unwrap();
    let tokens = synthetic_corpus(20_000, 64, 1);
    let p = if bf16 {
        HostProducts::Bf16Operands
    } else {
        HostProducts::F32
    };
    let ops = || HostOps::with_products(p);
    let peaks = on_peer_trainers((world, rpn), c, s, &params, ops, |mut t| {
        for step in 0..3 {
            t.step(&tokens, step).unwrap();
        }
        t.ops().memory().peak
    });
    assert!(
        peaks.iter().all(|&p| p == peaks[0]),
        "every rank's peak: {peaks:?}"
    );
    peaks[0]
}

#[test]
fn the_plan_is_the_measured_peak() {
    for world in [2, 4] {
        for (accum, ckpt, bf16, reduce) in [
            (1, false, false, DType::F32),
            (2, true, false, DType::F32),
            (1, false, true, DType::F32),
            (2, true, true, DType::F32),
            (2, false, true, DType::BF16),
        ] {
            let c = DeviceTrainConfig {
                activation_checkpointing: ckpt,
                reduce_dtype: reduce,
                ..device_config(LrSchedule::Constant, true, Some(1.0), accum)
            };
            let mut peaks = Vec::new();
            for s in [
                ShardingStrategy::FullShard,
                ShardingStrategy::ShardGradOp,
                ShardingStrategy::NoShard,
            ] {
                let products = if bf16 { Products::Bf16 } else { Products::F32 };
                let plan = plan_sharded_memory(&c, products, world, s, None).unwrap();
                let m = measured(c, world, s, None, bf16);
                assert_eq!(
                    plan.peak, m,
                    "{world} ranks, {s:?}, accum {accum}, checkpointing {ckpt}, bf16 {bf16}, \
                     reduced in {reduce}: planned {} vs measured {m}\n{plan}",
                    plan.peak
                );
                assert!(plan.persistent() < plan.peak);
                peaks.push(m);
            }
            assert!(
                peaks[0] < peaks[1] && peaks[1] < peaks[2],
                "{world} ranks: {peaks:?}"
            );
            println!(
                "{world} ranks, accum {accum}, checkpointing {ckpt}, bf16 {bf16}, reduced in \
                 {reduce}: peaks \
                 FULL_SHARD {}, SHARD_GRAD_OP {}, NO_SHARD {} bytes, planned exactly",
                peaks[0], peaks[1], peaks[2]
            );
        }
    }
}

/// The hybrid strategies in two nodes of two ranks: planned exactly too.
#[test]
fn the_plan_of_a_hybrid_mesh_is_the_measured_peak() {
    for s in [
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ] {
        for bf16 in [false, true] {
            // With bf16 products, the gradients reduced in bf16 too (both collectives).
            let c = DeviceTrainConfig {
                reduce_dtype: if bf16 { DType::BF16 } else { DType::F32 },
                ..device_config(LrSchedule::Constant, true, Some(1.0), 2)
            };
            let products = if bf16 { Products::Bf16 } else { Products::F32 };
            let plan = plan_sharded_memory(&c, products, 4, s, Some(2)).unwrap();
            let m = measured(c, 4, s, Some(2), bf16);
            assert_eq!(plan.peak, m, "{s:?}, bf16 {bf16}\n{plan}");
        }
    }
}

/// CPU offload with several ranks: planned exactly too (the shards, accumulators and moments
/// on the host, each unit's shards copied in when used), the plan listing them as offloaded.
#[test]
fn the_plan_of_cpu_offload_is_the_measured_peak() {
    for (s, rpn) in [
        (ShardingStrategy::FullShard, None),
        (ShardingStrategy::NoShard, None),
        (ShardingStrategy::HybridShard, Some(2)),
    ] {
        let c = DeviceTrainConfig {
            offload: true,
            ..device_config(LrSchedule::Constant, true, Some(1.0), 2)
        };
        let plan = plan_sharded_memory(&c, Products::F32, 4, s, rpn).unwrap();
        let m = measured(c, 4, s, rpn, false);
        assert_eq!(plan.peak, m, "{s:?}\n{plan}");
        // The device holds no shards, accumulators or moments: the host holds them.
        assert_eq!(
            (plan.parameters, plan.accumulators, plan.moments),
            (0, 0, 0)
        );
        let without = plan_sharded_memory(
            &DeviceTrainConfig {
                offload: false,
                ..c
            },
            Products::F32,
            4,
            s,
            rpn,
        )
        .unwrap();
        assert_eq!(plan.offloaded, 4 * without.parameters);
        // At most the run without it less the accumulators and moments; sharded, less the
        // shards too (only the units in use are on the device).
        let bound = without.peak - without.accumulators - without.moments;
        assert!(plan.peak <= bound, "{plan}\n{without}");
        if s != ShardingStrategy::NoShard {
            assert!(plan.peak < bound, "{plan}\n{without}");
        }
        println!(
            "{s:?}: offloaded peak {} bytes against {} without",
            plan.peak, without.peak
        );
    }
}

/// Rank 0's counted peak plus its collectives' staging buffers over 3 steps of `c` on `world`
/// host-twin ranks over `StagedComm` on the ring (NCCL's path as processes), with `prefetch`.
fn measured_staged(
    c: DeviceTrainConfig,
    world: usize,
    s: ShardingStrategy,
    rpn: Option<usize>,
    prefetch: Prefetch,
) -> (u64, u64) {
    let params = seeded_params(&c.cfg, 1).unwrap();
    let tokens = synthetic_corpus(20_000, 64, 1);
    let out = ring::run_ranks(world, ring::RingOptions::default(), |comm| {
        let ops = HostOps::new();
        let mut t = staged_trainer(ops, comm, world, rpn, c, s, &params);
        t.set_prefetch(prefetch);
        for step in 0..3 {
            t.step(&tokens, step).unwrap();
        }
        // The staging buffers are counted in the operations' memory.
        (t.ops().memory().peak, t.collective_bytes())
    })
    .unwrap();
    assert!(out.iter().all(|&p| p == out[0]), "every rank's: {out:?}");
    out[0]
}

/// Ranks as processes over `StagedComm` (NCCL's path): `plan_process_memory` (rank 0 alone
/// over dry-run collectives and meta operations, meta staging buffers) is the measured peak
/// of the operations plus the staging buffers, to the byte, for every strategy and with
/// prefetch in both directions; the staging buffers are about twice the largest unit.
#[test]
fn the_process_plan_is_the_measured_peak_with_staging() {
    let both = Prefetch {
        forward: true,
        backward: true,
    };
    for (world, s, rpn, prefetch, offload, reduce) in [
        (
            2,
            ShardingStrategy::FullShard,
            None,
            Prefetch::default(),
            false,
            DType::F32,
        ),
        (
            4,
            ShardingStrategy::FullShard,
            None,
            both,
            false,
            DType::F32,
        ),
        (
            4,
            ShardingStrategy::FullShard,
            None,
            both,
            false,
            DType::BF16,
        ),
        (
            2,
            ShardingStrategy::ShardGradOp,
            None,
            both,
            false,
            DType::F32,
        ),
        (
            2,
            ShardingStrategy::NoShard,
            None,
            Prefetch::default(),
            false,
            DType::BF16,
        ),
        (
            4,
            ShardingStrategy::HybridShard,
            Some(2),
            both,
            false,
            DType::BF16,
        ),
        (4, ShardingStrategy::FullShard, None, both, true, DType::F32),
        (
            2,
            ShardingStrategy::FullShard,
            None,
            both,
            false,
            DType::F16,
        ),
    ] {
        let c = DeviceTrainConfig {
            offload,
            reduce_dtype: reduce,
            ..device_config(LrSchedule::Constant, true, Some(1.0), 2)
        };
        let plan = plan_process_memory(&c, Products::F32, world, s, rpn, prefetch).unwrap();
        let (peak, staging) = measured_staged(c, world, s, rpn, prefetch);
        let what =
            format!("{world} ranks, {s:?}, {prefetch:?}, offload {offload}, reduced in {reduce}");
        assert_eq!((plan.peak, plan.staging), (peak, staging), "{what}\n{plan}");
        assert!(staging > 0, "{what}");
        println!("{what}: peak {peak} bytes, of which staging {staging}, planned exactly");
    }
}

/// AnyPrecisionAdamW's state (bf16 packed with the compensation, or f32 without it) shaped
/// as the shards — of odd lengths at 3 ranks — on the device or offloaded: the thread and
/// process plans are the measured peaks.
#[test]
fn the_plan_of_anyprecision_adamw_is_the_measured_peak() {
    use fsdp_kernels::host::AnyPrecision;
    for (world, s, state, kahan, offload) in [
        (2, ShardingStrategy::FullShard, DType::BF16, true, false),
        (3, ShardingStrategy::FullShard, DType::BF16, true, false),
        (3, ShardingStrategy::ShardGradOp, DType::F32, false, true),
        (2, ShardingStrategy::NoShard, DType::BF16, true, true),
    ] {
        let c = DeviceTrainConfig {
            offload,
            any_precision: Some(AnyPrecision {
                param: DType::BF16,
                state,
                kahan,
            }),
            batch_size: 6 * world,
            ..device_config(LrSchedule::Constant, true, Some(1.0), 1)
        };
        let what =
            format!("{world} ranks, {s:?}, {state:?} state, kahan {kahan}, offload {offload}");
        let plan = plan_sharded_memory(&c, Products::Bf16, world, s, None).unwrap();
        assert_eq!(
            plan.peak,
            measured(c, world, s, None, true),
            "{what}\n{plan}"
        );
        let plan =
            plan_process_memory(&c, Products::F32, world, s, None, Prefetch::default()).unwrap();
        let (peak, staging) = measured_staged(c, world, s, None, Prefetch::default());
        assert_eq!((plan.peak, plan.staging), (peak, staging), "{what}\n{plan}");
        println!("{what}: planned exactly ({peak} bytes a process)");
    }
}
