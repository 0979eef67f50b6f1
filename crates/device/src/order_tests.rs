//! Tests of the stream ordering core on CPU worker streams.
use super::*;
use crate::{DType, Device, HostStorage, Storage};
use proptest::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Host memory that is ordered by a [`StreamOrder`] instead of access tickets: the CPU twin of a
/// device storage, so that [`Buffer::use_on`] runs on CPU streams.
struct OrderedHost {
    mem: HostStorage,
    order: Arc<StreamOrder>,
    device: Device,
}

// SAFETY: delegates address and size to a HostStorage, which satisfies the contract.
unsafe impl Storage for OrderedHost {
    fn device(&self) -> Device {
        self.device
    }
    fn byte_len(&self) -> usize {
        self.mem.byte_len()
    }
    fn as_ptr(&self) -> *mut u8 {
        self.mem.as_ptr()
    }
    fn stream_order(&self) -> Option<Arc<StreamOrder>> {
        Some(self.order.clone())
    }
}

fn ordered_host(len: usize, device: Device) -> Buffer {
    let storage = OrderedHost {
        mem: HostStorage::zeroed(len * 8).unwrap(),
        order: Arc::new(StreamOrder::new()),
        device,
    };
    Buffer::from_storage(Box::new(storage), DType::F64).unwrap()
}

/// The element `i` of an 8-byte-element buffer (F64 storage used as u64 cells), accessed atomically so that a missing order shows as a
/// wrong value, never as undefined behaviour.
fn cell(addr: usize, i: usize) -> &'static AtomicU64 {
    // SAFETY: callers pass the address of a live, 8-aligned u64 buffer of more than `i`
    // elements, kept alive by a clone the task owns; all accesses to it are atomic.
    unsafe { &*(addr as *const AtomicU64).add(i) }
}

fn gate() -> (
    crossbeam_channel::Sender<()>,
    crossbeam_channel::Receiver<()>,
) {
    crossbeam_channel::bounded(0)
}

/// Enqueues on `producer` a store of 42 into `mem`, held until the returned gate is sent to
/// (at most 10 s).
fn slow_write_42(producer: &Stream, mem: &Arc<AtomicU64>) -> crossbeam_channel::Sender<()> {
    let (tx, rx) = gate();
    let m = mem.clone();
    producer
        .enqueue(move || {
            rx.recv_timeout(Duration::from_secs(10)).unwrap();
            m.store(42, Ordering::SeqCst);
        })
        .unwrap();
    tx
}

/// Enqueues on `consumer` a copy of `mem` into a cell holding `init` until then; returns the
/// cell.
fn copy_of(consumer: &Stream, mem: &Arc<AtomicU64>, init: u64) -> Arc<AtomicU64> {
    let (m, seen) = (mem.clone(), Arc::new(AtomicU64::new(init)));
    let s = seen.clone();
    consumer
        .enqueue(move || s.store(m.load(Ordering::SeqCst), Ordering::SeqCst))
        .unwrap();
    seen
}

#[test]
fn consumer_sees_the_slow_producers_write() {
    let order = StreamOrder::new();
    let (producer, consumer) = (Stream::cpu("producer"), Stream::cpu("consumer"));
    let mem = Arc::new(AtomicU64::new(0));
    order.before_write(&producer).unwrap();
    let tx = slow_write_42(&producer, &mem);
    let written = order.after_write(&producer);
    order.before_read(&consumer).unwrap();
    let seen = copy_of(&consumer, &mem, 0);
    let read = order.after_read(&consumer);
    // The consumer is held behind the producer, which is held by the gate (time enough for an
    // unordered consumer to run: see the next test).
    std::thread::sleep(Duration::from_millis(20));
    assert!(!read.query() && !written.query());
    tx.send(()).unwrap();
    read.synchronize().unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 42);
    assert_eq!(order.events().len(), 2);
}

#[test]
fn without_the_order_the_consumer_sees_stale_data() {
    // The control for the test above: the same work without before_read reads too early.
    let (producer, consumer) = (Stream::cpu("producer"), Stream::cpu("consumer"));
    let mem = Arc::new(AtomicU64::new(0));
    let tx = slow_write_42(&producer, &mem);
    let seen = copy_of(&consumer, &mem, 7);
    consumer.synchronize().unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 0);
    tx.send(()).unwrap();
    producer.synchronize().unwrap();
}

