//! torchdistx's AnyPrecisionAdamW, decided: one tensor and many in one launch.

use crate::common::emulator::{addr, bytes_of, Emulator};
use fsdp_device::DType;
use fsdp_kernels::host::{
    self, pack_state, state_len, AnyPrecision, AnyPrecisionChoice, AnyPrecisionScalars,
};
use fsdp_kernels::launch::{plan, ANYPRECISION_TENSORS};
use fsdp_kernels::Program;
use half::bf16;

use super::helpers::*;

/// `values` packed as `kind.state` (`host::pack_state`), the unused half of an odd bf16 run's
/// last element set to the guard.
pub(crate) fn packed(values: &[f32], state: DType) -> Vec<f32> {
    let mut out = pack_state(values, state);
    if state == DType::BF16 && values.len() % 2 == 1 {
        let last = out.last_mut().unwrap();
        *last = f32::from_bits((last.to_bits() & 0xffff) | (u32::from(guard_bf16()) << 16));
    }
    out
}

pub(crate) fn round_to(d: DType, x: f32) -> f32 {
    if d == DType::BF16 {
        bf16::from_f32(x).to_f32()
    } else {
        x
    }
}

/// Every kind of `AnyPrecisionAdamW` run: parameters f32 or bf16, state f32 or bf16, Kahan
/// summation on or off.
pub(crate) fn kinds(kahan: &[bool]) -> Vec<AnyPrecision> {
    let mut out = Vec::new();
    for param in [DType::F32, DType::BF16] {
        for state in [DType::F32, DType::BF16] {
            for &kahan in kahan {
                out.push(AnyPrecision {
                    param,
                    state,
                    kahan,
                });
            }
        }
    }
    out
}

/// One tensor's `AnyPrecisionAdamW` buffers as the twin takes them: parameters (rounded to
/// the parameter dtype), momentum, variance, compensation (packed state).
pub(crate) type ApState = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

pub(crate) fn anyprecision_state(kind: AnyPrecision, n: usize, seed: u64) -> ApState {
    let p = mixed(n, seed, 0.5)
        .into_iter()
        .map(|x| round_to(kind.param, x))
        .collect();
    let v: Vec<f32> = mixed(n, seed + 2, 0.001).iter().map(|x| x.abs()).collect();
    (
        p,
        packed(&mixed(n, seed + 1, 0.01), kind.state),
        packed(&v, kind.state),
        packed(&mixed(n, seed + 3, 1e-4), kind.state),
    )
}

/// `anyprecision_decided_f32` / `_bf16_state` (`plan::anyprecision_decided`: `config(n)`,
/// parameters p, g, m, v, comp, n, the scalars, the choice by value, param_bf16) over
/// [`decisions`] with state carried over, every kind with Kahan summation and without (the
/// launcher's null compensation: the compensation buffer is not touched), a set with weight
/// decay and one without, [`N`] elements, against `host::anyprecision_decided`.
#[test]
fn anyprecision_decided_is_its_twin() {
    let Some(emu) = Emulator::build(Program::AnyPrecision, "anyprecision_decided_is_its_twin")
    else {
        return;
    };
    let n = N;
    let cfg = adamw_cfg;
    let choice = AnyPrecisionChoice([
        AnyPrecisionScalars::new(&cfg(1e-3, 0.1), 3).unwrap(),
        AnyPrecisionScalars::new(&cfg(9e-4, 0.0), 4).unwrap(),
    ]);
    assert!(choice.0[0].decay.is_some() && choice.0[1].decay.is_none());
    for kind in kinds(&[true, false]) {
        let kernel = if kind.state == DType::BF16 {
            "anyprecision_decided_bf16_state"
        } else {
            "anyprecision_decided_f32"
        };
        let (mut p, mut m, mut v, mut c) = anyprecision_state(kind, n, 1);
        let sn = state_len(n, kind.state);
        assert_eq!(m.len(), sn);
        let mut bufs = vec![
            guarded(&p),
            vec![],
            guarded(&m),
            guarded(&v),
            guarded(&c),
            vec![],
        ];
        for (k, (applied, pick, clipped, coef, unscale)) in decisions().into_iter().enumerate() {
            let g = mixed(n, 10 + k as u64, 2.0);
            let sc = decision(applied, pick, clipped, coef, unscale);
            let before = [p.clone(), m.clone(), v.clone(), c.clone()];
            host::anyprecision_decided(
                &choice,
                kind,
                &sc,
                &mut p,
                &g,
                &mut m,
                &mut v,
                kind.kahan.then_some(&mut c),
            )
            .unwrap();
            bufs[1] = guarded(&g);
            bufs[5] = bytes_of(&sc);
            // The compensation given either way: the plan passes null without Kahan.
            let at: [u64; 6] = std::array::from_fn(addr);
            let [p_at, g_at, m_at, v_at, c_at, s_at] = at;
            let launches = plan::anyprecision_decided(
                &choice,
                kind,
                s_at,
                p_at,
                g_at,
                m_at,
                v_at,
                Some(c_at),
                n,
            )
            .unwrap();
            assert_eq!(launches[0].kernel, kernel);
            emu.run_plan(&mut bufs, &launches);
            let what = format!("{kernel} {kind:?} case {k}");
            let got = [
                unguard(&bufs[0], n, &what),
                unguard(&bufs[2], sn, &what),
                unguard(&bufs[3], sn, &what),
                unguard(&bufs[4], sn, &what),
            ];
            let want = [&p, &m, &v, &c];
            let names = ["param", "exp_avg", "exp_avg_sq", "compensation"];
            for i in 0..4 {
                assert_bits(&got[i], want[i], &format!("{what}: {}", names[i]));
                if applied == 0.0 {
                    let w = format!("{what}: {} not applied", names[i]);
                    assert_bits(&got[i], &before[i], &w);
                }
            }
            assert_scalars_kept(&bufs[5], &sc, &what);
        }
    }
}

