//! What `fsdp train` checks and decides before any rank starts: how the ranks run (threads of
//! this process, or this process as one rank under a launcher or mpirun), the sizes and the
//! memory admission of the run, the learning-rate schedule, the grad scaler and the initial
//! parameters.

use std::collections::HashMap;
use std::path::Path;

use fsdp::engine::GradScalerConfig;
use fsdp::optim::{LrSchedule, OptimizerConfig};
use fsdp_collectives::{Backend, LaunchEnv};
use fsdp_device::DType;
use fsdp_gpt::init::gpt2_init;
use fsdp_gpt::model::{param_specs, GptConfig};

use crate::admission::{self, available, ProcessData, Sharing};
use crate::args::{ScheduleKindArg, TrainArgs, TrainBackend};
use crate::engine_cmd::EngineDevice;
use crate::setup::{micro_batch, setup, Setup, DEFAULT_RANKS};
use crate::train::SYNTHETIC_LEN;
use crate::{fail, CliError};

/// The learning-rate schedule of the options, validated.
pub(crate) fn lr_schedule(args: &TrainArgs) -> Result<LrSchedule, CliError> {
    let cosine_only =
        args.warmup_iters > 0 || args.lr_decay_iters.is_some() || args.min_lr.is_some();
    let s = match args.lr_schedule {
        ScheduleKindArg::Constant if cosine_only => {
            return Err(fail(
                "--warmup-iters, --lr-decay-iters and --min-lr need --lr-schedule cosine",
            ))
        }
        ScheduleKindArg::Constant => LrSchedule::Constant,
        ScheduleKindArg::Cosine => LrSchedule::Cosine {
            warmup_iters: args.warmup_iters,
            lr_decay_iters: args.lr_decay_iters.unwrap_or(args.steps as u64),
            min_lr: args.min_lr.unwrap_or(args.lr / 10.0),
        },
    };
    s.validate()?;
    Ok(s)
}

/// The initial parameters of a checkpoint, or `None` for the sharded seeded initialisation
/// (each rank draws only its own shards; the same model at every world size).
pub(crate) fn initial_params(
    args: &TrainArgs,
    cfg: &GptConfig,
) -> Result<Option<HashMap<String, Vec<f32>>>, CliError> {
    match &args.init_from {
        Some(path) => Ok(Some(load_checkpoint(path, cfg)?)),
        None => {
            // Check the rule covers every parameter before any rank starts.
            let rule = gpt2_init(cfg.n_layer);
            for p in param_specs(cfg) {
                rule(&p.name, &p.shape)?;
            }
            Ok(None)
        }
    }
}

fn load_checkpoint(path: &Path, cfg: &GptConfig) -> Result<HashMap<String, Vec<f32>>, CliError> {
    Ok(fsdp_gpt::checkpoint::load_full(path, cfg)?)
}

/// What [`admit_run`] gives: the model, FSDP configuration and unit plan, the optimizer, the
/// rows of a micro-batch (all ranks), the tokens of a step (all ranks), each rank's
/// allocator capacity and the data the process holds besides the ranks' memory.
pub(crate) struct Admitted {
    pub(crate) setup: Setup,
    pub(crate) optim: OptimizerConfig,
    pub(crate) micro: usize,
    pub(crate) global_tokens: usize,
    pub(crate) capacity: usize,
    pub(crate) data: ProcessData,
}

/// The checks of the sizes that come before any allocation, ending with the memory admission
/// of the ranks sharing this memory (`sharing`; `resumed`: a `--resume` run, which loads its
/// checkpoint's tensors).
pub(crate) fn admit_run(
    args: &TrainArgs,
    world: usize,
    sharing: Sharing<'_>,
    resumed: bool,
    engine_device: Option<EngineDevice>,
) -> Result<Admitted, CliError> {
    let on_device = engine_device.is_some();
    // The optimizer decides what a shard element holds (AnyPrecisionAdamW: the shards in
    // --param-dtype), so it is checked first.
    let optim = crate::optimizer::train_optimizer(args)?;
    // A cheap lower bound of the memory, before the module tree and the plan are built (not
    // for the engine on a device: its plan is the device's, `engine_plan_cmd::admit`).
    if !on_device {
        admission::precheck(&args.model, &optim, world, sharing, args.memory_limit)?;
    }
    let setup = setup(&args.model, world, false)?;
    let t = setup.cfg.block_size;
    let micro = micro_batch(args.batch_size, args.grad_accum, world)?;
    if args.steps == 0 {
        return Err(fail("--steps must be at least 1"));
    }
    if args.steps.checked_mul(args.grad_accum).is_none() {
        return Err(fail(format!(
            "--steps {} × --grad-accum {} micro-batches overflow a 64-bit count",
            args.steps, args.grad_accum
        )));
    }
    let global_tokens = args.batch_size.checked_mul(t).ok_or_else(|| {
        fail(format!(
            "--batch-size {} × --block-size {t} tokens overflow a 64-bit count",
            args.batch_size
        ))
    })?;
    // Memory admission, before any allocation: the plan's prediction of every rank sharing
    // this memory against the memory available; each rank's allocator gets its share.
    let data = ProcessData::new(
        args.data.as_deref(),
        SYNTHETIC_LEN,
        setup.cfg.num_params(),
        args.init_from.is_some(),
        resumed.then_some(&optim),
        args.save.is_some(),
    )?;
    // The engine on a device is admitted on its device plan and the host on its host figures
    // (`engine_plan_cmd::admit`, with this data): each rank's allocators (its host one, which
    // holds the shards until they are placed and offloaded ones; the host twin's device) take an
    // equal share of the host's memory among the ranks of this host (`--memory-limit` on the
    // host twin, whose device memory is the host's; on CUDA it bounds the device alone).
    let capacity = if let Some(dev) = engine_device {
        let ranks = match sharing {
            Sharing::Threads => world,
            Sharing::Host(h) => h.env().local_world_size,
            Sharing::Launched => admission::local_ranks().unwrap_or(1),
        };
        available(dev.host_memory_limit(args.memory_limit)).map_or(usize::MAX, |a| {
            usize::try_from(a.bytes / ranks.max(1) as u64).unwrap_or(usize::MAX)
        })
    } else {
        admission::admit(
            &setup.cfg,
            &setup.config,
            &setup.plan,
            world,
            micro,
            args.grad_accum,
            &optim,
            sharing,
            &data,
            args.memory_limit,
        )?
    };
    Ok(Admitted {
        setup,
        optim,
        micro,
        global_tokens,
        capacity,
        data,
    })
}

