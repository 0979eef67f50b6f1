//! Tests of [`PeerOps`](super::PeerOps) for the host twins (run under Miri too).
use super::*;
use crate::gpt::{GptOps, HostOps};

/// The host twins read their peers' buffers by address across threads: a copy and the
/// reductions (in rank order; an average divided at the last step) give the values of the
/// slices, and ranges outside a buffer are refused before anything is read. (Under Miri:
/// the raw reads stay within the live buffers.)
#[test]
fn host_peers_copy_and_reduce_by_address() {
    let ops = HostOps::new();
    let peers: Vec<_> = (0..3)
        .map(|r| ops.upload(&[r as f32, 10.0 + r as f32, 0.5]).unwrap())
        .collect();
    let scalars: Vec<_> = (0..3)
        .map(|r| ops.scalars(&[r as f64, 2.0 * r as f64]).unwrap())
        .collect();
    let ptrs: Vec<PeerPtr> = peers.iter().map(|b| ops.peer_ptr(b)).collect();
    let sptrs: Vec<PeerPtr> = scalars.iter().map(|s| ops.scalars_ptr(s)).collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            let ops = HostOps::new();
            let mut dst = ops.zeros(4).unwrap();
            // SAFETY: the peers' buffers live and are unwritten until the scope ends.
            unsafe { ops.copy_from_peer(ptrs[2], 1, &mut dst, 2, 2).unwrap() };
            assert_eq!(ops.download(&dst).unwrap(), [0.0, 0.0, 12.0, 0.5]);
            let srcs: Vec<_> = ptrs.iter().map(|&p| (p, 0)).collect();
            // SAFETY: as above; `dst` is this thread's.
            unsafe {
                ops.reduce_from_peers(ReduceKind::Avg, &srcs, &mut dst, 1, 3)
                    .unwrap()
            };
            assert_eq!(ops.download(&dst).unwrap(), [0.0, 1.0, 11.0, 0.5]);
            let mut sd = ops.scalars(&[0.0; 3]).unwrap();
            let srcs: Vec<_> = sptrs.iter().map(|&p| (p, 1)).collect();
            // SAFETY: as above.
            unsafe {
                ops.reduce_scalars_from_peers(ReduceKind::Sum, &srcs, &mut sd, 2, 1)
                    .unwrap()
            };
            assert_eq!(sd.to_vec(), [0.0, 0.0, 6.0]);
            // SAFETY: refused before any read.
            let e = unsafe { ops.copy_from_peer(ptrs[0], 2, &mut dst, 0, 2) };
            assert!(e.unwrap_err().to_string().contains("outside"));
            // SAFETY: refused before any read.
            let e = unsafe { ops.reduce_from_peers(ReduceKind::Sum, &[], &mut dst, 0, 1) };
            assert!(e.unwrap_err().to_string().contains("no source"));
        });
    });
}
