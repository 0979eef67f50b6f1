//! The end of a training step decided on the GPU against the host twins, bitwise: the loss
//! (`loss_accumulate`), the decision (`step_decide`: norm, clipping, non-finite steps, the halt,
//! the AdamW scalar set, the step count, the bookkeeping fault) and AdamW as decided
//! (`adamw_decided_f32`) and `AnyPrecisionAdamW` as decided (`anyprecision_decided_*`), with a
//! grad scaler's decisions and unscaling; the multi-tensor launches (`sum_of_squares_many`,
//! `adamw_decided_many`) bitwise each tensor's twin; and `CudaOps::copy_scalars`, whose values
//! are those at the copy, not
//! those of work enqueued after it. Without a GPU each test prints `skipped: no GPU (<reason>)`
//! and passes.

mod common;

use common::{data, down, gpu, gpu_stream, up};
use fsdp_device::DType;
use fsdp_device::Stream;
use fsdp_kernels::gpt::{CudaOps, GptOps};
use fsdp_kernels::host::{
    self, pack_state, state_len, step_scalars_len, AdamW, AdamWChoice, AdamWScalars, AnyPrecision,
    AnyPrecisionChoice, AnyPrecisionScalars, ScalerRule, StepRule, STEP_LOSS, STEP_SQUARES,
};
use fsdp_kernels::launch;

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn loss_accumulate_equals_its_twin() {
    let Some(s) = gpu_stream("loss_accumulate_equals_its_twin") else {
        return;
    };
    let mut want = vec![0.0f64; step_scalars_len(0)];
    let mut got = up(&s, &want);
    for (m, n) in [1usize, 255, 256, 257, 8192, 100_003]
        .into_iter()
        .enumerate()
    {
        let losses: Vec<f32> = data(n, 90 + m as u64, 1.0)
            .iter()
            .map(|x| x.abs() * 11.0)
            .collect();
        let (accum, first) = (3, m % 3 == 0);
        host::loss_accumulate(&losses, accum, first, &mut want).unwrap();
        launch::loss_accumulate(&s, &up(&s, &losses), accum, first, &mut got).unwrap();
        assert_eq!(bits(&down(&s, &got)), bits(&want), "{n} losses");
    }
}

/// Squares, loss, max_norm, skip limit, base.
type Case = (f64, f64, Option<f64>, Option<u64>, u64);

#[test]
fn step_decide_equals_its_twin() {
    let Some(s) = gpu_stream("step_decide_equals_its_twin") else {
        return;
    };
    let tensors = 5;
    // (squares, loss, max_norm, skip limit, base) over a run: clipped, unclipped, a NaN loss,
    // an infinite norm, past the skip limit (halts), a base the count is not within (fault).
    let cases: [Case; 7] = [
        (4.0, 2.5, Some(1.0), Some(1), 0),
        (0.01, 2.4, Some(1.0), Some(1), 1),
        (0.02, f64::NAN, Some(1.0), Some(1), 2),
        (0.03, 2.3, None, Some(1), 1),
        (f64::INFINITY, 2.3, Some(1.0), Some(1), 3),
        (0.04, 2.2, None, Some(1), 3),
        (0.05, 2.1, None, None, 7),
    ];
    // Without a grad scaler; with one at a power-of-two scale, growing every 2 steps; with
    // one at a scale that is not a power of two, growing every step (the growth past f32's
    // range is not applied).
    let scaler = |interval| ScalerRule {
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: interval,
    };
    for (rule_scaler, start) in [
        (None, None),
        (Some(scaler(2)), Some((65536.0f32, 0, 0))),
        (Some(scaler(1)), Some((1000.0f32, 0, 3))),
        (Some(scaler(1)), Some((f32::MAX / 1.5, 0, 0))),
    ] {
        // The previous decision: its persistent slots (count, non-finite steps, halt, the
        // scaler's) carry on.
        let mut state = host::step_scalars(tensors, start);
        for (k, (sq, loss, max_norm, skip, base)) in cases.into_iter().enumerate() {
            state[STEP_LOSS] = loss;
            for i in 0..tensors {
                state[STEP_SQUARES + i] = sq * (i + 1) as f64 / 3.0;
            }
            let mut got = up(&s, &state);
            let mut want = state.clone();
            let rule = StepRule {
                tensors,
                max_norm,
                skip_nonfinite: skip,
                base_steps: base,
                scaler: rule_scaler,
            };
            host::step_decide(&rule, &mut want).unwrap();
            launch::step_decide(&s, &rule, &mut got).unwrap();
            let what = format!("{rule_scaler:?} case {k}: {want:?}");
            assert_eq!(bits(&down(&s, &got)), bits(&want), "{what}");
            state = want;
        }
    }
}

