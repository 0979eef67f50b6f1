//! Every collective of the ring backend against a naive reference, for world sizes 1..=8, all
//! element types, lengths from 0 to a few MiB, several segment sizes; sub-groups and a 2x3 mesh.
//!
//! Inputs are chosen so that every reduction is exact in every element type (small integers for
//! sums, powers of two for products), so the reference may reduce in any order.

use fsdp_collectives::{mesh_2d, ring, Communicator, ReduceOp};
use fsdp_device::{Buffer, DType};
use proptest::prelude::*;

mod support;

/// Run every collective once on a group of `world` ranks and check each rank's results.
fn check_all(
    world: usize,
    dtype: DType,
    len: usize,
    op: ReduceOp,
    root: usize,
    opts: ring::RingOptions,
) {
    ring::run_ranks(world, opts, |comm| {
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
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Small and odd lengths with tiny segments, so that every path is pipelined over many
    /// segments and slots are reused.
    #[test]
    fn small_lengths_many_segments(
        world in 1usize..=8,
        dtype in dtype_strategy(),
        op in op_strategy(),
        len in prop_oneof![0usize..=3, 4usize..=300],
        root_seed in 0usize..8,
        seg_bytes in prop::sample::select(vec![2usize, 8, 24, 64, 1000]),
        slots in 2usize..=4,
    ) {
        let mut opts = ring::RingOptions::default().with_segment_bytes(seg_bytes);
        opts.slots = slots;
        check_all(world, dtype, len, op, root_seed % world, opts);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// Lengths up to a few MiB with the default segment size.
    #[test]
    fn large_lengths(
        world in prop::sample::select(vec![2usize, 3, 5, 8]),
        dtype in dtype_strategy(),
        len in 100_000usize..=600_000,
    ) {
        check_all(world, dtype, len, ReduceOp::Sum, world - 1, ring::RingOptions::default());
    }
}

#[test]
fn split_groups_reduce_among_their_members() {
    // Colors by parity, keys reversed: the odd group orders its members from the highest rank.
    let world = 7;
    let results = ring::run_ranks(world, ring::RingOptions::default(), |comm| {
        let r = comm.rank();
        let sub = comm
            .split(Some((r % 2) as u32), world - r)
            .unwrap()
            .expect("every rank has a color");
        let buf = Buffer::from_slice(&[r as f64, 1.0]).unwrap();
        sub.all_reduce(&buf, ReduceOp::Sum).unwrap().wait().unwrap();
        (sub.rank(), sub.world_size(), buf.to_vec::<f64>().unwrap())
    })
    .unwrap();
    for (r, (sub_rank, sub_world, v)) in results.into_iter().enumerate() {
        let members: Vec<usize> = (0..world).filter(|q| q % 2 == r % 2).collect();
        assert_eq!(sub_world, members.len());
        // ordered by key = world - rank: descending global rank
        let pos_desc = members.iter().rev().position(|&q| q == r).unwrap();
        assert_eq!(sub_rank, pos_desc);
        assert_eq!(
            v,
            vec![members.iter().sum::<usize>() as f64, members.len() as f64]
        );
    }
}

#[test]
fn split_with_no_color_joins_nothing() {
    let out = ring::run_ranks(3, ring::RingOptions::default(), |comm| {
        let color = if comm.rank() == 1 { None } else { Some(0) };
        let sub = comm.split(color, 0).unwrap();
        // The parent group stays usable after a split.
        let b = Buffer::from_slice(&[1.0f32]).unwrap();
        comm.all_reduce(&b, ReduceOp::Sum).unwrap().wait().unwrap();
        (sub.map(|s| s.world_size()), b.to_vec::<f32>().unwrap()[0])
    })
    .unwrap();
    assert_eq!(out, vec![(Some(2), 3.0), (None, 3.0), (Some(2), 3.0)]);
}

#[test]
fn mesh_2x3_collectives_match_reference() {
    // 2 "nodes" x 3 ranks: shard groups are rows {0,1,2},{3,4,5}; replicate groups columns.
    let out = ring::run_ranks(6, ring::RingOptions::default(), |comm| {
        let r = comm.rank();
        let mesh = mesh_2d(&comm, 2, 3).unwrap();
        // reduce-scatter in the shard group, then all-reduce of the shard across replicas: the
        // gradient path of HYBRID_SHARD.
        let grads: Vec<f32> = (0..6).map(|i| (r * 10 + i) as f32).collect();
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
        // all-gather the shard back inside the node
        let full = Buffer::zeros(DType::F32, 6).unwrap();
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
    let total: Vec<f32> = (0..6)
        .map(|i| (0..6).map(|r| (r * 10 + i) as f32).sum())
        .collect();
    for (r, (srank, rrank, full)) in out.into_iter().enumerate() {
        assert_eq!((srank, rrank), (r % 3, r / 3));
        assert_eq!(full, total, "rank {r}");
    }
}

#[test]
fn in_place_all_gather_and_reduce_scatter() {
    ring::run_ranks(
        4,
        ring::RingOptions::default().with_segment_bytes(16),
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
