//! The optimizer of `fsdp train` and `fsdp plan`: `--optimizer adamw|anyprecision-adamw`,
//! `--kahan-summation on|off` and `--optimizer-state-dtype bf16|f32`, as an
//! [`OptimizerConfig`]; its record in [`RUN_FILE`](crate::run_config::RUN_FILE)'s `config` and
//! its reconciliation with `--resume`'s checkpoint.
//!
//! - `adamw` (the default): `torch.optim.AdamW` on `f32` master shards (`--param-dtype` is only
//!   the dtype the parameters are gathered and read in); 8 bytes of state per shard element.
//! - `anyprecision-adamw`: torchdistx's `AnyPrecisionAdamW`. The engine stores the shards
//!   themselves in `--param-dtype` (bf16: pure-bf16 training, no `f32` master weights; f16 is
//!   refused); the momentum, the variance and (with `--kahan-summation on`, the default) the
//!   Kahan compensation are stored in `--optimizer-state-dtype` (bf16 by default: 6 bytes per
//!   shard element). `--lr`, `--beta1`, `--beta2`, `--eps` and `--weight-decay` map to its
//!   fields; `--decay-2d-only` and `--lr-schedule` apply as to AdamW (the engine's parameter
//!   groups and schedule are the optimizer's whichever it is).
//!
//! A checkpoint records the optimizer (`optimizer`, and for AnyPrecisionAdamW
//! `kahan_summation` and `optimizer_state_dtype`); one written before these keys is AdamW's.

use fsdp::optim::{AdamWConfig, AnyPrecisionAdamWConfig, OptimizerConfig};
use fsdp_device::DType;
use serde_json::{json, Value};

use crate::args::{OptimizerArgs, OptimizerKind, TrainArgs};
use crate::resume::Reconcile;
use crate::run_config::{dtype_from_option, dtype_option, Fields};
use crate::{fail, CliError};

/// The command-line spelling of an optimizer (`--optimizer`, and in [`RUN_FILE`]).
///
/// [`RUN_FILE`]: crate::run_config::RUN_FILE
pub(crate) fn kind_option(k: OptimizerKind) -> &'static str {
    match k {
        OptimizerKind::AdamW => "adamw",
        OptimizerKind::AnyPrecisionAdamW => "anyprecision-adamw",
    }
}

pub(crate) fn kind_from_option(s: &str) -> Option<OptimizerKind> {
    [OptimizerKind::AdamW, OptimizerKind::AnyPrecisionAdamW]
        .into_iter()
        .find(|&k| kind_option(k) == s)
}

