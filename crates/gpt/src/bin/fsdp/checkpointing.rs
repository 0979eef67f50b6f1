//! Writing periodic checkpoints (`--checkpoint-dir`, `--checkpoint-every`,
//! `--keep-checkpoints`); [`crate::resume`] checks these options and resumes from them.
//!
//! A checkpoint is the engine's sharded checkpoint (one file per rank: parameters, optimizer
//! state with its groups and learning-rate schedule, all keyed by parameter name; with the grad
//! scaler on, its state in [`fsdp::engine::GRAD_SCALER_FILE`]) plus [`RUN_FILE`], the run: the
//! step K reached, the data position, the skipped non-finite steps, and the options that define
//! the run (model sizes, strategy, the optimizer (`--optimizer` and its settings) and the
//! schedule, gradient clipping, batch, gradient accumulation, seed, data, `--init-from`, mixed
//! precision and the grad scaler's settings). It is written
//! with the `step-K` protocol of [`fsdp::checkpoint::CheckpointDir`]: every rank writes and
//! `fsync`s its file into `DIR/step-K.tmp` and the ranks agree that all succeeded; rank 0 then
//! writes [`RUN_FILE`] atomically, renames the directory to `DIR/step-K`, `fsync`s `DIR`, and
//! removes older checkpoints beyond `--keep-checkpoints` and staging directories of crashed
//! runs; the ranks agree again, so a failure stops every rank.

use std::path::PathBuf;

use fsdp::checkpoint::{write_atomic, CheckpointDir};
use fsdp::Fsdp;
use serde_json::{json, Map, Value};

use crate::args::TrainArgs;
use crate::run_config::{run_config, RUN_FILE, RUN_FORMAT, RUN_VERSION};
use crate::{fail, fail_with, CliError};

/// `--checkpoint-dir`, `--checkpoint-every` and `--keep-checkpoints`, checked.
#[derive(Clone)]
pub(crate) struct CheckpointPlan {
    pub(crate) dir: PathBuf,
    pub(crate) every: usize,
    pub(crate) keep: usize,
}

/// Writes the checkpoints of one rank's run (see the [module documentation](self)).
pub(crate) struct Checkpointer {
    plan: CheckpointPlan,
    dir: CheckpointDir,
    /// [`RUN_FILE`]'s fields that do not change from step to step.
    base: Map<String, Value>,
    grad_accum: usize,
}

impl Checkpointer {
    /// The checkpoints of the run of `args` (resolved) on `world` ranks over `data_tokens`
    /// tokens.
    pub(crate) fn new(
        plan: &CheckpointPlan,
        args: &TrainArgs,
        data_tokens: usize,
        world: usize,
    ) -> Self {
        let mut base = Map::new();
        base.insert("format".into(), json!(RUN_FORMAT));
        base.insert("version".into(), json!(RUN_VERSION));
        base.insert("world_size".into(), json!(world));
        base.insert("steps".into(), json!(args.steps));
        base.insert("checkpoint_every".into(), json!(plan.every));
        base.insert("keep_checkpoints".into(), json!(plan.keep));
        base.insert("config".into(), run_config(args, data_tokens));
        Checkpointer {
            plan: plan.clone(),
            dir: CheckpointDir::new(&plan.dir),
            base,
            grad_accum: args.grad_accum,
        }
    }

    /// Creates the directory and removes the staging directories of crashed runs. Call it in
    /// one process (rank 0) before training: every other rank writes its first checkpoint only
    /// after a step, whose collectives need rank 0, so after this.
    pub(crate) fn prepare(&self) -> Result<(), CliError> {
        self.dir
            .prepare()
            .map(drop)
            .map_err(|e| fail(format!("--checkpoint-dir: {e}")))
    }

    /// Whether a checkpoint is due after `done` steps.
    pub(crate) fn due(&self, done: usize) -> bool {
        done % self.plan.every == 0
    }

    /// Writes the checkpoint of step `done` (steps done) with `skipped` non-finite steps
    /// skipped so far. **Collective**: every rank calls it.
    pub(crate) fn save(&self, model: &Fsdp, done: usize, skipped: usize) -> Result<(), CliError> {
        let step = done as u64;
        let staging = self.dir.staging_path(step);
        // Every rank writes and fsyncs its file; the ranks agree that all succeeded.
        model
            .save_sharded(&staging)
            .map_err(|e| fail_with("--checkpoint-dir", e))?;
        // Rank 0 completes the checkpoint; the ranks agree on that too.
        let committed = if model.rank() == 0 {
            self.commit(step, done, skipped)
        } else {
            Ok(())
        };
        let failed = model.all_reduce_loss(if committed.is_ok() { 0.0 } else { 1.0 })?;
        committed?;
        if failed > 0.0 {
            return Err(fail(format!(
                "--checkpoint-dir {}: rank 0 could not complete the checkpoint of step {done}",
                self.plan.dir.display()
            )));
        }
        Ok(())
    }

    /// Writes the checkpoint of step `done` of a run in one process (the device trainer's):
    /// `write` puts its files into the staging directory, then it is completed as
    /// [`save`](Self::save) completes the engine's.
    pub(crate) fn save_one(
        &self,
        done: usize,
        skipped: usize,
        write: impl FnOnce(&std::path::Path) -> Result<(), CliError>,
    ) -> Result<(), CliError> {
        write(&self.dir.staging_path(done as u64))?;
        self.commit(done as u64, done, skipped)
    }

    fn commit(&self, step: u64, done: usize, skipped: usize) -> Result<(), CliError> {
        let staging = self.dir.staging_path(step);
        let mut run = self.base.clone();
        run.insert("step".into(), json!(done));
        // Micro-batches consumed: the next step reads global batch `done * grad_accum`.
        run.insert("data_position".into(), json!(done * self.grad_accum));
        run.insert("skipped_steps".into(), json!(skipped));
        let text = serde_json::to_string_pretty(&Value::Object(run))
            .map_err(|e| fail(format!("--checkpoint-dir: {e}")))?;
        write_atomic(&staging.join(RUN_FILE), |w| {
            w.write_all(text.as_bytes())?;
            w.write_all(b"\n")
        })
        .map_err(|e| fail(format!("--checkpoint-dir: {e}")))?;
        self.dir
            .commit(step, self.plan.keep)
            .map(drop)
            .map_err(|e| fail(format!("--checkpoint-dir: {e}")))
    }
}
