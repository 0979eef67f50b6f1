//! The device memory of one rank of sharded training on a device
//! ([`ShardedDeviceTrainer`] over [`PeerComm`], what `fsdp train --device … --ranks N` runs),
//! predicted: [`plan_sharded_memory`] runs the trainer itself, every rank as a thread, over
//! [`MetaOps`] — operations that allocate and count every buffer as the host twins and
//! `CudaOps` do and compute nothing — for two steps, and reads rank 0's counted peak (every
//! rank holds the same sizes). The plan is therefore exact by construction for every strategy,
//! checkpointing and product type: the units gathered and freed, the gradients reduced, the
//! collectives' own buffers, in the order they happen. Under CPU offload (planned with it: its
//! host side holds real host memory, as the run will) the device holds no shards,
//! accumulators or moments: each unit's shards are copied in when used.
//! `tests/device_plan_sharded.rs` holds it equal to the host twins' measured peak.

use std::fmt;
use std::time::Duration;

use fsdp::ShardingStrategy;
use fsdp_allocator::{AllocatorConfig, MemoryStats};
use fsdp_collectives::{dryrun, Communicator};
use fsdp_kernels::gpt::HostProducts;
use fsdp_kernels::gpt::{param_shapes, MetaOps, Products};
use fsdp_kernels::host::step_scalars_len;
use fsdp_kernels::KernelError;

use crate::device_comm::CommVolume;
use crate::device_config::{DeviceTrainConfig, DeviceTrainError};
use crate::device_peer::PeerComm;
use crate::device_plan_alloc::mirror_allocator;
use crate::device_shard::shard_len;
use crate::device_sharded::{Prefetch, ShardedDeviceTrainer};
use crate::device_staged::StagedComm;

/// The predicted device memory of one rank of sharded training, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardedMemoryPlan {
    /// Ranks.
    pub world: usize,
    /// The sharding.
    pub strategy: ShardingStrategy,
    /// This rank's shards of the parameters held on the device (f32; padded to whole
    /// shards; 0 under CPU offload).
    pub parameters: u64,
    /// Its gradient accumulators (f32, shaped as the shards).
    pub accumulators: u64,
    /// The optimizer's state, shaped as the shards: AdamW's two f32 moments, or
    /// `AnyPrecisionAdamW`'s two and its compensation in its state dtype.
    pub moments: u64,
    /// Under CPU offload, what lives in host memory instead: the master shards, the
    /// accumulators and the optimizer's state (0 without offload; the accumulators and
    /// moments above are then 0).
    pub offloaded: u64,
    /// The step's scalars (f64).
    pub step_scalars: u64,
    /// Ranks as processes ([`plan_process_memory`]): the collectives' staging buffers, in
    /// device memory beside the operations' (included in `peak`); 0 for ranks as threads.
    pub staging: u64,
    /// The peak of a step past the first: what it holds throughout, plus the units gathered,
    /// the gradients, the activations and the working buffers at that moment.
    pub peak: u64,
    /// The bytes the rank's collectives move in a step (as
    /// [`ShardedDeviceTrainer::comm_volume`] counts them).
    pub comm_per_step: CommVolume,
}

impl ShardedMemoryPlan {
    /// What a rank holds throughout: its shards, accumulators, moments and scalars.
    pub fn persistent(&self) -> u64 {
        self.parameters + self.accumulators + self.moments + self.step_scalars
    }
}

impl fmt::Display for ShardedMemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
        writeln!(f, "per rank, {} ranks, {:?}:", self.world, self.strategy)?;
        for (what, b) in [
            ("parameter shards", self.parameters),
            ("gradient accumulators", self.accumulators),
            ("optimizer state", self.moments),
            ("step scalars", self.step_scalars),
            ("in host memory (CPU offload)", self.offloaded),
            ("collective staging buffers", self.staging),
        ] {
            writeln!(f, "  {what}: {b} bytes ({})", mib(b))?;
        }
        writeln!(
            f,
            "peak: {} bytes ({}): held throughout {} + the step's units, gradients, \
             activations and working buffers {}",
            self.peak,
            mib(self.peak),
            self.persistent(),
            self.peak.saturating_sub(self.persistent())
        )?;
        let v = self.comm_per_step;
        writeln!(
            f,
            "collectives a step: all-gathered {} bytes ({}), reduce-scattered {} bytes ({}), \
             all-reduced {} bytes ({})",
            v.all_gathered,
            mib(v.all_gathered),
            v.reduce_scattered,
            mib(v.reduce_scattered),
            v.all_reduced,
            mib(v.all_reduced)
        )
    }
}

