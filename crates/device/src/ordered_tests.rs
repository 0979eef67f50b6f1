//! Tests of [`OrderedStorage`] on CPU worker streams.
use super::*;
use crate::{AccessMode, HostStorage, MetaStorage, Stream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Host memory that says when it is dropped.
struct Watched {
    mem: HostStorage,
    dropped: Arc<AtomicBool>,
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

// SAFETY: delegates address and size to a HostStorage, which satisfies the contract.
unsafe impl Storage for Watched {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn byte_len(&self) -> usize {
        self.mem.byte_len()
    }
    fn as_ptr(&self) -> *mut u8 {
        self.mem.as_ptr()
    }
}

fn watched(len: usize) -> (Buffer, Arc<AtomicBool>) {
    let dropped = Arc::new(AtomicBool::new(false));
    let storage = Watched {
        mem: HostStorage::zeroed(len * 4).unwrap(),
        dropped: dropped.clone(),
    };
    (
        Buffer::stream_ordered(Box::new(storage), DType::F32).unwrap(),
        dropped,
    )
}

fn wait_until(flag: &AtomicBool, timeout: Duration) -> bool {
    let start = Instant::now();
    while !flag.load(Ordering::SeqCst) {
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

#[test]
#[cfg_attr(
    miri,
    ignore = "under Miri a release waits in place (no reaper thread): this drop would wait for the gate it opens"
)]
fn memory_outlives_the_last_buffer_until_its_work_completes() {
    let stream = Stream::cpu("slow");
    let (buf, dropped) = watched(4);
    let (go, gate) = mpsc::channel::<()>();
    let u = buf.use_on(&stream, AccessMode::Exclusive).unwrap();
    let p = u.device_ptr() as usize;
    stream
        .enqueue(move || {
            gate.recv_timeout(Duration::from_secs(10)).unwrap();
            // SAFETY: 4 f32 that only this stream's work touches, alive until it completes.
            unsafe { std::slice::from_raw_parts_mut(p as *mut f32, 4).fill(7.0) }
        })
        .unwrap();
    u.finish();
    drop(buf);
    // The work has not run: the memory is still held.
    std::thread::sleep(Duration::from_millis(20));
    assert!(!dropped.load(Ordering::SeqCst), "freed under pending work");
    go.send(()).unwrap();
    assert!(
        wait_until(&dropped, Duration::from_secs(10)),
        "never freed after its work completed"
    );
}

#[test]
fn memory_without_pending_work_is_released_at_once() {
    let (buf, dropped) = watched(4);
    let slice = buf.slice(1..3).unwrap();
    drop(buf);
    assert!(!dropped.load(Ordering::SeqCst), "a slice still views it");
    drop(slice);
    assert!(dropped.load(Ordering::SeqCst));
}

#[test]
fn a_reader_on_another_stream_sees_the_write() {
    let (a, b) = (Stream::cpu("a"), Stream::cpu("b"));
    let (buf, _) = watched(3);
    let w = buf.use_on(&a, AccessMode::Exclusive).unwrap();
    let p = w.device_ptr() as usize;
    a.enqueue(move || {
        std::thread::sleep(Duration::from_millis(20));
        // SAFETY: 3 f32 written by this stream's work only, alive until it completes.
        unsafe { std::slice::from_raw_parts_mut(p as *mut f32, 3).copy_from_slice(&[1., 2., 3.]) }
    })
    .unwrap();
    w.finish();
    let out = Buffer::zeros(DType::F32, 3).unwrap();
    let r = buf.use_on(&b, AccessMode::Shared).unwrap();
    let (src, dst) = (r.device_ptr() as usize, out.access(AccessMode::Exclusive));
    b.enqueue(move || {
        let dst = dst.acquire(Duration::from_secs(10)).unwrap();
        // SAFETY: 3 f32 that b reads after a's write (it waited for a's event), copied into 3
        // host f32 under an exclusive guard.
        unsafe { std::ptr::copy_nonoverlapping(src as *const f32, dst.as_ptr().cast(), 3) }
    })
    .unwrap();
    r.finish();
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![1., 2., 3.]);
}

#[test]
fn host_access_and_double_ordering_and_meta_are_refused() {
    let (buf, _) = watched(2);
    let e = buf.read::<f32>().unwrap_err().to_string();
    assert!(e.contains("stream-ordered"), "{e}");
    assert!(buf.write::<f32>().is_err());
    assert!(buf.to_vec::<f32>().is_err());
    let inner = OrderedStorage::new(Box::new(HostStorage::zeroed(8).unwrap())).unwrap();
    let e = OrderedStorage::new(Box::new(inner))
        .unwrap_err()
        .to_string();
    assert!(e.contains("already stream-ordered"), "{e}");
    let e = OrderedStorage::new(Box::new(MetaStorage::new(8)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("meta"), "{e}");
}
