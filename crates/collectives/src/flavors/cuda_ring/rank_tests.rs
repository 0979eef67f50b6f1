//! Tests of a rank's failure handshake. At two ranks a rank has no scratch and the handshake
//! makes no CUDA call (its events and stream waits are the streams'), so CPU streams stand in
//! for the CUDA ones and these tests run without a GPU.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fsdp_device::{DType, Stream};

use super::Rank;
use crate::flavors::cuda_ring::links::make_links;
use crate::flavors::engine::DataError;
use crate::flavors::ring::board::Board;

/// Ranks 0 and 1 of a group of two on CPU streams, both in collective #0 with `timeout` left.
fn pair(timeout: Duration) -> (Arc<Board>, Rank, Rank) {
    let board = Arc::new(Board::new(2));
    let mut links = make_links(2).into_iter();
    let mut ranks = (0..2).map(|r| {
        let links = links.next().expect("two ranks' links");
        let mut rank = Rank::new(
            (r, 2),
            Stream::cpu(format!("cuda-ring-test:{r}")),
            board.clone(),
            links,
            (2, 64),
        )
        .unwrap();
        rank.begin(0, Instant::now() + timeout);
        rank
    });
    let (r0, r1) = (ranks.next().unwrap(), ranks.next().unwrap());
    (board, r0, r1)
}

/// The successor's release arrives while this rank waits for its answer (in `drain`, before
/// the 20 ms abort check saw the abort): the wait fails as an abort naming the successor, and
/// `release` does not wait out its grace period for a second release message, which never
/// comes (the successor's links stay open all along).
#[test]
fn a_release_received_while_waiting_for_an_answer_is_not_awaited_again() {
    let grace = Duration::from_secs(5);
    let (_board, mut r0, mut r1) = pair(grace);
    let ready = r0.stream.record_event();
    r0.publish(0x1000, 4, DType::F32, ready, None).unwrap();
    // Rank 1 gives up without reading anything.
    assert!(r1.release(grace));
    let t0 = Instant::now();
    match r0.drain() {
        Err(DataError::Aborted { reason }) => {
            assert!(
                reason.contains("rank 1 gave up on collective #0"),
                "{reason}"
            )
        }
        Err(other) => panic!("expected an abort, got {other:?}"),
        Ok(()) => panic!("expected an abort, got an answer"),
    }
    assert!(r0.release(grace), "rank 0 would leak its buffers");
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(2), "rank 0 took {took:?}");
}

/// The same when the release is only read by `release` (the abort check fired first): it ends
/// the wait there.
#[test]
fn a_release_waiting_in_the_channel_ends_the_release() {
    let grace = Duration::from_secs(5);
    let (board, mut r0, mut r1) = pair(grace);
    let ready = r0.stream.record_event();
    r0.publish(0x1000, 4, DType::F32, ready, None).unwrap();
    board.abort("rank 1: injected failure".into());
    assert!(r1.release(grace));
    let t0 = Instant::now();
    assert!(matches!(r0.drain(), Err(DataError::Aborted { .. })));
    assert!(r0.release(grace), "rank 0 would leak its buffers");
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(2), "rank 0 took {took:?}");
}
