//! The AdamW and SGD twins against the host optimizers of `fsdp::optim` (PyTorch's formulas),
//! the clipping twins against its clip coefficient, and the grad scaler's twins against the
//! engine's `GradScaler`, bitwise, over several steps and settings.

use fsdp::optim::{adamw_step, sgd_step, AdamWConfig, SgdConfig};
use fsdp_kernels::host::{self, AdamW, AdamWScalars, Sgd, SgdScalars};
use half::bf16;

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
            ((x >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * if i % 7 == 0 { 40.0 } else { 1.0 }
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn adamw_twin_equals_fsdp_bitwise() {
    let n = 3001;
    for (beta1, wd) in [(0.9, 0.01), (0.3, 0.0), (0.5, 0.1)] {
        let cfg = AdamWConfig {
            lr: 3e-3,
            beta1,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: wd,
        };
        let k = AdamW {
            lr: cfg.lr,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        };
        let (mut p_ref, mut m_ref, mut v_ref) = (data(n, 1), vec![0.0; n], vec![0.0; n]);
        let (mut p, mut m, mut v) = (p_ref.clone(), vec![0.0f32; n], vec![0.0f32; n]);
        // bf16 moments: the reference widens them, takes fsdp's step, and rounds them back.
        let (mut pb_ref, mut mb_ref, mut vb_ref) = (data(n, 1), vec![0.0f32; n], vec![0.0; n]);
        let (mut pb, mut mb, mut vb) = (pb_ref.clone(), vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
        for step in 1..=5u64 {
            let g = data(n, 100 + step as u32);
            adamw_step(&cfg, step, &mut p_ref, &g, &mut m_ref, &mut v_ref).unwrap();
            let s = AdamWScalars::new(&k, step).unwrap();
            host::adamw(&s, &mut p, &g, &mut m, &mut v).unwrap();
            assert_eq!(bits(&p), bits(&p_ref), "param, beta1 {beta1}, step {step}");
            assert_eq!(bits(&m), bits(&m_ref));
            assert_eq!(bits(&v), bits(&v_ref));

            adamw_step(&cfg, step, &mut pb_ref, &g, &mut mb_ref, &mut vb_ref).unwrap();
            for x in mb_ref.iter_mut().chain(vb_ref.iter_mut()) {
                *x = bf16::from_f32(*x).to_f32();
            }
            host::adamw(&s, &mut pb, &g, &mut mb, &mut vb).unwrap();
            assert_eq!(bits(&pb), bits(&pb_ref), "bf16 state, step {step}");
            let widen = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
            assert_eq!(bits(&widen(&mb)), bits(&mb_ref));
            assert_eq!(bits(&widen(&vb)), bits(&vb_ref));
        }
    }
    assert!(AdamWScalars::new(
        &AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0
        },
        0
    )
    .is_err());
}

#[test]
fn sgd_twin_equals_fsdp_bitwise() {
    let n = 2049;
    let configs = [
        (0.0, 0.0, 0.0, false),
        (0.0, 0.0, 0.01, false),
        (0.9, 0.0, 0.0, false),
        (0.9, 0.1, 0.01, false),
        (0.9, 0.0, 0.01, true),
    ];
    for (momentum, dampening, weight_decay, nesterov) in configs {
        let cfg = SgdConfig {
            lr: 0.05,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        };
        let k = Sgd {
            lr: cfg.lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        };
        let (mut p_ref, mut b_ref) = (data(n, 7), vec![0.0f32; n]);
        let (mut p, mut b) = (p_ref.clone(), vec![0.0f32; n]);
        for step in 1..=4u64 {
            let g = data(n, 200 + step as u32);
            sgd_step(&cfg, step, &mut p_ref, &g, &mut b_ref).unwrap();
            let s = SgdScalars::new(&k, step).unwrap();
            host::sgd(&s, &mut p, &g, &mut b).unwrap();
            assert_eq!(bits(&p), bits(&p_ref), "{cfg:?} step {step}");
            assert_eq!(bits(&b), bits(&b_ref));
        }
    }
}

/// The clipping twins against `fsdp::optim::clip_coefficient` and the host engine's scaling
/// (`x *= c`): the same norm, the same coefficient (1 where fsdp does not clip) and the same
/// bits after scaling, over norms below, at and above `max_norm`, and non-finite ones.
#[test]
fn clipping_twins_equal_fsdp_bitwise() {
    let x = data(2001, 7);
    for (sharded, replicated) in [(0.0, 0.0), (0.3, 0.1), (4.0, 5.0), (1e9, 0.0), (1.0, 1e-7)] {
        for max_norm in [0.0, 0.05, 1.0, 3.0, 1e12] {
            let [norm, coef] = host::clip_coefficient(sharded, replicated, max_norm);
            let total = (sharded + replicated).sqrt();
            assert_eq!(norm.to_bits(), total.to_bits());
            let want = fsdp::optim::clip_coefficient(max_norm, total);
            assert_eq!(
                coef,
                want.map_or(1.0, f64::from),
                "{sharded} {replicated} {max_norm}"
            );
            let mut got = x.clone();
            host::scale_by(&mut got, coef);
            let mut fsdp_x = x.clone();
            if let Some(c) = want {
                fsdp_x.iter_mut().for_each(|v| *v *= c);
            }
            assert_eq!(bits(&got), bits(&fsdp_x));
        }
    }
    for bad in [f64::INFINITY, f64::NAN] {
        let [norm, coef] = host::clip_coefficient(bad, 0.0, 1.0);
        assert!(!norm.is_finite());
        assert_eq!(coef, 1.0);
        assert_eq!(fsdp::optim::clip_coefficient(1.0, norm), None);
    }
    assert_eq!(host::clip_coefficient(16.0, 0.0, f64::INFINITY), [4.0, 1.0]);
}

/// The engine's grad scaler on the device, as its twins do it (`engine_decide`, `unscale_by`),
/// against the host engine's `GradScaler` over a run of optimizer steps and skips, with and
/// without an overflow: after each, the same scale (bitwise), growth tracker and skips, the
/// step applied exactly when the host engine takes it, and the unscaled gradients bitwise the
/// host engine's `x · inv_scale`. Settings that round (growth 3, backoff 0.3, from 1000.5) and
/// torch's defaults.
#[test]
fn grad_scaler_twins_equal_fsdp_bitwise() {
    use fsdp::engine::{GradScaler, GradScalerConfig};
    use host::{EngineDecision, ScalerRule, STEP_APPLIED, STEP_COUNT, STEP_FAULT};
    use host::{STEP_FOUND_INF, STEP_GROWTH_TRACKER, STEP_SCALE, STEP_SCALER_SKIPPED};
    let x = data(1001, 11);
    let configs = [
        GradScalerConfig {
            init_scale: 1000.5,
            growth_factor: 3.0,
            backoff_factor: 0.3,
            growth_interval: 3,
            enabled: true,
        },
        GradScalerConfig {
            growth_interval: 2,
            ..GradScalerConfig::default()
        },
    ];
    for cfg in configs {
        let mut want = GradScaler::new(cfg).unwrap();
        let (mut skipped, mut steps) = (0u64, 0u64);
        let mut s = host::step_scalars(0, Some((want.scale(), 0, 0)));
        let rule = ScalerRule {
            growth_factor: cfg.growth_factor,
            backoff_factor: cfg.backoff_factor,
            growth_interval: cfg.growth_interval,
        };
        for i in 0..40u32 {
            // Overflows now and then (an infinity, a NaN); every fifth step a skip asked for.
            let sharded = match i % 7 {
                3 => f64::INFINITY,
                6 if i % 2 == 0 => f64::NAN,
                _ => f64::from(i) * 0.25,
            };
            let found = !sharded.is_finite();
            let take = i % 5 != 4;
            let mut got_x = x.clone();
            host::unscale_by(&mut got_x, s[STEP_SCALE]);
            let inv = want.inv_scale();
            let want_x: Vec<f32> = x.iter().map(|v| v * inv).collect();
            assert_eq!(bits(&got_x), bits(&want_x), "{cfg:?} step {i}: unscaled");
            let d = EngineDecision {
                scaler: Some(rule),
                nonfinite: None,
                base_steps: steps,
                take,
            };
            host::engine_decide(&d, &mut s, sharded, 0.5, 0.0).unwrap();
            // The host engine: an overflow is the scaler's skip whether stepped or skipped; a
            // step without one counts towards growth; a skip without one changes nothing.
            if found {
                skipped += 1;
                want.update(true);
            } else if take {
                steps += 1;
                want.update(false);
            }
            let what = format!("{cfg:?} step {i} (found {found}, take {take})");
            assert_eq!(
                (s[STEP_SCALE] as f32).to_bits(),
                want.scale().to_bits(),
                "{what}"
            );
            assert_eq!(
                s[STEP_GROWTH_TRACKER],
                f64::from(want.growth_tracker()),
                "{what}"
            );
            assert_eq!(s[STEP_SCALER_SKIPPED], skipped as f64, "{what}");
            assert_eq!(s[STEP_COUNT], steps as f64, "{what}");
            assert_eq!(
                s[STEP_APPLIED],
                f64::from(u8::from(take && !found)),
                "{what}"
            );
            assert_eq!(s[STEP_FOUND_INF], f64::from(u8::from(found)), "{what}");
            assert_eq!(s[STEP_FAULT], 0.0, "{what}");
        }
        assert!(skipped > 0 && steps > 0);
    }
}
