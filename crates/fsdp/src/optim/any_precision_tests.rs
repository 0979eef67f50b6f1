//! Unit tests of [`super`] (AnyPrecisionAdamW).
use super::*;

fn b(x: f32) -> bf16 {
    bf16::from_f32(x)
}

#[test]
fn scalars_follow_torchdistx() {
    let cfg = AnyPrecisionAdamWConfig {
        lr: 1e-3,
        weight_decay: 0.1,
        ..Default::default()
    };
    let s = Scalars::new(&cfg, 1);
    // bias_correction1 = 1 - f32(0.9) = 0.100000024 (f32), its reciprocal times f32(1e-3).
    let bc1 = 1.0f32 - 0.9f32;
    assert_eq!(s.neg_step_size, -((1.0f32 / bc1) * 1e-3f32));
    assert_eq!(s.denom_correction, (1.0f32 - 0.999f32).sqrt());
    assert_eq!(s.decay, Some((1.0f64 - 1e-4) as f32));
    assert_eq!(
        Scalars::new(&AnyPrecisionAdamWConfig::default(), 3).decay,
        None
    );
    // Late steps: both corrections are exactly 1.
    let late = Scalars::new(&cfg, 1_000_000);
    assert_eq!(late.denom_correction, 1.0);
    assert_eq!(late.neg_step_size, -1e-3f32);
}

/// The derivation of the stall test in miniature: updates of 2⁻¹² from 1.0 (half an ulp
/// below 1.0 is 2⁻⁹) are all exact in the compensation, so after k steps p + c = 1 − k·2⁻¹²
/// exactly, with p the bf16 nearest to it.
#[test]
fn kahan_update_is_exact_for_representable_steps() {
    // Converged moments (m = v = 1 with g = 1), past the bias correction.
    let cfg = AnyPrecisionAdamWConfig {
        lr: 2f64.powi(-12),
        ..Default::default()
    };
    let mut st = AnyPrecisionAdamWState::try_new(&cfg, 1).unwrap();
    st.step = 1_000_000;
    st.exp_avg = PrecisionVec::BF16(vec![b(1.0)]);
    st.exp_avg_sq = PrecisionVec::BF16(vec![b(1.0)]);
    let mut p = [b(1.0)];
    for k in 1..=9 {
        st.step(&cfg, &mut p, &[1.0]).unwrap();
        let c = st.compensation.as_ref().unwrap().to_f32_vec()[0];
        let exact = 1.0 - k as f32 * 2f32.powi(-12);
        assert_eq!(p[0].to_f32() + c, exact, "step {k}");
        assert_eq!(p[0], b(exact), "step {k}");
    }
    // Nine steps: p moved one ulp down, the compensation holds the remainder 7·2⁻¹².
    assert_eq!(p[0].to_f32(), 1.0 - 2f32.powi(-8));
    assert_eq!(
        st.compensation.unwrap().to_f32_vec(),
        vec![7.0 * 2f32.powi(-12)]
    );
    assert_eq!(st.exp_avg.to_f32_vec(), vec![1.0]);
    assert_eq!(st.exp_avg_sq.to_f32_vec(), vec![1.0]);
}

#[test]
fn without_kahan_small_updates_are_lost() {
    let cfg = AnyPrecisionAdamWConfig {
        lr: 2f64.powi(-12),
        use_kahan_summation: false,
        ..Default::default()
    };
    let mut st = AnyPrecisionAdamWState::try_new(&cfg, 1).unwrap();
    assert!(st.compensation.is_none());
    st.step = 1_000_000;
    st.exp_avg = PrecisionVec::BF16(vec![b(1.0)]);
    st.exp_avg_sq = PrecisionVec::BF16(vec![b(1.0)]);
    let mut p = [b(1.0)];
    for _ in 0..100 {
        st.step(&cfg, &mut p, &[1.0]).unwrap();
    }
    assert_eq!(p[0], b(1.0));
}

#[test]
fn f32_state_and_parameter_is_plain_f32_arithmetic() {
    let cfg = AnyPrecisionAdamWConfig {
        use_kahan_summation: false,
        momentum_dtype: DType::F32,
        variance_dtype: DType::F32,
        ..Default::default()
    };
    let mut st = AnyPrecisionAdamWState::try_new(&cfg, 1).unwrap();
    let mut p = [0.5f32];
    st.step_slice(&cfg, &mut p, &[0.25]).unwrap();
    let s = Scalars::new(&cfg, 1);
    let m = s.one_minus_beta1.mul_add(0.25, 0.0f32 * 0.9);
    let v = (s.one_minus_beta2 * 0.25).mul_add(0.25, 0.0f32 * s.beta2);
    let d = v.sqrt() / s.denom_correction + s.eps;
    assert_eq!(p[0], 0.5 + s.neg_step_size * m / d);
    assert_eq!(st.exp_avg, PrecisionVec::F32(vec![m]));
}

#[test]
fn precision_vec_round_trips() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let v = PrecisionVec::from_f32(dtype, &[1.5, -0.25, 0.0]).unwrap();
        assert_eq!(v.dtype(), dtype);
        assert_eq!(v.len(), 3);
        assert_eq!(v.to_f32_vec(), vec![1.5, -0.25, 0.0]);
        assert_eq!(v.size_in_bytes(), 3 * dtype.size_in_bytes());
    }
    assert!(PrecisionVec::try_zeros(DType::F64, 1, "x").is_err());
    assert!(matches!(
        PrecisionVec::try_zeros(DType::BF16, usize::MAX / 2, "the test buffer"),
        Err(FsdpError::HostOutOfMemory { .. })
    ));
}
