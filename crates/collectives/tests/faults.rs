//! Bad input and faults: every case fails on every rank involved with an error that names the
//! ranks and what differed, within the timeout — never a hang, never garbage.

#![allow(clippy::needless_range_loop)] // index arithmetic mirrors the collectives' definitions

use std::time::{Duration, Instant};

use fsdp_collectives::{ring, CollectiveError, Communicator, ReduceOp};
use fsdp_device::{Buffer, DType};

/// Long enough never to be reached in a passing run; the tests assert they finish far sooner.
const TIMEOUT: Duration = Duration::from_secs(20);

fn opts() -> ring::RingOptions {
    ring::RingOptions::default().with_timeout(TIMEOUT)
}

fn f32s(n: usize) -> Buffer {
    Buffer::zeros(DType::F32, n).unwrap()
}

/// Run a two-or-more-rank scenario; each rank returns its error (if any) and how long it took.
fn scenario(
    world: usize,
    opts: ring::RingOptions,
    f: impl Fn(&ring::RingCommunicator) -> Result<(), CollectiveError> + Sync,
) -> Vec<(Result<(), CollectiveError>, Duration)> {
    ring::run_ranks(world, opts, |comm| {
        let t0 = Instant::now();
        let r = f(&comm);
        (r, t0.elapsed())
    })
    .unwrap()
}

