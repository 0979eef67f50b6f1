//! The process launcher, like `torchrun --nproc-per-node N`: starts the ranks of a job on this
//! node, forwards their output, and stops them all when one fails.
//!
//! [`run`] starts [`nproc_per_node`](LaunchOptions::nproc_per_node) processes of
//! [`program`](LaunchOptions::program) with the environment of the launcher plus the variables
//! that [`TcpStore`](crate::store::TcpStore) rendezvous and `init_from_env` read:
//!
//! | variable | value |
//! |---|---|
//! | `RANK` | `node_rank * nproc_per_node + LOCAL_RANK` |
//! | `WORLD_SIZE` | `nnodes * nproc_per_node` |
//! | `LOCAL_RANK` | `0..nproc_per_node` |
//! | `LOCAL_WORLD_SIZE` | `nproc_per_node` |
//! | `GROUP_RANK`, `GROUP_WORLD_SIZE` | `node_rank` and `nnodes`, as torchrun sets them (a node's identity) |
//! | `MASTER_ADDR`, `MASTER_PORT` | the rendezvous address (rank 0's store) |
//!
//! Each line a child writes to its standard output (error) is written to the launcher's standard
//! output (error) prefixed by `[rank N] `; lines are never interleaved mid-line. Children get no
//! standard input.
//!
//! When a child fails — exits with a non-zero status or is killed by a signal — the launcher
//! kills the others (`SIGKILL`), reaps them, and returns a [`LaunchReport`] naming the rank that
//! failed first and its status; [`LaunchReport::exit_code`] is the status the launcher should exit
//! with (the failing rank's exit code, or 128 + the signal number, like a shell). When every
//! child succeeds, the report says so and the exit code is 0. A program that cannot be started
//! is [`CollectiveError::Launch`], after the ranks already started are stopped.
//!
//! On Linux the children die with the launcher: each gets `SIGKILL` when the launcher ends,
//! however it ends (`kill -9` included), through `prctl(PR_SET_PDEATHSIG, SIGKILL)` set in the
//! child before it executes the program; a child whose launcher died before that was set exits
//! at once instead of starting. So a killed launcher leaves no orphan ranks. (The signal follows
//! the *thread* that started the child, which is the caller of [`run`] and outlives the
//! children: [`run`] returns only after they ended.)
//!
//! Limits: processes that a child started itself (grandchildren) are not killed; if they keep the
//! child's output open, the launcher stops forwarding it about two seconds after the children
//! ended instead of waiting. Children share the launcher's process group, so `Ctrl-C` in a
//! terminal reaches them all.
//!
//! ```
//! # #[cfg(unix)] {
//! use fsdp_collectives::launch::{run_with_output, LaunchOptions, RankOutcome};
//!
//! // Two ranks of `sh`; rank 1 fails with status 3.
//! let opts = LaunchOptions::new(2, "/bin/sh")
//!     .with_args(["-c", "echo hello from $RANK of $WORLD_SIZE; exit $((RANK * 3))"])
//!     .with_master("127.0.0.1", 0);
//! let report = run_with_output(&opts, std::io::sink(), std::io::sink())?;
//! assert_eq!(report.first_failure(), Some((1, RankOutcome::Exited(3))));
//! assert_eq!(report.exit_code(), 3);
//! # }
//! # Ok::<(), fsdp_collectives::CollectiveError>(())
//! ```

