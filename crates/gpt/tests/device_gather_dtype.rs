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
use fsdp_kernels::gpt::{GptOps, HostOps, HostProducts};
use fsdp_kernels::host::AnyPrecision;

mod common;
use common::device::{
    device_config, grad_value, over_peers, over_ring, over_staged, param_bits, peer_comms,
    rank0_shards, staged_trainer, UNIT_LENS,
};

fn round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// The dtypes of the test unit's tensors in [`gather_mixed`]: the second alone in bf16.
const MIXED: [DType; 3] = [DType::F32, DType::BF16, DType::F32];

/// Each rank's shards of the test unit (the full tensor's values `grad_value(0, t, i)`,
/// mostly not bf16) gathered in `dtypes`; then prefetched in those and completed; then
/// prefetched in f32 and gathered in `dtypes` (the prefetch is of other dtypes: completed
/// unused).
fn gather_in(
    comm: &dyn DeviceComm<HostOps>,
    ops: &HostOps,
    dtypes: [DType; 3],
) -> Vec<Vec<Vec<f32>>> {
    let (r, world) = (comm.rank(), comm.world_size());
    let shards = rank0_shards(ops, r, world);
    let refs: Vec<_> = shards.iter().collect();
    let mut runs = Vec::new();
    for prefetch in [None, Some(dtypes), Some([DType::F32; 3])] {
        if let Some(d) = prefetch {
            comm.prefetch_all_gather(ops, &refs, &d).unwrap();
        }
        let mut fulls: Vec<_> = UNIT_LENS
            .iter()
            .map(|&n| ops.upload(&vec![-1.0; n]).unwrap())
            .collect();
        comm.all_gather(
            ops,
            &refs,
            &mut fulls.iter_mut().collect::<Vec<_>>(),
            &dtypes,
        )
        .unwrap();
        runs.push(fulls.iter().map(|f| ops.download(f).unwrap()).collect());
    }
    runs
}

fn gather_bf16(comm: &dyn DeviceComm<HostOps>, ops: &HostOps) -> Vec<Vec<Vec<f32>>> {
    gather_in(comm, ops, [DType::BF16; 3])
}

fn gather_mixed(comm: &dyn DeviceComm<HostOps>, ops: &HostOps) -> Vec<Vec<Vec<f32>>> {
    gather_in(comm, ops, MIXED)
}