fn expect_mismatch(results: &[(Result<(), CollectiveError>, Duration)], needles: &[&str]) {
    for (rank, (r, took)) in results.iter().enumerate() {
        match r {
            Err(CollectiveError::Mismatch {
                rank: er, details, ..
            }) => {
                assert_eq!(*er, rank);
                for n in needles {
                    assert!(details.contains(n), "rank {rank}: `{details}` lacks `{n}`");
                }
            }
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
        assert!(*took < Duration::from_secs(5), "rank {rank} took {took:?}");
    }
}

#[test]
fn length_mismatch_names_both_ranks() {
    let res = scenario(2, opts(), |c| {
        let buf = f32s(4 + c.rank());
        c.all_reduce(&buf, ReduceOp::Sum)?.wait()
    });
    expect_mismatch(
        &res,
        &[
            "rank 0 issued all_reduce(dtype=float32, count=4",
            "rank 1 issued all_reduce(dtype=float32, count=5",
        ],
    );
}

#[test]
fn dtype_mismatch() {
    let res = scenario(3, opts(), |c| {
        let dtype = if c.rank() == 2 {
            DType::BF16
        } else {
            DType::F32
        };
        let input = Buffer::zeros(dtype, 3).unwrap();
        let output = Buffer::zeros(dtype, 9).unwrap();
        c.all_gather_base(&input, &output)?.wait()
    });
    expect_mismatch(
        &res,
        &[
            "ranks [0, 1] issued all_gather_base(dtype=float32",
            "rank 2 issued all_gather_base(dtype=bfloat16",
        ],
    );
}

#[test]
fn reduce_op_mismatch() {
    let res = scenario(2, opts(), |c| {
        let op = if c.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        c.reduce_scatter_base(&f32s(4), &f32s(2), op)?.wait()
    });
    expect_mismatch(&res, &["op=sum", "op=max"]);
}

#[test]
fn root_mismatch() {
    let res = scenario(2, opts(), |c| c.broadcast(&f32s(8), c.rank())?.wait());
    expect_mismatch(
        &res,
        &[
            "rank 0 issued broadcast(dtype=float32, count=8, root=0)",
            "rank 1 issued broadcast(dtype=float32, count=8, root=1)",
        ],
    );
}

#[test]
fn operation_sequence_mismatch_then_group_recovers() {
    let res = scenario(2, opts(), |c| {
        let buf = f32s(4);
        let first = if c.rank() == 0 {
            c.all_reduce(&buf, ReduceOp::Sum)?.wait()
        } else {
            c.broadcast(&buf, 0)?.wait()
        };
        let err = first.unwrap_err();
        // Nothing moved: the group is still usable.
        let ok = Buffer::from_slice(&[1.0f32, 2.0]).unwrap();
        c.all_reduce(&ok, ReduceOp::Sum)?.wait()?;
        assert_eq!(ok.to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
        Err(err)
    });
    expect_mismatch(
        &res,
        &["rank 0 issued all_reduce", "rank 1 issued broadcast"],
    );
}

#[test]
fn invalid_arguments_fail_locally_and_on_peers() {
    let res = scenario(2, opts(), |c| {
        let out_len = if c.rank() == 1 { 7 } else { 8 };
        c.all_gather_base(&f32s(4), &f32s(out_len))?.wait()
    });
    match &res[1].0 {
        Err(CollectiveError::InvalidArgument {
            rank: 1,
            op: "all_gather_base",
            reason,
        }) => {
            assert!(
                reason.contains("output has 7 elements, expected world size 2 x input 4 = 8"),
                "{reason}"
            )
        }
        other => panic!("rank 1: {other:?}"),
    }
    match &res[0].0 {
        Err(CollectiveError::Mismatch { details, .. }) => assert!(
            details.contains("rank 1 issued all_gather_base with invalid arguments: output has 7"),
            "{details}"
        ),
        other => panic!("rank 0: {other:?}"),
    }
    assert!(res.iter().all(|(_, t)| *t < Duration::from_secs(5)));
}

#[test]
fn bad_root_and_bad_group_options_are_errors() {
    let res = scenario(2, opts(), |c| c.reduce(&f32s(2), ReduceOp::Sum, 5)?.wait());
    for (r, (e, _)) in res.iter().enumerate() {
        if r == 0 || r == 1 {
            assert!(
                matches!(e, Err(CollectiveError::InvalidArgument { .. })),
                "{e:?}"
            );
        }
    }
    assert!(matches!(
        ring::new_group(0, opts()),
        Err(CollectiveError::InvalidArgument { .. })
    ));
    let mut o = opts();
    o.slots = 1;
    assert!(matches!(
        ring::new_group(3, o),
        Err(CollectiveError::InvalidArgument { .. })
    ));
    let res = scenario(2, opts(), |c| {
        let outs = vec![f32s(1)];
        c.all_gather(&f32s(1), &outs)?.wait()
    });
    assert!(
        matches!(&res[0].0, Err(CollectiveError::InvalidArgument { reason, .. }) if reason.contains("1 output buffers given, expected one per rank (2)"))
    );
}

#[test]
fn rank_that_never_arrives_times_out_naming_it() {
    let timeout = Duration::from_millis(400);
    let res = scenario(3, ring::RingOptions::default().with_timeout(timeout), |c| {
        if c.rank() == 2 {
            // Arrives only after the others gave up: the group is aborted by then.
            std::thread::sleep(Duration::from_millis(3000));
        }
        c.all_reduce(&f32s(16), ReduceOp::Sum)?.wait()
    });
    // The first rank to time out aborts the group; a rank woken by that abort reports it, with
    // the missing rank named either way.
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
            Err(CollectiveError::Aborted { reason, .. }) => {
                assert!(
                    reason.contains("rank [2] did not reach this collective"),
                    "{reason}"
                )
            }
            other => panic!("rank {r}: {other:?}"),
        }
        // Within the timeout (plus scheduling slack on a loaded machine), long before rank 2
        // arrives; a rank woken by a peer's abort may return a little before its own timeout
        // (the ranks' clocks start a few milliseconds apart).
        let timed_out = matches!(res[r].0, Err(CollectiveError::Timeout { .. }));
        let earliest = if timed_out { timeout } else { timeout / 2 };
        assert!(
            res[r].1 >= earliest && res[r].1 < Duration::from_millis(2500),
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
fn dropped_communicator_makes_peers_fail_fast() {
    let res = scenario(3, opts(), |c| {
        if c.rank() == 1 {
            return Ok(()); // the communicator is dropped when the thread returns
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
    let any_names_peer = [0, 2].iter().any(
        |&r| matches!(&res[r].0, Err(e) if e.to_string().contains("rank 1 has left the group")),
    );
    assert!(any_names_peer, "{res:?}");
}

#[test]
fn rank_panicking_mid_collective_fails_peers_with_clear_error() {
    let comms = ring::new_group(2, opts()).unwrap();
    let mut it = comms.into_iter();
    let (c0, c1) = (it.next().unwrap(), it.next().unwrap());
    let t1 = std::thread::spawn(move || {
        let buf = Buffer::from_slice(&[1.0f32; 64]).unwrap();
        let _work = c1.all_reduce(&buf, ReduceOp::Sum).unwrap();
        panic!("rank 1 crashes while its all-reduce is in flight");
    });
    let t0 = Instant::now();
    let buf = Buffer::from_slice(&[2.0f32; 64]).unwrap();
    // The collective already issued by rank 1 completes (its stream runs it)...
    c0.all_reduce(&buf, ReduceOp::Sum).unwrap().wait().unwrap();
    assert_eq!(buf.to_vec::<f32>().unwrap(), vec![3.0; 64]);
    assert!(t1.join().is_err());
    // ...and the next one fails with an error naming rank 1, well within the timeout.
    let err = c0
        .all_reduce(&buf, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(
        matches!(
            err,
            CollectiveError::PeerDeparted {
                rank: 0,
                peer: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("rank 1 has left the group"),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    // The group is now aborted: later calls fail at once.
    assert!(matches!(c0.barrier(), Err(CollectiveError::Aborted { .. })));
}

#[test]
fn work_wait_timeout_and_poll() {
    let comms = ring::new_group(2, opts()).unwrap();
    let mut it = comms.into_iter();
    let (c0, c1) = (it.next().unwrap(), it.next().unwrap());
    let buf = f32s(8);
    let work = c0.all_reduce(&buf, ReduceOp::Sum).unwrap();
    assert!(!work.is_completed() && work.poll().is_none());
    let err = work.wait_timeout(Duration::from_millis(50)).unwrap_err();
    assert!(
        matches!(
            err,
            CollectiveError::Timeout {
                rank: 0,
                op: "all_reduce",
                ..
            }
        ),
        "{err}"
    );
    let t = std::thread::spawn(move || {
        let b = f32s(8);
        c1.all_reduce(&b, ReduceOp::Sum).unwrap().wait()
    });
    work.wait().unwrap();
    assert!(work.is_completed() && work.poll() == Some(Ok(())));
    t.join().unwrap().unwrap();
}

#[test]
fn host_read_of_an_output_waits_for_the_collective() {
    // Reading the output without waiting on the Work is safe: the read is ordered after the
    // collective that was issued before it.
    let out = ring::run_ranks(4, opts(), |c| {
        let input = Buffer::from_slice(&[c.rank() as f64; 1000]).unwrap();
        let output = Buffer::zeros(DType::F64, 4000).unwrap();
        let _work = c.all_gather_base(&input, &output).unwrap(); // dropped, never waited
        output.to_vec::<f64>().unwrap()
    })
    .unwrap();
    for o in out {
        for q in 0..4 {
            assert!(o[q * 1000..(q + 1) * 1000].iter().all(|&x| x == q as f64));
        }
    }
}

#[test]
fn forgotten_work_keeps_buffers_alive() {
    let out = ring::run_ranks(3, opts(), |c| {
        let buf = Buffer::from_slice(&[1.0f32; 5000]).unwrap();
        let work = c.all_reduce(&buf, ReduceOp::Sum).unwrap();
        let event = work.event().clone();
        std::mem::forget(work);
        drop(buf); // the stream still owns the storage
        event.synchronize().unwrap();
        c.barrier().unwrap().wait()
    })
    .unwrap();
    assert!(out.iter().all(Result::is_ok));
}
