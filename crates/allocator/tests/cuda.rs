//! The host scenarios on real device memory (feature `cuda`). Without a CUDA driver or GPU each
//! test prints that it skipped and passes.
#![cfg(feature = "cuda")]

mod common;

use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use crossbeam_channel::{Receiver, Sender};
use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream};
use fsdp_allocator::cuda::{CudaAllocator, CudaBlock, CudaSource};
use fsdp_allocator::{AllocError, AllocatorConfig};
use fsdp_device::{Device, Storage};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

struct CudaHarness {
    ctx: Arc<CudaContext>,
    streams: [Arc<CudaStream>; 3],
    gates: [Mutex<Vec<Sender<()>>>; 3],
}

/// The harness, or `None` after printing why the test skipped.
fn harness(test: &str) -> Option<CudaHarness> {
    match CudaSource::new(0) {
        Ok(src) => {
            let ctx = src.context().clone();
            let s = || ctx.new_stream().expect("a CUDA stream");
            Some(CudaHarness {
                streams: [s(), s(), s()],
                ctx,
                gates: Default::default(),
            })
        }
        Err(e) if !fsdp_allocator::cuda::driver_present() => {
            println!("{test}: skipped: no CUDA driver ({e})");
            None
        }
        Err(e) => {
            println!("{test}: skipped: no usable GPU ({e})");
            None
        }
    }
}

/// A host function that blocks its stream until its gate closes or its time is up.
unsafe extern "C" fn stall_fn(arg: *mut c_void) {
    // SAFETY: `arg` is the Box leaked by `CudaHarness::stall`, passed to exactly one call.
    let gate = unsafe { Box::from_raw(arg.cast::<(Receiver<()>, Duration)>()) };
    let _ = gate.0.recv_timeout(gate.1);
}

/// A host function that occupies its stream for a while (simulated kernel time).
unsafe extern "C" fn busy_fn(arg: *mut c_void) {
    // SAFETY: `arg` is the Box leaked by `CudaHarness::busy`, passed to exactly one call.
    let d = unsafe { Box::from_raw(arg.cast::<Duration>()) };
    std::thread::sleep(*d);
}

impl CudaHarness {
    fn launch<T>(&self, i: usize, f: unsafe extern "C" fn(*mut c_void), arg: T) {
        self.ctx.bind_to_thread().unwrap();
        let arg = Box::into_raw(Box::new(arg)).cast::<c_void>();
        // SAFETY: the stream is live; `f` takes ownership of `arg` (a leaked Box of the type it
        // expects) and makes no CUDA call.
        unsafe { result::stream::launch_host_function(self.streams[i].cu_stream(), f, arg) }
            .unwrap();
    }
}

impl Harness for CudaHarness {
    type Src = CudaSource;
    type Marker = CudaEvent;

    fn allocator(&self, config: AllocatorConfig) -> CudaAllocator {
        CudaAllocator::new(CudaSource::new(0).unwrap(), config).unwrap()
    }

    fn stream(&self, i: usize) -> &Arc<CudaStream> {
        &self.streams[i]
    }

    fn stall(&self, i: usize, max: Duration) {
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        self.gates[i].lock().unwrap().push(tx);
        self.launch(i, stall_fn, (rx, max));
    }

    fn release(&self, i: usize) {
        self.gates[i].lock().unwrap().clear();
    }

    fn busy(&self, i: usize, d: Duration) {
        self.launch(i, busy_fn, d);
    }

    fn wait_for(&self, waiter: usize, on: usize) {
        self.streams[waiter].join(&self.streams[on]).unwrap();
    }

    fn marker(&self, i: usize) -> CudaEvent {
        self.streams[i].record_event(None).unwrap()
    }

    fn marker_done(&self, m: &CudaEvent) -> bool {
        m.try_is_complete().unwrap()
    }

    fn marker_wait(&self, m: &CudaEvent, timeout: Duration) {
        let t0 = Instant::now();
        while !m.try_is_complete().unwrap() {
            assert!(t0.elapsed() < timeout, "marker timed out");
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn write_pattern(&self, b: &CudaBlock, byte: u8) {
        self.ctx.bind_to_thread().unwrap();
        let n = PATTERN.min(b.size());
        for off in [0, b.size() - n] {
            // SAFETY: the handle owns `b.size()` bytes of device memory from `addr()`.
            unsafe { result::memset_d8_sync(b.addr() + off as u64, byte, n) }.unwrap();
        }
    }

    fn check_pattern(&self, b: &CudaBlock, byte: u8) -> bool {
        self.ctx.bind_to_thread().unwrap();
        let n = PATTERN.min(b.size());
        let mut host = [0u8; PATTERN];
        [0, b.size() - n].iter().all(|&off| {
            // SAFETY: as in write_pattern; `host` has room for n bytes.
            unsafe { result::memcpy_dtoh_sync(&mut host[..n], b.addr() + off as u64) }.unwrap();
            host[..n].iter().all(|&x| x == byte)
        })
    }

    fn synchronize(&self, i: usize) {
        self.streams[i].synchronize().unwrap();
    }
}

#[test]
fn cuda_random_ops_keep_every_invariant() {
    let Some(h) = harness("cuda_random_ops_keep_every_invariant") else {
        return;
    };
    let mut runner = TestRunner::new(Config {
        cases: 6,
        ..Config::default()
    });
    runner
        .run(&prop::collection::vec(op_strategy(), 300), |ops| {
            random_ops_scenario(&h, &ops);
            Ok(())
        })
        .unwrap();
    runner
        .run(&prop::collection::vec(op_strategy(), 250), |ops| {
            random_ops_limited_scenario(&h, &ops);
            Ok(())
        })
        .unwrap();
}

#[test]
fn cuda_paper_scenario_rate_limiter_removes_retries() {
    if let Some(h) = harness("cuda_paper_scenario_rate_limiter_removes_retries") {
        paper_scenario_both(&h, "cuda");
    }
}

#[test]
fn cuda_out_of_memory_error_and_message() {
    let Some(h) = harness("cuda_out_of_memory_error_and_message") else {
        return;
    };
    oom_scenario(&h);
    // The driver's own out-of-memory (more than the whole GPU) goes through the same path.
    let alloc = h.allocator(AllocatorConfig::default());
    let total = alloc.source().context().total_mem().unwrap();
    let err = alloc.allocate(2 * total, h.stream(0)).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory { .. }), "{err}");
    println!("driver out-of-memory message: {err}");
    let msg = err.to_string();
    assert!(
        msg.starts_with("CUDA out of memory. Tried to allocate ") && msg.contains("GPU 0 has"),
        "{msg}"
    );
    let st = alloc.memory_stats();
    assert_eq!((st.num_ooms, st.num_alloc_retries), (1, 1));
}

