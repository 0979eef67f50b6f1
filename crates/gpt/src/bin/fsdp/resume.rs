//! Periodic checkpoints and resuming (`--checkpoint-dir`, `--checkpoint-every`,
//! `--keep-checkpoints`, `--resume`), and the options `fsdp train` reads from files: the model
//! sizes of `--init-from`, and every option that defines the run from `--resume`'s checkpoint.
//! Writing the checkpoints is [`crate::checkpointing`]; their [`RUN_FILE`] is
//! [`crate::run_config`].
//!
//! `--resume DIR` starts from the newest complete `DIR/step-K` at any number of ranks (the
//! checkpoint is resharded on load; as threads, the checkpoint's number unless `--ranks` is
//! given) at step K with the same data positions, so at the same number of ranks the steps and
//! losses are bitwise those of an uninterrupted run. The options not given are the
//! checkpoint's (`--steps` and the checkpoint settings included); a run-defining option given
//! must equal the checkpoint's, else the error names both values.

use std::collections::HashMap;
use std::fmt::Display;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use fsdp::checkpoint::{CheckpointDir, FullOptimizerState};
use fsdp::engine::{load_grad_scaler_state, GradScalerState, GRAD_SCALER_FILE};
use fsdp_gpt::model::GptConfig;
use serde_json::Value;

use fsdp_device::DType;

use crate::args::{Cli, Command, DeviceArg, ScheduleKindArg, TrainArgs, TrainBackend};
use crate::checkpointing::CheckpointPlan;
use crate::run_config::{
    canonical, dtype_from_option, dtype_option, effective_grad_clip, path_string, schedule_option,
    strategy_from_option, strategy_option, Fields, RUN_FILE, RUN_FORMAT, RUN_VERSION,
};
use crate::{fail, CliError};

#[path = "resume_plan.rs"]
mod plan;
use plan::{checkpoint_plan, SavedPlan};

/// Parses the command line like `Cli::try_parse`, and records which options of `fsdp train`
/// were given (rather than defaulted) in [`TrainArgs::explicit`].
pub(crate) fn parse_cli() -> Result<Cli, clap::Error> {
    let matches = Cli::command().try_get_matches()?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    match (&mut cli.command, matches.subcommand()) {
        (Command::Train(args), Some(("train", sub))) => {
            args.explicit = given_ids(sub);
            device_dtype_default(&mut args.model.param_dtype, args.device, &args.explicit);
        }
        (Command::Plan(args), Some(("plan", sub))) => {
            args.explicit = given_ids(sub);
            device_dtype_default(&mut args.model.param_dtype, args.device, &args.explicit);
        }
        _ => {}
    }
    Ok(cli)
}

/// The ids of the options of `sub` given on the command line (not defaulted).
fn given_ids(sub: &clap::ArgMatches) -> Vec<String> {
    sub.ids()
        .filter(|id| sub.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| id.as_str().to_string())
        .collect()
}

/// On a device (`--device cuda`, and its host twin) the default `--param-dtype` is bf16, as in
/// torchtitan's recipes (with `--reduce-dtype f32`); on the CPU it stays f32.
fn device_dtype_default(param_dtype: &mut DType, device: DeviceArg, explicit: &[String]) {
    if device != DeviceArg::Cpu && !explicit.iter().any(|e| e == "param_dtype") {
        *param_dtype = DType::BF16;
    }
}

/// The options of `fsdp train` after reading `--resume`'s checkpoint and `--init-from`'s
/// sizes, with what resuming and checkpointing need.
pub(crate) struct Resolved {
    /// The options: those given, then the checkpoint's or the file's, then the defaults.
    pub(crate) args: TrainArgs,
    /// Where the run resumes, with `--resume`.
    pub(crate) resume: Option<ResumePoint>,
    /// Where and how often checkpoints are written.
    pub(crate) checkpoints: Option<CheckpointPlan>,
}

/// The checkpoint a run resumes from.
pub(crate) struct ResumePoint {
    /// `DIR/step-K`.
    pub(crate) path: PathBuf,
    /// K: the steps done; the resumed run starts at step K.
    pub(crate) step: usize,
    /// The non-finite steps skipped before K (they count against `--skip-nonfinite`).
    pub(crate) skipped: usize,
    /// Tokens of the data the checkpoint was trained on.
    data_tokens: usize,
    /// Whether the checkpoint's run had the grad scaler on (then it holds its state).
    grad_scaler: bool,
}