/// `AnyPrecisionAdamW` as decided, every kind (parameters f32 or bf16, state f32 or packed
/// bf16, Kahan on and off) over applied, clipped and skipped steps: bitwise its twin.
#[test]
fn anyprecision_decided_equals_its_twin() {
    let Some(s) = gpu_stream("anyprecision_decided_equals_its_twin") else {
        return;
    };
    let n = 100_003;
    let cfg = |lr: f64| AdamW {
        lr,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let choice = AnyPrecisionChoice([
        AnyPrecisionScalars::new(&cfg(1e-3), 3).unwrap(),
        AnyPrecisionScalars::new(
            &AdamW {
                weight_decay: 0.0,
                ..cfg(9e-4)
            },
            4,
        )
        .unwrap(),
    ]);
    for param in [DType::F32, DType::BF16] {
        for state in [DType::F32, DType::BF16] {
            for kahan in [false, true] {
                let kind = AnyPrecision {
                    param,
                    state,
                    kahan,
                };
                let round = |x: f32| match param {
                    DType::BF16 => half::bf16::from_f32(x).to_f32(),
                    _ => x,
                };
                let mut p: Vec<f32> = data(n, 1, 0.5).into_iter().map(round).collect();
                let sn = state_len(n, state);
                let pack = |v: Vec<f32>| pack_state(&v[..n.min(v.len())], state);
                let mut m = pack(data(n, 2, 0.01));
                let mut v = pack(data(n, 3, 0.001).iter().map(|x| x.abs()).collect());
                let mut c = pack(data(n, 4, 1e-4));
                assert_eq!(m.len(), sn);
                let (mut dp, mut dm, mut dv, mut dc) =
                    (up(&s, &p), up(&s, &m), up(&s, &v), up(&s, &c));
                for (k, (applied, pick, clipped, coef, unscale)) in [
                    (1.0, 0.0, 0.0, 1.0, 0.0),
                    (1.0, 1.0, 1.0, 0.37f32 as f64, 0.0),
                    (0.0, 1.0, 1.0, 0.5, 0.0),
                    (1.0, 1.0, 0.0, 1.0, 0.0),
                    (1.0, 0.0, 1.0, 0.37f32 as f64, 2f64.powi(-16)),
                    (1.0, 1.0, 0.0, 1.0, f64::from(1.0f32 / 1000.0)),
                ]
                .into_iter()
                .enumerate()
                {
                    let g = data(n, 10 + k as u64, 2.0);
                    let mut sc = vec![0.0f64; step_scalars_len(0)];
                    sc[host::STEP_APPLIED] = applied;
                    sc[host::STEP_CHOICE] = pick;
                    sc[host::STEP_CLIPPED] = clipped;
                    sc[host::STEP_CLIP_COEF] = coef;
                    sc[host::STEP_UNSCALE] = unscale;
                    host::anyprecision_decided(
                        &choice,
                        kind,
                        &sc,
                        &mut p,
                        &g,
                        &mut m,
                        &mut v,
                        Some(&mut c),
                    )
                    .unwrap();
                    let (dg, ds) = (up(&s, &g), up(&s, &sc));
                    launch::anyprecision_decided(
                        &s,
                        &choice,
                        kind,
                        &ds,
                        &mut dp,
                        &dg,
                        &mut dm,
                        &mut dv,
                        Some(&mut dc),
                    )
                    .unwrap();
                    for (what, d, h) in [
                        ("param", &dp, &p),
                        ("exp_avg", &dm, &m),
                        ("exp_avg_sq", &dv, &v),
                        ("compensation", &dc, &c),
                    ] {
                        let d = down(&s, d);
                        let same = d
                            .iter()
                            .zip(h.iter())
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{kind:?} case {k}: {what} differs from its twin");
                    }
                }
            }
        }
    }
}

#[test]
fn adamw_decided_equals_its_twin() {
    let Some(s) = gpu_stream("adamw_decided_equals_its_twin") else {
        return;
    };
    let n = 100_003;
    let cfg = |lr: f64| AdamW {
        lr,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let choice = AdamWChoice([
        AdamWScalars::new(&cfg(1e-3), 3).unwrap(),
        AdamWScalars::new(&cfg(9e-4), 4).unwrap(),
    ]);
    let mut p = data(n, 1, 0.5);
    let mut m = data(n, 2, 0.01);
    let mut v: Vec<f32> = data(n, 3, 0.001).iter().map(|x| x.abs()).collect();
    let (mut dp, mut dm, mut dv) = (up(&s, &p), up(&s, &m), up(&s, &v));
    // (applied, choice, clipped, coefficient, a grad scaler's unscaling or 0)
    for (k, (applied, pick, clipped, coef, unscale)) in [
        (1.0, 0.0, 0.0, 1.0, 0.0),
        (1.0, 1.0, 1.0, 0.37f32 as f64, 0.0),
        (0.0, 1.0, 1.0, 0.5, 0.0),
        (1.0, 1.0, 0.0, 1.0, 0.0),
        (1.0, 0.0, 1.0, 0.37f32 as f64, 2f64.powi(-16)),
        (1.0, 1.0, 0.0, 1.0, f64::from(1.0f32 / 1000.0)),
    ]
    .into_iter()
    .enumerate()
    {
        let g = data(n, 10 + k as u64, 2.0);
        let mut sc = vec![0.0f64; step_scalars_len(0)];
        sc[host::STEP_APPLIED] = applied;
        sc[host::STEP_CHOICE] = pick;
        sc[host::STEP_CLIPPED] = clipped;
        sc[host::STEP_CLIP_COEF] = coef;
        sc[host::STEP_UNSCALE] = unscale;
        host::adamw_decided(&choice, &sc, &mut p, &g, &mut m, &mut v).unwrap();
        let (dg, ds) = (up(&s, &g), up(&s, &sc));
        launch::adamw_decided(&s, &choice, &ds, &mut dp, &dg, &mut dm, &mut dv).unwrap();
        for (what, d, h) in [
            ("param", &dp, &p),
            ("exp_avg", &dm, &m),
            ("exp_avg_sq", &dv, &v),
        ] {
            let d = down(&s, d);
            let same = d
                .iter()
                .zip(h.iter())
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "case {k}: {what} differs from its twin");
        }
    }
}

/// A copy's values are those at the point it was enqueued: a step enqueued after it changes
/// the scalars on the device, not the copy.
#[test]
fn copy_scalars_reads_the_point_of_the_copy() {
    if !gpu("copy_scalars_reads_the_point_of_the_copy") {
        return;
    }
    let ops = CudaOps::new(Stream::cuda(0, "copy_scalars").unwrap()).unwrap();
    let mut sc = ops.scalars(&[0.0; step_scalars_len(1)]).unwrap();
    let losses = ops.upload(&[2.0, 4.0]).unwrap();
    ops.loss_accumulate(&losses, 1, true, &mut sc).unwrap();
    let first = ops.copy_scalars(&sc).unwrap();
    // Work after the copy: a large product keeps the device busy, then the loss changes.
    let big = ops.upload(&data(1 << 22, 5, 1.0)).unwrap();
    let mut out = ops.zeros(1).unwrap();
    for _ in 0..50 {
        let mut slots = ops.scalars(&[0.0; step_scalars_len(1)]).unwrap();
        ops.sum_of_squares_at(&big, &mut slots, STEP_SQUARES)
            .unwrap();
        ops.fill_zero(&mut out).unwrap();
    }
    ops.loss_accumulate(&losses, 2, false, &mut sc).unwrap();
    let second = ops.copy_scalars(&sc).unwrap();
    assert_eq!(ops.wait_scalars(first).unwrap()[STEP_LOSS], 3.0);
    assert_eq!(ops.wait_scalars(second).unwrap()[STEP_LOSS], 4.5);
    // The page-locked buffers are reused: a third copy works the same.
    let third = ops.copy_scalars(&sc).unwrap();
    assert_eq!(ops.wait_scalars(third).unwrap()[STEP_LOSS], 4.5);
}

/// CPU offload's staging memory: a copy out holds the values at the copy while later work
/// changes the buffer; a copy in lands before the work enqueued after it; lengths are checked.
#[test]
fn staging_copies_keep_stream_order() {
    if !gpu("staging_copies_keep_stream_order") {
        return;
    }
    let ops = CudaOps::new(Stream::cuda(0, "staging").unwrap()).unwrap();
    let n = 1 << 20;
    let (x, y) = (data(n, 21, 1.0), data(n, 22, 1.0));
    let mut a = ops.upload(&x).unwrap();
    let mut st = ops.staging(n).unwrap();
    ops.copy_out(&a, &mut st).unwrap();
    ops.fill_zero(&mut a).unwrap();
    assert!(ops.staged(&st).unwrap() == x.as_slice(), "the copy out");
    ops.staged_mut(&mut st).unwrap().copy_from_slice(&y);
    ops.copy_in(&mut st, &mut a).unwrap();
    let mut b = ops.zeros(n).unwrap();
    ops.axpby(2.0, &a, 0.0, &mut b).unwrap();
    let want: Vec<f32> = y.iter().map(|v| 2.0 * v + 0.0).collect();
    assert!(
        ops.download(&b).unwrap() == want,
        "the copy in, then the work after it"
    );
    let short = ops.zeros(3).unwrap();
    assert!(ops.copy_out(&short, &mut st).is_err());
}

/// Lengths of the multi-tensor tests' tensors: one element, around a block's chunk of the
/// sum of squares (4096), and larger, `count` of them.
fn many_lens(count: usize) -> Vec<usize> {
    let edges = [1usize, 2, 4095, 4096, 4097, 70_001, 300_000];
    (0..count)
        .map(|i| edges[i % edges.len()] + (i * 37) % 11)
        .collect()
}

/// The sums of squares of 200 tensors (three launches of at most 96) into consecutive slots:
/// bitwise each tensor's twin, the slots around them untouched.
#[test]
fn sum_of_squares_many_equals_its_twin() {
    let Some(s) = gpu_stream("sum_of_squares_many_equals_its_twin") else {
        return;
    };
    let lens = many_lens(200);
    let xs: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| data(n, 100 + i as u64, 3.0))
        .collect();
    let dx: Vec<_> = xs.iter().map(|x| up(&s, x)).collect();
    let refs: Vec<_> = dx.iter().collect();
    let first = 3;
    let mut sc = up(&s, &vec![-7.0f64; first + lens.len() + 2]);
    launch::sum_of_squares_many(&s, &refs, &mut sc, first).unwrap();
    let got = down(&s, &sc);
    for (i, x) in xs.iter().enumerate() {
        let want = host::sum_of_squares(x);
        assert_eq!(
            got[first + i].to_bits(),
            want.to_bits(),
            "tensor {i} ({})",
            x.len()
        );
    }
    assert!(got[..first]
        .iter()
        .chain(&got[first + lens.len()..])
        .all(|&v| v == -7.0));
    // Slots past the buffer are refused.
    assert!(launch::sum_of_squares_many(&s, &refs, &mut sc, 4).is_err());
}

