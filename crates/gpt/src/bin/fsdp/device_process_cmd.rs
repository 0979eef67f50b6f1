//! `fsdp launch … train --device cuda|cuda:N|host-twin`: ranks as processes, this process one
//! of them, through [`ShardedDeviceTrainer`] over the launcher's backend:
//!
//! - `--device cuda` with `--backend nccl` (the default when every rank of a host has a GPU of
//!   its own): NCCL on the rank's GPU, the units staged in device memory ([`StagedComm`]), so
//!   no step waits on the host;
//! - `--device cuda` with `--backend tcp` (the default when ranks share a GPU, which NCCL
//!   refuses): TCP, the units staged through host memory ([`HostComm`]);
//! - `--device host-twin`: TCP with [`StagedComm`] in host memory — the NCCL path's code on
//!   the kernels' host twins.
//!
//! Each rank plans its memory first (`plan_process_memory`: the same trainer over dry-run
//! collectives and meta operations, the staging buffers included) and checks it against its
//! GPU's free memory (or `--memory-limit`; the ranks that share a GPU under tcp together).
//! Rank 0 reports and writes the outputs, its counted peak beside the plan's.

use std::time::Instant;

use fsdp_collectives::nccl::{NcclCommunicator, NcclOptions};
use fsdp_collectives::{init_from_env, mesh_2d, Backend, Communicator, InitOptions, LaunchEnv};
use fsdp_gpt::device_comm::{DeviceComm, HostComm};
use fsdp_gpt::device_plan_alloc::plan_process_allocator;
use fsdp_gpt::device_plan_sharded::plan_process_memory;
use fsdp_gpt::device_sharded::{Prefetch, ShardedDeviceTrainer};
use fsdp_gpt::device_staged::StagedComm;
use fsdp_gpt::runtime::BackwardPrefetch;
use fsdp_kernels::gpt::StagingOps;
use fsdp_kernels::gpt::{GptOps, HostOps};

use crate::args::{DeviceArg, TrainArgs, TrainBackend};
use crate::device_cmd::{
    cuda_ops, cuda_ordinal, cuda_stream, free_memory, host_products, products, Run,
};
use crate::device_plan_cmd::planned_allocator;
use crate::device_report::admit;
use crate::device_sharded_cmd::{check_strategy, Shared};
use crate::{fail, CliError};

/// The backend of `--device dev` under the launcher, on a host of `gpus` GPUs (`None`: the
/// host twins) where `indexed` says that `cuda:N` put every rank on one GPU.
pub(crate) fn process_backend(
    backend: Option<TrainBackend>,
    dev: DeviceArg,
    env: &LaunchEnv,
    gpus: Option<usize>,
    indexed: bool,
) -> Result<Backend, CliError> {
    let shared = |gpus: usize| env.local_world_size > 1 && (indexed || env.local_world_size > gpus);
    match (backend, gpus) {
        (None, Some(g)) if !shared(g) => Ok(Backend::Nccl),
        (None, _) | (Some(TrainBackend::Process(Backend::Tcp)), _) => Ok(Backend::Tcp),
        (Some(TrainBackend::Process(Backend::Nccl)), None) => Err(fail(format!(
            "--device {dev}: --backend nccl runs on CUDA buffers: use --device cuda, or tcp"
        ))),
        (Some(TrainBackend::Process(Backend::Nccl)), Some(g)) if shared(g) => Err(fail(format!(
            "--device {dev}: --backend nccl: the {} ranks of this host share {} GPU{}, and NCCL \
             takes one GPU per rank: use --backend tcp",
            env.local_world_size,
            if indexed { 1 } else { g },
            if indexed || g == 1 { "" } else { "s" }
        ))),
        (Some(TrainBackend::Process(Backend::Nccl)), Some(_)) => Ok(Backend::Nccl),
        (Some(b), _) => Err(fail(format!(
            "--device {dev} under a launcher: --backend {} is not supported (nccl{} or tcp)",
            match b {
                TrainBackend::Ring => "ring".to_string(),
                TrainBackend::Process(b) => b.to_string(),
            },
            if gpus.is_some() {
                ""
            } else {
                " on --device cuda"
            }
        ))),
    }
}

