//! Building a communicator from the launcher's environment (`torch.distributed.init_process_group`
//! with `init_method="env://"`).
//!
//! A launcher (`fsdp launch`, `torchrun`, or a job scheduler) starts one process per rank and sets
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`.
//! [`init_from_env`] reads them, meets the other ranks at the rendezvous [`TcpStore`] (rank 0
//! hosts it at `MASTER_ADDR:MASTER_PORT`), waits until every rank has arrived — a rank that never
//! does is named in a [`MissingRanks`](CollectiveError::MissingRanks) error within the timeout —
//! and builds the requested [`Backend`]. Under `mpirun` the MPI backend needs none of these
//! variables: MPI knows the ranks.
//!
//! ```no_run
//! use fsdp_collectives::{init_from_env, Backend, Communicator, InitOptions};
//!
//! // Run under `fsdp launch --nproc-per-node 2 -- <this program>`.
//! let comm = init_from_env(Backend::Tcp, &InitOptions::default()).unwrap();
//! println!("rank {} of {}", comm.rank(), comm.world_size());
//! ```

use std::fmt;
use std::net::ToSocketAddrs;
use std::str::FromStr;
use std::time::Duration;

use fsdp_device::DEFAULT_TIMEOUT;

use crate::auth::{self, JobToken};
use crate::store::{StoreOptions, StoreProtocol, TcpStore};
use crate::{tcp, torchelastic, CollectiveError, Communicator, Result};

/// The backends that [`init_from_env`] can build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// The [`tcp`](crate::tcp) backend: host buffers, ranks are processes (what Gloo is to
    /// PyTorch).
    Tcp,
    /// The `nccl` backend: CUDA buffers, one GPU per rank (`LOCAL_RANK` picks the device).
    /// Needs the cargo feature `nccl`.
    Nccl,
    /// The `mpi` backend: host buffers, ranks started by `mpirun`. Needs the cargo feature `mpi`.
    Mpi,
}

impl Backend {
    /// The backend's name as accepted by [`FromStr`]: `tcp`, `nccl` or `mpi`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Tcp => "tcp",
            Backend::Nccl => "nccl",
            Backend::Mpi => "mpi",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Backend {
    type Err = String;

    /// `tcp` (alias `gloo`), `nccl` or `mpi`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "tcp" | "gloo" => Ok(Backend::Tcp),
            "nccl" => Ok(Backend::Nccl),
            "mpi" => Ok(Backend::Mpi),
            _ => Err(format!("unknown backend {s:?} (expected tcp, nccl or mpi)")),
        }
    }
}

/// Options of [`init_from_env`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct InitOptions {
    /// Bound of every wait of the communicator built (its collectives). Default:
    /// [`DEFAULT_TIMEOUT`].
    pub timeout: Duration,
    /// Bound of the rendezvous (connecting to the store, waiting for every rank, the store's
    /// operations) and of the communicator's set-up (connecting to its peers). Default: `None`,
    /// [`timeout`](Self::timeout).
    pub init_timeout: Option<Duration>,
    /// The GPU of the NCCL backend's communicator. Default: `None`, the launcher's
    /// `LOCAL_RANK` (torchrun's convention).
    pub cuda_device: Option<usize>,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            timeout: DEFAULT_TIMEOUT,
            init_timeout: None,
            cuda_device: None,
        }
    }
}

impl InitOptions {
    /// These options with another timeout (of collectives; also of the rendezvous unless
    /// [`with_init_timeout`](Self::with_init_timeout) says otherwise).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These options with another bound of the rendezvous and the communicator's set-up.
    pub fn with_init_timeout(mut self, timeout: Duration) -> Self {
        self.init_timeout = Some(timeout);
        self
    }

    /// These options with the NCCL backend's communicator on GPU `ordinal` (e.g. a program's
    /// `--device cuda:N`) rather than the one of the launcher's `LOCAL_RANK`.
    pub fn with_cuda_device(mut self, ordinal: usize) -> Self {
        self.cuda_device = Some(ordinal);
        self
    }

    /// The bound of the rendezvous and set-up: [`init_timeout`](Self::init_timeout), else
    /// [`timeout`](Self::timeout).
    pub fn effective_init_timeout(&self) -> Duration {
        self.init_timeout.unwrap_or(self.timeout)
    }

    /// The options of the environment: `FSDP_TIMEOUT` and `FSDP_INIT_TIMEOUT` (seconds, as
    /// `fsdp launch --timeout/--init-timeout` set them) over the defaults.
    pub fn from_env() -> Result<InitOptions> {
        let mut o = InitOptions::default();
        if let Some(t) = seconds_from_env(TIMEOUT_ENV)? {
            o.timeout = t;
        }
        if let Some(t) = seconds_from_env(INIT_TIMEOUT_ENV)? {
            o.init_timeout = Some(t);
        }
        Ok(o)
    }
}

