//! The engine on a device (`Fsdp::new_on`), run on the host twin of a device: the unsharded
//! parameters and gradients in stream-ordered memory — and the shards, gradient shards and
//! AdamW state too, or offloaded to host memory (`offload_params`) — every copy, zeroing,
//! cast, accumulation and optimizer step a task of the device's streams, the collectives
//! ordered by their events. The tied-weight MLP example, run on the device's buffers through an
//! adapter, gives the host engine's losses, parameters and schedule bit for bit in both
//! placements: every strategy at worlds 1–4 (every hybrid mesh), mixed precision, prefetching
//! and gradient accumulation. The device holds the working set (the host's peak falls), and
//! without offloading everything (the host pool holds nothing while training). A failed pass
//! leaves the engine usable, and no gradient shard that took part of it marked as zeros. And
//! what the device path refuses is an error naming it.

mod common;
#[allow(dead_code)]
#[path = "common/faulty.rs"]
mod faulty;
#[path = "common/hooked.rs"]
mod hooked;
#[path = "common/on_device.rs"]
mod on_device;
#[allow(dead_code)]
#[path = "../examples/tied_mlp.rs"]
mod tied_mlp;

use std::time::Duration;

use fsdp::engine::{
    BackwardPrefetch, ComputeDevice, FsdpConfig, GradientDivide, MixedPrecisionPolicy, ParamInit,
    ShardingStrategy,
};
use fsdp::wrap::plan_units;
use fsdp::{Fsdp, Params};
use fsdp_collectives::{ring, Communicator};
use fsdp_device::DType;

use common::{adamw, bits, configs, mesh, ring_options, GLOBAL};
use faulty::{is_missing, Fault, Faulty};
use fsdp::engine::{HostCompute, Phase};
use hooked::Hooked;
use on_device::{host_run, train_rank, train_rank_with, Outcome, STEPS};
use tied_mlp::TiedMlp;

/// Rank 0's outcome of a run of `world` ranks (threads) on the host engine or on the host
/// twin of a device with a latency of a millisecond before each operation (unordered work would
/// see stale data).
fn run(world: usize, config: FsdpConfig, micro: usize, on_device: bool) -> Outcome {
    run_with_latency(
        world,
        config,
        micro,
        on_device.then_some(Duration::from_millis(1)),
    )
}

/// [`run`] on the host engine (`None`) or the host twin with `latency`.
fn run_with_latency(
    world: usize,
    config: FsdpConfig,
    micro: usize,
    latency: Option<Duration>,
) -> Outcome {
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let device = latency.map(|latency| {
            ComputeDevice::host_twin_with_latency(1 << 28, Default::default(), latency).unwrap()
        });
        train_rank(Box::new(comm), device, latency, world, config, micro)
    })
    .unwrap();
    out.swap_remove(0)
}

/// The device runs against the host engine's: with the shards on the device and with them
/// offloaded to host memory, the same bits and schedule; the working set moved.
fn same_as_host(world: usize, config: FsdpConfig, micro: usize) {
    let host = run(world, config, micro, false);
    for offload_params in [false, true] {
        let config = FsdpConfig {
            offload_params,
            ..config
        };
        let what = format!("world {world}, {config:?}, {micro} micro-batches");
        let dev = run(world, config, micro, true);
        assert_eq!(dev.losses, host.losses, "{what}: losses");
        assert_eq!(dev.params, host.params, "{what}: parameters");
        assert_eq!(dev.schedule, host.schedule, "{what}: schedule");
        let device_peak = dev.device_peak.expect("a device");
        assert!(device_peak > 0, "{what}: nothing on the device");
        println!(
            "world {world} {:?}/{:?} offload {offload_params}: host peak {} B on the host \
             engine, {} B + {device_peak} B on the device",
            config.strategy, config.ranks_per_node, host.host_peak, dev.host_peak
        );
        if !offload_params {
            // Everything is on the device: the host pool holds nothing while training.
            assert_eq!(dev.host_peak, 0, "{what}: host memory used while training");
            continue;
        }
        // Sharded units gather into the device's memory, not the host's (unsharded ones work
        // in place on the host, and in the device's memory beside).
        let sharded = world > 1
            && config.strategy != ShardingStrategy::NoShard
            && config.ranks_per_node.is_none_or(|n| n > 1);
        assert!(
            dev.host_peak < host.host_peak || (!sharded && dev.host_peak == host.host_peak),
            "{what}: host peak {} on a device vs {} without",
            dev.host_peak,
            host.host_peak
        );
    }
    // The model learns (the losses fall).
    let l = |b: u32| f32::from_bits(b);
    assert!(
        l(host.losses[STEPS - 1]) < l(host.losses[0]),
        "world {world}"
    );
}

