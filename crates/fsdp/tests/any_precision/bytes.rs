//! (d) Bytes per parameter.

use super::*;

#[test]
fn bytes_per_parameter() {
    let any = AnyPrecisionAdamWConfig::default();
    // Pure bf16: parameter 2 + exp_avg 2 + exp_avg_sq 2 + compensation 2.
    assert_eq!(any.state_bytes_per_element(), 6);
    let cfg = OptimizerConfig::from(any);
    assert_eq!(cfg.state_bytes_per_element(), 6);
    assert_eq!(cfg.sharded_bytes_per_param(DType::BF16), 8);
    // f32 AdamW on f32 parameters: 4 + 4 + 4.
    let adamw = OptimizerConfig::from(AdamWConfig::default());
    assert_eq!(adamw.state_bytes_per_element(), 8);
    assert_eq!(adamw.sharded_bytes_per_param(DType::F32), 12);
    // Variants.
    let no_kahan = AnyPrecisionAdamWConfig {
        use_kahan_summation: false,
        compensation_buffer_dtype: DType::F32,
        ..any
    };
    assert_eq!(no_kahan.state_bytes_per_element(), 4);
    let torchdistx_defaults = AnyPrecisionAdamWConfig {
        use_kahan_summation: false,
        momentum_dtype: DType::F32,
        ..any
    };
    assert_eq!(
        OptimizerConfig::from(torchdistx_defaults).sharded_bytes_per_param(DType::F32),
        10
    );
    assert_eq!(
        OptimizerConfig::from(SgdConfig::with_momentum(0.1, 0.9)).state_bytes_per_element(),
        4
    );
    assert_eq!(
        OptimizerConfig::from(SgdConfig::with_momentum(0.1, 0.0)).state_bytes_per_element(),
        0
    );
    // The allocated state agrees with the per-element figure.
    for c in [cfg, adamw, no_kahan.into(), torchdistx_defaults.into()] {
        let st = OptimizerState::try_new(&c, 1000).unwrap();
        assert_eq!(
            st.size_in_bytes(),
            1000 * c.state_bytes_per_element(),
            "{c:?}"
        );
    }
}
