//! Memory admission: before `fsdp train` allocates anything, the plan (a dry run of the engine,
//! [`fsdp_gpt::plan::plan_with_optimizer`]) predicts every rank's memory — the caching
//! allocator's reserved peak, the optimizer state (AdamW's, or AnyPrecisionAdamW's with its
//! shards in `--param-dtype`) and the activations — and the ranks that share this memory
//! add up: all ranks in thread mode (they are threads of this process); under a launcher the
//! ranks of this host, which meet at the rendezvous store ([`HostGroup`], [`crate::host_admission`]): each publishes its
//! own prediction and the memory it sees, and each adds up the same figures, so every rank of
//! the host reaches the same verdict. (Under mpirun, which has no store before the
//! communicator, the ranks of this host are counted as `LOCAL_WORLD_SIZE` times one rank's
//! figure: every rank holds equal-sized shards and runs the same schedule.) Data held once per
//! process (the token corpus, `--init-from`'s or `--resume`'s full tensors, the full parameters
//! `--save` gathers on every rank) are added.
//!
//! The total is compared with the memory available: the smaller of `/proc/meminfo`'s
//! `MemAvailable` and the cgroup limits' headroom ([`fsdp::plan::available_memory`]), or
//! `--memory-limit` when given, which replaces the detected figure (under a launcher, the
//! smallest figure a rank of the host saw). Above it, the run stops with one error line giving
//! both figures and a hint. Admitted, each rank's caching allocator gets its share of the
//! available memory (less its optimizer state and activations) as capacity, so the allocator
//! enforces what was admitted.
//!
//! A cheap lower bound (per element of a rank's shard: the parameter, its f32 gradient and the
//! optimizer state; 16 bytes for AdamW) is checked first, before the module tree and the plan
//! are built, so that an absurd model is refused without building anything in proportion to
//! it.

use std::path::Path;

use fsdp::optim::OptimizerConfig;
use fsdp::plan::{available_memory, AvailableMemory, MemoryPlan};
use fsdp::units::UnitPlan;
use fsdp::{human_bytes, FsdpError};
use fsdp_collectives::LaunchEnv;
use fsdp_gpt::model::GptConfig;
use fsdp_gpt::runtime::{FsdpConfig, ShardingStrategy};

use crate::args::ModelArgs;
use crate::host_admission::{list_shares, HostGroup, Share, LOWER_BOUND, PLAN};
use crate::{fail, CliError};

/// Parses a byte count: a whole number with an optional binary suffix `K`, `M`, `G`, `T` or
/// `P` (`KiB`, `MB`, `G`... are the same: powers of 1024), e.g. `512M`, `2G`, `1048576`.
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    let (num, suffix) = t.split_at(digits);
    let num: u64 = num
        .parse()
        .map_err(|_| format!("`{s}`: expected bytes, e.g. 1048576, 512M or 2G"))?;
    let suffix = suffix.trim();
    let upper = suffix.to_ascii_uppercase();
    let unit = upper
        .strip_suffix("IB")
        .or_else(|| upper.strip_suffix('B'))
        .unwrap_or(&upper);
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        "P" => 50,
        _ => {
            return Err(format!(
                "`{s}`: unknown unit `{suffix}` (expected K, M, G, T or P, powers of 1024)"
            ))
        }
    };
    num.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("`{s}` overflows 64-bit bytes"))
}

/// The error of rank `rank` as the program reports it: an allocation failure (the caching
/// allocator's, or a host buffer's) is prefixed with the rank, which its message lacks.
pub(crate) fn on_rank(rank: usize) -> impl Fn(FsdpError) -> CliError {
    move |e| match e {
        FsdpError::Alloc(_) | FsdpError::HostOutOfMemory { .. } => {
            fail(format!("rank {rank}: {e}"))
        }
        e => e.into(),
    }
}

/// Which ranks share the memory checked.
#[derive(Clone, Copy)]
pub(crate) enum Sharing<'a> {
    /// All `world` ranks are threads of this process.
    Threads,
    /// This process is one rank; the ranks of this host are `LOCAL_WORLD_SIZE`, each assumed
    /// to need what this one needs (mpirun: no store to add up their predictions).
    Launched,
    /// This process is one rank; the ranks of this host add up their predictions through the
    /// rendezvous store.
    Host(&'a HostGroup),
}

