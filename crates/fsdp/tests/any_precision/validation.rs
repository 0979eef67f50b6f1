//! (c) Validation and errors.

use super::*;

#[test]
fn invalid_settings_are_rejected_by_name() {
    let d = AnyPrecisionAdamWConfig::default();
    let cases: Vec<(AnyPrecisionAdamWConfig, &str)> = vec![
        (AnyPrecisionAdamWConfig { lr: -1e-3, ..d }, "lr"),
        (AnyPrecisionAdamWConfig { lr: f64::NAN, ..d }, "lr"),
        (
            AnyPrecisionAdamWConfig {
                lr: f64::INFINITY,
                ..d
            },
            "lr",
        ),
        (AnyPrecisionAdamWConfig { eps: -1.0, ..d }, "eps"),
        (
            AnyPrecisionAdamWConfig {
                weight_decay: -0.1,
                ..d
            },
            "weight_decay",
        ),
        (AnyPrecisionAdamWConfig { beta1: 1.0, ..d }, "beta1"),
        (AnyPrecisionAdamWConfig { beta1: -0.1, ..d }, "beta1"),
        (
            AnyPrecisionAdamWConfig {
                beta2: f64::NAN,
                ..d
            },
            "beta2",
        ),
        (
            AnyPrecisionAdamWConfig {
                momentum_dtype: DType::F64,
                ..d
            },
            "momentum_dtype",
        ),
        (
            AnyPrecisionAdamWConfig {
                variance_dtype: DType::F64,
                ..d
            },
            "variance_dtype",
        ),
        (
            AnyPrecisionAdamWConfig {
                compensation_buffer_dtype: DType::F64,
                ..d
            },
            "compensation_buffer_dtype",
        ),
    ];
    for (cfg, name) in cases {
        match cfg.validate() {
            Err(FsdpError::InvalidHyperparameter { name: got, .. }) => {
                assert_eq!(got, name, "{cfg:?}")
            }
            other => panic!("{cfg:?}: {other:?}"),
        }
        assert!(OptimizerConfig::from(cfg).validate().is_err());
        assert!(AnyPrecisionAdamWState::try_new(&cfg, 4).is_err());
    }
    // The compensation dtype does not matter without Kahan summation.
    AnyPrecisionAdamWConfig {
        use_kahan_summation: false,
        compensation_buffer_dtype: DType::F64,
        ..d
    }
    .validate()
    .unwrap();
    d.validate().unwrap();
    AnyPrecisionAdamWConfig {
        lr: 0.0,
        eps: 0.0,
        beta1: 0.0,
        beta2: 0.0,
        ..d
    }
    .validate()
    .unwrap();
}

