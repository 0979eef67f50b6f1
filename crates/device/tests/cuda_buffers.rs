//! Stream-ordered CUDA device buffers and async copies through pinned memory (cargo feature
//! `cuda`). Without a GPU each GPU test prints `skipped: no GPU (<reason>)` and passes.
#![cfg(feature = "cuda")]

mod common;

use std::time::Duration;

use common::gpu;
use cudarc::driver::result;
use fsdp_device::cuda::{pending_releases, wait_for_releases};
use fsdp_device::{AccessMode, Buffer, DType, Device, DeviceError, Stream};

/// Elements of the large buffers: 256 MiB of f32.
const BIG: usize = 64 << 20;

/// Distinct, exactly representable f32 values per element and round.
fn pattern(n: usize, round: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(round * 7919)
                % (1 << 24)) as f32
        })
        .collect()
}

fn pinned(data: &[f32]) -> Buffer {
    let b = Buffer::pinned_zeros(DType::F32, data.len()).unwrap();
    b.copy_from_slice(data).unwrap();
    b
}

fn bits(b: &Buffer) -> Vec<u32> {
    b.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// Memset bytes of `buf` to `byte` on `stream` through the raw stream-ordered use.
fn memset(buf: &Buffer, byte: u8, stream: &Stream) {
    let usage = buf.use_on(stream, AccessMode::Exclusive).unwrap();
    let cu = stream.cuda_stream().unwrap();
    cu.context().bind_to_thread().unwrap();
    // SAFETY: the exclusive use covers buf.byte_len() live device bytes, ordered on `stream`.
    unsafe { result::memset_d8_async(usage.device_ptr(), byte, buf.byte_len(), cu.cu_stream()) }
        .unwrap();
    usage.finish();
}

#[test]
fn argument_errors_without_a_gpu() {
    let host = Buffer::zeros(DType::F32, 4).unwrap();
    let cpu = Stream::cpu("cpu");
    let err = host.copy_to_host_async(&host, &cpu).unwrap_err();
    assert!(
        matches!(&err, DeviceError::InvalidArgument(m) if m.contains("not a stream-ordered buffer"))
    );
    assert!(matches!(
        Buffer::cuda_zeros(DType::F32, 4, &cpu),
        Err(DeviceError::Unsupported { .. })
    ));
    // Empty pinned buffers need no driver.
    let empty = Buffer::pinned_zeros(DType::BF16, 0).unwrap();
    assert!(empty.is_empty() && empty.is_page_locked());
}

#[test]
fn round_trip_through_memset_and_a_copy_on_another_stream() {
    let Some(_serial) = gpu("round_trip_through_memset_and_a_copy_on_another_stream") else {
        return;
    };
    let n = 1 << 20;
    let (a, b, c) = (
        Stream::cuda(0, "a").unwrap(),
        Stream::cuda(0, "b").unwrap(),
        Stream::cuda(0, "c").unwrap(),
    );
    let data = pattern(n, 1);
    let x = Buffer::cuda_zeros(DType::F32, n, &a).unwrap();
    assert_eq!(x.device(), Device::Cuda(0));
    // A fresh buffer reads as zeros (its memset is ordered before the download on `c`).
    let out = Buffer::pinned_zeros(DType::F32, n).unwrap();
    out.copy_from_slice(&vec![1.0f32; n]).unwrap();
    x.copy_to_host_async(&out, &c).unwrap();
    assert!(out.read::<f32>().unwrap().iter().all(|v| *v == 0.0));
    // Upload on `a`, copy on `b`, memset a slice on `c`, download the slices on `a`.
    x.copy_from_host_async(&pinned(&data), &a).unwrap();
    let y = Buffer::cuda_zeros(DType::F32, n, &b).unwrap();
    y.copy_from_device_async(&x, &b).unwrap();
    memset(&y.slice(1000..3000).unwrap(), 0xff, &c);
    let mut expected: Vec<u32> = data.iter().map(|v| v.to_bits()).collect();
    expected[1000..3000].fill(u32::MAX);
    let ev = y.copy_to_host_async(&out, &a).unwrap();
    assert_eq!(bits(&out), expected);
    assert!(ev.query());
    let tail = Buffer::pinned_zeros(DType::F32, n - 2500).unwrap();
    y.slice(2500..n)
        .unwrap()
        .copy_to_host_async(&tail, &b)
        .unwrap();
    assert_eq!(bits(&tail), expected[2500..]);
    x.copy_to_host_async(&out, &b).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), data);
    wait_for_releases(Duration::from_secs(10)).unwrap();
}