/// Trains `run` as this process's rank on `--device`'s operations (`bf16`: products of bf16
/// operands) over the backend [`process_backend`] picks.
pub(crate) fn train_launched(
    args: &TrainArgs,
    mut run: Run,
    env: &LaunchEnv,
    dtype: fsdp_device::DType,
) -> Result<(), CliError> {
    let dev = args.device;
    let init = init_options(args)?;
    // Every rank plans its own memory (all hold the same sizes) and checks it against its GPU.
    let strategy = args.model.strategy;
    let rpn = check_strategy(dev, strategy, node_ranks(args, env), env.world_size)?;
    let prefetch = prefetch(args)?;
    let plan = plan_process_memory(
        &run.config,
        products(dtype),
        env.world_size,
        strategy,
        rpn,
        prefetch,
    )
    .map_err(|e| fail(format!("--device {dev}: rank {}: {e}", env.rank)))?;
    let run = &mut run;
    match dev {
        DeviceArg::Cuda { ordinal, indexed } => {
            let count = fsdp_device::cuda::device_count()
                .map_err(|e| fail(format!("--device {dev}: no CUDA device ({e})")))?;
            // `cuda`: the launcher's local rank picks the GPU (torchrun's convention).
            let n = if indexed {
                ordinal
            } else {
                env.local_rank % count.max(1)
            };
            cuda_ordinal(dev, n)?;
            let backend = process_backend(args.backend, dev, env, Some(count), indexed)?;
            let what = format!("--device {dev}");
            let name = format!("fsdp train rank {}", env.rank);
            let ops = cuda_ops(cuda_stream(args, n, &name, &what)?, args, &what)?;
            let free = free_memory(ops.stream());
            if backend == Backend::Nccl {
                run.predicted_peak = plan.peak;
                // The staging buffers are NCCL's; the rest is the caching allocator's, which
                // reserves what its plan says.
                if let Some(alloc) = planned_allocator(args)? {
                    let how = (env.world_size, strategy, rpn, prefetch);
                    let a = plan_process_allocator(&run.config, products(dtype), how, alloc)
                        .map_err(|e| fail(format!("--device {dev}: rank {}: {e}", env.rank)))?;
                    run.predicted_reserved = Some(a.peak_reserved);
                    run.beside_allocator = plan.staging;
                }
                admit(args, run, free, 1)?;
                let store = env.rendezvous(init.effective_init_timeout())?;
                let opts = NcclOptions::default()
                    .with_timeout(init.timeout)
                    .with_init_timeout(init.effective_init_timeout());
                let comm = NcclCommunicator::new(&store, n, opts)
                    .map_err(|e| fail(format!("{what}: --backend nccl: {e}")))?;
                let how = "nccl, staged on the GPU";
                train_process(
                    args,
                    run,
                    env,
                    ops,
                    Box::new(comm),
                    staged,
                    Exchange { how, prefetch, rpn },
                )
            } else {
                // Host staging: none on the GPU; the ranks of this host that share it.
                run.predicted_peak = plan.peak - plan.staging;
                let sharing = if indexed {
                    env.local_world_size
                } else {
                    env.local_world_size.div_ceil(count.max(1))
                };
                admit(args, run, free, sharing)?;
                let comm = init_from_env(Backend::Tcp, &init)?;
                let how = "tcp, staged through host memory";
                train_process(
                    args,
                    run,
                    env,
                    ops,
                    comm,
                    host_staged,
                    Exchange {
                        how,
                        prefetch: Prefetch::NONE,
                        rpn,
                    },
                )
            }
        }
        DeviceArg::HostTwin => {
            process_backend(args.backend, dev, env, None, false)?;
            run.predicted_peak = plan.peak;
            admit(args, run, None, 1)?;
            let ops = HostOps::with_products(host_products(dtype));
            let comm = init_from_env(Backend::Tcp, &init)?;
            train_process(
                args,
                run,
                env,
                ops,
                comm,
                staged,
                Exchange {
                    how: "tcp",
                    prefetch,
                    rpn,
                },
            )
        }
        DeviceArg::Cpu => Err(fail("--device cpu runs the sharded engine")),
    }
}

