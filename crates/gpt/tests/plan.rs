//! The memory plan (a dry run of the engine on the meta device): its predicted per-rank peak of
//! allocated bytes equals the peak the caching allocator measures in a real run (two steps, ring
//! backend), byte for byte, for every strategy at world 4
//! (hybrid: 2 nodes × 2 ranks) on an 8-block model, and its collective counts per step match
//! the runtime's recorded schedule.

mod common;

use std::time::Duration;

use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::{get_batch, synthetic_corpus};
use fsdp_gpt::model::{init_params, named_params, GptConfig};
use fsdp_gpt::plan::plan;
use fsdp_gpt::runtime::{
    BackwardPrefetch, FsdpConfig, FsdpGpt, Phase, ScheduleKind, ShardingStrategy,
};
use fsdp_gpt::tree::gpt_block_plan;

const WORLD: usize = 4;
const ROWS: usize = 4; // global batch
const SEQ: usize = 16;

/// Per rank: the allocator's peak allocated bytes over two steps, and the second step's
/// (forward all-gathers, backward all-gathers, reduce-scatters, all-reduces).
fn measure(cfg: GptConfig, config: FsdpConfig) -> Vec<(u64, (usize, usize, usize, usize))> {
    let init = named_params(&cfg, init_params(&cfg, 5)).unwrap();
    let tokens = synthetic_corpus(4_000, cfg.vocab_size as u16, 3);
    let opt = common::adamw();
    let plan = gpt_block_plan(&cfg);
    let opts = ring::RingOptions::default().with_timeout(Duration::from_secs(60));
    ring::run_ranks(WORLD, opts, |comm| {
        let rank = comm.rank();
        let mut fsdp = FsdpGpt::new(Box::new(comm), cfg, &plan, &init, config, opt).unwrap();
        for k in 0..2 {
            if k == 1 {
                fsdp.clear_schedule();
            }
            let batch = get_batch(&tokens, k, ROWS, SEQ, rank, WORLD).unwrap();
            fsdp.step(&batch, ROWS * SEQ).unwrap();
        }
        let count = |phase: Option<Phase>, kind: ScheduleKind| {
            fsdp.schedule()
                .iter()
                .filter(|e| e.kind == kind && phase.is_none_or(|p| e.phase == p))
                .count()
        };
        let counts = (
            count(Some(Phase::Forward), ScheduleKind::AllGather),
            count(Some(Phase::Backward), ScheduleKind::AllGather),
            count(None, ScheduleKind::ReduceScatter),
            count(None, ScheduleKind::AllReduce),
        );
        (fsdp.memory_stats().allocated_bytes.all.peak, counts)
    })
    .unwrap()
}

#[test]
fn predicted_peak_equals_the_measured_peak_for_every_strategy() {
    let cfg = GptConfig::new(8, 2, 32, 16, 96).unwrap();
    let units = gpt_block_plan(&cfg);
    let mut configs: Vec<FsdpConfig> = ShardingStrategy::ALL
        .iter()
        .map(|&s| FsdpConfig {
            ranks_per_node: Some(2),
            ..FsdpConfig::new(s)
        })
        .collect();
    configs.push(FsdpConfig {
        forward_prefetch: true,
        ..FsdpConfig::new(ShardingStrategy::FullShard)
    });
    configs.push(FsdpConfig {
        backward_prefetch: BackwardPrefetch::Post,
        ..FsdpConfig::new(ShardingStrategy::FullShard)
    });
    configs.push(FsdpConfig {
        backward_prefetch: BackwardPrefetch::None,
        ..FsdpConfig::new(ShardingStrategy::HybridShard)
    });
    for config in configs {
        let p = plan(&cfg, WORLD, &config, &units, ROWS / WORLD, SEQ).unwrap();
        let measured = measure(cfg, config);
        assert_eq!(p.per_rank.len(), WORLD);
        for (rank, (peak, counts)) in measured.iter().enumerate() {
            let predicted = p.per_rank[rank].peak_allocated;
            println!(
                "{:?} fwd-prefetch {} {:?} rank {rank}: predicted {predicted} measured {peak}",
                config.strategy, config.forward_prefetch, config.backward_prefetch,
            );
            assert_eq!(
                predicted, *peak,
                "{config:?} rank {rank}: predicted {predicted}, measured {peak}"
            );
            assert_eq!(p.collective_counts(), *counts, "{config:?} rank {rank}");
        }
        let m = &p.per_rank[0];
        assert_eq!(
            m.peak_allocated,
            m.sharded_state + m.unsharded_params + m.unsharded_grads
        );
        assert!(m.optimizer_state > 0 && m.activations > 0);
        let table = p.to_string();
        assert!(table.contains("peak allocated") && table.contains("total per step"));
    }
}

