//! The rendezvous store on loopback: every operation across processes (the test binary re-executes
//! itself as ranks 1 and 2), concurrency inside one process, timeouts, a rank that never arrives,
//! a server that never comes, a port already taken, a server that goes away.

use std::collections::HashSet;
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use fsdp_collectives::store::{StoreOptions, TcpStore};
use fsdp_collectives::CollectiveError;

const HOST: &str = "127.0.0.1";
/// Slack allowed past a timeout on this small, shared machine.
const MARGIN: Duration = Duration::from_millis(1500);

fn server(world: usize, timeout: Duration) -> TcpStore {
    TcpStore::new(StoreOptions::new(HOST, 0, 0, world).with_timeout(timeout)).unwrap()
}

fn client(port: u16, rank: usize, world: usize, timeout: Duration) -> TcpStore {
    TcpStore::new(StoreOptions::new(HOST, port, rank, world).with_timeout(timeout)).unwrap()
}

fn assert_elapsed_within(start: Instant, lo: Duration, what: &str) {
    let took = start.elapsed();
    assert!(
        took + Duration::from_millis(20) >= lo && took <= lo + MARGIN,
        "{what} took {took:?}; expected about {lo:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Across processes.

/// Children, killed and reaped on every path.
struct Children(Vec<Child>);

impl Children {
    fn wait_all(&mut self, timeout: Duration) -> Vec<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        for child in &mut self.0 {
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    out.push(status);
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "child {} did not finish within {timeout:?}",
                    child.id()
                );
                thread::sleep(Duration::from_millis(20));
            }
        }
        out
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

const ROLE: &str = "FSDP_STORE_TEST_RANK";
const PORT: &str = "FSDP_STORE_TEST_PORT";

/// What every rank does, rank 0 included; the checks are against values computed here.
fn rank_program(store: &TcpStore) {
    let rank = store.rank();
    let world = store.world_size();
    let t = Duration::from_secs(20);

    // set / get: every rank publishes a value and reads everyone's (waiting for late ones).
    store
        .set(
            &format!("val/{rank}"),
            format!("value of rank {rank}").as_bytes(),
        )
        .unwrap();
    for q in 0..world {
        let v = store.get(&format!("val/{q}")).unwrap();
        assert_eq!(v, format!("value of rank {q}").into_bytes());
    }
    // wait / check.
    let vals: Vec<String> = (0..world).map(|q| format!("val/{q}")).collect();
    let vals: Vec<&str> = vals.iter().map(String::as_str).collect();
    store.wait(&vals, t).unwrap();
    assert!(store.check(&vals).unwrap());
    assert!(!store.check(&["val/0", "never-set"]).unwrap());
    assert_eq!(store.try_get("never-set").unwrap(), None);
    assert_eq!(
        store.try_get("val/0").unwrap().as_deref(),
        Some(&b"value of rank 0"[..])
    );

    // add: rank r adds r + 1; each returned value is a distinct partial sum.
    let mine = store.add("counter", rank as i64 + 1).unwrap();
    store
        .set(&format!("partial/{rank}"), mine.to_string().as_bytes())
        .unwrap();

    // compare_set: everyone tries to become the leader; exactly one wins.
    let got = store
        .compare_set("leader", b"", rank.to_string().as_bytes())
        .unwrap();
    store.barrier("after-updates", t).unwrap();
    let total: i64 = (1..=world as i64).sum();
    assert_eq!(
        store.get("counter").unwrap(),
        total.to_string().into_bytes()
    );
    let leader = store.get("leader").unwrap();
    assert_eq!(got, leader, "rank {rank}: compare_set returned {got:?}");
    let mut partials: Vec<i64> = (0..world)
        .map(|q| {
            let v = store.get(&format!("partial/{q}")).unwrap();
            String::from_utf8(v).unwrap().parse().unwrap()
        })
        .collect();
    partials.sort_unstable();
    assert_eq!(partials.last(), Some(&total));
    assert_eq!(partials.iter().collect::<HashSet<_>>().len(), world);
    // A failed compare_set leaves the value alone and returns it.
    assert_eq!(
        store.compare_set("leader", b"nobody", b"x").unwrap(),
        leader
    );
    assert_eq!(store.get("leader").unwrap(), leader);

    // delete_key: each rank creates and deletes its own key.
    let tmp = format!("tmp/{rank}");
    store.set(&tmp, b"x").unwrap();
    assert!(store.delete_key(&tmp).unwrap());
    assert!(!store.delete_key(&tmp).unwrap());
    assert_eq!(store.try_get(&tmp).unwrap(), None);
    store.barrier("done", t).unwrap();
}

#[test]
fn every_operation_across_three_processes() {
    if let Ok(rank) = std::env::var(ROLE) {
        let port: u16 = std::env::var(PORT).unwrap().parse().unwrap();
        let store = client(port, rank.parse().unwrap(), 3, Duration::from_secs(20));
        rank_program(&store);
        return;
    }
    let store = server(3, Duration::from_secs(20));
    let exe = std::env::current_exe().unwrap();
    let mut children = Children(Vec::new());
    for rank in 1..3 {
        children.0.push(
            Command::new(&exe)
                .args([
                    "--exact",
                    "every_operation_across_three_processes",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(ROLE, rank.to_string())
                .env(PORT, store.port().to_string())
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        );
    }
    rank_program(&store);
    let statuses = children.wait_all(Duration::from_secs(30));
    for (i, s) in statuses.iter().enumerate() {
        assert!(s.success(), "rank {} failed: {s}", i + 1);
    }
    // Keys left: val/0..3, counter, partial/0..3, leader, and two barriers of 3 keys.
    assert_eq!(store.num_keys().unwrap(), 3 + 1 + 3 + 1 + 3 + 3);
}

// ---------------------------------------------------------------------------------------------
// Concurrency inside one process.

#[test]
fn wait_and_get_are_woken_by_a_later_set() {
    let t = Duration::from_secs(10);
    let s = server(3, t);
    let a = client(s.port(), 1, 3, t);
    let b = client(s.port(), 2, 3, t);
    let start = Instant::now();
    let waiter = thread::spawn(move || {
        a.wait(&["late/x", "late/y"], Duration::from_secs(10))
            .unwrap();
        (a.get("late/y").unwrap(), Instant::now())
    });
    let getter = {
        let s = s.clone();
        thread::spawn(move || (s.get("late/x").unwrap(), Instant::now()))
    };
    thread::sleep(Duration::from_millis(300));
    assert!(!waiter.is_finished() && !getter.is_finished());
    let set_at = Instant::now();
    b.set("late/x", b"1").unwrap();
    b.set("late/y", b"2").unwrap();
    let (y, woke) = waiter.join().unwrap();
    let (x, got_at) = getter.join().unwrap();
    assert_eq!((x, y), (b"1".to_vec(), b"2".to_vec()));
    assert!(woke >= set_at && got_at >= set_at);
    // Woken promptly, not at some poll interval or timeout.
    assert!(
        woke - set_at < Duration::from_secs(1),
        "{:?}",
        woke - set_at
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_waiting_thread_does_not_block_others_on_the_same_handle() {
    let t = Duration::from_secs(10);
    let s = server(2, t);
    let c = client(s.port(), 1, 2, t);
    let c2 = c.clone();
    let waiter = thread::spawn(move || c2.get("k"));
    thread::sleep(Duration::from_millis(200));
    // The same handle (a clone) sets the key the other thread is waiting for.
    c.set("k", b"v").unwrap();
    assert_eq!(waiter.join().unwrap().unwrap(), b"v");
}

#[test]
fn add_from_many_threads_gives_the_exact_total() {
    let t = Duration::from_secs(20);
    let s = server(5, t);
    let clients: Vec<TcpStore> = (1..5).map(|r| client(s.port(), r, 5, t)).collect();
    const THREADS: usize = 8;
    const ADDS: usize = 50;
    let go = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            // Two threads per client: they share its connection pool.
            let c = clients[i % clients.len()].clone();
            let go = Arc::clone(&go);
            thread::spawn(move || {
                go.wait();
                (0..ADDS)
                    .map(|_| c.add("total", 3).unwrap())
                    .collect::<Vec<i64>>()
            })
        })
        .collect();
    let mut seen: Vec<i64> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    seen.sort_unstable();
    // Each add returned a distinct new value: exactly 3, 6, ..., 3 * THREADS * ADDS.
    let expected: Vec<i64> = (1..=(THREADS * ADDS) as i64).map(|k| 3 * k).collect();
    assert_eq!(seen, expected);
    assert_eq!(
        s.get("total").unwrap(),
        (3 * THREADS * ADDS).to_string().into_bytes()
    );
    assert_eq!(s.add("total", -1).unwrap(), (3 * THREADS * ADDS) as i64 - 1);
}

// ---------------------------------------------------------------------------------------------
// Timeouts and failures.

#[test]
fn get_and_wait_of_absent_keys_time_out_naming_the_keys() {
    let t = Duration::from_secs(1);
    let s = server(2, t);
    let c = client(s.port(), 1, 2, t);
    c.set("present", b"here").unwrap();

    let start = Instant::now();
    let err = c.get("absent/get").unwrap_err();
    assert_elapsed_within(start, t, "get");
    // A key that never comes is this rank's failure, not a peer's leaving.
    assert!(!err.caused_by_peer(), "{err:?}");
    match &err {
        CollectiveError::Store {
            rank: 1,
            op: "get",
            reason,
        } => {
            assert!(reason.contains("\"absent/get\""), "{reason}");
            assert!(
                reason.contains(&format!("127.0.0.1:{}", s.port())),
                "{reason}"
            );
        }
        other => panic!("unexpected error {other:?}"),
    }

    let start = Instant::now();
    let wait = Duration::from_millis(800);
    let err = s
        .wait(&["present", "absent/a", "absent/b"], wait)
        .unwrap_err();
    assert_elapsed_within(start, wait, "wait");
    match &err {
        CollectiveError::Store {
            rank: 0,
            op: "wait",
            reason,
        } => {
            assert!(
                reason.contains(r#"keys ["absent/a", "absent/b"] did not appear"#),
                "{reason}"
            );
            assert!(reason.contains("1 of 3 keys present"), "{reason}");
        }
        other => panic!("unexpected error {other:?}"),
    }
    // The store is still usable after timeouts.
    assert_eq!(c.get("present").unwrap(), b"here");
    assert!(s.wait(&["present"], Duration::ZERO).is_ok());
}

#[test]
fn a_rank_that_never_arrives_is_named_by_the_barrier() {
    // World 3: ranks 0 and 1 start, rank 2 never does.
    let t = Duration::from_secs(3);
    let s = server(3, t);
    let c = client(s.port(), 1, 3, t);
    let barrier_timeout = Duration::from_millis(1500);
    let start = Instant::now();
    let other = thread::spawn(move || c.barrier("init", barrier_timeout));
    let mine = s.barrier("init", barrier_timeout);
    let theirs = other.join().unwrap();
    assert_elapsed_within(start, barrier_timeout, "barrier");
    for (rank, result) in [(0, mine), (1, theirs)] {
        match result {
            Err(CollectiveError::MissingRanks {
                rank: r,
                missing,
                waited,
                what,
            }) => {
                assert_eq!(r, rank);
                assert_eq!(missing, vec![2]);
                assert_eq!(waited, barrier_timeout);
                assert!(what.contains("init"), "{what}");
            }
            other => panic!("rank {rank}: unexpected result {other:?}"),
        }
    }
}

#[test]
fn barrier_lists_exactly_the_absent_ranks() {
    // World 5: ranks 0 and 3 arrive, 1, 2 and 4 do not.
    let t = Duration::from_secs(3);
    let s = server(5, t);
    let c = client(s.port(), 3, 5, t);
    let bt = Duration::from_millis(700);
    let other = thread::spawn(move || c.barrier("b", bt));
    let err = s.barrier("b", bt).unwrap_err();
    let err3 = other.join().unwrap().unwrap_err();
    for e in [err, err3] {
        match e {
            CollectiveError::MissingRanks { missing, .. } => assert_eq!(missing, vec![1, 2, 4]),
            other => panic!("unexpected {other:?}"),
        }
    }
    // When everyone arrives, the barrier passes.
    let s2 = server(3, t);
    let clients: Vec<_> = (1..3).map(|r| client(s2.port(), r, 3, t)).collect();
    let handles: Vec<_> = clients
        .into_iter()
        .map(|c| thread::spawn(move || c.barrier("all", Duration::from_secs(5))))
        .collect();
    s2.barrier("all", Duration::from_secs(5)).unwrap();
    for h in handles {
        h.join().unwrap().unwrap();
    }
}

#[test]
fn a_client_whose_server_never_comes_fails_naming_the_address() {
    // A port that nobody listens on.
    let port = TcpListener::bind((HOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t = Duration::from_secs(1);
    let start = Instant::now();
    let err = TcpStore::new(StoreOptions::new(HOST, port, 1, 2).with_timeout(t)).unwrap_err();
    assert_elapsed_within(start, t, "connect");
    // Never reached: not a server that went away.
    assert!(!err.caused_by_peer(), "{err:?}");
    match &err {
        CollectiveError::Store {
            rank: 1,
            op: "connect",
            reason,
        } => {
            assert!(reason.contains(&format!("127.0.0.1:{port}")), "{reason}");
            assert!(reason.contains("after trying for"), "{reason}");
        }
        other => panic!("unexpected error {other:?}"),
    }
}

#[test]
fn a_client_started_before_its_server_connects_when_it_comes() {
    let port = TcpListener::bind((HOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t = Duration::from_secs(10);
    let c = thread::spawn(move || {
        let c = client(port, 1, 2, t);
        c.set("hello", b"from 1").unwrap();
        c
    });
    thread::sleep(Duration::from_millis(300));
    let s = TcpStore::new(StoreOptions::new(HOST, port, 0, 2).with_timeout(t)).unwrap();
    assert_eq!(s.get("hello").unwrap(), b"from 1");
    drop(c.join().unwrap());
}

#[test]
fn a_port_already_taken_is_a_bind_error() {
    let taken = TcpListener::bind((HOST, 0)).unwrap();
    let port = taken.local_addr().unwrap().port();
    let start = Instant::now();
    let err =
        TcpStore::new(StoreOptions::new(HOST, port, 0, 2).with_timeout(Duration::from_secs(2)))
            .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(1));
    match &err {
        CollectiveError::Store {
            rank: 0,
            op: "bind",
            reason,
        } => {
            assert!(reason.contains(&format!("127.0.0.1:{port}")), "{reason}");
            assert!(reason.contains("already in use"), "{reason}");
        }
        other => panic!("unexpected error {other:?}"),
    }
}

#[test]
fn something_else_on_the_port_is_not_mistaken_for_a_store() {
    // A listener that accepts connections (in the kernel's backlog) but never answers.
    let mute = TcpListener::bind((HOST, 0)).unwrap();
    let port = mute.local_addr().unwrap().port();
    let t = Duration::from_secs(1);
    let start = Instant::now();
    let err = TcpStore::new(StoreOptions::new(HOST, port, 1, 2).with_timeout(t)).unwrap_err();
    assert!(start.elapsed() <= t + MARGIN, "{:?}", start.elapsed());
    match &err {
        CollectiveError::Store {
            op: "connect",
            reason,
            ..
        } => {
            assert!(reason.contains("is this a store server"), "{reason}");
        }
        other => panic!("unexpected error {other:?}"),
    }
}

#[test]
fn a_server_that_goes_away_is_an_error_not_a_hang() {
    let t = Duration::from_secs(20);
    let s = server(2, t);
    let port = s.port();
    let c = client(port, 1, 2, t);
    let c2 = c.clone();
    let waiter = thread::spawn(move || {
        let result = c2.wait(&["never"], Duration::from_secs(20));
        (result, Instant::now())
    });
    thread::sleep(Duration::from_millis(300));
    // Dropping rank 0's last handle stops the server, boundedly, even with a client waiting.
    let start = Instant::now();
    drop(s);
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    // The waiting client learns it at once, not at the end of its 20 s wait.
    let (result, ended) = waiter.join().unwrap();
    assert!(
        ended - start < Duration::from_secs(2),
        "{:?}",
        ended - start
    );
    let e = result.unwrap_err();
    // Typed, not by its words: this rank's failure is a consequence of rank 0's leaving.
    assert!(e.caused_by_peer(), "{e:?}");
    match e {
        CollectiveError::StoreLost {
            rank: 1,
            op: "wait",
            reason,
        } => {
            assert!(reason.contains(&format!("127.0.0.1:{port}")), "{reason}");
            // Either the server's last word or the closed connection, never a timeout.
            assert!(
                reason.contains("stopping") || reason.contains("closed"),
                "{reason}"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    // The next call fails too, naming the server's address.
    match c.set("x", b"y").unwrap_err() {
        CollectiveError::StoreLost {
            op: "set", reason, ..
        } => {
            assert!(reason.contains(&format!("127.0.0.1:{port}")), "{reason}")
        }
        other => panic!("unexpected {other:?}"),
    }
    // The port is free again.
    drop(TcpListener::bind((HOST, port)).unwrap());
}

#[test]
fn the_server_lives_as_long_as_a_clone_of_rank_zeros_handle() {
    let t = Duration::from_secs(5);
    let s = server(2, t);
    let keep = s.clone();
    let c = client(s.port(), 1, 2, t);
    drop(s);
    c.set("still", b"there").unwrap();
    assert_eq!(keep.get("still").unwrap(), b"there");
    assert_eq!(keep.num_keys().unwrap(), 1);
}

#[test]
fn invalid_options_are_refused() {
    for (opts, needle) in [
        (StoreOptions::new(HOST, 1, 3, 3), "out of range"),
        (StoreOptions::new(HOST, 1, 0, 0), "world_size"),
        (StoreOptions::new(HOST, 0, 1, 2), "port"),
        (
            StoreOptions::new(HOST, 0, 0, 2).with_timeout(Duration::ZERO),
            "timeout",
        ),
        (StoreOptions::new("", 0, 0, 2), "host"),
    ] {
        match TcpStore::new(opts).unwrap_err() {
            CollectiveError::InvalidArgument { reason, .. } => {
                assert!(reason.contains(needle), "{reason}")
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // A host that does not resolve is a bind error that names it.
    match TcpStore::new(StoreOptions::new("no-such-host.invalid", 0, 0, 1)).unwrap_err() {
        CollectiveError::Store {
            op: "bind", reason, ..
        } => {
            assert!(reason.contains("no-such-host.invalid"), "{reason}")
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn values_are_binary_and_may_be_large() {
    let t = Duration::from_secs(10);
    let s = server(2, t);
    let c = client(s.port(), 1, 2, t);
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 256) as u8).collect();
    c.set("big", &big).unwrap();
    assert_eq!(s.get("big").unwrap(), big);
    c.set("empty", b"").unwrap();
    assert_eq!(s.get("empty").unwrap(), b"");
    assert_eq!(s.try_get("empty").unwrap(), Some(Vec::new()));
    c.set("big", b"small now").unwrap();
    assert_eq!(s.get("big").unwrap(), b"small now");
    assert_eq!(s.num_keys().unwrap(), 2);
}