#[test]
fn bf16_all_gathers_round_each_shard_and_widen() {
    // The values are mostly not bf16: the gathers must round them.
    assert_ne!(round(grad_value(0, 0, 1)), grad_value(0, 0, 1));
    let want = |dtypes: [DType; 3]| -> Vec<Vec<f32>> {
        UNIT_LENS
            .iter()
            .enumerate()
            .map(|(t, &n)| {
                (0..n)
                    .map(|i| match dtypes[t] {
                        DType::BF16 => round(grad_value(0, t, i)),
                        _ => grad_value(0, t, i),
                    })
                    .collect()
            })
            .collect()
    };
    type Run = fn(&dyn DeviceComm<HostOps>, &HostOps) -> Vec<Vec<Vec<f32>>>;
    let cases: [(Run, [DType; 3]); 2] = [(gather_bf16, [DType::BF16; 3]), (gather_mixed, MIXED)];
    for (f, dtypes) in cases {
        for world in [1, 2, 3, 4] {
            for (name, got) in [
                ("peers", over_peers(world, f)),
                ("ring", over_ring(world, f)),
                ("staged", over_staged(world, f)),
            ] {
                for (r, runs) in got.iter().enumerate() {
                    for (k, run) in runs.iter().enumerate() {
                        assert_eq!(
                            run,
                            &want(dtypes),
                            "{name} in {dtypes:?}, {world} ranks, rank {r}, run {k}"
                        );
                    }
                }
            }
        }
    }
    // f16 is refused by name, by every implementation, and so is a dtype count that is not
    // the tensors'.
    let f16 = |comm: &dyn DeviceComm<HostOps>, ops: &HostOps| {
        let shard = ops.upload(&[1.0]).unwrap();
        let mut full = ops.upload(&[0.0]).unwrap();
        let e = comm
            .all_gather(ops, &[&shard], &mut [&mut full], &[DType::F16])
            .unwrap_err()
            .to_string();
        let n = comm
            .all_gather(ops, &[&shard], &mut [&mut full], &[DType::F32; 2])
            .unwrap_err()
            .to_string();
        (e, n)
    };
    for errs in [over_peers(1, f16), over_ring(1, f16), over_staged(1, f16)] {
        let (e, n) = &errs[0];
        assert!(
            e.contains("all-gather in float16") && e.contains("f32 or bf16"),
            "{e}"
        );
        assert!(n.contains("2 dtypes for 1 tensors"), "{n}");
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
        dtypes: &[DType],
    ) -> Result<(), DeviceTrainError> {
        self.0
            .all_gather(ops, shards, fulls, &vec![DType::F32; dtypes.len()])
    }
    fn prefetch_all_gather(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        dtypes: &[DType],
    ) -> Result<bool, DeviceTrainError> {
        self.0
            .prefetch_all_gather(ops, shards, &vec![DType::F32; dtypes.len()])
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

/// `c` trained at 2 ranks sharded by `s` on the host twins with `products`: over `PeerComm`,
/// over `PeerComm` gathering everything in f32, over `StagedComm` prefetching both ways, and
/// over `HostComm`; rank by rank.
fn four_runs(c: DeviceTrainConfig, products: HostProducts, s: ShardingStrategy) -> [Vec<Run>; 4] {
    let tokens = synthetic_corpus(20_000, 64, 3);
    let params = seeded_params(&c.cfg, 3).unwrap();
    let ops = || HostOps::with_products(products);
    let peers = |f32_gathers: bool| -> Vec<Run> {
        let comms = peer_comms::<HostOps>(2, None);
        std::thread::scope(|sc| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|(comm, _)| {
                    let (tokens, params) = (&tokens, &params);
                    sc.spawn(move || {
                        if f32_gathers {
                            let comm = F32Gathers(comm);
                            let t = ShardedDeviceTrainer::new(ops(), comm, c, s, params);
                            train(t.unwrap(), tokens)
                        } else {
                            let t = ShardedDeviceTrainer::new(ops(), comm, c, s, params);
                            train(t.unwrap(), tokens)
                        }
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let staged = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
        let mut t = staged_trainer(ops(), comm, 2, None, c, s, &params);
        t.set_prefetch(Prefetch {
            forward: true,
            backward: true,
        });
        train(t, &tokens)
    })
    .unwrap();
    let host = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
        let comm = HostComm::new(Box::new(comm));
        train(
            ShardedDeviceTrainer::new(ops(), comm, c, s, &params).unwrap(),
            &tokens,
        )
    })
    .unwrap();
    [peers(false), peers(true), staged, host]
}

/// Holds the runs of [`four_runs`] to the same bits (the f32 gathers' run but for its bytes
/// all-gathered); returns each rank's bytes all-gathered.
fn same_bits(runs: &[Vec<Run>; 4], what: &str) -> Vec<u64> {
    let [peers, f32_gathers, staged, host] = runs;
    for r in 0..2 {
        let bits = (&peers[r].0, &peers[r].1);
        assert_eq!(
            bits,
            (&f32_gathers[r].0, &f32_gathers[r].1),
            "{what}, rank {r}"
        );
        assert_eq!(staged[r], peers[r], "staged, {what}, rank {r}");
        assert_eq!(host[r], peers[r], "host, {what}, rank {r}");
    }
    peers.iter().map(|r| r.2).collect()
}

/// Pure-bf16 training at 2 ranks (`FULL_SHARD`, `SHARD_GRAD_OP`) over each communicator, with
/// prefetch and under CPU offload: bitwise the run whose gathers move f32, with half the bytes
/// all-gathered (AdamW's run gathers the same units in f32).
#[test]
fn pure_bf16_training_gathers_in_bf16_bitwise_as_in_f32() {
    for offload in [false, true] {
        let c = pure_bf16(offload);
        assert_eq!(c.gather_dtype(), DType::BF16);
        for s in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
            let what = format!("pure bf16, {s:?}, offload {offload}");
            let bytes = same_bits(&four_runs(c, HostProducts::F32, s), &what);
            let adamw = DeviceTrainConfig {
                any_precision: None,
                ..c
            };
            let f32_bytes = same_bits(&four_runs(adamw, HostProducts::F32, s), "AdamW");
            for r in 0..2 {
                assert_eq!(2 * bytes[r], f32_bytes[r], "{what}: bytes all-gathered");
            }
        }
    }
}

/// AdamW with bf16 products (the device's default `--param-dtype bf16`) at 2 ranks: the
/// blocks' weights that only products read are gathered in bf16, the rest in f32 — bitwise
/// the run whose gathers move f32 over each communicator, with prefetch and under CPU
/// offload, with fewer bytes: the blocks' product weights at half their size.
#[test]
fn bf16_products_gather_the_blocks_weights_in_bf16_bitwise_as_in_f32() {
    for offload in [false, true] {
        let c = DeviceTrainConfig {
            offload,
            ..device_config(LrSchedule::Constant, true, Some(0.5), 2)
        };
        assert_eq!(c.gather_dtype(), DType::F32);
        for s in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
            let what = format!("bf16 products, {s:?}, offload {offload}");
            let bytes = same_bits(&four_runs(c, HostProducts::Bf16Operands, s), &what);
            let f32_bytes = same_bits(&four_runs(c, HostProducts::F32, s), "f32 products");
            // Per gather of a block, its product weights (12·E² elements) at 2 bytes, not 4;
            // FULL_SHARD gathers each block twice a micro-batch, SHARD_GRAD_OP once.
            let e = c.cfg.n_embd as u64;
            let gathers = match s {
                ShardingStrategy::FullShard => 2,
                _ => 1,
            } * (c.cfg.n_layer * c.grad_accum * STEPS) as u64;
            for r in 0..2 {
                assert_eq!(f32_bytes[r] - bytes[r], gathers * 12 * e * e * 2, "{what}");
            }
            println!(
                "{what}: {} of {} bytes all-gathered",
                bytes[0], f32_bytes[0]
            );
        }
    }
}