/// The ranks of a node for the hybrid strategies: `--ranks-per-node`, else the launcher's
/// `LOCAL_WORLD_SIZE` (as the engine takes them).
fn node_ranks(args: &TrainArgs, env: &LaunchEnv) -> Option<usize> {
    args.model.ranks_per_node.or(Some(env.local_world_size))
}

/// How a process's ranks exchange, as its run's first line says.
struct Exchange<'s> {
    /// The backend and where it stages.
    how: &'s str,
    /// The all-gathers issued ahead (none where the collectives run whole).
    prefetch: Prefetch,
    /// The ranks of a node under a hybrid strategy.
    rpn: Option<usize>,
}

/// The launcher's options with `--timeout` and `--init-timeout`.
fn init_options(args: &TrainArgs) -> Result<InitOptions, CliError> {
    let mut init = InitOptions::from_env()?;
    if let Some(t) = args.timeout {
        init.timeout = t;
    }
    if let Some(t) = args.init_timeout {
        init.init_timeout = Some(t);
    }
    Ok(init)
}

/// `--forward-prefetch` and `--backward-prefetch` (`pre` or `none`): the all-gathers a rank
/// issues ahead of their use. They overlap compute where the collectives run on a stream of
/// their own ([`StagedComm`]: NCCL, and TCP on the host twins); [`HostComm`] runs each whole.
/// A prefetch is one unit deep, so at most two all-gathers are in flight:
/// `--limit-all-gathers 1` turns prefetch off, and any larger limit (or `off`) holds already.
fn prefetch(args: &TrainArgs) -> Result<Prefetch, CliError> {
    if args.model.limit_all_gathers.0 == Some(1) {
        return Ok(Prefetch {
            forward: false,
            backward: false,
        });
    }
    let backward = match args.model.backward_prefetch {
        BackwardPrefetch::Pre => true,
        BackwardPrefetch::None => false,
        _ => {
            return Err(fail(format!(
                "--device {}: --backward-prefetch post is not supported on the device (pre or \
                 none: the previous block's all-gather before each block's backward)",
                args.device
            )))
        }
    };
    Ok(Prefetch {
        forward: args.model.forward_prefetch,
        backward,
    })
}

/// [`StagedComm`] over `comm`.
fn staged<O: StagingOps>(comm: Box<dyn Communicator>) -> Box<dyn DeviceComm<O>> {
    Box::new(StagedComm::new(comm))
}

/// [`HostComm`] over `comm`.
fn host_staged<O: GptOps>(comm: Box<dyn Communicator>) -> Box<dyn DeviceComm<O>> {
    Box::new(HostComm::new(comm))
}