/// The variable that gives the collectives' timeout in seconds (`fsdp launch --timeout`).
pub const TIMEOUT_ENV: &str = "FSDP_TIMEOUT";
/// The variable that gives the rendezvous' and set-up's timeout in seconds
/// (`fsdp launch --init-timeout`).
pub const INIT_TIMEOUT_ENV: &str = "FSDP_INIT_TIMEOUT";

/// Parses a positive number of seconds (`"2.5"`): the message names what is wrong.
pub fn parse_seconds(s: &str) -> std::result::Result<Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1e9 => Ok(Duration::from_secs_f64(v)),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

fn seconds_from_env(name: &str) -> Result<Option<Duration>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => parse_seconds(&v)
            .map(Some)
            .map_err(|e| CollectiveError::InvalidArgument {
                rank: 0,
                op: "init_from_env",
                reason: format!("{name}: {e}"),
            }),
    }
}

/// What a launcher tells a rank, read from `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` (and, under torchrun,
/// `TORCHELASTIC_USE_AGENT_STORE` and `TORCHELASTIC_RESTART_COUNT`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchEnv {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank on this machine (`LOCAL_RANK`; default: `rank`).
    pub local_rank: usize,
    /// Ranks on this machine (`LOCAL_WORLD_SIZE`; default: `world_size`).
    pub local_world_size: usize,
    /// Host of the rendezvous store (`MASTER_ADDR`; default `127.0.0.1`).
    pub master_addr: String,
    /// Port of the rendezvous store (`MASTER_PORT`; default 29500).
    pub master_port: u16,
    /// The job's secret (`FSDP_JOB_TOKEN`, else the file named by `FSDP_JOB_TOKEN_FILE`).
    pub token: Option<JobToken>,
    /// The job's id (`FSDP_JOB_ID`, set by `fsdp launch`).
    pub job_id: Option<String>,
    /// Whether torchrun's agent hosts the store (`TORCHELASTIC_USE_AGENT_STORE=True`): then
    /// every rank joins it as a PyTorch client (see [`crate::torchelastic`]).
    pub use_agent_store: bool,
    /// torchrun's attempt (`TORCHELASTIC_RESTART_COUNT`; default 0).
    pub restart_count: usize,
}

