//! Tests of the step twins: closed forms, and the grad scaler against the engine's.
use super::*;
use crate::host::AdamW;

fn rule(tensors: usize, max_norm: Option<f64>, skip: Option<u64>, base: u64) -> StepRule {
    StepRule {
        tensors,
        max_norm,
        skip_nonfinite: skip,
        base_steps: base,
        scaler: None,
    }
}

/// The loss: the micro-batches' means, each over its count, added in f32 — for values
/// exact in binary, the closed form.
#[test]
fn loss_accumulate_is_the_mean_over_micro_batches() {
    let mut s = vec![7.0; step_scalars_len(0)];
    loss_accumulate(&[1.0, 2.0, 3.0, 6.0], 2, true, &mut s).unwrap();
    assert_eq!(s[STEP_LOSS], 1.5);
    loss_accumulate(&vec![0.5; 1000], 2, false, &mut s).unwrap();
    assert_eq!(s[STEP_LOSS], 1.75);
    // Many values: within f32 rounding of the f64 mean.
    let l: Vec<f32> = (0..10_007).map(|i| (i % 97) as f32 * 0.013 + 1.0).collect();
    loss_accumulate(&l, 1, true, &mut s).unwrap();
    let mean = l.iter().map(|&x| f64::from(x)).sum::<f64>() / l.len() as f64;
    assert!(
        (s[STEP_LOSS] - mean).abs() <= mean * 1e-7,
        "{} vs {mean}",
        s[STEP_LOSS]
    );
    assert!(loss_accumulate(&[], 1, true, &mut s).is_err());
    assert!(loss_accumulate(&[1.0], 0, true, &mut s).is_err());
    assert!(loss_accumulate(&[1.0], 1, true, &mut [0.0; 3]).is_err());
}

/// The norm, the clipping coefficient (`torch.nn.utils.clip_grad_norm_`'s), the count.
#[test]
fn step_decide_takes_the_norm_clips_and_counts() {
    let mut s = vec![0.0; step_scalars_len(2)];
    s[STEP_LOSS] = 2.0;
    s[STEP_SQUARES] = 9.0;
    s[STEP_SQUARES + 1] = 16.0;
    step_decide(&rule(2, Some(1.0), None, 0), &mut s).unwrap();
    assert_eq!(s[STEP_GRAD_NORM], 5.0);
    assert_eq!(s[STEP_CLIPPED], 1.0);
    assert_eq!(s[STEP_CLIP_COEF], f64::from((1.0 / (5.0 + 1e-6)) as f32));
    assert_eq!(
        (s[STEP_APPLIED], s[STEP_CHOICE], s[STEP_COUNT]),
        (1.0, 0.0, 1.0)
    );
    // A norm below the limit is not clipped; the count goes on (base 0: choice 1).
    s[STEP_SQUARES] = 0.25;
    s[STEP_SQUARES + 1] = 0.0;
    step_decide(&rule(2, Some(1.0), None, 0), &mut s).unwrap();
    assert_eq!((s[STEP_GRAD_NORM], s[STEP_CLIPPED]), (0.5, 0.0));
    assert_eq!(
        (s[STEP_APPLIED], s[STEP_CHOICE], s[STEP_COUNT]),
        (1.0, 1.0, 2.0)
    );
    // A count the host offered no scalars for: a fault, nothing applied.
    step_decide(&rule(2, None, None, 0), &mut s).unwrap();
    assert_eq!(
        (s[STEP_FAULT], s[STEP_APPLIED], s[STEP_COUNT]),
        (1.0, 0.0, 2.0)
    );
    assert!(step_decide(&rule(3, None, None, 0), &mut s).is_err());
}

/// Non-finite losses and norms are skipped; past the limit the trainer halts and no later
/// step applies, finite or not.
#[test]
fn step_decide_skips_then_halts() {
    let mut s = vec![0.0; step_scalars_len(1)];
    let mut decide = |loss: f64, sq: f64| {
        s[STEP_LOSS] = loss;
        s[STEP_SQUARES] = sq;
        let base = s[STEP_COUNT] as u64;
        step_decide(&rule(1, Some(1.0), Some(1), base), &mut s).unwrap();
        (
            s[STEP_APPLIED],
            s[STEP_NONFINITE],
            s[STEP_HALTED],
            s[STEP_CLIPPED],
        )
    };
    assert_eq!(decide(1.0, 0.25), (1.0, 0.0, 0.0, 0.0));
    assert_eq!(decide(f64::NAN, 4.0), (0.0, 1.0, 0.0, 1.0));
    assert_eq!(decide(1.0, 0.5), (1.0, 1.0, 0.0, 0.0));
    // An infinite norm: not finite, never clipped.
    assert_eq!(decide(1.0, f64::INFINITY), (0.0, 2.0, 1.0, 0.0));
    assert_eq!(decide(1.0, 0.5), (0.0, 2.0, 1.0, 0.0));
    assert_eq!(s[STEP_COUNT], 2.0);
}

