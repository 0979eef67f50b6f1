//! Training the reference GPT on one device, without the sharded engine: [`DeviceTrainer`],
//! generic over [`GptOps`] (`fsdp-kernels`' [`HostOps`], the
//! kernels' host twins, or [`CudaOps`](fsdp_kernels::gpt::CudaOps), NVRTC kernels and cuBLAS on
//! one CUDA stream). It is what `fsdp train --device cuda` runs, and it follows `fsdp train
//! --ranks 1` (the engine, [`FsdpGpt`](crate::runtime::FsdpGpt)) step for step:
//!
//! - the same initial weights: [`seeded_params`] materialises every tensor whole with the
//!   engine's seeded rule ([`gpt2_init`], [`fsdp::init::materialize`], which every sharded fill
//!   reproduces bitwise), uploaded once;
//! - the same batches: [`get_batch`] of the same token stream, micro-batch `step·accum + m`;
//! - gradient accumulation into buffers of its own: [`DeviceGpt::step`] overwrites its
//!   gradients, so each micro-batch's (of its mean loss) is added as `acc += g / accum` by
//!   [`GptOps::axpby`] (the engine sums the micro-batches' gradients of `sum / global_tokens`:
//!   the same value up to rounding); with one micro-batch a step the optimizer reads the
//!   model's gradients themselves (`0 + 1·g` is `g`), and no accumulators are allocated on the
//!   device;
//! - the global gradient norm from [`GptOps::sum_of_squares`] of every tensor, and with
//!   clipping every gradient scaled by `max_norm / (norm + 1e-6)` when that is below 1
//!   ([`GptOps::scale`]), as [`Fsdp::clip_grad_norm`](fsdp::engine::Fsdp::clip_grad_norm);
//! - AdamW with one state (two f32 moments) per parameter tensor on the device, the fused
//!   kernel ([`GptOps::adamw`], bitwise the engine's host AdamW), the learning rate of the
//!   schedule computed on the host as the engine does ([`LrSchedule::lr_at`] at the number of
//!   optimizer steps taken), and nanoGPT's weight-decay groups with `decay_2d_only`;
//! - a step whose loss or gradient norm is not finite takes no optimizer step (the caller
//!   stops or counts it skipped, as `fsdp train` does with the engine);
//! - with [`DeviceTrainConfig::offload`] (CPU offload, PyTorch's
//!   `CPUOffload(offload_params=True)`) the master parameters, the accumulators and AdamW's
//!   moments live on the host and the norm, clipping and AdamW run there on the kernels' host
//!   twins (bitwise the kernels'): each micro-batch's gradients are copied out after its
//!   backward and the updated parameters copied into the device's after the optimizer step,
//!   so the device holds parameters, one micro-batch's gradients and activations only. The
//!   copies are plain (pageable, each waiting for the stream), not yet pinned and overlapped.
//!
//! Its device memory is counted ([`DeviceTrainer::memory`]) and predicted
//! ([`plan_memory`](crate::device_plan::plan_memory), exactly: `tests/device_plan.rs`).
//!
//! The losses differ from the engine's only by rounding (the kernels' order of sums, the
//! micro-batch scaling): `tests/device_train.rs` holds them within 1e-4 relative.

use std::collections::HashMap;

use fsdp::init::materialize;
use fsdp::optim::{
    check_max_norm, clip_coefficient, decay_2d_only_group, AdamWConfig, LrSchedule, DECAY_GROUP,
};
use fsdp::FsdpError;
use fsdp_kernels::gpt::{
    param_shapes, DeviceGpt, GptDims, GptOps, HostBuf, HostOps, MemoryUse, Weights,
};
use fsdp_kernels::host::{AdamW, AdamWScalars};
use fsdp_kernels::KernelError;

use crate::data::get_batch;
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
    /// ([`DeviceGpt::set_activation_checkpointing`]): forward keeps each block's input only and
    /// backward recomputes the block's forward. The same training bit for bit, with the
    /// activations of one block held at a time.
    pub activation_checkpointing: bool,
}

