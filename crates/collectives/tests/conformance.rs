//! One conformance suite for every backend ([`support::cases`]): the same cases — every
//! collective, reduce op and element type (in place and not), sub-groups, a mismatched call and
//! a timeout — run here on ring-threads (ranks as threads), ring-shm and ring-tcp (ranks as
//! processes: the test binary re-executes itself as three rank processes meeting through a
//! store hosted by the parent), with reductions checked bitwise against the thread ring. MPI runs
//! the same cases under `mpirun -np 3` (`tests/mpi.rs`, `conformance_np3`).

use std::time::Duration;

use fsdp_collectives::{ring, tcp};

mod support;
use support::cases::{suite, timeout_case, Expect, WORLD};
use support::procs;

const TIMEOUT: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(500);
const RING: Expect = Expect { bitwise_ring: true };

#[test]
fn ring_threads() {
    if procs::role().is_some() {
        return;
    }
    ring::run_ranks(
        WORLD,
        ring::RingOptions::default().with_segment_bytes(24),
        |c| suite(&c, &RING),
    )
    .unwrap();
    ring::run_ranks(
        WORLD,
        ring::RingOptions::default().with_timeout(SHORT),
        |c| timeout_case(&c, SHORT),
    )
    .unwrap();
}

/// In a child: run the suite over `transport` (its data buffers in [`SharedHostStorage`] if
/// `shared`); in the parent: spawn the children and check them.
///
/// [`SharedHostStorage`]: fsdp_device::shared::SharedHostStorage
fn processes(test: &str, transport: tcp::ProcessTransport, shared: bool) {
    if let Some(role) = procs::role() {
        if role != test {
            return;
        }
        if shared {
            support::use_shared_buffers();
        }
        let (rank, store) = procs::child_store(WORLD, TIMEOUT);
        let opts = tcp::TcpOptions::default()
            .with_transport(transport)
            .with_segment_bytes(24);
        let comm = tcp::TcpCommunicator::new(&store, opts.clone().with_timeout(TIMEOUT)).unwrap();
        assert_eq!(comm.transport(), transport);
        suite(&comm, &RING);
        let short = tcp::TcpCommunicator::new(&store, opts.with_timeout(SHORT)).unwrap();
        timeout_case(&short, SHORT);
        // Segments of shared buffers crossed in place (and only those).
        assert_eq!(
            tcp::shared_bytes_received() > 0,
            shared,
            "rank {rank}: {} bytes received in place",
            tcp::shared_bytes_received()
        );
        println!("rank {rank}: conformant");
        return;
    }
    let results = procs::run_children(test, test, WORLD, &[], TIMEOUT * 2);
    procs::assert_all_said(test, &results, "conformant");
}

#[test]
fn ring_shm_processes() {
    processes("ring_shm_processes", tcp::ProcessTransport::Shm, false);
}

/// The same over buffers the peers read in place (`SharedHostStorage`).
#[test]
fn ring_shm_processes_shared_buffers() {
    processes(
        "ring_shm_processes_shared_buffers",
        tcp::ProcessTransport::Shm,
        true,
    );
}

#[test]
fn ring_tcp_processes() {
    processes("ring_tcp_processes", tcp::ProcessTransport::Tcp, false);
}
