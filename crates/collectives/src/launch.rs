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
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
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

/// The variable that names a rank's error file: a rank that fails may write there one line of
/// JSON, `{"rank":N,"peer_left":true|false,"message":"..."}` (see [`write_error_file`]); the
/// launcher reads `peer_left` to tell a primary failure from one caused by a peer leaving.
pub const ERROR_FILE_ENV: &str = "FSDP_ERROR_FILE";

/// Whether an error message (of this crate's errors, possibly wrapped) says that the rank failed
/// because a peer left: a departed peer, a communicator aborted by another rank's failure, the
/// store's connection closed or reset by rank 0's exit.
pub fn message_blames_a_peer(message: &str) -> bool {
    const PHRASES: [&str; 7] = [
        "has left the group",
        "communicator aborted",
        "closed by the other side",
        "closed in mid-message",
        "Connection reset",
        "Broken pipe",
        "the server is stopping",
    ];
    PHRASES.iter().any(|p| message.contains(p))
}

/// Writes this rank's error file if the launcher asked for one ([`ERROR_FILE_ENV`]): its rank,
/// whether `message` blames a peer ([`message_blames_a_peer`]), and the message. Errors of the
/// write are ignored (the launcher then goes by time alone).
pub fn write_error_file(message: &str) {
    let Some(path) = std::env::var_os(ERROR_FILE_ENV) else {
        return;
    };
    let rank = std::env::var("RANK").unwrap_or_default();
    let rank: i64 = rank.trim().parse().unwrap_or(-1);
    let line = serde_json::json!({
        "rank": rank,
        "peer_left": message_blames_a_peer(message),
        "message": message,
    })
    .to_string()
        + "\n";
    let _ = std::fs::write(path, line);
}

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

/// How a rank's process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RankOutcome {
    /// It exited with this status (0 is success).
    Exited(i32),
    /// It was killed by this signal (not sent by the launcher).
    Signaled(i32),
    /// The launcher killed it because another rank failed or the job ran past
    /// [`max_duration`](LaunchOptions::max_duration).
    Stopped,
}

impl RankOutcome {
    /// Whether the rank succeeded (exited with status 0).
    pub fn success(self) -> bool {
        self == RankOutcome::Exited(0)
    }

    /// The exit status a shell would report for it: the exit code, 128 + the signal, or 137
    /// (`SIGKILL`) when the launcher stopped it.
    pub fn exit_code(self) -> i32 {
        match self {
            RankOutcome::Exited(c) => c,
            RankOutcome::Signaled(s) => 128 + s,
            RankOutcome::Stopped => 128 + 9,
        }
    }
}

impl fmt::Display for RankOutcome {
    /// `exited with status 1`, `killed by signal 9, status 137`, `stopped by the launcher`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankOutcome::Exited(c) => write!(f, "exited with status {c}"),
            RankOutcome::Signaled(s) => write!(f, "killed by signal {s}, status {}", 128 + s),
            RankOutcome::Stopped => f.write_str("stopped by the launcher"),
        }
    }
}

/// How one rank ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RankExit {
    /// Its global rank (`RANK`).
    pub rank: usize,
    /// Its rank on this node (`LOCAL_RANK`).
    pub local_rank: usize,
    /// How it ended.
    pub outcome: RankOutcome,
    /// How long after the launch it ended.
    pub elapsed: Duration,
    /// Whether the rank said (in its error file, [`ERROR_FILE_ENV`]) that it failed because a
    /// peer left: its failure is *secondary*, a consequence of another rank's.
    pub peer_left: bool,
}

/// The outcome of [`run`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchReport {
    /// Every rank of this node, by local rank.
    pub ranks: Vec<RankExit>,
    /// Index (local rank) in [`ranks`](Self::ranks) of the rank whose failure was *primary*, if
    /// one failed: the first to fail by time among the ranks that did not fail because a peer
    /// left (see the [module documentation](self)); if every failed rank blames a peer, the
    /// first of them.
    pub first_failed: Option<usize>,
    /// Whether the job was stopped because it ran past
    /// [`max_duration`](LaunchOptions::max_duration).
    pub timed_out: bool,
    /// The `MASTER_PORT` the children got (the chosen one when the options said 0).
    pub master_port: u16,
}

impl LaunchReport {
    /// Whether every rank succeeded.
    pub fn success(&self) -> bool {
        !self.timed_out && self.ranks.iter().all(|r| r.outcome.success())
    }

    /// The rank (global) whose failure was primary and how it ended, if one failed.
    pub fn first_failure(&self) -> Option<(usize, RankOutcome)> {
        self.first_failed
            .map(|i| (self.ranks[i].rank, self.ranks[i].outcome))
    }

