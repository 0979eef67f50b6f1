//! Parameters all-gathered in bf16 (FSDP's `param_dtype` on the wire) by every `DeviceComm`:
//! `PeerComm` (ranks as threads reading each other's bf16 roundings), `StagedComm` (NCCL's
//! path, bf16 staging, prefetched or not) and `HostComm` over the ring. Each shard is rounded
//! to bf16 (ties to even) and widened into the f32 full tensors: the reference is the `half`
//! crate's rounding of the values. The sharded trainer gathers in bf16 where every
//! parameter's value is a bf16 (pure-bf16 `AnyPrecisionAdamW`): there the bf16 gathers give
//! bitwise the training of f32 gathers, over the three, with prefetch and under CPU offload,
//! and move half the bytes.

use std::ops::Range;

use fsdp::optim::LrSchedule;
use fsdp_collectives::{ring, ReduceOp};
use fsdp_device::half::bf16;
use fsdp_device::DType;
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::device_comm::{DeviceComm, HostComm};

use fsdp_gpt::device_sharded::{Prefetch, ShardedDeviceTrainer};
use fsdp_gpt::device_train::{seeded_params, DeviceTrainConfig, DeviceTrainError};
use fsdp_gpt::runtime::ShardingStrategy;
use fsdp_kernels::gpt::{GptOps, HostOps};
use fsdp_kernels::host::AnyPrecision;

mod common;
use common::device::{
    device_config, grad_value, over_peers, over_ring, over_staged, param_bits, peer_comms,
    rank0_shards, staged_trainer, UNIT_LENS,
};

fn round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Each rank's shards of the test unit (the full tensor's values `grad_value(0, t, i)`,
/// mostly not bf16) gathered in bf16; then prefetched in bf16 and completed; then prefetched
/// in f32 and gathered in bf16 (the prefetch is of another dtype: completed unused).
fn gather_bf16(comm: &dyn DeviceComm<HostOps>, ops: &HostOps) -> Vec<Vec<Vec<f32>>> {
    let (r, world) = (comm.rank(), comm.world_size());
    let shards = rank0_shards(ops, r, world);
    let refs: Vec<_> = shards.iter().collect();
    let mut runs = Vec::new();
    for prefetch in [None, Some(DType::BF16), Some(DType::F32)] {
        if let Some(d) = prefetch {
            comm.prefetch_all_gather(ops, &refs, d).unwrap();
        }
        let mut fulls: Vec<_> = UNIT_LENS
            .iter()
            .map(|&n| ops.upload(&vec![-1.0; n]).unwrap())
            .collect();
        comm.all_gather(
            ops,
            &refs,
            &mut fulls.iter_mut().collect::<Vec<_>>(),
            DType::BF16,
        )
        .unwrap();
        runs.push(fulls.iter().map(|f| ops.download(f).unwrap()).collect());
    }
    runs
}

#[test]
fn bf16_all_gathers_round_each_shard_and_widen() {
    let want: Vec<Vec<f32>> = UNIT_LENS
        .iter()
        .enumerate()
        .map(|(t, &n)| (0..n).map(|i| round(grad_value(0, t, i))).collect())
        .collect();
    // The values are mostly not bf16: the gathers must round them.
    assert_ne!(round(grad_value(0, 0, 1)), grad_value(0, 0, 1));
    for world in [1, 2, 3, 4] {
        for (name, got) in [
            ("peers", over_peers(world, gather_bf16)),
            ("ring", over_ring(world, gather_bf16)),
            ("staged", over_staged(world, gather_bf16)),
        ] {
            for (r, runs) in got.iter().enumerate() {
                for (k, run) in runs.iter().enumerate() {
                    assert_eq!(run, &want, "{name}, {world} ranks, rank {r}, run {k}");
                }
            }
        }
    }
    // f16 is refused by name, by every implementation.
    let f16 = |comm: &dyn DeviceComm<HostOps>, ops: &HostOps| {
        let shard = ops.upload(&[1.0]).unwrap();
        let mut full = ops.upload(&[0.0]).unwrap();
        comm.all_gather(ops, &[&shard], &mut [&mut full], DType::F16)
            .unwrap_err()
            .to_string()
    };
    for e in [over_peers(1, f16), over_ring(1, f16), over_staged(1, f16)] {
        assert!(
            e[0].contains("all-gather in float16") && e[0].contains("f32 or bf16"),
            "{}",
            e[0]
        );
    }
}

/// A communicator that gathers in f32 whatever it is asked: the reference run.
struct F32Gathers<C>(C);

