//! AdamW and SGD against hand-computed steps of PyTorch's formulas, shard invariance, errors.

use fsdp::optim::{adamw_step, sgd_step, AdamWConfig, AdamWState, SgdConfig};
use fsdp::FsdpError;

fn close(a: f32, b: f64, tol: f64) -> bool {
    (f64::from(a) - b).abs() <= tol * b.abs().max(1e-30)
}

#[test]
fn adamw_matches_hand_computed_steps() {
    // torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1) on a
    // single weight 1.0 with gradients 0.5, -0.25, 0.125. By hand (f64):
    //   step 1: p = 1·0.99 = 0.99; m = 0.05; v = 0.001·0.25 = 2.5e-4;
    //           p −= (0.1/0.1)·0.05 / (√2.5e-4/√0.001 + 1e-8) = 0.1  →  0.890000002
    //   step 2: p = 0.8811; m = 0.02; v = 3.1225e-4;
    //           p −= (0.1/0.19)·0.02 / (√3.1225e-4/√0.001999 + 1e-8)  →  0.85446629868...
    //   step 3: p −= ...                                                →  0.81187872190...
    let cfg = AdamWConfig {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let want = [
        (0.890_000_002, 0.05, 2.5e-4),
        (0.854_466_298_687_846_3, 0.02, 3.1225e-4),
        (0.811_878_721_909_775_6, 0.0305, 3.275_627_5e-4),
    ];
    let mut p = [1.0f32];
    let mut m = [0.0f32];
    let mut v = [0.0f32];
    for (step, (g, (wp, wm, wv))) in [0.5f32, -0.25, 0.125].iter().zip(want).enumerate() {
        adamw_step(&cfg, step as u64 + 1, &mut p, &[*g], &mut m, &mut v).unwrap();
        assert!(
            close(p[0], wp, 1e-6),
            "step {}: p {} want {wp}",
            step + 1,
            p[0]
        );
        assert!(
            close(m[0], wm, 1e-6),
            "step {}: m {} want {wm}",
            step + 1,
            m[0]
        );
        assert!(
            close(v[0], wv, 1e-5),
            "step {}: v {} want {wv}",
            step + 1,
            v[0]
        );
    }
}

#[test]
fn adamw_first_step_moves_by_lr_and_decays() {
    // With one gradient the bias-corrected update is ±lr (up to eps), whatever its size; weight
    // decay applies even where the gradient is zero.
    let cfg = AdamWConfig {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut p = vec![0.5f32, -0.5, 2.0];
    let g = [3.0f32, -1e-3, 0.0];
    let mut st = AdamWState::new(3);
    st.step(&cfg, &mut p, &g).unwrap();
    assert_eq!(st.step, 1);
    let decay = 1.0 - 1e-3 * 0.1;
    assert!(close(p[0], 0.5 * decay - 1e-3, 1e-6), "{}", p[0]);
    assert!(close(p[1], -0.5 * decay + 1e-3, 1e-5), "{}", p[1]);
    assert!(close(p[2], 2.0 * decay, 1e-7), "{}", p[2]);
}

#[test]
fn adamw_on_shards_equals_adamw_on_the_whole() {
    let cfg = AdamWConfig {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let n = 37;
    let p0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let grads: Vec<Vec<f32>> = (0..4)
        .map(|s| (0..n).map(|i| ((i * 7 + s) as f32 * 0.11).cos()).collect())
        .collect();
    let mut whole = p0.clone();
    let mut st = AdamWState::new(n);
    for g in &grads {
        st.step(&cfg, &mut whole, g).unwrap();
    }
    // Uneven shards, each with its own state.
    let cuts = [0, 10, 11, 30, n];
    let mut sharded = p0.clone();
    for w in cuts.windows(2) {
        let (a, b) = (w[0], w[1]);
        let mut st = AdamWState::new(b - a);
        for g in &grads {
            st.step(&cfg, &mut sharded[a..b], &g[a..b]).unwrap();
        }
    }
    assert_eq!(whole, sharded, "element-wise: bitwise equal");
}

#[test]
fn sgd_momentum_matches_torch_formula() {
    // torch.optim.SGD([p], lr=0.1, momentum=0.9): buf = g on the first step, then
    // buf = 0.9·buf + g; p −= 0.1·buf.  p: 1 → 0.95 → 0.93 → 0.8995.
    let cfg = SgdConfig::with_momentum(0.1, 0.9);
    let mut p = [1.0f32];
    let mut buf = [123.0f32]; // ignored on the first step
    let want = [(0.95, 0.5), (0.93, 0.2), (0.8995, 0.305)];
    for (step, (g, (wp, wb))) in [0.5f32, -0.25, 0.125].iter().zip(want).enumerate() {
        sgd_step(&cfg, step as u64 + 1, &mut p, &[*g], &mut buf).unwrap();
        assert!(close(p[0], wp, 1e-6), "step {}: p {}", step + 1, p[0]);
        assert!(close(buf[0], wb, 1e-6), "step {}: buf {}", step + 1, buf[0]);
    }
}

#[test]
fn sgd_options_follow_torch() {
    // Plain SGD with weight decay: p −= lr·(g + wd·p); the buffer is not touched.
    let cfg = SgdConfig {
        lr: 0.5,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.1,
        nesterov: false,
    };
    let mut p = [2.0f32];
    sgd_step(&cfg, 1, &mut p, &[1.0], &mut []).unwrap();
    assert!(close(p[0], 2.0 - 0.5 * (1.0 + 0.2), 1e-7));

    // Dampening applies from the second step: buf = m·buf + (1 − d)·g.
    let cfg = SgdConfig {
        lr: 1.0,
        momentum: 0.5,
        dampening: 0.25,
        weight_decay: 0.0,
        nesterov: false,
    };
    let (mut p, mut b) = ([0.0f32], [0.0f32]);
    sgd_step(&cfg, 1, &mut p, &[1.0], &mut b).unwrap();
    assert_eq!((p[0], b[0]), (-1.0, 1.0));
    sgd_step(&cfg, 2, &mut p, &[1.0], &mut b).unwrap();
    assert_eq!((p[0], b[0]), (-2.25, 1.25));

    // Nesterov: update = g + m·buf.
    let cfg = SgdConfig {
        lr: 1.0,
        momentum: 0.5,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: true,
    };
    let (mut p, mut b) = ([0.0f32], [0.0f32]);
    sgd_step(&cfg, 1, &mut p, &[1.0], &mut b).unwrap();
    assert_eq!((p[0], b[0]), (-1.5, 1.0));
    sgd_step(&cfg, 2, &mut p, &[1.0], &mut b).unwrap();
    assert_eq!((p[0], b[0]), (-1.5 - 1.75, 1.5));
}

#[test]
fn optimizer_errors_change_nothing() {
    let cfg = AdamWConfig::default();
    let mut p = [1.0f32, 2.0];
    let (mut m, mut v) = ([0.0f32; 2], [0.0f32; 2]);
    let err = adamw_step(&cfg, 1, &mut p, &[1.0], &mut m, &mut v).unwrap_err();
    assert!(matches!(
        err,
        FsdpError::OptimizerLength {
            what: "grad",
            expected: 2,
            actual: 1
        }
    ));
    assert!(matches!(
        adamw_step(&cfg, 1, &mut p, &[1.0, 1.0], &mut m, &mut [0.0]),
        Err(FsdpError::OptimizerLength {
            what: "exp_avg_sq",
            ..
        })
    ));
    assert!(matches!(
        adamw_step(&cfg, 0, &mut p, &[1.0, 1.0], &mut m, &mut v),
        Err(FsdpError::InvalidHyperparameter { name: "step", .. })
    ));
    let bad = AdamWConfig {
        beta2: 1.0,
        ..AdamWConfig::default()
    };
    let err = adamw_step(&bad, 1, &mut p, &[1.0, 1.0], &mut m, &mut v).unwrap_err();
    assert!(err.to_string().contains("beta2"), "{err}");
    let bad = AdamWConfig {
        lr: f64::NAN,
        ..AdamWConfig::default()
    };
    assert!(adamw_step(&bad, 1, &mut p, &[1.0, 1.0], &mut m, &mut v).is_err());
    assert_eq!((p, m, v), ([1.0, 2.0], [0.0; 2], [0.0; 2]));

    let mut st = AdamWState::new(3);
    assert!(st.step(&cfg, &mut p, &[1.0, 1.0]).is_err());
    assert_eq!(st.step, 0);

    let sgd = SgdConfig::with_momentum(0.1, 0.9);
    assert!(matches!(
        sgd_step(&sgd, 1, &mut p, &[1.0, 1.0], &mut [0.0]),
        Err(FsdpError::OptimizerLength {
            what: "momentum_buffer",
            ..
        })
    ));
    let nesterov_bad = SgdConfig {
        nesterov: true,
        dampening: 0.5,
        ..sgd
    };
    assert!(sgd_step(&nesterov_bad, 1, &mut p, &[1.0, 1.0], &mut [0.0; 2]).is_err());
    assert_eq!(p, [1.0, 2.0]);
}

#[test]
fn non_finite_hyperparameters_are_errors_huge_finite_ones_are_not() {
    let adamw = AdamWConfig::default();
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        for (name, cfg) in [
            ("lr", AdamWConfig { lr: bad, ..adamw }),
            (
                "beta1",
                AdamWConfig {
                    beta1: bad,
                    ..adamw
                },
            ),
            (
                "beta2",
                AdamWConfig {
                    beta2: bad,
                    ..adamw
                },
            ),
            ("eps", AdamWConfig { eps: bad, ..adamw }),
            (
                "weight_decay",
                AdamWConfig {
                    weight_decay: bad,
                    ..adamw
                },
            ),
        ] {
            let err = cfg.validate().unwrap_err();
            assert!(
                matches!(err, FsdpError::InvalidHyperparameter { name: n, .. } if n == name),
                "AdamW {name} = {bad}: {err:?}"
            );
        }
        let sgd = SgdConfig::with_momentum(0.1, 0.9);
        for (name, cfg) in [
            ("lr", SgdConfig { lr: bad, ..sgd }),
            (
                "momentum",
                SgdConfig {
                    momentum: bad,
                    ..sgd
                },
            ),
            (
                "weight_decay",
                SgdConfig {
                    weight_decay: bad,
                    ..sgd
                },
            ),
            (
                "dampening",
                SgdConfig {
                    dampening: bad,
                    ..sgd
                },
            ),
        ] {
            let err = cfg.validate().unwrap_err();
            assert!(
                matches!(err, FsdpError::InvalidHyperparameter { name: n, .. } if n == name),
                "SGD {name} = {bad}: {err:?}"
            );
        }
    }
    // `lr = inf`: the message says why.
    let err = AdamWConfig {
        lr: f64::INFINITY,
        ..adamw
    }
    .validate()
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid optimizer setting lr = inf: must be a finite number ≥ 0"
    );
    // Huge but finite settings are valid (their steps may overflow: the trainer checks the
    // loss and the gradient norm at run time).
    let huge = AdamWConfig {
        lr: 1e30,
        eps: 1e300,
        weight_decay: 1e30,
        ..adamw
    };
    huge.validate().unwrap();
    SgdConfig {
        lr: 1e300,
        momentum: 1e30,
        dampening: -1e30,
        ..SgdConfig::with_momentum(0.1, 0.9)
    }
    .validate()
    .unwrap();
}

/// The fallible constructors of the optimizer state: a size no allocation can hold is an
/// error naming the buffer and the bytes asked, not an abort.
#[test]
fn optimizer_state_too_large_to_allocate_is_an_error() {
    use fsdp::optim::{OptimizerConfig, OptimizerState};
    let huge = 1usize << 61; // 2^63 bytes of f32: beyond any allocation
    let e = AdamWState::try_new(huge).unwrap_err();
    assert!(
        matches!(&e, FsdpError::HostOutOfMemory { bytes, what }
            if *bytes == 1 << 63 && what.contains("AdamW")),
        "{e}"
    );
    assert!(e.to_string().contains("9223372036854775808 bytes"), "{e}");
    let sgd = OptimizerConfig::from(SgdConfig::with_momentum(0.1, 0.9));
    let e = OptimizerState::try_new(&sgd, huge).unwrap_err();
    assert!(e.to_string().contains("momentum"), "{e}");
    // Without momentum SGD keeps no buffer: nothing to allocate.
    let plain = OptimizerConfig::from(SgdConfig::with_momentum(0.1, 0.0));
    assert!(OptimizerState::try_new(&plain, huge).is_ok());
    // Sizes that fit are the zero state of `new`.
    assert_eq!(AdamWState::try_new(5).unwrap(), AdamWState::new(5));
    let adamw = OptimizerConfig::from(AdamWConfig::default());
    assert_eq!(
        OptimizerState::try_new(&adamw, 3).unwrap(),
        OptimizerState::new(&adamw, 3)
    );
}