#[test]
fn every_strategy_and_mesh_gives_the_host_engines_bits() {
    for (world, config) in configs() {
        same_as_host(world, config, 1);
    }
}

#[test]
fn mixed_precision_gives_the_host_engines_bits() {
    let policies = [
        (DType::BF16, None),
        (DType::BF16, Some(DType::BF16)),
        (DType::F16, Some(DType::F16)),
        (DType::F16, None),
    ];
    for (param, reduce) in policies {
        for (world, strategy, per_node) in [
            (1, ShardingStrategy::FullShard, None),
            (2, ShardingStrategy::FullShard, None),
            (3, ShardingStrategy::NoShard, None),
            (4, ShardingStrategy::HybridShard, Some(2)),
        ] {
            let mut config = mesh(strategy, per_node);
            config.mixed_precision = MixedPrecisionPolicy::new(param, reduce);
            same_as_host(world, config, 1);
        }
    }
}

#[test]
fn the_division_by_the_data_parallel_size_gives_the_host_engines_bits() {
    // FSDP's gradient averaging: f32 and bf16 reductions pre-multiply by 1/n, f16 ones
    // pre-divide and post-divide (FSDP2's factors), each rounded to the reduce dtype — on the
    // device as on the host.
    for (param, reduce) in [
        (DType::F32, None),
        (DType::BF16, None),
        (DType::BF16, Some(DType::BF16)),
        (DType::F16, Some(DType::F16)),
    ] {
        for (world, strategy, per_node) in [
            (2, ShardingStrategy::FullShard, None),
            (3, ShardingStrategy::ShardGradOp, None),
            (4, ShardingStrategy::NoShard, None),
            (4, ShardingStrategy::HybridShard, Some(2)),
        ] {
            let mut config = mesh(strategy, per_node);
            config.mixed_precision = MixedPrecisionPolicy::new(param, reduce);
            config.gradient_divide = GradientDivide::DataParallelSize;
            // Two micro-batches: the second adds into gradient shards that are not zero.
            same_as_host(world, config, 2);
        }
    }
}

#[test]
fn prefetching_and_accumulation_give_the_host_engines_bits() {
    for prefetch in [
        BackwardPrefetch::Pre,
        BackwardPrefetch::Post,
        BackwardPrefetch::None,
    ] {
        for (forward_prefetch, limit) in [(true, Some(1)), (true, None), (false, Some(2))] {
            let config = FsdpConfig {
                backward_prefetch: prefetch,
                forward_prefetch,
                limit_all_gathers: limit,
                ..FsdpConfig::new(ShardingStrategy::FullShard)
            };
            same_as_host(3, config, 1);
        }
    }
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
        same_as_host(2, FsdpConfig::new(strategy), 3);
    }
}

/// Clipping by `clip_grad_norm_async` (the norm, its coefficient and the scaling on the
/// device, the norms read after the last step) in both placements: every norm, loss and
/// parameter the host engine's `clip_grad_norm`, bit for bit, on every kind of mesh.
#[test]
fn clipping_on_the_device_gives_the_host_engines_bits() {
    let max_norm = Some(0.05);
    for (world, config) in [
        (1, FsdpConfig::new(ShardingStrategy::FullShard)),
        (2, FsdpConfig::new(ShardingStrategy::FullShard)),
        (2, FsdpConfig::new(ShardingStrategy::NoShard)),
        (4, mesh(ShardingStrategy::HybridShard, Some(2))),
        (4, mesh(ShardingStrategy::HybridShardZero2, Some(2))),
    ] {
        let optim = adamw().into();
        let host = host_run(world, config, optim, max_norm);
        assert!(host.norms.iter().all(|&n| n > 0.05), "{:?}", host.norms);
        for offload_params in [false, true] {
            let config = FsdpConfig {
                offload_params,
                ..config
            };
            let dev = ring::run_ranks(world, ring_options(), |comm| {
                let latency = Duration::from_millis(1);
                let twin =
                    ComputeDevice::host_twin_with_latency(1 << 28, Default::default(), latency);
                let dev = Some(twin.unwrap());
                train_rank_with(Box::new(comm), dev, None, world, config, 1, optim, max_norm)
            })
            .unwrap()
            .swap_remove(0);
            let what = format!("world {world}, {config:?}");
            assert_eq!(dev.norms, host.norms, "{what}: norms");
            assert_eq!(dev.losses, host.losses, "{what}: losses");
            assert_eq!(dev.params, host.params, "{what}: parameters");
        }
    }
}

