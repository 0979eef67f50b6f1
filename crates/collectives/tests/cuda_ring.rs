//! GPU tests of the CUDA ring (cargo feature `cuda`). Each prints `skipped: <reason>` and
//! returns where the CUDA driver or a GPU is missing.
//!
//! - every collective, every element type and reduce op, worlds 1 to 4 on GPU 0, on random
//!   inputs (so that a different reduction order would show in the low bits): bitwise equal to
//!   the host thread ring, the reference;
//! - a rank that never calls: the others fail with a timeout naming it, within the bound.
#![cfg(feature = "cuda")]

use std::sync::Barrier;
use std::time::{Duration, Instant};

use fsdp_allocator::cuda::{CudaAllocator, CudaSource};
use fsdp_allocator::AllocatorConfig;
use fsdp_collectives::cuda_ring::{self, CudaRingCommunicator, CudaRingOptions};
use fsdp_collectives::ring::{self, RingOptions};
use fsdp_collectives::{CollectiveError, Communicator, ReduceOp, Work};
use fsdp_device::half::{bf16, f16};
use fsdp_device::{AccessMode, Buffer, Device, Element};

const TIMEOUT: Duration = Duration::from_secs(60);
/// Small segments, so that collectives take many pipelined steps and reuse scratch slots.
const SEGMENT_BYTES: usize = 256;
const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Product,
];

/// Why the GPU tests cannot run here, if they cannot.
fn skip_reason() -> Option<String> {
    match fsdp_device::cuda::device_count() {
        Err(e) => return Some(e.to_string()),
        Ok(0) => return Some("no CUDA device".into()),
        Ok(_) => {}
    }
    CudaSource::new(0)
        .err()
        .map(|e| format!("no CUDA device 0: {e}"))
}

fn gpu(test: &str) -> bool {
    match skip_reason() {
        Some(why) => {
            println!("{test}: skipped: no GPU ({why})");
            false
        }
        None => true,
    }
}

/// A collective of the test matrix.
#[derive(Clone, Copy, Debug)]
enum Call {
    AllGatherBase,
    ReduceScatterBase(ReduceOp),
    AllReduce(ReduceOp),
    Broadcast(usize),
    Reduce(ReduceOp, usize),
}

impl Call {
    /// (input length, output length) of rank buffers for `n` elements per rank; output 0 for
    /// collectives on one buffer.
    fn lens(self, world: usize, n: usize) -> (usize, usize) {
        match self {
            Call::AllGatherBase => (n, world * n),
            Call::ReduceScatterBase(_) => (world * n, n),
            _ => (world * n + 3, 0),
        }
    }

    fn issue(self, c: &dyn Communicator, input: &Buffer, output: &Buffer) -> Work {
        match self {
            Call::AllGatherBase => c.all_gather_base(input, output),
            Call::ReduceScatterBase(op) => c.reduce_scatter_base(input, output, op),
            Call::AllReduce(op) => c.all_reduce(input, op),
            Call::Broadcast(root) => c.broadcast(input, root),
            Call::Reduce(op, root) => c.reduce(input, op, root),
        }
        .unwrap_or_else(|e| panic!("{self:?} on rank {}: {e}", c.rank()))
    }

    /// Whether the result is in the output buffer (else in the input).
    fn result_in_output(self) -> bool {
        matches!(self, Call::AllGatherBase | Call::ReduceScatterBase(_))
    }
}

/// Rank `r`'s random input of `len` elements (xorshift; products stay finite: values near 1).
fn input(seed: u64, r: usize, len: usize, op_is_product: bool) -> Vec<f64> {
    let mut s = seed ^ (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            if op_is_product {
                0.5 + u
            } else {
                u * 200.0 - 100.0
            }
        })
        .collect()
}

/// The bits of a result, element by element.
fn bits<T: Element>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