/// AdamW as decided: nothing when not applied; the chosen scalar set; the clipped gradient
/// as `axpby(c, g, 0, 0)` rounds it.
#[test]
fn adamw_decided_applies_the_chosen_step_to_the_clipped_gradient() {
    let cfg = AdamW {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let choice = AdamWChoice([
        AdamWScalars::new(&cfg, 1).unwrap(),
        AdamWScalars::new(&cfg, 2).unwrap(),
    ]);
    let g = vec![0.3f32, -2.0, 0.0, 5.5];
    let start = || {
        (
            vec![1.0f32, -1.0, 0.5, 2.0],
            vec![0.1f32; 4],
            vec![0.01f32; 4],
        )
    };
    let mut s = vec![0.0; step_scalars_len(0)];
    let (mut p, mut m, mut v) = start();
    adamw_decided(&choice, &s, &mut p, &g, &mut m, &mut v).unwrap();
    assert_eq!((p.clone(), m.clone(), v.clone()), start(), "not applied");
    s[STEP_APPLIED] = 1.0;
    s[STEP_CHOICE] = 1.0;
    s[STEP_CLIPPED] = 1.0;
    s[STEP_CLIP_COEF] = f64::from(0.25f32);
    adamw_decided(&choice, &s, &mut p, &g, &mut m, &mut v).unwrap();
    let (mut wp, mut wm, mut wv) = start();
    let mut clipped = vec![0.0f32; 4];
    crate::host::axpby(0.25f32, &g, 0.0, &mut clipped).unwrap();
    adamw::<f32>(&choice.0[1], &mut wp, &clipped, &mut wm, &mut wv).unwrap();
    assert_eq!((p, m, v), (wp, wm, wv));
}

/// The grad scaler's decisions against the engine's `GradScaler` fed the same steps by
/// the engine loop's rule (the loss checked first, then the scaler's overflow): the scale,
/// the tracker and the skips after every step; the norm unscaled exactly at a power-of-two
/// scale; an overflow is not a non-finite step unless the loss is.
#[test]
fn step_decide_scales_as_the_engines_grad_scaler() {
    use fsdp::engine::{GradScaler, GradScalerConfig};
    let config = GradScalerConfig {
        init_scale: 1024.0,
        growth_interval: 3,
        ..GradScalerConfig::default()
    };
    let mut engine = GradScaler::new(config).unwrap();
    let scaler = ScalerRule {
        growth_factor: config.growth_factor,
        backoff_factor: config.backoff_factor,
        growth_interval: config.growth_interval,
    };
    let mut s = step_scalars(2, Some((1024.0, 0, 0)));
    // (loss finite, gradients overflowed) a step.
    let steps = [
        (true, false),
        (true, false),
        (true, false),
        (true, true),
        (false, false),
        (true, false),
        (false, true),
        (true, false),
        (true, false),
        (true, false),
        (true, false),
    ];
    let (mut count, mut nonfinite, mut skipped) = (0u64, 0.0, 0u64);
    for (k, &(loss_ok, over)) in steps.iter().enumerate() {
        let scale = s[STEP_SCALE];
        s[STEP_LOSS] = if loss_ok { 2.0 } else { f64::NAN };
        // Unscaled squares 9 and 16 (norm 5), scaled by scale².
        s[STEP_SQUARES] = if over {
            f64::INFINITY
        } else {
            9.0 * scale * scale
        };
        s[STEP_SQUARES + 1] = 16.0 * scale * scale;
        let rule = StepRule {
            scaler: Some(scaler),
            ..rule(2, None, None, count)
        };
        step_decide(&rule, &mut s).unwrap();
        if !loss_ok {
            nonfinite += 1.0;
        }
        if over {
            skipped += 1;
            engine.update(true);
        } else if loss_ok {
            count += 1;
            engine.update(false);
            assert_eq!(s[STEP_GRAD_NORM], 5.0, "step {k}");
        }
        assert_eq!(s[STEP_APPLIED] == 1.0, loss_ok && !over, "step {k}");
        assert_eq!(s[STEP_FOUND_INF] == 1.0, over, "step {k}");
        assert_eq!(s[STEP_SCALE] as f32, engine.scale(), "step {k}");
        assert_eq!(s[STEP_GROWTH_TRACKER] as u32, engine.growth_tracker());
        assert_eq!(s[STEP_SCALER_SKIPPED] as u64, skipped);
        assert_eq!(s[STEP_NONFINITE], nonfinite);
        assert_eq!(s[STEP_UNSCALE], f64::from((1.0 / scale) as f32));
    }
    assert_eq!(s[STEP_COUNT], count as f64);
    // A growth past f32's range is not applied; the tracker restarts.
    let mut s = step_scalars(1, Some((f32::MAX / 1.5, 0, 0)));
    s[STEP_SQUARES] = 1.0;
    let one = ScalerRule {
        growth_interval: 1,
        ..scaler
    };
    let rule1 = StepRule {
        scaler: Some(one),
        ..rule(1, None, None, 0)
    };
    step_decide(&rule1, &mut s).unwrap();
    assert_eq!(
        (s[STEP_SCALE] as f32, s[STEP_GROWTH_TRACKER]),
        (f32::MAX / 1.5, 0.0)
    );
    // Invalid settings are refused before anything changes.
    for bad in [
        ScalerRule {
            growth_interval: 0,
            ..scaler
        },
        ScalerRule {
            backoff_factor: 1.0,
            ..scaler
        },
        ScalerRule {
            growth_factor: 1.0,
            ..scaler
        },
    ] {
        let before = s.clone();
        let r = StepRule {
            scaler: Some(bad),
            ..rule(1, None, None, 0)
        };
        assert!(step_decide(&r, &mut s).is_err(), "{bad:?}");
        assert_eq!(s, before);
    }
}

/// AdamW reads the gradient unscaled (`g · inv`, f32) and then clipped; the seed of the
/// cross-entropy is `dloss` times the scale.
#[test]
fn a_scalers_gradient_is_unscaled_then_clipped() {
    let mut s = step_scalars(0, Some((4.0, 0, 0)));
    let g = [8.0f32, -2.0, 0.0];
    assert_eq!(
        &*decided_grad(&s, &g),
        &g[..],
        "no unscaling before a decision"
    );
    s[STEP_UNSCALE] = 0.25;
    assert_eq!(&*decided_grad(&s, &g), &[2.0, -0.5, 0.0][..]);
    s[STEP_CLIPPED] = 1.0;
    s[STEP_CLIP_COEF] = 0.5;
    assert_eq!(&*decided_grad(&s, &g), &[1.0, -0.25, 0.0][..]);
    assert_eq!(scaled_seed("k", 0.125, Some(&s)).unwrap(), 0.5);
    assert_eq!(scaled_seed("k", 0.125, None).unwrap(), 0.125);
    assert!(scaled_seed("k", 0.125, Some(&[1.0; 3])).is_err());
}

/// SGD as decided: nothing unless applied; else the chosen step's scalars (the first step's
/// momentum buffer is the gradient) on the gradient unscaled, then clipped.
#[test]
fn sgd_decided_applies_the_chosen_step_to_the_decided_gradient() {
    let cfg = crate::host::Sgd {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 0.01,
        nesterov: false,
    };
    let choice = SgdChoice([
        SgdScalars::new(&cfg, 1).unwrap(),
        SgdScalars::new(&cfg, 2).unwrap(),
    ]);
    let g = vec![0.3f32, -2.0, 0.0, 5.5];
    let start = || (vec![1.0f32, -1.0, 0.5, 2.0], vec![0.5f32; 4]);
    let mut s = vec![0.0; step_scalars_len(0)];
    let (mut p, mut b) = start();
    sgd_decided(&choice, &s, &mut p, &g, &mut b).unwrap();
    assert_eq!((p.clone(), b.clone()), start(), "not applied");
    s[STEP_APPLIED] = 1.0;
    for (k, unscale, clip) in [(0, 0.0, None), (1, 0.5, Some(0.25f32))] {
        s[STEP_CHOICE] = k as f64;
        s[STEP_UNSCALE] = unscale;
        s[STEP_CLIPPED] = if clip.is_some() { 1.0 } else { 0.0 };
        s[STEP_CLIP_COEF] = clip.map_or(1.0, f64::from);
        let (mut p, mut b) = start();
        sgd_decided(&choice, &s, &mut p, &g, &mut b).unwrap();
        let d: Vec<f32> = g
            .iter()
            .map(|&x| {
                let x = if unscale == 0.0 {
                    x
                } else {
                    x * unscale as f32
                };
                clip.map_or(x, |c| c * x + 0.0)
            })
            .collect();
        let (mut wp, mut wb) = start();
        sgd(&choice.0[k], &mut wp, &d, &mut wb).unwrap();
        assert_eq!((p, b), (wp, wb), "choice {k}");
    }
    assert!(sgd_decided(&choice, &s[..3], &mut p, &g, &mut b).is_err());
}

/// The engine's decision with the grad scaler: a count outside the choices is a fault, never
/// a step (the scaler still backs off on an overflow); invalid settings and a short buffer
/// are refused.
#[test]
fn engine_decide_faults_and_refuses() {
    let rule = ScalerRule {
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 1,
    };
    let mut s = step_scalars(0, Some((8.0, 0, 0)));
    s[STEP_COUNT] = 5.0;
    let d = EngineDecision {
        scaler: Some(rule),
        nonfinite: None,
        base_steps: 2,
        take: true,
    };
    engine_decide(&d, &mut s, 1.0, 0.0, 0.0).unwrap();
    assert_eq!(
        (s[STEP_FAULT], s[STEP_APPLIED], s[STEP_COUNT]),
        (1.0, 0.0, 5.0)
    );
    assert_eq!(s[STEP_SCALE], 8.0, "no growth without a step");
    engine_decide(&d, &mut s, f64::NAN, 0.0, 0.0).unwrap();
    assert_eq!((s[STEP_SCALE], s[STEP_SCALER_SKIPPED]), (4.0, 1.0));
    let d = EngineDecision { base_steps: 4, ..d };
    engine_decide(&d, &mut s, 1.0, f64::NEG_INFINITY, 0.0).unwrap();
    assert_eq!((s[STEP_FOUND_INF], s[STEP_APPLIED]), (1.0, 0.0));
    engine_decide(&d, &mut s, 1.0, 3.0, 0.0).unwrap();
    assert_eq!(
        (s[STEP_CHOICE], s[STEP_APPLIED], s[STEP_COUNT]),
        (1.0, 1.0, 6.0)
    );
    assert_eq!(s[STEP_GRAD_NORM], 2.0, "√(1 + 3)");
    assert_eq!(s[STEP_SCALE], 4.0, "grown after its interval of 1");
    let bad = EngineDecision {
        scaler: Some(ScalerRule {
            backoff_factor: 1.5,
            ..rule
        }),
        ..d
    };
    assert!(engine_decide(&bad, &mut s, 1.0, 0.0, 0.0).is_err());
    assert!(engine_decide(&d, &mut s[..STEP_SQUARES - 1], 1.0, 0.0, 0.0).is_err());
    let mut x = [4.0f32, -1.0];
    unscale_by(&mut x, 8.0);
    assert_eq!(x, [0.5, -0.125]);
}

/// The engine's non-finite rule, against the closed form of `fsdp train`'s loop: a step is
/// skipped when its loss is not finite, or its norm is not and the scaler found no overflow
/// (an overflow is the scaler's skip, not counted); beyond the limit the engine halts and no
/// later step applies, finite or not. Without the rule a NaN loss is stepped on.
#[test]
fn engine_decide_skips_nonfinite_steps_and_halts_past_the_limit() {
    let scaler = ScalerRule {
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 100,
    };
    for (with_scaler, limit) in [(false, Some(2)), (true, Some(2)), (false, None)] {
        let mut s = step_scalars(0, Some((8.0, 0, 0)));
        let (mut steps, mut nonfinite, mut halted) = (0u64, 0u64, false);
        for i in 0..16u32 {
            let loss = if i % 5 == 2 { f64::NAN } else { 3.0 };
            let sharded = if i % 4 == 3 { f64::INFINITY } else { 1.0 };
            let d = EngineDecision {
                scaler: with_scaler.then_some(scaler),
                nonfinite: Some(NonfiniteRule { skip_limit: limit }),
                base_steps: steps,
                take: true,
            };
            engine_decide(&d, &mut s, sharded, 3.0, loss).unwrap();
            let overflow = with_scaler && !sharded.is_finite();
            let finite = loss.is_finite() && (overflow || sharded.is_finite());
            if !finite {
                nonfinite += 1;
                halted |= limit.is_some_and(|k| nonfinite > k);
            }
            let applied = finite && !overflow && !halted;
            steps += u64::from(applied);
            let what = format!("scaler {with_scaler} limit {limit:?} step {i}");
            assert_eq!(s[STEP_APPLIED], f64::from(u8::from(applied)), "{what}");
            assert_eq!(s[STEP_COUNT], steps as f64, "{what}");
            assert_eq!(s[STEP_NONFINITE], nonfinite as f64, "{what}");
            assert_eq!(s[STEP_HALTED], f64::from(u8::from(halted)), "{what}");
            assert_eq!(s[STEP_FOUND_INF], f64::from(u8::from(overflow)), "{what}");
            assert_eq!(s[STEP_LOSS].to_bits(), loss.to_bits(), "{what}");
            assert_eq!(s[STEP_GRAD_NORM], (sharded + 3.0).sqrt(), "{what}");
        }
        assert_eq!(
            halted,
            limit.is_some(),
            "the limit of 2 is passed in 16 steps"
        );
    }
    // Without the rule: a NaN loss is not looked at.
    let mut s = step_scalars(0, None);
    let d = EngineDecision {
        scaler: None,
        nonfinite: None,
        base_steps: 0,
        take: true,
    };
    engine_decide(&d, &mut s, 1.0, 0.0, f64::NAN).unwrap();
    assert_eq!((s[STEP_APPLIED], s[STEP_NONFINITE]), (1.0, 0.0));
}