#[test]
fn misuse_is_a_clear_error() {
    let Some(_serial) = gpu("misuse_is_a_clear_error") else {
        return;
    };
    let s = Stream::cuda(0, "s").unwrap();
    let cpu = Stream::cpu("cpu");
    let x = Buffer::cuda_zeros(DType::F32, 16, &s).unwrap();
    let err = x.to_vec::<f32>().unwrap_err();
    assert!(
        matches!(&err, DeviceError::Unsupported { op, device } if op.contains("copy_to_host_async") && device == "cuda:0"),
        "{err}"
    );
    assert!(x.write::<f32>().is_err());
    let invalid = |r: Result<fsdp_device::Event, DeviceError>, needle: &str| match r {
        Err(DeviceError::InvalidArgument(m)) => assert!(m.contains(needle), "{m} lacks {needle}"),
        other => panic!("expected an invalid argument naming {needle}, got {other:?}"),
    };
    let pageable = Buffer::zeros(DType::F32, 16).unwrap();
    invalid(x.copy_to_host_async(&pageable, &s), "pinned");
    invalid(x.copy_from_host_async(&pageable, &s), "pinned");
    let short = Buffer::pinned_zeros(DType::F32, 15).unwrap();
    invalid(x.copy_to_host_async(&short, &s), "15 elements");
    let wide = Buffer::pinned_zeros(DType::F64, 16).unwrap();
    invalid(x.copy_from_host_async(&wide, &s), "float64");
    let ok = Buffer::pinned_zeros(DType::F32, 16).unwrap();
    invalid(x.copy_to_host_async(&ok, &cpu), "stream `cpu`");
    invalid(
        ok.copy_to_host_async(&ok, &s),
        "not a stream-ordered CUDA buffer",
    );
    invalid(
        x.copy_from_device_async(&x.slice(0..8).unwrap(), &s),
        "8 elements",
    );
    invalid(
        x.slice(0..8)
            .unwrap()
            .copy_from_device_async(&x.slice(4..12).unwrap(), &s),
        "overlapping",
    );
    assert!(matches!(
        x.use_on(&cpu, AccessMode::Shared),
        Err(DeviceError::InvalidArgument(_))
    ));
    // Disjoint views of one storage copy fine.
    x.slice(0..8)
        .unwrap()
        .copy_from_device_async(&x.slice(8..16).unwrap(), &s)
        .unwrap();
    s.synchronize().unwrap();
}

#[test]
fn big_upload_then_read_on_another_stream_is_never_stale() {
    let Some(_serial) = gpu("big_upload_then_read_on_another_stream_is_never_stale") else {
        return;
    };
    let (a, b) = (Stream::cuda(0, "a").unwrap(), Stream::cuda(0, "b").unwrap());
    let src = Buffer::pinned_zeros(DType::F32, BIG).unwrap();
    let dst = Buffer::pinned_zeros(DType::F32, BIG).unwrap();
    let x = Buffer::cuda_zeros(DType::F32, BIG, &a).unwrap();
    let y = Buffer::cuda_zeros(DType::F32, BIG, &b).unwrap();
    for round in 0..20 {
        let data = pattern(BIG, round);
        // Waits for the previous round's upload to have read `src`.
        src.copy_from_slice(&data).unwrap();
        x.copy_from_host_async(&src, &a).unwrap();
        // At once, no host synchronisation: `b` reads `x`.
        y.copy_from_device_async(&x, &b).unwrap();
        y.copy_to_host_async(&dst, &b).unwrap();
        let got = dst.read::<f32>().unwrap();
        let stale = got.iter().zip(&data).filter(|(g, d)| g != d).count();
        assert_eq!(stale, 0, "round {round}: {stale} stale elements");
    }
    wait_for_releases(Duration::from_secs(10)).unwrap();
}

