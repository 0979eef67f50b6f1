//! The device trainer's tests' shared run: the tiny GPT (2 layers, 2 heads, 32 wide, 16
//! tokens, a vocabulary of 64), 8 rows a step, AdamW lr 3e-3, betas (0.9, 0.95), eps 1e-8,
//! weight decay 0.1.

use std::collections::HashMap;

use fsdp::optim::{decay_2d_only as decay_groups, decay_2d_only_group, AdamWConfig, LrSchedule};
use fsdp::wrap::{plan_units, WrapOptions, WrapPolicy};
use fsdp::ParamInit;
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::get_batch;
use fsdp_gpt::device_train::DeviceTrainConfig;
use fsdp_gpt::init::gpt2_init;
use fsdp_gpt::model::GptConfig;
use fsdp_gpt::runtime::{FsdpConfig, FsdpGpt, ShardingStrategy};
use fsdp_gpt::tree::gpt_module_tree;
use fsdp_kernels::gpt::HostOps;

/// The shared run with `schedule`, nanoGPT's groups when `decay_2d_only`, clipping at `clip`
/// and `accum` micro-batches a step; no offload, no checkpointing.
pub fn device_config(
    schedule: LrSchedule,
    decay_2d_only: bool,
    clip: Option<f64>,
    accum: usize,
) -> DeviceTrainConfig {
    DeviceTrainConfig {
        cfg: GptConfig::new(2, 2, 32, 16, 64).unwrap(),
        adamw: AdamWConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        schedule,
        decay_2d_only,
        grad_clip: clip,
        batch_size: 8,
        grad_accum: accum,
        offload: false,
        activation_checkpointing: false,
        attention: Default::default(),
        logits: Default::default(),
        reduce_dtype: fsdp_device::DType::F32,
        any_precision: None,
        grad_scaler: None,
        wrap: Default::default(),
    }
}

/// Every parameter's bits, sorted by name (for bitwise comparisons).
pub fn param_bits(p: HashMap<String, Vec<f32>>) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<_> = p
        .into_iter()
        .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    v.sort();
    v
}

/// (loss, gradient norm before clipping) of the first `steps` steps of the engine at `world`
/// ranks (threads of the ring) with `strategy` (a hybrid one in two nodes), from the seeded
/// weights of `seed`, each rank
/// taking its rows of every micro-batch as `fsdp train` does (rank 0's view: every rank's is
/// the same).
pub fn engine_run(
    c: &DeviceTrainConfig,
    tokens: &[u16],
    world: usize,
    strategy: ShardingStrategy,
    steps: usize,
    seed: u64,
) -> Vec<(f32, f64)> {
    let cfg = c.cfg;
    let plan = plan_units(
        &gpt_module_tree(&cfg),
        &WrapOptions::new(WrapPolicy::module_type(["Block"])),
    )
    .unwrap();
    let (accum, t) = (c.grad_accum, cfg.block_size);
    let micro = c.batch_size / accum;
    let global_tokens = c.batch_size * t;
    let mut out = ring::run_ranks(world, ring::RingOptions::default(), |comm| {
        let rank = comm.rank();
        let rule = gpt2_init(cfg.n_layer);
        let init = ParamInit::Seeded { seed, rule: &rule };
        let mut config = FsdpConfig::new(strategy);
        if strategy.is_hybrid() {
            // Two nodes.
            config.ranks_per_node = Some(world / 2);
        }
        let mut model =
            FsdpGpt::with_init(Box::new(comm), cfg, &plan, init, config, c.adamw).unwrap();
        model.set_lr_schedule(c.schedule).unwrap();
        if c.decay_2d_only {
            model
                .set_param_groups(decay_groups(c.adamw.weight_decay), |_, shape| {
                    decay_2d_only_group(shape)
                })
                .unwrap();
        }
        let mut v = Vec::new();
        for step in 0..steps {
            let mut loss = 0.0f32;
            for m in 0..accum {
                let k = (step * accum + m) as u64;
                let b = get_batch(tokens, k, micro, t, rank, world).unwrap();
                loss += if m + 1 < accum {
                    model
                        .no_sync(|f| f.forward_backward(&b, global_tokens))
                        .unwrap()
                } else {
                    model.forward_backward(&b, global_tokens).unwrap()
                };
            }
            let norm = match c.grad_clip {
                Some(max) => model.clip_grad_norm(max).unwrap(),
                None => model.grad_norm().unwrap(),
            };
            model.optimizer_step().unwrap();
            v.push((loss, norm));
        }
        v
    })
    .unwrap();
    out.swap_remove(0)
}

/// Tensor lengths of the collectives' test unit: uneven, one shorter than the largest world.
pub const UNIT_LENS: [usize; 3] = [7, 12, 2];

