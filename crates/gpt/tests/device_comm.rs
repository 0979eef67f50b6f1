//! One conformance suite for every `DeviceComm` (the collectives of sharded training on a
//! device), run against each: `HostComm` over the ring (threads) and `PeerComm` over the host
//! twins (ranks as threads reading each other's buffers: the protocol `CudaOps` runs on one
//! GPU). Each collective (`common::device::exercise_collectives`) is checked against a naive
//! reference on a unit of uneven tensors (padding, a rank whose shard lies past a tensor's
//! end), with values whose sums are exact, so that every implementation must give the
//! reference's bits. Then `PeerComm`'s failures:
//! calls that differ across ranks, a rank that leaves, a rank that never arrives — each an
//! error on the others within the timeout, never a hang. And the sharded trainer over
//! `PeerComm`: bitwise the ring's at 2 ranks, within 1e-5 at 4.

use std::time::{Duration, Instant};

use fsdp::optim::LrSchedule;
use fsdp_collectives::{ring, CollectiveError};
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_comm::{DeviceComm, HostComm};
use fsdp_gpt::device_peer::PeerComm;
use fsdp_gpt::device_sharded::{Prefetch, ShardedDeviceTrainer};
use fsdp_gpt::device_staged::StagedComm;
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig, DeviceTrainError};
use fsdp_gpt::runtime::ShardingStrategy;
use fsdp_kernels::gpt::{GptOps, HostOps};

use fsdp_device::DType;

mod common;
use common::device::{
    device_config, exercise_collectives, over_peers, over_ring, over_staged, param_bits,
    unit_value, UNIT_LENS,
};

/// What [`exercise_collectives`] must give rank `r` of `world`, computed naively in f64
/// (exact: the values are small integers and the worlds powers of two or 1 and 3 on sums).
fn expected(world: usize, r: usize) -> Vec<Vec<f64>> {
    let mean = |t: usize, i: usize| {
        (0..world)
            .map(|p| f64::from(unit_value(p, t, i)))
            .sum::<f64>()
            / world as f64
    };
    let mut v = Vec::new();
    for (t, &n) in UNIT_LENS.iter().enumerate() {
        v.push((0..n).map(|i| f64::from(unit_value(0, t, i))).collect());
    }
    for (t, &n) in UNIT_LENS.iter().enumerate() {
        let s = n.div_ceil(world);
        v.push(
            (0..s)
                .map(|j| {
                    if r * s + j < n {
                        mean(t, r * s + j)
                    } else {
                        0.0
                    }
                })
                .collect(),
        );
    }
    for (t, &n) in UNIT_LENS.iter().enumerate() {
        v.push((0..n).map(|i| mean(t, i)).collect());
    }
    let (w, ranks) = (world as f64, (0..world).map(|p| p as f64).sum::<f64>());
    v.push(vec![
        r as f64,
        ranks + 0.5 * w,
        2.0 * ranks,
        4.0 * ranks / w,
        9.0,
    ]);
    v
}

/// Every collective of both implementations at 1 to 4 ranks: the reference's bits (uneven
/// tensors; at 3 and 4 ranks a shard lies past the end of the shortest).
#[test]
fn every_comm_gives_the_references_bits() {
    for world in [1, 2, 3, 4] {
        let runs = [
            ("ring", over_ring(world, exercise_collectives)),
            ("peers", over_peers(world, exercise_collectives)),
            ("staged", over_staged(world, exercise_collectives)),
        ];
        for (name, out) in runs {
            for (r, got) in out.iter().enumerate() {
                let want = expected(world, r);
                // An average over 3 ranks is rounded to f32 on the devices' side.
                let want: Vec<Vec<f64>> = want
                    .into_iter()
                    .map(|v| v.into_iter().map(|x| f64::from(x as f32)).collect())
                    .collect();
                let got: Vec<Vec<f64>> = got
                    .iter()
                    .map(|v| v.iter().map(|&x| f64::from(x as f32)).collect())
                    .collect();
                assert_eq!(got, want, "{name}, {world} ranks: rank {r}");
            }
        }
    }
}

/// Rank 1 gathers a unit of another shape: every rank fails with a mismatch naming both calls.
#[test]
fn peers_refuse_calls_that_differ() {
    let errs = over_peers(2, |comm, ops| {
        let n = if comm.rank() == 1 { 6 } else { 4 };
        let shard = ops.zeros(n / 2).unwrap();
        let mut full = ops.zeros(n).unwrap();
        comm.all_gather(ops, &[&shard], &mut [&mut full], &[DType::F32])
            .unwrap_err()
            .to_string()
    });
    for e in errs {
        assert!(
            e.contains("does not match") && e.contains("rank 0") && e.contains("rank 1"),
            "{e}"
        );
        assert!(e.contains("[2]") && e.contains("[3]"), "{e}");
    }
}

