//! What the optimizers' emulated tests share: guarded buffers, the decisions they run over,
//! the many-tensor tests' tensors.

use crate::common::data;
use crate::common::emulator::{addr, bytes_of, values_of};
use fsdp_kernels::host::{
    self, AdamW, STEP_APPLIED, STEP_CHOICE, STEP_CLIPPED, STEP_CLIP_COEF, STEP_UNSCALE,
};
use fsdp_kernels::launch::plan::DecidedTensor;
use half::bf16;

/// AdamW at `lr` and `weight_decay` with the GPU tests' betas (0.9, 0.95) and eps (1e-8).
pub(crate) fn adamw_cfg(lr: f64, weight_decay: f64) -> AdamW {
    AdamW {
        lr,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay,
    }
}

/// The guard past each buffer's end (and in a packed bf16 state's unused half).
pub(crate) const GUARD: f32 = -1234.5;

pub(crate) fn guard_bf16() -> u16 {
    bf16::from_f32(GUARD).to_bits()
}

/// `n` values uniform in `[-scale, scale)` (`common::data`), with zeros of both signs and
/// subnormals among them.
pub(crate) fn mixed(n: usize, seed: u64, scale: f32) -> Vec<f32> {
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
pub(crate) fn guarded(v: &[f32]) -> Vec<u8> {
    let mut b = bytes_of(v);
    b.extend_from_slice(&GUARD.to_le_bytes());
    b
}

/// The `n` f32 values of a [`guarded`] buffer, its guard checked.
pub(crate) fn unguard(b: &[u8], n: usize, what: &str) -> Vec<f32> {
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
pub(crate) fn assert_bits(got: &[f32], want: &[f32], what: &str) {
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
pub(crate) trait Moment: host::MomentFloat {
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
pub(crate) fn guarded_moment<S: Moment>(v: &[S]) -> Vec<u8> {
    v.iter()
        .copied()
        .chain([S::store(GUARD)])
        .flat_map(|x| x.bits().to_le_bytes()[..S::SIZE].to_vec())
        .collect()
}

/// The `n` values of a [`guarded_moment`] buffer, its guard checked, as f32 bits.
pub(crate) fn unguard_moment<S: Moment>(b: &[u8], n: usize, what: &str) -> Vec<f32> {
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

pub(crate) fn f32s<S: Moment>(v: &[S]) -> Vec<f32> {
    v.iter().map(|x| x.load()).collect()
}

/// A step's scalars as a decision leaves them: applied or not, the choice, clipped by `coef`
/// or not, a grad scaler's unscaling (0: none).
pub(crate) fn decision(
    applied: f64,
    choice: f64,
    clipped: f64,
    coef: f64,
    unscale: f64,
) -> Vec<f64> {
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
pub(crate) fn decisions() -> Vec<(f64, f64, f64, f64, f64)> {
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
pub(crate) fn assert_scalars_kept(b: &[u8], sc: &[f64], what: &str) {
    let got: Vec<f64> = values_of(b);
    let same = got.iter().zip(sc).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same && got.len() == sc.len(), "{what}: the scalars changed");
}

/// The tensors of the `_many` tests: tensor `t` of `lens[t]` elements (with weight decay
/// where `decay[t]`) on buffers `stride·t ..`: its parameter, gradient, moments and, where
/// `compensation`, its Kahan compensation (`plan::DecidedTensor`).
pub(crate) fn decided_tensors(
    lens: &[usize],
    decay: &[bool],
    stride: usize,
    compensation: bool,
) -> Vec<DecidedTensor> {
    lens.iter()
        .zip(decay)
        .enumerate()
        .map(|(t, (&n, &decay))| {
            let at = |f: usize| addr(stride * t + f);
            DecidedTensor {
                param: at(0),
                grad: at(1),
                exp_avg: at(2),
                exp_avg_sq: at(3),
                compensation: compensation.then(|| at(4)),
                n,
                decay,
            }
        })
        .collect()
}

/// The one-tensor kernels' length: 3 blocks of 256, the last partial, odd (a packed bf16
/// state's last half unused).
pub(crate) const N: usize = 517;

/// Lengths of the multi-tensor tests' tensors: empty, one element, odd, around a block of 256,
/// and longer than one pass of the blocks along x (2 blocks of 256 for 2500: each thread takes
/// several elements).
pub(crate) const MANY_LENS: [usize; 7] = [257, 1, 0, 256, 2049, 3, 2500];
