//! The cross-rank check of every call: the ranks all-gather a 192-byte description of it (the
//! description every backend shares) and compare them before data moves, so that a call that
//! differs between ranks (or failed validation on one rank) fails on every rank with
//! [`CollectiveError::Mismatch`] instead of hanging NCCL or corrupting memory. The buffer checks
//! themselves are [`Placement`](crate::flavors::check::Placement)'s, shared with the other
//! backends.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::driver::{result as cu, sys as cusys, CudaStream};
use cudarc::nccl::sys;

use super::comm::Comm;
use crate::flavors::desc::{self, OpDesc as Desc, FIXED_BYTES as DESC_BYTES};
use crate::{CollectiveError, Result};

/// Device memory for the gathered descriptions and its pinned host mirror.
pub(crate) struct Scratch {
    dev: cusys::CUdeviceptr,
    host: *mut u8,
    world: usize,
    stream: std::sync::Arc<CudaStream>,
}

// SAFETY: the pointers are owned by this value and only used by the thread holding it (the
// communicator keeps it behind a mutex).
unsafe impl Send for Scratch {}

impl Scratch {
    /// Scratch for `world` descriptions, allocated on `stream` (its context is current).
    pub(crate) fn new(
        world: usize,
        stream: &std::sync::Arc<CudaStream>,
    ) -> std::result::Result<Scratch, cu::DriverError> {
        let bytes = world * DESC_BYTES;
        // SAFETY: the stream's context is current (bound by the caller); freed in Drop.
        let dev = unsafe { cu::malloc_async(stream.cu_stream(), bytes) }?;
        // SAFETY: as above; pinned host memory for the exchange's copies, freed in Drop.
        let host = match unsafe { cu::malloc_host(bytes, 0) } {
            Ok(h) => h.cast::<u8>(),
            Err(e) => {
                // SAFETY: allocated just above on this stream, never used.
                let _ = unsafe { cu::free_async(dev, stream.cu_stream()) };
                return Err(e);
            }
        };
        Ok(Scratch {
            dev,
            host,
            world,
            stream: stream.clone(),
        })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: allocated in `new`; no copy is in flight (the exchange waits for its copies,
        // and a failed exchange leaks the scratch with `mem::forget` instead).
        unsafe {
            let _ = cu::free_async(self.dev, self.stream.cu_stream());
            let _ = cu::free_host(self.host.cast());
        }
    }
}

fn driver(rank: usize, op: &'static str) -> impl Fn(cu::DriverError) -> CollectiveError {
    move |e| CollectiveError::Backend {
        rank,
        backend: "nccl",
        op,
        reason: format!("CUDA driver error {e:?}"),
    }
}

/// All-gather the ranks' descriptions of call `seq` through `comm` on the scratch's stream and
/// compare them; blocks the host until the gathered descriptions arrived (bounded by
/// `timeout`). On a failure the scratch is consumed (leaked if copies may still be in flight).
pub(crate) fn exchange(
    comm: &Comm,
    slot: &mut Option<Scratch>,
    desc: &Desc,
    seq: u64,
    timeout: Duration,
) -> Result<()> {
    let rank = comm.rank;
    let Some(s) = slot.as_ref() else {
        return Err(CollectiveError::Aborted {
            rank,
            reason: "the call-description buffers were lost in an earlier failure".into(),
        });
    };
    let (world, op) = (s.world, desc.op);
    let deadline = Instant::now() + timeout;
    let off = rank * DESC_BYTES;
    let bytes = desc.encode_fixed();
    let cs = s.stream.cu_stream();
    let result = (|| {
        // SAFETY: `host` is pinned memory of `world * DESC_BYTES` bytes owned by the scratch;
        // the previous exchange's copies have completed (it waited), so nothing touches it.
        let mine = unsafe { std::slice::from_raw_parts_mut(s.host.add(off), DESC_BYTES) };
        mine.copy_from_slice(&bytes);
        // SAFETY: device scratch of world * DESC_BYTES bytes; the pinned source stays alive
        // until the copy completed (waited for below, or leaked on failure).
        unsafe { cu::memcpy_htod_async(s.dev + off as u64, &*mine, cs) }
            .map_err(driver(rank, "cuMemcpyHtoDAsync"))?;
        comm.call(op, seq, deadline, timeout, |c| {
            // SAFETY: in-place all-gather (send = this rank's block of recv) on the device
            // scratch, on the scratch's stream, which is the communicator's NCCL stream.
            unsafe {
                sys::ncclAllGather(
                    (s.dev + off as u64) as *const c_void,
                    s.dev as *mut c_void,
                    DESC_BYTES,
                    sys::ncclDataType_t::ncclUint8,
                    c,
                    cs as sys::cudaStream_t,
                )
            }
        })?;
        // SAFETY: the whole pinned mirror receives the gathered descriptions.
        let all = unsafe { std::slice::from_raw_parts_mut(s.host, world * DESC_BYTES) };
        // SAFETY: device scratch and pinned mirror of the same size.
        unsafe { cu::memcpy_dtoh_async(all, s.dev, cs) }
            .map_err(driver(rank, "cuMemcpyDtoHAsync"))?;
        let ev = fsdp_device::cuda::PooledEvent::acquire(s.stream.context())
            .map_err(|source| CollectiveError::Device { rank, source })?;
        ev.event()
            .record(&s.stream)
            .map_err(driver(rank, "cuEventRecord"))?;
        wait_host(comm, ev.event(), op, seq, deadline, timeout)
    })();
    if let Err(e) = result {
        if let Some(s) = slot.take() {
            // The copies may still be in flight: leak the scratch rather than free it.
            std::mem::forget(s);
        }
        return Err(e);
    }
    // SAFETY: the copies have completed (event waited for); nothing else touches `host`.
    let all = unsafe { std::slice::from_raw_parts(s.host, world * DESC_BYTES) };
    let raw: Vec<&[u8]> = all.chunks(DESC_BYTES).collect();
    desc::decode_all_fixed(&raw)
        .and_then(|descs| desc::compare(&descs, seq))
        .map_err(|details| CollectiveError::Mismatch { rank, seq, details })
}

/// Poll `ev` until it completes: spin, yield, then sleep 20 µs at most; a timeout aborts every
/// rank, an aborted communicator ends the wait.
pub(crate) fn wait_host(
    comm: &Comm,
    ev: &cudarc::driver::CudaEvent,
    op: &'static str,
    seq: u64,
    deadline: Instant,
    timeout: Duration,
) -> Result<()> {
    let rank = comm.rank;
    let mut polls = 0u32;
    loop {
        match ev.try_is_complete() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => {
                let reason = format!("CUDA error on the NCCL stream: {e:?}");
                comm.abort(format!("rank {rank}: {reason}"), true);
                return Err(CollectiveError::Backend {
                    rank,
                    backend: "nccl",
                    op,
                    reason,
                });
            }
        }
        if comm.abort_reason().is_some() {
            return Err(comm.aborted_error());
        }
        if Instant::now() >= deadline {
            let waiting_for = "the NCCL stream did not reach this point: a peer did not reach \
                               this collective (or issued a different one)"
                .to_string();
            comm.abort(
                format!("rank {rank} timed out in {op} (collective #{seq}): {waiting_for}"),
                true,
            );
            return Err(CollectiveError::Timeout {
                rank,
                op,
                seq,
                waited: timeout,
                waiting_for,
            });
        }
        polls += 1;
        if polls < 64 {
            std::hint::spin_loop();
        } else if polls < 512 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}