/// Trains `run` as rank `env.rank` of `env.world_size` processes started by a launcher, on
/// `ops`, the collectives over `comm` made [`DeviceComm`]s by `stage` as `exchange` says;
/// rank 0 reports and writes the outputs.
fn train_process<O: GptOps>(
    args: &TrainArgs,
    run: &Run,
    env: &LaunchEnv,
    ops: O,
    comm: Box<dyn Communicator>,
    stage: fn(Box<dyn Communicator>) -> Box<dyn DeviceComm<O>>,
    Exchange { how, prefetch, rpn }: Exchange<'_>,
) -> Result<(), CliError> {
    let dev = args.device;
    let (rank, world) = (env.rank, env.world_size);
    let strategy = args.model.strategy;
    let shared = Shared::open(
        args,
        run,
        &format!(
            "rank {rank} of {world} processes on {dev} ({how}){}",
            match (prefetch.forward, prefetch.backward) {
                (false, false) => "",
                (true, true) => ", all-gathers prefetched in forward and backward",
                (true, false) => ", all-gathers prefetched in forward",
                (false, true) => ", all-gathers prefetched in backward",
            }
        ),
        rank == 0,
    )?;
    let (c, p) = (run.config, &run.params);
    let start = Instant::now();
    let trainer = match rpn {
        Some(n) => {
            let mesh = mesh_2d(comm.as_ref(), world / n, n)?;
            ShardedDeviceTrainer::new_hybrid(
                ops,
                stage(mesh.shard),
                stage(mesh.replicate),
                c,
                strategy,
                p,
            )
        }
        None => ShardedDeviceTrainer::new(ops, stage(comm), c, strategy, p),
    }
    .map_err(|e| crate::fail_device(&format!("--device {dev}: rank {rank}"), e))?;
    let mut trainer = trainer;
    trainer.set_prefetch(prefetch);
    let end = shared.train(rank, trainer)?;
    if rank != 0 {
        shared.progress.finish();
        return Ok(());
    }
    shared.finish(
        vec![end],
        start.elapsed(),
        &format!("{world} processes (rank 0's)"),
        world,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(local_world_size: usize) -> LaunchEnv {
        let n = local_world_size.to_string();
        LaunchEnv::from_lookup(|k| match k {
            "RANK" | "LOCAL_RANK" => Some("0".into()),
            "WORLD_SIZE" | "LOCAL_WORLD_SIZE" => Some(n.clone()),
            _ => None,
        })
        .unwrap()
        .unwrap()
    }

    /// NCCL by default where every rank of the host has a GPU of its own (`cuda`, enough
    /// GPUs), TCP where ranks share one (`cuda:N`, or fewer GPUs than ranks) and on the host
    /// twins; an explicit nccl that NCCL would refuse is an error naming why.
    #[test]
    fn nccl_where_each_rank_has_its_gpu() {
        let cuda = DeviceArg::Cuda {
            ordinal: 0,
            indexed: false,
        };
        let nccl = Some(TrainBackend::Process(Backend::Nccl));
        let tcp = Some(TrainBackend::Process(Backend::Tcp));
        let pick = |b, ranks, gpus, indexed| process_backend(b, cuda, &env(ranks), gpus, indexed);
        assert_eq!(pick(None, 2, Some(2), false).unwrap(), Backend::Nccl);
        assert_eq!(pick(None, 1, Some(1), true).unwrap(), Backend::Nccl);
        assert_eq!(pick(None, 4, Some(2), false).unwrap(), Backend::Tcp);
        assert_eq!(pick(None, 2, Some(8), true).unwrap(), Backend::Tcp);
        assert_eq!(pick(None, 2, None, false).unwrap(), Backend::Tcp);
        assert_eq!(pick(tcp, 2, Some(2), false).unwrap(), Backend::Tcp);
        assert_eq!(pick(nccl, 2, Some(2), false).unwrap(), Backend::Nccl);
        let e = pick(nccl, 4, Some(2), false).unwrap_err().msg;
        assert!(e.contains("4 ranks of this host share 2 GPUs"), "{e}");
        let e = pick(nccl, 2, Some(8), true).unwrap_err().msg;
        assert!(e.contains("share 1 GPU,"), "{e}");
        let e = pick(nccl, 2, None, false).unwrap_err().msg;
        assert!(e.contains("runs on CUDA buffers"), "{e}");
        let ring = Some(TrainBackend::Ring);
        let e = pick(ring, 2, Some(2), false).unwrap_err().msg;
        assert!(
            e.contains("--backend ring is not supported (nccl or tcp)"),
            "{e}"
        );
    }
}