impl ResumePoint {
    /// The parameters and the optimizer state of the checkpoint, reassembled for `cfg` (at
    /// any world size; the engine reshards them).
    pub(crate) fn load(
        &self,
        cfg: &GptConfig,
    ) -> Result<(HashMap<String, Vec<f32>>, FullOptimizerState), CliError> {
        let ck = fsdp_gpt::checkpoint::load_sharded_gpt(&self.path, cfg)
            .map_err(|e| fail(format!("--resume: {e}")))?;
        let optimizer = ck.optimizer.ok_or_else(|| {
            fail(format!(
                "--resume {}: the checkpoint holds no optimizer state",
                self.path.display()
            ))
        })?;
        Ok((ck.params, optimizer))
    }

    /// The grad scaler's state saved with the checkpoint ([`GRAD_SCALER_FILE`]), for a run
    /// with the scaler on: `None` for a checkpoint written without a scaler (which predates the
    /// recording of `--grad-scaler`: the scaler then starts at its initial scale).
    pub(crate) fn grad_scaler_state(&self) -> Result<Option<GradScalerState>, CliError> {
        let state =
            load_grad_scaler_state(&self.path).map_err(|e| fail(format!("--resume: {e}")))?;
        if state.is_none() && self.grad_scaler {
            return Err(fail(format!(
                "--resume {}: the checkpoint's run had the grad scaler on, but it holds no \
                 {GRAD_SCALER_FILE}",
                self.path.display()
            )));
        }
        Ok(state)
    }

    /// The data read for the resumed run must be the checkpoint's: the same number of tokens.
    pub(crate) fn check_tokens(&self, tokens: usize) -> Result<(), CliError> {
        if tokens != self.data_tokens {
            return Err(fail(format!(
                "--resume {}: the data has {tokens} tokens, the checkpoint's had {}",
                self.path.display(),
                self.data_tokens
            )));
        }
        Ok(())
    }
}

/// Options are reconciled with a source (a checkpoint or an `--init-from` file): one given
/// on the command line must equal the source's value (else an error naming both); one not
/// given takes it.
pub(crate) struct Reconcile<'a> {
    explicit: &'a [String],
    /// `the checkpoint DIR/step-K` or `--init-from FILE`.
    source: String,
}

impl Reconcile<'_> {
    pub(crate) fn given(&self, id: &str) -> bool {
        self.explicit.iter().any(|e| e == id)
    }

    pub(crate) fn error(&self, option: &str, given: &str, saved: &str) -> CliError {
        fail(format!(
            "{option} {given} disagrees with {}, which has {saved}",
            self.source
        ))
    }

    /// A plain value (`--n-layer 2`).
    fn value<T: PartialEq + Display>(
        &self,
        id: &str,
        arg: &mut T,
        saved: T,
    ) -> Result<(), CliError> {
        let option = format!("--{}", id.replace('_', "-"));
        if !self.given(id) {
            *arg = saved;
        } else if *arg != saved {
            return Err(self.error(&option, &arg.to_string(), &format!("{option} {saved}")));
        }
        Ok(())
    }

    /// An optional value (`--grad-clip 1` or none).
    fn optional<T: PartialEq + Display>(
        &self,
        id: &str,
        arg: &mut Option<T>,
        saved: Option<T>,
    ) -> Result<(), CliError> {
        let option = format!("--{}", id.replace('_', "-"));
        let show = |v: &Option<T>| match v {
            Some(v) => format!("{option} {v}"),
            None => format!("no {option}"),
        };
        if !self.given(id) {
            *arg = saved;
        } else if *arg != saved {
            let given = arg.as_ref().map_or_else(String::new, ToString::to_string);
            return Err(self.error(&option, &given, &show(&saved)));
        }
        Ok(())
    }
}

/// Reads the options of `args` from `--resume`'s checkpoint and `--init-from`'s sizes, and
/// checks the checkpoint options. Nothing is written.
pub(crate) fn resolve(args: &TrainArgs) -> Result<Resolved, CliError> {
    let mut out = args.clone();
    let resume_dir = args.resume.clone().or(restarted_from(args)?);
    let resume = match &resume_dir {
        Some(dir) => Some(resume_from(dir, &mut out)?),
        None => {
            if out.init_from.is_some() {
                sizes_from_init(&mut out)?;
            }
            None
        }
    };
    let checkpoints = checkpoint_plan(&out, resume.as_ref().map(|r| &r.1))?;
    Ok(Resolved {
        args: out,
        resume: resume.map(|r| r.0),
        checkpoints,
    })
}

