//! One conformance suite for every `DeviceComm` (the collectives of sharded training on a
//! device), run against each: `HostComm` over the ring (threads) and `PeerComm` over the host
//! twins (ranks as threads reading each other's buffers: the protocol `CudaOps` runs on one
//! GPU). Each collective is checked against a naive reference on units of uneven tensors
//! (padding, a rank whose shard lies past a tensor's end), with values whose sums are exact,
//! so that every implementation must give the reference's bits. Then `PeerComm`'s failures:
//! calls that differ across ranks, a rank that leaves, a rank that never arrives — each an
//! error on the others within the timeout, never a hang. And the sharded trainer over
//! `PeerComm`: bitwise the ring's at 2 ranks, within 1e-5 at 4.

use std::time::{Duration, Instant};

use fsdp::optim::LrSchedule;
use fsdp_collectives::{ring, CollectiveError, ReduceOp};
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_comm::{DeviceComm, HostComm};
use fsdp_gpt::device_peer::PeerComm;
use fsdp_gpt::device_sharded::ShardedDeviceTrainer;
use fsdp_gpt::device_train::{seeded_params, DeviceTrainError};
use fsdp_gpt::runtime::ShardingStrategy;
use fsdp_kernels::gpt::{GptOps, HostOps};

mod common;
use common::device::{device_config, param_bits};

/// Runs `f` on `world` ranks of `HostComm` over the ring.
fn over_ring<R: Send>(
    world: usize,
    f: impl Fn(&dyn DeviceComm<HostOps>, &HostOps) -> R + Sync,
) -> Vec<R> {
    ring::run_ranks(world, ring::RingOptions::default(), |c| {
        let comm = HostComm::new(Box::new(c));
        f(&comm, &HostOps::new())
    })
    .unwrap()
}