    /// The ranks (global) that failed on their own, other than the primary one: mostly ranks
    /// that failed because a peer left.
    pub fn secondary_failures(&self) -> Vec<usize> {
        self.ranks
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                Some(*i) != self.first_failed
                    && !r.outcome.success()
                    && r.outcome != RankOutcome::Stopped
            })
            .map(|(_, r)| r.rank)
            .collect()
    }

    /// The status the launcher should exit with: 0 when every rank succeeded, else that of the
    /// rank that failed first (its exit code, or 128 + the signal); 124 (like `timeout`) when the
    /// job ran past its [`max_duration`](LaunchOptions::max_duration).
    pub fn exit_code(&self) -> i32 {
        if let Some((_, outcome)) = self.first_failure() {
            return outcome.exit_code();
        }
        if self.timed_out {
            return 124;
        }
        0
    }
}

impl fmt::Display for LaunchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((rank, outcome)) = self.first_failure() {
            write!(f, "rank {rank} failed ({outcome})")?;
            let secondary = self.secondary_failures();
            if !secondary.is_empty() {
                write!(f, "; ranks {secondary:?} failed after it (secondary)")?;
            }
            let stopped: Vec<usize> = self
                .ranks
                .iter()
                .filter(|r| r.outcome == RankOutcome::Stopped)
                .map(|r| r.rank)
                .collect();
            if !stopped.is_empty() {
                write!(f, "; ranks {stopped:?} were stopped")?;
            }
            Ok(())
        } else if self.timed_out {
            write!(f, "the job ran past its time limit; every rank was stopped")
        } else {
            write!(f, "all {} ranks succeeded", self.ranks.len())
        }
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

type Sink = Arc<Mutex<Box<dyn Write + Send>>>;

struct Proc {
    rank: usize,
    local_rank: usize,
    child: Child,
    outcome: Option<(RankOutcome, Duration)>,
    /// Its error file says it failed because a peer left.
    peer_left: bool,
}

/// The index of the rank whose failure was primary: the earliest failure (by the time the
/// launcher saw it, then by rank) among the ranks that do not blame a peer; if all of them do,
/// the earliest of those. Ranks the launcher stopped are not failures.
fn primary_failure(procs: &[Proc]) -> Option<usize> {
    let failed = |p: &Proc| {
        p.outcome
            .is_some_and(|(o, _)| !o.success() && o != RankOutcome::Stopped)
    };
    let earliest = |secondary: bool| {
        procs
            .iter()
            .enumerate()
            .filter(|(_, p)| failed(p) && p.peer_left == secondary)
            .min_by_key(|(_, p)| (p.outcome.map(|o| o.1), p.rank))
            .map(|(i, _)| i)
    };
    earliest(false).or_else(|| earliest(true))
}

/// The error files of the ranks ([`ERROR_FILE_ENV`]): a directory of this launch, removed at
/// the end.
struct ErrorFiles {
    dir: Option<std::path::PathBuf>,
}

impl ErrorFiles {
    fn create() -> ErrorFiles {
        let dir = std::env::temp_dir().join(format!(
            "fsdp-launch-{}-{}",
            std::process::id(),
            crate::auth::generate_job_id()
        ));
        match std::fs::create_dir_all(&dir) {
            Ok(()) => ErrorFiles { dir: Some(dir) },
            Err(e) => {
                tracing::warn!(error = %e, "no error files: ranks' failures are told apart by time only");
                ErrorFiles { dir: None }
            }
        }
    }

    fn path(&self, rank: usize) -> Option<std::path::PathBuf> {
        self.dir
            .as_ref()
            .map(|d| d.join(format!("rank-{rank}.json")))
    }

    fn says_peer_left(&self, rank: usize) -> bool {
        self.path(rank)
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
            .is_some_and(|v| v["peer_left"] == serde_json::Value::Bool(true))
    }
}

impl Drop for ErrorFiles {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The running children and their output forwarders; stops the children on drop.
struct Job {
    procs: Vec<Proc>,
    forwarders: Vec<JoinHandle<()>>,
    forwarders_done: Arc<AtomicUsize>,
}

impl Job {
    fn forward<R: Read + Send + 'static>(&mut self, pipe: R, rank: usize, sink: &Sink) {
        let sink = Arc::clone(sink);
        let done = Arc::clone(&self.forwarders_done);
        let spawned = std::thread::Builder::new()
            .name(format!("launch-output-{rank}"))
            .spawn(move || {
                forward_lines(pipe, rank, &sink);
                done.fetch_add(1, Ordering::SeqCst);
            });
        match spawned {
            Ok(h) => self.forwarders.push(h),
            // The pipe is dropped with the closure: the child gets EPIPE if it writes.
            Err(e) => tracing::warn!(rank, error = %e, "cannot start an output forwarder"),
        }
    }