/// Under torchrun, a restarted attempt (`TORCHELASTIC_RESTART_COUNT` > 0) with
/// `--checkpoint-dir` resumes from that directory's newest complete checkpoint, if it has one.
fn restarted_from(args: &TrainArgs) -> Result<Option<PathBuf>, CliError> {
    let restart = std::env::var(fsdp_collectives::torchelastic::RESTART_COUNT_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let Some(dir) = args.checkpoint_dir.as_ref().filter(|_| restart > 0) else {
        return Ok(None);
    };
    if !dir.is_dir() {
        return Ok(None);
    }
    let complete = CheckpointDir::new(dir).complete().map_err(|e| {
        fail(format!(
            "--checkpoint-dir {} (restart {restart} under torchrun): {e}",
            dir.display()
        ))
    })?;
    Ok((!complete.is_empty()).then(|| dir.clone()))
}

/// Finds the newest complete checkpoint in `dir`, reads its [`RUN_FILE`] and reconciles the
/// options of `out` with it.
fn resume_from(dir: &Path, out: &mut TrainArgs) -> Result<(ResumePoint, SavedPlan), CliError> {
    let named = |reason: String| fail(format!("--resume {}: {reason}", dir.display()));
    let ckpts = CheckpointDir::new(dir);
    let latest = ckpts.latest().map_err(|e| match e {
        fsdp::FsdpError::Checkpoint { reason, .. } => named(reason),
        other => named(other.to_string()),
    })?;
    let Some((step, path)) = latest else {
        let staging = ckpts.staging().unwrap_or_default();
        return Err(named(match staging.last() {
            Some((_, p)) => format!(
                "no complete checkpoint ({} was never completed)",
                p.file_name()
                    .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
            ),
            None => "no complete checkpoint (no step-K directory)".into(),
        }));
    };
    let file = path.join(RUN_FILE);
    let text = std::fs::read_to_string(&file)
        .map_err(|e| named(format!("cannot read {}: {e}", file.display())))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| named(format!("{} is not valid JSON: {e}", file.display())))?;
    let run = Fields::new(&file, &v)?;
    if run.str("format")? != RUN_FORMAT || run.u64("version")? != RUN_VERSION {
        return Err(named(format!(
            "{} is not a run file of this version ({RUN_FORMAT} {RUN_VERSION})",
            file.display()
        )));
    }
    let saved_step = run.usize("step")?;
    if saved_step as u64 != step {
        return Err(named(format!(
            "{} says step {saved_step}, its directory step {step}",
            file.display()
        )));
    }
    let c = run.object("config")?;
    let explicit = std::mem::take(&mut out.explicit);
    let r = Reconcile {
        explicit: &explicit,
        source: format!("the checkpoint {}", path.display()),
    };
    let m = &mut out.model;
    r.value("n_layer", &mut m.n_layer, c.usize("n_layer")?)?;
    r.value("n_head", &mut m.n_head, c.usize("n_head")?)?;
    r.value("n_embd", &mut m.n_embd, c.usize("n_embd")?)?;
    r.value("block_size", &mut m.block_size, c.usize("block_size")?)?;
    r.value("vocab_size", &mut m.vocab_size, c.usize("vocab_size")?)?;
    let saved_strategy = c.str("strategy")?;
    let strategy = strategy_from_option(saved_strategy).ok_or_else(|| c.bad("strategy"))?;
    if r.given("strategy") && m.strategy != strategy {
        return Err(r.error(
            "--strategy",
            strategy_option(m.strategy),
            &format!("--strategy {saved_strategy}"),
        ));
    }
    m.strategy = strategy;
    r.value("lr", &mut out.lr, c.f64("lr")?)?;
    r.value("beta1", &mut out.beta1, c.f64("beta1")?)?;
    r.value("beta2", &mut out.beta2, c.f64("beta2")?)?;
    r.value("eps", &mut out.eps, c.f64("eps")?)?;
    r.value(
        "weight_decay",
        &mut out.weight_decay,
        c.f64("weight_decay")?,
    )?;
    let decay = c.bool("decay_2d_only")?;
    if r.given("decay_2d_only") && !decay {
        return Err(fail(format!(
            "--decay-2d-only disagrees with {}, which has no --decay-2d-only",
            r.source
        )));
    }
    out.decay_2d_only = decay;
    let schedule = match c.str("lr_schedule")? {
        "constant" => ScheduleKindArg::Constant,
        "cosine" => ScheduleKindArg::Cosine,
        _ => return Err(c.bad("lr_schedule")),
    };
    if r.given("lr_schedule") && out.lr_schedule != schedule {
        return Err(r.error(
            "--lr-schedule",
            schedule_option(out.lr_schedule),
            &format!("--lr-schedule {}", schedule_option(schedule)),
        ));
    }
    out.lr_schedule = schedule;
    r.value(
        "warmup_iters",
        &mut out.warmup_iters,
        c.u64("warmup_iters")?,
    )?;
    r.optional(
        "lr_decay_iters",
        &mut out.lr_decay_iters,
        c.opt("lr_decay_iters", Value::as_u64)?,
    )?;
    r.optional("min_lr", &mut out.min_lr, c.opt("min_lr", Value::as_f64)?)?;
    out.grad_clip = effective_grad_clip(out.grad_clip);
    r.optional(
        "grad_clip",
        &mut out.grad_clip,
        c.opt("grad_clip", Value::as_f64)?,
    )?;
    r.value("batch_size", &mut out.batch_size, c.usize("batch_size")?)?;
    r.value("grad_accum", &mut out.grad_accum, c.usize("grad_accum")?)?;
    r.value("seed", &mut out.seed, c.u64("seed")?)?;
    let grad_scaler = precision_from(&r, &c, out)?;
    crate::optimizer::reconcile(&r, &c, &mut out.optim)?;
    // Inputs are compared as canonical paths.
    let saved_data = c.opt("data", |v| v.as_str().map(PathBuf::from))?;
    if r.given("data") {
        let given = out.data.as_deref().map(canonical);
        if given != saved_data {
            let shown = |p: &Option<PathBuf>| match p {
                Some(p) => format!("--data {}", p.display()),
                None => "a generated corpus (no --data)".to_string(),
            };
            let arg = out.data.as_deref().map(path_string).unwrap_or_default();
            return Err(r.error("--data", &arg, &shown(&saved_data)));
        }
    }
    out.data = saved_data;
    let saved_init = c.opt("init_from", |v| v.as_str().map(PathBuf::from))?;
    if let Some(given) = &out.init_from {
        if Some(canonical(given)) != saved_init {
            let shown = saved_init.as_ref().map_or_else(
                || "no --init-from".to_string(),
                |p| format!("--init-from {}", p.display()),
            );
            return Err(r.error("--init-from", &path_string(given), &shown));
        }
    }
    // The weights come from the checkpoint.
    out.init_from = None;
    // Ranks as threads: as many as the checkpoint's unless given (a launcher or mpirun sets
    // its own world size).
    if !r.given("ranks") && runs_as_threads(out) {
        out.model.ranks = Some(run.usize("world_size")?);
    }
    if !r.given("steps") {
        out.steps = run.usize("steps")?;
    }
    if step as usize >= out.steps {
        return Err(named(format!(
            "the newest checkpoint {} is at step {step}, and --steps is {}: nothing is left to \
             train (give a larger --steps)",
            path.display(),
            out.steps
        )));
    }
    if run.usize("data_position")? != step as usize * out.grad_accum {
        return Err(named(format!(
            "{} says data position {}, but step {step} of {} micro-batches is at {}",
            file.display(),
            run.usize("data_position")?,
            out.grad_accum,
            step as usize * out.grad_accum
        )));
    }
    let point = ResumePoint {
        step: step as usize,
        skipped: run.usize("skipped_steps")?,
        data_tokens: c.usize("data_tokens")?,
        grad_scaler,
        path,
    };
    let saved = SavedPlan {
        root: dir.to_path_buf(),
        every: run.usize("checkpoint_every")?.max(1),
        keep: run.usize("keep_checkpoints")?.max(1),
    };
    out.explicit = explicit;
    Ok((point, saved))
}