impl LaunchEnv {
    /// Read the process's environment. `Ok(None)` when neither `RANK` nor `WORLD_SIZE` is set
    /// (not started by a launcher); an error names the variable that is missing or malformed.
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        LaunchEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// Read the variables through `lookup` (for tests, or another source than the environment).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let rank_s = lookup("RANK");
        let world_s = lookup("WORLD_SIZE");
        if rank_s.is_none() && world_s.is_none() {
            return Ok(None);
        }
        // The rank for error messages: the parsed RANK when it parses.
        let guess = rank_s
            .as_deref()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        let bad = |reason: String| CollectiveError::InvalidArgument {
            rank: guess,
            op: "init_from_env",
            reason,
        };
        let num = |name: &str, v: Option<String>| -> Result<Option<usize>> {
            match v {
                None => Ok(None),
                Some(s) => s
                    .trim()
                    .parse::<usize>()
                    .map(Some)
                    .map_err(|_| bad(format!("{name}={s:?} is not a non-negative integer"))),
            }
        };
        let rank =
            num("RANK", rank_s)?.ok_or_else(|| bad("WORLD_SIZE is set but RANK is not".into()))?;
        let world_size = num("WORLD_SIZE", world_s)?
            .ok_or_else(|| bad("RANK is set but WORLD_SIZE is not".into()))?;
        if world_size == 0 {
            return Err(bad("WORLD_SIZE=0: a group needs at least one rank".into()));
        }
        if rank >= world_size {
            return Err(bad(format!(
                "RANK={rank} is not below WORLD_SIZE={world_size}"
            )));
        }
        let local_rank = num("LOCAL_RANK", lookup("LOCAL_RANK"))?.unwrap_or(rank);
        let local_world_size =
            num("LOCAL_WORLD_SIZE", lookup("LOCAL_WORLD_SIZE"))?.unwrap_or(world_size);
        if local_rank >= local_world_size {
            return Err(bad(format!(
                "LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}"
            )));
        }
        let master_addr = lookup("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        if master_addr.trim().is_empty() {
            return Err(bad("MASTER_ADDR is empty".into()));
        }
        let master_port = match lookup("MASTER_PORT") {
            None => 29500,
            Some(s) => match s.trim().parse::<u16>() {
                Ok(p) if p != 0 => p,
                _ => {
                    return Err(bad(format!(
                        "MASTER_PORT={s:?} is not a port number (1-65535)"
                    )))
                }
            },
        };
        let token = match (lookup(auth::TOKEN_ENV), lookup(auth::TOKEN_FILE_ENV)) {
            (Some(t), _) => {
                Some(JobToken::new(t).map_err(|e| bad(format!("{}: {e}", auth::TOKEN_ENV)))?)
            }
            (None, Some(path)) => {
                let bytes = std::fs::read(&path).map_err(|e| {
                    bad(format!(
                        "{}={path}: cannot read it: {e}",
                        auth::TOKEN_FILE_ENV
                    ))
                })?;
                Some(
                    JobToken::new(bytes)
                        .map_err(|e| bad(format!("{}={path}: {e}", auth::TOKEN_FILE_ENV)))?,
                )
            }
            (None, None) => None,
        };
        let job_id = lookup(auth::JOB_ID_ENV).filter(|j| !j.trim().is_empty());
        let use_agent_store =
            lookup(torchelastic::USE_AGENT_STORE_ENV).is_some_and(|v| torchelastic::says_true(&v));
        let restart_count = num(
            torchelastic::RESTART_COUNT_ENV,
            lookup(torchelastic::RESTART_COUNT_ENV),
        )?
        .unwrap_or(0);
        Ok(Some(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            token,
            job_id,
            use_agent_store,
            restart_count,
        }))
    }

    /// Connect to the rendezvous store (rank 0 hosts it; under torchrun with
    /// [`use_agent_store`](Self::use_agent_store) every rank joins the agent's store under the
    /// attempt's prefix) and wait until every rank has connected; the ranks that do not arrive
    /// within `timeout` are named in the error.
    pub fn rendezvous(&self, timeout: Duration) -> Result<TcpStore> {
        let store = if self.use_agent_store {
            self.join_agent_store(timeout)?
        } else {
            self.open_store(timeout)?
        };
        store
            .barrier("init_from_env", timeout)
            .map_err(|e| self.name_missing_nodes(e))?;
        Ok(store)
    }

    /// torchrun's agent store, as a PyTorch client. Without a job token the data links are
    /// unauthenticated: only a loopback `MASTER_ADDR` is accepted then.
    fn join_agent_store(&self, timeout: Duration) -> Result<TcpStore> {
        if self.token.is_none() {
            let open = (self.master_addr.as_str(), self.master_port)
                .to_socket_addrs()
                .map(|mut a| a.find(|a| !a.ip().is_loopback()))
                .unwrap_or(None);
            if let Some(open) = open {
                return Err(CollectiveError::InvalidArgument {
                    rank: self.rank,
                    op: "init_from_env",
                    reason: format!(
                        "under torchrun's agent store, MASTER_ADDR={} ({open}) is not a loopback \
                         address and there is no job token: the links between ranks would be \
                         unauthenticated; set FSDP_JOB_TOKEN (or FSDP_JOB_TOKEN_FILE) in \
                         torchrun's environment",
                        self.master_addr
                    ),
                });
            }
        }
        let opts = StoreOptions::new(
            self.master_addr.clone(),
            self.master_port,
            self.rank,
            self.world_size,
        )
        .with_server(false)
        .with_protocol(StoreProtocol::Torch)
        .with_key_prefix(torchelastic::attempt_key_prefix(self.restart_count))
        .with_timeout(timeout)
        .with_token(self.token.clone())
        .with_job_id(self.job_id.clone());
        TcpStore::new(opts)
    }

    fn open_store(&self, timeout: Duration) -> Result<TcpStore> {
        let opts = StoreOptions::new(
            self.master_addr.clone(),
            self.master_port,
            self.rank,
            self.world_size,
        )
        .with_timeout(timeout)
        .with_token(self.token.clone())
        .with_job_id(self.job_id.clone());
        TcpStore::new(opts)
    }

    /// Add the nodes of the missing ranks to a [`MissingRanks`](CollectiveError::MissingRanks)
    /// error when the job spans several nodes (`LOCAL_WORLD_SIZE` ranks each, in rank order, as
    /// torchrun and `fsdp launch` number them): "node 1 (ranks [2, 3]) never arrived".
    fn name_missing_nodes(&self, e: CollectiveError) -> CollectiveError {
        let per_node = self.local_world_size;
        match e {
            CollectiveError::MissingRanks {
                rank,
                missing,
                waited,
                what,
            } if per_node > 0 && per_node < self.world_size && !missing.is_empty() => {
                let nodes = self.world_size.div_ceil(per_node);
                let mut by_node: Vec<String> = Vec::new();
                for node in 0..nodes {
                    let ranks: Vec<usize> = missing
                        .iter()
                        .copied()
                        .filter(|r| r / per_node == node)
                        .collect();
                    if ranks.is_empty() {
                        continue;
                    }
                    let whole = ranks.len() == per_node.min(self.world_size - node * per_node);
                    by_node.push(format!(
                        "node {node} {} (ranks {ranks:?})",
                        if whole { "never arrived" } else { "in part" }
                    ));
                }
                CollectiveError::MissingRanks {
                    rank,
                    missing,
                    waited,
                    what: format!(
                        "{what}; by node of {per_node} ranks (LOCAL_WORLD_SIZE) out of {nodes}: {}",
                        by_node.join(", ")
                    ),
                }
            }
            other => other,
        }
    }
}

