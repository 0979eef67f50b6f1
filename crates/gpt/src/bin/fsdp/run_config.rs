//! [`RUN_FILE`], the run record in each checkpoint directory: its format and version, the
//! options that define a run as it records them (`config`), and reading its fields back.

use std::path::{Path, PathBuf};

use fsdp_device::DType;
use fsdp_gpt::runtime::ShardingStrategy;
use serde_json::{json, Map, Value};

use crate::args::{ScheduleKindArg, TrainArgs};
use crate::train_checks::grad_scaler_on;
use crate::{fail, CliError};

/// The run's metadata in each checkpoint directory (JSON).
pub(crate) const RUN_FILE: &str = "run.json";

/// The `format` of [`RUN_FILE`].
pub(crate) const RUN_FORMAT: &str = "fsdp-train-run";
/// The version of [`RUN_FILE`]'s layout.
pub(crate) const RUN_VERSION: u64 = 1;

/// The command-line spelling of a strategy.
pub(crate) fn strategy_option(s: ShardingStrategy) -> &'static str {
    match s {
        ShardingStrategy::FullShard => "full-shard",
        ShardingStrategy::ShardGradOp => "shard-grad-op",
        ShardingStrategy::NoShard => "no-shard",
        ShardingStrategy::HybridShard => "hybrid-shard",
        ShardingStrategy::HybridShardZero2 => "hybrid-shard-zero2",
    }
}

pub(crate) fn strategy_from_option(s: &str) -> Option<ShardingStrategy> {
    [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ]
    .into_iter()
    .find(|&x| strategy_option(x) == s)
}

/// The command-line spelling of a dtype (`--param-dtype`, `--reduce-dtype`).
pub(crate) fn dtype_option(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F64 => "f64",
    }
}

pub(crate) fn dtype_from_option(s: &str) -> Option<DType> {
    [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .find(|&d| dtype_option(d) == s)
}

/// The grad scaler's initial scale and growth interval when none is given
/// (`torch.amp.GradScaler`'s).
pub(crate) const DEFAULT_INIT_SCALE: f64 = 65536.0;
pub(crate) const DEFAULT_GROWTH_INTERVAL: u32 = 2000;

pub(crate) fn schedule_option(s: ScheduleKindArg) -> &'static str {
    match s {
        ScheduleKindArg::Constant => "constant",
        ScheduleKindArg::Cosine => "cosine",
    }
}

/// A path made absolute and canonical when it exists (as given otherwise), for comparing and
/// recording inputs.
pub(crate) fn canonical(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

pub(crate) fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// `--grad-clip` as the run uses it: `None` for no clipping (`--grad-clip 0` included).
pub(crate) fn effective_grad_clip(c: Option<f64>) -> Option<f64> {
    c.filter(|&c| c != 0.0)
}

/// The options that define a run, as [`RUN_FILE`] records them (`config`). `data_tokens` is
/// the length of the token stream; `steps` resolves the cosine schedule's default.
pub(crate) fn run_config(args: &TrainArgs, data_tokens: usize) -> Value {
    let m = &args.model;
    let cosine = args.lr_schedule == ScheduleKindArg::Cosine;
    let mut config = json!({
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_embd": m.n_embd,
        "block_size": m.block_size,
        "vocab_size": m.vocab_size,
        "strategy": strategy_option(m.strategy),
        "lr": args.lr,
        "beta1": args.beta1,
        "beta2": args.beta2,
        "eps": args.eps,
        "weight_decay": args.weight_decay,
        "decay_2d_only": args.decay_2d_only,
        "lr_schedule": schedule_option(args.lr_schedule),
        "warmup_iters": args.warmup_iters,
        // The cosine schedule's defaults resolved, so that a resumed run with another --steps
        // keeps the schedule.
        "lr_decay_iters": if cosine {
            Some(args.lr_decay_iters.unwrap_or(args.steps as u64))
        } else {
            args.lr_decay_iters
        },
        "min_lr": if cosine { Some(args.min_lr.unwrap_or(args.lr / 10.0)) } else { args.min_lr },
        "grad_clip": effective_grad_clip(args.grad_clip),
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "seed": args.seed,
        "data": args.data.as_deref().map(|p| path_string(&canonical(p))),
        "data_tokens": data_tokens,
        "init_from": args.init_from.as_deref().map(|p| path_string(&canonical(p))),
        // Mixed precision and the grad scaler (absent from checkpoints written before them:
        // such a checkpoint takes these options as given).
        "param_dtype": dtype_option(m.param_dtype),
        "reduce_dtype": m.reduce_dtype.map(dtype_option),
        "grad_scaler": grad_scaler_on(args).then(|| json!({
            "init_scale": args.init_scale.unwrap_or(DEFAULT_INIT_SCALE),
            "growth_interval": args.growth_interval.unwrap_or(DEFAULT_GROWTH_INTERVAL),
        })),
    });
    // The optimizer and its settings (absent from checkpoints written before --optimizer:
    // such a checkpoint is AdamW's).
    if let Some(map) = config.as_object_mut() {
        for (key, value) in crate::optimizer::record(&args.optim) {
            map.insert(key.into(), value);
        }
    }
    config
}

/// Reads fields of a JSON object, errors naming the file and the field.
pub(crate) struct Fields<'a> {
    file: &'a Path,
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    pub(crate) fn new(file: &'a Path, v: &'a Value) -> Result<Self, CliError> {
        let map = v
            .as_object()
            .ok_or_else(|| fail(format!("{}: not a JSON object", file.display())))?;
        Ok(Fields { file, map })
    }

    pub(crate) fn bad(&self, key: &str) -> CliError {
        fail(format!(
            "{}: missing or invalid `{key}`",
            self.file.display()
        ))
    }

    /// Whether the object has `key` (for fields that older files lack).
    pub(crate) fn has(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    pub(crate) fn get(&self, key: &str) -> Result<&'a Value, CliError> {
        self.map.get(key).ok_or_else(|| self.bad(key))
    }

    pub(crate) fn u64(&self, key: &str) -> Result<u64, CliError> {
        self.get(key)?.as_u64().ok_or_else(|| self.bad(key))
    }

    pub(crate) fn usize(&self, key: &str) -> Result<usize, CliError> {
        usize::try_from(self.u64(key)?).map_err(|_| self.bad(key))
    }

    pub(crate) fn f64(&self, key: &str) -> Result<f64, CliError> {
        self.get(key)?.as_f64().ok_or_else(|| self.bad(key))
    }

    pub(crate) fn bool(&self, key: &str) -> Result<bool, CliError> {
        self.get(key)?.as_bool().ok_or_else(|| self.bad(key))
    }

    pub(crate) fn str(&self, key: &str) -> Result<&'a str, CliError> {
        self.get(key)?.as_str().ok_or_else(|| self.bad(key))
    }

    /// `null` is `None`.
    pub(crate) fn opt<T>(
        &self,
        key: &str,
        f: impl FnOnce(&Value) -> Option<T>,
    ) -> Result<Option<T>, CliError> {
        match self.get(key)? {
            Value::Null => Ok(None),
            v => f(v).map(Some).ok_or_else(|| self.bad(key)),
        }
    }

    pub(crate) fn object(&self, key: &str) -> Result<Fields<'a>, CliError> {
        Fields::new(self.file, self.get(key)?)
    }
}