/// Reconciles `--param-dtype`, `--reduce-dtype` and the grad scaler's options with the
/// checkpoint's `config` (`c`; a checkpoint written before they were recorded leaves them as
/// given). Returns whether the checkpoint's run had the grad scaler on.
fn precision_from(
    r: &Reconcile<'_>,
    c: &Fields<'_>,
    out: &mut TrainArgs,
) -> Result<bool, CliError> {
    let dtype = |key: &str, v: &Value| match v {
        Value::Null => Ok(None),
        v => v
            .as_str()
            .and_then(dtype_from_option)
            .map(Some)
            .ok_or_else(|| c.bad(key)),
    };
    let m = &mut out.model;
    if c.has("param_dtype") {
        let saved =
            dtype("param_dtype", c.get("param_dtype")?)?.ok_or_else(|| c.bad("param_dtype"))?;
        if r.given("param_dtype") && m.param_dtype != saved {
            return Err(r.error(
                "--param-dtype",
                dtype_option(m.param_dtype),
                &format!("--param-dtype {}", dtype_option(saved)),
            ));
        }
        m.param_dtype = saved;
    }
    if c.has("reduce_dtype") {
        let saved = dtype("reduce_dtype", c.get("reduce_dtype")?)?;
        if r.given("reduce_dtype") && m.reduce_dtype != saved {
            let shown = saved.map_or_else(
                || "no --reduce-dtype".to_string(),
                |d| format!("--reduce-dtype {}", dtype_option(d)),
            );
            let given = m.reduce_dtype.map_or("", dtype_option);
            return Err(r.error("--reduce-dtype", given, &shown));
        }
        m.reduce_dtype = saved;
    }
    if !c.has("grad_scaler") {
        return Ok(false);
    }
    let saved = match c.get("grad_scaler")? {
        Value::Null => None,
        _ => {
            let g = c.object("grad_scaler")?;
            let interval =
                u32::try_from(g.u64("growth_interval")?).map_err(|_| g.bad("growth_interval"))?;
            Some((g.f64("init_scale")?, interval))
        }
    };
    let on_off = |on: bool| if on { "on" } else { "off" };
    match out.grad_scaler {
        Some(on) if r.given("grad_scaler") && on != saved.is_some() => {
            return Err(r.error(
                "--grad-scaler",
                on_off(on),
                &format!("--grad-scaler {}", on_off(saved.is_some())),
            ))
        }
        _ => out.grad_scaler = Some(saved.is_some()),
    }
    r.optional("init_scale", &mut out.init_scale, saved.map(|s| s.0))?;
    r.optional(
        "growth_interval",
        &mut out.growth_interval,
        saved.map(|s| s.1),
    )?;
    Ok(saved.is_some())
}