impl DeviceTrainConfig {
    /// Checks the settings with the engine's rules.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] or [`FsdpError::InvalidShape`] naming the setting.
    pub fn validate(&self) -> Result<(), FsdpError> {
        self.adamw.validate()?;
        self.schedule.validate()?;
        if let Some(c) = self.grad_clip {
            check_max_norm(c)?;
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

    /// The model's shape as the kernels' model takes it.
    pub fn dims(&self) -> GptDims {
        GptDims {
            n_layer: self.cfg.n_layer,
            n_head: self.cfg.n_head,
            n_embd: self.cfg.n_embd,
            block_size: self.cfg.block_size,
            vocab_size: self.cfg.vocab_size,
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

/// What one [`DeviceTrainer::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// The step's loss: the mean cross-entropy over all its tokens (every micro-batch).
    pub loss: f32,
    /// The global L2 norm of the accumulated gradients, before clipping.
    pub grad_norm: f64,
    /// The learning rate of the optimizer step (the schedule's at the steps taken before).
    pub lr: f64,
    /// Whether the optimizer stepped: `false` when the loss or the norm is not finite.
    pub applied: bool,
}

/// The reference GPT, its gradient accumulators and its AdamW state on one device (see the
/// [module](self) documentation).
pub struct DeviceTrainer<O: GptOps> {
    model: DeviceGpt<O>,
    config: DeviceTrainConfig,
    /// Where the optimizer's side lives: on the device, or offloaded to the host.
    state: Placement<O>,
    /// Per parameter, in [`param_shapes`] order: whether weight decay applies.
    decays: Vec<bool>,
    optimizer_steps: u64,
}

/// The step's gradient accumulators (none on the device with one micro-batch a step: the
/// model's gradients serve) and AdamW's moments, on one side.
struct Optim<B> {
    acc: Option<Weights<B>>,
    exp_avg: Weights<B>,
    exp_avg_sq: Weights<B>,
}

impl<B> Optim<B> {
    fn zeros<P: GptOps<Buf = B>>(
        ops: &P,
        dims: &GptDims,
        accumulators: bool,
    ) -> Result<Optim<B>, KernelError> {
        Ok(Optim {
            acc: if accumulators {
                Some(Weights::try_build(dims, |_, len| ops.zeros(len))?)
            } else {
                None
            },
            exp_avg: Weights::try_build(dims, |_, len| ops.zeros(len))?,
            exp_avg_sq: Weights::try_build(dims, |_, len| ops.zeros(len))?,
        })
    }
}

/// CPU offload's host side: the master parameters and the optimizer on the host twins.
struct HostSide {
    ops: HostOps,
    params: Weights<HostBuf>,
    optim: Optim<HostBuf>,
}

/// The optimizer's side of a [`DeviceTrainer`].
enum Placement<O: GptOps> {
    /// On the device, beside the model.
    Device(Optim<O::Buf>),
    /// CPU offload: the master parameters and the optimizer on the host twins.
    Host(Box<HostSide>),
}

impl<O: GptOps> DeviceTrainer<O> {
    /// The model of `config` on `ops`' device with `params` uploaded (every parameter by
    /// nanoGPT's name: [`seeded_params`] or a checkpoint's), zero moments and no step taken.
    ///
    /// # Errors
    /// Invalid settings; a missing or mis-sized parameter; allocation and copy failures.
    pub fn new(
        ops: O,
        config: DeviceTrainConfig,
        params: &HashMap<String, Vec<f32>>,
    ) -> Result<DeviceTrainer<O>, DeviceTrainError> {
        config.validate()?;
        let dims = config.dims();
        let mut model = DeviceGpt::new(ops, dims, params)?;
        model.set_activation_checkpointing(config.activation_checkpointing);
        let state = if config.offload {
            let host = HostOps::new();
            let master = Weights::try_build(&dims, |name, len| {
                // `DeviceGpt::new` checked every parameter; checked again, never a panic.
                match params.get(name) {
                    Some(p) if p.len() == len => host.upload(p),
                    _ => Err(KernelError::InvalidArgument {
                        kernel: "offload",
                        reason: format!("parameter {name} missing or not of {len} elements"),
                    }),
                }
            })?;
            let optim = Optim::zeros(&host, &dims, true)?;
            Placement::Host(Box::new(HostSide {
                ops: host,
                params: master,
                optim,
            }))
        } else {
            Placement::Device(Optim::zeros(model.ops(), &dims, config.grad_accum > 1)?)
        };
        let decays = param_shapes(&dims)
            .iter()
            .map(|(_, shape)| !config.decay_2d_only || decay_2d_only_group(shape) == DECAY_GROUP)
            .collect();
        Ok(DeviceTrainer {
            model,
            config,
            state,
            decays,
            optimizer_steps: 0,
        })
    }

    /// The settings.
    pub fn config(&self) -> &DeviceTrainConfig {
        &self.config
    }

    /// Optimizer steps taken (steps whose loss and norm were finite).
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps
    }

    /// The operations.
    pub fn ops(&self) -> &O {
        self.model.ops()
    }

    /// The device memory the trainer's operations hold now and their peak since they were
    /// made ([`GptOps::memory`]): what [`plan_memory`](crate::device_plan::plan_memory)
    /// predicts.
    pub fn memory(&self) -> MemoryUse {
        self.ops().memory()
    }

    /// The peak of [`memory`](Self::memory), in bytes.
    pub fn peak_bytes(&self) -> u64 {
        self.memory().peak
    }

    /// Training step `step` (0 for the first) on the token stream `tokens`: forward and
    /// backward of micro-batches `step·accum … step·accum + accum − 1` ([`get_batch`], world 1),
    /// their gradients accumulated, the global norm (clipped if set), then AdamW, unless the
    /// loss or the norm is not finite.
    ///
    /// # Errors
    /// A token stream too short or holding ids outside the vocabulary; device failures.
    pub fn step(&mut self, tokens: &[u16], step: usize) -> Result<StepOutcome, DeviceTrainError> {
        let c = self.config;
        let (accum, t) = (c.grad_accum, c.cfg.block_size);
        let micro = c.batch_size / accum;
        let alpha = (1.0 / accum as f64) as f32;
        match &mut self.state {
            Placement::Device(optim) => {
                if let Some(acc) = &mut optim.acc {
                    zero_all(self.model.ops(), acc)?;
                }
            }
            Placement::Host(h) => {
                if let Some(acc) = &mut h.optim.acc {
                    zero_all(&h.ops, acc)?;
                }
            }
        }
        let mut loss = 0.0f32;
        for m in 0..accum {
            let k = step
                .checked_mul(accum)
                .and_then(|s| s.checked_add(m))
                .ok_or_else(|| FsdpError::InvalidShape {
                    reason: format!("micro-batch {m} of step {step} overflows a 64-bit count"),
                })? as u64;
            let b = get_batch(tokens, k, micro, t, 0, 1)?;
            let l = self.model.step(&b.inputs, &b.targets, b.shape.rows, t)?;
            // The engine's loss of a micro-batch: its token sum over the step's tokens.
            loss += (f64::from(l) / accum as f64) as f32;
            let (ops, _, grads) = self.model.parts_mut();
            match &mut self.state {
                // Without accumulators (one micro-batch) the model's gradients are the step's.
                Placement::Device(Optim { acc: None, .. }) => {}
                Placement::Device(Optim { acc: Some(acc), .. }) => {
                    for (a, (_, g)) in acc.all_mut().into_iter().zip(grads.named()) {
                        ops.axpby(alpha, g, 1.0, a)?;
                    }
                }
                Placement::Host(h) => {
                    // Offload: each gradient copied out after the backward, accumulated on
                    // the host.
                    // `HostOps::axpby` is `host::axpby`: the downloaded values need no
                    // host buffer of their own.
                    let acc = h
                        .optim
                        .acc
                        .as_mut()
                        .ok_or_else(|| KernelError::InvalidArgument {
                            kernel: "offload",
                            reason: "the host side has no accumulators".into(),
                        })?;
                    for (a, (_, g)) in acc.all_mut().into_iter().zip(grads.named()) {
                        fsdp_kernels::host::axpby(alpha, &ops.download(g)?, 1.0, a)?;
                    }
                }
            }
        }
        let lr = c.schedule.lr_at(c.adamw.lr, self.optimizer_steps);
        let n = self.optimizer_steps + 1;
        let hyper = |decay: bool| AdamW {
            lr,
            beta1: c.adamw.beta1,
            beta2: c.adamw.beta2,
            eps: c.adamw.eps,
            weight_decay: if decay { c.adamw.weight_decay } else { 0.0 },
        };
        let finite = |norm: f64| loss.is_finite() && norm.is_finite();
        let (grad_norm, applied) = match &mut self.state {
            Placement::Device(optim) => {
                let (ops, params, model_grads) = self.model.parts_mut();
                optimizer_step(
                    ops,
                    params,
                    Some(model_grads),
                    optim,
                    &self.decays,
                    c.grad_clip,
                    finite,
                    |d| AdamWScalars::new(&hyper(d), n),
                )?
            }
            Placement::Host(h) => {
                let HostSide {
                    ops: host,
                    params: master,
                    optim,
                } = &mut **h;
                let r = optimizer_step(
                    host,
                    master,
                    None,
                    optim,
                    &self.decays,
                    c.grad_clip,
                    finite,
                    |d| AdamWScalars::new(&hyper(d), n),
                )?;
                if r.1 {
                    // Offload: the updated parameters copied into the device's working ones.
                    let (ops, params, _) = self.model.parts_mut();
                    for (p, (_, h)) in params.all_mut().into_iter().zip(master.named()) {
                        ops.upload_into(h, p)?;
                    }
                }
                r
            }
        };
        if applied {
            self.optimizer_steps = n;
        }
        Ok(StepOutcome {
            loss,
            grad_norm,
            lr,
            applied,
        })
    }

    /// Every parameter on the host, by name.
    ///
    /// # Errors
    /// Copy failures.
    pub fn full_params(&self) -> Result<HashMap<String, Vec<f32>>, DeviceTrainError> {
        Ok(self.model.download_params()?.into_iter().collect())
    }
}

/// Zero every buffer of `w`.
fn zero_all<P: GptOps>(ops: &P, w: &mut Weights<P::Buf>) -> Result<(), KernelError> {
    for b in w.all_mut() {
        ops.fill_zero(b)?;
    }
    Ok(())
}

/// The end of a step on one side (the device, or the host under offload): the global norm of
/// the step's gradients — the accumulators, or without them `model_grads` — (clipped when
/// set), then AdamW with `scalars(decays)` per parameter when `finite(norm)` holds. Returns the
/// norm and whether AdamW ran.
#[allow(clippy::too_many_arguments)]
fn optimizer_step<P: GptOps>(
    ops: &P,
    params: &mut Weights<P::Buf>,
    model_grads: Option<&mut Weights<P::Buf>>,
    optim: &mut Optim<P::Buf>,
    decays: &[bool],
    grad_clip: Option<f64>,
    finite: impl Fn(f64) -> bool,
    scalars: impl Fn(bool) -> Result<AdamWScalars, KernelError>,
) -> Result<(f64, bool), DeviceTrainError> {
    let grads = match (&mut optim.acc, model_grads) {
        (Some(acc), _) => acc,
        (None, Some(g)) => g,
        (None, None) => {
            return Err(DeviceTrainError::Kernel(KernelError::InvalidArgument {
                kernel: "adamw",
                reason: "the optimizer step has no gradients (no accumulators, no model's)".into(),
            }))
        }
    };
    let mut sq = 0.0f64;
    for (_, a) in grads.named() {
        sq += ops.sum_of_squares(a)?;
    }
    let grad_norm = sq.sqrt();
    if let Some(coef) = grad_clip.and_then(|m| clip_coefficient(m, grad_norm)) {
        for a in grads.all_mut() {
            ops.scale(coef, a)?;
        }
    }
    if !finite(grad_norm) {
        return Ok((grad_norm, false));
    }
    let moments = optim
        .exp_avg
        .all_mut()
        .into_iter()
        .zip(optim.exp_avg_sq.all_mut());
    for (((p, (_, g)), (m, v)), &decay) in params
        .all_mut()
        .into_iter()
        .zip(grads.named())
        .zip(moments)
        .zip(decays)
    {
        ops.adamw(&scalars(decay)?, p, g, m, v)?;
    }
    Ok((grad_norm, true))
}