/// `anyprecision_decided_many_f32` / `_bf16_state` (`plan::anyprecision_decided_many`:
/// `foreach_grid`, parameters the list by value, count, the scalars, the choices without and
/// with weight decay by value, param_bf16) on [`MANY_LENS`] tensors, every kind (Kahan off: a
/// compensation address of 0 in the list), every other tensor with weight decay, over
/// applied, clipped, unscaled and skipped steps of both choices with state carried over: each
/// tensor bitwise `host::anyprecision_decided` with its choice.
#[test]
fn anyprecision_decided_many_is_each_tensors_twin() {
    let Some(emu) = Emulator::build(
        Program::AnyPrecision,
        "anyprecision_decided_many_is_each_tensors_twin",
    ) else {
        return;
    };
    let cfg = adamw_cfg;
    let choices = [0.0, 0.1].map(|wd| {
        AnyPrecisionChoice([
            AnyPrecisionScalars::new(&cfg(1e-3, wd), 3).unwrap(),
            AnyPrecisionScalars::new(&cfg(9e-4, wd), 4).unwrap(),
        ])
    });
    let lens = MANY_LENS;
    let count = lens.len();
    let decay: Vec<bool> = (0..count).map(|i| i % 2 == 1).collect();
    let c = f64::from(0.37f32);
    let steps = [
        (1.0, 0.0, 0.0, 1.0, 0.0),
        (1.0, 1.0, 1.0, c, f64::from(1.0f32 / 1000.0)),
        (0.0, 1.0, 1.0, c, 0.0),
    ];
    for kind in kinds(&[false, true]) {
        let kernel = if kind.state == DType::BF16 {
            "anyprecision_decided_many_bf16_state"
        } else {
            "anyprecision_decided_many_f32"
        };
        let mut host: Vec<ApState> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| anyprecision_state(kind, n, 1000 * i as u64))
            .collect();
        let initial_c: Vec<Vec<f32>> = host.iter().map(|t| t.3.clone()).collect();
        // Buffers: tensor i's p, g, m, v, c at 5i..5i+5, the scalars last.
        let mut bufs: Vec<Vec<u8>> = host
            .iter()
            .flat_map(|(p, m, v, c)| [guarded(p), vec![], guarded(m), guarded(v), guarded(c)])
            .collect();
        bufs.push(vec![]);
        // Every tensor's compensation given: without Kahan the plan lists address 0.
        let tensors = decided_tensors(&lens, &decay, 5, true);
        assert!(count <= ANYPRECISION_TENSORS, "one launch");
        for (k, &(applied, pick, clipped, coef, unscale)) in steps.iter().enumerate() {
            let sc = decision(applied, pick, clipped, coef, unscale);
            for (i, (p, m, v, c)) in host.iter_mut().enumerate() {
                let g = mixed(lens[i], 1000 * i as u64 + 10 + k as u64, 2.0);
                let ch = &choices[usize::from(decay[i])];
                host::anyprecision_decided(ch, kind, &sc, p, &g, m, v, Some(&mut c[..])).unwrap();
                bufs[5 * i + 1] = guarded(&g);
            }
            bufs[5 * count] = bytes_of(&sc);
            let launches =
                plan::anyprecision_decided_many(&choices, kind, addr(5 * count), &tensors).unwrap();
            assert_eq!(launches.len(), 1);
            assert_eq!(launches[0].kernel, kernel);
            emu.run_plan(&mut bufs, &launches);
            for (i, (p, m, v, c)) in host.iter().enumerate() {
                let n = lens[i];
                let sn = state_len(n, kind.state);
                let what = format!("{kernel} {kind:?} case {k} tensor {i} ({n})");
                let got = |f: usize, len: usize| unguard(&bufs[5 * i + f], len, &what);
                assert_bits(&got(0, n), p, &format!("{what}: param"));
                assert_bits(&got(2, sn), m, &format!("{what}: exp_avg"));
                assert_bits(&got(3, sn), v, &format!("{what}: exp_avg_sq"));
                assert_bits(&got(4, sn), c, &format!("{what}: compensation"));
                if !kind.kahan {
                    let w = format!("{what}: an unused compensation");
                    assert_bits(c, &initial_c[i], &w);
                }
            }
            assert_scalars_kept(&bufs[5 * count], &sc, kernel);
        }
    }
}
