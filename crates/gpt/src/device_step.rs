//! What the one-rank and the sharded device trainers share of a step: the optimizer's
//! scalars for the steps ahead ([`step_choices`]), reading a step's outcome from its scalars
//! ([`read_outcome`]), and the micro-batches' counting.

use fsdp::FsdpError;
use fsdp_kernels::host::{
    AdamW, AdamWChoice, AdamWScalars, AnyPrecisionChoice, AnyPrecisionScalars, STEP_APPLIED,
    STEP_COUNT, STEP_FAULT, STEP_GRAD_NORM, STEP_HALTED, STEP_LOSS,
};
use fsdp_kernels::KernelError;

use crate::device_config::{DeviceTrainConfig, DeviceTrainError};
use crate::device_optim::StepChoices;
use crate::device_train::{Reported, StepOutcome};

/// The optimizer's scalars (AdamW's, or `AnyPrecisionAdamW`'s), without and with weight
/// decay, of optimizer steps `known + 1 ..= known + STEP_CHOICES` (the learning rate of the
/// schedule at the steps taken before each).
pub(crate) fn step_choices(c: &DeviceTrainConfig, known: u64) -> Result<StepChoices, KernelError> {
    let hyper = |decay: bool, j: u64| AdamW {
        lr: c.schedule.lr_at(c.adamw.lr, known + j),
        beta1: c.adamw.beta1,
        beta2: c.adamw.beta2,
        eps: c.adamw.eps,
        weight_decay: if decay { c.adamw.weight_decay } else { 0.0 },
    };
    let step = |j: u64| known + j + 1;
    match c.any_precision {
        None => {
            let set = |decay, j| AdamWScalars::new(&hyper(decay, j), step(j));
            let choice = |decay| -> Result<AdamWChoice, KernelError> {
                Ok(AdamWChoice([set(decay, 0)?, set(decay, 1)?]))
            };
            Ok(StepChoices::AdamW([choice(false)?, choice(true)?]))
        }
        Some(kind) => {
            let set = |decay, j| AnyPrecisionScalars::new(&hyper(decay, j), step(j));
            let choice = |decay| -> Result<AnyPrecisionChoice, KernelError> {
                Ok(AnyPrecisionChoice([set(decay, 0)?, set(decay, 1)?]))
            };
            Ok(StepChoices::AnyPrecision(
                [choice(false)?, choice(true)?],
                kind,
            ))
        }
    }
}

/// The outcome of step `step` from its scalars `v` (read from the device), enqueued when the
/// host knew of `known` optimizer steps; and the optimizer steps taken after it.
///
/// # Errors
/// [`DeviceTrainError::Bookkeeping`] when the device reports a count it was offered no
/// scalars for.
pub(crate) fn read_outcome(
    c: &DeviceTrainConfig,
    step: usize,
    known: u64,
    v: &[f64],
) -> Result<(Reported, u64), DeviceTrainError> {
    let count = v[STEP_COUNT] as u64;
    if v[STEP_FAULT] != 0.0 {
        return Err(DeviceTrainError::Bookkeeping {
            step,
            device: count,
            known,
        });
    }
    let applied = v[STEP_APPLIED] == 1.0;
    let before = count.saturating_sub(u64::from(applied));
    let outcome = StepOutcome {
        loss: v[STEP_LOSS] as f32,
        grad_norm: v[STEP_GRAD_NORM],
        lr: c.schedule.lr_at(c.adamw.lr, before),
        applied,
        halted: v[STEP_HALTED] == 1.0,
        overflow: DeviceTrainConfig::overflowed(v),
        scaler: c.scaler_state(v),
    };
    Ok((Reported { step, outcome }, count))
}

/// `accum` micro-batches a step as the kernels count them (32 bits).
///
/// # Errors
/// A count past 32 bits.
pub(crate) fn accum_u32(accum: usize) -> Result<u32, DeviceTrainError> {
    u32::try_from(accum).map_err(|_| {
        FsdpError::InvalidShape {
            reason: format!("{accum} micro-batches a step do not fit in 32 bits"),
        }
        .into()
    })
}

/// The number of micro-batch `m` of step `step` in the run's stream of micro-batches
/// ([`get_batch`]'s `k`): `step·accum + m`.
///
/// # Errors
/// A number past 64 bits.
pub(crate) fn micro_batch_index(
    step: usize,
    accum: usize,
    m: usize,
) -> Result<u64, DeviceTrainError> {
    step.checked_mul(accum)
        .and_then(|s| s.checked_add(m))
        .map(|k| k as u64)
        .ok_or_else(|| {
            FsdpError::InvalidShape {
                reason: format!("micro-batch {m} of step {step} overflows a 64-bit count"),
            }
            .into()
        })
}
