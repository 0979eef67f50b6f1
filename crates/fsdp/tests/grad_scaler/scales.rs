//! The sequence of scales: torch.amp's `update_scale`, hand-computed sequences with injected
//! overflows, and a gradient that overflows only once scaled.

use super::*;

#[test]
fn update_follows_torch_amp_update_scale() {
    let config = GradScalerConfig {
        growth_interval: 3,
        ..GradScalerConfig::default()
    };
    let mut s = GradScaler::new(config).unwrap();
    assert_eq!(
        (s.scale(), s.growth_tracker(), s.inv_scale()),
        (65536.0, 0, 1.0 / 65536.0)
    );
    let found = [
        false, false, true, false, false, false, true, true, false, false, false,
    ];
    let want: [(f32, u32); 11] = [
        (65536.0, 1),
        (65536.0, 2),
        (32768.0, 0),
        (32768.0, 1),
        (32768.0, 2),
        (65536.0, 0),
        (32768.0, 0),
        (16384.0, 0),
        (16384.0, 1),
        (16384.0, 2),
        (32768.0, 0),
    ];
    for (f, w) in found.iter().zip(want) {
        s.update(*f);
        assert_eq!((s.scale(), s.growth_tracker()), w);
    }
    // The engine counts skipped steps, `update` does not.
    assert_eq!(s.skipped_steps(), 0);

    // Growth that would overflow to infinity is not applied; the tracker still resets.
    let top = f32::from_bits(0x7f00_0000); // 2^127
    let mut s = GradScaler::new(GradScalerConfig {
        init_scale: top,
        growth_interval: 1,
        ..GradScalerConfig::default()
    })
    .unwrap();
    s.update(false);
    assert_eq!((s.scale(), s.growth_tracker()), (top, 0));
    s.update(true);
    assert_eq!(s.scale(), top / 2.0);

    // Non-power-of-two factors: products in f64, rounded to f32 once.
    let mut s = GradScaler::new(GradScalerConfig {
        init_scale: 3.0,
        growth_factor: 1.1,
        backoff_factor: 0.3,
        growth_interval: 1,
        enabled: true,
    })
    .unwrap();
    s.update(false);
    assert_eq!(s.scale(), (3.0f64 * 1.1) as f32);
    s.update(true);
    assert_eq!(s.scale(), (f64::from((3.0f64 * 1.1) as f32) * 0.3) as f32);
    assert_eq!(s.inv_scale(), (1.0 / f64::from(s.scale())) as f32);
}

#[test]
fn hand_computed_scales_with_injected_overflows() {
    // Growth interval 3; an infinity (rank 0), a NaN (rank 1) and an infinity on both ranks at
    // steps 2, 6 and 7.
    let scaler = GradScalerConfig {
        growth_interval: 3,
        ..GradScalerConfig::default()
    };
    let poison = |rank: usize, step: usize| match (step, rank) {
        (2, 0) | (7, _) => Some((1, f32::INFINITY)),
        (6, 1) => Some((2, f32::NAN)),
        _ => None,
    };
    // The scale after each of the 12 steps: 2^16 until the overflow at step 2 halves it, three
    // clean steps (3, 4, 5) double it, steps 6 and 7 halve it twice, steps 8, 9, 10 double it.
    let scales: [f32; 12] = [
        65536.0, 65536.0, 32768.0, 32768.0, 32768.0, 65536.0, 32768.0, 16384.0, 16384.0, 16384.0,
        32768.0, 32768.0,
    ];
    let trackers: [u32; 12] = [1, 2, 0, 1, 2, 0, 0, 0, 1, 2, 0, 1];
    let skipped_at = [2, 6, 7];
    for (world, config) in [
        (2, mesh(ShardingStrategy::FullShard, None)),
        (3, mesh(ShardingStrategy::NoShard, None)),
    ] {
        let runs = train(world, config, adamw(), Some(scaler), 12, poison);
        for (r, t) in runs.iter().enumerate() {
            let what = format!("world {world} {:?} rank {r}", config.strategy);
            let got: Vec<f32> = t.scales.iter().map(|s| s.0).collect();
            assert_eq!(got, scales, "{what}: scales");
            let got: Vec<u32> = t.scales.iter().map(|s| s.1).collect();
            assert_eq!(got, trackers, "{what}: growth trackers");
            assert_eq!(t.skipped, 3, "{what}: skipped steps");
            assert_eq!(t.optimizer_steps, 9, "{what}: optimizer steps");
            let init = init();
            for step in 0..12 {
                let before = if step == 0 {
                    &init
                } else {
                    &t.params[step - 1]
                };
                let after = &t.params[step];
                assert!(after.values().flatten().all(|x| x.is_finite()), "{what}");
                if skipped_at.contains(&step) {
                    assert_eq!(bits(before), bits(after), "{what}: step {step} was skipped");
                } else {
                    for name in ["a.w", "b.w"] {
                        assert_ne!(before[name], after[name], "{what}: step {step} {name}");
                    }
                }
            }
            assert_eq!(t, &runs[0], "{what}: differs from rank 0");
        }
    }
}

#[test]
fn a_gradient_that_overflows_only_once_scaled_backs_the_scale_off_until_it_fits() {
    // 2^112 is finite, 2^112 · 2^16 = 2^128 is not, 2^112 · 2^15 = 2^127 is: the first step is
    // skipped and the second, with the same gradient, taken.
    let huge = 2f32.powi(112);
    let runs = train(
        2,
        mesh(ShardingStrategy::FullShard, None),
        SgdConfig::with_momentum(1e-33, 0.0).into(),
        Some(GradScalerConfig::default()),
        2,
        |rank, _| (rank == 0).then_some((0, huge)),
    );
    for t in &runs {
        assert_eq!(t.scales, [(32768.0, 0), (32768.0, 1)]);
        assert_eq!((t.skipped, t.optimizer_steps), (1, 1));
        assert_eq!(bits(&t.params[0]), bits(&init()), "step 0 was skipped");
        let b = &t.params[1]["b.w"];
        // b0 − 1e-33 · (2^112 + small): moved by about −5.2, and finite.
        assert!(
            b[0].is_finite() && (b[0] - (0.7 - 1e-33 * huge)).abs() < 1e-2,
            "{b:?}"
        );
    }
}
