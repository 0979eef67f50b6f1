//! A small run of every ring collective, sized for Miri: it checks the unsafe pointer protocol of
//! the ring (published segments, scratch slots, in-place paths) for undefined behaviour and data
//! races. Also an ordinary test. Run with `cargo +nightly miri test -p fsdp-collectives --test
//! miri_smoke`.

use fsdp_collectives::{ring, Communicator, ReduceOp};
use fsdp_device::{Buffer, DType};

#[test]
fn every_collective_on_three_ranks() {
    // 8-byte segments and 2 slots: many segments, slot reuse, every code path.
    let mut opts = ring::RingOptions::default().with_segment_bytes(8);
    opts.slots = 2;
    ring::run_ranks(3, opts, |comm| {
        let r = comm.rank() as f32;
        let input = Buffer::from_slice(&[r, r + 1.0, r + 2.0]).unwrap();
        let output = Buffer::zeros(DType::F32, 9).unwrap();
        comm.all_gather_base(&input, &output)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(
            output.to_vec::<f32>().unwrap(),
            vec![0.0, 1.0, 2.0, 1.0, 2.0, 3.0, 2.0, 3.0, 4.0]
        );

        let rs_in = Buffer::from_slice(&[1.0f32; 9]).unwrap();
        let rs_out = Buffer::zeros(DType::F32, 3).unwrap();
        comm.reduce_scatter_base(&rs_in, &rs_out, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(rs_out.to_vec::<f32>().unwrap(), vec![3.0; 3]);

        let ar = Buffer::from_slice(&[r; 7]).unwrap();
        comm.all_reduce(&ar, ReduceOp::Max).unwrap().wait().unwrap();
        assert_eq!(ar.to_vec::<f32>().unwrap(), vec![2.0; 7]);

        let bc = Buffer::from_slice(&[r; 5]).unwrap();
        comm.broadcast(&bc, 1).unwrap().wait().unwrap();
        assert_eq!(bc.to_vec::<f32>().unwrap(), vec![1.0; 5]);

        let red = Buffer::from_slice(&[r + 1.0; 5]).unwrap();
        comm.reduce(&red, ReduceOp::Product, 2)
            .unwrap()
            .wait()
            .unwrap();
        let want = if comm.rank() == 2 { 6.0 } else { r + 1.0 };
        assert_eq!(red.to_vec::<f32>().unwrap(), vec![want; 5]);

        let outs: Vec<Buffer> = (0..3)
            .map(|q| Buffer::zeros(DType::F32, q + 1).unwrap())
            .collect();
        let mine = Buffer::from_slice(&vec![r; comm.rank() + 1]).unwrap();
        comm.all_gather(&mine, &outs).unwrap().wait().unwrap();
        for (q, o) in outs.iter().enumerate() {
            assert_eq!(o.to_vec::<f32>().unwrap(), vec![q as f32; q + 1]);
        }
    })
    .unwrap();
}