/// How `train` runs its ranks.
pub(crate) enum Mode {
    /// Ranks as threads of this process on the ring backend.
    Threads(usize),
    /// This process is one rank of `world`, started by a launcher or by mpirun.
    Process { backend: Backend, world: usize },
}

/// The world size under mpirun, from the variables that Open MPI (`OMPI_COMM_WORLD_SIZE`) and
/// PMI-based launchers such as MPICH's (`PMI_SIZE`) set.
pub(crate) fn mpi_world_from_env() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
}

/// The error of `--backend ring` under a launcher (which would run a whole job per process).
pub(crate) const RING_UNDER_LAUNCHER: &str = "--backend ring runs every rank as a thread of one \
     process; under fsdp launch use the default (tcp)";

pub(crate) fn train_mode(args: &TrainArgs) -> Result<Mode, CliError> {
    let launched = LaunchEnv::from_env()?;
    let backend = match args.backend {
        Some(b) => b,
        None if launched.is_some() => TrainBackend::Process(Backend::Tcp),
        None if cfg!(feature = "mpi") && mpi_world_from_env().is_some() => {
            TrainBackend::Process(Backend::Mpi)
        }
        None => TrainBackend::Ring,
    };
    let given = args.model.ranks;
    let (backend, world) =
        match backend {
            TrainBackend::Ring if launched.is_some() => return Err(fail(RING_UNDER_LAUNCHER)),
            TrainBackend::Ring => return Ok(Mode::Threads(given.unwrap_or(DEFAULT_RANKS))),
            TrainBackend::Process(Backend::Nccl) => return Err(fail(
                "--backend nccl needs CUDA buffers, and the sharded engine computes on the CPU: \
                 use tcp or mpi (nccl trains with --device cuda under fsdp launch)",
            )),
            TrainBackend::Process(Backend::Mpi) => {
                let world = mpi_world_from_env().ok_or_else(|| {
                fail("--backend mpi: not started by mpirun (OMPI_COMM_WORLD_SIZE / PMI_SIZE unset)")
            })?;
                (Backend::Mpi, world)
            }
            TrainBackend::Process(b) => match &launched {
                Some(env) => (b, env.world_size),
                None => {
                    return Err(fail(format!(
                        "--backend {b}: RANK and WORLD_SIZE are not set; start the ranks with \
                     `fsdp launch --nproc-per-node N train ...`"
                    )))
                }
            },
        };
    check_ranks_given(given, world)?;
    Ok(Mode::Process { backend, world })
}

/// `--ranks`, when given under a launcher, must be the launcher's world size.
pub(crate) fn check_ranks_given(given: Option<usize>, world: usize) -> Result<(), CliError> {
    match given {
        Some(n) if n != world => Err(fail(format!(
            "--ranks {n} disagrees with the launcher's world size {world}"
        ))),
        _ => Ok(()),
    }
}

/// Whether the grad scaler is on: `--grad-scaler`, by default on with `--param-dtype f16`.
pub(crate) fn grad_scaler_on(args: &TrainArgs) -> bool {
    args.grad_scaler
        .unwrap_or(args.model.param_dtype == DType::F16)
}

/// The grad scaler of the options (`--grad-scaler`, `--init-scale`, `--growth-interval`),
/// validated: `None` when it is off. On by default with `--param-dtype f16`, off otherwise;
/// the other settings are `torch.amp.GradScaler`'s (growth factor 2, backoff factor ½).
pub(crate) fn grad_scaler_config(args: &TrainArgs) -> Result<Option<GradScalerConfig>, CliError> {
    if !grad_scaler_on(args) {
        let given = [
            ("--init-scale", args.init_scale.is_some()),
            ("--growth-interval", args.growth_interval.is_some()),
        ];
        if let Some((option, _)) = given.iter().find(|(_, g)| *g) {
            return Err(fail(format!(
                "{option} sets the grad scaler, which is off (it is on by default only with \
                 --param-dtype f16; --grad-scaler on turns it on)"
            )));
        }
        return Ok(None);
    }
    let mut config = GradScalerConfig::default();
    if let Some(s) = args.init_scale {
        // The scale is an f32, as torch's.
        let f = s as f32;
        if !(s.is_finite() && f.is_finite() && f > 0.0) {
            let shown = if s.is_finite() && s.abs() >= 1e9 {
                format!("{s:e}")
            } else {
                s.to_string()
            };
            return Err(fail(format!(
                "--init-scale {shown}: must be a finite positive number that an f32 holds \
                 (at most {:e})",
                f32::MAX
            )));
        }
        config.init_scale = f;
    }
    if let Some(n) = args.growth_interval {
        if n == 0 {
            return Err(fail("--growth-interval must be at least 1"));
        }
        config.growth_interval = n;
    }
    config.validate()?;
    Ok(Some(config))
}
