//! FSDP training of the reference GPT on the [`fsdp`] engine: [`GptModel`] implements
//! [`FsdpModel`] (spans: the embedding, one per transformer block, the head with the tied
//! `lm_head`), and [`FsdpGpt`] is one rank's engine with the model, with the step API of a
//! language-model trainer (`step(batch, global_tokens)`).
//!
//! The blocks can be checkpointed ([`FsdpConfig::activation_checkpointing`],
//! [`Fsdp::set_activation_checkpointing`]): a checkpointed block keeps only its input and is
//! recomputed before its backward; the embedding and the head always keep their activations.
//! The tape's bytes ([`GptTape::bytes`]: the blocks' saved activations or kept inputs, the
//! head's, and the activation or gradient handed between spans) are what the engine counts
//! ([`Fsdp::activation_stats`]) and what [`crate::plan::span_activations`] declares to the plan.
//!
//! ```
//! use fsdp_gpt::model::{init_params, named_params, GptConfig};
//! use fsdp_gpt::runtime::{FsdpConfig, FsdpGpt, ShardingStrategy};
//! use fsdp_gpt::tree::gpt_block_plan;
//! use fsdp_gpt::data::{get_batch, synthetic_corpus};
//! use fsdp::optim::AdamWConfig;
//! use fsdp_collectives::{ring, Communicator};
//!
//! let cfg = GptConfig::new(2, 2, 32, 16, 96).unwrap();
//! let params = named_params(&cfg, init_params(&cfg, 0)).unwrap();
//! let tokens = synthetic_corpus(5_000, 96, 1);
//! let opt = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
//! let losses = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
//!     let rank = comm.rank();
//!     let config = FsdpConfig::new(ShardingStrategy::FullShard);
//!     let mut fsdp = FsdpGpt::new(Box::new(comm), cfg, &gpt_block_plan(&cfg), &params, config, opt)
//!         .unwrap();
//!     let batch = get_batch(&tokens, 0, 4, 16, rank, 2).unwrap();
//!     fsdp.step(&batch, 4 * 16).unwrap()
//! })
//! .unwrap();
//! assert_eq!(losses[0], losses[1]); // the global loss, on every rank
//! ```

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};

use fsdp::engine::Span;
use fsdp::optim::OptimizerConfig;
use fsdp::units::UnitPlan;
use fsdp::{Fsdp, FsdpError, FsdpModel, Grads, ParamInit, Params};
use fsdp_collectives::Communicator;

pub use fsdp::engine::{
    BackwardPrefetch, CrossStreamSafety, FsdpConfig, Phase, ScheduleEvent, ScheduleKind,
    ShardingStrategy,
};

use crate::checkpoint::WTE;
use crate::data::Batch;
use crate::model::{
    self, block_param_specs, embed_param_specs, head_param_specs, param_specs, BlockCache,
    GptConfig, HeadCache,
};

/// The reference GPT as an [`FsdpModel`], with the loss normaliser: the token count of
/// everything the next optimizer step averages over (all ranks, all micro-batches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptModel {
    cfg: GptConfig,
    global_tokens: usize,
}

impl GptModel {
    /// The model of configuration `cfg` whose loss is the sum of the token cross-entropies
    /// divided by `global_tokens`.
    ///
    /// # Errors
    /// An invalid configuration.
    pub fn new(cfg: GptConfig, global_tokens: usize) -> Result<Self, FsdpError> {
        cfg.validate()?;
        Ok(GptModel { cfg, global_tokens })
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }
}

/// The activations of one pass of the GPT: the activation handed forward (`x`), each block's
/// saved activations (or only its input when checkpointed), the head's saved activations and
/// loss, and the gradient handed backward (`dx`).
#[derive(Debug, Default)]
pub struct GptTape {
    x: Vec<f32>,
    blocks: Vec<BlockSaved>,
    head: Option<(f32, HeadCache)>,
    dx: Vec<f32>,
}

