//! The tcp backend across real processes, beyond the conformance suite (which runs every
//! collective over tcp and shm processes, `tests/conformance.rs`): a rank process that dies in
//! the middle of a collective makes the others fail with an error naming it, well within the
//! timeout.

use std::time::{Duration, Instant};

use fsdp_collectives::{tcp, CollectiveError, Communicator, ReduceOp};
use fsdp_device::Buffer;

mod support;
use support::procs;

const WORLD: usize = 3;
/// Bound of every wait inside the children; the parent gives them this long in all.
const TIMEOUT: Duration = Duration::from_secs(60);

#[test]
fn a_process_that_dies_fails_the_others() {
    const TEST: &str = "a_process_that_dies_fails_the_others";
    if let Some(role) = procs::role() {
        if role != TEST {
            return;
        }
        let (r, store) = procs::child_store(WORLD, TIMEOUT);
        let opts = tcp::TcpOptions::default()
            .with_timeout(TIMEOUT)
            .with_segment_bytes(4096);
        let comm = tcp::TcpCommunicator::new(&store, opts).unwrap();
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
        // What a launcher reads to call this failure secondary.
        assert!(err.caused_by_peer(), "{err:?}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
        // The communicator is aborted for good.
        assert!(matches!(
            comm.barrier(),
            Err(CollectiveError::Aborted { .. })
        ));
        println!("rank {r}: failed as expected");
        return;
    }
    let results = procs::run_children(TEST, TEST, WORLD, &[], TIMEOUT);
    assert_eq!(results[2].0, Some(17), "rank 2:\n{}", results[2].1);
    procs::assert_all_said(TEST, &results[..2], "failed as expected");
    for (_, out) in &results[..2] {
        for line in out.lines().filter(|l| l.contains("failed after")) {
            println!("{line}");
        }
    }
}
