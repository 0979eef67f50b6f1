//! The optimizers' CUDA source run on the host (`common::emulator`: `cu/optim.cu` and
//! `cu/any_precision.cu` as NVRTC compiles them, a block's threads as host threads), each kernel
//! launched with its launcher's grid, block and parameters (`src/launch/mod.rs`, `step.rs`,
//! `foreach.rs`; `buffers.rs` and `step_buffers.rs` reach the same launches), against its twin
//! bitwise (`host/optim.rs`, `host/step.rs`, `host/any_precision.rs`):
//!
//! - `adamw_f32` and `adamw_bf16_state` over several steps (the moments carried over), with and
//!   without weight decay and on both branches of torch.lerp;
//! - `sgd_f32` with every flag the launcher's scalars encode (momentum, its first step,
//!   Nesterov, weight decay) and dampening, several steps (the buffer carried over; left alone
//!   without momentum);
//! - `adamw_decided_f32` and `sgd_decided_f32` over a run of decisions: applied or not (then
//!   nothing changes), either choice (and a choice past them: the last), clipped, unscaled;
//! - `anyprecision_decided_f32` and `anyprecision_decided_bf16_state` with parameters of f32 or
//!   bf16 values, state of f32 or bf16 packed two to an f32 element (odd lengths: the unused
//!   half stays), with Kahan summation and without (the launcher's null compensation), a set
//!   with and one without weight decay;
//! - `adamw_decided_many`, `anyprecision_decided_many_f32` and
//!   `anyprecision_decided_many_bf16_state` over tensors of different lengths (empty, one
//!   element, around a block, longer than the blocks along x take in one pass), every other
//!   one with weight decay, their lists and choices passed by value as `launch/foreach.rs` and
//!   `launch/step.rs` lay them out — each tensor bitwise its one-tensor twin.
//!
//! Every buffer has a guard element past its end that must stay, and the step's scalars are only
//! read. What this cannot check is the hardware itself: `tests/gpu.rs` and `tests/gpu_step.rs`
//! do, on a GPU (AdamW there within 1 ulp, 0 expected; here bitwise).

mod common;

use common::data;
use common::emulator::{bytes_of, values_of, Arg, Emulator, Launch};
use fsdp_device::DType;
use fsdp_kernels::host::{
    self, pack_state, state_len, AdamW, AdamWChoice, AdamWScalars, AnyPrecision,
    AnyPrecisionChoice, AnyPrecisionScalars, Sgd, SgdChoice, SgdScalars, STEP_APPLIED, STEP_CHOICE,
    STEP_CLIPPED, STEP_CLIP_COEF, STEP_UNSCALE,
};
use fsdp_kernels::launch::{ADAMW_TENSORS, ANYPRECISION_TENSORS};
use fsdp_kernels::Program;
use half::bf16;

/// The guard past each buffer's end (and in a packed bf16 state's unused half).
const GUARD: f32 = -1234.5;

fn guard_bf16() -> u16 {
    bf16::from_f32(GUARD).to_bits()
}

/// `n` values uniform in `[-scale, scale)` (`common::data`), with zeros of both signs and
/// subnormals among them.
fn mixed(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut v = data(n, seed, scale);
    for (i, x) in v.iter_mut().enumerate() {
        match i % 97 {
            5 => *x = 0.0,
            6 => *x = -0.0,
            7 => *x = 1.0e-40,
            8 => *x = -3.0e-39,
            _ => {}
        }
    }
    v
}

/// `v`'s bytes and a guard element.
fn guarded(v: &[f32]) -> Vec<u8> {
    let mut b = bytes_of(v);
    b.extend_from_slice(&GUARD.to_le_bytes());
    b
}

/// The `n` f32 values of a [`guarded`] buffer, its guard checked.
fn unguard(b: &[u8], n: usize, what: &str) -> Vec<f32> {
    let v: Vec<f32> = values_of(b);
    assert_eq!(v.len(), n + 1, "{what}: the buffer's length");
    assert_eq!(
        v[n].to_bits(),
        GUARD.to_bits(),
        "{what}: the guard past its end"
    );
    v[..n].to_vec()
}