#[test]
fn writer_waits_for_outstanding_readers_and_clears_them() {
    let order = StreamOrder::new();
    let readers = [Stream::cpu("r0"), Stream::cpu("r1")];
    let writer = Stream::cpu("w");
    let mem = Arc::new(AtomicU64::new(5));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut gates = Vec::new();
    for r in &readers {
        let (tx, rx) = gate();
        gates.push(tx);
        order.before_read(r).unwrap();
        let (m, s) = (mem.clone(), seen.clone());
        r.enqueue(move || {
            rx.recv_timeout(Duration::from_secs(10)).unwrap();
            s.lock().unwrap().push(m.load(Ordering::SeqCst));
        })
        .unwrap();
        order.after_read(r);
        // A second read on the same stream replaces the first one's event.
        order.after_read(r);
    }
    assert_eq!(order.events().len(), 2);
    order.before_write(&writer).unwrap();
    let m = mem.clone();
    writer
        .enqueue(move || m.store(9, Ordering::SeqCst))
        .unwrap();
    let w = order.after_write(&writer);
    assert_eq!(order.events().len(), 1, "a write clears the reads");
    std::thread::sleep(Duration::from_millis(20));
    assert!(!w.query(), "the writer ran before its readers");
    assert_eq!(mem.load(Ordering::SeqCst), 5);
    for tx in gates {
        tx.send(()).unwrap();
    }
    w.synchronize().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![5, 5]);
    assert_eq!(mem.load(Ordering::SeqCst), 9);
    assert!(order.is_idle());
}

#[test]
fn stream_use_orders_buffer_work_and_checks_its_arguments() {
    let buf = ordered_host(4, Device::Cpu);
    let (a, b) = (Stream::cpu("a"), Stream::cpu("b"));
    let (tx, rx) = gate();
    let w = buf.use_on(&a, AccessMode::Exclusive).unwrap();
    let (addr, keep) = (w.as_ptr() as usize, buf.clone());
    assert_eq!(w.device_ptr(), addr as u64);
    a.enqueue(move || {
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        (0..4).for_each(|i| cell(addr, i).store(i as u64 + 1, Ordering::SeqCst));
        drop(keep);
    })
    .unwrap();
    drop(w); // dropping records the write too
    let tail = buf.slice(2..4).unwrap();
    let r = tail.use_on(&b, AccessMode::Shared).unwrap();
    assert_eq!(r.mode(), AccessMode::Shared);
    let (addr, seen) = (r.as_ptr() as usize, Arc::new(Mutex::new(Vec::new())));
    let (s, keep) = (seen.clone(), tail.clone());
    b.enqueue(move || {
        let v: Vec<u64> = (0..2)
            .map(|i| cell(addr, i).load(Ordering::SeqCst))
            .collect();
        *s.lock().unwrap() = v;
        drop(keep);
    })
    .unwrap();
    let done = r.finish();
    tx.send(()).unwrap();
    done.synchronize().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![3, 4]);
    // Slices share their storage's order.
    assert!(Arc::ptr_eq(
        &buf.stream_order().unwrap(),
        &tail.stream_order().unwrap()
    ));
    // Ticket-ordered buffers refuse, and so do streams of another device.
    let host = Buffer::zeros(DType::F32, 4).unwrap();
    assert!(host.stream_order().is_none());
    assert!(matches!(
        host.use_on(&a, AccessMode::Shared),
        Err(DeviceError::Unsupported { .. })
    ));
    // Host access to a buffer that claims a CUDA device is refused, naming the way to do it.
    let device = ordered_host(4, Device::Cuda(0));
    let err = device.to_vec::<f64>().unwrap_err();
    assert!(
        matches!(&err, DeviceError::Unsupported { op, device } if op.contains("copy_to_host_async") && device == "cuda:0"),
        "{err}"
    );
    assert!(device.write::<f64>().is_err());
    let elsewhere = ordered_host(4, Device::Meta);
    let err = elsewhere.use_on(&a, AccessMode::Exclusive).unwrap_err();
    assert!(
        matches!(&err, DeviceError::InvalidArgument(m) if m.contains("meta") && m.contains("`a`")),
        "{err}"
    );
}

