//! Every collective of the tcp backend (ranks as threads over loopback sockets) against a naive
//! reference, for world sizes 1..=4, all element types and reduce ops, small lengths and tiny
//! segments; results bitwise identical to the ring backend on order-sensitive random data;
//! sub-groups and a 2x2 mesh.
//!
//! Reference inputs are chosen so that every reduction is exact in every element type (small
//! integers for sums, powers of two for products), so the reference may reduce in any order.

use fsdp_collectives::{mesh_2d, ring, tcp, Communicator, ReduceOp};
use fsdp_device::{Buffer, DType};
use proptest::prelude::*;

mod support;
use support::*;

/// Run every collective once on a tcp group of `world` ranks and check each rank's results.
fn check_all(
    world: usize,
    dtype: DType,
    len: usize,
    op: ReduceOp,
    root: usize,
    opts: tcp::TcpOptions,
) {
    tcp::run_local_ranks(world, opts, |comm| {
        support::check_every_collective(&comm, dtype, len, op, root)
    })
    .unwrap();
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

fn op_strategy() -> impl Strategy<Value = ReduceOp> {
    prop::sample::select(ReduceOp::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Small and odd lengths with tiny segments, so that every path is pipelined over many
    /// segments.
    #[test]
    fn small_lengths_many_segments(
        world in 1usize..=4,
        dtype in dtype_strategy(),
        op in op_strategy(),
        len in prop_oneof![0usize..=3, 4usize..=200],
        root_seed in 0usize..4,
        seg_bytes in prop::sample::select(vec![2usize, 8, 24, 64, 1000]),
    ) {
        check_all(world, dtype, len, op, root_seed % world,
                  tcp::TcpOptions::default().with_segment_bytes(seg_bytes));
    }
}

#[test]
fn a_large_message_with_default_segments() {
    // Several 512 KiB segments in flight on every link at once.
    check_all(
        3,
        DType::F32,
        400_000,
        ReduceOp::Sum,
        1,
        tcp::TcpOptions::default(),
    );
}

#[test]
fn results_are_bitwise_identical_to_the_ring_backend() {
    let len = 301;
    for world in 2..=4 {
        let seg = 96;
        let ring_out = ring::run_ranks(
            world,
            ring::RingOptions::default().with_segment_bytes(seg),
            |c| reductions(&c, len),
        )
        .unwrap();
        let tcp_out = tcp::run_local_ranks(
            world,
            tcp::TcpOptions::default().with_segment_bytes(seg),
            |c| reductions(&c, len),
        )
        .unwrap();
        for r in 0..world {
            for (k, (a, b)) in ring_out[r].iter().zip(&tcp_out[r]).enumerate() {
                let (dt, op, coll) = (
                    k / 15,
                    (k / 3) % 5,
                    ["all_reduce", "reduce_scatter", "reduce"][k % 3],
                );
                assert_eq!(
                    a,
                    b,
                    "world {world} rank {r}: {coll} of {} with {} differs from the ring backend",
                    DType::ALL[dt],
                    ReduceOp::ALL[op]
                );
            }
            assert_eq!(ring_out[r].len(), tcp_out[r].len());
        }
        // The data is order-sensitive: from three ranks on, a plain rank-order f32 sum differs
        // from the ring's all-reduce somewhere (so the equality above is not trivially true).
        if world < 3 {
            continue;
        }
        let ring_f32_sum = &ring_out[0][0];
        let naive: Vec<u64> = (0..len)
            .map(|i| {
                let mut acc = 0f32;
                for q in 0..world {
                    let seed = (q as u64 + 1) * 1000;
                    acc += noisy(seed ^ (1 << 32), i) as f32;
                }
                acc.to_bits() as u64
            })
            .collect();
        assert_ne!(
            &naive, ring_f32_sum,
            "world {world}: data not order-sensitive"
        );
    }
}

#[test]
fn split_groups_reduce_among_their_members() {
    let world = 4;
    let results = tcp::run_local_ranks(world, tcp::TcpOptions::default(), |comm| {
        let r = comm.rank();
        // Colors by parity, keys reversed: each group orders its members from the highest rank.
        let sub = comm
            .split(Some((r % 2) as u32), world - r)
            .unwrap()
            .expect("every rank has a color");
        let buf = Buffer::from_slice(&[r as f64, 1.0]).unwrap();
        sub.all_reduce(&buf, ReduceOp::Sum).unwrap().wait().unwrap();
        // A second split of the same parent, and one of the sub-group: names stay unique.
        let again = comm.split(Some(0), r).unwrap().unwrap();
        let b2 = Buffer::from_slice(&[1.0f32]).unwrap();
        again
            .all_reduce(&b2, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        let solo = sub.split(Some(sub.rank() as u32), 0).unwrap().unwrap();
        let b3 = Buffer::from_slice(&[r as f32]).unwrap();
        solo.all_reduce(&b3, ReduceOp::Sum).unwrap().wait().unwrap();
        (
            sub.rank(),
            sub.world_size(),
            buf.to_vec::<f64>().unwrap(),
            b2.to_vec::<f32>().unwrap()[0],
            (solo.world_size(), b3.to_vec::<f32>().unwrap()[0]),
        )
    })
    .unwrap();
    for (r, (sub_rank, sub_world, v, all, solo)) in results.into_iter().enumerate() {
        let members: Vec<usize> = (0..world).filter(|q| q % 2 == r % 2).collect();
        assert_eq!(sub_world, members.len());
        let pos_desc = members.iter().rev().position(|&q| q == r).unwrap();
        assert_eq!(sub_rank, pos_desc);
        assert_eq!(
            v,
            vec![members.iter().sum::<usize>() as f64, members.len() as f64]
        );
        assert_eq!(all, world as f32);
        assert_eq!(solo, (1, r as f32));
    }
}

#[test]
fn split_with_no_color_joins_nothing() {
    let out = tcp::run_local_ranks(3, tcp::TcpOptions::default(), |comm| {
        let color = if comm.rank() == 1 { None } else { Some(0) };
        let sub = comm.split(color, 0).unwrap();
        let b = Buffer::from_slice(&[1.0f32]).unwrap();
        comm.all_reduce(&b, ReduceOp::Sum).unwrap().wait().unwrap();
        let sub_sum = sub.map(|s| {
            let c = Buffer::from_slice(&[2.0f32]).unwrap();
            s.all_reduce(&c, ReduceOp::Sum).unwrap().wait().unwrap();
            (s.world_size(), c.to_vec::<f32>().unwrap()[0])
        });
        (sub_sum, b.to_vec::<f32>().unwrap()[0])
    })
    .unwrap();
    assert_eq!(
        out,
        vec![(Some((2, 4.0)), 3.0), (None, 3.0), (Some((2, 4.0)), 3.0)]
    );
}

#[test]
fn mesh_2x2_collectives_match_reference() {
    let out = tcp::run_local_ranks(4, tcp::TcpOptions::default(), |comm| {
        let r = comm.rank();
        let mesh = mesh_2d(&comm, 2, 2).unwrap();
        // The gradient path of HYBRID_SHARD: reduce-scatter in the shard group, all-reduce of
        // the shard across replicas, all-gather back inside the node.
        let grads: Vec<f32> = (0..4).map(|i| (r * 10 + i) as f32).collect();
        let input = Buffer::from_slice(&grads).unwrap();
        let shard = Buffer::zeros(DType::F32, 2).unwrap();
        mesh.shard
            .reduce_scatter_base(&input, &shard, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        mesh.replicate
            .all_reduce(&shard, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        let full = Buffer::zeros(DType::F32, 4).unwrap();
        mesh.shard
            .all_gather_base(&shard, &full)
            .unwrap()
            .wait()
            .unwrap();
        (
            mesh.shard.rank(),
            mesh.replicate.rank(),
            full.to_vec::<f32>().unwrap(),
        )
    })
    .unwrap();
    let total: Vec<f32> = (0..4)
        .map(|i| (0..4).map(|r| (r * 10 + i) as f32).sum())
        .collect();
    for (r, (srank, rrank, full)) in out.into_iter().enumerate() {
        assert_eq!((srank, rrank), (r % 2, r / 2));
        assert_eq!(full, total, "rank {r}");
    }
}

#[test]
fn in_place_all_gather_and_reduce_scatter() {
    tcp::run_local_ranks(
        4,
        tcp::TcpOptions::default().with_segment_bytes(16),
        |comm| {
            let (r, n, len) = (comm.rank(), comm.world_size(), 37);
            let out = Buffer::zeros(DType::F32, n * len).unwrap();
            let own = out.slice(r * len..(r + 1) * len).unwrap();
            own.copy_from_slice(&vec![r as f32; len]).unwrap();
            comm.all_gather_base(&own, &out).unwrap().wait().unwrap();
            let got = out.to_vec::<f32>().unwrap();
            for q in 0..n {
                assert!(got[q * len..(q + 1) * len].iter().all(|&x| x == q as f32));
            }
            let rs_in = Buffer::from_slice(&vec![1.0f32; n * len]).unwrap();
            let rs_out = rs_in.slice(r * len..(r + 1) * len).unwrap();
            comm.reduce_scatter_base(&rs_in, &rs_out, ReduceOp::Avg)
                .unwrap()
                .wait()
                .unwrap();
            assert!(rs_out.to_vec::<f32>().unwrap().iter().all(|&x| x == 1.0));
        },
    )
    .unwrap();
}

#[test]
fn every_rank_sending_a_huge_segment_at_once_does_not_deadlock() {
    // One 16 MiB segment per message: far more than a socket buffer holds, sent by every rank at
    // the same moment. Blocking writes alone would deadlock here; the reader threads drain.
    let elems = 4 << 20;
    let opts = tcp::TcpOptions::default()
        .with_segment_bytes(elems * 4)
        .with_timeout(std::time::Duration::from_secs(60));
    let out = tcp::run_local_ranks(3, opts, |comm| {
        let r = comm.rank();
        let input = Buffer::from_slice(&vec![r as f32; elems]).unwrap();
        let output = Buffer::zeros(DType::F32, 3 * elems).unwrap();
        comm.all_gather_base(&input, &output)
            .unwrap()
            .wait()
            .unwrap();
        comm.all_reduce(&input, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        let got = output.to_vec::<f32>().unwrap();
        let gathered_ok = (0..3).all(|q| {
            got[q * elems..(q + 1) * elems]
                .iter()
                .all(|&x| x == q as f32)
        });
        let summed_ok = input.to_vec::<f32>().unwrap().iter().all(|&x| x == 3.0);
        (gathered_ok, summed_ok)
    })
    .unwrap();
    assert_eq!(out, vec![(true, true); 3]);
}
