//! One conformance suite for every ring transport: the same cases — every collective, reduce op
//! and element type (in place and not), sub-groups, a mismatched call and a timeout — run on
//! ring-threads (ranks as threads), ring-shm and ring-tcp (ranks as processes: the test binary
//! re-executes itself as three rank processes meeting through a store hosted by the parent).
//! Reductions are also checked bitwise against the thread ring on the same data.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use fsdp_collectives::store::{StoreOptions, TcpStore};
use fsdp_collectives::{ring, tcp, CollectiveError, Communicator, ReduceOp};
use fsdp_device::{Buffer, DType};

mod support;
use support::{check_every_collective, reductions};

const WORLD: usize = 3;
const TIMEOUT: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(500);
const ROLE: &str = "FSDP_CONFORMANCE_ROLE";
const PORT: &str = "FSDP_CONFORMANCE_PORT";
const RANK: &str = "FSDP_CONFORMANCE_RANK";

/// The data cases, on a communicator of `WORLD` ranks.
fn suite(comm: &dyn Communicator) {
    let r = comm.rank();
    for (di, dtype) in DType::ALL.into_iter().enumerate() {
        for (oi, op) in ReduceOp::ALL.into_iter().enumerate() {
            check_every_collective(comm, dtype, 37, op, (di + oi) % WORLD);
            check_every_collective(comm, dtype, 0, op, 0);
        }
    }
    // In place: the input is this rank's block of the output.
    let n = 5;
    let out = Buffer::zeros(DType::F32, n * WORLD).unwrap();
    out.slice(r * n..(r + 1) * n)
        .unwrap()
        .copy_from_slice(&vec![r as f32; n])
        .unwrap();
    comm.all_gather_base(&out.slice(r * n..(r + 1) * n).unwrap(), &out)
        .unwrap()
        .wait()
        .unwrap();
    let want: Vec<f32> = (0..WORLD * n).map(|i| (i / n) as f32).collect();
    assert_eq!(out.to_vec::<f32>().unwrap(), want);
    // Bitwise the thread ring's reductions.
    let mine = reductions(comm, 203);
    let threads = ring::run_ranks(
        WORLD,
        ring::RingOptions::default().with_segment_bytes(24),
        |c| reductions(&c, 203),
    )
    .unwrap();
    assert!(
        mine == threads[r],
        "rank {r}: reductions differ from the thread ring"
    );
    // Sub-groups: {0, 2} and {1}.
    let sub = comm.split(Some((r % 2) as u32), r).unwrap().unwrap();
    let b = Buffer::from_slice(&[r as f32 + 1.0]).unwrap();
    sub.all_reduce(&b, ReduceOp::Sum).unwrap().wait().unwrap();
    let want = if r % 2 == 0 { 4.0 } else { 2.0 };
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![want]);
    // A mismatch fails every rank, names the odd rank, and leaves the group usable.
    let len = if r == 1 { 5 } else { 4 };
    let m = Buffer::zeros(DType::F32, len).unwrap();
    let err = comm
        .all_reduce(&m, ReduceOp::Sum)
        .and_then(|w| w.wait())
        .unwrap_err();
    match &err {
        CollectiveError::Mismatch { details, .. } => {
            assert!(details.contains("rank 1 issued all_reduce"), "{details}")
        }
        other => panic!("rank {r}: expected a mismatch, got {other}"),
    }
    comm.barrier().unwrap().wait().unwrap();
}

/// The timeout case, on a fresh communicator with a short timeout: rank 2 never arrives; the
/// others time out naming it, and the group is aborted.
fn timeout_case(comm: &dyn Communicator) {
    if comm.rank() == 2 {
        std::thread::sleep(SHORT * 4);
        return;
    }
    let err = comm.barrier().and_then(|w| w.wait()).unwrap_err();
    assert!(
        err.to_string().contains("did not reach this collective"),
        "rank {}: {err}",
        comm.rank()
    );
    assert!(matches!(
        comm.barrier(),
        Err(CollectiveError::Aborted { .. })
    ));
}

#[test]
fn ring_threads() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    ring::run_ranks(
        WORLD,
        ring::RingOptions::default().with_segment_bytes(24),
        |c| suite(&c),
    )
    .unwrap();
    ring::run_ranks(
        WORLD,
        ring::RingOptions::default().with_timeout(SHORT),
        |c| timeout_case(&c),
    )
    .unwrap();
}

/// In a child: run the suite over `transport`; in the parent: spawn the children and check them.
fn processes(test: &str, transport: tcp::ProcessTransport) {
    if let Ok(role) = std::env::var(ROLE) {
        if role != test {
            return;
        }
        let port: u16 = std::env::var(PORT).unwrap().parse().unwrap();
        let rank: usize = std::env::var(RANK).unwrap().parse().unwrap();
        let store = TcpStore::new(
            StoreOptions::new("127.0.0.1", port, rank, WORLD)
                .with_server(false)
                .with_timeout(TIMEOUT),
        )
        .unwrap();
        let opts = tcp::TcpOptions::default()
            .with_transport(transport)
            .with_segment_bytes(24);
        let comm = tcp::TcpCommunicator::new(&store, opts.clone().with_timeout(TIMEOUT)).unwrap();
        assert_eq!(comm.transport(), transport);
        suite(&comm);
        let short = tcp::TcpCommunicator::new(&store, opts.with_timeout(SHORT)).unwrap();
        timeout_case(&short);
        println!("rank {rank}: conformant");
        return;
    }
    let server =
        TcpStore::new(StoreOptions::new("127.0.0.1", 0, 0, WORLD).with_timeout(TIMEOUT)).unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..WORLD)
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env(ROLE, test)
                .env(PORT, server.port().to_string())
                .env(RANK, rank.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, mut c) in children.into_iter().enumerate() {
        let mut out = String::new();
        let _ = c.stdout.take().unwrap().read_to_string(&mut out);
        let _ = c.stderr.take().unwrap().read_to_string(&mut out);
        let status = c.wait().unwrap();
        assert!(
            status.success() && out.contains("conformant"),
            "rank {rank} ({test}): {status}\n{out}"
        );
    }
}

#[test]
fn ring_shm_processes() {
    processes("ring_shm_processes", tcp::ProcessTransport::Shm);
}

#[test]
fn ring_tcp_processes() {
    processes("ring_tcp_processes", tcp::ProcessTransport::Tcp);
}
