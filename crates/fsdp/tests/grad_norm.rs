//! `Fsdp::grad_norm`, the global L2 norm of the gradients over the shards, and
//! `Fsdp::skip_step`, on the tied-weight MLP of `examples/tied_mlp.rs` (a weight shared by two
//! units, unit sizes that are no multiple of the world size):
//!
//! - the norm equals the norm of the single-process gradients of the whole batch, for every
//!   strategy at worlds 1 to 4 (hybrid strategies on every mesh) and with an ignored module
//!   (replicated gradients, counted once), bitwise the same on every rank;
//! - `clip_grad_norm` returns bitwise the same value, and clips to its bound;
//! - unreduced `no_sync` gradients are an error; a NaN gradient gives a NaN norm on every rank;
//! - a skipped step (gradients discarded, no optimizer step) leaves the run bitwise equal to a
//!   run without that step, the learning-rate schedule's position included.

use fsdp::engine::{Fsdp, FsdpConfig, FsdpModel, ParamInit, ShardingStrategy};
use fsdp::optim::LrSchedule;
use fsdp::wrap::WrapOptions;
use fsdp::FsdpError;
use fsdp_collectives::{ring, Communicator};

mod common;
#[allow(dead_code)]
#[path = "../examples/tied_mlp.rs"]
mod tied_mlp;

use common::{adamw, configs, ring_options, Map, GLOBAL};

use tied_mlp::TiedMlp;

/// The gradients of one forward and backward pass on the whole batch in one process, on plain
/// maps (the tied weight once, under its storage name).
fn reference_grads(model: &TiedMlp, params: &Map) -> Map {
    let batch = tied_mlp::batch(GLOBAL, 0, 1);
    common::loss_and_grads(model, params, params, &batch)
        .unwrap()
        .1
}

/// The L2 norm of `grads`, summed in f64.
fn l2(grads: &Map) -> f64 {
    grads
        .values()
        .flatten()
        .map(|&g| f64::from(g) * f64::from(g))
        .sum::<f64>()
        .sqrt()
}

/// One engine per rank on `world` threads, each given its slice of the batch.
fn on_ranks<T: Send>(
    world: usize,
    config: FsdpConfig,
    wrap: &WrapOptions,
    init: &Map,
    body: impl Fn(&mut Fsdp, &<TiedMlp as FsdpModel>::Batch) -> T + Sync,
) -> Vec<T> {
    let tree = tied_mlp::tree();
    ring::run_ranks(world, ring_options(), |comm| {
        let batch = tied_mlp::batch(GLOBAL, comm.rank(), world);
        let mut fsdp = Fsdp::from_module(
            Box::new(comm),
            &tree,
            wrap,
            ParamInit::Full(init),
            config,
            adamw(),
        )
        .unwrap();
        body(&mut fsdp, &batch)
    })
    .unwrap()
}

/// Per rank: `grad_norm`, `grad_norm` again, `clip_grad_norm` with a bound it does not reach,
/// `clip_grad_norm` with half the norm, and `grad_norm` after that clipping.
fn norms(world: usize, config: FsdpConfig, wrap: &WrapOptions, init: &Map) -> Vec<[f64; 5]> {
    let model = TiedMlp { global: GLOBAL };
    on_ranks(world, config, wrap, init, |fsdp, batch| {
        fsdp.forward_backward(&model, batch).unwrap();
        let n = fsdp.grad_norm().unwrap();
        let again = fsdp.grad_norm().unwrap();
        let unclipped = fsdp.clip_grad_norm(1e30).unwrap();
        let before = fsdp.clip_grad_norm(n / 2.0).unwrap();
        let after = fsdp.grad_norm().unwrap();
        [n, again, unclipped, before, after]
    })
}

fn check_norms(what: &str, runs: &[[f64; 5]], want: f64) {
    for (r, run) in runs.iter().enumerate() {
        assert_eq!(
            run.map(f64::to_bits),
            runs[0].map(f64::to_bits),
            "{what}: rank {r} differs from rank 0: {run:?} vs {:?}",
            runs[0]
        );
    }
    let [n, again, unclipped, before, after] = runs[0];
    let rel = (n - want).abs() / want;
    assert!(rel < 1e-5, "{what}: grad_norm {n}, reference {want}");
    assert_eq!(again.to_bits(), n.to_bits(), "{what}: grad_norm changed");
    assert_eq!(unclipped.to_bits(), n.to_bits(), "{what}: clip_grad_norm");
    assert_eq!(before.to_bits(), n.to_bits(), "{what}: clip_grad_norm");
    let rel = (after - n / 2.0).abs() / (n / 2.0);
    assert!(rel < 1e-5, "{what}: after clipping to {}: {after}", n / 2.0);
}

