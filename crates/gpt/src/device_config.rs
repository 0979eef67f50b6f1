//! The settings and errors of the [`DeviceTrainer`](crate::device_train::DeviceTrainer), and
//! the seeded weights it starts from (re-exported by [`device_train`](crate::device_train)).

use std::borrow::Cow;
use std::collections::HashMap;

use fsdp::engine::{GradScalerConfig, GradScalerState};
use fsdp::init::materialize;
use fsdp::optim::{check_max_norm, AdamWConfig, LrSchedule};
use fsdp::FsdpError;
use fsdp_device::half::bf16;
use fsdp_device::DType;
use fsdp_kernels::gpt::{Attention, GptDims, Logits};
use fsdp_kernels::host::{
    step_scalars, AnyPrecision, ScalerRule, STEP_CHOICES, STEP_COUNT, STEP_FOUND_INF,
    STEP_GROWTH_TRACKER, STEP_NONFINITE, STEP_SCALE, STEP_SCALER_SKIPPED,
};
use fsdp_kernels::KernelError;

use crate::device_units::{DeviceWrap, UnitLayout};
use crate::init::gpt2_init;
use crate::model::{param_specs, GptConfig};

/// An error of the device trainer: a setting or batch the engine's rules refuse, or a device
/// operation that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceTrainError {
    /// An invalid setting, token stream or batch (the engine's own errors).
    #[error(transparent)]
    Fsdp(#[from] FsdpError),
    /// A device operation (allocation, copy, kernel, cuBLAS) failed or was given bad shapes.
    #[error("device: {0}")]
    Kernel(#[from] KernelError),
    /// A collective of sharded training failed (its error names the ranks and what differed
    /// or timed out).
    #[error("collective: {0}")]
    Collective(#[from] fsdp_collectives::CollectiveError),
    /// A step whose loss or gradient norm is not finite where every step must be (the
    /// benchmark's [`time_steps`](crate::device_bench::time_steps)).
    #[error("step {step} is not finite: loss {loss}, gradient norm {grad_norm}")]
    NotFinite {
        /// The step.
        step: usize,
        /// Its loss.
        loss: f32,
        /// Its global gradient norm.
        grad_norm: f64,
    },
    /// [`DeviceTrainer::step`](crate::device_train::DeviceTrainer::step) while the outcome of
    /// a step enqueued by
    /// [`enqueue_step`](crate::device_train::DeviceTrainer::enqueue_step) is unread.
    #[error(
        "the outcome of step {step} is still unread: call flush() before step(), or keep to \
         enqueue_step()"
    )]
    Unread {
        /// The enqueued step.
        step: usize,
    },
    /// The device's optimizer step count was not one the host offered AdamW's scalars for.
    #[error(
        "step {step}: the device counted {device} optimizer steps where the host knew of \
         {known} (and at most {} more); nothing was applied",
        STEP_CHOICES - 1
    )]
    Bookkeeping {
        /// The step.
        step: usize,
        /// The count on the device.
        device: u64,
        /// The count the host knew.
        known: u64,
    },
}

impl DeviceTrainError {
    /// Whether this rank failed *because a peer left* (a collective's
    /// [`caused_by_peer`](fsdp_collectives::CollectiveError::caused_by_peer)), so that a
    /// launcher blames the rank whose failure was primary.
    ///
    /// ```
    /// use fsdp_collectives::CollectiveError;
    /// use fsdp_gpt::device_train::DeviceTrainError;
    /// let left = CollectiveError::PeerDeparted { rank: 0, peer: 2, op: "all_gather_base", seq: 7 };
    /// assert!(DeviceTrainError::from(left).caused_by_peer());
    /// assert!(!DeviceTrainError::Unread { step: 3 }.caused_by_peer());
    /// ```
    pub fn caused_by_peer(&self) -> bool {
        match self {
            DeviceTrainError::Collective(e) => e.caused_by_peer(),
            DeviceTrainError::Fsdp(e) => e.caused_by_peer(),
            _ => false,
        }
    }
}

impl From<fsdp_device::DeviceError> for DeviceTrainError {
    fn from(e: fsdp_device::DeviceError) -> Self {
        DeviceTrainError::Kernel(e.into())
    }
}