#[test]
fn errors_leave_state_and_parameters_unchanged() {
    let cfg = AnyPrecisionAdamWConfig::default();
    let mut state = AnyPrecisionAdamWState::try_new(&cfg, 3).unwrap();
    let mut p = vec![bf16::from_f32(1.0); 3];
    let before = state.clone();

    // Gradient of the wrong length.
    let e = state.step(&cfg, &mut p, &[1.0; 2]).unwrap_err();
    assert!(
        matches!(e, FsdpError::OptimizerLength { what: "grad", .. }),
        "{e:?}"
    );
    // Parameter of another length than the state.
    let mut long = vec![bf16::from_f32(1.0); 4];
    let e = state.step(&cfg, &mut long, &[1.0; 4]).unwrap_err();
    assert!(
        matches!(
            e,
            FsdpError::OptimizerLength {
                what: "exp_avg",
                ..
            }
        ),
        "{e:?}"
    );
    // A bad hyperparameter.
    let bad = AnyPrecisionAdamWConfig { lr: -1.0, ..cfg };
    assert!(state.step(&bad, &mut p, &[1.0; 3]).is_err());
    // A config whose dtypes are not the state's.
    let f32_m = AnyPrecisionAdamWConfig {
        momentum_dtype: DType::F32,
        ..cfg
    };
    let e = state.step(&f32_m, &mut p, &[1.0; 3]).unwrap_err();
    assert!(
        matches!(
            e,
            FsdpError::InvalidHyperparameter {
                name: "momentum_dtype",
                ..
            }
        ),
        "{e:?}"
    );
    // Kahan summation asked of a state made without a compensation buffer.
    let plain = AnyPrecisionAdamWConfig {
        use_kahan_summation: false,
        ..cfg
    };
    let mut plain_state = AnyPrecisionAdamWState::try_new(&plain, 3).unwrap();
    let e = plain_state.step(&cfg, &mut p, &[1.0; 3]).unwrap_err();
    assert!(
        matches!(
            e,
            FsdpError::InvalidHyperparameter {
                name: "use_kahan_summation",
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(state, before);
    assert_eq!(p, vec![bf16::from_f32(1.0); 3]);

    // A Kahan state stepped without Kahan summation leaves its compensation alone.
    state.step(&plain, &mut p, &[1.0; 3]).unwrap();
    assert_eq!(state.compensation, before.compensation);
}

#[test]
fn optimizer_state_and_config_must_match() {
    let any = OptimizerConfig::from(AnyPrecisionAdamWConfig::default());
    let adamw = OptimizerConfig::from(AdamWConfig::default());
    let sgd = OptimizerConfig::from(SgdConfig::with_momentum(0.1, 0.9));
    let groups = [ParamGroupOptions::default()];
    let seg = ShardGroups::single(2);
    let mut p16 = vec![bf16::from_f32(1.0); 2];
    let g = [1.0f32; 2];
    // AdamW and SGD cannot step bf16 parameters.
    for cfg in [adamw, sgd] {
        let mut st = OptimizerState::try_new(&cfg, 2).unwrap();
        let e = st
            .step_grouped_bf16(&cfg, 0.1, &groups, &seg, &mut p16, &g)
            .unwrap_err();
        assert!(
            matches!(
                e,
                FsdpError::InvalidHyperparameter {
                    name: "optimizer",
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(st.steps(), 0);
    }
    // A state of another optimizer.
    let mut st = OptimizerState::try_new(&adamw, 2).unwrap();
    assert!(st
        .step_grouped_bf16(&any, 0.1, &groups, &seg, &mut p16, &g)
        .is_err());
    let mut st = OptimizerState::try_new(&any, 2).unwrap();
    assert!(st.step(&adamw, &mut [1.0f32; 2], &g).is_err());
    assert!(st
        .step_grouped(&sgd, 0.1, &groups, &seg, &mut [1.0f32; 2], &g)
        .is_err());
    // Group errors are checked before anything changes.
    let bad_groups = [ParamGroupOptions {
        weight_decay: None,
        lr_scale: -1.0,
    }];
    assert!(st
        .step_grouped_bf16(&any, 0.1, &bad_groups, &seg, &mut p16, &g)
        .is_err());
    assert!(st
        .step_grouped_bf16(&any, 0.1, &groups, &ShardGroups::single(3), &mut p16, &g)
        .is_err());
    assert!(st
        .step_grouped_bf16(&any, -0.1, &groups, &seg, &mut p16, &g)
        .is_err());
    assert_eq!(st.steps(), 0);
    assert_eq!(p16, vec![bf16::from_f32(1.0); 2]);
    assert_eq!(st, OptimizerState::try_new(&any, 2).unwrap());
}

#[test]
fn huge_state_is_an_error_not_an_abort() {
    let cfg = AnyPrecisionAdamWConfig::default();
    let e = AnyPrecisionAdamWState::try_new(&cfg, usize::MAX / 4).unwrap_err();
    assert!(matches!(e, FsdpError::HostOutOfMemory { .. }), "{e:?}");
    let e = OptimizerState::try_new(&cfg.into(), usize::MAX / 4).unwrap_err();
    assert!(matches!(e, FsdpError::HostOutOfMemory { .. }), "{e:?}");
}