impl Sharing<'_> {
    /// A refusal: under [`Sharing::Host`] the line names the rank (each rank of the host says
    /// it).
    pub(crate) fn refuse(self, msg: String) -> CliError {
        match self {
            Sharing::Host(h) => fail(format!("rank {}: {msg}", h.env().rank)),
            _ => fail(msg),
        }
    }

    /// The ranks whose memory this process predicts, and how to name them (under
    /// [`Sharing::Host`], this rank alone: the host's sum comes from the store).
    pub(crate) fn ranks(self, world: usize) -> (usize, String) {
        match self {
            Sharing::Host(h) => (1, format!("rank {}", h.env().rank)),
            Sharing::Threads => (
                world,
                if world == 1 {
                    "1 rank in this process".to_string()
                } else {
                    format!("{world} ranks as threads of this process")
                },
            ),
            Sharing::Launched => {
                let local = local_ranks().unwrap_or(world).clamp(1, world);
                (
                    local,
                    if local == 1 {
                        "the 1 rank of this host".to_string()
                    } else {
                        format!("the {local} ranks of this host")
                    },
                )
            }
        }
    }
}

/// The ranks on this host under a launcher: `LOCAL_WORLD_SIZE` (torchrun, `fsdp launch`), or
/// under mpirun Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE` or MPICH's `MPI_LOCALNRANKS`.
pub(crate) fn local_ranks() -> Option<usize> {
    if let Ok(Some(env)) = LaunchEnv::from_env() {
        return Some(env.local_world_size);
    }
    ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
}

/// The memory available: `--memory-limit` when given, else the detected figure (`None`: it
/// cannot be read on this system).
pub(crate) fn available(limit: Option<u64>) -> Option<AvailableMemory> {
    match limit {
        Some(bytes) => Some(AvailableMemory {
            bytes,
            source: "--memory-limit".into(),
        }),
        None => available_memory(),
    }
}

pub(crate) fn overflow(what: &str) -> CliError {
    fail(format!(
        "the memory this run needs overflows 64-bit bytes ({what}): the model or the batch is \
         too large"
    ))
}

/// `n` bytes as `1.5 GiB (1610612736 bytes)`.
fn both(n: u64) -> String {
    format!("{} ({n} bytes)", human_bytes(n))
}

/// `available` as `1.5 GiB (1610612736 bytes, <source>)`.
fn avail(a: &AvailableMemory) -> String {
    format!("{} ({} bytes, {})", human_bytes(a.bytes), a.bytes, a.source)
}

/// The data held once per process besides the ranks' own memory.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ProcessData {
    /// The token corpus.
    pub(crate) corpus: u64,
    /// Full tensors kept for the whole run: `--init-from`'s parameters, or `--resume`'s
    /// parameters and optimizer state.
    pub(crate) checkpoint: u64,
    /// Full parameters gathered at the end by each rank for `--save`.
    pub(crate) save_per_rank: u64,
}

impl ProcessData {
    /// The corpus of `--data` (its size on disk; unreadable: 0, the read reports it) or the
    /// generated one of `generated` tokens, with `params` parameters loaded by `--init-from`
    /// (`init_from`) or `--resume` (parameters and the optimizer's buffers: both AdamW moments,
    /// or AnyPrecisionAdamW's moments and compensation, read as f32), and gathered for `--save`.
    pub(crate) fn new(
        data: Option<&Path>,
        generated: usize,
        params: usize,
        init_from: bool,
        resume: Option<&OptimizerConfig>,
        save: bool,
    ) -> Result<ProcessData, CliError> {
        let corpus = match data {
            Some(p) => std::fs::metadata(p).map_or(0, |m| m.len()),
            None => (generated as u64).saturating_mul(2),
        };
        let param_bytes = (params as u64)
            .checked_mul(4)
            .ok_or_else(|| overflow("the parameters"))?;
        let checkpoint = match (resume, init_from) {
            (Some(optim), _) => {
                param_bytes.checked_mul(1 + crate::optimizer::checkpoint_buffers(optim))
            }
            (None, true) => Some(param_bytes),
            (None, false) => Some(0),
        }
        .ok_or_else(|| overflow("the checkpoint"))?;
        Ok(ProcessData {
            corpus,
            checkpoint,
            save_per_rank: if save { param_bytes } else { 0 },
        })
    }