/// AdamW as decided on 150 tensors (three launches of at most 64), every other one with
/// weight decay, over applied, clipped, unscaled and skipped steps: bitwise the twin of each.
#[test]
fn adamw_decided_many_equals_its_twin() {
    let Some(s) = gpu_stream("adamw_decided_many_equals_its_twin") else {
        return;
    };
    let cfg = |lr: f64, wd: f64| AdamW {
        lr,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: wd,
    };
    let choices = [
        AdamWChoice([
            AdamWScalars::new(&cfg(1e-3, 0.0), 3).unwrap(),
            AdamWScalars::new(&cfg(9e-4, 0.0), 4).unwrap(),
        ]),
        AdamWChoice([
            AdamWScalars::new(&cfg(1e-3, 0.1), 3).unwrap(),
            AdamWScalars::new(&cfg(9e-4, 0.1), 4).unwrap(),
        ]),
    ];
    let lens = many_lens(150);
    let seeded = |i: usize, k: u64, scale: f32| data(lens[i], 1000 * k + i as u64, scale);
    let mut host_state: Vec<_> = (0..lens.len())
        .map(|i| {
            let v: Vec<f32> = seeded(i, 3, 0.001).iter().map(|x| x.abs()).collect();
            (seeded(i, 1, 0.5), seeded(i, 2, 0.01), v)
        })
        .collect();
    let mut dev: Vec<_> = host_state
        .iter()
        .map(|(p, m, v)| (up(&s, p), up(&s, m), up(&s, v)))
        .collect();
    // (applied, choice, clipped, coefficient, unscaling)
    for (k, (applied, pick, clipped, coef, unscale)) in [
        (1.0, 0.0, 0.0, 1.0, 0.0),
        (1.0, 1.0, 1.0, 0.37f32 as f64, 0.0),
        (0.0, 1.0, 1.0, 0.5, 0.0),
        (1.0, 0.0, 1.0, 0.37f32 as f64, f64::from(1.0f32 / 1000.0)),
    ]
    .into_iter()
    .enumerate()
    {
        let mut sc = vec![0.0f64; step_scalars_len(0)];
        sc[host::STEP_APPLIED] = applied;
        sc[host::STEP_CHOICE] = pick;
        sc[host::STEP_CLIPPED] = clipped;
        sc[host::STEP_CLIP_COEF] = coef;
        sc[host::STEP_UNSCALE] = unscale;
        let grads: Vec<Vec<f32>> = (0..lens.len())
            .map(|i| seeded(i, 10 + k as u64, 2.0))
            .collect();
        for (i, (p, m, v)) in host_state.iter_mut().enumerate() {
            host::adamw_decided(&choices[i % 2], &sc, p, &grads[i], m, v).unwrap();
        }
        let dg: Vec<_> = grads.iter().map(|g| up(&s, g)).collect();
        let ds = up(&s, &sc);
        let mut list: Vec<launch::AdamWTensor<'_>> = dev
            .iter_mut()
            .zip(&dg)
            .enumerate()
            .map(|(i, ((p, m, v), g))| launch::AdamWTensor {
                param: p,
                grad: g,
                exp_avg: m,
                exp_avg_sq: v,
                compensation: None,
                decay: i % 2 == 1,
            })
            .collect();
        launch::adamw_decided_many(&s, &choices, &ds, &mut list).unwrap();
        for (i, ((p, m, v), (hp, hm, hv))) in dev.iter().zip(&host_state).enumerate() {
            for (what, d, h) in [("param", p, hp), ("exp_avg", m, hm), ("exp_avg_sq", v, hv)] {
                let same = down(&s, d)
                    .iter()
                    .zip(h.iter())
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "case {k}, tensor {i} ({}): {what} differs", lens[i]);
            }
        }
    }
}

