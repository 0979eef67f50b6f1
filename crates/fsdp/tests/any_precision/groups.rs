//! Parameter groups: the grouped step equals per-group steps. ((b), tiny updates where bf16
//! stalls and Kahan tracks f32, is tests/any_precision_kahan.rs.)

use super::*;

#[test]
fn grouped_bf16_step_equals_per_group_steps() {
    let base = AnyPrecisionAdamWConfig {
        weight_decay: 0.1,
        ..Default::default()
    };
    let cfg = OptimizerConfig::from(base);
    let groups = [
        ParamGroupOptions::with_weight_decay(0.2),
        ParamGroupOptions {
            weight_decay: None,
            lr_scale: 0.5,
        },
    ];
    // Runs: 0..5 group 0, 5..7 skipped, 7..12 group 1.
    let layout = fsdp_flatparam::FlatParamLayout::builder(1)
        .param("w", &[5])
        .param("frozen", &[2])
        .param("b", &[5])
        .build()
        .unwrap();
    let segments = ShardGroups::new(&layout, 0, |name, _| match name {
        "w" => 0,
        "b" => 1,
        _ => SKIP_GROUP,
    })
    .unwrap();
    assert_eq!(
        segments.segments(),
        &[(0..5, 0), (5..7, SKIP_GROUP), (7..12, 1)]
    );
    let n = 12;
    let mut rng = Rng(3);
    let p0: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.unit())).collect();
    let mut p = p0.clone();
    let mut state = OptimizerState::try_new(&cfg, n).unwrap();
    // Reference: each group's range stepped on its own with its own config.
    let g0 = AnyPrecisionAdamWConfig {
        lr: 2e-3,
        weight_decay: 0.2,
        ..base
    };
    let g1 = AnyPrecisionAdamWConfig { lr: 1e-3, ..base };
    let mut r0 = AnyPrecisionAdamWState::try_new(&g0, 5).unwrap();
    let mut r1 = AnyPrecisionAdamWState::try_new(&g1, 5).unwrap();
    let mut q = p0.clone();
    for _ in 0..4 {
        let g: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
        state
            .step_grouped_bf16(&cfg, 2e-3, &groups, &segments, &mut p, &g)
            .unwrap();
        r0.step(&g0, &mut q[0..5], &g[0..5]).unwrap();
        r1.step(&g1, &mut q[7..12], &g[7..12]).unwrap();
    }
    assert_eq!(state.steps(), 4);
    assert_eq!(bits_of(&p), bits_of(&q));
    assert_eq!(&p[5..7], &p0[5..7], "skipped elements untouched");
    let OptimizerState::AnyPrecisionAdamW(s) = &state else {
        unreachable!()
    };
    let m = s.exp_avg.to_f32_vec();
    assert_eq!(&m[5..7], &[0.0, 0.0], "skipped state untouched");
    assert_eq!(&m[0..5], &r0.exp_avg.to_f32_vec()[..]);
    assert_eq!(&m[7..12], &r1.exp_avg.to_f32_vec()[..]);
    let c = s.compensation.as_ref().unwrap().to_f32_vec();
    assert_eq!(
        &c[7..12],
        &r1.compensation.as_ref().unwrap().to_f32_vec()[..]
    );

    // One default group over the whole shard is the plain step.
    let mut a = p0.clone();
    let mut b = p0.clone();
    let mut sa = OptimizerState::try_new(&cfg, n).unwrap();
    let mut sb = AnyPrecisionAdamWState::try_new(&base, n).unwrap();
    let g: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
    let (one, whole) = ([ParamGroupOptions::default()], ShardGroups::single(n));
    sa.step_grouped_bf16(&cfg, base.lr, &one, &whole, &mut a, &g)
        .unwrap();
    sb.step(&base, &mut b, &g).unwrap();
    assert_eq!(bits_of(&a), bits_of(&b));
}

#[test]
fn grouped_f32_step_supports_any_precision() {
    let base = AnyPrecisionAdamWConfig::default();
    let cfg = OptimizerConfig::from(base);
    let n = 8;
    let mut rng = Rng(11);
    let p0: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
    let g: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
    let (mut a, mut b) = (p0.clone(), p0);
    let mut sa = OptimizerState::try_new(&cfg, n).unwrap();
    let mut sb = OptimizerState::try_new(&cfg, n).unwrap();
    let (one, whole) = ([ParamGroupOptions::default()], ShardGroups::single(n));
    sa.step_grouped(&cfg, base.lr, &one, &whole, &mut a, &g)
        .unwrap();
    sb.step(&cfg, &mut b, &g).unwrap();
    assert_eq!(a, b);
    assert_eq!(sa, sb);
}
