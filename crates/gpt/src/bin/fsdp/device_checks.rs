//! What `fsdp train|plan --device` refuses before anything starts, each refusal one error
//! naming the option and why: ranks it cannot run, dtypes other than those it trains in, and
//! the sharded engine's options that mean nothing on the device; and the device's units of
//! `--wrap`.

use fsdp_collectives::LaunchEnv;
use fsdp_device::DType;
use fsdp_gpt::device_units::DeviceWrap;
use fsdp_kernels::gpt::Attention;

use crate::args::{DeviceArg, ModelArgs, TrainArgs};
use crate::{fail, CliError};

/// Options of the sharded engine (given on the command line) that mean nothing without it.
const ENGINE_ONLY: [(&str, &str, &str); 7] = [
    ("strategy", "--strategy", ONE_RANK),
    ("ranks_per_node", "--ranks-per-node", ONE_RANK),
    ("backward_prefetch", "--backward-prefetch", THREADS_PREFETCH),
    ("forward_prefetch", "--forward-prefetch", THREADS_PREFETCH),
    ("limit_all_gathers", "--limit-all-gathers", THREADS_PREFETCH),
    ("backend", "--backend", THREADS_MEET),
    ("init_timeout", "--init-timeout", THREADS_MEET),
];

/// Why the sharding options mean nothing at one rank.
const ONE_RANK: &str = "one rank shards nothing: --ranks N, or processes under fsdp launch";
/// Why ranks as threads take no prefetch options.
const THREADS_PREFETCH: &str = "ranks as threads on one device gather by copying each \
     other's shards on their own streams, with nothing to overlap: the prefetch options are \
     of processes under fsdp launch";
/// Why ranks as threads take no backend.
const THREADS_MEET: &str = "ranks as threads meet in the process, without a backend: it \
     is of processes under fsdp launch";

/// The refusals of `--device` other than cpu shared by `fsdp train` and `fsdp plan`, in order:
/// ranks as processes (a launcher's), a hybrid strategy of several ranks, a dtype other than
/// f32 (but bf16 or f16 parameters, bf16 or f16 reductions of several ranks). Returns the number of
/// ranks.
pub(crate) fn check_device_world_and_dtypes(
    dev: DeviceArg,
    model: &ModelArgs,
    launched_ok: bool,
) -> Result<usize, CliError> {
    let env = LaunchEnv::from_env()?;
    // Under a launcher a node is the launcher's: its LOCAL_WORLD_SIZE ranks (as the engine).
    let node_ranks = model
        .ranks_per_node
        .or(env.as_ref().map(|e| e.local_world_size));
    let world = match (env, launched_ok) {
        (Some(env), false) => {
            return Err(fail(format!(
                "--device {dev}: launched as rank {} of {}: the device plan is of ranks as \
                 threads (--ranks N, no launcher)",
                env.rank, env.world_size
            )))
        }
        (Some(env), true) => match model.ranks {
            Some(n) if n != env.world_size => {
                return Err(fail(format!(
                    "--ranks {n} disagrees with the launcher's world size {}",
                    env.world_size
                )))
            }
            _ => env.world_size,
        },
        (None, _) => model.ranks.unwrap_or(1),
    };
    if world > 1 {
        crate::device_sharded_cmd::check_strategy(dev, model.strategy, node_ranks, world)?;
    }
    // One rank reduces nothing: only f32 (the default) means anything there.
    let reduce_also = if world > 1 { DType::BF16 } else { DType::F32 };
    let dtypes = [
        ("--param-dtype", Some(model.param_dtype), DType::BF16),
        ("--reduce-dtype", model.reduce_dtype, reduce_also),
    ];
    for (i, (option, d, also)) in dtypes.into_iter().enumerate() {
        // Parameters may also be f16 (products of f16 operands, with the grad scaler), and
        // several ranks may reduce in f16 too.
        let f16_ok = |d: DType| d == DType::F16 && (i == 0 || world > 1);
        if let Some(d) = d.filter(|&d| d != DType::F32 && d != also && !f16_ok(d)) {
            return Err(fail(format!(
                "--device {dev}: {option} {}: the device trainer takes f32{}",
                crate::run_config::dtype_option(d),
                match (i, world) {
                    (0, _) => ", bf16 or f16 (products of 16-bit operands)",
                    (_, 1) => " only (one rank reduces nothing)",
                    _ => ", bf16 or f16 (the gradients' reductions)",
                }
            )));
        }
    }
    if model.attention == Some(Attention::Fused) && model.param_dtype == DType::F32 {
        return Err(fail(format!(
            "--device {dev}: --attention fused reads bf16 or f16 operands (tensor cores): it \
             takes --param-dtype bf16 (the device's default) or f16, not f32"
        )));
    }
    Ok(world)
}

/// The device's units of `--wrap`.
pub(crate) fn device_wrap(model: &ModelArgs) -> DeviceWrap {
    match model.wrap {
        crate::args::Wrap::Block => DeviceWrap::Block,
        crate::args::Wrap::Size(n) => DeviceWrap::Size { min_num_params: n },
    }
}

/// The refusals of `--device` other than cpu, in order: ranks it cannot run, a dtype other
/// than f32, then every option the device trainer does not support, by name. Returns the
/// number of ranks.
pub(crate) fn check_device_options(args: &TrainArgs) -> Result<usize, CliError> {
    let dev = args.device;
    let world = check_device_world_and_dtypes(dev, &args.model, true)?;
    if dev == DeviceArg::HostTwin && args.model.alloc_conf.is_some() {
        return Err(fail(
            "--device host-twin: --alloc-conf is not supported (the host twins count their \
             buffers without a caching allocator; it configures the one of --device cuda)",
        ));
    }
    // Under a launcher the ranks meet over `--backend` (nccl or tcp) within `--init-timeout`.
    let launched = LaunchEnv::from_env()?.is_some();
    // Processes issue the next unit's all-gather ahead of its use (FSDP's prefetch options).
    let allowed: &[&str] = match (world > 1, launched) {
        (true, true) => &[
            "strategy",
            "ranks_per_node",
            "backend",
            "init_timeout",
            "backward_prefetch",
            "forward_prefetch",
            "limit_all_gathers",
        ],
        (false, true) => &["backend", "init_timeout"],
        (true, false) => &["strategy", "ranks_per_node"],
        (false, false) => &[],
    };
    refuse_first(dev, world, [], &args.explicit, allowed)?;
    Ok(world)
}

/// The first of `unsupported` (option, set, why) that is set, then the first of
/// [`ENGINE_ONLY`] (but those in `allowed`) among the options given (`explicit`), as one
/// error naming it and why (at `world` ranks).
pub(crate) fn refuse_first(
    dev: DeviceArg,
    world: usize,
    unsupported: impl IntoIterator<Item = (&'static str, bool, &'static str)>,
    explicit: &[String],
    allowed: &[&str],
) -> Result<(), CliError> {
    let given = |id: &str| explicit.iter().any(|e| e == id) && !allowed.contains(&id);
    let engine_only = ENGINE_ONLY.iter().map(|&(id, o, why)| {
        // One rank (a process under a launcher among them) has nothing to prefetch.
        let why = if world == 1 && why == THREADS_PREFETCH {
            ONE_RANK
        } else {
            why
        };
        (o, given(id), why)
    });
    match unsupported
        .into_iter()
        .chain(engine_only)
        .find(|(_, g, _)| *g)
    {
        Some((option, _, why)) => Err(fail(format!(
            "--device {dev}: {option} is not supported on the device ({why})"
        ))),
        None => Ok(()),
    }
}