#[test]
fn the_limiter_waits_for_freed_units_on_the_device() {
    // Each device operation 10 ms late: freed units are still in use when the next gathers
    // come, so the limiter at 1 waits for them (and prefetches wait instead of gathering more).
    let config = |limit| FsdpConfig {
        forward_prefetch: true,
        limit_all_gathers: limit,
        ..FsdpConfig::new(ShardingStrategy::FullShard)
    };
    let latency = Some(Duration::from_millis(10));
    let limited = run_with_latency(2, config(Some(1)), 1, latency);
    let unlimited = run_with_latency(2, config(None), 1, latency);
    let host = run(2, config(Some(1)), 1, false);
    assert!(limited.limiter_waits > 0, "the limiter never waited");
    assert_eq!((unlimited.limiter_waits, host.limiter_waits), (0, 0));
    // Waiting changes no bit, and holds no more memory than not waiting.
    assert_eq!(limited.params, host.params);
    assert_eq!(limited.losses, unlimited.losses);
    let (l, u) = (limited.device_peak.unwrap(), unlimited.device_peak.unwrap());
    println!(
        "device peak: limit 1 {l} B, no limit {u} B; {} waits",
        limited.limiter_waits
    );
    assert!(l <= u, "limit 1 peaks at {l} B, no limit at {u} B");
}

#[test]
fn a_model_failing_on_the_device_leaves_the_engine_usable() {
    // The model fails in forward (span `dec`, after gathers and prefetches were issued) or in
    // backward (span `inp`, after the other units' reductions were issued) at steps 0 and 2;
    // after zero_grad, training goes on as if those passes had not happened.
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    let model = TiedMlp { global: GLOBAL };
    for (world, strategy) in [
        (2, ShardingStrategy::FullShard),
        (3, ShardingStrategy::NoShard),
    ] {
        let mut config = FsdpConfig::new(strategy);
        config.forward_prefetch = true;
        let host = run(world, config, 1, false);
        for fault in [
            Fault::Read(Phase::Forward, 2),
            Fault::Read(Phase::Backward, 0),
        ] {
            let out = ring::run_ranks(world, ring_options(), |comm| {
                let rank = comm.rank();
                let latency = Duration::from_millis(1);
                let dev =
                    ComputeDevice::host_twin_with_latency(1 << 28, Default::default(), latency)
                        .unwrap();
                let init = ParamInit::Full(&init);
                let mut fsdp =
                    Fsdp::new_on(Box::new(comm), dev, &plan, init, config, adamw()).unwrap();
                let batch = tied_mlp::batch(GLOBAL, rank, world);
                let good = HostCompute::new(&model).with_lag(latency);
                let faulty = Faulty {
                    inner: &model,
                    fault,
                };
                let bad = HostCompute::new(&faulty).with_lag(latency);
                let mut losses = Vec::new();
                for step in 0..STEPS {
                    if step != 1 {
                        let r = fsdp.forward_backward(&bad, &batch);
                        assert!(is_missing(r), "rank {rank} step {step}");
                        fsdp.zero_grad().unwrap();
                    }
                    losses.push(fsdp.step(&good, &batch).unwrap().to_bits());
                }
                (losses, bits(&fsdp.full_state_dict().unwrap()))
            })
            .unwrap();
            let what = format!("world {world}, {strategy:?}, {fault:?}");
            assert_eq!(out[0].0, host.losses, "{what}: losses");
            assert_eq!(out[0].1, host.params, "{what}: parameters");
        }
    }
}