/// What a block keeps for its backward.
#[derive(Debug)]
enum BlockSaved {
    /// Everything its backward reads.
    Full(Box<BlockCache>),
    /// Only its input (activation checkpointing: recomputed before its backward).
    Input(Vec<f32>),
}

const F32: u64 = std::mem::size_of::<f32>() as u64;

impl GptTape {
    /// Bytes of the blocks' saved activations: their caches, or their inputs when
    /// checkpointed.
    pub fn block_bytes(&self) -> u64 {
        self.blocks
            .iter()
            .map(|b| match b {
                BlockSaved::Full(c) => c.bytes() as u64,
                BlockSaved::Input(x) => x.len() as u64 * F32,
            })
            .sum()
    }

    /// Bytes of the head's saved activations (its input, `ln_f` output and statistics, the
    /// softmax of the logits and the targets), 0 outside forward's end and the head's backward.
    pub fn head_bytes(&self) -> u64 {
        self.head.as_ref().map_or(0, |(_, h)| h.bytes() as u64)
    }

    /// Bytes of the activation handed forward and the gradient handed backward.
    pub fn handoff_bytes(&self) -> u64 {
        (self.x.len() + self.dx.len()) as u64 * F32
    }

    /// Every byte above: what the engine counts ([`FsdpModel::tape_bytes`]).
    pub fn bytes(&self) -> u64 {
        self.block_bytes() + self.head_bytes() + self.handoff_bytes()
    }
}

fn no_cache() -> FsdpError {
    FsdpError::InvalidShape {
        reason: "a block without its cache".into(),
    }
}

fn names(specs: Vec<model::ParamSpec>) -> impl Iterator<Item = String> {
    specs.into_iter().map(|p| p.name)
}

impl FsdpModel for GptModel {
    type Batch = Batch;
    type Tape = GptTape;

    fn spans(&self) -> Vec<Span> {
        let cfg = &self.cfg;
        let mut spans = vec![Span::new("embed", names(embed_param_specs(cfg)))];
        for l in 0..cfg.n_layer {
            spans.push(Span::new(
                format!("block {l}"),
                names(block_param_specs(cfg, l)),
            ));
        }
        spans.push(Span::new(
            "head",
            names(head_param_specs(cfg)).chain([WTE.to_string()]),
        ));
        spans
    }

    fn forward(
        &self,
        span: usize,
        p: &dyn Params,
        b: &Batch,
        t: &mut GptTape,
    ) -> Result<(), FsdpError> {
        let cfg = &self.cfg;
        let shape = b.shape;
        match span {
            0 => t.x = model::embed_forward(cfg, p, &b.inputs, shape)?,
            s if s <= cfg.n_layer => {
                let (y, c) = model::block_forward(cfg, p, s - 1, std::mem::take(&mut t.x), shape)?;
                t.blocks.push(BlockSaved::Full(Box::new(c)));
                t.x = y;
            }
            _ => {
                t.head = Some(model::head_forward(
                    cfg,
                    p,
                    std::mem::take(&mut t.x),
                    &b.targets,
                    shape,
                    self.global_tokens,
                )?);
            }
        }
        Ok(())
    }

    fn loss(&self, t: &GptTape) -> Result<f32, FsdpError> {
        t.head
            .as_ref()
            .map(|h| h.0)
            .ok_or_else(|| FsdpError::InvalidShape {
                reason: "the head did not run".into(),
            })
    }

    fn backward(
        &self,
        span: usize,
        p: &dyn Params,
        g: &mut dyn Grads,
        b: &Batch,
        t: &mut GptTape,
    ) -> Result<(), FsdpError> {
        let cfg = &self.cfg;
        match span {
            0 => model::embed_backward(cfg, g, &b.inputs, b.shape, &t.dx)?,
            s if s <= cfg.n_layer => {
                let Some(BlockSaved::Full(c)) = t.blocks.pop() else {
                    return Err(no_cache());
                };
                t.dx = model::block_backward(cfg, p, g, s - 1, &c, &t.dx)?;
            }
            _ => {
                // The head's activations are dropped after its backward (as autograd frees a
                // node's saved tensors).
                let (_, head) = t.head.take().ok_or_else(|| FsdpError::InvalidShape {
                    reason: "the head did not run".into(),
                })?;
                t.dx = model::head_backward(cfg, p, g, &head, 1.0)?;
            }
        }
        Ok(())
    }