/// Whether the ranks will be threads of this process (no launcher, no mpirun, no process
/// backend asked for).
fn runs_as_threads(args: &TrainArgs) -> bool {
    let launched = !matches!(fsdp_collectives::LaunchEnv::from_env(), Ok(None));
    let mpirun = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .any(|k| std::env::var_os(k).is_some());
    matches!(args.backend, None | Some(TrainBackend::Ring)) && !launched && !mpirun
}

/// Takes the model sizes not given from the `--init-from` file (its metadata, else its
/// shapes); a size given that disagrees with the file's is an error naming both.
fn sizes_from_init(out: &mut TrainArgs) -> Result<(), CliError> {
    let Some(path) = out.init_from.clone() else {
        return Ok(());
    };
    let sizes = match fsdp_gpt::checkpoint::read_sizes(&path) {
        Ok(s) => s,
        // An unreadable file is reported when it is loaded, naming the tensor or the file.
        Err(_) => return Ok(()),
    };
    let r = Reconcile {
        explicit: &out.explicit,
        source: format!("--init-from {}", path.display()),
    };
    let m = &mut out.model;
    let slots: [(&str, &mut usize); 5] = [
        ("n_layer", &mut m.n_layer),
        ("n_head", &mut m.n_head),
        ("n_embd", &mut m.n_embd),
        ("block_size", &mut m.block_size),
        ("vocab_size", &mut m.vocab_size),
    ];
    for ((id, arg), file) in slots.into_iter().zip(sizes.sizes) {
        if let Some(v) = file {
            r.value(id, arg, v)?;
        }
    }
    Ok(())
}