/// Rank `r`'s value of element `i` of tensor `t`: small integers, so that sums are exact.
pub fn unit_value(r: usize, t: usize, i: usize) -> f32 {
    (r * 100 + t * 10 + i) as f32
}

/// Every collective of `DeviceComm` once on this rank, on the test unit ([`UNIT_LENS`],
/// [`unit_value`]): the all-gathered tensors, the reduce-scattered shards, the all-reduced
/// tensors and the scalars after a sum of slots 1..3 and an average of slot 3, in that order.
pub fn exercise_collectives<O: fsdp_kernels::gpt::GptOps>(
    comm: &dyn fsdp_gpt::device_comm::DeviceComm<O>,
    ops: &O,
) -> Vec<Vec<f64>> {
    let (r, world) = (comm.rank(), comm.world_size());
    let mut out = Vec::new();
    let mut keep = |bufs: &[O::Buf]| {
        for b in bufs {
            out.push(
                ops.download(b)
                    .unwrap()
                    .iter()
                    .map(|&x| f64::from(x))
                    .collect(),
            );
        }
    };
    let up = |v: Vec<f32>| ops.upload(&v).unwrap();
    // All-gather: the full tensor is 0, 1, 2, … ; rank r holds its shard of it.
    let shards: Vec<_> = UNIT_LENS
        .iter()
        .enumerate()
        .map(|(t, &n)| {
            let s = n.div_ceil(world);
            up((0..s)
                .map(|j| {
                    if r * s + j < n {
                        unit_value(0, t, r * s + j)
                    } else {
                        0.0
                    }
                })
                .collect())
        })
        .collect();
    let mut fulls: Vec<_> = UNIT_LENS.iter().map(|&n| up(vec![-1.0; n])).collect();
    comm.all_gather(
        ops,
        &shards.iter().collect::<Vec<_>>(),
        &mut fulls.iter_mut().collect::<Vec<_>>(),
        &[fsdp_device::DType::F32; 3],
    )
    .unwrap();
    keep(&fulls);
    // Reduce-scatter of each rank's own values.
    let own: Vec<_> = UNIT_LENS
        .iter()
        .enumerate()
        .map(|(t, &n)| up((0..n).map(|i| unit_value(r, t, i)).collect()))
        .collect();
    let mut out_shards: Vec<_> = UNIT_LENS
        .iter()
        .map(|&n| up(vec![-1.0; n.div_ceil(world)]))
        .collect();
    comm.reduce_scatter_avg(
        ops,
        &own.iter().collect::<Vec<_>>(),
        &mut out_shards.iter_mut().collect::<Vec<_>>(),
        fsdp_device::DType::F32,
    )
    .unwrap();
    keep(&out_shards);
    // All-reduce of the same.
    let mut bufs = own;
    comm.all_reduce_avg(
        ops,
        &mut bufs.iter_mut().collect::<Vec<_>>(),
        fsdp_device::DType::F32,
    )
    .unwrap();
    keep(&bufs);
    // Scalars.
    let r = r as f64;
    let mut s = ops.scalars(&[r, r + 0.5, 2.0 * r, 4.0 * r, 9.0]).unwrap();
    comm.all_reduce_scalars(ops, &mut s, 1..3, fsdp_collectives::ReduceOp::Sum)
        .unwrap();
    comm.all_reduce_scalars(ops, &mut s, 3..4, fsdp_collectives::ReduceOp::Avg)
        .unwrap();
    let copy = ops.copy_scalars(&s).unwrap();
    out.push(ops.wait_scalars(copy).unwrap());
    // A prefetched all-gather completed by the all-gather of the same shards, with another
    // collective between them; then a prefetch of other shards (the first tensor alone)
    // that the next all-gather does not use: both give the first gather's values.
    let refs: Vec<_> = shards.iter().collect();
    let gathered = |fulls: &[O::Buf]| -> Vec<Vec<f32>> {
        fulls.iter().map(|f| ops.download(f).unwrap()).collect()
    };
    let want = gathered(&fulls);
    for prefetch in [&refs[..], &refs[..1]] {
        comm.prefetch_all_gather(
            ops,
            prefetch,
            &vec![fsdp_device::DType::F32; prefetch.len()],
        )
        .unwrap();
        comm.all_reduce_scalars(ops, &mut s, 4..5, fsdp_collectives::ReduceOp::Sum)
            .unwrap();
        let mut again: Vec<_> = UNIT_LENS.iter().map(|&n| up(vec![-1.0; n])).collect();
        comm.all_gather(
            ops,
            &refs,
            &mut again.iter_mut().collect::<Vec<_>>(),
            &[fsdp_device::DType::F32; 3],
        )
        .unwrap();
        assert_eq!(gathered(&again), want, "a prefetched all-gather");
    }
    out
}