    /// The bytes of one process holding `ranks` ranks.
    pub(crate) fn bytes(&self, ranks: usize) -> Option<u64> {
        self.corpus
            .checked_add(self.checkpoint)?
            .checked_add(self.save_per_rank.checked_mul(ranks as u64)?)
    }
}

/// What the ranks sharing this memory need, predicted.
#[derive(Clone)]
pub(crate) struct Prediction<'a> {
    /// The ranks sharing the memory and how they are named.
    ranks: usize,
    who: String,
    /// One rank's allocator (reserved) peak, optimizer state and activations.
    allocator: u64,
    optimizer: u64,
    activations: u64,
    per_rank: u64,
    /// Data of the processes sharing the memory (see [`ProcessData`]); under
    /// [`Sharing::Host`], of this rank's process.
    data: u64,
    /// Whether `data` includes full tensors (checkpoints, `--save`).
    data_has_tensors: bool,
    /// Everything.
    pub(crate) total: u64,
    /// Under [`Sharing::Host`], once added up: this rank's own figure and every rank's.
    shares: Option<(u64, Vec<Share>)>,
    strategy: ShardingStrategy,
    sharing: Sharing<'a>,
    world: usize,
}

impl<'a> Prediction<'a> {
    /// The prediction of `plan` for `world` ranks shared as `sharing`, with `data` per process.
    pub(crate) fn new(
        plan: &MemoryPlan,
        world: usize,
        sharing: Sharing<'a>,
        d: &ProcessData,
    ) -> Result<Prediction<'a>, CliError> {
        let m = plan
            .per_rank
            .first()
            .ok_or_else(|| fail("the memory plan has no rank"))?;
        let per_rank = m.total().ok_or_else(|| overflow("one rank's memory"))?;
        let (ranks, who) = sharing.ranks(world);
        // Thread mode: one process holds every rank; under a launcher one process per rank.
        let data = match sharing {
            Sharing::Threads => d.bytes(ranks),
            Sharing::Launched | Sharing::Host(_) => {
                d.bytes(1).and_then(|b| b.checked_mul(ranks as u64))
            }
        }
        .ok_or_else(|| overflow("the data"))?;
        let total = per_rank
            .checked_mul(ranks as u64)
            .and_then(|b| b.checked_add(data))
            .ok_or_else(|| overflow("all ranks"))?;
        Ok(Prediction {
            ranks,
            who,
            allocator: m.peak_reserved,
            optimizer: m.optimizer_state,
            activations: m.activations,
            per_rank,
            data,
            data_has_tensors: d.checkpoint > 0 || d.save_per_rank > 0,
            total,
            shares: None,
            strategy: plan.strategy,
            sharing,
            world,
        })
    }

    /// Under [`Sharing::Host`]: the host's total from every rank's `shares` (this rank's
    /// own figure is `self.total` until now).
    fn add_up(&mut self, host: &HostGroup, shares: Vec<Share>, total: u64) {
        self.ranks = shares.len();
        self.who = host.who();
        self.shares = Some((self.total, shares));
        self.total = total;
    }

    /// `predicted X (N bytes) for <who> (each rank ...; plus ... of data)`.
    fn describe(&self) -> String {
        let each = match &self.shares {
            Some((_, shares)) => format!("{}; this rank", list_shares(shares)),
            None => "each rank".to_string(),
        };
        let mut s = format!(
            "predicted {} for {} ({each} {}: allocator peak {} + optimizer state {} + \
             activations {}",
            both(self.total),
            self.who,
            human_bytes(self.per_rank),
            human_bytes(self.allocator),
            human_bytes(self.optimizer),
            human_bytes(self.activations)
        );
        if self.data > 0 {
            s += &format!(
                "; plus {} of data (the token corpus{})",
                human_bytes(self.data),
                if self.data_has_tensors {
                    ", full tensors of --init-from, --resume or --save"
                } else {
                    ""
                }
            );
        }
        s.push(')');
        s
    }

    /// Whether the prediction fits in `available`.
    pub(crate) fn fits(&self, available: &AvailableMemory) -> bool {
        self.total <= available.bytes
    }

    /// The error line of a prediction above `available`, with a hint.
    fn refusal(&self, available: &AvailableMemory) -> CliError {
        self.sharing.refuse(format!(
            "not enough memory: {}, available {}; hint: {}",
            self.describe(),
            avail(available),
            self.hint()
        ))
    }

    /// What would lower the prediction.
    fn hint(&self) -> String {
        let mut h = Vec::new();
        if self.strategy != ShardingStrategy::FullShard {
            h.push("a sharded strategy (--strategy full-shard)".to_string());
        }
        // Activations matter when they are a tenth of a rank's memory or more.
        if self.activations > 0 && self.activations >= self.per_rank / 10 {
            h.push("a smaller --batch-size (or a larger --grad-accum)".to_string());
        }
        match self.sharing {
            Sharing::Threads if self.world > 1 => h.push(
                "fewer --ranks in one process (its ranks share its memory) or more ranks as \
                 processes on several hosts"
                    .to_string(),
            ),
            _ => h.push("more ranks, on more hosts".to_string()),
        }
        h.push("a smaller model".to_string());
        h.join(", ")
    }

    /// The capacity of each rank's caching allocator: its share of `available` (after the
    /// processes' data), less its optimizer state and activations. At least the planned
    /// reserved peak when the prediction fits.
    fn capacity(&self, available: u64) -> usize {
        let share = match &self.shares {
            // In proportion to this rank's part of the host's total, less its process's data.
            Some((own, _)) => {
                let part = u128::from(available) * u128::from(*own) / u128::from(self.total.max(1));
                u64::try_from(part)
                    .unwrap_or(u64::MAX)
                    .saturating_sub(self.data)
            }
            None => available.saturating_sub(self.data) / self.ranks.max(1) as u64,
        };
        let cap = share
            .saturating_sub(self.optimizer)
            .saturating_sub(self.activations)
            .max(self.allocator);
        usize::try_from(cap).unwrap_or(usize::MAX)
    }

    /// A line for `fsdp plan`: the prediction, the available memory, and whether it fits.
    pub(crate) fn report(&self, available: Option<&AvailableMemory>) -> String {
        match available {
            Some(a) => format!(
                "memory: {}; available {}: {}",
                self.describe(),
                avail(a),
                if self.fits(a) {
                    "fits".to_string()
                } else {
                    format!("does not fit (hint: {})", self.hint())
                }
            ),
            None => format!(
                "memory: {}; available: unknown on this system (give --memory-limit)",
                self.describe()
            ),
        }
    }
}

