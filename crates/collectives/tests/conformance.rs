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
/// `shared`); in the parent: spawn the children (with `envs`) and check them.
///
/// [`SharedHostStorage`]: fsdp_device::shared::SharedHostStorage
fn processes(test: &str, transport: tcp::ProcessTransport, shared: bool) {
    processes_with(test, transport, shared, &[]);
}

fn processes_with(
    test: &str,
    transport: tcp::ProcessTransport,
    shared: bool,
    envs: &[(&str, &std::ffi::OsStr)],
) {
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
    let results = procs::run_children(test, test, WORLD, envs, TIMEOUT * 2);
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

/// Cross-memory attach refused between the rank processes while it works on each one's own
/// memory (Yama's `ptrace_scope` 1, simulated by `FSDP_SHM_CMA=deny-peers`, under which a pull
/// from a peer fails): the ranks find out at set-up and send through the slots.
#[test]
fn ring_shm_processes_when_peers_refuse_cross_memory_attach() {
    processes_with(
        "ring_shm_processes_when_peers_refuse_cross_memory_attach",
        tcp::ProcessTransport::Shm,
        false,
        &[("FSDP_SHM_CMA", std::ffi::OsStr::new("deny-peers"))],
    );
}

#[test]
fn ring_tcp_processes() {
    processes("ring_tcp_processes", tcp::ProcessTransport::Tcp, false);
}