    /// The blocks can be checkpointed; the embedding and the head cannot.
    fn checkpointable(&self, span: usize) -> bool {
        (1..=self.cfg.n_layer).contains(&span)
    }

    fn discard_saved(&self, span: usize, t: &mut GptTape) -> Result<(), FsdpError> {
        if !self.checkpointable(span) {
            return Err(FsdpError::InvalidShape {
                reason: format!("span {span} of the GPT cannot be checkpointed"),
            });
        }
        match t.blocks.pop() {
            Some(BlockSaved::Full(c)) if c.layer() == span - 1 => {
                t.blocks.push(BlockSaved::Input((*c).into_input()));
                Ok(())
            }
            _ => Err(no_cache()),
        }
    }

    fn recompute(
        &self,
        span: usize,
        p: &dyn Params,
        b: &Batch,
        t: &mut GptTape,
    ) -> Result<(), FsdpError> {
        if !self.checkpointable(span) {
            return Err(FsdpError::InvalidShape {
                reason: format!("span {span} of the GPT cannot be recomputed"),
            });
        }
        let Some(BlockSaved::Input(x)) = t.blocks.pop() else {
            return Err(no_cache());
        };
        // The block's output (the next block's input, kept there) is not needed again.
        let (_, c) = model::block_forward(&self.cfg, p, span - 1, x, b.shape)?;
        t.blocks.push(BlockSaved::Full(Box::new(c)));
        Ok(())
    }

    fn tape_bytes(&self, t: &GptTape) -> u64 {
        t.bytes()
    }
}

/// One rank of FSDP training of the reference GPT: the engine and the model (see the
/// [module](self) documentation). Dereferences to the [`Fsdp`] engine for everything else
/// (`optimizer_step`, `clip_grad_norm`, `schedule`, `memory_stats`, `save_sharded`, ...).
pub struct FsdpGpt {
    fsdp: Fsdp,
    model: GptModel,
}

impl std::fmt::Debug for FsdpGpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpGpt")
            .field("model", &self.model)
            .field("fsdp", &self.fsdp)
            .finish()
    }
}

impl Deref for FsdpGpt {
    type Target = Fsdp;
    fn deref(&self) -> &Fsdp {
        &self.fsdp
    }
}

impl DerefMut for FsdpGpt {
    fn deref_mut(&mut self) -> &mut Fsdp {
        &mut self.fsdp
    }
}

/// Check that `plan` holds every parameter of `cfg` with its shape, and nothing else.
pub(crate) fn check_plan(cfg: &GptConfig, plan: &UnitPlan) -> Result<(), FsdpError> {
    let specs = param_specs(cfg);
    let planned: HashMap<&str, &[usize]> = plan
        .units
        .iter()
        .flat_map(|u| u.params.iter())
        .chain(plan.ignored.iter())
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    if planned.len() != specs.len() {
        return Err(FsdpError::InvalidPlan {
            reason: format!(
                "the plan holds {} parameters, the model has {}",
                planned.len(),
                specs.len()
            ),
        });
    }
    for s in &specs {
        match planned.get(s.name.as_str()) {
            Some(shape) if *shape == s.shape.as_slice() => {}
            Some(shape) => {
                return Err(FsdpError::InvalidPlan {
                    reason: format!(
                        "parameter `{}` has shape {:?} in the plan, {:?} in the model",
                        s.name, shape, s.shape
                    ),
                })
            }
            None => {
                return Err(FsdpError::InvalidPlan {
                    reason: format!("parameter `{}` is in no unit", s.name),
                })
            }
        }
    }
    Ok(())
}

