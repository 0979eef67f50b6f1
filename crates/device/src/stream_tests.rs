//! Tests of the CPU streams and events.
use super::*;
use std::sync::atomic::AtomicUsize;

#[test]
fn worker_runs_in_order_and_events_complete() {
    let s = Stream::cpu("t");
    let seen = Arc::new(Mutex::new(Vec::new()));
    for i in 0..100 {
        let seen = seen.clone();
        s.enqueue(move || seen.lock().unwrap().push(i)).unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(*seen.lock().unwrap(), (0..100).collect::<Vec<_>>());
    assert!(s.query());
}

#[test]
fn wait_event_orders_two_streams() {
    let a = Stream::cpu("a");
    let b = Stream::cpu("b");
    let value = Arc::new(AtomicUsize::new(0));
    let (gate_tx, gate_rx) = crossbeam_channel::bounded::<()>(0);
    {
        let value = value.clone();
        a.enqueue(move || {
            gate_rx.recv().unwrap();
            value.store(7, Ordering::SeqCst);
        })
        .unwrap();
    }
    let ev = a.record_event();
    assert!(!ev.query());
    b.wait_event(&ev).unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    {
        let (value, seen) = (value.clone(), seen.clone());
        b.enqueue(move || seen.store(value.load(Ordering::SeqCst), Ordering::SeqCst))
            .unwrap();
    }
    gate_tx.send(()).unwrap();
    b.synchronize().unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 7);
    assert!(ev.query());
}

#[test]
fn unrecorded_event_is_complete_and_inline_runs_at_once() {
    assert!(Event::new().query());
    let s = Stream::inline("compute");
    let hit = Arc::new(AtomicUsize::new(0));
    let h = hit.clone();
    s.enqueue(move || {
        h.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    assert_eq!(hit.load(Ordering::SeqCst), 1);
    assert!(s.record_event().query());
}

#[test]
fn synchronize_times_out() {
    let s = Stream::cpu("slow");
    let (tx, rx) = crossbeam_channel::bounded::<()>(0);
    s.enqueue(move || {
        let _ = rx.recv_timeout(Duration::from_secs(5));
    })
    .unwrap();
    let t0 = Instant::now();
    let err = s
        .record_event()
        .synchronize_timeout(Duration::from_millis(50))
        .unwrap_err();
    assert!(matches!(err, DeviceError::Timeout { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    drop(tx);
}

#[test]
fn panicking_task_becomes_sticky_error() {
    let s = Stream::cpu("p");
    let before = s.record_event();
    s.enqueue(|| panic!("boom")).unwrap();
    let after = s.record_event();
    let err = after.synchronize().unwrap_err();
    assert!(err.to_string().contains("boom"), "{err}");
    before.synchronize().unwrap();
    assert!(s.error().is_some());
    // The worker survives: later work still runs.
    let hit = Arc::new(AtomicUsize::new(0));
    let h = hit.clone();
    s.enqueue(move || {
        h.store(1, Ordering::SeqCst);
    })
    .unwrap();
    let _ = s.synchronize();
    assert_eq!(hit.load(Ordering::SeqCst), 1);
}

#[test]
fn inline_wait_event_times_out() {
    let a = Stream::cpu("a");
    let (tx, rx) = crossbeam_channel::bounded::<()>(0);
    a.enqueue(move || {
        let _ = rx.recv_timeout(Duration::from_secs(5));
    })
    .unwrap();
    let ev = a.record_event();
    let c = Stream::inline_with_timeout("c", Duration::from_millis(30));
    assert!(matches!(
        c.wait_event(&ev),
        Err(DeviceError::Timeout { .. })
    ));
    drop(tx);
}

#[test]
fn cpu_and_inline_streams_run_host_tasks() {
    assert!(Stream::cpu("worker").runs_host_tasks());
    assert!(Stream::inline("inline").runs_host_tasks());
}
