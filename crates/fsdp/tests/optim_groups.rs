//! Optimizer parameter groups inside flat shards (per-group weight decay and learning rate)
//! against per-parameter reference updates, nanoGPT's decay rule, and its learning-rate schedule.

use fsdp::optim::{
    adamw_step, decay_2d_only, decay_2d_only_group, sgd_step, AdamWConfig, LrSchedule,
    OptimizerConfig, OptimizerState, ParamGroupOptions, SgdConfig, ShardGroups, DECAY_GROUP,
    NO_DECAY_GROUP, SKIP_GROUP,
};
use fsdp::FsdpError;
use fsdp_flatparam::FlatParamLayout;

/// A [4, 3] weight, a [3] bias and a [5] LayerNorm weight (20 elements), in a layout whose
/// shards split parameters: world 2 (shards of 10) or world 3 with 4-element alignment (a gap
/// before `ln.weight`, shards of 7).
fn layouts() -> Vec<FlatParamLayout> {
    let base = |world| {
        FlatParamLayout::builder(world)
            .param("fc.weight", &[4, 3])
            .param("fc.bias", &[3])
            .param("ln.weight", &[5])
    };
    vec![
        base(2).build().unwrap(),
        base(3).align_numel(4).build().unwrap(),
        base(1).build().unwrap(),
    ]
}

fn init_params(layout: &FlatParamLayout) -> Vec<Vec<f32>> {
    layout
        .params()
        .iter()
        .enumerate()
        .map(|(k, p)| {
            (0..p.numel())
                .map(|i| ((i * 5 + k * 11) as f32 * 0.37).sin())
                .collect()
        })
        .collect()
}

fn grads_at(layout: &FlatParamLayout, step: usize) -> Vec<Vec<f32>> {
    layout
        .params()
        .iter()
        .enumerate()
        .map(|(k, p)| {
            (0..p.numel())
                .map(|i| ((i * 7 + k * 3 + step * 13) as f32 * 0.11).cos() * 0.5)
                .collect()
        })
        .collect()
}

/// Groups: weight decay on matrices (group 0, full lr), none on vectors at half the lr.
fn groups() -> Vec<ParamGroupOptions> {
    vec![
        ParamGroupOptions {
            weight_decay: Some(0.1),
            lr_scale: 1.0,
        },
        ParamGroupOptions {
            weight_decay: Some(0.0),
            lr_scale: 0.5,
        },
    ]
}

const STEPS: usize = 3;
const SCHEDULE: LrSchedule = LrSchedule::Cosine {
    warmup_iters: 1,
    lr_decay_iters: 3,
    min_lr: 1e-3,
};

/// Runs `STEPS` grouped steps on every shard of `layout` and returns the shards joined back
/// into the unsharded flat buffer.
fn run_sharded(layout: &FlatParamLayout, cfg: &OptimizerConfig) -> Vec<f32> {
    let groups = groups();
    let flat0 = layout.flatten(&init_params(layout)).unwrap();
    let grads: Vec<Vec<f32>> = (0..STEPS)
        .map(|s| layout.flatten(&grads_at(layout, s)).unwrap())
        .collect();
    let mut out = Vec::new();
    for rank in 0..layout.world_size() {
        let segs = ShardGroups::new(layout, rank, |_, shape| decay_2d_only_group(shape)).unwrap();
        assert_eq!(segs.len(), layout.shard_numel());
        let mut shard = layout.shard(&flat0, rank).unwrap().to_vec();
        let mut state = OptimizerState::new(cfg, shard.len());
        for g in &grads {
            let lr = SCHEDULE.lr_at(cfg.lr(), state.steps());
            state
                .step_grouped(
                    cfg,
                    lr,
                    &groups,
                    &segs,
                    &mut shard,
                    layout.shard(g, rank).unwrap(),
                )
                .unwrap();
        }
        assert_eq!(state.steps(), STEPS as u64, "one count per call");
        out.extend(shard);
    }
    out
}

