//! Collectives of the ring engine on stream-ordered buffers (`Buffer::stream_ordered`): the
//! collective runs after the work that wrote its input on another stream, and work issued after
//! it on any stream sees its output, with no host wait by the caller in between.

mod support;

use fsdp_collectives::{ring, Communicator, ReduceOp};
use fsdp_device::Stream;
use support::cases::{stream_ordered_case, WORLD};
use support::{ordered, read_on, write_late};

/// The conformance suite's stream-ordered case (an all-gather, a reduce-scatter and an
/// in-place all-reduce of inputs written late on another stream, read on a third) on the
/// thread ring, which must say it orders such buffers.
#[test]
fn all_gather_and_reduce_scatter_order_themselves_by_stream_events() {
    ring::run_ranks(WORLD, ring::RingOptions::default(), |comm| {
        assert!(comm.orders_stream_ordered_buffers());
        stream_ordered_case(&comm);
    })
    .unwrap();
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
