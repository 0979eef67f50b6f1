//! Collectives of the ring engine on stream-ordered buffers (`Buffer::stream_ordered`): the
//! collective runs after the work that wrote its input on another stream, and work issued after
//! it on any stream sees its output, with no host wait by the caller in between.

mod support;

use fsdp_collectives::{ring, Communicator, ReduceOp};
use fsdp_device::Stream;
use support::{ordered, read_on, write_late};

#[test]
fn all_gather_and_reduce_scatter_order_themselves_by_stream_events() {
    let world = 3;
    let out = ring::run_ranks(world, ring::RingOptions::default(), move |comm| {
        assert!(comm.orders_stream_ordered_buffers());
        let r = comm.rank();
        let (producer, consumer) = (Stream::cpu("producer"), Stream::cpu("consumer"));
        // All-gather: the input is written late on the producer stream.
        let input = ordered(4);
        write_late(
            &producer,
            &input,
            (0..4).map(|i| (10 * r + i) as f32).collect(),
        );
        let gathered = ordered(4 * world);
        let work = comm.all_gather_base(&input, &gathered).unwrap();
        let seen = read_on(&consumer, &gathered);
        work.wait().unwrap();
        // Reduce-scatter of a late input, then an in-place all-reduce of its output.
        let full = ordered(2 * world);
        write_late(
            &producer,
            &full,
            (0..2 * world).map(|i| (r * 100 + i) as f32).collect(),
        );
        let shard = ordered(2);
        comm.reduce_scatter_base(&full, &shard, ReduceOp::Sum)
            .unwrap();
        comm.all_reduce(&shard, ReduceOp::Max).unwrap();
        (seen, read_on(&consumer, &shard))
    })
    .unwrap();
    let gathered: Vec<f32> = (0..world)
        .flat_map(|r| (0..4).map(move |i| (10 * r + i) as f32))
        .collect();
    // Rank r's chunk of the sum: elements 2r and 2r+1 of Σ_q (100q + i).
    let sum = |i: usize| (0..world).map(|q| (q * 100 + i) as f32).sum::<f32>();
    let max_chunk: Vec<f32> = (0..2)
        .map(|j| (0..world).map(|r| sum(2 * r + j)).fold(f32::MIN, f32::max))
        .collect();
    for (r, (seen, shard)) in out.into_iter().enumerate() {
        assert_eq!(seen, gathered, "rank {r}'s gathered output");
        assert_eq!(shard, max_chunk, "rank {r}'s reduced shard");
    }
}

#[test]
fn a_freed_ordered_buffer_outlives_its_collective() {
    let out = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
        let producer = Stream::cpu("producer");
        let buf = ordered(3);
        write_late(&producer, &buf, vec![1.0 + comm.rank() as f32; 3]);
        let work = comm.all_reduce(&buf, ReduceOp::Sum).unwrap();
        let keep = buf.slice(0..3).unwrap();
        drop(buf);
        work.wait().unwrap();
        read_on(&Stream::cpu("consumer"), &keep)
    })
    .unwrap();
    assert_eq!(out, vec![vec![3.0; 3], vec![3.0; 3]]);
}
