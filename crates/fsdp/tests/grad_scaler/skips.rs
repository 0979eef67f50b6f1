//! Skipped steps across ranks and strategies, and training without overflow, with `no_sync`
//! accumulation and clipping, and through the trainer's non-finite check, equal to training
//! without the scaler.

use super::*;

/// Every strategy at worlds 2 and 3, hybrid ones on every mesh, and the 2×2 hybrid mesh.
fn configs() -> Vec<(usize, FsdpConfig)> {
    let mut out = Vec::new();
    for world in [2, 3] {
        for strategy in ShardingStrategy::ALL {
            if strategy.is_hybrid() {
                for rpn in [1, world] {
                    out.push((world, mesh(strategy, Some(rpn))));
                }
            } else {
                out.push((world, mesh(strategy, None)));
            }
        }
    }
    out.push((4, mesh(ShardingStrategy::HybridShard, Some(2))));
    out.push((4, mesh(ShardingStrategy::HybridShardZero2, Some(2))));
    out
}

#[test]
fn an_infinity_on_one_rank_is_skipped_on_every_rank() {
    for (world, config) in configs() {
        let what = format!(
            "world {world} {:?} ranks_per_node {:?}",
            config.strategy, config.ranks_per_node
        );
        // An infinity in `b.w[2]`'s gradient on rank 1 at step 1: with sharded strategies it
        // lands in one rank's shard only.
        let runs = train(
            world,
            config,
            adamw(),
            Some(GradScalerConfig::default()),
            3,
            |rank, step| (rank == 1 && step == 1).then_some((2, f32::INFINITY)),
        );
        // The same run without the scaler and without that step.
        let plain = train(world, config, adamw(), None, 2, |_, _| None);
        for (r, (t, p)) in runs.iter().zip(&plain).enumerate() {
            assert_eq!(
                t.scales,
                [(65536.0, 1), (32768.0, 0), (32768.0, 1)],
                "{what} rank {r}"
            );
            assert_eq!((t.skipped, t.optimizer_steps), (1, 2), "{what} rank {r}");
            assert_eq!(bits(&t.params[0]), bits(&t.params[1]), "{what} rank {r}");
            assert_eq!(
                bits(&t.params[2]),
                bits(&p.params[1]),
                "{what} rank {r}: differs from the run without the skipped step"
            );
            assert_eq!(
                bits(&t.params[2]),
                bits(&runs[0].params[2]),
                "{what} rank {r}"
            );
        }
    }
}

/// Per rank: the losses, gradient norms and final parameters of 4 steps of 2 micro-batches
/// (the first under `no_sync`), clipped to a norm the gradients exceed.
fn accumulate_and_clip(
    world: usize,
    config: FsdpConfig,
    scaler: Option<GradScalerConfig>,
) -> Vec<(Vec<u64>, Bits, Option<f32>)> {
    on_ranks(world, config, adamw(), scaler, |fsdp, rank| {
        let b = batch(rank, world, None);
        let mut norms = Vec::new();
        for _ in 0..4 {
            fsdp.no_sync(|f| f.forward_backward(&Net, &b)).unwrap();
            fsdp.forward_backward(&Net, &b).unwrap();
            let n = fsdp.clip_grad_norm(0.01).unwrap();
            assert!(n > 0.01);
            norms.push(n.to_bits());
            norms.push(fsdp.grad_norm().unwrap().to_bits());
            fsdp.optimizer_step().unwrap();
        }
        (
            norms,
            bits(&fsdp.full_state_dict().unwrap()),
            fsdp.grad_scaler().map(GradScaler::scale),
        )
    })
}