/// Bitwise equality.
fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}[{i}]: emulated {g:?}, the twin {w:?}"
        );
    }
}

/// The moment types of `adamw_f32` / `adamw_bf16_state`, to and from their bytes.
trait Moment: host::MomentFloat {
    const SIZE: usize;
    fn from_bits(b: u64) -> Self;
}
impl Moment for f32 {
    const SIZE: usize = 4;
    fn from_bits(b: u64) -> Self {
        f32::from_bits(b as u32)
    }
}
impl Moment for bf16 {
    const SIZE: usize = 2;
    fn from_bits(b: u64) -> Self {
        bf16::from_bits(b as u16)
    }
}

/// `v`'s bytes and a guard element of `S`.
fn guarded_moment<S: Moment>(v: &[S]) -> Vec<u8> {
    v.iter()
        .copied()
        .chain([S::store(GUARD)])
        .flat_map(|x| x.bits().to_le_bytes()[..S::SIZE].to_vec())
        .collect()
}

/// The `n` values of a [`guarded_moment`] buffer, its guard checked, as f32 bits.
fn unguard_moment<S: Moment>(b: &[u8], n: usize, what: &str) -> Vec<f32> {
    let v: Vec<S> = b
        .chunks_exact(S::SIZE)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..S::SIZE].copy_from_slice(c);
            S::from_bits(u64::from_le_bytes(w))
        })
        .collect();
    assert_eq!(v.len(), n + 1, "{what}: the buffer's length");
    assert_eq!(v[n].bits(), S::store(GUARD).bits(), "{what}: the guard");
    v[..n].iter().map(|x| x.load()).collect()
}

fn f32s<S: Moment>(v: &[S]) -> Vec<f32> {
    v.iter().map(|x| x.load()).collect()
}

/// A step's scalars as a decision leaves them: applied or not, the choice, clipped by `coef`
/// or not, a grad scaler's unscaling (0: none).
fn decision(applied: f64, choice: f64, clipped: f64, coef: f64, unscale: f64) -> Vec<f64> {
    let mut s = host::step_scalars(0, None);
    s[STEP_APPLIED] = applied;
    s[STEP_CHOICE] = choice;
    s[STEP_CLIPPED] = clipped;
    s[STEP_CLIP_COEF] = coef;
    s[STEP_UNSCALE] = unscale;
    s
}

/// The decisions the decided kernels run through (`gpu_step.rs`'s, and a choice past the
/// choices, which both clamp to the last): (applied, choice, clipped, coefficient, unscaling).
fn decisions() -> Vec<(f64, f64, f64, f64, f64)> {
    let c = f64::from(0.37f32);
    vec![
        (1.0, 0.0, 0.0, 1.0, 0.0),
        (1.0, 1.0, 1.0, c, 0.0),
        (0.0, 1.0, 1.0, 0.5, 0.0),
        (1.0, 1.0, 0.0, 1.0, 0.0),
        (1.0, 0.0, 1.0, c, 2f64.powi(-16)),
        (1.0, 1.0, 0.0, 1.0, f64::from(1.0f32 / 1000.0)),
        (1.0, 5.0, 1.0, c, 0.0),
    ]
}

/// The scalars buffer after a run: the kernels only read it.
fn assert_scalars_kept(b: &[u8], sc: &[f64], what: &str) {
    let got: Vec<f64> = values_of(b);
    let same = got.iter().zip(sc).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same && got.len() == sc.len(), "{what}: the scalars changed");
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    bytes_of(v)
}

/// `AdamWChoice` of `cu/optim.cu` as `launch/step.rs` lays it out (`AdamWChoiceArgs`): per
/// choice decay, w1, one_minus_w1, lerp_small (u32), beta2, one_minus_beta2, neg_step_size,
/// bc2_sqrt, eps — 4-byte fields, no padding.
fn adamw_choice_arg(c: &AdamWChoice) -> Arg {
    let mut b = Vec::new();
    for s in &c.0 {
        b.extend(f32_bytes(&[s.decay, s.w1, s.one_minus_w1]));
        b.extend(u32::from(s.lerp_small).to_le_bytes());
        b.extend(f32_bytes(&[
            s.beta2,
            s.one_minus_beta2,
            s.neg_step_size,
            s.bc2_sqrt,
            s.eps,
        ]));
    }
    Arg::Struct(b, vec![])
}