#[test]
fn what_the_device_path_refuses_is_named() {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    let dev = || ComputeDevice::host_twin(1 << 26, Default::default()).unwrap();
    let build = |comm: Box<dyn Communicator>, config: FsdpConfig| {
        Fsdp::new_on(comm, dev(), &plan, ParamInit::Full(&init), config, adamw())
    };
    // A communicator that does not order stream-ordered buffers (as MPI).
    let e = ring::run_ranks(2, ring_options(), |comm| {
        let rank = comm.rank();
        let mut unordered = Hooked::new(comm);
        unordered.ordered = false;
        let e = build(Box::new(unordered), FsdpConfig::default()).unwrap_err();
        (rank, e.to_string())
    })
    .unwrap();
    for (rank, e) in e {
        assert!(e.contains(&format!("rank {rank}:")), "{e}");
        assert!(e.contains("does not order stream-ordered buffers"), "{e}");
    }
    // On a device the views give buffers, not host slices.
    let e = ring::run_ranks(2, ring_options(), |comm| {
        let mut fsdp = build(Box::new(comm), FsdpConfig::default()).unwrap();
        let id = fsdp.param_id("inp.weight").unwrap();
        fsdp.pre_forward(0).unwrap();
        let views = fsdp.param_views(&[0]).unwrap();
        let read = views.get(id).unwrap_err().to_string();
        let b = views.buffer_of(id).unwrap();
        assert!(b.stream_order().is_some() && views.compute_stream().is_some());
        drop(views);
        fsdp.post_forward(0).unwrap();
        fsdp.pre_backward(0).unwrap();
        let mut grads = fsdp.grad_views(&[0]).unwrap();
        let write = grads.get_mut(id).unwrap_err().to_string();
        assert_eq!(grads.grad_buffer_of(id).unwrap().len(), b.len());
        drop(grads);
        fsdp.abort_pass();
        (read, write)
    })
    .unwrap();
    assert!(
        e[0].0.contains("inp.weight") && e[0].0.contains("read it as a buffer"),
        "{}",
        e[0].0
    );
    assert!(e[1].1.contains("write it as a buffer"), "{}", e[1].1);
}

/// A pass that fails after a unit's gradient was accumulated in its gradient shard (world 1:
/// each unit's gradient is its shard itself, `F = 1`) leaves that shard marked as holding a
/// partial gradient, not zeros: a step decided on the device without `zero_grad` sees the
/// partial gradients' norm, as the host engine does (it reads the shards), and after
/// `zero_grad` a norm of 0. The model fails in the backward of span `dec`, after the head's
/// gradient went into the root unit's shard and before any unit's post-backward.
#[test]
fn an_aborted_pass_leaves_no_gradient_shard_marked_zero() {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    let model = TiedMlp { global: GLOBAL };
    let faulty = Faulty {
        inner: &model,
        fault: Fault::Read(Phase::Backward, 2),
    };
    let norms = |on_device: bool| -> (f64, f64) {
        let mut out = ring::run_ranks(1, ring_options(), |comm| {
            let init = ParamInit::Full(&init);
            let config = FsdpConfig::new(ShardingStrategy::FullShard);
            let mut fsdp = if on_device {
                let dev = ComputeDevice::host_twin(1 << 26, Default::default()).unwrap();
                Fsdp::new_on(Box::new(comm), dev, &plan, init, config, adamw()).unwrap()
            } else {
                Fsdp::new(Box::new(comm), &plan, init, config, adamw()).unwrap()
            };
            let batch = tied_mlp::batch(GLOBAL, 0, 1);
            let r = if on_device {
                fsdp.forward_backward(&HostCompute::new(&faulty), &batch)
            } else {
                fsdp.forward_backward(&faulty, &batch)
            };
            assert!(is_missing(r), "on the device: {on_device}");
            let host = fsdp_device::Buffer::from_slice(&[1.0f64]).unwrap();
            let loss = match fsdp.compute_device() {
                Some(d) => d.copy_from_host(&host, d.compute_stream()).unwrap(),
                None => host,
            };
            let norm = |fsdp: &mut Fsdp| {
                fsdp.optimizer_step_if_finite(&loss).unwrap();
                fsdp.flush_step_outcomes().unwrap()[0].grad_norm
            };
            let aborted = norm(&mut fsdp);
            fsdp.zero_grad().unwrap();
            (aborted, norm(&mut fsdp))
        })
        .unwrap();
        out.swap_remove(0)
    };
    let host = norms(false);
    let dev = norms(true);
    assert!(host.0 > 0.0 && host.1 == 0.0, "host engine: {host:?}");
    assert_eq!(dev.0.to_bits(), host.0.to_bits(), "after the aborted pass");
    assert_eq!(dev.1, 0.0, "after zero_grad");
}