#[test]
fn without_overflow_the_scaler_changes_nothing() {
    // The scale grows at every step (2^16 to 2^20), or starts below 1.
    let growing = GradScalerConfig {
        growth_interval: 1,
        ..GradScalerConfig::default()
    };
    let small = GradScalerConfig {
        init_scale: 0.25,
        growth_interval: 1,
        ..GradScalerConfig::default()
    };
    for (world, config) in [
        (1, mesh(ShardingStrategy::FullShard, None)),
        (2, mesh(ShardingStrategy::FullShard, None)),
        (3, mesh(ShardingStrategy::ShardGradOp, None)),
        (2, mesh(ShardingStrategy::NoShard, None)),
        (4, mesh(ShardingStrategy::HybridShard, Some(2))),
    ] {
        let what = format!("world {world} {:?}", config.strategy);
        let plain = accumulate_and_clip(world, config, None);
        for (scaler, last) in [(growing, 2f32.powi(20)), (small, 4.0)] {
            let scaled = accumulate_and_clip(world, config, Some(scaler));
            for (r, (p, s)) in plain.iter().zip(&scaled).enumerate() {
                assert_eq!(p.0, s.0, "{what} rank {r}: gradient norms");
                assert!(p.1 == s.1, "{what} rank {r}: parameters differ");
                assert_eq!(s.2, Some(last), "{what} rank {r}: scale");
            }
        }
        // Plain stepping too (no clipping, no accumulation).
        let plain = train(world, config, adamw(), None, 3, |_, _| None);
        let scaled = train(world, config, adamw(), Some(growing), 3, |_, _| None);
        for (p, s) in plain.iter().zip(&scaled) {
            assert_eq!(
                p.params.iter().map(bits).collect::<Vec<_>>(),
                s.params.iter().map(bits).collect::<Vec<_>>(),
                "{what}"
            );
        }
    }
}

#[test]
fn the_trainers_nonfinite_check_skips_as_the_scaler_does() {
    let runs = on_ranks(
        2,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        Some(GradScalerConfig::default()),
        |fsdp, rank| {
            let mut out = Vec::new();
            for step in 0..3 {
                let poison = (rank == 0 && step == 1).then_some((0, f32::INFINITY));
                fsdp.forward_backward(&Net, &batch(rank, 2, poison))
                    .unwrap();
                let norm = fsdp.grad_norm().unwrap();
                let s = fsdp.grad_scaler().unwrap();
                out.push((norm.is_finite(), s.found_inf()));
                // The unscaling is done once: a second norm is the same.
                assert_eq!(fsdp.grad_norm().unwrap().to_bits(), norm.to_bits());
                assert_eq!(fsdp.unscale_grads().unwrap(), !norm.is_finite());
                if norm.is_finite() {
                    fsdp.optimizer_step().unwrap();
                } else {
                    fsdp.skip_step().unwrap();
                }
            }
            let s = fsdp.grad_scaler().unwrap();
            (out, s.state(), fsdp.optimizer_steps())
        },
    );
    for (out, state, steps) in runs {
        assert_eq!(
            out,
            [
                (true, Some(false)),
                (false, Some(true)),
                (true, Some(false))
            ]
        );
        assert_eq!(
            state,
            GradScalerState {
                scale: 32768.0,
                growth_tracker: 1,
                skipped_steps: 1
            }
        );
        assert_eq!(steps, 2);
    }

    // A skip for the caller's own reasons (finite gradients) leaves the scaler alone, and so
    // does a skip before unscaling.
    let runs = on_ranks(
        2,
        mesh(ShardingStrategy::NoShard, None),
        adamw(),
        Some(GradScalerConfig::default()),
        |fsdp, rank| {
            fsdp.forward_backward(&Net, &batch(rank, 2, None)).unwrap();
            fsdp.grad_norm().unwrap();
            fsdp.skip_step().unwrap();
            let poison = Some((0, f32::INFINITY));
            fsdp.forward_backward(&Net, &batch(rank, 2, poison))
                .unwrap();
            fsdp.skip_step().unwrap();
            fsdp.grad_scaler().unwrap().state()
        },
    );
    for state in runs {
        assert_eq!(
            state,
            GradScalerState {
                scale: 65536.0,
                growth_tracker: 0,
                skipped_steps: 0
            }
        );
    }
}

#[test]
fn a_backward_after_unscaling_is_refused() {
    let runs = on_ranks(
        2,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        Some(GradScalerConfig::default()),
        |fsdp, rank| {
            let b = batch(rank, 2, None);
            // Unscaling no gradient marks nothing: a backward may follow.
            assert!(!fsdp.unscale_grads().unwrap());
            fsdp.forward_backward(&Net, &b).unwrap();
            assert!(!fsdp.unscale_grads().unwrap());
            let refused = matches!(
                fsdp.forward_backward(&Net, &b),
                Err(FsdpError::InvalidFsdpConfig { .. })
            );
            // The scaler cannot change while gradients are held.
            let held = matches!(
                fsdp.set_grad_scaler(None),
                Err(FsdpError::InvalidFsdpConfig { .. })
            );
            fsdp.zero_grad().unwrap();
            fsdp.step(&Net, &b).unwrap();
            fsdp.set_grad_scaler(None).unwrap();
            (refused, held, fsdp.optimizer_steps())
        },
    );
    assert_eq!(runs, [(true, true, 1), (true, true, 1)]);
}
