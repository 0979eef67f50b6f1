//! Bad input and faults on the tcp backend: every case fails on every rank involved with an
//! error that names the ranks and what went wrong, within the timeout — never a hang.

#![allow(clippy::needless_range_loop)] // ranks index the per-rank results

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use fsdp_collectives::store::{StoreOptions, TcpStore};
use fsdp_collectives::{tcp, CollectiveError, Communicator, ReduceOp};
use fsdp_device::{Buffer, DType};

/// Long enough never to be reached in a passing run; the tests assert they finish far sooner.
const TIMEOUT: Duration = Duration::from_secs(20);

fn opts() -> tcp::TcpOptions {
    tcp::TcpOptions::default().with_timeout(TIMEOUT)
}

fn f32s(n: usize) -> Buffer {
    Buffer::zeros(DType::F32, n).unwrap()
}

type Outcome = (Result<(), CollectiveError>, Duration);

/// Run a scenario on every rank; each returns its error (if any) and how long it took.
fn scenario(
    world: usize,
    opts: tcp::TcpOptions,
    f: impl Fn(&tcp::TcpCommunicator) -> Result<(), CollectiveError> + Sync,
) -> Vec<Outcome> {
    tcp::run_local_ranks(world, opts, |comm| {
        let t0 = Instant::now();
        let r = f(&comm);
        (r, t0.elapsed())
    })
    .unwrap()
}

