//! A steady-state step of the engine with its shards on a device does not block the host: the
//! all-gathers and reductions are not waited for on the host (the model's and the optimizer's
//! work waits for them on the device), the reduced gradients are added and the optimizer steps
//! there. A model that computes on the device itself — here each span a task of the host twin's
//! compute stream (`fsdp_device::host_task`), its loss left in device memory
//! (`FsdpModel::loss_buffer`), summed over the ranks there by `Fsdp::forward_backward_async`
//! and read by the host after the last step — runs a whole step while the device is still
//! busy, with no host wait counted (`Fsdp::host_waits`), and gives the host engine's losses
//! and parameters bit for bit; so does clipping (`Fsdp::clip_grad_norm_async`). A collective
//! that fails there is reported at the engine's next check, within the timeouts.

#[path = "common/chain.rs"]
mod chain;
mod common;
#[path = "common/hooked.rs"]
mod hooked;

use std::time::Duration;

use fsdp::engine::{ComputeDevice, DeviceScalar, FsdpConfig, ParamInit, ShardingStrategy};
use fsdp::optim::{OptimizerConfig, SgdConfig};
use fsdp::Fsdp;
use fsdp_collectives::{ring, Communicator};

use chain::{plan, Batch, Chain, N};
use common::{adamw, ring_options};

/// Steps of a run; the first records the execution order.
const STEPS: usize = 4;

/// What a rank's run gives: the losses, the norms it clipped by and final parameters (bits),
/// the host waits of the steady-state steps, and whether the device was still busy when each
/// of them returned (and its norm not ready yet).
struct Run {
    losses: Vec<u32>,
    norms: Vec<u64>,
    params: Vec<(String, Vec<u32>)>,
    steady_waits: u64,
    ran_ahead: bool,
}

/// A run, clipping the gradients by `clip` each step when it is set (on the device without
/// reading the norm: `clip_grad_norm_async`, the norms read after the last step).
fn run(
    world: usize,
    config: FsdpConfig,
    optim: OptimizerConfig,
    clip: Option<f64>,
    on_device: bool,
) -> Run {
    let init = chain::init();
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let (plan, init) = (plan(), ParamInit::Full(&init));
        let mut fsdp = if on_device {
            // Each device operation 10 ms late: a host that waited for any would see it.
            let dev = ComputeDevice::host_twin_with_latency(
                1 << 24,
                Default::default(),
                Duration::from_millis(10),
            )
            .unwrap();
            Fsdp::new_on(Box::new(comm), dev, &plan, init, config, optim).unwrap()
        } else {
            Fsdp::new(Box::new(comm), &plan, init, config, optim).unwrap()
        };
        let ((x, t), model) = chain::batch(rank, world);
        let (mut losses, mut steady_waits, mut ran_ahead) = (Vec::new(), 0, true);
        let mut norms = Vec::new();
        for step in 0..STEPS {
            let before = fsdp.host_waits();
            let batch = (x.clone(), t.clone());
            let loss = fsdp.forward_backward_async(&model, &batch).unwrap();
            let mut ready = loss.is_ready();
            losses.push(loss);
            if let Some(max_norm) = clip {
                let norm = match on_device {
                    true => fsdp.clip_grad_norm_async(max_norm).unwrap(),
                    false => DeviceScalar::from(fsdp.clip_grad_norm(max_norm).unwrap()),
                };
                ready |= norm.is_ready();
                norms.push(norm);
            }
            fsdp.optimizer_step().unwrap();
            if step > 0 {
                steady_waits += fsdp.host_waits() - before;
                if let Some(dev) = fsdp.compute_device() {
                    ran_ahead &= !dev.compute_stream().query() && !ready;
                }
            }
        }
        // The losses and norms, read by the host now (each waits for the device if need
        // be): a loop that never waits reads each one step late.
        let norms = norms.iter().map(|n| n.value().unwrap().to_bits()).collect();
        let losses: Vec<f32> = losses.iter().map(|l| l.value().unwrap() as f32).collect();
        fsdp.synchronize().unwrap();
        let mut params: Vec<_> = fsdp
            .full_state_dict()
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
            .collect();
        params.sort();
        Run {
            losses: losses.iter().map(|l| l.to_bits()).collect(),
            norms,
            params,
            steady_waits,
            ran_ahead,
        }
    })
    .unwrap();
    out.swap_remove(0)
}