/// The same steps applied to each whole parameter separately with its own group's settings.
fn run_reference(layout: &FlatParamLayout, cfg: &OptimizerConfig) -> Vec<f32> {
    let groups = groups();
    let mut params = init_params(layout);
    for (k, p) in params.iter_mut().enumerate() {
        let info = &layout.params()[k];
        let opts = groups[decay_2d_only_group(info.shape())];
        let n = p.len();
        let (mut m, mut v, mut buf) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
        for s in 0..STEPS {
            let g = &grads_at(layout, s)[k];
            let lr = SCHEDULE.lr_at(cfg.lr(), s as u64) * opts.lr_scale;
            match *cfg {
                OptimizerConfig::AdamW(c) => {
                    let c = AdamWConfig {
                        lr,
                        weight_decay: opts.weight_decay.unwrap(),
                        ..c
                    };
                    adamw_step(&c, s as u64 + 1, p, g, &mut m, &mut v).unwrap();
                }
                OptimizerConfig::Sgd(c) => {
                    let c = SgdConfig {
                        lr,
                        weight_decay: opts.weight_decay.unwrap(),
                        ..c
                    };
                    sgd_step(&c, s as u64 + 1, p, g, &mut buf).unwrap();
                }
                _ => unreachable!(),
            }
        }
    }
    layout.flatten(&params).unwrap()
}

fn assert_bitwise(layout: &FlatParamLayout, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "world {} element {i}: {a} vs {b}",
            layout.world_size()
        );
    }
}

#[test]
fn grouped_adamw_on_shards_equals_per_parameter_adamw() {
    let cfg = OptimizerConfig::AdamW(AdamWConfig {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.5, // overridden by both groups
    });
    for layout in layouts() {
        let got = run_sharded(&layout, &cfg);
        let want = run_reference(&layout, &cfg);
        assert_bitwise(&layout, &got, &want);
        for r in layout.padding_ranges() {
            assert!(got[r].iter().all(|&x| x.to_bits() == 0), "padding stays +0");
        }
    }
}

#[test]
fn grouped_sgd_momentum_on_shards_equals_per_parameter_sgd() {
    for nesterov in [false, true] {
        let cfg = OptimizerConfig::Sgd(SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.5,
            nesterov,
        });
        for layout in layouts() {
            let got = run_sharded(&layout, &cfg);
            let want = run_reference(&layout, &cfg);
            assert_bitwise(&layout, &got, &want);
        }
    }
    // Without momentum (no buffer at all).
    let cfg = OptimizerConfig::Sgd(SgdConfig {
        lr: 0.05,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.2,
        nesterov: false,
    });
    for layout in layouts() {
        assert_bitwise(
            &layout,
            &run_sharded(&layout, &cfg),
            &run_reference(&layout, &cfg),
        );
    }
}

#[test]
fn one_default_group_is_bitwise_step() {
    let configs = [
        OptimizerConfig::AdamW(AdamWConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }),
        OptimizerConfig::Sgd(SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            nesterov: false,
        }),
    ];
    let n = 23;
    let p0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let grads: Vec<Vec<f32>> = (0..4)
        .map(|s| (0..n).map(|i| ((i * 7 + s) as f32 * 0.11).cos()).collect())
        .collect();
    for cfg in &configs {
        let (mut a, mut b) = (p0.clone(), p0.clone());
        let mut sa = OptimizerState::new(cfg, n);
        let mut sb = OptimizerState::new(cfg, n);
        let single = ShardGroups::single(n);
        assert_eq!(single.segments(), &[(0..n, 0)]);
        for g in &grads {
            sa.step(cfg, &mut a, g).unwrap();
            sb.step_grouped(
                cfg,
                cfg.lr(),
                &[ParamGroupOptions::default()],
                &single,
                &mut b,
                g,
            )
            .unwrap();
        }
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(sa, sb, "same state, same step count");
    }
}

