//! Twin of `anyprecision_decided`: torchdistx's `AnyPrecisionAdamW` as the end of a step
//! decided on the device (see [`step`](super::step)): nothing unless the step is applied, the
//! chosen scalar set, the gradient times the clipping coefficient when clipped. Every line is
//! one PyTorch operation computed in f32 and rounded once to the dtype it writes, as
//! `fsdp::optim::AnyPrecisionAdamWState` computes it (tested bitwise against it).
//!
//! The parameters are f32 buffers whose values are rounded to [`AnyPrecision::param`] after
//! every operation that writes them (bf16: the values of bf16 shards). The momentum, the
//! variance and the Kahan compensation are stored in [`AnyPrecision::state`]: as f32, or as
//! bf16 *packed* two to an f32 element ([`state_len`]: element `i` is the `i`-th bf16 of the
//! buffer's bytes), so that they live in the same buffers as everything else and take 2 bytes
//! an element.

use fsdp_device::DType;
use half::bf16;

use super::optim::AdamW;
use super::step::check_scalars_len;
use super::{same_len, STEP_CHOICES};
use crate::KernelError;

/// The dtypes of an `AnyPrecisionAdamW` run on the device, and whether it compensates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnyPrecision {
    /// The dtype the parameters' values are rounded to (f32 or bf16).
    pub param: DType,
    /// The dtype of the momentum, the variance and the compensation (f32 or bf16).
    pub state: DType,
    /// Kahan summation of the update into a compensation buffer.
    pub kahan: bool,
}

impl AnyPrecision {
    /// Checks that both dtypes are f32 or bf16.
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] naming the dtype.
    pub fn validate(&self) -> Result<(), KernelError> {
        for (what, d) in [("parameter", self.param), ("state", self.state)] {
            if d != DType::F32 && d != DType::BF16 {
                return Err(KernelError::InvalidArgument {
                    kernel: "anyprecision_decided",
                    reason: format!("{what} dtype {d:?}: f32 or bf16 on the device"),
                });
            }
        }
        Ok(())
    }

    /// Bytes of state per parameter element: two moments and, with Kahan summation, the
    /// compensation.
    pub fn state_bytes_per_element(&self) -> u64 {
        (2 + u64::from(self.kahan)) * self.state.size_in_bytes() as u64
    }
}

/// The f32 elements of a state buffer of `n` values stored in `state` (bf16: two a slot).
pub fn state_len(n: usize, state: DType) -> usize {
    if state == DType::BF16 {
        n.div_ceil(2)
    } else {
        n
    }
}

/// The per-step scalars of `AnyPrecisionAdamW`, in f32 as torchdistx computes them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AnyPrecisionScalars {
    /// `f32(1 − lr·weight_decay)` (computed in f64), `None` without decay.
    pub decay: Option<f32>,
    /// `beta1`.
    pub beta1: f32,
    /// `1 − beta1` (computed in f64).
    pub one_minus_beta1: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 − beta2` (computed in f64).
    pub one_minus_beta2: f32,
    /// `√(1 − beta2^step)` in f32.
    pub denom_correction: f32,
    /// `eps`.
    pub eps: f32,
    /// `−lr / (1 − beta1^step)`, as torchdistx's f32 tensors compute it.
    pub neg_step_size: f32,
}

impl AnyPrecisionScalars {
    /// The scalars of step number `step` (1 for the first): torchdistx's step count is an f32
    /// tensor, `beta ** step` an f32 power, `lr / t` the reciprocal times `lr`.
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] for `step == 0` or a non-finite setting.
    pub fn new(cfg: &AdamW, step: u64) -> Result<AnyPrecisionScalars, KernelError> {
        let all = [cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay];
        if step == 0 || all.iter().any(|v| !v.is_finite()) {
            return Err(KernelError::InvalidArgument {
                kernel: "anyprecision_decided",
                reason: format!("step {step} (counted from 1) with {cfg:?}"),
            });
        }
        let t = step as f32;
        let bias_correction1 = 1.0f32 - (cfg.beta1 as f32).powf(t);
        let step_size = (1.0f32 / bias_correction1) * cfg.lr as f32;
        Ok(AnyPrecisionScalars {
            decay: (cfg.weight_decay != 0.0).then_some((1.0 - cfg.lr * cfg.weight_decay) as f32),
            beta1: cfg.beta1 as f32,
            one_minus_beta1: (1.0 - cfg.beta1) as f32,
            beta2: cfg.beta2 as f32,
            one_minus_beta2: (1.0 - cfg.beta2) as f32,
            denom_correction: (1.0f32 - (cfg.beta2 as f32).powf(t)).sqrt(),
            eps: cfg.eps as f32,
            neg_step_size: -step_size,
        })
    }
}

/// The `AnyPrecisionAdamW` scalars of the optimizer step numbers `base_steps + 1 ..=
/// base_steps + STEP_CHOICES`, one of which the decision chooses (as
/// [`AdamWChoice`](super::AdamWChoice)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AnyPrecisionChoice(pub [AnyPrecisionScalars; STEP_CHOICES]);