/// `SgdChoice` of `cu/optim.cu` as `launch/step.rs` lays it out (`SgdChoiceArgs`): per choice
/// neg_lr, wd, momentum, damp, flags (u32).
fn sgd_choice_arg(c: &SgdChoice) -> Arg {
    let mut b = Vec::new();
    for s in &c.0 {
        b.extend(f32_bytes(&[s.neg_lr, s.wd, s.momentum, s.damp]));
        b.extend(s.flags.to_le_bytes());
    }
    Arg::Struct(b, vec![])
}

/// `AnyPrecisionChoice` of `cu/any_precision.cu` as `launch/step.rs` lays it out
/// (`AnyPrecisionChoiceArgs`): per choice has_decay (u32), decay (1 without), beta1,
/// one_minus_beta1, beta2, one_minus_beta2, denom_correction, eps, neg_step_size.
fn anyprecision_choice_arg(c: &AnyPrecisionChoice) -> Arg {
    let mut b = Vec::new();
    for s in &c.0 {
        b.extend(u32::from(s.decay.is_some()).to_le_bytes());
        b.extend(f32_bytes(&[
            s.decay.unwrap_or(1.0),
            s.beta1,
            s.one_minus_beta1,
            s.beta2,
            s.one_minus_beta2,
            s.denom_correction,
            s.eps,
            s.neg_step_size,
        ]));
    }
    Arg::Struct(b, vec![])
}

/// A tensor list of `launch/foreach.rs` (`AdamWList`: p, g, m, v; `AnyPrecisionList`: p, g, m,
/// v, c) for `slots` tensors: one array of `slots` u64 addresses per field of `fields`
/// (`fields[f][t]`: tensor `t`'s buffer, relocated, or `None`: address 0), the lengths
/// (`slots` u64), the decay flags (`slots` u32), tail-padded to 8 bytes as `#[repr(C)]` does.
fn list_arg(slots: usize, fields: &[Vec<Option<usize>>], lens: &[usize], decay: &[bool]) -> Arg {
    let words = fields.len() + 1;
    let size = (words * slots * 8 + slots * 4).next_multiple_of(8);
    let mut b = vec![0u8; size];
    let mut relocs = Vec::new();
    for (f, field) in fields.iter().enumerate() {
        assert!(field.len() <= slots);
        for (t, buf) in field.iter().enumerate() {
            if let Some(buf) = buf {
                relocs.push((f * slots * 8 + t * 8, *buf, 0));
            }
        }
    }
    for (t, &n) in lens.iter().enumerate() {
        b[fields.len() * slots * 8 + t * 8..][..8].copy_from_slice(&(n as u64).to_le_bytes());
    }
    for (t, &d) in decay.iter().enumerate() {
        b[words * slots * 8 + t * 4..][..4].copy_from_slice(&u32::from(d).to_le_bytes());
    }
    Arg::Struct(b, relocs)
}

/// The launch shape of the `_many` kernels (`launch/foreach.rs` `per_segment`): blocks of 256
/// threads, one along x per 2048 elements of the longest tensor (at most `MAX_BLOCKS_X` =
/// 1024), one row per tensor.
fn per_segment(kernel: &str, lens: &[usize], args: Vec<Arg>) -> Launch {
    const BLOCK: u64 = 256;
    const PER_THREAD: u64 = 8;
    const MAX_BLOCKS_X: u64 = 1024;
    let longest = lens.iter().copied().max().unwrap_or(0) as u64;
    let blocks = longest.div_ceil(BLOCK * PER_THREAD).clamp(1, MAX_BLOCKS_X) as u32;
    Launch::new(kernel, (blocks, lens.len() as u32), BLOCK as u32, args)
}

/// The one-tensor kernels' length: 3 blocks of 256, the last partial, odd (a packed bf16
/// state's last half unused).
const N: usize = 517;

/// Lengths of the multi-tensor tests' tensors: empty, one element, odd, around a block of 256,
/// and longer than one pass of the blocks along x (2 blocks of 256 for 2500: each thread takes
/// several elements).
const MANY_LENS: [usize; 7] = [257, 1, 0, 256, 2049, 3, 2500];