#[test]
fn a_failed_wait_is_reported_by_the_use() {
    let order = Arc::new(StreamOrder::new());
    let slow = Stream::cpu("slow");
    let (tx, rx) = gate();
    slow.enqueue(move || {
        let _ = rx.recv_timeout(Duration::from_secs(10));
    })
    .unwrap();
    order.after_write(&slow);
    let impatient = Stream::inline_with_timeout("impatient", Duration::from_millis(20));
    assert!(matches!(
        order.before_read(&impatient),
        Err(DeviceError::Timeout { .. })
    ));
    drop(tx);
    slow.synchronize().unwrap();
    order.before_read(&impatient).unwrap();
}

#[test]
fn re_recording_a_returned_event_does_not_move_the_order() {
    let order = StreamOrder::new();
    let slow = Stream::cpu("slow");
    let (tx, rx) = gate();
    slow.enqueue(move || {
        let _ = rx.recv_timeout(Duration::from_secs(10));
    })
    .unwrap();
    let ev = order.after_write(&slow);
    assert!(!ev.query() && !order.is_idle());
    ev.record(&Stream::inline("elsewhere"));
    assert!(ev.query());
    assert!(!order.is_idle(), "the order lost the pending write");
    tx.send(()).unwrap();
    slow.synchronize().unwrap();
    assert!(order.is_idle());
}

/// One issued operation of the property test: a read or a write on one of three streams, with
/// a delay before it touches memory (to widen any race).
#[derive(Clone, Debug)]
struct Op {
    stream: usize,
    write: bool,
    delay_us: u64,
}

fn op() -> impl Strategy<Value = Op> {
    (0..3usize, any::<bool>(), 0..300u64).prop_map(|(stream, write, delay_us)| Op {
        stream,
        write,
        delay_us,
    })
}

/// Cases of the property test; a few under Miri, which interprets every step.
const CASES: u32 = 48;
const CASES_UNDER_MIRI: u32 = 2;

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { CASES_UNDER_MIRI } else { CASES },
        // Under Miri's isolation the regression file cannot be located (no `getcwd`).
        failure_persistence: if cfg!(miri) {
            None
        } else {
            ProptestConfig::default().failure_persistence
        },
        ..ProptestConfig::default()
    })]

    /// Reads only ever observe the last write issued before them, and the final value is the
    /// last write: the host model is "the value of the latest write in program order".
    #[test]
    fn reads_observe_exactly_the_last_write(ops in prop::collection::vec(op(), 1..20)) {
        let streams = [Stream::cpu("s0"), Stream::cpu("s1"), Stream::cpu("s2")];
        let buf = ordered_host(1, Device::Cpu);
        let mut expected_reads = Vec::new();
        let observed = Arc::new(Mutex::new(Vec::new()));
        let mut last_write = 0u64;
        for (i, o) in ops.iter().enumerate() {
            let s = &streams[o.stream];
            let delay = Duration::from_micros(o.delay_us);
            let mode = if o.write { AccessMode::Exclusive } else { AccessMode::Shared };
            let usage = buf.use_on(s, mode).unwrap();
            let (addr, keep) = (usage.as_ptr() as usize, buf.clone());
            if o.write {
                let value = i as u64 + 1;
                last_write = value;
                s.enqueue(move || {
                    std::thread::sleep(delay);
                    cell(addr, 0).store(value, Ordering::SeqCst);
                    drop(keep);
                }).unwrap();
            } else {
                expected_reads.push((i, last_write));
                let log = observed.clone();
                s.enqueue(move || {
                    std::thread::sleep(delay);
                    let v = cell(addr, 0).load(Ordering::SeqCst);
                    log.lock().unwrap().push((i, v));
                    drop(keep);
                }).unwrap();
            }
            usage.finish();
        }
        for s in &streams {
            s.synchronize().unwrap();
        }
        let mut seen = observed.lock().unwrap().clone();
        seen.sort();
        prop_assert_eq!(seen, expected_reads);
        prop_assert_eq!(cell(buf.element_ptr() as usize, 0).load(Ordering::SeqCst), last_write);
    }
}
