//! Throughput of the tcp backend over loopback next to the in-process ring backend (ignored by
//! default; a measurement, not a check): `cargo test --release -p fsdp-collectives --test
//! tcp_throughput -- --ignored --nocapture`.

use std::time::{Duration, Instant};

use fsdp_collectives::{ring, tcp, Communicator, ReduceOp};
use fsdp_device::{Buffer, DType};

/// Median time of `reps` all-reduces and all-gathers of `elems` f32 per rank.
fn time_ops(comm: &dyn Communicator, elems: usize, reps: usize) -> (Duration, Duration) {
    let world = comm.world_size();
    let buf = Buffer::from_slice(&vec![1.0f32; elems]).unwrap();
    let shard = Buffer::from_slice(&vec![1.0f32; elems / world]).unwrap();
    let full = Buffer::zeros(DType::F32, elems / world * world).unwrap();
    let mut ar = Vec::new();
    let mut ag = Vec::new();
    for _ in 0..reps {
        comm.barrier().unwrap().wait().unwrap();
        let t = Instant::now();
        comm.all_reduce(&buf, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        ar.push(t.elapsed());
        comm.barrier().unwrap().wait().unwrap();
        let t = Instant::now();
        comm.all_gather_base(&shard, &full).unwrap().wait().unwrap();
        ag.push(t.elapsed());
    }
    ar.sort();
    ag.sort();
    (ar[reps / 2], ag[reps / 2])
}

#[test]
#[ignore = "a measurement; run with --ignored --nocapture"]
fn loopback_throughput() {
    let elems = 4 << 20; // 16 MiB of f32
    let bytes = (elems * 4) as f64;
    for world in [2, 4] {
        let r = ring::run_ranks(world, ring::RingOptions::default(), |c| {
            time_ops(&c, elems, 5)
        })
        .unwrap();
        let t = tcp::run_local_ranks(world, tcp::TcpOptions::default(), |c| {
            time_ops(&c, elems, 5)
        })
        .unwrap();
        let bus =
            |d: Duration| bytes * 2.0 * (world - 1) as f64 / world as f64 / d.as_secs_f64() / 1e9;
        let agbus = |d: Duration| bytes * (world - 1) as f64 / world as f64 / d.as_secs_f64() / 1e9;
        println!(
            "world {world}, 16 MiB f32: all_reduce ring {:?} ({:.2} GB/s busbw), tcp {:?} ({:.2} GB/s); \
             all_gather_base ring {:?} ({:.2} GB/s), tcp {:?} ({:.2} GB/s)",
            r[0].0, bus(r[0].0), t[0].0, bus(t[0].0), r[0].1, agbus(r[0].1), t[0].1, agbus(t[0].1)
        );
    }
}