/// A rank that leaves (its communicator dropped, as when its thread fails) makes the others
/// fail at once; one that never arrives makes them fail at the timeout.
#[test]
fn peers_fail_on_a_departed_or_missing_rank() {
    let mut comms = PeerComm::<HostOps>::group(2, Duration::from_secs(60));
    let second = comms.pop().unwrap();
    let first = comms.pop().unwrap();
    let ops = HostOps::new();
    let start = Instant::now();
    let e = std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(second);
        });
        let shard = ops.zeros(1).unwrap();
        let mut full = ops.zeros(2).unwrap();
        first
            .all_gather(&ops, &[&shard], &mut [&mut full], &[DType::F32])
            .unwrap_err()
    });
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    assert!(
        matches!(
            e,
            DeviceTrainError::Collective(CollectiveError::PeerDeparted {
                rank: 0,
                peer: 1,
                ..
            })
        ),
        "{e}"
    );
    let comms = PeerComm::<HostOps>::group(2, Duration::from_millis(300));
    let (first, _second) = (&comms[0], &comms[1]);
    let shard = ops.zeros(1).unwrap();
    let mut full = ops.zeros(2).unwrap();
    let e = first
        .all_gather(&ops, &[&shard], &mut [&mut full], &[DType::F32])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("timed out") && e.contains("ranks [1] did not reach"),
        "{e}"
    );
}

/// The sharded trainer over `StagedComm`: bitwise over `HostComm` on the same ring. Over
/// `PeerComm`: bitwise the ring's at 2 ranks (a sum of two is the
/// same in either order), within 1e-5 relative at 4 (the ring folds in its own order).
#[test]
fn sharded_training_over_peers_matches_the_ring() {
    let tokens = synthetic_corpus(20_000, 64, 7);
    let schedule = LrSchedule::Constant;
    let c = device_config(schedule, true, Some(0.5), 2);
    let params = seeded_params(&c.cfg, 7).unwrap();
    let train = |comm: Box<dyn DeviceComm<HostOps>>, prefetch: Prefetch| {
        let mut t = ShardedDeviceTrainer::new(
            HostOps::new(),
            comm,
            c,
            ShardingStrategy::FullShard,
            &params,
        )
        .unwrap();
        t.set_prefetch(prefetch);
        let losses: Vec<f32> = (0..6).map(|s| t.step(&tokens, s).unwrap().loss).collect();
        (losses, param_bits(t.full_params().unwrap()))
    };
    for world in [2, 4] {
        let ring = ring::run_ranks(world, ring::RingOptions::default(), |c| {
            train(Box::new(HostComm::new(Box::new(c))), Prefetch::default())
        })
        .unwrap();
        // The same ring on the same packed layout: the same bits, whether the all-gathers
        // are issued ahead of their use (the ring's thread gathering while the host computes)
        // or not.
        for prefetch in [
            Prefetch::default(),
            Prefetch {
                forward: true,
                backward: true,
            },
            Prefetch {
                forward: false,
                backward: false,
            },
        ] {
            let staged = ring::run_ranks(world, ring::RingOptions::default(), |c| {
                train(Box::new(StagedComm::new(Box::new(c))), prefetch)
            })
            .unwrap();
            assert_eq!(
                staged, ring,
                "{world} ranks, {prefetch:?}: staged against host"
            );
        }
        let comms = PeerComm::<HostOps>::group(world, Duration::from_secs(60));
        let peers: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| s.spawn(|| train(Box::new(c), Prefetch::default())))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (p, g)) in peers.iter().zip(&ring).enumerate() {
            if world == 2 {
                assert_eq!(p.0, g.0, "rank {r}: losses");
                assert!(p.1 == g.1, "rank {r}: parameters");
            } else {
                for (a, b) in p.0.iter().zip(&g.0) {
                    assert!(((a - b) / b).abs() <= 1e-5, "rank {r}: {a} vs {b}");
                }
            }
        }
    }
}

/// FSDP's prefetch over `StagedComm`: with both directions on, every block's all-gather in
/// forward and again in backward (FULL_SHARD frees the blocks after forward) is issued one
/// unit ahead and used by its unit — none completed unused — and the losses are the run's
/// without prefetch, bitwise, also under CPU offload (the shards copied in ahead).
/// `SHARD_GRAD_OP` keeps the blocks, so backward prefetches none.
#[test]
fn staged_prefetch_gathers_each_block_one_unit_ahead() {
    let tokens = synthetic_corpus(20_000, 64, 7);
    let c = device_config(LrSchedule::Constant, true, Some(0.5), 2);
    let params = seeded_params(&c.cfg, 7).unwrap();
    let (steps, layers) = (3, c.cfg.n_layer as u64);
    let micro = (steps * c.grad_accum) as u64;
    for (strategy, per_pass, offload) in [
        (ShardingStrategy::FullShard, 2 * layers, false),
        (ShardingStrategy::ShardGradOp, layers, false),
        // Under CPU offload each block's shards are copied in ahead too.
        (ShardingStrategy::FullShard, 2 * layers, true),
    ] {
        let c = DeviceTrainConfig { offload, ..c };
        let runs = [false, true].map(|on| {
            ring::run_ranks(2, ring::RingOptions::default(), |comm| {
                let mut t = ShardedDeviceTrainer::new(
                    HostOps::new(),
                    StagedComm::new(Box::new(comm)),
                    c,
                    strategy,
                    &params,
                )
                .unwrap();
                t.set_prefetch(Prefetch {
                    forward: on,
                    backward: on,
                });
                let losses: Vec<f32> = (0..steps)
                    .map(|s| t.step(&tokens, s).unwrap().loss)
                    .collect();
                (losses, t.comm().prefetched_gathers())
            })
            .unwrap()
        });
        for (off, on) in runs[0].iter().zip(&runs[1]) {
            assert_eq!(off.0, on.0, "{strategy:?}: the losses");
            assert_eq!(off.1, (0, 0), "{strategy:?}: no prefetch asked");
            assert_eq!(on.1, (micro * per_pass, 0), "{strategy:?}: (used, unused)");
        }
    }
}