/// Bytes of the host structures that describe one transformer block (module tree, unit plan,
/// spans, the engine's parameter table and schedule): a lower bound (a plan measures about
/// 13 KiB per block).
const BLOCK_DESCRIPTION_BYTES: u64 = 4096;

/// The lower bound checked before anything is built: every rank holds at least its shard of
/// every parameter with its f32 gradient and the optimizer's state (`optim`; 16 bytes per
/// element for AdamW), in all ranks sharing the memory, and every process describes every
/// block. `Ok` when it fits (or when the sizes are invalid, which the setup reports).
pub(crate) fn precheck(
    m: &ModelArgs,
    optim: &OptimizerConfig,
    world: usize,
    sharing: Sharing<'_>,
    limit: Option<u64>,
) -> Result<(), CliError> {
    // The parameter (in the dtype of the shards), its state and its f32 gradient.
    let element = crate::optimizer::shard_dtype(optim, m.param_dtype);
    let element = (optim.sharded_bytes_per_param(element) + 4) as u64;
    // (elements of a rank's shard, bytes of a rank, bytes of a process, layers), or `None`
    // when the sizes are invalid.
    let bound = match GptConfig::new(m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size) {
        Ok(cfg) if world > 0 && m.vocab_size <= usize::from(u16::MAX) + 1 => {
            let factor = match m.strategy {
                ShardingStrategy::NoShard => 1,
                ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2 => {
                    m.ranks_per_node.unwrap_or(world).max(1)
                }
                _ => world,
            };
            let shard = (cfg.num_params() as u64).div_ceil(factor as u64);
            let per_rank = shard
                .checked_mul(element)
                .ok_or_else(|| overflow("the parameters"))?;
            let blocks = (cfg.n_layer as u64).saturating_mul(BLOCK_DESCRIPTION_BYTES);
            Some((shard, per_rank, blocks, cfg.n_layer))
        }
        _ => None,
    };
    let (ranks, who) = sharing.ranks(world);
    let own = match bound {
        Some((_, per_rank, blocks, _)) => per_rank
            .checked_mul(ranks as u64)
            .and_then(|b| b.checked_add(blocks))
            .ok_or_else(|| overflow("the parameters"))?,
        None => 0,
    };
    let (total, available, shares, who) = match sharing {
        Sharing::Host(h) => {
            let shares = h.exchange(LOWER_BOUND, own, available(limit))?;
            let (total, available) = h.add_up(&shares)?;
            (total, available, Some(shares), h.who())
        }
        _ => (own, available(limit), None, who),
    };
    let (Some((shard, per_rank, blocks, n_layer)), Some(available)) = (bound, available) else {
        return Ok(());
    };
    if total <= available.bytes {
        return Ok(());
    }
    let each = match &shares {
        Some(s) => format!("{}; this rank", list_shares(s)),
        None => "each rank".to_string(),
    };
    let p = Prediction {
        ranks,
        who,
        allocator: 0,
        optimizer: 0,
        activations: 0,
        per_rank,
        data: blocks,
        data_has_tensors: false,
        total,
        shares: None,
        strategy: m.strategy,
        sharing,
        world,
    };
    Err(sharing.refuse(format!(
        "not enough memory: predicted at least {} for {} ({each} at least {}: {element} bytes \
         for each of the {shard} elements of its shard, the parameter, its gradient and the \
         optimizer state; plus at least {} to describe the {n_layer} blocks), available {}; \
         hint: {}",
        both(total),
        p.who,
        human_bytes(per_rank),
        human_bytes(blocks),
        avail(&available),
        p.hint()
    )))
}