#[test]
fn shard_groups_follow_the_layout() {
    let ls = layouts();
    // World 2, shards of 10: fc.weight 0..12, fc.bias 12..15, ln.weight 15..20.
    let rule = |_: &str, shape: &[usize]| decay_2d_only_group(shape);
    let g0 = ShardGroups::new(&ls[0], 0, rule).unwrap();
    let g1 = ShardGroups::new(&ls[0], 1, rule).unwrap();
    assert_eq!(g0.segments(), &[(0..10, DECAY_GROUP)]);
    assert_eq!(
        g1.segments(),
        &[(0..2, DECAY_GROUP), (2..10, NO_DECAY_GROUP)],
        "bias and ln merged"
    );
    assert_eq!(g1.numel_in(NO_DECAY_GROUP), 8);
    assert_eq!(g1.max_group(), Some(1));
    // World 3, aligned to 4: fc.bias 12..15, gap 15..16, ln.weight 16..21; shards of 7.
    let g1 = ShardGroups::new(&ls[1], 1, rule).unwrap();
    let g2 = ShardGroups::new(&ls[1], 2, rule).unwrap();
    assert_eq!(
        g1.segments(),
        &[(0..5, DECAY_GROUP), (5..7, NO_DECAY_GROUP)]
    );
    assert_eq!(
        g2.segments(),
        &[
            (0..1, NO_DECAY_GROUP),
            (1..2, SKIP_GROUP),
            (2..7, NO_DECAY_GROUP)
        ]
    );
    assert_eq!(
        g2.ranges_of(NO_DECAY_GROUP).collect::<Vec<_>>(),
        [0..1, 2..7]
    );
    // End padding: 21 elements over world 2 → 11 + 11, one padding element at the end.
    let l = FlatParamLayout::builder(2)
        .param("a", &[21])
        .build()
        .unwrap();
    let g = ShardGroups::new(&l, 1, |_, _| 0).unwrap();
    assert_eq!(g.segments(), &[(0..10, 0), (10..11, SKIP_GROUP)]);
    // Names reach the rule; a frozen parameter is skipped like padding.
    let g = ShardGroups::new(
        &ls[2],
        0,
        |name, _| {
            if name == "fc.bias" {
                SKIP_GROUP
            } else {
                0
            }
        },
    )
    .unwrap();
    assert_eq!(
        g.segments(),
        &[(0..12, 0), (12..15, SKIP_GROUP), (15..20, 0)]
    );
    // Empty shard.
    assert!(ShardGroups::single(0).segments().is_empty());
    assert!(ShardGroups::single(0).is_empty());
}

#[test]
fn decay_2d_only_spares_vectors() {
    assert_eq!(decay_2d_only_group(&[]), NO_DECAY_GROUP);
    assert_eq!(decay_2d_only_group(&[5]), NO_DECAY_GROUP);
    assert_eq!(decay_2d_only_group(&[4, 3]), DECAY_GROUP);
    assert_eq!(decay_2d_only_group(&[2, 3, 4]), DECAY_GROUP);
    let groups = decay_2d_only(0.1);
    assert_eq!(
        groups,
        [
            ParamGroupOptions {
                weight_decay: Some(0.1),
                lr_scale: 1.0
            },
            ParamGroupOptions {
                weight_decay: Some(0.0),
                lr_scale: 1.0
            }
        ]
    );

    // Zero gradients: AdamW's update term is 0, only the decoupled decay moves a parameter.
    let (lr, wd) = (0.1, 0.1);
    let cfg = OptimizerConfig::AdamW(AdamWConfig {
        lr,
        weight_decay: 0.3, // the config's own decay is not used: both groups set theirs
        ..AdamWConfig::default()
    });
    for layout in layouts() {
        let flat0 = layout.flatten(&init_params(&layout)).unwrap();
        let zero = vec![0.0f32; layout.shard_numel()];
        let decay = (1.0 - lr * wd) as f32;
        for rank in 0..layout.world_size() {
            let segs =
                ShardGroups::new(&layout, rank, |_, shape| decay_2d_only_group(shape)).unwrap();
            let p0 = layout.shard(&flat0, rank).unwrap();
            let mut p = p0.to_vec();
            let mut st = OptimizerState::new(&cfg, p.len());
            st.step_grouped(&cfg, lr, &groups, &segs, &mut p, &zero)
                .unwrap();
            for (range, group) in segs.segments() {
                for i in range.clone() {
                    match *group {
                        DECAY_GROUP => {
                            assert_eq!(p[i], p0[i] * decay, "2-D param decays");
                            assert!(p[i].abs() < p0[i].abs() || p0[i] == 0.0);
                        }
                        _ => assert_eq!(p[i].to_bits(), p0[i].to_bits(), "1-D param untouched"),
                    }
                }
            }
        }
    }
}

