//! AdamW and SGD: one tensor, decided, and many tensors in one launch.

use crate::common::emulator::{addr, bytes_of, Emulator};
use fsdp_kernels::host::{self, AdamW, AdamWChoice, AdamWScalars, Sgd, SgdChoice, SgdScalars};
use fsdp_kernels::launch::{plan, ADAMW_TENSORS};
use fsdp_kernels::Program;
use half::bf16;

use super::helpers::*;

/// `adamw_f32` / `adamw_bf16_state` (`plan::adamw`: `config(n)`, parameters p, g, m, v, n,
/// then the scalars one by one) over steps 1..=4 from zero moments, against `host::adamw`.
fn adamw_steps<S: Moment>(emu: &Emulator, cfg: &AdamW, n: usize) {
    let mut p = mixed(n, 1, 0.5);
    let (mut m, mut v) = (vec![S::default(); n], vec![S::default(); n]);
    let mut bufs = vec![guarded(&p), vec![], guarded_moment(&m), guarded_moment(&v)];
    for step in 1..=4u64 {
        let g = mixed(n, 10 + step, 2.0);
        let sc = AdamWScalars::new(cfg, step).unwrap();
        host::adamw(&sc, &mut p, &g, &mut m, &mut v).unwrap();
        bufs[1] = guarded(&g);
        let launches = plan::adamw::<S>(&sc, addr(0), addr(1), addr(2), addr(3), n);
        assert_eq!(launches[0].kernel, S::ADAMW_KERNEL);
        emu.run_plan(&mut bufs, &launches);
        let what = format!("{} {cfg:?} step {step}", S::ADAMW_KERNEL);
        assert_bits(&unguard(&bufs[0], n, &what), &p, &format!("{what}: param"));
        let (gm, gv) = (
            unguard_moment::<S>(&bufs[2], n, &what),
            unguard_moment::<S>(&bufs[3], n, &what),
        );
        assert_bits(&gm, &f32s(&m), &format!("{what}: exp_avg"));
        assert_bits(&gv, &f32s(&v), &format!("{what}: exp_avg_sq"));
    }
}

/// AdamW with f32 and bf16 moments, with and without weight decay, both lerp branches
/// (`beta1` 0.9: `w1 < 0.5`; 0.3: not), [`N`] elements.
#[test]
fn adamw_kernels_are_their_twins() {
    let Some(emu) = Emulator::build(Program::Optim, "adamw_kernels_are_their_twins") else {
        return;
    };
    for (beta1, weight_decay) in [(0.9, 0.1), (0.3, 0.0)] {
        let cfg = AdamW {
            lr: 1e-3,
            beta1,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
        };
        let lerp_small = AdamWScalars::new(&cfg, 1).unwrap().lerp_small;
        assert_eq!(lerp_small, beta1 > 0.5);
        adamw_steps::<f32>(emu, &cfg, N);
        adamw_steps::<bf16>(emu, &cfg, N);
    }
}

/// `sgd_f32` (`plan::sgd`: `config(n)`, parameters p, g, buf, n, neg_lr, wd, momentum, damp,
/// flags) over steps 1..=3 of configurations that set every flag and dampening, against
/// `host::sgd`; without momentum the buffer is left alone.
#[test]
fn sgd_f32_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Optim, "sgd_f32_is_its_twin") else {
        return;
    };
    let n = N;
    let mut flags_seen = 0u32;
    // (momentum, dampening, weight decay, Nesterov)
    for (momentum, dampening, weight_decay, nesterov) in [
        (0.0, 0.0, 0.0, false),
        (0.9, 0.0, 0.01, false),
        (0.9, 0.0, 0.0, true),
        (0.9, 0.25, 0.01, true),
        (0.5, 0.1, 0.0, false),
        (0.0, 0.5, 0.01, true),
    ] {
        let cfg = Sgd {
            lr: 0.1,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        };
        let mut p = mixed(n, 61, 1.0);
        // Not zeros: the first step with momentum must not read it.
        let mut b = mixed(n, 62, 0.1);
        let mut bufs = vec![guarded(&p), vec![], guarded(&b)];
        for step in 1..=3u64 {
            let g = mixed(n, 70 + step, 2.0);
            let sc = SgdScalars::new(&cfg, step).unwrap();
            flags_seen |= sc.flags;
            host::sgd(&sc, &mut p, &g, &mut b).unwrap();
            bufs[1] = guarded(&g);
            emu.run_plan(&mut bufs, &plan::sgd(&sc, addr(0), addr(1), addr(2), n));
            let what = format!("sgd_f32 {cfg:?} step {step} (flags {:#x})", sc.flags);
            assert_bits(&unguard(&bufs[0], n, &what), &p, &format!("{what}: param"));
            let buf = unguard(&bufs[2], n, &what);
            assert_bits(&buf, &b, &format!("{what}: momentum buffer"));
        }
        if momentum == 0.0 {
            assert_bits(&b, &mixed(n, 62, 0.1), "an unused momentum buffer");
        }
    }
    assert_eq!(flags_seen, 1 | 2 | 4 | 8, "every SGD flag exercised");
}