/// A value rounded to `d` (f32 or bf16) and widened back.
#[inline(always)]
fn round(d: DType, x: f32) -> f32 {
    if d == DType::BF16 {
        bf16::from_f32(x).to_f32()
    } else {
        x
    }
}

/// A state buffer's values, f32 or packed bf16.
enum State<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
}

impl State<'_> {
    fn of(buf: &mut [f32], n: usize, d: DType) -> State<'_> {
        if d == DType::BF16 {
            State::Bf16(&mut bytemuck::cast_slice_mut(buf)[..n])
        } else {
            State::F32(&mut buf[..n])
        }
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        match self {
            State::F32(s) => s[i],
            State::Bf16(s) => s[i].to_f32(),
        }
    }
    /// Stores `x` (rounded to the state's dtype).
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32) {
        match self {
            State::F32(s) => s[i] = x,
            State::Bf16(s) => s[i] = bf16::from_f32(x),
        }
    }
}

/// Twin of `anyprecision_decided_f32` and `anyprecision_decided_bf16_state`: nothing unless
/// [`STEP_APPLIED`](super::STEP_APPLIED) is 1; else `AnyPrecisionAdamW` with the chosen scalar
/// set on the gradient, first unscaled and clipped as the AdamW twin reads it (`decided_grad`).
/// `exp_avg`, `exp_avg_sq` and `compensation` hold [`state_len`] elements; the compensation is
/// required with Kahan summation and ignored without.
///
/// # Errors
/// [`KernelError::Length`] for lengths that differ; [`KernelError::InvalidArgument`] for a bad
/// dtype, a missing compensation or a short scalar buffer.
#[allow(clippy::too_many_arguments)]
pub fn anyprecision_decided(
    choice: &AnyPrecisionChoice,
    kind: AnyPrecision,
    scalars: &[f64],
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    compensation: Option<&mut [f32]>,
) -> Result<(), KernelError> {
    let n = param.len();
    let lens = [
        scalars.len(),
        n,
        grad.len(),
        exp_avg.len(),
        exp_avg_sq.len(),
    ];
    let kahan = check_call(kind, lens, compensation.as_ref().map(|c| c.len()))?;
    let comp = compensation
        .filter(|_| kahan)
        .map(|c| State::of(c, n, kind.state));
    let Some(s) = super::step::chosen(&choice.0, scalars) else {
        return Ok(());
    };
    let grad = super::decided_grad(scalars, grad);
    let (pd, sd) = (kind.param, kind.state);
    let mut m = State::of(exp_avg, n, sd);
    let mut v = State::of(exp_avg_sq, n, sd);
    // `add_(eps)` converts its scalar to the tensor's dtype.
    let eps = round(sd, s.eps);
    let mut comp = comp;
    for i in 0..n {
        let g = grad[i];
        let mut pf = param[i];
        if let Some(decay) = s.decay {
            // p.mul_(1 - lr*wd)
            pf = round(pd, pf * decay);
        }
        // exp_avg.mul_(beta1).add_(grad, alpha=1-beta1)
        let mut mf = round(sd, m.get(i) * s.beta1);
        mf = round(sd, s.one_minus_beta1.mul_add(g, mf));
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2)
        let mut vf = round(sd, v.get(i) * s.beta2);
        vf = round(sd, (s.one_minus_beta2 * g).mul_add(g, vf));
        m.set(i, mf);
        v.set(i, vf);
        // (exp_avg_sq.sqrt() / denom_correction).add_(eps, alpha=1)
        let mut d = round(sd, vf.sqrt());
        d = round(sd, d / s.denom_correction);
        d = round(sd, d + eps);
        param[i] = match &mut comp {
            Some(c) => {
                // compensation.addcdiv_(exp_avg, denom, value=-step_size)
                let cf = round(sd, c.get(i) + s.neg_step_size * mf / d);
                let pn = round(pd, pf + cf); // p.data.add_(compensation)
                let t = round(pd, pf - pn); // temp_buffer.sub_(p.data)
                c.set(i, cf + t); // compensation.add_(temp_buffer)
                pn
            }
            // p.data.addcdiv_(exp_avg, denom, value=-step_size)
            None => round(pd, pf + s.neg_step_size * mf / d),
        };
    }
    Ok(())
}