/// The host thread ring's results of `call`, by rank.
fn host_results<T: Element>(
    call: Call,
    world: usize,
    data: &[Vec<T>],
    out_len: usize,
) -> Vec<Vec<u64>> {
    let opts = RingOptions::default()
        .with_timeout(TIMEOUT)
        .with_segment_bytes(SEGMENT_BYTES);
    ring::run_ranks(world, opts, |c| {
        let r = c.rank();
        let input = Buffer::from_slice(&data[r]).unwrap();
        let output = Buffer::zeros(T::DTYPE, out_len).unwrap();
        call.issue(&c, &input, &output).wait().unwrap();
        let res = if call.result_in_output() {
            &output
        } else {
            &input
        };
        bits(&res.to_vec::<T>().unwrap())
    })
    .unwrap()
}

/// A device buffer of rank `c` holding `data`.
fn upload<T: Element>(c: &CudaRingCommunicator, alloc: &CudaAllocator, data: &[T]) -> Buffer {
    let stream = c.cuda_stream().cuda_stream().unwrap();
    let buf = alloc.allocate_buffer(T::DTYPE, data.len(), stream).unwrap();
    if !data.is_empty() {
        let g = buf.access(AccessMode::Exclusive).acquire(TIMEOUT).unwrap();
        let ctx = stream.context();
        ctx.bind_to_thread().unwrap();
        // The allocation may be stream-ordered, and a synchronous copy from pageable memory may
        // return before its DMA ended: synchronise around it.
        ctx.synchronize().unwrap();
        // SAFETY: exclusive access to `buf`, device memory of `data.len()` elements of T in the
        // context just made current.
        unsafe { cudarc::driver::result::memcpy_htod_sync(g.as_ptr() as u64, data) }.unwrap();
        ctx.synchronize().unwrap();
    }
    buf
}

fn download<T: Element>(c: &CudaRingCommunicator, buf: &Buffer) -> Vec<T> {
    let stream = c.cuda_stream().cuda_stream().unwrap();
    let mut out = vec![T::default(); buf.len()];
    if !out.is_empty() {
        let g = buf.access(AccessMode::Shared).acquire(TIMEOUT).unwrap();
        stream.context().bind_to_thread().unwrap();
        // SAFETY: shared access to `buf`, device memory of `out.len()` elements of T in the
        // context just made current; the collective's work completed (its end event).
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut out, g.as_ptr() as u64) }.unwrap();
    }
    out
}

/// The CUDA ring's results of `call`, by rank.
fn cuda_results<T: Element>(
    call: Call,
    world: usize,
    data: &[Vec<T>],
    out_len: usize,
) -> Vec<Vec<u64>> {
    let opts = CudaRingOptions::default()
        .with_timeout(TIMEOUT)
        .with_segment_bytes(SEGMENT_BYTES);
    cuda_ring::run_ranks(0, world, opts, |c| {
        let r = c.rank();
        // Its buffers are the GPU's, though a host worker stream orders its collectives.
        assert_eq!(
            (c.device(), c.stream().device()),
            (Device::Cuda(0), Device::Cpu)
        );
        let alloc =
            CudaAllocator::new(CudaSource::new(0).unwrap(), AllocatorConfig::default()).unwrap();
        let input = upload(&c, &alloc, &data[r]);
        let output = upload(&c, &alloc, &vec![T::from_f64(-1.0); out_len]);
        call.issue(&c, &input, &output)
            .wait()
            .unwrap_or_else(|e| panic!("{call:?} rank {r} of {world}: {e}"));
        let res = if call.result_in_output() {
            &output
        } else {
            &input
        };
        bits(&download::<T>(&c, res))
    })
    .unwrap()
}