#[test]
fn grad_norm_equals_the_single_process_norm_for_every_strategy() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let want = l2(&reference_grads(&TiedMlp { global: GLOBAL }, &init));
    assert!(want > 0.0);
    let mut n = 0;
    for (world, config) in configs() {
        let what = format!(
            "world {world} {:?} ranks_per_node {:?}",
            config.strategy, config.ranks_per_node
        );
        check_norms(&what, &norms(world, config, &tied_mlp::wrap(), &init), want);
        n += 1;
    }
    println!("{n} configurations: grad_norm = {want}");
}

#[test]
fn grad_norm_counts_replicated_gradients_of_ignored_modules_once() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let want = l2(&reference_grads(&TiedMlp { global: GLOBAL }, &init));
    let wrap = tied_mlp::wrap().with_ignored_module("head");
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::HybridShard] {
        for world in [2, 4] {
            let mut config = FsdpConfig::new(strategy);
            if strategy.is_hybrid() {
                config.ranks_per_node = Some(2);
            }
            let what = format!("ignored head, world {world} {strategy:?}");
            check_norms(&what, &norms(world, config, &wrap, &init), want);
        }
    }
}

#[test]
fn grad_norm_refuses_unreduced_gradients_and_sees_nan_on_every_rank() {
    let model = TiedMlp { global: GLOBAL };
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let refused = on_ranks(
        2,
        FsdpConfig::new(ShardingStrategy::FullShard),
        &tied_mlp::wrap(),
        &init,
        |fsdp, batch| {
            fsdp.no_sync(|f| f.forward_backward(&model, batch)).unwrap();
            let a = matches!(fsdp.grad_norm(), Err(FsdpError::InvalidFsdpConfig { .. }));
            let b = matches!(
                fsdp.clip_grad_norm(1.0),
                Err(FsdpError::InvalidFsdpConfig { .. })
            );
            a && b
        },
    );
    assert_eq!(refused, [true, true]);

    // A NaN parameter: a NaN loss and NaN gradients, so a NaN norm on every rank, and
    // clipping by it returns it without failing.
    let mut bad = init.clone();
    bad.get_mut("head.bias").unwrap()[0] = f32::NAN;
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::NoShard] {
        let runs = on_ranks(
            3,
            FsdpConfig::new(strategy),
            &tied_mlp::wrap(),
            &bad,
            |fsdp, batch| {
                let loss = fsdp.forward_backward(&model, batch).unwrap();
                (
                    loss,
                    fsdp.grad_norm().unwrap(),
                    fsdp.clip_grad_norm(1.0).unwrap(),
                )
            },
        );
        for (loss, norm, clipped) in runs {
            assert!(loss.is_nan(), "{strategy:?}: loss {loss}");
            assert!(norm.is_nan(), "{strategy:?}: norm {norm}");
            assert!(clipped.is_nan(), "{strategy:?}: clip_grad_norm {clipped}");
        }
    }
}

#[test]
fn a_skipped_step_leaves_no_trace() {
    let model = TiedMlp { global: GLOBAL };
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    // A schedule whose learning rate changes every step, so a skipped step that advanced it
    // would show.
    let schedule = LrSchedule::Cosine {
        warmup_iters: 2,
        lr_decay_iters: 6,
        min_lr: 1e-3,
    };
    for (world, strategy) in [
        (1, ShardingStrategy::FullShard),
        (2, ShardingStrategy::FullShard),
        (3, ShardingStrategy::ShardGradOp),
        (2, ShardingStrategy::NoShard),
    ] {
        let config = FsdpConfig::new(strategy);
        // `skips[k]`: skip a step before optimizer step k (one under no_sync, unreduced).
        let run = |skips: bool| {
            on_ranks(world, config, &tied_mlp::wrap(), &init, |fsdp, batch| {
                fsdp.set_lr_schedule(schedule).unwrap();
                for step in 0..3 {
                    if skips {
                        fsdp.forward_backward(&model, batch).unwrap();
                        fsdp.skip_step().unwrap();
                        assert_eq!(fsdp.grad_norm().unwrap(), 0.0);
                        if step == 1 {
                            fsdp.no_sync(|f| f.forward_backward(&model, batch)).unwrap();
                            fsdp.skip_step().unwrap();
                        }
                    }
                    fsdp.step(&model, batch).unwrap();
                }
                (
                    fsdp.optimizer_steps(),
                    fsdp.lr(),
                    fsdp.full_state_dict().unwrap(),
                )
            })
        };
        let (plain, skipped) = (run(false), run(true));
        for (r, (a, b)) in plain.iter().zip(&skipped).enumerate() {
            assert_eq!(a.0, 3, "world {world} {strategy:?}");
            assert_eq!(
                a.0, b.0,
                "world {world} {strategy:?} rank {r}: optimizer steps"
            );
            assert_eq!(
                a.1.to_bits(),
                b.1.to_bits(),
                "world {world} {strategy:?}: lr"
            );
            assert!(
                a.2 == b.2,
                "world {world} {strategy:?} rank {r}: parameters differ after skipped steps"
            );
        }
    }
}