/// `adamw_decided_f32` (`plan::adamw_decided`: `config(n)`, parameters p, g, m, v, n, the
/// scalars, the choice by value) over [`decisions`] with state carried over, with and without
/// weight decay, against `host::adamw_decided`; a step not applied changes nothing.
#[test]
fn adamw_decided_f32_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Optim, "adamw_decided_f32_is_its_twin") else {
        return;
    };
    let n = N;
    for wd in [0.1, 0.0] {
        let cfg = |lr: f64| adamw_cfg(lr, wd);
        let choice = AdamWChoice([
            AdamWScalars::new(&cfg(1e-3), 3).unwrap(),
            AdamWScalars::new(&cfg(9e-4), 4).unwrap(),
        ]);
        let mut p = mixed(n, 1, 0.5);
        let mut m = mixed(n, 2, 0.01);
        let mut v: Vec<f32> = mixed(n, 3, 0.001).iter().map(|x| x.abs()).collect();
        let mut bufs = vec![guarded(&p), vec![], guarded(&m), guarded(&v), vec![]];
        for (k, (applied, pick, clipped, coef, unscale)) in decisions().into_iter().enumerate() {
            let g = mixed(n, 10 + k as u64, 2.0);
            let sc = decision(applied, pick, clipped, coef, unscale);
            let before = (p.clone(), m.clone(), v.clone());
            host::adamw_decided(&choice, &sc, &mut p, &g, &mut m, &mut v).unwrap();
            bufs[1] = guarded(&g);
            bufs[4] = bytes_of(&sc);
            let launches =
                plan::adamw_decided(&choice, addr(4), addr(0), addr(1), addr(2), addr(3), n);
            emu.run_plan(&mut bufs, &launches);
            let what = format!("adamw_decided_f32 wd {wd} case {k}");
            let got = [
                unguard(&bufs[0], n, &what),
                unguard(&bufs[2], n, &what),
                unguard(&bufs[3], n, &what),
            ];
            assert_bits(&got[0], &p, &format!("{what}: param"));
            assert_bits(&got[1], &m, &format!("{what}: exp_avg"));
            assert_bits(&got[2], &v, &format!("{what}: exp_avg_sq"));
            assert_scalars_kept(&bufs[4], &sc, &what);
            if applied == 0.0 {
                assert_bits(&got[0], &before.0, &format!("{what}: param not applied"));
                assert_bits(&got[1], &before.1, &format!("{what}: exp_avg not applied"));
                assert_bits(
                    &got[2],
                    &before.2,
                    &format!("{what}: exp_avg_sq not applied"),
                );
            } else {
                assert_ne!(got[0], before.0, "{what}: an applied step moved nothing");
            }
        }
    }
}