/// Rank `r`'s gradient of element `i` of tensor `t`: of both signs, between −5 and 5, mostly
/// not representable in bf16.
pub fn grad_value(r: usize, t: usize, i: usize) -> f32 {
    ((r * 7919 + t * 104_729 + i * 1_299_709) % 1000) as f32 / 97.0 - 5.0
}

/// Each rank's gradients ([`grad_value`]) of the test unit ([`UNIT_LENS`]) reduce-scattered
/// and all-reduced in bf16, and rank 0's values of them all-gathered in bf16 from each rank's
/// shard: the shards, then the all-reduced tensors, then the gathered ones.
pub fn exercise_bf16<O: fsdp_kernels::gpt::GptOps>(
    comm: &dyn fsdp_gpt::device_comm::DeviceComm<O>,
    ops: &O,
) -> Vec<Vec<f32>> {
    exercise_half(comm, ops, fsdp_device::DType::BF16)
}

/// [`exercise_bf16`] with the reductions in f16 (the all-gather still in bf16).
pub fn exercise_f16<O: fsdp_kernels::gpt::GptOps>(
    comm: &dyn fsdp_gpt::device_comm::DeviceComm<O>,
    ops: &O,
) -> Vec<Vec<f32>> {
    exercise_half(comm, ops, fsdp_device::DType::F16)
}

/// [`exercise_bf16`] with the reductions in `reduce`.
fn exercise_half<O: fsdp_kernels::gpt::GptOps>(
    comm: &dyn fsdp_gpt::device_comm::DeviceComm<O>,
    ops: &O,
    reduce: fsdp_device::DType,
) -> Vec<Vec<f32>> {
    let (r, world) = (comm.rank(), comm.world_size());
    let own: Vec<_> = UNIT_LENS
        .iter()
        .enumerate()
        .map(|(t, &n)| {
            let v: Vec<f32> = (0..n).map(|i| grad_value(r, t, i)).collect();
            ops.upload(&v).unwrap()
        })
        .collect();
    let mut shards: Vec<_> = UNIT_LENS
        .iter()
        .map(|&n| ops.upload(&vec![-1.0; n.div_ceil(world)]).unwrap())
        .collect();
    comm.reduce_scatter_avg(
        ops,
        &own.iter().collect::<Vec<_>>(),
        &mut shards.iter_mut().collect::<Vec<_>>(),
        reduce,
    )
    .unwrap();
    let mut bufs = own;
    comm.all_reduce_avg(ops, &mut bufs.iter_mut().collect::<Vec<_>>(), reduce)
        .unwrap();
    let mine = rank0_shards(ops, r, world);
    let mut gathered: Vec<_> = UNIT_LENS
        .iter()
        .map(|&n| ops.upload(&vec![-1.0; n]).unwrap())
        .collect();
    comm.all_gather(
        ops,
        &mine.iter().collect::<Vec<_>>(),
        &mut gathered.iter_mut().collect::<Vec<_>>(),
        &[fsdp_device::DType::BF16; 3],
    )
    .unwrap();
    shards
        .iter()
        .chain(&bufs)
        .chain(&gathered)
        .map(|b| ops.download(b).unwrap())
        .collect()
}

/// Rank `r`'s shards (of `world`) of the test unit whose full values are rank 0's gradients
/// (`grad_value(0, t, i)`, mostly not bf16), zero-padded.
pub fn rank0_shards<O: fsdp_kernels::gpt::GptOps>(ops: &O, r: usize, world: usize) -> Vec<O::Buf> {
    UNIT_LENS
        .iter()
        .enumerate()
        .map(|(t, &n)| {
            let s = n.div_ceil(world);
            let v: Vec<f32> = (r * s..(r + 1) * s)
                .map(|i| if i < n { grad_value(0, t, i) } else { 0.0 })
                .collect();
            ops.upload(&v).unwrap()
        })
        .collect()
}

/// Each rank's groups for `world` ranks as threads: its shard group and, in nodes of `rpn`
/// ranks (a hybrid strategy), its replicas.
pub fn peer_comms<O: fsdp_kernels::gpt::PeerOps>(
    world: usize,
    rpn: Option<usize>,
) -> Vec<(
    fsdp_gpt::device_peer::PeerComm<O>,
    Option<fsdp_gpt::device_peer::PeerComm<O>>,
)> {
    use fsdp_gpt::device_peer::PeerComm;
    let timeout = std::time::Duration::from_secs(60);
    match rpn {
        Some(n) => PeerComm::mesh(world, n, timeout)
            .unwrap()
            .into_iter()
            .map(|(a, b)| (a, Some(b)))
            .collect(),
        None => PeerComm::group(world, timeout)
            .into_iter()
            .map(|a| (a, None))
            .collect(),
    }
}

