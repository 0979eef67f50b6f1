//! The checkpoint plan of `fsdp train` (`--checkpoint-dir`, `--checkpoint-every`,
//! `--keep-checkpoints`): the options reconciled with what a resumed checkpoint says, and the
//! directory checked before any rank starts. Part of [`super`] (`resume.rs`).

use std::path::{Path, PathBuf};

use fsdp::checkpoint::CheckpointDir;

use crate::args::TrainArgs;
use crate::checkpointing::CheckpointPlan;
use crate::run_config::canonical;
use crate::{fail, CliError};

/// What a checkpoint says about checkpointing: `checkpoint_every`, `keep_checkpoints`, and the
/// directory it lies in.
pub(super) struct SavedPlan {
    pub(super) root: PathBuf,
    pub(super) every: usize,
    pub(super) keep: usize,
}

pub(super) fn checkpoint_plan(
    args: &TrainArgs,
    saved: Option<&SavedPlan>,
) -> Result<Option<CheckpointPlan>, CliError> {
    if args.checkpoint_every == Some(0) {
        return Err(fail("--checkpoint-every must be at least 1"));
    }
    if args.keep_checkpoints == 0 {
        return Err(fail("--keep-checkpoints must be at least 1"));
    }
    let keep_given = args.explicit.iter().any(|e| e == "keep_checkpoints");
    let plan = match (saved, &args.checkpoint_dir, args.checkpoint_every) {
        // Resuming: the checkpoint's directory and settings unless given.
        (Some(s), dir, every) => Some(CheckpointPlan {
            dir: dir.clone().unwrap_or_else(|| s.root.clone()),
            every: every.unwrap_or(s.every),
            keep: if keep_given {
                args.keep_checkpoints
            } else {
                s.keep
            },
        }),
        (None, Some(dir), Some(every)) => Some(CheckpointPlan {
            dir: dir.clone(),
            every,
            keep: args.keep_checkpoints,
        }),
        (None, Some(_), None) => return Err(fail("--checkpoint-dir needs --checkpoint-every N")),
        (None, None, Some(_)) => {
            return Err(fail(
                "--checkpoint-every needs --checkpoint-dir DIR (or --resume DIR)",
            ))
        }
        (None, None, None) if keep_given => {
            return Err(fail("--keep-checkpoints needs --checkpoint-dir DIR"))
        }
        (None, None, None) => None,
    };
    if let Some(p) = &plan {
        check_checkpoint_dir(p, saved.map(|s| s.root.as_path()))?;
    }
    Ok(plan)
}

/// The checkpoint directory, before any rank starts: absent (it is created) or a directory,
/// writable, and holding no checkpoint of another run (unless it is the directory the run
/// resumes from).
fn check_checkpoint_dir(
    plan: &CheckpointPlan,
    resumed_from: Option<&Path>,
) -> Result<(), CliError> {
    let dir = &plan.dir;
    let named = |reason: String| fail(format!("--checkpoint-dir {}: {reason}", dir.display()));
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(named(format!("cannot inspect: {e}"))),
        Ok(m) if !m.is_dir() => return Err(named("is not a directory".into())),
        Ok(_) => {}
    }
    let same = resumed_from.is_some_and(|r| canonical(r) == canonical(dir));
    if !same {
        let complete = CheckpointDir::new(dir)
            .complete()
            .map_err(|e| named(e.to_string()))?;
        if !complete.is_empty() {
            let names: Vec<String> = complete.iter().map(|(k, _)| format!("step-{k}")).collect();
            return Err(named(format!(
                "already holds checkpoints of another run ({}); continue it with --resume {} or \
                 choose another directory",
                names.join(", "),
                dir.display()
            )));
        }
    }
    let probe = dir.join(format!(".fsdp-probe.{}", std::process::id()));
    match std::fs::File::options()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(named(format!("is not writable ({e})"))),
    }
}
