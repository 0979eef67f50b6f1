//! The emulated tests' plans run on a GPU instead of the host emulator: under
//! `FSDP_EMULATED_ON=cuda` (what `scripts/gpu-check.sh` sets), [`Emulator::build`]
//! (super::emulator::Emulator::build) gives a runner on `cuda:0`, and every `run_plan` of the
//! `emulated_*` tests uploads its buffers, enqueues the launchers' plans on their device
//! addresses (`launch::enqueue`, what the launchers do) and reads the buffers back, so the same
//! cases and twins check the hardware. As on the host, canary bytes surround every buffer (a
//! write past one fails by name) and a run that does not end within the emulator's timeout
//! fails.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use fsdp_kernels::launch::{self, KernelLaunch, Param};

use super::emulator::{buffer_at, RUN_TIMEOUT};

/// Canary bytes before and after each buffer (a multiple of 256: each buffer starts as
/// aligned as `cudaMalloc`'s memory).
const GUARD: usize = 256;
const CANARY: u8 = 0xA5;

/// `launches` (on addresses from [`addr`](super::emulator::addr)) run on `stream` over
/// `buffers`, each buffer written back.
pub fn run(stream: &Arc<CudaStream>, buffers: &mut [Vec<u8>], launches: &[KernelLaunch]) {
    let devs: Vec<CudaSlice<u8>> = buffers
        .iter()
        .map(|b| {
            let mut v = vec![CANARY; b.len() + 2 * GUARD];
            v[GUARD..GUARD + b.len()].copy_from_slice(b);
            stream.clone_htod(&v).expect("a buffer on the GPU")
        })
        .collect();
    let held: Vec<_> = devs.iter().map(|d| d.device_ptr(stream)).collect();
    let bases: Vec<u64> = held.iter().map(|(p, _)| p + GUARD as u64).collect();
    let at = |a: u64| {
        if a == 0 {
            return 0;
        }
        let (b, o) = buffer_at(a);
        bases[b] + o as u64
    };
    let launches: Vec<KernelLaunch> = launches
        .iter()
        .map(|l| {
            let mut l = l.clone();
            for p in &mut l.params {
                match p {
                    Param::Ptr(a) => *a = at(*a),
                    Param::Struct(s) => s.relocate(at),
                    _ => {}
                }
            }
            l
        })
        .collect();
    let names: Vec<&str> = launches.iter().map(|l| l.kernel.as_str()).collect();
    // SAFETY: every address is inside a buffer allocated above, of the length the test gives
    // it (the plans' reads and writes stay within, as the canaries check after), held until
    // the stream has run the kernels (waited for below).
    unsafe { launch::enqueue(stream, &launches) }
        .unwrap_or_else(|e| panic!("enqueueing {names:?}: {e}"));
    let done = stream.record_event(None).expect("an event");
    let t0 = Instant::now();
    while !done
        .try_is_complete()
        .unwrap_or_else(|e| panic!("{names:?} on the GPU: {e:?}"))
    {
        assert!(
            t0.elapsed() < RUN_TIMEOUT,
            "{names:?} ran past {RUN_TIMEOUT:?} on the GPU"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    drop(held);
    for (i, (b, d)) in buffers.iter_mut().zip(&devs).enumerate() {
        let v = stream.clone_dtoh(d).expect("a buffer from the GPU");
        stream.synchronize().expect("the stream");
        let n = b.len();
        if let Some(k) = v[..GUARD].iter().position(|&c| c != CANARY) {
            panic!(
                "{names:?}: buffer {i} was written {} bytes before its start",
                GUARD - k
            );
        }
        if let Some(k) = v[GUARD + n..].iter().position(|&c| c != CANARY) {
            panic!("{names:?}: buffer {i} was written {k} bytes past its end");
        }
        b.copy_from_slice(&v[GUARD..GUARD + n]);
    }
}