/// Build a communicator of `backend` for this process from the launcher's environment
/// ([`LaunchEnv`]): meet the other ranks at the rendezvous store, wait until every rank has arrived
/// (the missing ranks are named in a [`MissingRanks`](CollectiveError::MissingRanks) error after
/// `opts.timeout`), then connect the backend. For [`Backend::Mpi`] the ranks are MPI's
/// (`mpirun`); for the others `RANK` and `WORLD_SIZE` must be set.
pub fn init_from_env(backend: Backend, opts: &InitOptions) -> Result<Box<dyn Communicator>> {
    if backend == Backend::Mpi {
        return init_mpi(opts);
    }
    let env = LaunchEnv::from_env()?.ok_or_else(|| CollectiveError::InvalidArgument {
        rank: 0,
        op: "init_from_env",
        reason: "RANK and WORLD_SIZE are not set: start the program with a launcher \
                 (`fsdp launch --nproc-per-node N -- ...`, torchrun) or set them"
            .into(),
    })?;
    let store = env.rendezvous(opts.effective_init_timeout())?;
    init_with_store(backend, &store, &env, opts)
}

/// Build a communicator of `backend` over a store this process already met the other ranks
/// at ([`LaunchEnv::rendezvous`]), for a program that uses the store itself before the
/// communicator exists (the `fsdp` program's ranks add up their predicted memory there).
/// [`init_from_env`] is [`LaunchEnv::rendezvous`] followed by this. [`Backend::Mpi`] needs no
/// store: it is an [`InvalidArgument`](CollectiveError::InvalidArgument) error here.
pub fn init_with_store(
    backend: Backend,
    store: &TcpStore,
    env: &LaunchEnv,
    opts: &InitOptions,
) -> Result<Box<dyn Communicator>> {
    match backend {
        Backend::Tcp => {
            let comm = tcp::TcpCommunicator::new(
                store,
                tcp::TcpOptions::default()
                    .with_timeout(opts.timeout)
                    .with_connect_timeout(opts.effective_init_timeout()),
            )?;
            Ok(Box::new(comm))
        }
        Backend::Nccl => init_nccl(store, env, opts),
        Backend::Mpi => Err(CollectiveError::InvalidArgument {
            rank: env.rank,
            op: "init_with_store",
            reason: "the mpi backend meets its ranks through MPI, not a store: use \
                     init_from_env(Backend::Mpi, ..)"
                .into(),
        }),
    }
}

#[cfg(feature = "nccl")]
fn init_nccl(
    store: &TcpStore,
    env: &LaunchEnv,
    opts: &InitOptions,
) -> Result<Box<dyn Communicator>> {
    use crate::nccl::{NcclCommunicator, NcclOptions};
    let comm = NcclCommunicator::new(
        store,
        opts.cuda_device.unwrap_or(env.local_rank),
        NcclOptions::default()
            .with_timeout(opts.timeout)
            .with_init_timeout(opts.effective_init_timeout()),
    )?;
    Ok(Box::new(comm))
}

#[cfg(not(feature = "nccl"))]
fn init_nccl(_: &TcpStore, env: &LaunchEnv, _: &InitOptions) -> Result<Box<dyn Communicator>> {
    Err(CollectiveError::Unavailable {
        rank: env.rank,
        backend: "nccl",
        reason: "this build of fsdp-collectives does not include it (enable the cargo feature \
                 `nccl`)"
            .into(),
    })
}

#[cfg(feature = "mpi")]
fn init_mpi(opts: &InitOptions) -> Result<Box<dyn Communicator>> {
    use crate::mpi::{MpiCommunicator, MpiOptions};
    let comm = MpiCommunicator::world(MpiOptions::default().with_timeout(opts.timeout))?;
    Ok(Box::new(comm))
}

#[cfg(not(feature = "mpi"))]
fn init_mpi(_: &InitOptions) -> Result<Box<dyn Communicator>> {
    Err(CollectiveError::Unavailable {
        rank: 0,
        backend: "mpi",
        reason: "this build of fsdp-collectives does not include it (enable the cargo feature \
                 `mpi`)"
            .into(),
    })
}

#[cfg(test)]
#[path = "env_tests.rs"]
mod tests;