    /// Kills every child still running and reaps it (boundedly).
    fn stop_all(&mut self, start: Instant) {
        // One that ended on its own since the last look keeps its real status (a `kill -9`
        // from outside included).
        for p in self.procs.iter_mut().filter(|p| p.outcome.is_none()) {
            if let Ok(Some(status)) = p.child.try_wait() {
                p.outcome = Some((outcome_of(status), start.elapsed()));
            }
        }
        for p in self.procs.iter_mut().filter(|p| p.outcome.is_none()) {
            let _ = p.child.kill();
        }
        let deadline = Instant::now() + REAP_GRACE;
        for p in self.procs.iter_mut().filter(|p| p.outcome.is_none()) {
            loop {
                match p.child.try_wait() {
                    Ok(Some(status)) => {
                        // One that ended on its own before the kill keeps its real status.
                        let outcome = match outcome_of(status) {
                            RankOutcome::Signaled(9) => RankOutcome::Stopped,
                            o => o,
                        };
                        p.outcome = Some((outcome, start.elapsed()));
                        break;
                    }
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
                    _ => {
                        tracing::warn!(rank = p.rank, "a killed child could not be reaped");
                        p.outcome = Some((RankOutcome::Stopped, start.elapsed()));
                        break;
                    }
                }
            }
        }
    }

    /// Waits (boundedly) for the forwarders to drain the children's output.
    fn finish_output(&mut self, err: &Sink) {
        let total = self.forwarders.len();
        let deadline = Instant::now() + OUTPUT_GRACE;
        while self.forwarders_done.load(Ordering::SeqCst) < total && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        let open = total - self.forwarders_done.load(Ordering::SeqCst).min(total);
        if open > 0 {
            launcher_message(
                err,
                &format!(
                    "{open} output stream(s) are still open after the ranks ended (processes \
                     they started are still running?); no longer waiting for them"
                ),
            );
        }
        for h in std::mem::take(&mut self.forwarders) {
            if h.is_finished() {
                let _ = h.join();
            }
            // Unfinished forwarders are detached; they end when the pipe closes.
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let start = Instant::now();
        self.stop_all(start);
    }
}

/// Copies `pipe` to `sink` line by line with the rank's prefix.
fn forward_lines<R: Read>(pipe: R, rank: usize, sink: &Sink) {
    let prefix = format!("[rank {rank}] ");
    let mut reader = BufReader::new(pipe);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) => {
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                let mut w = sink.lock().unwrap_or_else(|e| e.into_inner());
                // A closed or failing sink must not stall the child: keep draining.
                let _ = w
                    .write_all(prefix.as_bytes())
                    .and_then(|()| w.write_all(&line))
                    .and_then(|()| w.flush());
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

fn launcher_message(sink: &Sink, msg: &str) {
    tracing::info!("{msg}");
    let mut w = sink.lock().unwrap_or_else(|e| e.into_inner());
    let _ = writeln!(w, "[launcher] {msg}").and_then(|()| w.flush());
}

/// Makes the child started by `cmd` die with this process (Linux; elsewhere nothing): the
/// child asks for `SIGKILL` on its parent's death, then checks that its parent is still this
/// process — if the launcher died before the request took effect, the child was re-parented
/// already and no signal will come, so it exits before executing the program.
#[cfg(target_os = "linux")]
fn die_with_launcher(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let launcher = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-safe
    // calls are allowed: `prctl` and `getppid` are system calls, and building an `io::Error`
    // from an error number does not allocate. It touches no memory shared with the parent.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                // The launcher is gone: do not start an orphan rank.
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_launcher(_cmd: &mut Command) {}

fn outcome_of(status: ExitStatus) -> RankOutcome {
    if let Some(code) = status.code() {
        return RankOutcome::Exited(code);
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return RankOutcome::Signaled(sig);
        }
    }
    RankOutcome::Stopped
}

fn spawn_error(program: &OsString, e: &io::Error) -> String {
    let shown = program.to_string_lossy();
    let searched = !shown.contains('/');
    match e.kind() {
        io::ErrorKind::NotFound if searched => {
            format!("cannot start program {shown:?}: not found in PATH")
        }
        io::ErrorKind::NotFound => format!("cannot start program {shown:?}: not found"),
        io::ErrorKind::PermissionDenied => {
            format!("cannot start program {shown:?}: permission denied (not executable?)")
        }
        _ => format!("cannot start program {shown:?}: {e}"),
    }
}

/// A port that is free on `addr` right now (the operating system's choice).
fn free_port(addr: &str) -> io::Result<u16> {
    Ok(TcpListener::bind((addr, 0))?.local_addr()?.port())
}