#[test]
fn cosine_schedule_matches_nanogpt_get_lr() {
    // nanoGPT's get_lr with learning_rate 6e-4, warmup_iters 10, lr_decay_iters 110,
    // min_lr 6e-5, evaluated in Python (repr of the float):
    //   it 0 → 5.454545454545454e-05     (6e-4 · 1 / 11)
    //   it 4 → 0.0002727272727272727     (6e-4 · 5 / 11)
    //   it 9 → 0.0005454545454545454     (6e-4 · 10 / 11)
    //   it 10 → 0.0006                   (ratio 0, coeff 1)
    //   it 35 → 0.0005209188309203678    (ratio 0.25, coeff (1 + √½)/2)
    //   it 60 → 0.00032999999999999994   (ratio 0.5, coeff 0.5: 6e-5 + 0.5 · 5.4e-4)
    //   it 85 → 0.00013908116907963218   (ratio 0.75)
    //   it 110 → 6e-05                   (ratio 1, coeff 0)
    //   it 111, 5000 → 6e-05             (after decay)
    let s = LrSchedule::Cosine {
        warmup_iters: 10,
        lr_decay_iters: 110,
        min_lr: 6e-5,
    };
    s.validate().unwrap();
    let exact = [
        (0, 5.454545454545454e-05),
        (4, 0.0002727272727272727),
        (9, 0.0005454545454545454),
        (10, 0.0006),
        (60, 0.00032999999999999994),
        (110, 6e-05),
        (111, 6e-05),
        (5000, 6e-05),
    ];
    for (it, want) in exact {
        assert_eq!(s.lr_at(6e-4, it), want, "iter {it}");
    }
    // Off the points where the cosine is exact (0, ±1), allow the last bits of libm's cos.
    for (it, want) in [(35, 0.0005209188309203678), (85, 0.00013908116907963218)] {
        let got = s.lr_at(6e-4, it);
        assert!(
            (got - want).abs() <= 1e-15 * want,
            "iter {it}: {got} vs {want}"
        );
    }
    // Monotone: up during warmup, down during decay.
    let lrs: Vec<f64> = (0..=111).map(|it| s.lr_at(6e-4, it)).collect();
    assert!(lrs[..=10].windows(2).all(|w| w[0] < w[1]));
    assert!(lrs[10..].windows(2).all(|w| w[0] >= w[1]));

    assert_eq!(LrSchedule::default(), LrSchedule::Constant);
    assert_eq!(LrSchedule::Constant.lr_at(6e-4, 123), 6e-4);
    LrSchedule::Constant.validate().unwrap();

    for bad in [
        LrSchedule::Cosine {
            warmup_iters: 11,
            lr_decay_iters: 10,
            min_lr: 0.0,
        },
        LrSchedule::Cosine {
            warmup_iters: 0,
            lr_decay_iters: 10,
            min_lr: -1e-5,
        },
        LrSchedule::Cosine {
            warmup_iters: 0,
            lr_decay_iters: 10,
            min_lr: f64::NAN,
        },
    ] {
        assert!(matches!(
            bad.validate(),
            Err(FsdpError::InvalidHyperparameter { .. })
        ));
    }
}