/// `AnyPrecisionAdamW` as decided on 100 tensors (three launches of at most 48), every kind
/// (parameters f32 or bf16, state f32 or packed bf16, Kahan on and off), every other tensor
/// with weight decay, over applied, clipped, unscaled and skipped steps: bitwise the twin of
/// each.
#[test]
fn anyprecision_decided_many_equals_its_twin() {
    let Some(s) = gpu_stream("anyprecision_decided_many_equals_its_twin") else {
        return;
    };
    let cfg = |lr: f64, wd: f64| AdamW {
        lr,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: wd,
    };
    let set = |wd| {
        AnyPrecisionChoice([
            AnyPrecisionScalars::new(&cfg(1e-3, wd), 3).unwrap(),
            AnyPrecisionScalars::new(&cfg(9e-4, wd), 4).unwrap(),
        ])
    };
    let choices = [set(0.0), set(0.1)];
    let lens = many_lens(100);
    let seeded = |i: usize, k: u64, scale: f32| data(lens[i], 1000 * k + i as u64, scale);
    for param in [DType::F32, DType::BF16] {
        for state in [DType::F32, DType::BF16] {
            for kahan in [false, true] {
                let kind = AnyPrecision {
                    param,
                    state,
                    kahan,
                };
                let round = |x: f32| match param {
                    DType::BF16 => half::bf16::from_f32(x).to_f32(),
                    _ => x,
                };
                let pack = |v: Vec<f32>| pack_state(&v, state);
                let mut host: Vec<_> = (0..lens.len())
                    .map(|i| {
                        let v = seeded(i, 3, 0.001).iter().map(|x| x.abs()).collect();
                        (
                            seeded(i, 1, 0.5).into_iter().map(round).collect::<Vec<_>>(),
                            pack(seeded(i, 2, 0.01)),
                            pack(v),
                            pack(seeded(i, 4, 1e-4)),
                        )
                    })
                    .collect();
                let mut dev: Vec<_> = host
                    .iter()
                    .map(|(p, m, v, c)| (up(&s, p), up(&s, m), up(&s, v), up(&s, c)))
                    .collect();
                for (k, (applied, clipped, unscale)) in [
                    (1.0, 0.0, 0.0),
                    (1.0, 1.0, f64::from(1.0f32 / 1000.0)),
                    (0.0, 1.0, 0.0),
                ]
                .into_iter()
                .enumerate()
                {
                    let mut sc = vec![0.0f64; step_scalars_len(0)];
                    sc[host::STEP_APPLIED] = applied;
                    sc[host::STEP_CHOICE] = 1.0;
                    sc[host::STEP_CLIPPED] = clipped;
                    sc[host::STEP_CLIP_COEF] = 0.37f32 as f64;
                    sc[host::STEP_UNSCALE] = unscale;
                    let grads: Vec<Vec<f32>> = (0..lens.len())
                        .map(|i| seeded(i, 10 + k as u64, 2.0))
                        .collect();
                    for (i, (p, m, v, c)) in host.iter_mut().enumerate() {
                        let comp = Some(&mut c[..]);
                        let ch = &choices[i % 2];
                        host::anyprecision_decided(ch, kind, &sc, p, &grads[i], m, v, comp)
                            .unwrap();
                    }
                    let dg: Vec<_> = grads.iter().map(|g| up(&s, g)).collect();
                    let ds = up(&s, &sc);
                    let mut list: Vec<launch::AdamWTensor<'_>> = dev
                        .iter_mut()
                        .zip(&dg)
                        .enumerate()
                        .map(|(i, ((p, m, v, c), g))| launch::AdamWTensor {
                            param: p,
                            grad: g,
                            exp_avg: m,
                            exp_avg_sq: v,
                            compensation: Some(c),
                            decay: i % 2 == 1,
                        })
                        .collect();
                    launch::anyprecision_decided_many(&s, &choices, kind, &ds, &mut list).unwrap();
                    for (i, (d, h)) in dev.iter().zip(&host).enumerate() {
                        let pairs = [("param", &d.0, &h.0), ("exp_avg", &d.1, &h.1)];
                        let more = [("exp_avg_sq", &d.2, &h.2), ("compensation", &d.3, &h.3)];
                        for (what, dv, hv) in pairs.into_iter().chain(more) {
                            let same = down(&s, dv)
                                .iter()
                                .zip(hv.iter())
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{kind:?} case {k}, tensor {i}: {what} differs");
                        }
                    }
                }
            }
        }
    }
}
