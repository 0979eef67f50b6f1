//! The crate's error type.

use std::time::Duration;

use fsdp_device::DeviceError;

/// Why a collective failed. Every variant names the rank that reports it; errors about peers
/// name the peers too.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// The arguments of a call are wrong on this rank (detected before anything was issued).
    #[error("rank {rank}: invalid argument to {op}: {reason}")]
    InvalidArgument {
        /// The rank that made the call.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The ranks did not issue the same collective with the same arguments (length, element type,
    /// reduce op, root or operation), or a peer issued it with invalid arguments. Reported on
    /// every rank before any data moved; the communicator stays usable.
    #[error("rank {rank}: collective #{seq} does not match across ranks: {details}")]
    Mismatch {
        /// The reporting rank.
        rank: usize,
        /// The sequence number of the collective on this communicator (from 0).
        seq: u64,
        /// Each distinct call and the ranks that made it.
        details: String,
    },
    /// A wait ran past the communicator's timeout.
    #[error("rank {rank}: {op} (collective #{seq}) timed out after {waited:?}: {waiting_for}")]
    Timeout {
        /// The reporting rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// How long the wait lasted.
        waited: Duration,
        /// What did not arrive (e.g. `ranks [2] did not reach this collective`).
        waiting_for: String,
    },
    /// A peer's communicator was dropped (or its thread or process died) while this rank needed it.
    #[error(
        "rank {rank}: {op} (collective #{seq}) failed: rank {peer} has left the group \
         (its communicator was dropped, its thread panicked or its process exited)"
    )]
    PeerDeparted {
        /// The reporting rank.
        rank: usize,
        /// The rank that left.
        peer: usize,
        /// The operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
    },
    /// The communicator was aborted by an earlier failure (a timeout or a departed peer, on this
    /// rank or another) and can no longer be used, like an NCCL communicator after
    /// `ncclCommAbort`.
    #[error("rank {rank}: communicator aborted: {reason}")]
    Aborted {
        /// The reporting rank.
        rank: usize,
        /// The failure that aborted the group.
        reason: String,
    },
    /// The rendezvous could not complete in time: the listed ranks never arrived (never connected
    /// to the store or never published what the others wait for).
    #[error(
        "rank {rank}: rendezvous timed out after {waited:?}: ranks {missing:?} never arrived ({what})"
    )]
    MissingRanks {
        /// The reporting rank.
        rank: usize,
        /// The ranks that did not arrive.
        missing: Vec<usize>,
        /// How long the wait lasted.
        waited: Duration,
        /// What was waited for (e.g. "keys tcp/addr/{r} in the store").
        what: String,
    },
    /// An operation of the rendezvous store failed: the port is taken, the server cannot be
    /// reached, a key did not appear in time, the connection broke.
    #[error("rank {rank}: store {op} failed: {reason}")]
    Store {
        /// The reporting rank.
        rank: usize,
        /// The store operation (`bind`, `connect`, `set`, `get`, `wait`, `add`, ...).
        op: &'static str,
        /// What went wrong, with the address or keys involved.
        reason: String,
    },
    /// The connection to the rendezvous store broke because its server went away: it closed or
    /// reset the connection, stopped while this rank waited, or no longer accepts connections
    /// (rank 0's store was dropped or its process ended). A rank that fails with it failed
    /// because a peer left ([`caused_by_peer`](CollectiveError::caused_by_peer)).
    #[error("rank {rank}: store {op} failed: {reason}")]
    StoreLost {
        /// The reporting rank.
        rank: usize,
        /// The store operation.
        op: &'static str,
        /// What happened, with the server's address.
        reason: String,
    },
    /// The backend's library reported an error (NCCL's or MPI's error string is kept).
    #[error("rank {rank}: {backend} error in {op}: {reason}")]
    Backend {
        /// The reporting rank.
        rank: usize,
        /// The backend (`"nccl"`, `"mpi"`, `"tcp"`).
        backend: &'static str,
        /// The operation that failed.
        op: &'static str,
        /// The library's own description of the error.
        reason: String,
    },
    /// The requested backend cannot be used here: its library is not installed or could not be
    /// loaded, no device is present, or this build does not include it (cargo feature off).
    #[error("rank {rank}: backend {backend} is not available: {reason}")]
    Unavailable {
        /// The reporting rank.
        rank: usize,
        /// The backend.
        backend: &'static str,
        /// Why, and what to do about it.
        reason: String,
    },
    /// The launcher could not start or supervise the processes of a job: invalid options, a
    /// program that cannot be started (not found, not executable), output that cannot be
    /// forwarded. A child that *fails* is not this error but a report
    /// ([`LaunchReport`](crate::launch::LaunchReport)).
    #[error("rank {rank}: launch failed: {reason}")]
    Launch {
        /// The rank whose process it concerns (the node's first rank for errors about the
        /// whole launch).
        rank: usize,
        /// What went wrong.
        reason: String,
    },
    /// A stream or buffer error.
    #[error("rank {rank}: {source}")]
    Device {
        /// The reporting rank.
        rank: usize,
        /// The underlying error.
        #[source]
        source: DeviceError,
    },
}

impl CollectiveError {
    /// The rank that reported the error.
    pub fn rank(&self) -> usize {
        match self {
            CollectiveError::InvalidArgument { rank, .. }
            | CollectiveError::Mismatch { rank, .. }
            | CollectiveError::Timeout { rank, .. }
            | CollectiveError::PeerDeparted { rank, .. }
            | CollectiveError::Aborted { rank, .. }
            | CollectiveError::MissingRanks { rank, .. }
            | CollectiveError::Store { rank, .. }
            | CollectiveError::StoreLost { rank, .. }
            | CollectiveError::Backend { rank, .. }
            | CollectiveError::Unavailable { rank, .. }
            | CollectiveError::Launch { rank, .. }
            | CollectiveError::Device { rank, .. } => *rank,
        }
    }
}

impl CollectiveError {
    /// Whether this rank failed *because a peer left*, so that its failure is secondary: a peer
    /// departed ([`PeerDeparted`](CollectiveError::PeerDeparted)), another rank's failure
    /// aborted the group ([`Aborted`](CollectiveError::Aborted)), or the store's server went
    /// away ([`StoreLost`](CollectiveError::StoreLost)). Launchers use it to name the rank whose
    /// failure was primary (`fsdp_collectives::launch`).
    ///
    /// ```
    /// use fsdp_collectives::CollectiveError;
    /// let left = CollectiveError::PeerDeparted { rank: 0, peer: 2, op: "all_gather_base", seq: 7 };
    /// assert!(left.caused_by_peer());
    /// let own = CollectiveError::InvalidArgument { rank: 0, op: "all_reduce", reason: "x".into() };
    /// assert!(!own.caused_by_peer());
    /// ```
    pub fn caused_by_peer(&self) -> bool {
        matches!(
            self,
            CollectiveError::PeerDeparted { .. }
                | CollectiveError::Aborted { .. }
                | CollectiveError::StoreLost { .. }
        )
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;