impl<O: GptOps, C: DeviceComm<O>> DeviceComm<O> for F32Gathers<C> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_gather(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        fulls: &mut [&mut O::Buf],
        _: DType,
    ) -> Result<(), DeviceTrainError> {
        self.0.all_gather(ops, shards, fulls, DType::F32)
    }
    fn prefetch_all_gather(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        _: DType,
    ) -> Result<bool, DeviceTrainError> {
        self.0.prefetch_all_gather(ops, shards, DType::F32)
    }
    fn held_bytes(&self) -> u64 {
        self.0.held_bytes()
    }
    fn reduce_scatter_avg(
        &self,
        ops: &O,
        fulls: &[&O::Buf],
        shards: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError> {
        self.0.reduce_scatter_avg(ops, fulls, shards, dtype)
    }
    fn all_reduce_avg(
        &self,
        ops: &O,
        bufs: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError> {
        self.0.all_reduce_avg(ops, bufs, dtype)
    }
    fn all_reduce_scalars(
        &self,
        ops: &O,
        scalars: &mut O::Scalars,
        slots: Range<usize>,
        op: ReduceOp,
    ) -> Result<(), DeviceTrainError> {
        self.0.all_reduce_scalars(ops, scalars, slots, op)
    }
}

fn pure_bf16(offload: bool) -> DeviceTrainConfig {
    DeviceTrainConfig {
        any_precision: Some(AnyPrecision {
            param: DType::BF16,
            state: DType::BF16,
            kahan: true,
        }),
        offload,
        ..device_config(LrSchedule::Constant, true, Some(0.5), 2)
    }
}

const STEPS: usize = 4;

/// Each step's (loss, norm) bits, the final parameters' bits and the bytes all-gathered.
type Run = (Vec<(u32, u64)>, Vec<(String, Vec<u32>)>, u64);

fn train<C: DeviceComm<HostOps>>(mut t: ShardedDeviceTrainer<HostOps, C>, tokens: &[u16]) -> Run {
    let o = (0..STEPS)
        .map(|s| {
            let r = t.step(tokens, s).unwrap();
            (r.loss.to_bits(), r.grad_norm.to_bits())
        })
        .collect();
    let p = param_bits(t.full_params().unwrap());
    (o, p, t.comm_volume().all_gathered)
}

/// Pure-bf16 training at 2 ranks (`FULL_SHARD`, `SHARD_GRAD_OP`) over each communicator, with
/// prefetch and under CPU offload: bitwise the run whose gathers move f32, with half the bytes
/// all-gathered.
#[test]
fn pure_bf16_training_gathers_in_bf16_bitwise_as_in_f32() {
    let tokens = synthetic_corpus(20_000, 64, 3);
    let both = Prefetch {
        forward: true,
        backward: true,
    };
    for offload in [false, true] {
        let c = pure_bf16(offload);
        assert_eq!(c.gather_dtype(), DType::BF16);
        let params = seeded_params(&c.cfg, 3).unwrap();
        for s in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
            let what = format!("{s:?}, offload {offload}");
            let peers = |f32_gathers: bool| -> Vec<Run> {
                let comms = peer_comms::<HostOps>(2, None);
                std::thread::scope(|sc| {
                    let hs: Vec<_> = comms
                        .into_iter()
                        .map(|(comm, _)| {
                            let (tokens, params) = (&tokens, &params);
                            sc.spawn(move || {
                                let ops = HostOps::new();
                                if f32_gathers {
                                    let comm = F32Gathers(comm);
                                    train(
                                        ShardedDeviceTrainer::new(ops, comm, c, s, params).unwrap(),
                                        tokens,
                                    )
                                } else {
                                    train(
                                        ShardedDeviceTrainer::new(ops, comm, c, s, params).unwrap(),
                                        tokens,
                                    )
                                }
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).collect()
                })
            };
            let (bf, f) = (peers(false), peers(true));
            for r in 0..2 {
                assert_eq!(
                    (&bf[r].0, &bf[r].1),
                    (&f[r].0, &f[r].1),
                    "peers, {what}, rank {r}"
                );
            }
            // Processes' path (staged, prefetching) and the host's: the same bits.
            let staged = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
                let mut t = staged_trainer(HostOps::new(), comm, 2, None, c, s, &params);
                t.set_prefetch(both);
                train(t, &tokens)
            })
            .unwrap();
            let host = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
                let comm = HostComm::new(Box::new(comm));
                train(
                    ShardedDeviceTrainer::new(HostOps::new(), comm, c, s, &params).unwrap(),
                    &tokens,
                )
            })
            .unwrap();
            // AdamW's run gathers the same units in f32: twice the bytes.
            let adamw = DeviceTrainConfig {
                any_precision: None,
                ..c
            };
            let f32_bytes = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
                let comm = HostComm::new(Box::new(comm));
                train(
                    ShardedDeviceTrainer::new(HostOps::new(), comm, adamw, s, &params).unwrap(),
                    &tokens,
                )
                .2
            })
            .unwrap();
            for r in 0..2 {
                assert_eq!(staged[r], bf[r], "staged, {what}, rank {r}");
                assert_eq!(host[r], bf[r], "host, {what}, rank {r}");
                assert_eq!(2 * bf[r].2, f32_bytes[r], "{what}: bytes all-gathered");
            }
        }
    }
}