/// Checks a call of `anyprecision_decided` (twin or kernel): `kind`'s dtypes, and the lengths
/// `[scalars, param, grad, exp_avg, exp_avg_sq]` and the compensation's — the scalars at
/// least the decision's slots, the gradient the parameter's, each state buffer
/// [`state_len`] of it, the compensation present with Kahan summation. Returns whether the
/// compensation is used (Kahan summation).
pub(crate) fn check_call(
    kind: AnyPrecision,
    [scalars, n, grad, exp_avg, exp_avg_sq]: [usize; 5],
    compensation: Option<usize>,
) -> Result<bool, KernelError> {
    const K: &str = "anyprecision_decided";
    kind.validate()?;
    check_scalars_len(K, scalars, 0)?;
    let sn = state_len(n, kind.state);
    same_len(K, "grad", n, grad)?;
    same_len(K, "exp_avg", sn, exp_avg)?;
    same_len(K, "exp_avg_sq", sn, exp_avg_sq)?;
    match (kind.kahan, compensation) {
        (true, Some(c)) => {
            same_len(K, "compensation", sn, c)?;
            Ok(true)
        }
        (true, None) => Err(KernelError::InvalidArgument {
            kernel: K,
            reason: "Kahan summation without a compensation buffer".into(),
        }),
        (false, _) => Ok(false),
    }
}

/// `values` stored as [`state_len`] f32 elements of `state` (bf16: rounded and packed).
pub fn pack_state(values: &[f32], state: DType) -> Vec<f32> {
    if state != DType::BF16 {
        return values.to_vec();
    }
    let mut out = vec![0.0f32; state_len(values.len(), state)];
    let halves: &mut [bf16] = bytemuck::cast_slice_mut(&mut out);
    for (h, &x) in halves.iter_mut().zip(values) {
        *h = bf16::from_f32(x);
    }
    out
}