/// What one run of the trainer does: the model, AdamW's hyperparameters, the learning-rate
/// schedule, the weight-decay groups, clipping and the batch, as `fsdp train` gives them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceTrainConfig {
    /// The model.
    pub cfg: GptConfig,
    /// AdamW's hyperparameters (`lr` is the schedule's base learning rate).
    pub adamw: AdamWConfig,
    /// The learning-rate schedule.
    pub schedule: LrSchedule,
    /// Weight decay only for parameters of 2 or more dimensions (nanoGPT's groups).
    pub decay_2d_only: bool,
    /// Clip the global gradient norm to this (`None`: no clipping).
    pub grad_clip: Option<f64>,
    /// Rows of a step (all micro-batches).
    pub batch_size: usize,
    /// Micro-batches per step; divides `batch_size`.
    pub grad_accum: usize,
    /// CPU offload (FSDP's `CPUOffload(offload_params=True)`): the master parameters, the
    /// gradient accumulators and AdamW's moments live in host memory and the optimizer step
    /// runs on the host (the kernels' twins); the device holds the working parameters (the
    /// updated ones copied in after each optimizer step), one micro-batch's gradients (copied
    /// out after its backward) and the activations. The same training, bitwise on the host
    /// twins.
    pub offload: bool,
    /// Activation checkpointing of every block
    /// ([`DeviceGpt::set_activation_checkpointing`](fsdp_kernels::gpt::DeviceGpt::set_activation_checkpointing)): forward keeps each block's input only and
    /// backward recomputes the block's forward. The same training bit for bit, with the
    /// activations of one block held at a time.
    pub activation_checkpointing: bool,
    /// How the blocks' attention holds its `t × t` scores and probabilities
    /// ([`Attention`]; by default in chunks of 64 MiB, computed again in backward rather than
    /// kept): the same training bit for bit on the host twins either way.
    pub attention: Attention,
    /// How the head holds its `tokens × vocabulary` logits ([`Logits`]; by default in chunks
    /// of 256 MiB of logits, each chunk's cross-entropy and backward before the next's): the
    /// same losses bit for bit on the host twins either way, the tied weight's gradient summed
    /// chunk by chunk.
    pub logits: Logits,
    /// The dtype sharded training reduces the gradients in (FSDP's
    /// `MixedPrecisionPolicy.reduce_dtype`): f32, or bf16 or f16 — each unit's gradients
    /// rounded to that type before its reduce-scatter (or the all-reduce of replicated ones,
    /// and the replicas' all-reduce of a hybrid strategy), reduced with its rounding after
    /// every operation, and widened into the f32 accumulators, so the collectives move half
    /// the bytes while the accumulators, the norm and AdamW stay f32. With a grad scaler the
    /// gradients are reduced scaled (the seed is), as PyTorch's are; an f16 reduction that
    /// overflows is the scaler's skip. One rank reduces nothing.
    pub reduce_dtype: DType,
    /// torchdistx's `AnyPrecisionAdamW` instead of AdamW (`None`: AdamW with f32 moments),
    /// with `adamw`'s hyperparameters: its momentum, variance and (with Kahan summation) its
    /// compensation stored in `state` (bf16: 2 bytes an element), and the parameters' values
    /// rounded to `param` — with bf16 the trainer keeps the values of bf16 shards (pure-bf16
    /// training: the initial parameters are rounded too) in its f32 buffers, which the
    /// kernels read.
    pub any_precision: Option<AnyPrecision>,
    /// Dynamic loss scaling (PyTorch's `GradScaler` as the engine's
    /// [`GradScaler`](fsdp::engine::GradScaler) runs it; `None`, or a configuration not
    /// `enabled`: off). The scale lives on the device with the step's scalars: each
    /// micro-batch's backward starts from the cross-entropy's gradient seed times the scale,
    /// the norm and AdamW see the gradients unscaled, and a step whose scaled gradients
    /// overflowed is skipped and the scale backed off, all decided on the device
    /// ([`step_decide`](fsdp_kernels::host::step_decide)). With f32 or bf16 products and a
    /// power-of-two scale the training is bitwise that without the scaler, unless a step
    /// overflows.
    pub grad_scaler: Option<GradScalerConfig>,
    /// Which tensors sharded training gathers, frees and reduces together (the FSDP units of
    /// a wrap policy; by default the root and each block): the same training bit for bit
    /// under any policy, its collectives grouped and its memory held differently. One rank
    /// holds every tensor throughout.
    pub wrap: DeviceWrap,
}

impl DeviceTrainConfig {
    /// Checks the settings with the engine's rules.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`], [`FsdpError::InvalidShape`] or
    /// [`FsdpError::InvalidFsdpConfig`] naming the setting.
    pub fn validate(&self) -> Result<(), FsdpError> {
        self.adamw.validate()?;
        self.schedule.validate()?;
        if let Some(c) = self.grad_clip {
            check_max_norm(c)?;
        }
        crate::device_comm::reduces_in_half("reduce_dtype", self.reduce_dtype)?;
        if let Some(g) = self.grad_scaler.filter(|g| g.enabled) {
            g.validate()?;
        }
        if let Some(a) = self.any_precision {
            a.validate().map_err(|e| FsdpError::InvalidFsdpConfig {
                reason: format!("AnyPrecisionAdamW: {e}"),
            })?;
        }
        if self.wrap != DeviceWrap::Block {
            // A size policy can split a tie: its error before anything is made. (The block
            // plan cannot fail, and sizes too large to count are the plans' errors.)
            UnitLayout::new(&self.cfg, self.wrap)?;
        }
        if self.batch_size == 0 || self.grad_accum == 0 || self.batch_size % self.grad_accum != 0 {
            return Err(FsdpError::InvalidShape {
                reason: format!(
                    "batch size {} in {} micro-batches: both must be positive and the second \
                     divide the first",
                    self.batch_size, self.grad_accum
                ),
            });
        }
        Ok(())
    }