use std::ffi::OsString;
use std::io::{self, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{CollectiveError, Result};

/// How often the launcher looks at its children.
const POLL: Duration = Duration::from_millis(20);
/// How long a killed child may take to be reaped.
const REAP_GRACE: Duration = Duration::from_secs(5);
/// How long output is still forwarded after the children ended.
const OUTPUT_GRACE: Duration = Duration::from_secs(2);
/// How long the launcher waits, when every failure so far blames a peer, for the rank that
/// really failed to be seen before it stops the others.
const SETTLE: Duration = Duration::from_millis(1500);

mod errors;
mod job;
mod report;

use errors::{primary_failure, ErrorFiles};
pub use errors::{write_error_file, ERROR_FILE_ENV};
use job::{
    die_with_launcher, free_port, launcher_message, outcome_of, spawn_error, Job, Proc, Sink,
};
pub use report::{LaunchReport, RankExit, RankOutcome};

/// What to launch and how (see the [module documentation](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchOptions {
    /// Processes (ranks) to start on this node (`LOCAL_WORLD_SIZE`); at least 1.
    pub nproc_per_node: usize,
    /// Number of nodes of the job (default 1): `WORLD_SIZE = nnodes * nproc_per_node`.
    pub nnodes: usize,
    /// This node's index in `0..nnodes` (default 0): ranks `node_rank * nproc_per_node ..`.
    pub node_rank: usize,
    /// `MASTER_ADDR`: where rank 0's store listens (default `"127.0.0.1"`).
    pub master_addr: String,
    /// `MASTER_PORT` (default 29500); 0 picks a free port on `master_addr` (single node only).
    pub master_port: u16,
    /// The program to start (looked up in `PATH` when it has no `/`).
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment variables for every child (after the inherited ones, before the
    /// launcher's own).
    pub env: Vec<(OsString, OsString)>,
    /// Bound of the whole job (default: none). When it passes, every child is killed and the
    /// report says [`timed_out`](LaunchReport::timed_out).
    pub max_duration: Option<Duration>,
}

impl LaunchOptions {
    /// `nproc_per_node` processes of `program` on one node, rendezvous at `127.0.0.1:29500`.
    pub fn new(nproc_per_node: usize, program: impl Into<OsString>) -> Self {
        LaunchOptions {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            max_duration: None,
        }
    }

    /// These options with the program's arguments.
    pub fn with_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args = args.into_iter().map(Into::into).collect();
        self
    }

    /// These options with another rendezvous address (`port` 0: a free port).
    pub fn with_master(mut self, addr: impl Into<String>, port: u16) -> Self {
        self.master_addr = addr.into();
        self.master_port = port;
        self
    }

    /// These options for node `node_rank` of `nnodes`.
    pub fn with_nodes(mut self, nnodes: usize, node_rank: usize) -> Self {
        self.nnodes = nnodes;
        self.node_rank = node_rank;
        self
    }

    /// These options with one more environment variable for every child.
    pub fn with_env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// These options with a bound on the whole job.
    pub fn with_max_duration(mut self, max: Duration) -> Self {
        self.max_duration = Some(max);
        self
    }

    fn first_rank(&self) -> usize {
        self.node_rank.saturating_mul(self.nproc_per_node)
    }

    fn validate(&self) -> Result<()> {
        let err = |reason: String| CollectiveError::Launch {
            rank: self.first_rank(),
            reason,
        };
        if self.nproc_per_node == 0 {
            return Err(err("nproc_per_node must be at least 1".into()));
        }
        if self.nnodes == 0 {
            return Err(err("nnodes must be at least 1".into()));
        }
        if self.node_rank >= self.nnodes {
            return Err(err(format!(
                "node_rank {} is out of range for nnodes {}",
                self.node_rank, self.nnodes
            )));
        }
        if self.nnodes.checked_mul(self.nproc_per_node).is_none() {
            return Err(err("nnodes * nproc_per_node overflows".into()));
        }
        if self.program.is_empty() {
            return Err(err("the program is empty".into()));
        }
        if self.master_addr.is_empty() {
            return Err(err("master_addr is empty".into()));
        }
        if self.master_port == 0 && self.nnodes > 1 {
            return Err(err(
                "master_port 0 (a free port) only works on one node: the other nodes could not \
                 know it; give an explicit port"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Launches the job and waits for it, forwarding output to this process's standard output and
/// error. See the [module documentation](self).
pub fn run(opts: &LaunchOptions) -> Result<LaunchReport> {
    run_with_output(opts, io::stdout(), io::stderr())
}

/// [`run`], with the children's prefixed output written to `out` and `err` instead of this
/// process's standard output and error (the launcher's own messages go to `err` too).
pub fn run_with_output<O, E>(opts: &LaunchOptions, out: O, err: E) -> Result<LaunchReport>
where
    O: Write + Send + 'static,
    E: Write + Send + 'static,
{
    opts.validate()?;
    let first_rank = opts.first_rank();
    let world_size = opts.nnodes * opts.nproc_per_node;
    let master_port = match opts.master_port {
        0 => free_port(&opts.master_addr).map_err(|e| CollectiveError::Launch {
            rank: first_rank,
            reason: format!("cannot find a free port on {}: {e}", opts.master_addr),
        })?,
        p => p,
    };
    let out: Sink = Arc::new(Mutex::new(Box::new(out)));
    let err: Sink = Arc::new(Mutex::new(Box::new(err)));
    let errors = ErrorFiles::create();
    // The job's identity: a secret (unless the user gave one) and an id, for every rank.
    let inherited = |k: &str| opts.env.iter().any(|(n, _)| n == k) || std::env::var_os(k).is_some();
    let mut identity: Vec<(&str, String)> = Vec::new();
    // Several nodes must share one token: the user gives it (FSDP_JOB_TOKEN).
    if !inherited(crate::auth::TOKEN_ENV)
        && !inherited(crate::auth::TOKEN_FILE_ENV)
        && opts.nnodes == 1
    {
        identity.push((crate::auth::TOKEN_ENV, crate::auth::generate_token()));
    }
    if !inherited(crate::auth::JOB_ID_ENV) && opts.nnodes == 1 {
        identity.push((crate::auth::JOB_ID_ENV, crate::auth::generate_job_id()));
    }
    let start = Instant::now();

    let mut job = Job {
        procs: Vec::new(),
        forwarders: Vec::new(),
        forwarders_done: Arc::new(AtomicUsize::new(0)),
    };
    for local_rank in 0..opts.nproc_per_node {
        let rank = first_rank + local_rank;
        let mut cmd = Command::new(&opts.program);
        cmd.args(&opts.args)
            .envs(opts.env.iter().map(|(k, v)| (k, v)))
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("LOCAL_WORLD_SIZE", opts.nproc_per_node.to_string())
            .env("GROUP_RANK", opts.node_rank.to_string())
            .env("GROUP_WORLD_SIZE", opts.nnodes.to_string())
            .env("MASTER_ADDR", &opts.master_addr)
            .env("MASTER_PORT", master_port.to_string())
            .envs(identity.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(path) = errors.path(rank) {
            let _ = std::fs::remove_file(&path);
            cmd.env(ERROR_FILE_ENV, path);
        }
        die_with_launcher(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                // `job` kills and reaps the ranks already started when it is dropped.
                return Err(CollectiveError::Launch {
                    rank,
                    reason: spawn_error(&opts.program, &e),
                });
            }
        };
        if let Some(pipe) = child.stdout.take() {
            job.forward(pipe, rank, &out);
        }
        if let Some(pipe) = child.stderr.take() {
            job.forward(pipe, rank, &err);
        }
        job.procs.push(Proc {
            rank,
            local_rank,
            child,
            outcome: None,
            peer_left: false,
        });
    }
    tracing::debug!(
        nproc = opts.nproc_per_node,
        world_size,
        master_port,
        "launched"
    );

    let mut first_seen: Option<Instant> = None;
    let mut timed_out = false;
    loop {
        for p in job.procs.iter_mut().filter(|p| p.outcome.is_none()) {
            match p.child.try_wait() {
                Ok(Some(status)) => {
                    let outcome = outcome_of(status);
                    p.outcome = Some((outcome, start.elapsed()));
                    if !outcome.success() {
                        p.peer_left = errors.says_peer_left(p.rank);
                        first_seen.get_or_insert_with(Instant::now);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    // Cannot happen for a child we own; treat it as lost.
                    tracing::warn!(rank = p.rank, error = %e, "cannot query a child");
                    p.outcome = Some((RankOutcome::Stopped, start.elapsed()));
                    first_seen.get_or_insert_with(Instant::now);
                }
            }
        }
        if job.procs.iter().all(|p| p.outcome.is_some()) {
            break;
        }
        if let Some(seen) = first_seen {
            // Every failure so far blames a peer: give the peer that really failed a moment to
            // be seen with its own status before the others are killed.
            let only_secondary = job
                .procs
                .iter()
                .filter(|p| p.outcome.is_some_and(|(o, _)| !o.success()))
                .all(|p| p.peer_left);
            if !only_secondary || seen.elapsed() >= SETTLE {
                let primary = primary_failure(&job.procs);
                let p = &job.procs[primary.unwrap_or(0)];
                let outcome = p.outcome.map(|o| o.0).unwrap_or(RankOutcome::Stopped);
                let others: Vec<usize> = job
                    .procs
                    .iter()
                    .filter(|q| q.outcome.is_none())
                    .map(|q| q.rank)
                    .collect();
                launcher_message(
                    &err,
                    &format!(
                        "rank {} failed ({outcome}); stopping ranks {others:?}",
                        p.rank
                    ),
                );
                job.stop_all(start);
                break;
            }
        }
        if opts.max_duration.is_some_and(|m| start.elapsed() >= m) {
            launcher_message(
                &err,
                &format!(
                    "the job ran past its limit of {:?}; stopping every rank",
                    opts.max_duration.unwrap_or_default()
                ),
            );
            timed_out = true;
            job.stop_all(start);
            break;
        }
        std::thread::sleep(POLL);
    }
    let first_failed = primary_failure(&job.procs);
    job.finish_output(&err);

    let ranks = job
        .procs
        .iter()
        .map(|p| {
            let (outcome, elapsed) = p.outcome.unwrap_or((RankOutcome::Stopped, start.elapsed()));
            RankExit {
                rank: p.rank,
                local_rank: p.local_rank,
                outcome,
                elapsed,
                peer_left: p.peer_left,
            }
        })
        .collect();
    Ok(LaunchReport {
        ranks,
        first_failed,
        timed_out,
        master_port,
    })
}