/// `sgd_decided_f32` (`plan::sgd_decided`: `config(n)`, parameters p, g, buf, n, the scalars,
/// the choice by value) over [`decisions`] with a choice of SGD with momentum (its first step
/// and the next: the first-step flag in one set only), Nesterov, dampening and weight decay,
/// and with a choice without momentum (the buffer left alone), against `host::sgd_decided`.
#[test]
fn sgd_decided_f32_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Optim, "sgd_decided_f32_is_its_twin") else {
        return;
    };
    let n = N;
    for (momentum, dampening, weight_decay, nesterov) in
        [(0.9, 0.1, 0.01, true), (0.0, 0.0, 0.0, false)]
    {
        let cfg = Sgd {
            lr: 0.1,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        };
        let choice = SgdChoice([
            SgdScalars::new(&cfg, 1).unwrap(),
            SgdScalars::new(&cfg, 2).unwrap(),
        ]);
        let (mut p, mut b) = (mixed(n, 95, 1.0), mixed(n, 96, 0.1));
        let mut bufs = vec![guarded(&p), vec![], guarded(&b), vec![]];
        for (k, (applied, pick, clipped, coef, unscale)) in decisions().into_iter().enumerate() {
            let g = mixed(n, 97 + k as u64, 2.0);
            let sc = decision(applied, pick, clipped, coef, unscale);
            let before = (p.clone(), b.clone());
            host::sgd_decided(&choice, &sc, &mut p, &g, &mut b).unwrap();
            bufs[1] = guarded(&g);
            bufs[3] = bytes_of(&sc);
            let launches = plan::sgd_decided(&choice, addr(3), addr(0), addr(1), addr(2), n);
            emu.run_plan(&mut bufs, &launches);
            let what = format!("sgd_decided_f32 {cfg:?} case {k}");
            let (gp, gb) = (unguard(&bufs[0], n, &what), unguard(&bufs[2], n, &what));
            assert_bits(&gp, &p, &format!("{what}: param"));
            assert_bits(&gb, &b, &format!("{what}: momentum buffer"));
            assert_scalars_kept(&bufs[3], &sc, &what);
            if applied == 0.0 {
                assert_bits(&gp, &before.0, &format!("{what}: param not applied"));
                assert_bits(&gb, &before.1, &format!("{what}: buffer not applied"));
            }
        }
        if momentum == 0.0 {
            assert_bits(&b, &mixed(n, 96, 0.1), "an unused momentum buffer");
        }
    }
}

/// `adamw_decided_many` (`plan::adamw_decided_many`: `foreach_grid`, parameters the list by
/// value, count, the scalars, the choices without and with weight decay by value) on
/// [`MANY_LENS`] tensors, every other one with weight decay, over [`decisions`] with state
/// carried over: each tensor bitwise `host::adamw_decided` with its choice.
#[test]
fn adamw_decided_many_is_each_tensors_twin() {
    let Some(emu) = Emulator::build(Program::Optim, "adamw_decided_many_is_each_tensors_twin")
    else {
        return;
    };
    let cfg = adamw_cfg;
    let choices = [0.0, 0.1].map(|wd| {
        AdamWChoice([
            AdamWScalars::new(&cfg(1e-3, wd), 3).unwrap(),
            AdamWScalars::new(&cfg(9e-4, wd), 4).unwrap(),
        ])
    });
    let lens = MANY_LENS;
    let count = lens.len();
    let decay: Vec<bool> = (0..count).map(|i| i % 2 == 1).collect();
    let mut host: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let s = 1000 * i as u64;
            let v = mixed(n, s + 3, 0.001).iter().map(|x| x.abs()).collect();
            (mixed(n, s + 1, 0.5), mixed(n, s + 2, 0.01), v)
        })
        .collect();
    // Buffers: tensor i's p, g, m, v at 4i..4i+4, the scalars last.
    let mut bufs: Vec<Vec<u8>> = host
        .iter()
        .flat_map(|(p, m, v)| [guarded(p), vec![], guarded(m), guarded(v)])
        .collect();
    bufs.push(vec![]);
    let tensors = decided_tensors(&lens, &decay, 4, false);
    assert!(count <= ADAMW_TENSORS, "one launch");
    for (k, (applied, pick, clipped, coef, unscale)) in decisions().into_iter().enumerate() {
        let sc = decision(applied, pick, clipped, coef, unscale);
        for (i, (p, m, v)) in host.iter_mut().enumerate() {
            let g = mixed(lens[i], 1000 * i as u64 + 10 + k as u64, 2.0);
            host::adamw_decided(&choices[usize::from(decay[i])], &sc, p, &g, m, v).unwrap();
            bufs[4 * i + 1] = guarded(&g);
        }
        bufs[4 * count] = bytes_of(&sc);
        let launches = plan::adamw_decided_many(&choices, addr(4 * count), &tensors);
        assert_eq!(launches.len(), 1);
        emu.run_plan(&mut bufs, &launches);
        for (i, (p, m, v)) in host.iter().enumerate() {
            let (n, what) = (lens[i], format!("adamw_decided_many case {k} tensor {i}"));
            let got = |f: usize| unguard(&bufs[4 * i + f], n, &what);
            assert_bits(&got(0), p, &format!("{what} ({n}): param"));
            assert_bits(&got(2), m, &format!("{what} ({n}): exp_avg"));
            assert_bits(&got(3), v, &format!("{what} ({n}): exp_avg_sq"));
        }
        assert_scalars_kept(&bufs[4 * count], &sc, "adamw_decided_many");
    }
}