    /// `params` as the trainer starts from them: rounded to bf16 under `AnyPrecisionAdamW`
    /// with bf16 parameters (its shards' dtype), else unchanged.
    pub fn rounded_params<'a>(
        &self,
        params: &'a HashMap<String, Vec<f32>>,
    ) -> Cow<'a, HashMap<String, Vec<f32>>> {
        match self.any_precision {
            Some(a) if a.param == DType::BF16 => Cow::Owned(
                params
                    .iter()
                    .map(|(name, v)| {
                        let r = v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
                        (name.clone(), r)
                    })
                    .collect(),
            ),
            _ => Cow::Borrowed(params),
        }
    }

    /// The dtype the optimizer's state is stored in: f32 (AdamW's moments), or
    /// `AnyPrecisionAdamW`'s state dtype.
    pub fn state_dtype(&self) -> DType {
        self.any_precision.map_or(DType::F32, |a| a.state)
    }

    /// The dtype sharded training all-gathers the parameters in: bf16 where every
    /// parameter's value is a bf16 (`AnyPrecisionAdamW` with bf16 parameters: pure-bf16
    /// training, whose shards the engine stores and gathers in bf16), so that the gathers
    /// move half the bytes and give the same values; else f32.
    pub fn gather_dtype(&self) -> DType {
        match self.any_precision {
            Some(a) if a.param == DType::BF16 => DType::BF16,
            _ => DType::F32,
        }
    }

    /// The decision's loss-scaling settings: `None` without an enabled grad scaler.
    pub fn scaler_rule(&self) -> Option<ScalerRule> {
        self.grad_scaler.filter(|g| g.enabled).map(|g| ScalerRule {
            growth_factor: g.growth_factor,
            backoff_factor: g.backoff_factor,
            growth_interval: g.growth_interval,
        })
    }

    /// A step's scalars for `tensors` gradient tensors when training starts or resumes after
    /// `optimizer_steps` steps with `skipped` non-finite ones: with a grad scaler, its state
    /// `scaler` (a new scaler's when `None`: its initial scale).
    pub(crate) fn start_scalars(
        &self,
        tensors: usize,
        optimizer_steps: u64,
        skipped: u64,
        scaler: Option<GradScalerState>,
    ) -> Vec<f64> {
        let state = scaler
            .or(self.initial_scaler_state())
            .filter(|_| self.scaler_rule().is_some())
            .map(|s| (s.scale, s.growth_tracker, s.skipped_steps));
        let mut v = step_scalars(tensors, state);
        v[STEP_COUNT] = optimizer_steps as f64;
        v[STEP_NONFINITE] = skipped as f64;
        v
    }

    /// A new grad scaler's state (its initial scale): `None` without one.
    pub(crate) fn initial_scaler_state(&self) -> Option<GradScalerState> {
        self.grad_scaler
            .filter(|g| g.enabled)
            .map(|g| GradScalerState {
                scale: g.init_scale,
                growth_tracker: 0,
                skipped_steps: 0,
            })
    }

    /// The grad scaler's state after a step, from the step's scalars `v`: `None` without one.
    pub(crate) fn scaler_state(&self, v: &[f64]) -> Option<GradScalerState> {
        self.scaler_rule().map(|_| GradScalerState {
            scale: v[STEP_SCALE] as f32,
            growth_tracker: v[STEP_GROWTH_TRACKER] as u32,
            skipped_steps: v[STEP_SCALER_SKIPPED] as u64,
        })
    }

    /// Whether the step of scalars `v` overflowed under the grad scaler (its skip).
    pub(crate) fn overflowed(v: &[f64]) -> bool {
        v[STEP_FOUND_INF] == 1.0
    }

    /// The model's shape as the kernels' model takes it.
    pub fn dims(&self) -> GptDims {
        self.cfg.dims()
    }
}

impl GptConfig {
    /// The model's shape as `fsdp-kernels`' GPT takes it ([`GptDims`]).
    pub fn dims(&self) -> GptDims {
        GptDims {
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            block_size: self.block_size,
            vocab_size: self.vocab_size,
        }
    }
}

/// Every parameter of `cfg` whole, as the engine's seeded initialisation
/// (`ParamInit::Seeded` with [`gpt2_init`] and `seed`) fills its shards: the same model.
///
/// # Errors
/// A parameter the rule does not cover; a size that overflows.
pub fn seeded_params(cfg: &GptConfig, seed: u64) -> Result<HashMap<String, Vec<f32>>, FsdpError> {
    let rule = gpt2_init(cfg.n_layer);
    param_specs(cfg)
        .into_iter()
        .map(|p| {
            let init = rule(&p.name, &p.shape)?;
            let v = materialize(&p.name, &p.shape, &init, seed)?;
            Ok((p.name, v))
        })
        .collect()
}
