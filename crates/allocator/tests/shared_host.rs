//! The allocator over [`SharedHostSource`] (segments in sealed `memfd` regions): the shared
//! scenarios hold there as over private host memory, and every block lies in a region that
//! other processes can map.
#![cfg(all(target_os = "linux", not(miri)))] // Miri does not model memfd or file mappings

mod common;

use common::*;
use fsdp_allocator::{Block, SharedHostSource};
use fsdp_device::shared::region_of;
use proptest::prelude::*;

/// Shared host memory: the scenarios' bytes go into the blocks themselves.
#[derive(Default)]
struct SharedMemory;

impl CpuMemory for SharedMemory {
    type Src = SharedHostSource;

    fn source(capacity: usize) -> SharedHostSource {
        SharedHostSource::new(capacity)
    }

    fn write_pattern(&self, b: &Block<SharedHostSource>, byte: u8) {
        assert!(
            region_of(b.as_ptr(), b.size()).is_some(),
            "a block outside every shared region"
        );
        // SAFETY: the handle owns `b.size()` bytes of host memory at `as_ptr()`.
        unsafe { write_host_pattern(b.as_ptr(), b.size(), byte) }
    }

    fn check_pattern(&self, b: &Block<SharedHostSource>, byte: u8) -> bool {
        // SAFETY: as in write_pattern; the bytes were initialised (zeroed segments, then
        // written), and nothing else writes them while the handle lives.
        unsafe { check_host_pattern(b.as_ptr(), b.size(), byte) }
    }
}

type SharedHarness = CpuHarness<SharedMemory>;

const BIG: usize = 1 << 36; // virtual capacity: pages are only touched where tests write

proptest! {
    #![proptest_config(proptest_config(8))]

    /// Random allocate / free / record_stream / stall / release / empty_cache operations on
    /// three streams, with every invariant checked after each.
    #[test]
    fn random_ops_keep_every_invariant(ops in prop::collection::vec(op_strategy(), 200)) {
        let summary = random_ops_scenario(&SharedHarness::new(BIG), &ops);
        prop_assert_eq!(summary.ooms, 0);
    }
}

#[test]
fn out_of_memory_error_and_message() {
    oom_scenario(&SharedHarness::new(BIG));
}
