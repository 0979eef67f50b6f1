//! What `fsdp train` prints as it trains, the same for the sharded engine (`train.rs`) and
//! `--device` (`device_cmd.rs`): the progress bar on a terminal (else a status line at step 0
//! and every tenth of the run), the line of each skipped non-finite step and the error after
//! too many, and the closing `done:` and `skipped` lines.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use crate::say;
use crate::{fail, CliError};

/// The progress of a run of `steps` steps that skips up to `skip_nonfinite` non-finite steps.
/// Shared by the rank threads (only rank 0 reports).
pub(crate) struct Progress {
    bar: ProgressBar,
    /// Standard error is a terminal: the bar is drawn there, and the lines go above it.
    tty: bool,
    steps: usize,
    skip_nonfinite: usize,
}

impl Progress {
    /// The bar of a run of `steps` steps (drawn only on a terminal).
    pub(crate) fn new(steps: usize, skip_nonfinite: usize) -> Self {
        let bar = ProgressBar::new(steps as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Progress {
            bar,
            tty: std::io::stderr().is_terminal(),
            steps,
            skip_nonfinite,
        }
    }

    /// Starts the bar at `step` (a resumed run).
    pub(crate) fn start_at(&self, step: usize) {
        self.bar.set_position(step as u64);
    }

    /// Counts non-finite step `step` (`what` is non-finite) against `--skip-nonfinite`:
    /// `skipped` (the steps skipped so far) goes up by one, or, when it has reached the limit,
    /// the error that stops the run.
    pub(crate) fn count_skip(
        &self,
        step: usize,
        what: &str,
        skipped: &mut usize,
    ) -> Result<(), CliError> {
        if *skipped >= self.skip_nonfinite {
            return Err(nonfinite_error(step, what, *skipped, self.skip_nonfinite));
        }
        *skipped += 1;
        Ok(())
    }

    /// Prints the line of skipped step `step`, the `skipped`-th.
    pub(crate) fn skipped(&self, step: usize, what: &str, skipped: usize) {
        let msg = format!(
            "step {step}: {what}: skipped ({skipped} of --skip-nonfinite {})",
            self.skip_nonfinite
        );
        if self.tty {
            self.bar.println(msg);
        } else {
            say!("{msg}");
        }
    }

    /// Reports finished step `step`: the bar's message on a terminal, else the line at step 0
    /// and every tenth of the run.
    pub(crate) fn status(&self, step: usize, msg: String) {
        if self.tty {
            self.bar.set_message(msg);
            self.bar.inc(1);
        } else if step == 0 || (step + 1) % (self.steps / 10).max(1) == 0 {
            say!("{msg}");
        }
    }

    /// Removes the bar (training is over).
    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }

    /// The closing line of the steps skipped, if any.
    pub(crate) fn say_skipped(&self, skipped: usize) {
        if skipped > 0 {
            say!(
                "skipped {skipped} non-finite step(s) (no optimizer step; gradients discarded; \
                 --skip-nonfinite {})",
                self.skip_nonfinite
            );
        }
    }
}

/// The `done:` line: `steps` steps of `global_tokens` tokens in `elapsed`, the loss of the
/// first and of the last step.
pub(crate) fn say_done(
    steps: usize,
    elapsed: Duration,
    global_tokens: usize,
    first: f32,
    last: f32,
) {
    let secs = elapsed.as_secs_f64();
    say!(
        "done: {steps} steps in {secs:.1} s ({:.0} tokens/s); loss {first:.4} -> {last:.4}",
        global_tokens as f64 * steps as f64 / secs
    );
}

/// What is non-finite in a step, if anything: the global loss (checked first) or the global
/// gradient norm. The norm is not checked when the grad scaler found an overflow
/// (`scaler_overflow`): that step is the scaler's to skip. The loss is always checked: it is
/// computed before any scaling, so a non-finite loss is not the scale's doing.
pub(crate) fn nonfinite(loss: f32, grad_norm: f64, scaler_overflow: bool) -> Option<String> {
    if !loss.is_finite() {
        Some(format!("the loss is {loss}"))
    } else if !scaler_overflow && !grad_norm.is_finite() {
        Some(format!("the gradient norm is {grad_norm}"))
    } else {
        None
    }
}

/// The error that stops a run at a non-finite step (before its optimizer step, so no output
/// is written from non-finite parameters).
fn nonfinite_error(step: usize, what: &str, skipped: usize, skip_nonfinite: usize) -> CliError {
    if skip_nonfinite == 0 {
        fail(format!(
            "step {step}: {what} (non-finite); training stopped and nothing was saved \
             (--skip-nonfinite N skips up to N such steps)"
        ))
    } else {
        fail(format!(
            "step {step}: {what} (non-finite) after {skipped} skipped non-finite step(s) \
             (--skip-nonfinite {skip_nonfinite}); training stopped and nothing was saved"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--skip-nonfinite 2`: two steps are counted, the third is the error naming the step, what
    /// was non-finite and the limit; `--skip-nonfinite 0` stops at the first.
    #[test]
    fn count_skip_stops_after_the_limit() {
        let p = Progress::new(10, 2);
        let mut skipped = 0;
        p.count_skip(3, "the loss is NaN", &mut skipped).unwrap();
        p.count_skip(5, "the loss is NaN", &mut skipped).unwrap();
        assert_eq!(skipped, 2);
        let e = p
            .count_skip(7, "the gradient norm is inf", &mut skipped)
            .unwrap_err();
        assert_eq!(skipped, 2);
        assert_eq!(
            e.msg,
            "step 7: the gradient norm is inf (non-finite) after 2 skipped non-finite step(s) \
             (--skip-nonfinite 2); training stopped and nothing was saved"
        );
        let none = Progress::new(10, 0);
        let mut skipped = 0;
        let e = none
            .count_skip(0, "the loss is inf", &mut skipped)
            .unwrap_err();
        assert_eq!(skipped, 0);
        assert_eq!(
            e.msg,
            "step 0: the loss is inf (non-finite); training stopped and nothing was saved \
             (--skip-nonfinite N skips up to N such steps)"
        );
    }

    #[test]
    fn nonfinite_names_the_loss_first_and_leaves_overflow_to_the_scaler() {
        assert_eq!(nonfinite(1.0, 2.0, false), None);
        assert_eq!(
            nonfinite(f32::NAN, f64::INFINITY, false).as_deref(),
            Some("the loss is NaN")
        );
        assert_eq!(
            nonfinite(1.0, f64::INFINITY, false).as_deref(),
            Some("the gradient norm is inf")
        );
        assert_eq!(nonfinite(1.0, f64::NAN, true), None);
    }
}
