//! Periodic checkpoints in one directory, each complete or absent: the `step-K` protocol.
//!
//! A training run that checkpoints every N steps keeps its checkpoints in one directory
//! ([`CheckpointDir`]), one subdirectory per checkpoint:
//!
//! 1. Every rank writes its files into the **staging directory** `step-K.tmp`
//!    ([`CheckpointDir::staging_path`]), e.g. with
//!    [`Fsdp::save_sharded`](crate::engine::Fsdp::save_sharded), which writes and `fsync`s each
//!    rank's file and makes the ranks agree that all of them succeeded.
//! 2. After that agreement one process (rank 0) writes whatever describes the checkpoint as a
//!    whole (run metadata) into the staging directory, atomically, and calls
//!    [`CheckpointDir::commit`]: the staging directory is renamed to `step-K` and the parent
//!    directory `fsync`ed. The rename is the commit point: a `step-K` directory is complete by
//!    construction, and a crash at any earlier moment leaves only a `step-K.tmp`.
//! 3. Only then are older checkpoints removed (all but the newest `keep` complete ones), and
//!    with them every staging directory left behind by a crashed run.
//!
//! [`CheckpointDir::latest`] finds the newest complete checkpoint to resume from;
//! [`CheckpointDir::prepare`] creates the directory and removes stale staging directories
//! before a run writes its first checkpoint (so that a `step-K.tmp` of a crashed run, possibly
//! written at another world size, never mixes with the new files of the same step).
//!
//! Only one run may write a directory at a time.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use super::err;
use crate::FsdpError;

/// The suffix of a staging directory: `step-K.tmp`.
pub const STAGING_SUFFIX: &str = ".tmp";

/// The name of the complete checkpoint of step `step`: `step-K`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step}")
}

/// The step of a directory entry named `step-K` (`Some((K, false))`) or `step-K.tmp`
/// (`Some((K, true))`); `None` for any other name.
pub fn parse_step_dir_name(name: &str) -> Option<(u64, bool)> {
    let rest = name.strip_prefix("step-")?;
    let (digits, staging) = match rest.strip_suffix(STAGING_SUFFIX) {
        Some(d) => (d, true),
        None => (rest, false),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((digits.parse().ok()?, staging))
}

/// What [`CheckpointDir::commit`] removed after committing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Committed {
    /// The complete checkpoint just committed (`step-K`).
    pub path: PathBuf,
    /// Older complete checkpoints removed (beyond the newest `keep`).
    pub removed: Vec<PathBuf>,
    /// Staging directories of crashed runs removed.
    pub removed_staging: Vec<PathBuf>,
}

/// A directory of periodic checkpoints (see the [module documentation](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointDir {
    root: PathBuf,
}

