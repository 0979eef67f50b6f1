//! How the ranks ended: each rank's outcome and the launch's report.

use std::fmt;
use std::time::Duration;

/// How a rank's process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RankOutcome {
    /// It exited with this status (0 is success).
    Exited(i32),
    /// It was killed by this signal (not sent by the launcher).
    Signaled(i32),
    /// The launcher killed it because another rank failed or the job ran past
    /// [`max_duration`](super::LaunchOptions::max_duration).
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
    /// Whether the rank said (in its error file, [`ERROR_FILE_ENV`](super::ERROR_FILE_ENV)) that it failed because a
    /// peer left: its failure is *secondary*, a consequence of another rank's.
    pub peer_left: bool,
}

/// The outcome of [`run`](super::run).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchReport {
    /// Every rank of this node, by local rank.
    pub ranks: Vec<RankExit>,
    /// Index (local rank) in [`ranks`](Self::ranks) of the rank whose failure was *primary*, if
    /// one failed: the first to fail by time among the ranks that did not fail because a peer
    /// left (see the [module documentation](super)); if every failed rank blames a peer, the
    /// first of them.
    pub first_failed: Option<usize>,
    /// Whether the job was stopped because it ran past
    /// [`max_duration`](super::LaunchOptions::max_duration).
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
    /// job ran past its [`max_duration`](super::LaunchOptions::max_duration).
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