impl FsdpGpt {
    /// Build this rank's engine for the GPT `cfg` with the units of `plan` and the full initial
    /// parameters `params` (the same on every rank; each keeps its shards). Every rank of
    /// `comm` must call it with the same arguments.
    ///
    /// # Errors
    /// [`FsdpError::InvalidPlan`] if the plan does not cover every model parameter exactly once
    /// with its shape; the errors of [`Fsdp::new`].
    pub fn new(
        comm: Box<dyn Communicator>,
        cfg: GptConfig,
        plan: &UnitPlan,
        params: &HashMap<String, Vec<f32>>,
        config: FsdpConfig,
        optim: impl Into<OptimizerConfig>,
    ) -> Result<Self, FsdpError> {
        FsdpGpt::with_init(comm, cfg, plan, ParamInit::Full(params), config, optim)
    }

    /// As [`FsdpGpt::new`] with any [`ParamInit`].
    ///
    /// # Errors
    /// As [`FsdpGpt::new`].
    pub fn with_init(
        comm: Box<dyn Communicator>,
        cfg: GptConfig,
        plan: &UnitPlan,
        init: ParamInit<'_>,
        config: FsdpConfig,
        optim: impl Into<OptimizerConfig>,
    ) -> Result<Self, FsdpError> {
        let model = GptModel::new(cfg, 1)?;
        check_plan(&cfg, plan)?;
        let fsdp = Fsdp::new(comm, plan, init, config, optim)?;
        Ok(FsdpGpt { fsdp, model })
    }

    /// An engine built elsewhere (for example by [`Fsdp::with_parts`]) with the GPT `cfg`.
    ///
    /// # Errors
    /// An invalid configuration.
    pub fn from_engine(fsdp: Fsdp, cfg: GptConfig) -> Result<Self, FsdpError> {
        Ok(FsdpGpt {
            fsdp,
            model: GptModel::new(cfg, 1)?,
        })
    }

    /// The model.
    pub fn model(&self) -> &GptModel {
        &self.model
    }

    /// The engine.
    pub fn engine(&mut self) -> &mut Fsdp {
        &mut self.fsdp
    }

    /// One training step on this rank's part `batch` of a global batch of `global_tokens`
    /// tokens: [`forward_backward`](Self::forward_backward) then
    /// [`Fsdp::optimizer_step`]. Returns the loss of the global batch (the mean cross-entropy
    /// over all its tokens), the same on every rank. Every rank must call it.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward) and [`Fsdp::optimizer_step`].
    pub fn step(&mut self, batch: &Batch, global_tokens: usize) -> Result<f32, FsdpError> {
        let loss = self.forward_backward(batch, global_tokens)?;
        self.fsdp.optimizer_step()?;
        Ok(loss)
    }

    /// Forward and backward of this rank's part `batch` of a (micro-)batch (see
    /// [`Fsdp::forward_backward`]); `global_tokens` is the loss normaliser. Returns this
    /// micro-batch's share of the global loss, summed over ranks.
    ///
    /// # Errors
    /// An invalid batch, a failing collective or allocation.
    pub fn forward_backward(
        &mut self,
        batch: &Batch,
        global_tokens: usize,
    ) -> Result<f32, FsdpError> {
        let model = GptModel {
            global_tokens,
            ..self.model
        };
        if self.fsdp.compute_device().is_some() {
            // An engine on a device: the GPT computes on host copies of its buffers.
            return self
                .fsdp
                .forward_backward(&fsdp::engine::HostCompute::new(&model), batch);
        }
        self.fsdp.forward_backward(&model, batch)
    }

    /// Run `f` with gradient synchronisation off (see [`Fsdp::no_sync`]).
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let before = self.fsdp.set_no_sync(true);
        let r = f(self);
        self.fsdp.set_no_sync(before);
        r
    }

    /// The full parameters, by name (see [`Fsdp::full_state_dict`]).
    ///
    /// # Errors
    /// A failing collective.
    pub fn full_params(&self) -> Result<HashMap<String, Vec<f32>>, FsdpError> {
        self.fsdp.full_state_dict()
    }
}