#[test]
fn dropping_a_buffer_under_queued_work_defers_its_free() {
    let Some(_serial) = gpu("dropping_a_buffer_under_queued_work_defers_its_free") else {
        return;
    };
    let (a, b) = (Stream::cuda(0, "a").unwrap(), Stream::cuda(0, "b").unwrap());
    wait_for_releases(Duration::from_secs(10)).unwrap();
    let data = pattern(BIG, 99);
    let x = Buffer::cuda_zeros(DType::F32, BIG, &a).unwrap();
    let z = Buffer::cuda_zeros(DType::F32, BIG, &a).unwrap();
    let w = Buffer::cuda_zeros(DType::F32, BIG, &a).unwrap();
    // Pinned host memory first: pinning 256 MiB takes longer than the chain below runs.
    let out = Buffer::pinned_zeros(DType::F32, BIG).unwrap();
    x.copy_from_host_async(&pinned(&data), &a).unwrap();
    // A long chain on `a` (about 100 ms on an H100) that ends in `w`.
    for _ in 0..256 {
        z.copy_from_device_async(&x, &a).unwrap();
        x.copy_from_device_async(&z, &a).unwrap();
    }
    w.copy_from_device_async(&x, &a).unwrap();
    let done = w.copy_to_host_async(&out, &a).unwrap();
    drop((x, z));
    // Both frees wait for the chain, and so does the host's access to `out`.
    assert!(
        !done.query(),
        "the chain finished before the drop was checked"
    );
    assert!(pending_releases() >= 2, "{} pending", pending_releases());
    assert!(matches!(
        out.read_timeout::<f32>(Duration::ZERO),
        Err(DeviceError::Timeout { .. })
    ));
    // New buffers, allocated and overwritten at once on another stream: had the freed memory
    // been reused early, the chain would copy 0xff bytes.
    let fresh: Vec<Buffer> = (0..2)
        .map(|_| {
            let f = Buffer::cuda_zeros(DType::F32, BIG, &b).unwrap();
            memset(&f, 0xff, &b);
            f
        })
        .collect();
    assert_eq!(out.to_vec::<f32>().unwrap(), data);
    wait_for_releases(Duration::from_secs(10)).unwrap();
    assert_eq!(pending_releases(), 0);
    drop(fresh);
    b.synchronize().unwrap();
    wait_for_releases(Duration::from_secs(10)).unwrap();
}

/// Freed pinned memory is kept by size class and reused, zeroed, instead of freed
/// (`cuMemFreeHost` synchronises the device): a second buffer of the first's class takes its
/// block (a reuse, no allocation) and reads zeros, a buffer of another class does not take it;
/// `empty_pinned_cache` frees the cached blocks.
#[test]
fn freed_pinned_memory_is_reused_zeroed_by_size_class() {
    let Some(_serial) = gpu("freed_pinned_memory_is_reused_zeroed_by_size_class") else {
        return;
    };
    use fsdp_device::cuda::{empty_pinned_cache, pinned_cache_stats};
    // 3 MiB + 4 bytes of f32: class 4 MiB, which no other test of this binary uses.
    let n = (3 << 18) + 1;
    drop(pinned(&pattern(n, 1)));
    let before = pinned_cache_stats();
    assert!(before.cached_bytes >= 4 << 20, "{before:?}");
    let second = Buffer::pinned_zeros(DType::F32, n - 100).unwrap();
    let after = pinned_cache_stats();
    assert_eq!(after.reuses, before.reuses + 1, "{after:?}");
    assert_eq!(after.allocations, before.allocations, "{after:?}");
    assert!(second.to_vec::<f32>().unwrap().iter().all(|&x| x == 0.0));
    let cached = pinned_cache_stats().cached_bytes;
    let other = Buffer::pinned_zeros(DType::F32, 2 << 20).unwrap();
    assert_eq!(
        pinned_cache_stats().cached_bytes,
        cached,
        "another class is not served"
    );
    drop((second, other));
    empty_pinned_cache().unwrap();
    assert_eq!(pinned_cache_stats().cached_blocks, 0);
    println!("pinned cache: {:?}", pinned_cache_stats());
}