#[test]
fn a_steady_state_step_on_the_device_does_not_block_the_host() {
    for (world, strategy) in [
        (1, ShardingStrategy::FullShard),
        (2, ShardingStrategy::FullShard),
        (2, ShardingStrategy::ShardGradOp),
        (2, ShardingStrategy::NoShard),
    ] {
        for optim in [adamw().into(), SgdConfig::with_momentum(0.05, 0.9).into()] {
            let what = format!("world {world}, {strategy:?}, {optim:?}");
            let config = FsdpConfig {
                // The limiter waits on the host for freed memory by design (FSDP1's rate
                // limiter): off here.
                limit_all_gathers: None,
                forward_prefetch: true,
                ..FsdpConfig::new(strategy)
            };
            let host = run(world, config, optim, None, false);
            let dev = run(world, config, optim, None, true);
            assert_eq!(dev.losses, host.losses, "{what}: losses");
            assert_eq!(dev.params, host.params, "{what}: parameters");
            let l = |b: u32| f32::from_bits(b);
            assert!(
                l(host.losses[STEPS - 1]) < l(host.losses[0]),
                "{what}: no learning"
            );
            println!(
                "{what}: host waits in {} steady-state steps: {} on the host engine, {} with the \
                 shards on the device",
                STEPS - 1,
                host.steady_waits,
                dev.steady_waits
            );
            // The host engine waits for its collectives (when it has any); the device
            // run's host never waits in a steady-state step, and returns from each while the
            // device still works.
            assert!(
                world == 1 || host.steady_waits > 0,
                "{what}: the counter counts nothing"
            );
            assert_eq!(
                dev.steady_waits, 0,
                "{what}: host waits in steady-state steps"
            );
            assert!(
                dev.ran_ahead,
                "{what}: the device was idle when a step returned"
            );
        }
    }
}

/// Clipping on the device (`clip_grad_norm_async`): the norm and the coefficient computed
/// there and the gradients scaled there, nothing read on the host; the norms, read after the
/// last step, the losses and the parameters are the host engine's (`clip_grad_norm`) bit for
/// bit, with a limit that clips every step and one that never does; still no host wait.
#[test]
fn clipping_on_the_device_does_not_block_the_host() {
    for (world, strategy) in [
        (1, ShardingStrategy::FullShard),
        (2, ShardingStrategy::FullShard),
        (2, ShardingStrategy::ShardGradOp),
        (2, ShardingStrategy::NoShard),
    ] {
        for max_norm in [0.05, 1e6] {
            let what = format!("world {world}, {strategy:?}, max_norm {max_norm}");
            let config = FsdpConfig {
                limit_all_gathers: None,
                ..FsdpConfig::new(strategy)
            };
            let optim = SgdConfig::with_momentum(0.05, 0.9).into();
            let host = run(world, config, optim, Some(max_norm), false);
            let dev = run(world, config, optim, Some(max_norm), true);
            let norms: Vec<f64> = host.norms.iter().map(|&b| f64::from_bits(b)).collect();
            println!(
                "{what}: norms {norms:?}, host waits {} vs {}",
                host.steady_waits, dev.steady_waits
            );
            assert_eq!(dev.norms, host.norms, "{what}: norms");
            assert_eq!(dev.losses, host.losses, "{what}: losses");
            assert_eq!(dev.params, host.params, "{what}: parameters");
            // The limit bites (or not) as meant, so both branches of the coefficient run.
            assert!(
                norms.iter().all(|&n| (n > max_norm) == (max_norm < 1.0)),
                "{what}: {norms:?}"
            );
            assert_eq!(dev.steady_waits, 0, "{what}: host waits");
            assert!(
                dev.ran_ahead,
                "{what}: the device was idle, or a norm ready, when a step returned"
            );
        }
    }
}

/// A rank's FULL_SHARD engine of two ranks over `comm`, its shards on the host twin (each
/// operation `latency` late, if given), from fixed weights: the error tests' engine.
fn two_rank_engine(comm: Box<dyn Communicator>, latency: Option<Duration>) -> Fsdp {
    let init = std::collections::HashMap::from([
        ("w1".to_string(), vec![0.5f32; N]),
        ("w2".to_string(), vec![1.0f32; N]),
    ]);
    let dev = match latency {
        Some(l) => ComputeDevice::host_twin_with_latency(1 << 24, Default::default(), l),
        None => ComputeDevice::host_twin(1 << 24, Default::default()),
    };
    let config = FsdpConfig::new(ShardingStrategy::FullShard);
    let init = ParamInit::Full(&init);
    Fsdp::new_on(comm, dev.unwrap(), &plan(), init, config, adamw()).unwrap()
}

