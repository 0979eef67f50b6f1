//! The scaler's state in a sharded checkpoint, and configuration errors.

use super::*;

#[test]
fn the_scaler_state_is_saved_with_a_sharded_checkpoint() {
    let dir = std::env::temp_dir().join(format!("fsdp-grad-scaler-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let scaler = GradScalerConfig {
        growth_interval: 2,
        ..GradScalerConfig::default()
    };
    let saved = on_ranks(
        2,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        Some(scaler),
        |fsdp, rank| {
            for step in 0..4 {
                let poison = (step == 1).then_some((1, f32::INFINITY));
                fsdp.step(&Net, &batch(rank, 2, poison)).unwrap();
            }
            fsdp.save_sharded(&dir).unwrap();
            fsdp.grad_scaler().unwrap().state()
        },
    );
    let want = GradScalerState {
        scale: 65536.0,
        growth_tracker: 0,
        skipped_steps: 1,
    };
    assert_eq!(saved, [want, want]);
    let loaded = load_grad_scaler_state(&dir).unwrap();
    assert_eq!(loaded, Some(want));
    let restored = on_ranks(
        2,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        Some(scaler),
        |fsdp, _| {
            fsdp.set_grad_scaler_state(loaded.unwrap()).unwrap();
            fsdp.grad_scaler().unwrap().state()
        },
    );
    assert_eq!(restored, [want, want]);
    // Saved again without a scaler: the stale state is removed.
    on_ranks(
        2,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        None,
        |fsdp, _| {
            let e = fsdp.set_grad_scaler_state(want);
            assert!(matches!(e, Err(FsdpError::InvalidFsdpConfig { .. })));
            fsdp.save_sharded(&dir).unwrap();
        },
    );
    assert!(!dir.join(GRAD_SCALER_FILE).exists());
    assert_eq!(load_grad_scaler_state(&dir).unwrap(), None);
    std::fs::write(dir.join(GRAD_SCALER_FILE), "{\"scale\": -1}").unwrap();
    assert!(matches!(
        load_grad_scaler_state(&dir),
        Err(FsdpError::Checkpoint { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn invalid_configurations_are_refused() {
    let d = GradScalerConfig::default();
    assert_eq!(
        (
            d.init_scale,
            d.growth_factor,
            d.backoff_factor,
            d.growth_interval,
            d.enabled
        ),
        (65536.0, 2.0, 0.5, 2000, true)
    );
    let cases: Vec<(&str, GradScalerConfig)> = vec![
        (
            "init_scale",
            GradScalerConfig {
                init_scale: 0.0,
                ..d
            },
        ),
        (
            "init_scale",
            GradScalerConfig {
                init_scale: -1.0,
                ..d
            },
        ),
        (
            "init_scale",
            GradScalerConfig {
                init_scale: f32::INFINITY,
                ..d
            },
        ),
        (
            "init_scale",
            GradScalerConfig {
                init_scale: f32::NAN,
                ..d
            },
        ),
        (
            "growth_factor",
            GradScalerConfig {
                growth_factor: 1.0,
                ..d
            },
        ),
        (
            "growth_factor",
            GradScalerConfig {
                growth_factor: 0.5,
                ..d
            },
        ),
        (
            "growth_factor",
            GradScalerConfig {
                growth_factor: f64::INFINITY,
                ..d
            },
        ),
        (
            "growth_factor",
            GradScalerConfig {
                growth_factor: f64::NAN,
                ..d
            },
        ),
        (
            "backoff_factor",
            GradScalerConfig {
                backoff_factor: 0.0,
                ..d
            },
        ),
        (
            "backoff_factor",
            GradScalerConfig {
                backoff_factor: 1.0,
                ..d
            },
        ),
        (
            "backoff_factor",
            GradScalerConfig {
                backoff_factor: -0.5,
                ..d
            },
        ),
        (
            "backoff_factor",
            GradScalerConfig {
                backoff_factor: f64::NAN,
                ..d
            },
        ),
        (
            "growth_interval",
            GradScalerConfig {
                growth_interval: 0,
                ..d
            },
        ),
    ];
    for (name, c) in &cases {
        match c.validate() {
            Err(FsdpError::InvalidHyperparameter { name: n, .. }) => assert_eq!(n, *name),
            other => panic!("{c:?}: {other:?}"),
        }
        assert!(GradScaler::new(*c).is_err());
    }
    let runs = on_ranks(
        1,
        mesh(ShardingStrategy::FullShard, None),
        adamw(),
        None,
        |fsdp, _| {
            for (_, c) in &cases {
                assert!(matches!(
                    fsdp.set_grad_scaler(Some(*c)),
                    Err(FsdpError::InvalidHyperparameter { .. })
                ));
                assert!(fsdp.grad_scaler().is_none());
            }
            // A disabled scaler is none, and is not checked (as torch).
            let off = GradScalerConfig {
                enabled: false,
                growth_factor: 0.0,
                ..d
            };
            fsdp.set_grad_scaler(Some(off)).unwrap();
            let none = fsdp.grad_scaler().is_none();
            fsdp.set_grad_scaler(Some(d)).unwrap();
            let bad = GradScalerState {
                scale: f32::INFINITY,
                growth_tracker: 0,
                skipped_steps: 0,
            };
            let refused = matches!(
                fsdp.set_grad_scaler_state(bad),
                Err(FsdpError::InvalidHyperparameter { .. })
            );
            (none, refused, fsdp.grad_scaler().map(GradScaler::scale))
        },
    );
    assert_eq!(runs, [(true, true, Some(65536.0))]);
}
