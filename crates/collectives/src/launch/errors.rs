//! Telling a primary failure from a secondary one: the ranks' error files and the launcher's
//! choice of the rank to blame.

use super::job::Proc;
use super::RankOutcome;

/// The variable that names a rank's error file: a rank that fails may write there one line of
/// JSON, `{"rank":N,"peer_left":true|false,"message":"..."}` (see [`write_error_file`]); the
/// launcher reads `peer_left` to tell a primary failure from one caused by a peer leaving.
pub const ERROR_FILE_ENV: &str = "FSDP_ERROR_FILE";

/// Writes this rank's error file if the launcher asked for one ([`ERROR_FILE_ENV`]): its rank,
/// whether it failed because a peer left (`peer_left`: for this crate's errors,
/// [`CollectiveError::caused_by_peer`](crate::CollectiveError::caused_by_peer)), and the
/// message. Errors of the write are ignored (the launcher then goes by time alone).
///
/// ```no_run
/// use fsdp_collectives::{launch, CollectiveError};
/// let e = CollectiveError::PeerDeparted { rank: 1, peer: 2, op: "all_gather_base", seq: 3 };
/// launch::write_error_file(&e.to_string(), e.caused_by_peer());
/// ```
pub fn write_error_file(message: &str, peer_left: bool) {
    let Some(path) = std::env::var_os(ERROR_FILE_ENV) else {
        return;
    };
    let rank = std::env::var("RANK").unwrap_or_default();
    let rank: i64 = rank.trim().parse().unwrap_or(-1);
    let line = serde_json::json!({
        "rank": rank,
        "peer_left": peer_left,
        "message": message,
    })
    .to_string()
        + "\n";
    let _ = std::fs::write(path, line);
}

/// The index of the rank whose failure was primary: the earliest failure (by the time the
/// launcher saw it, then by rank) among the ranks that do not blame a peer; if all of them do,
/// the earliest of those. Ranks the launcher stopped are not failures.
pub(super) fn primary_failure(procs: &[Proc]) -> Option<usize> {
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
pub(super) struct ErrorFiles {
    pub(super) dir: Option<std::path::PathBuf>,
}

impl ErrorFiles {
    pub(super) fn create() -> ErrorFiles {
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

    pub(super) fn path(&self, rank: usize) -> Option<std::path::PathBuf> {
        self.dir
            .as_ref()
            .map(|d| d.join(format!("rank-{rank}.json")))
    }

    pub(super) fn says_peer_left(&self, rank: usize) -> bool {
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