fn expect_mismatch(results: &[Outcome], needles: &[&str]) {
    let mut first: Option<&String> = None;
    for (rank, (r, took)) in results.iter().enumerate() {
        match r {
            Err(CollectiveError::Mismatch {
                rank: er, details, ..
            }) => {
                assert_eq!(*er, rank);
                for n in needles {
                    assert!(details.contains(n), "rank {rank}: `{details}` lacks `{n}`");
                }
                // Every rank reports the same differences.
                assert_eq!(details, *first.get_or_insert(details));
            }
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
        assert!(*took < Duration::from_secs(5), "rank {rank} took {took:?}");
    }
}

#[test]
fn length_mismatch_names_the_ranks_and_the_group_recovers() {
    let res = scenario(3, opts(), |c| {
        let buf = f32s(if c.rank() == 1 { 5 } else { 4 });
        let err = c.all_reduce(&buf, ReduceOp::Sum)?.wait().unwrap_err();
        // Nothing moved: the group is still usable.
        let ok = Buffer::from_slice(&[1.0f32, 2.0]).unwrap();
        c.all_reduce(&ok, ReduceOp::Sum)?.wait()?;
        assert_eq!(ok.to_vec::<f32>().unwrap(), vec![3.0, 6.0]);
        Err(err)
    });
    expect_mismatch(
        &res,
        &[
            "ranks [0, 2] issued all_reduce(dtype=float32, count=4, op=sum)",
            "rank 1 issued all_reduce(dtype=float32, count=5, op=sum)",
        ],
    );
}

#[test]
fn dtype_and_operation_mismatches() {
    let res = scenario(2, opts(), |c| {
        let buf = Buffer::zeros(
            if c.rank() == 0 {
                DType::F32
            } else {
                DType::BF16
            },
            8,
        )
        .unwrap();
        c.all_reduce(&buf, ReduceOp::Sum)?.wait()
    });
    expect_mismatch(
        &res,
        &[
            "rank 0 issued all_reduce(dtype=float32",
            "rank 1 issued all_reduce(dtype=bfloat16",
        ],
    );
    let res = scenario(2, opts(), |c| {
        let buf = f32s(4);
        if c.rank() == 0 {
            c.all_reduce(&buf, ReduceOp::Max)?.wait()
        } else {
            c.reduce(&buf, ReduceOp::Max, 1)?.wait()
        }
    });
    expect_mismatch(
        &res,
        &[
            "rank 0 issued all_reduce",
            "rank 1 issued reduce(dtype=float32, count=4, op=max, root=1)",
        ],
    );
}

#[test]
fn invalid_arguments_fail_locally_and_on_peers() {
    let res = scenario(3, opts(), |c| {
        let out_len = if c.rank() == 2 { 7 } else { 12 };
        c.all_gather_base(&f32s(4), &f32s(out_len))?.wait()
    });
    match &res[2].0 {
        Err(CollectiveError::InvalidArgument {
            rank: 2,
            op: "all_gather_base",
            reason,
        }) => assert!(
            reason.contains("output has 7 elements, expected world size 3 x input 4 = 12"),
            "{reason}"
        ),
        other => panic!("rank 2: {other:?}"),
    }
    for r in 0..2 {
        match &res[r].0 {
            Err(CollectiveError::Mismatch { details, .. }) => assert!(
                details
                    .contains("rank 2 issued all_gather_base with invalid arguments: output has 7"),
                "{details}"
            ),
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(res.iter().all(|(_, t)| *t < Duration::from_secs(5)));
    // A root out of range, and bad options.
    let res = scenario(2, opts(), |c| c.broadcast(&f32s(2), 5)?.wait());
    assert!(res
        .iter()
        .all(|(e, _)| matches!(e, Err(CollectiveError::InvalidArgument { reason, .. }) if reason.contains("root 5 >= world size 2"))));
    assert!(matches!(
        tcp::run_local_ranks(2, opts().with_segment_bytes(0), |_| ()),
        Err(CollectiveError::InvalidArgument { .. })
    ));
    assert!(matches!(
        tcp::run_local_ranks(0, opts(), |_| ()),
        Err(CollectiveError::InvalidArgument { .. })
    ));
}

#[test]
fn dropped_communicator_makes_peers_fail_fast() {
    let res = scenario(3, opts(), |c| {
        if c.rank() == 1 {
            return Ok(()); // the communicator (and its sockets) go when the closure returns
        }
        let buf = f32s(1000);
        c.all_reduce(&buf, ReduceOp::Sum)?.wait()
    });
    for r in [0, 2] {
        match &res[r].0 {
            Err(CollectiveError::PeerDeparted { peer: 1, .. })
            | Err(CollectiveError::Aborted { .. }) => {}
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(
            res[r].1 < Duration::from_secs(5),
            "rank {r} took {:?}",
            res[r].1
        );
    }
    let names_peer = [0, 2].iter().any(
        |&r| matches!(&res[r].0, Err(e) if e.to_string().contains("rank 1 has left the group")),
    );
    assert!(names_peer, "{res:?}");
}

#[test]
fn rank_that_never_arrives_times_out_naming_it_and_aborts_the_group() {
    let timeout = Duration::from_millis(500);
    let res = scenario(3, tcp::TcpOptions::default().with_timeout(timeout), |c| {
        if c.rank() == 2 {
            // Arrives only after the others gave up: the group is aborted by then.
            std::thread::sleep(Duration::from_millis(2500));
        }
        let r = c.all_reduce(&f32s(16), ReduceOp::Sum)?.wait();
        // Whatever happened, the communicator is aborted now: later calls fail at once.
        assert!(
            matches!(c.barrier(), Err(CollectiveError::Aborted { .. })),
            "rank {}",
            c.rank()
        );
        assert!(c.aborted().is_some());
        r
    });
    let mut timeouts = 0;
    for r in 0..2 {
        match &res[r].0 {
            Err(CollectiveError::Timeout {
                waiting_for, rank, ..
            }) => {
                assert_eq!(*rank, r);
                assert!(
                    waiting_for.contains("rank [2] did not reach this collective"),
                    "{waiting_for}"
                );
                timeouts += 1;
            }
            Err(CollectiveError::Aborted { reason, .. }) => assert!(
                reason.contains("rank [2] did not reach this collective"),
                "{reason}"
            ),
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(
            res[r].1 >= timeout / 2 && res[r].1 < Duration::from_millis(2400),
            "rank {r} took {:?}",
            res[r].1
        );
    }
    assert!(timeouts >= 1);
    assert!(
        matches!(&res[2].0, Err(CollectiveError::Aborted { reason, .. }) if reason.contains("timed out")),
        "{:?}",
        res[2].0
    );
}

#[test]
fn a_peer_that_never_connects_is_named() {
    // Rank 1 of the store never creates its communicator.
    let timeout = Duration::from_millis(600);
    let server =
        TcpStore::new(StoreOptions::new("127.0.0.1", 0, 0, 2).with_timeout(TIMEOUT)).unwrap();
    let _client =
        TcpStore::new(StoreOptions::new("127.0.0.1", server.port(), 1, 2).with_timeout(TIMEOUT))
            .unwrap();
    let t0 = Instant::now();
    let err = tcp::TcpCommunicator::new(&server, tcp::TcpOptions::default().with_timeout(timeout))
        .unwrap_err();
    assert!(
        matches!(&err, CollectiveError::MissingRanks { rank: 0, missing, .. } if missing == &vec![1]),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_wrong_connection_is_refused_with_an_error() {
    // Rank 1 is played by hand: it publishes a listener of its own, then connects to rank 0
    // claiming to be from another group.
    let server =
        TcpStore::new(StoreOptions::new("127.0.0.1", 0, 0, 2).with_timeout(TIMEOUT)).unwrap();
    let client =
        TcpStore::new(StoreOptions::new("127.0.0.1", server.port(), 1, 2).with_timeout(TIMEOUT))
            .unwrap();
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let imposter = std::thread::spawn(move || {
        client
            .set(
                "fsdp/tcp/g1/addr/1",
                fake.local_addr().unwrap().to_string().as_bytes(),
            )
            .unwrap();
        let addr0 = client.get("fsdp/tcp/g1/addr/0").unwrap();
        let mut s = TcpStream::connect(std::str::from_utf8(&addr0).unwrap()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n__________________________")
            .unwrap();
        // Rank 0 answers with its refusal before closing.
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        let _keep = fake.accept();
        answer
    });
    let err = tcp::TcpCommunicator::new(
        &server,
        tcp::TcpOptions::default().with_timeout(Duration::from_secs(10)),
    )
    .unwrap_err();
    match &err {
        CollectiveError::Backend {
            rank: 0,
            backend: "tcp",
            reason,
            ..
        } => assert!(reason.contains("not an fsdp tcp connection"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let answer = imposter.join().unwrap();
    assert_eq!(answer.first(), Some(&1), "the refusal is sent to the peer");
}

#[test]
fn a_departed_rank_fails_every_other_rank() {
    // Rank 0 drops its communicator in the middle of a long run of collectives; the others
    // (which keep issuing) fail quickly with an error, and stay aborted.
    let res = scenario(4, opts().with_segment_bytes(1024), |c| {
        let buf = f32s(100_000);
        let n = if c.rank() == 0 { 3 } else { 1000 };
        for _ in 0..n {
            c.all_reduce(&buf, ReduceOp::Sum)?.wait()?;
        }
        Ok(())
    });
    assert!(res[0].0.is_ok());
    for r in 1..4 {
        let e = res[r].0.as_ref().unwrap_err();
        assert!(
            matches!(
                e,
                CollectiveError::PeerDeparted { peer: 0, .. } | CollectiveError::Aborted { .. }
            ),
            "rank {r}: {e}"
        );
        assert!(e.to_string().contains("rank 0"), "rank {r}: {e}");
        assert!(
            res[r].1 < Duration::from_secs(10),
            "rank {r} took {:?}",
            res[r].1
        );
    }
}

#[test]
fn work_wait_and_poll() {
    let res = tcp::run_local_ranks(2, opts(), |c| {
        let buf = Buffer::from_slice(&[c.rank() as f32 + 1.0; 3]).unwrap();
        let w = c.all_reduce(&buf, ReduceOp::Sum).unwrap();
        w.wait().unwrap();
        assert!(w.is_completed());
        assert!(matches!(w.poll(), Some(Ok(()))));
        buf.to_vec::<f32>().unwrap()
    })
    .unwrap();
    assert_eq!(res, vec![vec![3.0; 3]; 2]);
}
