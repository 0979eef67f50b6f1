//! Scenarios shared by the host, meta and CUDA tests: each runs against any memory source
//! through a [`Harness`] that provides three streams and ways to hold them up.
#![allow(dead_code)]

pub const MIB: usize = 1 << 20;
pub const KIB: usize = 1 << 10;
/// How many bytes at each end of a block [`Harness::write_pattern`] writes.
pub const PATTERN: usize = 64;

mod checks;
mod harness;
mod host_pattern;
mod miri;
mod random_ops;
mod scenarios;
// Only the host sources' tests write host patterns.
#[allow(unused_imports)]
pub use host_pattern::{check_host_pattern, write_host_pattern};
// Not every test that includes `common` runs property tests (`cuda.rs` does not).
#[allow(unused_imports)]
pub use miri::{ops_len, proptest_config};
// Not every test uses every harness, checker or scenario.
#[allow(unused_imports)]
pub use checks::{check_invariants, check_snapshot_against_stats};
#[allow(unused_imports)]
pub use harness::{CpuHarness, CpuMemory, Harness};
#[allow(unused_imports)]
pub use random_ops::{
    op_strategy, random_ops_limited_scenario, random_ops_scenario, run_ops, Op, RunSummary,
};
#[allow(unused_imports)]
pub use scenarios::{
    max_split_scenario, oom_scenario, paper_scenario, paper_scenario_both, per_stream_scenario,
    snapshot_scenario,
};