/// The memory of one rank of `world` training `config` sharded by `strategy` (a hybrid one in
/// nodes of `ranks_per_node`), with `products` (see the [module](self) documentation).
///
/// # Errors
/// The settings the trainer refuses (as [`ShardedDeviceTrainer::new`] does).
pub fn plan_sharded_memory(
    config: &DeviceTrainConfig,
    products: Products,
    world: usize,
    strategy: ShardingStrategy,
    ranks_per_node: Option<usize>,
) -> Result<ShardedMemoryPlan, DeviceTrainError> {
    let ranks = run_threads(
        config,
        products,
        world,
        strategy,
        ranks_per_node,
        STEPS,
        None,
    )?;
    let offload = config.offload;
    let config = *config;
    let peak = ranks.iter().map(|r| r.peak).max().unwrap_or(0);
    Ok(ShardedMemoryPlan {
        comm_per_step: ranks
            .first()
            .map(|r| r.volume.per_step(STEPS as u64))
            .unwrap_or_default(),
        ..plan_of(&config, world, strategy, ranks_per_node, offload, peak, 0)
    })
}

/// The steps a memory plan runs: the second is a steady one (the first grows the kept buffers).
const STEPS: usize = 2;

/// What a planning run of one rank gives.
pub(crate) struct RankRun {
    /// Its counted peak (the staging buffers included).
    pub(crate) peak: u64,
    /// Its mirror's allocator statistics.
    pub(crate) stats: Option<MemoryStats>,
    /// The bytes its collectives moved.
    pub(crate) volume: CommVolume,
    /// Its collectives' staging bytes (ranks as processes).
    pub(crate) staging: u64,
}

/// Runs the sharded trainer of `world` ranks as threads over [`MetaOps`] for `steps` steps;
/// with `alloc`, each rank's buffers mirrored into a caching allocator of those settings.
/// Each rank's counted peak and statistics.
pub(crate) fn run_threads(
    config: &DeviceTrainConfig,
    products: Products,
    world: usize,
    strategy: ShardingStrategy,
    ranks_per_node: Option<usize>,
    steps: usize,
    alloc: Option<AllocatorConfig>,
) -> Result<Vec<RankRun>, DeviceTrainError> {
    config.validate()?;
    config.dims().validate()?;
    let host = twin_products(products);
    let t = config.cfg.block_size;
    let tokens = vec![0u16; 2 * (t + 1)];
    let timeout = Duration::from_secs(600);
    // Every rank's groups: its shard group and, under a hybrid strategy, its replicas.
    let comms: Vec<(PeerComm<MetaOps>, Option<PeerComm<MetaOps>>)> =
        match (strategy.is_hybrid(), ranks_per_node) {
            (true, Some(n)) => PeerComm::mesh(world, n, timeout)
                .ok_or_else(|| {
                    DeviceTrainError::Fsdp(fsdp::FsdpError::InvalidShape {
                        reason: format!("{world} ranks do not make nodes of {n}"),
                    })
                })?
                .into_iter()
                .map(|(s, r)| (s, Some(r)))
                .collect(),
            _ => PeerComm::group(world, timeout)
                .into_iter()
                .map(|c| (c, None))
                .collect(),
        };
    // Under CPU offload the run is planned with it: the host side holds real host memory
    // (what the run itself will hold), the device side only sizes.
    let config = *config;
    let ranks: Vec<Result<RankRun, DeviceTrainError>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|(comm, replicas)| {
                let tokens = &tokens;
                s.spawn(move || {
                    let ops = MetaOps::new(host);
                    if let Some(a) = alloc {
                        ops.memory_counter().mirror_into(mirror_allocator(a)?);
                    }
                    let mut t = ShardedDeviceTrainer::with_shards(
                        ops,
                        comm,
                        replicas,
                        config,
                        strategy,
                        |ops, _, len, _, factor| {
                            fsdp_kernels::gpt::GptOps::zeros(ops, shard_len(len, factor))
                        },
                    )?;
                    // Past the first step: the kept bf16 operand copies have grown.
                    for step in 0..steps {
                        t.enqueue_step(tokens, step)?;
                    }
                    t.flush()?;
                    let stats = t.ops().memory_counter().mirror_stats().transpose();
                    Ok(RankRun {
                        peak: t.memory().peak,
                        stats: stats.map_err(KernelError::from)?,
                        volume: t.comm_volume(),
                        staging: 0,
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(DeviceTrainError::Fsdp(fsdp::FsdpError::InvalidShape {
                        reason: "a planning thread panicked".into(),
                    }))
                })
            })
            .collect()
    });
    ranks.into_iter().collect()
}

