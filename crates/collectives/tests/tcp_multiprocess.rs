//! The tcp backend across real processes: the test binary re-executes itself as three rank
//! processes that meet through a store hosted by the parent on 127.0.0.1 (a free port).
//!
//! - every collective, for every element type and reduce op, checked against a naive host
//!   reference, and the reductions checked bitwise against the in-process ring backend run
//!   inside each child on the same data;
//! - a rank process that dies in the middle of a collective makes the others fail with an error
//!   naming it, well within the timeout.

#![allow(clippy::needless_range_loop)] // index arithmetic mirrors the collectives' definitions

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fsdp_collectives::store::{StoreOptions, TcpStore};
use fsdp_collectives::{ring, tcp, CollectiveError, Communicator, ReduceOp};
use fsdp_device::{Buffer, DType};

mod support;
use support::{check_every_collective, reductions};

const ROLE: &str = "FSDP_TCP_MP_ROLE";
const PORT: &str = "FSDP_TCP_MP_PORT";
const RANK: &str = "FSDP_TCP_MP_RANK";
const WORLD: usize = 3;
/// Bound of every wait inside the children; the parent gives them this long in all.
const TIMEOUT: Duration = Duration::from_secs(60);

/// Kills and reaps the children on every path out of the parent.
struct Children(Vec<(usize, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Spawn `WORLD` children running `test` in `role`, wait for all of them (at most `TIMEOUT`),
/// and return each one's exit code and output.
fn run_children(test: &str, role: &str) -> Vec<(Option<i32>, String)> {
    let server = TcpStore::new(StoreOptions::new("127.0.0.1", 0, 0, WORLD).with_timeout(TIMEOUT))
        .expect("hosting the store");
    let exe = std::env::current_exe().unwrap();
    let mut children = Children(Vec::new());
    let mut readers = Vec::new();
    for rank in 0..WORLD {
        let mut child = Command::new(&exe)
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env(PORT, server.port().to_string())
            .env(RANK, rank.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning a rank process");
        let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        readers.push(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            let _ = err.read_to_string(&mut s);
            s
        }));
        children.0.push((rank, child));
    }
    let deadline = Instant::now() + TIMEOUT;
    let mut codes = vec![None; WORLD];
    let mut done = vec![false; WORLD];
    while done.iter().any(|d| !d) {
        for (rank, c) in &mut children.0 {
            if !done[*rank] {
                if let Some(status) = c.try_wait().unwrap() {
                    codes[*rank] = status.code();
                    done[*rank] = true;
                }
            }
        }
        if Instant::now() > deadline {
            drop(children);
            panic!("rank processes did not finish within {TIMEOUT:?} (done: {done:?})");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(children);
    codes
        .into_iter()
        .zip(readers)
        .map(|(c, r)| (c, r.join().unwrap()))
        .collect()
}

/// The child's communicator, through the parent's store.
fn child_comm(opts: tcp::TcpOptions) -> (TcpStore, tcp::TcpCommunicator) {
    let port: u16 = std::env::var(PORT).unwrap().parse().unwrap();
    let rank: usize = std::env::var(RANK).unwrap().parse().unwrap();
    let store = TcpStore::new(
        StoreOptions::new("127.0.0.1", port, rank, WORLD)
            .with_server(false)
            .with_timeout(TIMEOUT),
    )
    .unwrap();
    let comm = tcp::TcpCommunicator::new(&store, opts).unwrap();
    (store, comm)
}

#[test]
fn three_processes_run_every_collective() {
    if std::env::var(ROLE).as_deref() == Ok("collectives") {
        let opts = tcp::TcpOptions::default()
            .with_timeout(TIMEOUT)
            .with_segment_bytes(24);
        let (_store, comm) = child_comm(opts);
        let r = comm.rank();
        for (di, dtype) in DType::ALL.into_iter().enumerate() {
            for (oi, op) in ReduceOp::ALL.into_iter().enumerate() {
                check_every_collective(&comm, dtype, 37, op, (di + oi) % WORLD);
                check_every_collective(&comm, dtype, 0, op, 0);
            }
        }
        // The same reductions in-process on the ring backend: this rank's results must be
        // bitwise identical.
        let mine = reductions(&comm, 203);
        let ring = ring::run_ranks(
            WORLD,
            ring::RingOptions::default().with_segment_bytes(24),
            |c| reductions(&c, 203),
        )
        .unwrap();
        assert!(
            mine == ring[r],
            "rank {r}: tcp reductions differ from the ring backend"
        );
        // Sub-groups across processes: {0, 2} and {1}.
        let sub = comm.split(Some((r % 2) as u32), r).unwrap().unwrap();
        let b = Buffer::from_slice(&[r as f32 + 1.0]).unwrap();
        sub.all_reduce(&b, ReduceOp::Sum).unwrap().wait().unwrap();
        let want = if r % 2 == 0 { 4.0 } else { 2.0 };
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![want]);
        comm.barrier().unwrap().wait().unwrap();
        println!("rank {r}: all collectives match the reference");
        return;
    }
    if std::env::var(ROLE).is_ok() {
        return; // a child of the other test
    }
    let results = run_children("three_processes_run_every_collective", "collectives");
    for (rank, (code, out)) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank} failed:\n{out}");
        assert!(
            out.contains(&format!("rank {rank}: all collectives match the reference")),
            "{out}"
        );
    }
}

#[test]
fn a_process_that_dies_fails_the_others() {
    if std::env::var(ROLE).as_deref() == Ok("dies") {
        let (_store, comm) = child_comm(
            tcp::TcpOptions::default()
                .with_timeout(TIMEOUT)
                .with_segment_bytes(4096),
        );
        let r = comm.rank();
        let buf = Buffer::from_slice(&vec![1.0f32; 1 << 18]).unwrap();
        comm.all_reduce(&buf, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(buf.to_vec::<f32>().unwrap()[0], 3.0);
        if r == 2 {
            // Die abruptly while the next all-reduce is in flight (no destructors run).
            let _w = comm.all_reduce(&buf, ReduceOp::Sum).unwrap();
            std::thread::sleep(Duration::from_millis(5));
            std::process::exit(17);
        }
        let t0 = Instant::now();
        let mut err = None;
        for _ in 0..100 {
            if let Err(e) = comm.all_reduce(&buf, ReduceOp::Sum).and_then(|w| w.wait()) {
                err = Some(e);
                break;
            }
        }
        let err = err.expect("the collectives kept succeeding without rank 2");
        let took = t0.elapsed();
        println!("rank {r}: failed after {took:?} with: {err}");
        assert!(
            matches!(
                err,
                CollectiveError::PeerDeparted { peer: 2, .. } | CollectiveError::Aborted { .. }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("rank 2"), "{err}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
        // The communicator is aborted for good.
        assert!(matches!(
            comm.barrier(),
            Err(CollectiveError::Aborted { .. })
        ));
        println!("rank {r}: failed as expected");
        return;
    }
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let results = run_children("a_process_that_dies_fails_the_others", "dies");
    assert_eq!(results[2].0, Some(17), "rank 2:\n{}", results[2].1);
    for rank in 0..2 {
        let (code, out) = &results[rank];
        assert_eq!(*code, Some(0), "rank {rank} failed:\n{out}");
        assert!(
            out.contains(&format!("rank {rank}: failed as expected")),
            "{out}"
        );
        for line in out.lines().filter(|l| l.contains("failed after")) {
            println!("{line}");
        }
    }
}
