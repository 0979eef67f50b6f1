//! Unit tests of our protocol's encoding and of the server's request handling.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::server::{handle, Shared};
use super::wire::{Dec, Enc, Op, Reply};

#[test]
fn encoding_round_trips() {
    let req = Enc::new(Op::Wait).strs(&["a", "bc", ""]).u64(7).finish();
    let mut d = Dec::new(&req);
    assert_eq!(d.u8().unwrap(), Op::Wait as u8);
    assert_eq!(d.strings().unwrap(), vec!["a", "bc", ""]);
    assert_eq!(d.u64().unwrap(), 7);
    d.end().unwrap();
    for reply in [
        Reply::Ok(vec![1, 2, 3]),
        Reply::Error("no".into()),
        Reply::TimedOut(vec!["k/1".into(), "k/2".into()]),
        Reply::Stopping("bye".into()),
    ] {
        let back = Reply::decode(reply.encode()).unwrap();
        assert_eq!(format!("{back:?}"), format!("{reply:?}"));
    }
}

#[test]
fn malformed_input_is_an_error_not_a_panic() {
    // Truncated fields, absurd counts, unknown codes.
    assert!(Dec::new(&[0, 0, 0, 9, 1]).bytes().is_err());
    assert!(Dec::new(&[255, 255, 255, 255]).strings().is_err());
    assert!(Op::from_u8(99).is_err());
    assert!(Reply::decode(vec![]).is_err());
    assert!(Reply::decode(vec![7]).is_err());
    let shared = Shared {
        keys: Mutex::new(HashMap::new()),
        changed: Condvar::new(),
        stop: AtomicBool::new(false),
        live_conns: Mutex::new(0),
        conns_done: Condvar::new(),
        open: Mutex::new(HashMap::new()),
        io_timeout: Duration::from_secs(1),
        rank: 0,
        world_size: 1,
        job_id: "test".into(),
        token: None,
        fatal: Mutex::new(None),
    };
    assert!(matches!(handle(&shared, &[]), Reply::Error(_)));
    assert!(matches!(
        handle(&shared, &[Op::Set as u8, 0, 0]),
        Reply::Error(_)
    ));
    let trailing = Enc::new(Op::NumKeys).u8(0).finish();
    assert!(matches!(handle(&shared, &trailing), Reply::Error(_)));
    // A counter over a non-integer value is refused, and overflow too.
    let set = Enc::new(Op::Set).bytes(b"k").bytes(b"x").finish();
    assert!(matches!(handle(&shared, &set), Reply::Ok(_)));
    let add = Enc::new(Op::Add).bytes(b"k").i64(1).finish();
    assert!(matches!(handle(&shared, &add), Reply::Error(m) if m.contains("not an integer")));
    let add = Enc::new(Op::Add).bytes(b"n").i64(i64::MAX).finish();
    assert!(matches!(handle(&shared, &add), Reply::Ok(_)));
    let add = Enc::new(Op::Add).bytes(b"n").i64(1).finish();
    assert!(matches!(handle(&shared, &add), Reply::Error(m) if m.contains("overflows")));
}