/// Admission of a training run (see the [module](self) documentation): plans `config` for
/// `cfg` and `units` at `world` ranks with micro-batches of `micro` rows (all ranks) in
/// `grad_accum` per step and the optimizer `optim`, and returns the capacity to give each
/// rank's caching allocator.
///
/// # Errors
/// One line when the prediction exceeds the memory available, or overflows; the plan's errors.
#[allow(clippy::too_many_arguments)]
pub(crate) fn admit(
    cfg: &GptConfig,
    config: &FsdpConfig,
    units: &UnitPlan,
    world: usize,
    micro: usize,
    grad_accum: usize,
    optim: &OptimizerConfig,
    sharing: Sharing<'_>,
    data: &ProcessData,
    limit: Option<u64>,
) -> Result<usize, CliError> {
    // The plan with an unbounded allocator: the peak it reaches when nothing limits it.
    let unbounded = FsdpConfig {
        memory_capacity: usize::MAX,
        ..*config
    };
    let plan = fsdp_gpt::plan::plan_with_optimizer(
        cfg,
        world,
        &unbounded,
        units,
        micro / world,
        cfg.block_size,
        grad_accum,
        optim,
    )?;
    let mut p = Prediction::new(&plan, world, sharing, data)?;
    let available = match sharing {
        Sharing::Host(h) => {
            let shares = h.exchange(PLAN, p.total, available(limit))?;
            let (total, available) = h.add_up(&shares)?;
            p.add_up(h, shares, total);
            available
        }
        _ => available(limit),
    };
    match available {
        Some(a) if !p.fits(&a) => Err(p.refusal(&a)),
        Some(a) => Ok(p.capacity(a.bytes)),
        // Unknown: no check; the allocator keeps the larger of its default and the plan's peak.
        None => Ok(config
            .memory_capacity
            .max(usize::try_from(p.allocator).unwrap_or(usize::MAX))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_with_suffixes() {
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("1M"), Ok(1 << 20));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("2gb"), Ok(2 << 30));
        assert_eq!(parse_bytes("3k"), Ok(3 << 10));
        assert_eq!(parse_bytes("7B"), Ok(7));
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("M").is_err());
        assert!(parse_bytes("1.5G").is_err());
        assert!(parse_bytes("2X").is_err());
        assert!(parse_bytes("-1").is_err());
        assert!(parse_bytes("16384P").unwrap_err().contains("overflows"));
    }
}