#[test]
fn cuda_max_split_size_rules() {
    if let Some(h) = harness("cuda_max_split_size_rules") {
        max_split_scenario(&h);
    }
}

#[test]
fn cuda_snapshot_json_round_trip() {
    if let Some(h) = harness("cuda_snapshot_json_round_trip") {
        snapshot_scenario(&h);
    }
}

#[test]
fn cuda_pools_are_per_stream_and_record_stream_holds_blocks() {
    if let Some(h) = harness("cuda_pools_are_per_stream_and_record_stream_holds_blocks") {
        per_stream_scenario(&h);
    }
}

#[test]
fn cuda_blocks_are_device_storage() {
    let Some(h) = harness("cuda_blocks_are_device_storage") else {
        return;
    };
    let alloc = h.allocator(AllocatorConfig::default());
    let b = alloc.allocate(1000, h.stream(0)).unwrap();
    assert_eq!(b.device(), Device::Cuda(0));
    assert_eq!(Storage::byte_len(&b), 1000);
    assert_eq!(b.addr() % 512, 0);
    let buf = b.into_buffer(fsdp_device::DType::F32).unwrap();
    assert_eq!(buf.len(), 250);
    assert!(
        buf.to_vec::<f32>().is_err(),
        "no host access to device memory"
    );
    // A stream of another context is refused.
    if let Ok(other) = CudaContext::new_non_primary(0, 0) {
        let s = other.new_stream().unwrap();
        assert!(matches!(
            alloc.allocate(512, &s),
            Err(AllocError::InvalidArgument(_))
        ));
    }
}

/// PyTorch's fragmentation scenario on device memory (as `tests/expandable.rs` on the host):
/// requests growing from 21 to 40 MiB, each allocated before the previous one is freed, then
/// shrinking. With expandable segments (CUDA's virtual memory API) the stream's large pool is one
/// segment that grows by mapping pages, and the reserved peak is a fraction of the ordinary
/// segments'; every block keeps its bytes.
#[test]
fn cuda_expandable_segments_reserve_less_on_the_fragmentation_scenario() {
    let Some(h) = harness("cuda_expandable_segments_reserve_less_on_the_fragmentation_scenario")
    else {
        return;
    };
    const MIB: usize = 1 << 20;
    let run = |expandable: bool| {
        let alloc = h.allocator(AllocatorConfig::default().with_expandable_segments(expandable));
        let sizes: Vec<usize> = (0..20).map(|i| (21 + i) * MIB + 4096).collect();
        let mut prev = None;
        for (i, &size) in sizes.iter().chain(sizes.iter().rev()).enumerate() {
            let b = alloc.allocate(size, h.stream(0)).unwrap();
            let byte = (i % 251) as u8 + 1;
            h.write_pattern(&b, byte);
            assert!(h.check_pattern(&b, byte), "block {i} keeps its bytes");
            let st = alloc.memory_stats();
            assert_eq!(
                st.reserved_bytes.all.current,
                alloc.snapshot().reserved_bytes()
            );
            prev = Some(b);
        }
        drop(prev);
        let st = alloc.memory_stats();
        let snap = alloc.snapshot();
        let peaks = (st.reserved_bytes.all.peak, st.allocated_bytes.all.peak);
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.memory_stats().reserved_bytes.all.current, 0);
        (peaks, snap)
    };
    let ((plain_peak, plain_alloc), plain_snap) = run(false);
    let ((exp_peak, exp_alloc), exp_snap) = run(true);
    println!(
        "cuda fragmentation scenario: reserved peak {} MiB without expandable segments ({} \
         segments at the end), {} MiB with ({} segment); allocated peak {} MiB",
        plain_peak >> 20,
        plain_snap.segments.len(),
        exp_peak >> 20,
        exp_snap.segments.len(),
        plain_alloc >> 20
    );
    assert_eq!(plain_alloc, exp_alloc, "the same allocations");
    assert!(exp_peak * 3 < plain_peak, "{exp_peak} vs {plain_peak}");
    assert_eq!(exp_snap.segments.len(), 1);
    assert!(exp_snap.segments[0].is_expandable);
}