#[test]
fn per_unit_payloads_and_counts() {
    let cfg = GptConfig::new(8, 2, 32, 16, 96).unwrap();
    let units = gpt_block_plan(&cfg);
    let full = plan(
        &cfg,
        4,
        &FsdpConfig::new(ShardingStrategy::FullShard),
        &units,
        2,
        16,
    )
    .unwrap();
    println!("{full}");
    for (row, u) in full.units.iter().zip(&units.units) {
        assert_eq!(row.params, u.numel());
        assert_eq!(
            row.shard_bytes,
            // unit params × 4 bytes / F (padded to a multiple of F)
            (u.numel().div_ceil(4) * 4) as u64
        );
        assert_eq!((row.forward_all_gathers, row.reduce_scatters), (1, 1));
        assert_eq!(row.backward_all_gathers, usize::from(row.unit != 0));
        assert_eq!(row.all_reduces, 0);
    }
    let ddp = plan(
        &cfg,
        4,
        &FsdpConfig::new(ShardingStrategy::NoShard),
        &units,
        2,
        16,
    )
    .unwrap();
    assert_eq!(ddp.collective_counts(), (0, 0, 0, units.units.len()));
    assert_eq!(
        ddp.units[1].all_reduce_bytes,
        units.units[1].numel() as u64 * 4
    );
    // Bad inputs are errors.
    let hybrid = FsdpConfig {
        ranks_per_node: Some(3),
        ..FsdpConfig::new(ShardingStrategy::HybridShard)
    };
    assert!(plan(&cfg, 4, &hybrid, &units, 2, 16).is_err());
    let c = FsdpConfig::new(ShardingStrategy::FullShard);
    assert!(plan(&cfg, 0, &c, &units, 2, 16).is_err());
    assert!(plan(&cfg, 4, &c, &units, 0, 16).is_err());
    assert!(plan(&cfg, 4, &c, &units, 2, 17).is_err());
}

/// With gradient accumulation under `no_sync`, the planned peak (which holds the unsharded
/// gradients between micro-batches) equals the measured one, and the reserved peak too; one
/// micro-batch is the plain plan.
#[test]
fn predicted_peak_with_accumulation_equals_the_measured_peak() {
    let cfg = GptConfig::new(4, 2, 32, 16, 96).unwrap();
    let units = gpt_block_plan(&cfg);
    let init = named_params(&cfg, init_params(&cfg, 5)).unwrap();
    let tokens = synthetic_corpus(4_000, 96, 3);
    let opt = common::adamw();
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::NoShard] {
        let config = FsdpConfig {
            ranks_per_node: Some(2),
            ..FsdpConfig::new(strategy)
        };
        for micro in [1usize, 2, 4] {
            let p = fsdp_gpt::plan::plan_accumulated(
                &cfg,
                WORLD,
                &config,
                &units,
                ROWS / WORLD,
                SEQ,
                micro,
            )
            .unwrap();
            if micro == 1 {
                assert_eq!(
                    p,
                    plan(&cfg, WORLD, &config, &units, ROWS / WORLD, SEQ).unwrap()
                );
            }
            let opts = ring::RingOptions::default().with_timeout(Duration::from_secs(60));
            let measured = ring::run_ranks(WORLD, opts, |comm| {
                let rank = comm.rank();
                let mut f = FsdpGpt::new(Box::new(comm), cfg, &units, &init, config, opt).unwrap();
                for step in 0..2 {
                    for m in 0..micro {
                        let k = (step * micro + m) as u64;
                        let batch = get_batch(&tokens, k, ROWS, SEQ, rank, WORLD).unwrap();
                        if m + 1 < micro {
                            f.no_sync(|f| f.forward_backward(&batch, ROWS * SEQ * micro))
                                .unwrap();
                        } else {
                            f.forward_backward(&batch, ROWS * SEQ * micro).unwrap();
                        }
                    }
                    f.optimizer_step().unwrap();
                }
                let s = f.memory_stats();
                (s.allocated_bytes.all.peak, s.reserved_bytes.all.peak)
            })
            .unwrap();
            for (rank, (allocated, reserved)) in measured.into_iter().enumerate() {
                let m = &p.per_rank[rank];
                assert_eq!(
                    (m.peak_allocated, m.peak_reserved),
                    (allocated, reserved),
                    "{strategy:?}, {micro} micro-batches, rank {rank}"
                );
            }
        }
    }
}

/// The plan is of one rank, whatever the world size: 100 000 ranks plan in well under a
/// second, every rank with the same figures.
#[test]
fn a_huge_world_plans_quickly() {
    let cfg = GptConfig::new(1, 2, 32, 16, 96).unwrap();
    let units = gpt_block_plan(&cfg);
    let t0 = std::time::Instant::now();
    let c = FsdpConfig::new(ShardingStrategy::FullShard);
    let p = plan(&cfg, 100_000, &c, &units, 1, SEQ).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!(p.per_rank.len(), 100_000);
    assert!(p.per_rank.iter().all(|m| *m == p.per_rank[0]));
    // One row for all of them.
    let table = p.to_string();
    assert!(table.contains("0-99999"), "{table}");
    assert!(table.lines().count() < 20, "{table}");
}