/// `adamw_f32` / `adamw_bf16_state` (`launch::adamw`: `config(n)`, parameters p, g, m, v, n,
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
        let args = vec![
            Arg::buf(0),
            Arg::buf(1),
            Arg::buf(2),
            Arg::buf(3),
            Arg::u64(n as u64),
            Arg::f32(sc.decay),
            Arg::f32(sc.w1),
            Arg::f32(sc.one_minus_w1),
            Arg::u32(u32::from(sc.lerp_small)),
            Arg::f32(sc.beta2),
            Arg::f32(sc.one_minus_beta2),
            Arg::f32(sc.neg_step_size),
            Arg::f32(sc.bc2_sqrt),
            Arg::f32(sc.eps),
        ];
        emu.run(&mut bufs, &[Launch::elementwise(S::ADAMW_KERNEL, n, args)]);
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

/// `sgd_f32` (`launch::sgd`: `config(n)`, parameters p, g, buf, n, neg_lr, wd, momentum, damp,
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
            let args = vec![
                Arg::buf(0),
                Arg::buf(1),
                Arg::buf(2),
                Arg::u64(n as u64),
                Arg::f32(sc.neg_lr),
                Arg::f32(sc.wd),
                Arg::f32(sc.momentum),
                Arg::f32(sc.damp),
                Arg::u32(sc.flags),
            ];
            emu.run(&mut bufs, &[Launch::elementwise("sgd_f32", n, args)]);
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

/// `adamw_decided_f32` (`launch::adamw_decided`: `config(n)`, parameters p, g, m, v, n, the
/// scalars, the choice by value) over [`decisions`] with state carried over, with and without
/// weight decay, against `host::adamw_decided`; a step not applied changes nothing.
#[test]
fn adamw_decided_f32_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Optim, "adamw_decided_f32_is_its_twin") else {
        return;
    };
    let n = N;
    for wd in [0.1, 0.0] {
        let cfg = |lr: f64| AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: wd,
        };
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
            let args = vec![
                Arg::buf(0),
                Arg::buf(1),
                Arg::buf(2),
                Arg::buf(3),
                Arg::u64(n as u64),
                Arg::buf(4),
                adamw_choice_arg(&choice),
            ];
            emu.run(
                &mut bufs,
                &[Launch::elementwise("adamw_decided_f32", n, args)],
            );
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

/// `sgd_decided_f32` (`launch::sgd_decided`: `config(n)`, parameters p, g, buf, n, the scalars,
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
            let args = vec![
                Arg::buf(0),
                Arg::buf(1),
                Arg::buf(2),
                Arg::u64(n as u64),
                Arg::buf(3),
                sgd_choice_arg(&choice),
            ];
            emu.run(
                &mut bufs,
                &[Launch::elementwise("sgd_decided_f32", n, args)],
            );
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

/// `values` packed as `kind.state` (`host::pack_state`), the unused half of an odd bf16 run's
/// last element set to the guard.
fn packed(values: &[f32], state: DType) -> Vec<f32> {
    let mut out = pack_state(values, state);
    if state == DType::BF16 && values.len() % 2 == 1 {
        let last = out.last_mut().unwrap();
        *last = f32::from_bits((last.to_bits() & 0xffff) | (u32::from(guard_bf16()) << 16));
    }
    out
}

fn round_to(d: DType, x: f32) -> f32 {
    if d == DType::BF16 {
        bf16::from_f32(x).to_f32()
    } else {
        x
    }
}

