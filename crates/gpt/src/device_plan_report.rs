//! How a [`DeviceMemoryPlan`](super::DeviceMemoryPlan) prints: its table of what the
//! trainer holds, the attention's and the logits' chunks, and the peak with its parts.

use std::fmt;

use fsdp_device::DType;
use fsdp_kernels::gpt::{Attention, Logits};

use super::DeviceMemoryPlan;

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

impl fmt::Display for DeviceMemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "device memory (one rank, no sharding; micro-batch {} × {} tokens), bytes:",
            self.rows, self.tokens_per_row
        )?;
        // The optimizer and its state's dtype.
        let state = match self.any_precision {
            None => "AdamW, f32".to_string(),
            Some(a) if a.state == DType::BF16 => "AnyPrecisionAdamW, bf16".to_string(),
            Some(_) => "AnyPrecisionAdamW, f32".to_string(),
        };
        let rows = [
            (
                "parameters",
                self.parameters,
                format!("{} elements, f32", self.param_elements),
            ),
            (
                "gradients",
                self.gradients,
                "the model's, of each micro-batch".into(),
            ),
            (
                "accumulators",
                self.accumulators,
                if self.accumulators == 0 && self.offloaded == 0 {
                    "none: one micro-batch a step, AdamW reads the model's gradients".into()
                } else {
                    "the step's gradient".into()
                },
            ),
            ("exp_avg", self.exp_avg, state.clone()),
            ("exp_avg_sq", self.exp_avg_sq, state.clone()),
            ("compensation", self.compensation, state),
            (
                "bf16 operands",
                self.bf16_operands,
                "the two kept operand copies of the products".into(),
            ),
            (
                "step scalars",
                self.step_scalars,
                "f64: the loss, the norm, the decision, each gradient's sum of squares".into(),
            ),
            (
                "activations",
                self.tape,
                if self.activation_checkpointing {
                    "each block's input and ln_f's, kept by forward (activation checkpointing: \
                     backward recomputes one block at a time)"
                        .into()
                } else if self.bf16_operands > 0 {
                    "saved by one micro-batch's forward for backward; those only products \
                     read in bf16"
                        .into()
                } else {
                    "saved by one micro-batch's forward for backward".into()
                },
            ),
        ];
        let t = self.tokens_per_row;
        let attention = if self.attention == Attention::Fused {
            format!(
                "attention: fused, no {t} × {t} matrix; each block's {} × {t} rows' \
                 log-sum-exp kept for backward",
                self.attention_pairs
            )
        } else if self.attention.keeps_probabilities() {
            format!(
                "attention: materialized, each block's {} × {t} × {t} probabilities kept for \
                 backward",
                self.attention_pairs
            )
        } else {
            format!(
                "attention: {}, {} (sequence, head) pairs' {t} × {t} matrices at a time, \
                 computed again in backward",
                self.attention, self.attention_pairs
            )
        };
        for (name, bytes, what) in rows {
            if name == "compensation" && bytes == 0 {
                continue;
            }
            writeln!(f, "  {name:<18} {bytes:>14}  {:>11}  ({what})", mib(bytes))?;
        }
        writeln!(f, "  {attention}")?;
        if self.logits == Logits::Whole {
            writeln!(f, "  logits: whole, {} tokens' at once", self.logit_tokens)?;
        } else {
            writeln!(
                f,
                "  logits: {}, {} tokens' at a time, each chunk's cross-entropy and backward \
                 before the next's",
                self.logits, self.logit_tokens
            )?;
        }
        if self.offloaded > 0 {
            writeln!(
                f,
                "  {:<18} {:>14}  {:>11}  (CPU offload: master parameters, accumulators and \
                 AdamW's moments, in host memory)",
                "offloaded to host",
                self.offloaded,
                mib(self.offloaded)
            )?;
            writeln!(
                f,
                "  {:<18} {:>14}  {:>11}  (CPU offload: page-locked host memory of the copies, \
                 gradients and parameters)",
                "host staging",
                self.host_staging,
                mib(self.host_staging)
            )?;
        }
        writeln!(
            f,
            "peak: {} bytes ({}) at {}: held throughout {} + activations {} + working buffers \
             {} + ids {}",
            self.peak,
            mib(self.peak),
            self.peak_moment,
            self.persistent(),
            self.peak_tape,
            self.peak_working,
            self.peak_ids
        )
    }
}
