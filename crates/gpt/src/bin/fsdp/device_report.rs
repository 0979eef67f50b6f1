//! What device runs share around the trainer: admission against the device's memory
//! ([`admit`]) and the reading of each step's outcome ([`Tally`]).

use std::time::Instant;

use fsdp::human_bytes;
use fsdp_gpt::device_train::{DeviceTrainConfig, Reported};
use fsdp_kernels::gpt::Attention;

use crate::args::TrainArgs;
use crate::device_cmd::Run;
use crate::output::LossLog;
use crate::progress::{nonfinite, Progress};
use crate::say;
use crate::{fail, CliError};

/// Admission: the plan's peak of device memory, times the `ranks` that share the device,
/// against `--memory-limit`, else the device's free memory (`free`, `None` where it is not
/// known: the host twins), refused with both figures and what needs less.
pub(crate) fn admit(
    args: &TrainArgs,
    run: &Run,
    free: Option<u64>,
    ranks: usize,
) -> Result<(), CliError> {
    let dev = args.device;
    let (available, what) = match (args.memory_limit, free) {
        (Some(limit), _) => (limit, "--memory-limit"),
        (None, Some(free)) => (free, "free on the device"),
        (None, None) => return Ok(()),
    };
    // With the caching allocator's plan, what it reserves for all the ranks (its segments
    // cover their buffers).
    let counted = run.predicted_peak.saturating_mul(ranks as u64);
    let reserved = run
        .predicted_reserved
        .map_or(0, |r| r.saturating_add(run.beside_allocator));
    let needed = counted.max(reserved);
    if needed > available {
        let each = if ranks > 1 {
            format!(
                " ({ranks} ranks of {} each{})",
                human_bytes(run.predicted_peak),
                if needed > counted {
                    ", in the segments the caching allocator reserves"
                } else {
                    ""
                }
            )
        } else {
            String::new()
        };
        return Err(fail(format!(
            "--device {dev}: the run needs {}{each} of device memory at its peak (fsdp plan \
             --device {dev}), {} is {what}; --activation-checkpointing, --cpu-offload or a \
             smaller --batch-size (with --grad-accum) need less",
            human_bytes(needed),
            human_bytes(available)
        )));
    }
    Ok(())
}

/// What the training loop has read of the steps' outcomes.
pub(crate) struct Tally {
    /// The non-finite steps skipped so far.
    pub(crate) skipped: usize,
    /// The first step's loss and the last one read.
    pub(crate) first: f32,
    pub(crate) last: f32,
    /// When the last outcome arrived.
    pub(crate) arrived_at: Instant,
}

impl Default for Tally {
    fn default() -> Tally {
        Tally {
            skipped: 0,
            first: f32::NAN,
            last: f32::NAN,
            arrived_at: Instant::now(),
        }
    }
}

impl Tally {
    /// Step `r.step`'s outcome: counted against `--skip-nonfinite` (the error that stops the
    /// run past it), logged with the tokens a second since the outcome before it arrived.
    pub(crate) fn report(
        &mut self,
        r: Reported,
        progress: &Progress,
        log: Option<&mut LossLog>,
        global_tokens: usize,
        peak: u64,
    ) -> Result<(), CliError> {
        let (step, o) = (r.step, r.outcome);
        if let Some(what) = skipped_for(&o) {
            progress.count_skip(step, &what, &mut self.skipped)?;
            progress.skipped(step, &what, self.skipped);
        }
        let now = Instant::now();
        let dt = (now - self.arrived_at).as_secs_f64();
        self.arrived_at = now;
        let tps = global_tokens as f64 / dt;
        if self.first.is_nan() {
            self.first = o.loss;
        }
        self.last = o.loss;
        if let Some(log) = log {
            log.step(step, o.loss, tps, peak);
        }
        progress.status(
            step,
            format!("step {step} loss {:.4} {tps:.0} tok/s", o.loss),
        );
        Ok(())
    }
}

/// Why a step that took no optimizer step counts against `--skip-nonfinite`: its loss or norm
/// is not finite, or the trainer halted; `None` for an applied step and for the grad scaler's
/// own skip of gradients that overflowed under a finite loss (the engine's rule).
pub(crate) fn skipped_for(o: &fsdp_gpt::device_train::StepOutcome) -> Option<String> {
    if o.applied {
        return None;
    }
    match nonfinite(o.loss, o.grad_norm, o.overflow) {
        None if o.overflow => None,
        what => Some(what.unwrap_or_else(|| "the step is not finite".to_string())),
    }
}

/// The run's lines on how its step computes: the products (with bf16 or f16 ones, `dtype`),
/// the attention's and the logits' chunks.
pub(crate) fn say_layers(dtype: fsdp_device::DType, config: &DeviceTrainConfig) {
    if let Some(h) = crate::device_cmd::products(dtype).half() {
        let h = crate::run_config::dtype_option(h);
        say!(
            "products: {h} operands, f32 sums and results (every other layer in f32; the \
             activations only products read are kept in {h})"
        );
    }
    let attention = if config.attention == Attention::Fused {
        "fused, the probabilities computed again in backward tile by tile".to_string()
    } else if config.attention.keeps_probabilities() {
        "materialized, the probabilities kept for backward".to_string()
    } else {
        format!(
            "{}, the probabilities computed again in backward",
            config.attention
        )
    };
    say!("attention: {attention}; logits: {}", config.logits);
    if let Some(a) = config.any_precision {
        let d = crate::run_config::dtype_option;
        say!(
            "optimizer: AnyPrecisionAdamW ({} parameter values{}, {} moments, Kahan summation \
             {})",
            d(a.param),
            if a.param == fsdp_device::DType::BF16 {
                " in f32 buffers"
            } else {
                ""
            },
            d(a.state),
            if a.kahan {
                format!("on into a {} buffer", d(a.state))
            } else {
                "off".into()
            }
        );
    }
}