/// Every kind of `AnyPrecisionAdamW` run: parameters f32 or bf16, state f32 or bf16, Kahan
/// summation on or off.
fn kinds(kahan: &[bool]) -> Vec<AnyPrecision> {
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
type ApState = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

fn anyprecision_state(kind: AnyPrecision, n: usize, seed: u64) -> ApState {
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

/// `anyprecision_decided_f32` / `_bf16_state` (`launch::anyprecision_decided`: `config(n)`,
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
    let cfg = |lr: f64, weight_decay: f64| AdamW {
        lr,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay,
    };
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
            let args = vec![
                Arg::buf(0),
                Arg::buf(1),
                Arg::buf(2),
                Arg::buf(3),
                if kind.kahan { Arg::buf(4) } else { Arg::Null },
                Arg::u64(n as u64),
                Arg::buf(5),
                anyprecision_choice_arg(&choice),
                Arg::u32(u32::from(kind.param == DType::BF16)),
            ];
            emu.run(&mut bufs, &[Launch::elementwise(kernel, n, args)]);
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

/// `adamw_decided_many` (`launch::adamw_decided_many`: `per_segment`, parameters the list by
/// value, count, the scalars, the choices without and with weight decay by value) on
/// [`MANY_LENS`] tensors, every other one with weight decay, over [`decisions`] with state
/// carried over: each tensor bitwise `host::adamw_decided` with its choice.
#[test]
fn adamw_decided_many_is_each_tensors_twin() {
    let Some(emu) = Emulator::build(Program::Optim, "adamw_decided_many_is_each_tensors_twin")
    else {
        return;
    };
    let cfg = |lr: f64, wd: f64| AdamW {
        lr,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: wd,
    };
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
    let field = |f: usize| (0..count).map(|i| Some(4 * i + f)).collect::<Vec<_>>();
    // `AdamWList` (launch/foreach.rs): p, g, m, v, n, decay for ADAMW_TENSORS tensors.
    let list = list_arg(
        ADAMW_TENSORS,
        &[field(0), field(1), field(2), field(3)],
        &lens,
        &decay,
    );
    for (k, (applied, pick, clipped, coef, unscale)) in decisions().into_iter().enumerate() {
        let sc = decision(applied, pick, clipped, coef, unscale);
        for (i, (p, m, v)) in host.iter_mut().enumerate() {
            let g = mixed(lens[i], 1000 * i as u64 + 10 + k as u64, 2.0);
            host::adamw_decided(&choices[usize::from(decay[i])], &sc, p, &g, m, v).unwrap();
            bufs[4 * i + 1] = guarded(&g);
        }
        bufs[4 * count] = bytes_of(&sc);
        let args = vec![
            list.clone(),
            Arg::u32(count as u32),
            Arg::buf(4 * count),
            adamw_choice_arg(&choices[0]),
            adamw_choice_arg(&choices[1]),
        ];
        emu.run(&mut bufs, &[per_segment("adamw_decided_many", &lens, args)]);
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

/// `anyprecision_decided_many_f32` / `_bf16_state` (`launch::anyprecision_decided_many`:
/// `per_segment`, parameters the list by value, count, the scalars, the choices without and
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
    let cfg = |lr: f64, wd: f64| AdamW {
        lr,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: wd,
    };
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
        let field = |f: usize| (0..count).map(|i| Some(5 * i + f)).collect::<Vec<_>>();
        let comp = if kind.kahan {
            field(4)
        } else {
            vec![None; count]
        };
        // `AnyPrecisionList` (launch/foreach.rs): p, g, m, v, c, n, decay for
        // ANYPRECISION_TENSORS tensors.
        let list = list_arg(
            ANYPRECISION_TENSORS,
            &[field(0), field(1), field(2), field(3), comp],
            &lens,
            &decay,
        );
        for (k, &(applied, pick, clipped, coef, unscale)) in steps.iter().enumerate() {
            let sc = decision(applied, pick, clipped, coef, unscale);
            for (i, (p, m, v, c)) in host.iter_mut().enumerate() {
                let g = mixed(lens[i], 1000 * i as u64 + 10 + k as u64, 2.0);
                let ch = &choices[usize::from(decay[i])];
                host::anyprecision_decided(ch, kind, &sc, p, &g, m, v, Some(&mut c[..])).unwrap();
                bufs[5 * i + 1] = guarded(&g);
            }
            bufs[5 * count] = bytes_of(&sc);
            let args = vec![
                list.clone(),
                Arg::u32(count as u32),
                Arg::buf(5 * count),
                anyprecision_choice_arg(&choices[0]),
                anyprecision_choice_arg(&choices[1]),
                Arg::u32(u32::from(kind.param == DType::BF16)),
            ];
            emu.run(&mut bufs, &[per_segment(kernel, &lens, args)]);
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