#[test]
fn grouped_step_errors_change_nothing() {
    let layout = &layouts()[1];
    let cfg = OptimizerConfig::AdamW(AdamWConfig::default());
    let rank = 2; // fc.bias piece, gap, ln.weight
    let flat0 = layout.flatten(&init_params(layout)).unwrap();
    let p0 = layout.shard(&flat0, rank).unwrap().to_vec();
    let grad = vec![1.0f32; p0.len()];
    let mut p = p0.clone();
    let mut st = OptimizerState::new(&cfg, p.len());
    let fresh = st.clone();

    // ln.weight mapped to group 2 of 2.
    let segs = ShardGroups::new(
        layout,
        rank,
        |name, _| {
            if name == "ln.weight" {
                2
            } else {
                0
            }
        },
    )
    .unwrap();
    let err = st
        .step_grouped(&cfg, 1e-3, &decay_2d_only(0.1), &segs, &mut p, &grad)
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, FsdpError::InvalidFsdpConfig { .. }),
        "{err:?}"
    );
    assert!(
        msg.contains("`ln.weight`") && msg.contains("group 2"),
        "{msg}"
    );
    assert!(segs.check_groups(3).is_ok());

    let segs = ShardGroups::new(layout, rank, |_, shape| decay_2d_only_group(shape)).unwrap();
    for (bad, name) in [
        (
            ParamGroupOptions {
                weight_decay: None,
                lr_scale: -1.0,
            },
            "lr_scale",
        ),
        (
            ParamGroupOptions {
                weight_decay: None,
                lr_scale: f64::NAN,
            },
            "lr_scale",
        ),
        (
            ParamGroupOptions {
                weight_decay: None,
                lr_scale: f64::INFINITY,
            },
            "lr_scale",
        ),
        (
            ParamGroupOptions {
                weight_decay: Some(-0.1),
                lr_scale: 1.0,
            },
            "weight_decay",
        ),
        (
            ParamGroupOptions {
                weight_decay: Some(f64::NAN),
                lr_scale: 1.0,
            },
            "weight_decay",
        ),
    ] {
        let groups = [ParamGroupOptions::default(), bad];
        let err = st
            .step_grouped(&cfg, 1e-3, &groups, &segs, &mut p, &grad)
            .unwrap_err();
        assert!(
            matches!(err, FsdpError::InvalidHyperparameter { name: n, .. } if n == name),
            "{err:?}"
        );
        assert!(bad.validate().is_err());
    }
    // Bad learning rate.
    for lr in [-1.0, f64::NAN] {
        assert!(matches!(
            st.step_grouped(&cfg, lr, &decay_2d_only(0.1), &segs, &mut p, &grad),
            Err(FsdpError::InvalidHyperparameter { name: "lr", .. })
        ));
    }
    // Lengths: gradient, groups built for another shard size, state.
    let groups = decay_2d_only(0.1);
    assert!(matches!(
        st.step_grouped(&cfg, 1e-3, &groups, &segs, &mut p, &grad[1..]),
        Err(FsdpError::OptimizerLength { what: "grad", .. })
    ));
    assert!(matches!(
        st.step_grouped(&cfg, 1e-3, &groups, &ShardGroups::single(3), &mut p, &grad),
        Err(FsdpError::OptimizerLength {
            what: "shard groups",
            ..
        })
    ));
    let mut short = OptimizerState::new(&cfg, 3);
    assert!(matches!(
        short.step_grouped(&cfg, 1e-3, &groups, &segs, &mut p, &grad),
        Err(FsdpError::OptimizerLength {
            what: "exp_avg",
            ..
        })
    ));
    // State made for the other optimizer.
    let sgd = OptimizerConfig::Sgd(SgdConfig::with_momentum(0.1, 0.9));
    assert!(matches!(
        st.step_grouped(&sgd, 1e-3, &groups, &segs, &mut p, &grad),
        Err(FsdpError::InvalidHyperparameter {
            name: "optimizer",
            ..
        })
    ));
    // A rank the layout does not have.
    assert!(matches!(
        ShardGroups::new(layout, 3, |_, _| 0),
        Err(FsdpError::FlatParam(_))
    ));

    assert_eq!(st, fresh, "state and step count unchanged");
    assert_eq!(p, p0, "parameters unchanged");
}