/// The `n` values of a state buffer `packed` of `state` (bf16: unpacked and widened).
///
/// # Errors
/// [`KernelError::Length`] when `packed` is not [`state_len`] of `n`.
pub fn unpack_state(packed: &[f32], n: usize, state: DType) -> Result<Vec<f32>, KernelError> {
    same_len("unpack_state", "state", state_len(n, state), packed.len())?;
    if state != DType::BF16 {
        return Ok(packed.to_vec());
    }
    let halves: &[bf16] = bytemuck::cast_slice(packed);
    Ok(halves[..n].iter().map(|h| h.to_f32()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{step_scalars_len, STEP_APPLIED, STEP_CHOICE, STEP_CLIPPED, STEP_CLIP_COEF};
    use fsdp::optim::{
        AnyPrecisionAdamWConfig, AnyPrecisionAdamWState, OptimizerConfig, OptimizerState,
    };

    fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let h = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 20_011;
                (h as f32 / 20_011.0 - 0.47) * scale
            })
            .collect()
    }

    fn hyper(weight_decay: f64) -> AdamW {
        AdamW {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay,
        }
    }

    /// Steps 1..=6 of every kind (parameter and state dtypes, Kahan on and off, with and
    /// without decay, clipped on even steps) against `fsdp`'s `AnyPrecisionAdamWState`
    /// given the same clipped gradients: bitwise, parameters and every state buffer.
    #[test]
    fn the_twin_is_torchdistx_as_fsdp_computes_it() {
        let n = 1001;
        for param in [DType::F32, DType::BF16] {
            for state in [DType::F32, DType::BF16] {
                for kahan in [false, true] {
                    for wd in [0.0, 0.1] {
                        let kind = AnyPrecision {
                            param,
                            state,
                            kahan,
                        };
                        check_kind(kind, wd, n);
                    }
                }
            }
        }
    }

    fn check_kind(kind: AnyPrecision, wd: f64, n: usize) {
        let h = hyper(wd);
        let cfg = AnyPrecisionAdamWConfig {
            lr: h.lr,
            beta1: h.beta1,
            beta2: h.beta2,
            eps: h.eps,
            weight_decay: h.weight_decay,
            use_kahan_summation: kind.kahan,
            momentum_dtype: kind.state,
            variance_dtype: kind.state,
            compensation_buffer_dtype: kind.state,
        };
        let round_p = |x: f32| round(kind.param, x);
        let mut p: Vec<f32> = values(n, 1, 2.0).into_iter().map(round_p).collect();
        let mut reference = p.clone();
        let mut st = AnyPrecisionAdamWState::try_new(&cfg, n).unwrap();
        let sn = state_len(n, kind.state);
        let (mut m, mut v, mut c) = (vec![0.0; sn], vec![0.0; sn], vec![0.0; sn]);
        let mut scalars = vec![0.0; step_scalars_len(0)];
        scalars[STEP_APPLIED] = 1.0;
        for step in 1..=6u64 {
            let g = values(n, 10 + step as u32, 0.05);
            let coef = 0.75f32;
            let clipped = step % 2 == 0;
            scalars[STEP_CLIPPED] = if clipped { 1.0 } else { 0.0 };
            scalars[STEP_CLIP_COEF] = f64::from(coef);
            // The decision chose the second set: step `step` is `base + 2`.
            scalars[STEP_CHOICE] = 1.0;
            let at = |k| AnyPrecisionScalars::new(&h, k).unwrap();
            let choice = AnyPrecisionChoice([at(step.max(2) - 1), at(step.max(2))]);
            if step == 1 {
                scalars[STEP_CHOICE] = 0.0;
            }
            let comp = kind.kahan.then_some(&mut c[..]);
            anyprecision_decided(&choice, kind, &scalars, &mut p, &g, &mut m, &mut v, comp)
                .unwrap();
            let gref: Vec<f32> = if clipped {
                g.iter().map(|&x| coef * x + 0.0).collect()
            } else {
                g.clone()
            };
            if kind.param == DType::BF16 {
                let mut pb: Vec<bf16> = reference.iter().map(|&x| bf16::from_f32(x)).collect();
                st.step(&cfg, &mut pb, &gref).unwrap();
                reference = pb.iter().map(|x| x.to_f32()).collect();
            } else {
                let mut os = OptimizerState::AnyPrecisionAdamW(st);
                os.step(
                    &OptimizerConfig::AnyPrecisionAdamW(cfg),
                    &mut reference,
                    &gref,
                )
                .unwrap();
                let OptimizerState::AnyPrecisionAdamW(back) = os else {
                    unreachable!()
                };
                st = back;
            }
            let what = format!("{kind:?} wd {wd} step {step}");
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&p), bits(&reference), "parameters, {what}");
            let unpack = |b: &[f32]| bits(&unpack_state(b, n, kind.state).unwrap());
            assert_eq!(
                unpack(&m),
                bits(&st.exp_avg.to_f32_vec()),
                "exp_avg, {what}"
            );
            assert_eq!(
                unpack(&v),
                bits(&st.exp_avg_sq.to_f32_vec()),
                "exp_avg_sq, {what}"
            );
            if kind.kahan {
                let cref = st.compensation.as_ref().unwrap().to_f32_vec();
                assert_eq!(unpack(&c), bits(&cref), "compensation, {what}");
            }
        }
        // Updates happened: the parameters moved.
        assert_ne!(
            p,
            values(n, 1, 2.0)
                .into_iter()
                .map(round_p)
                .collect::<Vec<_>>()
        );
    }

    /// Not applied: nothing changes; bad lengths, dtypes and a missing compensation refused.
    #[test]
    fn unapplied_steps_change_nothing_and_bad_input_is_refused() {
        let kind = AnyPrecision {
            param: DType::BF16,
            state: DType::BF16,
            kahan: true,
        };
        let at = AnyPrecisionScalars::new(&hyper(0.1), 1).unwrap();
        let choice = AnyPrecisionChoice([at; STEP_CHOICES]);
        let scalars = vec![0.0; step_scalars_len(0)];
        let (mut p, g) = (vec![1.0f32; 5], vec![0.5f32; 5]);
        let (mut m, mut v, mut c) = (vec![0.0; 3], vec![0.0; 3], vec![0.0; 3]);
        anyprecision_decided(
            &choice,
            kind,
            &scalars,
            &mut p,
            &g,
            &mut m,
            &mut v,
            Some(&mut c),
        )
        .unwrap();
        assert_eq!((p[0], m[0]), (1.0, 0.0));
        let short = anyprecision_decided(
            &choice,
            kind,
            &scalars,
            &mut p,
            &g,
            &mut m,
            &mut v[..2],
            Some(&mut c),
        );
        assert!(
            matches!(
                short,
                Err(KernelError::Length {
                    what: "exp_avg_sq",
                    ..
                })
            ),
            "{short:?}"
        );
        let none = anyprecision_decided(&choice, kind, &scalars, &mut p, &g, &mut m, &mut v, None);
        assert!(none.unwrap_err().to_string().contains("compensation"));
        let f16 = AnyPrecision {
            state: DType::F16,
            ..kind
        };
        assert!(f16
            .validate()
            .unwrap_err()
            .to_string()
            .contains("state dtype"));
        assert!(AnyPrecisionScalars::new(&hyper(0.1), 0).is_err());
    }

    /// Packing: bf16 state round-trips its rounded values, f32 is the identity.
    #[test]
    fn packed_state_round_trips() {
        let x = [1.0f32, 1.0 + 2f32.powi(-10), -3.5];
        let packed = pack_state(&x, DType::BF16);
        assert_eq!(packed.len(), 2);
        assert_eq!(
            unpack_state(&packed, 3, DType::BF16).unwrap(),
            vec![1.0, 1.0, -3.5]
        );
        assert_eq!(
            unpack_state(&pack_state(&x, DType::F32), 3, DType::F32).unwrap(),
            x
        );
        assert!(unpack_state(&packed, 5, DType::BF16).is_err());
        let kind = AnyPrecision {
            param: DType::F32,
            state: DType::BF16,
            kahan: true,
        };
        assert_eq!(kind.state_bytes_per_element(), 6);
    }
}
