//! Proptest's configuration for the property tests that also run under Miri (`.ci/run`), shared
//! by the integration tests (through `common`, or on its own with `#[path]`) and the crate's unit
//! tests (`src/conf_tests.rs`, with `#[path]`).
#![allow(dead_code)]

use proptest::prelude::ProptestConfig;

/// `cases` random cases, or `cases_under_miri` under Miri, which interprets every step; no
/// failure persistence under Miri, whose isolation keeps the regression file from being located
/// (no `getcwd`).
pub fn miri_aware_config(cases: u32, cases_under_miri: u32) -> ProptestConfig {
    ProptestConfig {
        cases: if cfg!(miri) { cases_under_miri } else { cases },
        failure_persistence: if cfg!(miri) {
            None
        } else {
            ProptestConfig::default().failure_persistence
        },
        ..ProptestConfig::default()
    }
}

/// `cases` random cases (one under Miri): [`miri_aware_config`].
pub fn proptest_config(cases: u32) -> ProptestConfig {
    miri_aware_config(cases, 1)
}

/// Operations per random run: `n`, or a few under Miri, which interprets every step.
pub const fn ops_len(n: usize) -> usize {
    if cfg!(miri) {
        30
    } else {
        n
    }
}