/// The model of [`two_rank_engine`]'s ranks (its loss buffer a host one when `bad_loss`).
fn two_rank_chain(bad_loss: bool) -> Chain {
    Chain {
        global: (2 * N) as f32,
        bad_loss,
    }
}

/// A rank's batch of [`two_rank_engine`]'s tests.
fn two_rank_batch() -> Batch {
    (vec![1.0f32; N], vec![0.0f32; N])
}

#[test]
fn a_failed_collective_on_the_device_is_reported_without_a_hang() {
    // Rank 1 fails its fifth all-gather (step 1's first: two units, gathered for forward and
    // again for backward) without taking part, so rank 0's fails too (its peer left, or a
    // timeout). Rank 1 gets the error at once. Rank 0's host does not wait for its
    // all-gathers: it gets the error at a later check — an unshard, the optimizer step — or at
    // `synchronize`, within the timeouts; never a hang, never a silent success.
    chain::assert_fault_reported(
        STEPS,
        |rank, comm| {
            let mut hooked = hooked::Hooked::new(comm);
            if rank == 1 {
                hooked.fail_all_gather = Some(4);
            }
            Box::new(hooked)
        },
        |comm| {
            let fsdp = two_rank_engine(comm, Some(Duration::from_millis(1)));
            (fsdp, two_rank_batch(), two_rank_chain(false))
        },
    );
}

/// A loss buffer that is not one `f32` on the device is refused by name, on every rank, and the
/// engine trains on after it.
#[test]
fn a_loss_buffer_off_the_device_is_refused() {
    let out = ring::run_ranks(2, ring_options(), |comm| {
        let mut fsdp = two_rank_engine(Box::new(comm), None);
        let (bad, batch) = (two_rank_chain(true), two_rank_batch());
        let e = fsdp
            .forward_backward_async(&bad, &batch)
            .unwrap_err()
            .to_string();
        fsdp.zero_grad().unwrap();
        let good = two_rank_chain(false);
        let loss = fsdp.forward_backward_async(&good, &batch).unwrap();
        (e, loss.value().unwrap())
    })
    .unwrap();
    for (rank, (e, loss)) in out.iter().enumerate() {
        assert!(
            e.contains(&format!("rank {rank}")) && e.contains("not one f32 on the device"),
            "{e}"
        );
        assert!(loss.is_finite() && *loss > 0.0, "{loss}");
    }
}

/// A norm whose all-reduce failed is an error when it is read, never a value: rank 1 fails the
/// norm's all-reduce without taking part, so rank 0's times out; rank 0's
/// `clip_grad_norm_async` returns at once (the host does not wait), and its `value` reports the
/// failure within the timeouts.
#[test]
fn a_norm_whose_all_reduce_failed_is_an_error() {
    let mut options = ring_options();
    options.timeout = Duration::from_secs(2);
    let start = std::time::Instant::now();
    let out = ring::run_ranks(2, options, |comm| {
        let rank = comm.rank();
        let mut hooked = hooked::Hooked::new(comm);
        if rank == 1 {
            hooked.fail_all_reduce = Some(0);
        }
        let mut fsdp = two_rank_engine(Box::new(hooked), None);
        let (model, batch) = (two_rank_chain(false), two_rank_batch());
        fsdp.forward_backward_local(&model, &batch).unwrap();
        match fsdp.clip_grad_norm_async(0.05) {
            Err(e) => format!("issue: {e}"),
            Ok(norm) => match norm.value() {
                Err(e) => format!("value: {e}"),
                Ok(v) => format!("a value: {v}"),
            },
        }
    })
    .unwrap();
    println!("{out:?} after {:?}", start.elapsed());
    assert!(
        out[1].starts_with("issue: ") && out[1].contains("failed on purpose"),
        "{}",
        out[1]
    );
    assert!(out[0].starts_with("value: "), "{}", out[0]);
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{:?}",
        start.elapsed()
    );
}