fn every_call<T: Element>(world: usize) {
    let n = 97; // elements per rank: many segments, not a multiple of one
    let mut calls = vec![Call::AllGatherBase];
    for op in OPS {
        calls.push(Call::ReduceScatterBase(op));
        calls.push(Call::AllReduce(op));
        for root in 0..world {
            calls.push(Call::Reduce(op, root));
        }
    }
    calls.extend((0..world).map(Call::Broadcast));
    for (k, call) in calls.into_iter().enumerate() {
        let (in_len, out_len) = call.lens(world, n);
        let product = matches!(
            call,
            Call::ReduceScatterBase(ReduceOp::Product)
                | Call::AllReduce(ReduceOp::Product)
                | Call::Reduce(ReduceOp::Product, _)
        );
        let data: Vec<Vec<T>> = (0..world)
            .map(|r| {
                input(k as u64 + 1, r, in_len, product)
                    .into_iter()
                    .map(T::from_f64)
                    .collect()
            })
            .collect();
        let want = host_results::<T>(call, world, &data, out_len);
        let got = cuda_results::<T>(call, world, &data, out_len);
        for r in 0..world {
            assert_eq!(
                got[r],
                want[r],
                "{call:?} {:?} world {world} rank {r}: CUDA ring differs from the host ring",
                T::DTYPE
            );
        }
    }
}

#[test]
fn every_collective_is_bitwise_the_host_ring() {
    if !gpu("every_collective_is_bitwise_the_host_ring") {
        return;
    }
    for world in 1..=4 {
        every_call::<f32>(world);
        every_call::<f64>(world);
        every_call::<bf16>(world);
        every_call::<f16>(world);
    }
}

#[test]
fn in_place_all_gather_and_reduce_scatter() {
    if !gpu("in_place_all_gather_and_reduce_scatter") {
        return;
    }
    let world = 3;
    let n = 50;
    let opts = CudaRingOptions::default().with_segment_bytes(SEGMENT_BYTES);
    cuda_ring::run_ranks(0, world, opts, |c| {
        let r = c.rank();
        let alloc =
            CudaAllocator::new(CudaSource::new(0).unwrap(), AllocatorConfig::default()).unwrap();
        let mut full = vec![0f32; world * n];
        full[r * n..(r + 1) * n].fill(r as f32 + 1.0);
        let out = upload(&c, &alloc, &full);
        let own = out.slice(r * n..(r + 1) * n).unwrap();
        c.all_gather_base(&own, &out).unwrap().wait().unwrap();
        let want: Vec<f32> = (0..world * n).map(|i| (i / n) as f32 + 1.0).collect();
        assert_eq!(download::<f32>(&c, &out), want, "rank {r}");
        // Reduce-scatter in place: chunk r of the input holds the result.
        c.reduce_scatter_base(&out, &own, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        let got = download::<f32>(&c, &own);
        assert!(
            got.iter().all(|&v| v == (world * (r + 1)) as f32),
            "rank {r}: {got:?}"
        );
    })
    .unwrap();
}

#[test]
fn a_rank_that_never_calls_times_out_naming_it() {
    if !gpu("a_rank_that_never_calls_times_out_naming_it") {
        return;
    }
    let timeout = Duration::from_secs(2);
    let opts = CudaRingOptions::default().with_timeout(timeout);
    let done = Barrier::new(3);
    let outcomes = cuda_ring::run_ranks(0, 3, opts, |c| {
        let r = c.rank();
        let out = if r == 2 {
            None
        } else {
            let alloc = CudaAllocator::new(CudaSource::new(0).unwrap(), AllocatorConfig::default())
                .unwrap();
            let input = upload(&c, &alloc, &[1.0f32; 8]);
            let output = upload(&c, &alloc, &[0.0f32; 24]);
            let t0 = Instant::now();
            let res = c.all_gather_base(&input, &output).and_then(|w| w.wait());
            Some((res, t0.elapsed()))
        };
        // Rank 2 keeps its communicator until the others failed (leaving would be a departure,
        // not a timeout).
        done.wait();
        out
    })
    .unwrap();
    for (r, o) in outcomes.into_iter().enumerate().take(2) {
        let (res, took) = o.unwrap();
        match res {
            Err(CollectiveError::Timeout { waiting_for, .. }) => {
                assert!(waiting_for.contains("rank [2]"), "rank {r}: {waiting_for}");
            }
            other => panic!("rank {r}: expected a timeout, got {other:?}"),
        }
        assert!(
            took < timeout + Duration::from_secs(3),
            "rank {r} took {took:?}"
        );
    }
}
