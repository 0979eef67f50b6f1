//! Collectives of the ring engine on stream-ordered buffers (`Buffer::stream_ordered`): the
//! collective runs after the work that wrote its input on another stream, and work issued after
//! it on any stream sees its output, with no host wait by the caller in between.

mod support;

use fsdp_collectives::{ring, Communicator, ReduceOp};
use std::time::Duration;

use fsdp_device::{AccessMode, Stream};
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

/// A collective whose input's writer does not finish within the communicator's timeout does
/// not run and fails (the wait's error): before, the wait's timeout only marked the stream
/// and the collective ran anyway, under the writer, its work reporting success.
#[test]
fn a_collective_whose_writer_times_out_fails_and_does_not_run() {
    let opts = ring::RingOptions::default().with_timeout(Duration::from_millis(300));
    let out = ring::run_ranks(2, opts, |comm| {
        let writer = Stream::cpu("slow writer");
        let buf = ordered(2);
        let u = buf.use_on(&writer, AccessMode::Exclusive).unwrap();
        let p = u.device_ptr() as usize;
        writer
            .enqueue(move || {
                std::thread::sleep(Duration::from_millis(1500));
                // SAFETY: 2 f32 of the buffer, used by this stream's work only, alive until it
                // completed (held references).
                let dst = unsafe { std::slice::from_raw_parts_mut(p as *mut f32, 2) };
                dst.copy_from_slice(&[5.0, 5.0]);
            })
            .unwrap();
        u.finish();
        let r = comm.all_reduce(&buf, ReduceOp::Sum).and_then(|w| w.wait());
        writer.synchronize().unwrap();
        (r.map_err(|e| e.to_string()), read_on(&writer, &buf))
    })
    .unwrap();
    for (r, values) in out {
        let e = r.unwrap_err();
        assert!(e.contains("wait"), "{e}");
        assert_eq!(values, vec![5.0, 5.0]);
    }
}