/// Runs `f` on `world` ranks of `PeerComm` over the host twins, as threads.
fn over_peers<R: Send>(
    world: usize,
    f: impl Fn(&dyn DeviceComm<HostOps>, &HostOps) -> R + Sync,
) -> Vec<R> {
    let comms = PeerComm::<HostOps>::group(world, Duration::from_secs(30));
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| s.spawn(move || f(&c, &HostOps::new())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

type Runner = fn(
    usize,
    &(dyn Fn(&dyn DeviceComm<HostOps>, &HostOps) -> Vec<Vec<f32>> + Sync),
) -> Vec<Vec<Vec<f32>>>;

fn runners() -> [(&'static str, Runner); 2] {
    [
        ("ring", |w, f| over_ring(w, f)),
        ("peers", |w, f| over_peers(w, f)),
    ]
}

/// Tensor lengths of a unit: uneven, one shorter than the world.
const LENS: [usize; 3] = [7, 12, 2];

/// Rank `r`'s value of element `i` of tensor `t`: small integers, so sums are exact.
fn value(r: usize, t: usize, i: usize) -> f32 {
    (r * 100 + t * 10 + i) as f32
}

#[test]
fn all_gather_reassembles_every_tensor() {
    for (name, run) in runners() {
        for world in [1, 2, 3, 4] {
            let out = run(world, &|comm, ops| {
                let r = comm.rank();
                // The full tensor is 0, 1, 2, … ; rank r holds its shard of it.
                let shards: Vec<_> = LENS
                    .iter()
                    .enumerate()
                    .map(|(t, &n)| {
                        let s = n.div_ceil(world);
                        let v: Vec<f32> = (0..s)
                            .map(|j| {
                                let i = r * s + j;
                                if i < n {
                                    value(0, t, i)
                                } else {
                                    0.0
                                }
                            })
                            .collect();
                        ops.upload(&v).unwrap()
                    })
                    .collect();
                let mut fulls: Vec<_> = LENS
                    .iter()
                    .map(|&n| ops.upload(&vec![-1.0; n]).unwrap())
                    .collect();
                let refs: Vec<_> = shards.iter().collect();
                let mut outs: Vec<_> = fulls.iter_mut().collect();
                comm.all_gather(ops, &refs, &mut outs).unwrap();
                fulls.iter().map(|f| ops.download(f).unwrap()).collect()
            });
            for (r, fulls) in out.iter().enumerate() {
                for (t, (f, &n)) in fulls.iter().zip(&LENS).enumerate() {
                    let want: Vec<f32> = (0..n).map(|i| value(0, t, i)).collect();
                    assert_eq!(f, &want, "{name}, {world} ranks: rank {r}, tensor {t}");
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_chunk_of_the_mean() {
    for (name, run) in runners() {
        for world in [1, 2, 4] {
            let out = run(world, &|comm, ops| {
                let r = comm.rank();
                let fulls: Vec<_> = LENS
                    .iter()
                    .enumerate()
                    .map(|(t, &n)| {
                        ops.upload(&(0..n).map(|i| value(r, t, i)).collect::<Vec<_>>())
                            .unwrap()
                    })
                    .collect();
                let mut shards: Vec<_> = LENS
                    .iter()
                    .map(|&n| ops.upload(&vec![-1.0; n.div_ceil(world)]).unwrap())
                    .collect();
                let refs: Vec<_> = fulls.iter().collect();
                let mut outs: Vec<_> = shards.iter_mut().collect();
                comm.reduce_scatter_avg(ops, &refs, &mut outs).unwrap();
                shards.iter().map(|s| ops.download(s).unwrap()).collect()
            });
            for (r, shards) in out.iter().enumerate() {
                for (t, (got, &n)) in shards.iter().zip(&LENS).enumerate() {
                    let s = n.div_ceil(world);
                    let want: Vec<f32> = (0..s)
                        .map(|j| {
                            let i = r * s + j;
                            if i >= n {
                                return 0.0;
                            }
                            let sum: f64 = (0..world).map(|p| f64::from(value(p, t, i))).sum();
                            (sum / world as f64) as f32
                        })
                        .collect();
                    assert_eq!(got, &want, "{name}, {world} ranks: rank {r}, tensor {t}");
                }
            }
        }
    }
}

#[test]
fn all_reduce_gives_every_rank_the_mean_and_scalars_their_reduction() {
    for (name, run) in runners() {
        for world in [1, 2, 4] {
            let out = run(world, &|comm, ops| {
                let r = comm.rank();
                let mut bufs: Vec<_> = LENS
                    .iter()
                    .enumerate()
                    .map(|(t, &n)| {
                        ops.upload(&(0..n).map(|i| value(r, t, i)).collect::<Vec<_>>())
                            .unwrap()
                    })
                    .collect();
                let mut refs: Vec<_> = bufs.iter_mut().collect();
                comm.all_reduce_avg(ops, &mut refs).unwrap();
                let mut v: Vec<Vec<f32>> = bufs.iter().map(|b| ops.download(b).unwrap()).collect();
                // Scalars: slots 1..3 summed, slot 3 averaged, slots 0 and 4 untouched.
                let mut s = ops
                    .scalars(&[
                        r as f64,
                        r as f64 + 0.5,
                        2.0 * r as f64,
                        4.0 * r as f64,
                        9.0,
                    ])
                    .unwrap();
                comm.all_reduce_scalars(ops, &mut s, 1..3, ReduceOp::Sum)
                    .unwrap();
                comm.all_reduce_scalars(ops, &mut s, 3..4, ReduceOp::Avg)
                    .unwrap();
                v.push(s.iter().map(|&x| x as f32).collect());
                v
            });
            let w = world as f64;
            let ranks: f64 = (0..world).map(|p| p as f64).sum();
            for (r, v) in out.iter().enumerate() {
                for (t, (got, &n)) in v.iter().zip(&LENS).enumerate() {
                    let want: Vec<f32> = (0..n)
                        .map(|i| {
                            let sum: f64 = (0..world).map(|p| f64::from(value(p, t, i))).sum();
                            (sum / w) as f32
                        })
                        .collect();
                    assert_eq!(got, &want, "{name}, {world} ranks: rank {r}, tensor {t}");
                }
                let want = [r as f64, ranks + 0.5 * w, 2.0 * ranks, 4.0 * ranks / w, 9.0];
                let want: Vec<f32> = want.iter().map(|&x| x as f32).collect();
                assert_eq!(v[3], want, "{name}, {world} ranks: rank {r}, scalars");
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
        comm.all_gather(ops, &[&shard], &mut [&mut full])
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
            .all_gather(&ops, &[&shard], &mut [&mut full])
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
        .all_gather(&ops, &[&shard], &mut [&mut full])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("timed out") && e.contains("ranks [1] did not reach"),
        "{e}"
    );
}

/// The sharded trainer over `PeerComm`: bitwise the ring's at 2 ranks (a sum of two is the
/// same in either order), within 1e-5 relative at 4 (the ring folds in its own order).
#[test]
fn sharded_training_over_peers_matches_the_ring() {
    let tokens = synthetic_corpus(20_000, 64, 7);
    let schedule = LrSchedule::Constant;
    let c = device_config(schedule, true, Some(0.5), 2);
    let params = seeded_params(&c.cfg, 7).unwrap();
    let train = |comm: Box<dyn DeviceComm<HostOps>>| {
        let mut t = ShardedDeviceTrainer::new(
            HostOps::new(),
            comm,
            c,
            ShardingStrategy::FullShard,
            &params,
        )
        .unwrap();
        let losses: Vec<f32> = (0..6).map(|s| t.step(&tokens, s).unwrap().loss).collect();
        (losses, param_bits(t.full_params().unwrap()))
    };
    for world in [2, 4] {
        let ring = ring::run_ranks(world, ring::RingOptions::default(), |c| {
            train(Box::new(HostComm::new(Box::new(c))))
        })
        .unwrap();
        let comms = PeerComm::<HostOps>::group(world, Duration::from_secs(60));
        let peers: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| s.spawn(|| train(Box::new(c))))
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
