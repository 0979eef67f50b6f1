//! The conformance cases every backend runs (one list, several instantiations: ring-threads,
//! ring-shm and ring-tcp in `tests/conformance.rs`, MPI under `mpirun -np 3` through the
//! `mpi_reference` example's `--conformance` mode): every collective, reduce op and element type
//! (in place and not), sub-groups, stream-ordered buffers (on the backends that order them), a
//! mismatched call, and a rank that never arrives.

use std::time::Duration;

use fsdp_collectives::{ring, CollectiveError, Communicator, ReduceOp};
use fsdp_device::{Buffer, DType, Device, Stream};

use super::{check_every_collective, ordered, read_on, reductions, write_late, zeros};

/// Ranks of every instantiation.
pub const WORLD: usize = 3;

/// What differs between backends.
pub struct Expect {
    /// Reductions are bitwise those of the thread ring (true for every ring transport; MPI
    /// chooses its own reduction order and reduces 16-bit types in f32).
    pub bitwise_ring: bool,
}

/// The data cases, on a communicator of [`WORLD`] ranks; the group is usable afterwards.
pub fn suite(comm: &dyn Communicator, expect: &Expect) {
    assert_eq!(comm.world_size(), WORLD);
    let r = comm.rank();
    for (di, dtype) in DType::ALL.into_iter().enumerate() {
        for (oi, op) in ReduceOp::ALL.into_iter().enumerate() {
            check_every_collective(comm, dtype, 37, op, (di + oi) % WORLD);
            check_every_collective(comm, dtype, 0, op, 0);
        }
    }
    // In place: the input is this rank's block of the output.
    let n = 5;
    let out = zeros(DType::F32, n * WORLD);
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
    if expect.bitwise_ring {
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
    }
    // Sub-groups: {0, 2} and {1}.
    let sub = comm.split(Some((r % 2) as u32), r).unwrap().unwrap();
    let b = Buffer::from_slice(&[r as f32 + 1.0]).unwrap();
    sub.all_reduce(&b, ReduceOp::Sum).unwrap().wait().unwrap();
    let want = if r % 2 == 0 { 4.0 } else { 2.0 };
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![want]);
    if comm.orders_stream_ordered_buffers() && comm.device() == Device::Cpu {
        stream_ordered_case(comm);
    }
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

/// On a fresh communicator whose timeout is `short`: rank 2 never arrives; the others time out
/// naming it, and the group is aborted.
pub fn timeout_case(comm: &dyn Communicator, short: Duration) {
    if comm.rank() == 2 {
        std::thread::sleep(short * 4);
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

/// On a backend that orders stream-ordered host buffers (an engine on a device's host twin
/// gives it such buffers): an all-gather, a reduce-scatter and an all-reduce of inputs written
/// late on another stream, issued without a host wait, read on a third stream after them —
/// each result the exact one.
pub fn stream_ordered_case(comm: &dyn Communicator) {
    let r = comm.rank();
    let (producer, consumer) = (Stream::cpu("producer"), Stream::cpu("consumer"));
    let input = ordered(4);
    write_late(
        &producer,
        &input,
        (0..4).map(|i| (10 * r + i) as f32).collect(),
    );
    let gathered = ordered(4 * WORLD);
    comm.all_gather_base(&input, &gathered).unwrap();
    let full = ordered(2 * WORLD);
    write_late(
        &producer,
        &full,
        (0..2 * WORLD).map(|i| (r * 100 + i) as f32).collect(),
    );
    let shard = ordered(2);
    comm.reduce_scatter_base(&full, &shard, ReduceOp::Sum)
        .unwrap();
    comm.all_reduce(&shard, ReduceOp::Max).unwrap();
    let want: Vec<f32> = (0..WORLD)
        .flat_map(|q| (0..4).map(move |i| (10 * q + i) as f32))
        .collect();
    assert_eq!(read_on(&consumer, &gathered), want, "rank {r}: gathered");
    // Every rank's chunk of the sum, then the maximum over the ranks of theirs.
    let sum = |i: usize| (0..WORLD).map(|q| (q * 100 + i) as f32).sum::<f32>();
    let max: Vec<f32> = (0..2)
        .map(|j| (0..WORLD).map(|q| sum(2 * q + j)).fold(f32::MIN, f32::max))
        .collect();
    assert_eq!(read_on(&consumer, &shard), max, "rank {r}: reduced shard");
}