/// The memory of one rank of `world` ranks as processes (`fsdp launch … train --device cuda`,
/// one GPU each) training `config` sharded by `strategy` (a hybrid one in nodes of
/// `ranks_per_node`) with `products` and `prefetch`: the trainer over
/// [`StagedComm`] (NCCL's path), run as rank 0 alone for two steps over [`MetaOps`] and
/// dry-run collectives (every rank holds the same sizes). Its staging buffers (meta, sizes
/// only) are the plan's `staging`, included in the peak: they grow in the first step and stay.
///
/// # Errors
/// As [`plan_sharded_memory`].
pub fn plan_process_memory(
    config: &DeviceTrainConfig,
    products: Products,
    world: usize,
    strategy: ShardingStrategy,
    ranks_per_node: Option<usize>,
    prefetch: Prefetch,
) -> Result<ShardedMemoryPlan, DeviceTrainError> {
    let how = (world, strategy, ranks_per_node, prefetch);
    let r = run_process(config, products, how, STEPS, None)?;
    Ok(ShardedMemoryPlan {
        comm_per_step: r.volume.per_step(STEPS as u64),
        ..plan_of(
            config,
            world,
            strategy,
            ranks_per_node,
            config.offload,
            r.peak,
            r.staging,
        )
    })
}

/// How ranks as processes train: the world, the strategy, the ranks of a node, the prefetch.
pub type ProcessRun = (usize, ShardingStrategy, Option<usize>, Prefetch);

/// Rank 0 of ranks as processes (`how`) over [`StagedComm`] on dry-run collectives and
/// [`MetaOps`] for `steps` steps; with `alloc`, its buffers (not the collectives' staging)
/// mirrored into a caching allocator of those settings.
pub(crate) fn run_process(
    config: &DeviceTrainConfig,
    products: Products,
    how: ProcessRun,
    steps: usize,
    alloc: Option<AllocatorConfig>,
) -> Result<RankRun, DeviceTrainError> {
    let (world, strategy, ranks_per_node, prefetch) = how;
    config.validate()?;
    config.dims().validate()?;
    let host = twin_products(products);
    let (comm, replicas): (Box<dyn Communicator>, _) = match (strategy.is_hybrid(), ranks_per_node)
    {
        (true, Some(n)) if n > 0 && world % n == 0 => {
            let mesh = dryrun::dry_run_mesh(0, world / n, n)?;
            (mesh.shard, Some(StagedComm::new(mesh.replicate)))
        }
        (true, Some(n)) => {
            return Err(DeviceTrainError::Fsdp(fsdp::FsdpError::InvalidShape {
                reason: format!("{world} ranks do not make nodes of {n}"),
            }))
        }
        _ => (Box::new(dryrun::DryRunCommunicator::new(0, world)?), None),
    };
    let ops = MetaOps::new(host);
    if let Some(a) = alloc {
        ops.memory_counter().mirror_into(mirror_allocator(a)?);
    }
    let mut t = ShardedDeviceTrainer::with_shards(
        ops,
        StagedComm::new(comm),
        replicas,
        *config,
        strategy,
        |ops, _, len, _, factor| fsdp_kernels::gpt::GptOps::zeros(ops, shard_len(len, factor)),
    )?;
    t.set_prefetch(prefetch);
    let tokens = vec![0u16; 2 * (config.cfg.block_size + 1)];
    for step in 0..steps {
        t.enqueue_step(&tokens, step)?;
    }
    t.flush()?;
    // The staging buffers are counted in the operations' memory.
    let stats = t.ops().memory_counter().mirror_stats().transpose();
    Ok(RankRun {
        peak: t.memory().peak,
        stats: stats.map_err(KernelError::from)?,
        volume: t.comm_volume(),
        staging: t.collective_bytes(),
    })
}

/// The host twins' (and the meta operations') form of `products`.
pub(crate) fn twin_products(products: Products) -> HostProducts {
    match products.half() {
        Some(fsdp_device::DType::BF16) => HostProducts::Bf16Operands,
        Some(_) => HostProducts::F16Operands,
        None => HostProducts::F32,
    }
}

/// The plan of a rank whose counted peak is `peak` (`staging` included), its collectives'
/// bytes left for the caller.
fn plan_of(
    config: &DeviceTrainConfig,
    world: usize,
    strategy: ShardingStrategy,
    ranks_per_node: Option<usize>,
    offload: bool,
    peak: u64,
    staging: u64,
) -> ShardedMemoryPlan {
    let factor = match (strategy, ranks_per_node) {
        (ShardingStrategy::NoShard, _) => 1,
        (s, Some(n)) if s.is_hybrid() => n,
        _ => world,
    };
    let shards: u64 = param_shapes(&config.dims())
        .iter()
        .map(|(_, s)| shard_len(s.iter().product(), factor) as u64)
        .sum();
    let each = shards * 4;
    let tensors = param_shapes(&config.dims()).len();
    let (moment, comp) = crate::device_optim::state_bytes(config, factor);
    let state = 2 * moment + comp;
    let (parameters, accumulators, moments, offloaded) = if offload {
        (0, 0, 0, 2 * each + state)
    } else {
        (each, each, state, 0)
    };
    ShardedMemoryPlan {
        world,
        strategy,
        parameters,
        accumulators,
        moments,
        offloaded,
        step_scalars: step_scalars_len(tensors) as u64 * 8,
        staging,
        peak,
        comm_per_step: CommVolume::default(),
    }
}