/// Every rank's `f(trainer)`, `world` ranks as threads over `PeerComm` (what `fsdp train
/// --device … --ranks N` runs; a hybrid strategy in nodes of `rpn`), each training `c`
/// sharded by `s` from `params` on the operations `ops()` makes.
pub fn on_peer_trainers<R: Send>(
    (world, rpn): (usize, Option<usize>),
    c: DeviceTrainConfig,
    s: ShardingStrategy,
    params: &HashMap<String, Vec<f32>>,
    ops: impl Fn() -> HostOps + Sync,
    f: impl Fn(
            fsdp_gpt::device_sharded::ShardedDeviceTrainer<
                HostOps,
                fsdp_gpt::device_peer::PeerComm<HostOps>,
            >,
        ) -> R
        + Sync,
) -> Vec<R> {
    use fsdp_gpt::device_sharded::ShardedDeviceTrainer;
    let comms = peer_comms::<HostOps>(world, rpn);
    std::thread::scope(|sc| {
        let (f, ops) = (&f, &ops);
        let handles: Vec<_> = comms
            .into_iter()
            .map(|(comm, replicas)| {
                sc.spawn(move || {
                    let t = match replicas {
                        Some(r) => ShardedDeviceTrainer::new_hybrid(ops(), comm, r, c, s, params),
                        None => ShardedDeviceTrainer::new(ops(), comm, c, s, params),
                    };
                    f(t.unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `ops`' rank of `world` ranks over `StagedComm` on the ring rank `comm` (NCCL's path as
/// processes, in host memory), a hybrid strategy in nodes of `rpn`, training `c` sharded by
/// `s` from `params`.
pub fn staged_trainer<O: fsdp_kernels::gpt::StagingOps>(
    ops: O,
    comm: ring::RingCommunicator,
    world: usize,
    rpn: Option<usize>,
    c: DeviceTrainConfig,
    s: ShardingStrategy,
    params: &HashMap<String, Vec<f32>>,
) -> fsdp_gpt::device_sharded::ShardedDeviceTrainer<
    O,
    fsdp_gpt::device_staged::StagedComm<dyn Communicator>,
> {
    use fsdp_gpt::device_sharded::ShardedDeviceTrainer;
    use fsdp_gpt::device_staged::StagedComm;
    match rpn {
        Some(n) => {
            let mesh = fsdp_collectives::mesh_2d(&comm, world / n, n).unwrap();
            let (shard, replicas) = (StagedComm::new(mesh.shard), mesh.replicate);
            ShardedDeviceTrainer::new_hybrid(ops, shard, StagedComm::new(replicas), c, s, params)
        }
        None => {
            let comm: Box<dyn Communicator> = Box::new(comm);
            ShardedDeviceTrainer::new(ops, StagedComm::new(comm), c, s, params)
        }
    }
    .unwrap()
}

/// Runs `f` on `world` ranks of `HostComm` over the ring.
pub fn over_ring<R: Send>(
    world: usize,
    f: impl Fn(&dyn fsdp_gpt::device_comm::DeviceComm<HostOps>, &HostOps) -> R + Sync,
) -> Vec<R> {
    ring::run_ranks(world, ring::RingOptions::default(), |c| {
        let comm = fsdp_gpt::device_comm::HostComm::new(Box::new(c));
        f(&comm, &HostOps::new())
    })
    .unwrap()
}

/// Runs `f` on `world` ranks of `StagedComm` over the ring: host staging buffers, the
/// code path of NCCL's on a GPU.
pub fn over_staged<R: Send>(
    world: usize,
    f: impl Fn(&dyn fsdp_gpt::device_comm::DeviceComm<HostOps>, &HostOps) -> R + Sync,
) -> Vec<R> {
    ring::run_ranks(world, ring::RingOptions::default(), |c| {
        let comm = fsdp_gpt::device_staged::StagedComm::new(Box::new(c));
        f(&comm, &HostOps::new())
    })
    .unwrap()
}

/// Runs `f` on `world` ranks of `PeerComm` over the host twins, as threads.
pub fn over_peers<R: Send>(
    world: usize,
    f: impl Fn(&dyn fsdp_gpt::device_comm::DeviceComm<HostOps>, &HostOps) -> R + Sync,
) -> Vec<R> {
    let comms = fsdp_gpt::device_peer::PeerComm::<HostOps>::group(
        world,
        std::time::Duration::from_secs(30),
    );
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| s.spawn(move || f(&c, &HostOps::new())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