fn on_off(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

/// AnyPrecisionAdamW's state dtype when `--optimizer-state-dtype` is not given.
const DEFAULT_STATE_DTYPE: DType = DType::BF16;

/// The optimizer of `o` with the hyperparameters `h` for parameters of `param_dtype`,
/// validated.
///
/// # Errors
/// `--kahan-summation` or `--optimizer-state-dtype` with AdamW; AnyPrecisionAdamW with
/// `--param-dtype f16` (the engine refuses f16 shards); an invalid hyperparameter.
pub(crate) fn optimizer_config(
    o: &OptimizerArgs,
    param_dtype: DType,
    h: AdamWConfig,
) -> Result<OptimizerConfig, CliError> {
    match o.optimizer {
        OptimizerKind::AdamW => {
            let given = [
                ("--kahan-summation", o.kahan_summation.is_some()),
                ("--optimizer-state-dtype", o.optimizer_state_dtype.is_some()),
            ];
            if let Some((option, _)) = given.iter().find(|(_, g)| *g) {
                return Err(fail(format!(
                    "{option} applies only to --optimizer anyprecision-adamw (the optimizer is \
                     adamw)"
                )));
            }
            h.validate()?;
            Ok(h.into())
        }
        OptimizerKind::AnyPrecisionAdamW => {
            if param_dtype == DType::F16 {
                return Err(fail(
                    "--optimizer anyprecision-adamw stores the parameter shards in \
                     --param-dtype, and f16 shards are not supported (use --param-dtype bf16 \
                     for pure-bf16 training, or f32)",
                ));
            }
            let state = o.optimizer_state_dtype.unwrap_or(DEFAULT_STATE_DTYPE);
            let c = AnyPrecisionAdamWConfig {
                lr: h.lr,
                beta1: h.beta1,
                beta2: h.beta2,
                eps: h.eps,
                weight_decay: h.weight_decay,
                use_kahan_summation: o.kahan_summation.unwrap_or(true),
                momentum_dtype: state,
                variance_dtype: state,
                compensation_buffer_dtype: state,
            };
            c.validate()?;
            Ok(c.into())
        }
    }
}

/// The device trainer's `AnyPrecisionAdamW` of `o` (`None`: AdamW), the parameters' values
/// rounded to `param_dtype` (its shards' dtype in the engine), checked as
/// [`optimizer_config`] checks it.
///
/// # Errors
/// As [`optimizer_config`].
pub(crate) fn device_any_precision(
    o: &OptimizerArgs,
    param_dtype: DType,
) -> Result<Option<fsdp_kernels::host::AnyPrecision>, CliError> {
    Ok(
        match optimizer_config(o, param_dtype, AdamWConfig::default())? {
            OptimizerConfig::AnyPrecisionAdamW(c) => Some(fsdp_kernels::host::AnyPrecision {
                param: param_dtype,
                state: c.momentum_dtype,
                kahan: c.use_kahan_summation,
            }),
            _ => None,
        },
    )
}

/// AdamW's hyperparameters of `fsdp train`'s options (`--lr`, `--beta1`, `--beta2`, `--eps`,
/// `--weight-decay`), not yet validated.
pub(crate) fn adamw_options(args: &TrainArgs) -> AdamWConfig {
    AdamWConfig {
        lr: args.lr,
        beta1: args.beta1,
        beta2: args.beta2,
        eps: args.eps,
        weight_decay: args.weight_decay,
    }
}

/// The optimizer of `fsdp train`'s options ([`adamw_options`] and the optimizer's own),
/// validated.
pub(crate) fn train_optimizer(args: &TrainArgs) -> Result<OptimizerConfig, CliError> {
    optimizer_config(&args.optim, args.model.param_dtype, adamw_options(args))
}

/// The optimizer of `fsdp plan`'s options, whose memory does not depend on the
/// hyperparameters (AdamW's defaults stand for them).
pub(crate) fn plan_optimizer(
    o: &OptimizerArgs,
    param_dtype: DType,
) -> Result<OptimizerConfig, CliError> {
    optimizer_config(o, param_dtype, AdamWConfig::default())
}

/// The dtype the engine stores the shards in: `f32` master weights, except under
/// AnyPrecisionAdamW, which keeps the shards in `param_dtype`.
pub(crate) fn shard_dtype(optim: &OptimizerConfig, param_dtype: DType) -> DType {
    match optim {
        OptimizerConfig::AnyPrecisionAdamW(_) => param_dtype,
        _ => DType::F32,
    }
}

/// The optimizer's buffers per parameter in a checkpoint (each read back as a full f32
/// tensor): AdamW's two moments; AnyPrecisionAdamW's two and its Kahan compensation.
pub(crate) fn checkpoint_buffers(optim: &OptimizerConfig) -> u64 {
    match optim {
        OptimizerConfig::AnyPrecisionAdamW(c) if c.use_kahan_summation => 3,
        OptimizerConfig::Sgd(c) if c.momentum == 0.0 => 0,
        OptimizerConfig::Sgd(_) => 1,
        _ => 2,
    }
}

/// The optimizer in words: `AdamW (f32 master weights, f32 moments)` or
/// `AnyPrecisionAdamW (bf16 shards, bf16 moments, Kahan summation on)`.
pub(crate) fn describe(optim: &OptimizerConfig, param_dtype: DType) -> String {
    match optim {
        OptimizerConfig::AnyPrecisionAdamW(c) => format!(
            "AnyPrecisionAdamW ({} shards, {} moments, Kahan summation {}{})",
            dtype_option(param_dtype),
            dtype_option(c.momentum_dtype),
            on_off(c.use_kahan_summation),
            if c.use_kahan_summation {
                format!(
                    " into a {} buffer",
                    dtype_option(c.compensation_buffer_dtype)
                )
            } else {
                String::new()
            }
        ),
        _ => "AdamW (f32 master weights, f32 moments)".to_string(),
    }
}

/// `sharded state: 8 bytes per parameter (parameter 2 + optimizer 6)`: the bytes each shard
/// element holds of the parameter (in the dtype of the shards) and its optimizer state
/// ([`OptimizerConfig::sharded_bytes_per_param`]; the f32 gradient shard is not counted).
pub(crate) fn sharded_state_line(optim: &OptimizerConfig, param_dtype: DType) -> String {
    let shard = shard_dtype(optim, param_dtype);
    format!(
        "sharded state: {} bytes per parameter (parameter {} + optimizer {})",
        optim.sharded_bytes_per_param(shard),
        shard.size_in_bytes(),
        optim.state_bytes_per_element()
    )
}

/// The optimizer's fields of [`RUN_FILE`](crate::run_config::RUN_FILE)'s `config`:
/// `optimizer`, and `kahan_summation` and `optimizer_state_dtype` (`null` for AdamW).
pub(crate) fn record(o: &OptimizerArgs) -> [(&'static str, Value); 3] {
    let any = o.optimizer == OptimizerKind::AnyPrecisionAdamW;
    [
        ("optimizer", json!(kind_option(o.optimizer))),
        (
            "kahan_summation",
            json!(any.then(|| o.kahan_summation.unwrap_or(true))),
        ),
        (
            "optimizer_state_dtype",
            json!(any.then(|| dtype_option(o.optimizer_state_dtype.unwrap_or(DEFAULT_STATE_DTYPE)))),
        ),
    ]
}

/// Reconciles the optimizer's options with the checkpoint's `config` (`c`): one given that
/// disagrees is an error naming both; those not given are the checkpoint's. A checkpoint
/// without `optimizer` (written before the option) is AdamW's.
pub(crate) fn reconcile(
    r: &Reconcile<'_>,
    c: &Fields<'_>,
    o: &mut OptimizerArgs,
) -> Result<(), CliError> {
    let saved = if c.has("optimizer") {
        kind_from_option(c.str("optimizer")?).ok_or_else(|| c.bad("optimizer"))?
    } else {
        OptimizerKind::AdamW
    };
    if r.given("optimizer") && o.optimizer != saved {
        return Err(r.error(
            "--optimizer",
            kind_option(o.optimizer),
            &format!("--optimizer {}", kind_option(saved)),
        ));
    }
    o.optimizer = saved;
    if saved != OptimizerKind::AnyPrecisionAdamW {
        // Its own options, if given, are refused by `optimizer_config`.
        return Ok(());
    }
    let kahan = c.bool("kahan_summation")?;
    if let Some(given) = o.kahan_summation.filter(|&k| k != kahan) {
        return Err(r.error(
            "--kahan-summation",
            on_off(given),
            &format!("--kahan-summation {}", on_off(kahan)),
        ));
    }
    o.kahan_summation = Some(kahan);
    let state = c
        .str("optimizer_state_dtype")
        .ok()
        .and_then(dtype_from_option)
        .filter(|d| matches!(d, DType::BF16 | DType::F32))
        .ok_or_else(|| c.bad("optimizer_state_dtype"))?;
    if let Some(given) = o.optimizer_state_dtype.filter(|&d| d != state) {
        return Err(r.error(
            "--optimizer-state-dtype",
            dtype_option(given),
            &format!("--optimizer-state-dtype {}", dtype_option(state)),
        ));
    }
    o.optimizer_state_dtype = Some(state);
    Ok(())
}