impl CheckpointDir {
    /// The checkpoints in `root` (nothing is read or created yet).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        CheckpointDir { root: root.into() }
    }

    /// The directory holding the checkpoints.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `root/step-K`: the complete checkpoint of step `step`.
    pub fn step_path(&self, step: u64) -> PathBuf {
        self.root.join(step_dir_name(step))
    }

    /// `root/step-K.tmp`: where the ranks write the checkpoint of step `step` before it is
    /// committed.
    pub fn staging_path(&self, step: u64) -> PathBuf {
        self.root
            .join(format!("{}{STAGING_SUFFIX}", step_dir_name(step)))
    }

    /// Every `step-K` (`staging == false`) or `step-K.tmp` (`staging == true`) directory, by
    /// increasing K.
    fn entries(&self, staging: bool) -> Result<Vec<(u64, PathBuf)>, FsdpError> {
        let read = fs::read_dir(&self.root)
            .map_err(|e| err(&self.root, format!("cannot read directory: {e}")))?;
        let mut out = Vec::new();
        for entry in read {
            let entry =
                entry.map_err(|e| err(&self.root, format!("cannot read directory: {e}")))?;
            let Some((step, is_staging)) = entry.file_name().to_str().and_then(parse_step_dir_name)
            else {
                continue;
            };
            let is_dir = fs::symlink_metadata(entry.path()).is_ok_and(|m| m.is_dir());
            if is_staging == staging && is_dir {
                out.push((step, entry.path()));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The complete checkpoints (`step-K` directories), by increasing step.
    ///
    /// # Errors
    /// [`FsdpError::Checkpoint`] when the directory cannot be read.
    pub fn complete(&self) -> Result<Vec<(u64, PathBuf)>, FsdpError> {
        self.entries(false)
    }

    /// The staging directories (`step-K.tmp`) present: checkpoints that were never committed.
    ///
    /// # Errors
    /// [`FsdpError::Checkpoint`] when the directory cannot be read.
    pub fn staging(&self) -> Result<Vec<(u64, PathBuf)>, FsdpError> {
        self.entries(true)
    }

    /// The newest complete checkpoint: its step and path, or `None` when there is none.
    ///
    /// # Errors
    /// [`FsdpError::Checkpoint`] when the directory cannot be read.
    pub fn latest(&self) -> Result<Option<(u64, PathBuf)>, FsdpError> {
        Ok(self.complete()?.pop())
    }

    /// Creates the directory (and its parents) if needed and removes every staging directory
    /// left behind by a run that stopped before committing; returns those removed. Call it in
    /// one process before any rank writes a checkpoint.
    ///
    /// # Errors
    /// [`FsdpError::Checkpoint`] when the directory cannot be created or read, or a staging
    /// directory cannot be removed.
    pub fn prepare(&self) -> Result<Vec<PathBuf>, FsdpError> {
        fs::create_dir_all(&self.root)
            .map_err(|e| err(&self.root, format!("cannot create directory: {e}")))?;
        let mut removed = Vec::new();
        for (_, path) in self.staging()? {
            fs::remove_dir_all(&path).map_err(|e| {
                err(
                    &path,
                    format!("cannot remove an incomplete checkpoint: {e}"),
                )
            })?;
            removed.push(path);
        }
        if !removed.is_empty() {
            sync_dir(&self.root);
        }
        Ok(removed)
    }

    /// Commits the checkpoint of `step`: renames `step-K.tmp` to `step-K` and `fsync`s the
    /// directory. Then removes the other staging directories and all but the newest `keep`
    /// complete checkpoints (at least the one just committed stays); those removals are best
    /// effort (what cannot be removed stays and is not an error).
    ///
    /// # Errors
    /// [`FsdpError::Checkpoint`] when `keep` is 0, the staging directory is missing, `step-K`
    /// already exists, or the rename fails (the staging directory then stays, uncommitted).
    pub fn commit(&self, step: u64, keep: usize) -> Result<Committed, FsdpError> {
        let staging = self.staging_path(step);
        let target = self.step_path(step);
        if keep == 0 {
            return Err(err(&target, "keep must be at least 1"));
        }
        if !fs::symlink_metadata(&staging).is_ok_and(|m| m.is_dir()) {
            return Err(err(&staging, "no such staging directory"));
        }
        match fs::symlink_metadata(&target) {
            Ok(_) => {
                return Err(err(
                    &target,
                    "already exists: checkpoints are never replaced",
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(&target, format!("cannot inspect: {e}"))),
        }
        sync_dir(&staging);
        fs::rename(&staging, &target).map_err(|e| {
            err(
                &target,
                format!("cannot rename {} to it: {e}", staging.display()),
            )
        })?;
        sync_dir(&self.root);
        let mut committed = Committed {
            path: target,
            ..Committed::default()
        };
        // Housekeeping, best effort: the new checkpoint is complete whatever happens here.
        if let Ok(staging) = self.staging() {
            for (_, path) in staging {
                if fs::remove_dir_all(&path).is_ok() {
                    committed.removed_staging.push(path);
                }
            }
        }
        if let Ok(complete) = self.complete() {
            let excess = complete.len().saturating_sub(keep);
            for (s, path) in complete.into_iter().take(excess) {
                if s != step && fs::remove_dir_all(&path).is_ok() {
                    committed.removed.push(path);
                }
            }
        }
        if !committed.removed.is_empty() || !committed.removed_staging.is_empty() {
            sync_dir(&self.root);
        }
        Ok(committed)
    }
}

/// `fsync`s a directory, so that renames and removals in it are durable (best effort: not
/// every platform can open a directory).
fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fsdp-ckpt-dir-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn names_parse_strictly() {
        assert_eq!(parse_step_dir_name("step-12"), Some((12, false)));
        assert_eq!(parse_step_dir_name("step-3.tmp"), Some((3, true)));
        for bad in [
            "step-",
            "step-.tmp",
            "step-1a",
            "step--1",
            "steps-1",
            "step-1.tmpx",
        ] {
            assert_eq!(parse_step_dir_name(bad), None, "{bad}");
        }
        assert_eq!(step_dir_name(7), "step-7");
    }

    #[test]
    fn commit_renames_keeps_the_newest_and_removes_staging() {
        let root = scratch("commit");
        let dir = CheckpointDir::new(&root);
        // A leftover of a crashed run.
        fs::create_dir_all(root.join("step-1.tmp")).unwrap();
        fs::write(root.join("step-1.tmp/x"), b"partial").unwrap();
        assert_eq!(dir.prepare().unwrap(), vec![root.join("step-1.tmp")]);
        assert_eq!(dir.latest().unwrap(), None);
        for step in [2u64, 4, 6, 8] {
            fs::create_dir_all(dir.staging_path(step)).unwrap();
            fs::write(dir.staging_path(step).join("f"), b"data").unwrap();
            if step == 6 {
                // A crash leftover appearing meanwhile is removed by the next commit.
                fs::create_dir_all(root.join("step-5.tmp")).unwrap();
            }
            let c = dir.commit(step, 2).unwrap();
            assert_eq!(c.path, dir.step_path(step));
            if step == 6 {
                assert_eq!(c.removed_staging, vec![root.join("step-5.tmp")]);
            }
        }
        let steps: Vec<u64> = dir.complete().unwrap().into_iter().map(|s| s.0).collect();
        assert_eq!(steps, vec![6, 8]);
        assert!(dir.staging().unwrap().is_empty());
        assert_eq!(dir.latest().unwrap(), Some((8, dir.step_path(8))));
        assert_eq!(fs::read(dir.step_path(8).join("f")).unwrap(), b"data");
        // Never replaced; a missing staging directory is an error.
        fs::create_dir_all(dir.staging_path(8)).unwrap();
        assert!(dir.commit(8, 2).is_err());
        assert!(dir.commit(10, 2).is_err());
        let _ = fs::remove_dir_all(&root);
    }
}
