//! Optimizer parameter groups inside a flat shard.
//!
//! A rank's shard of a flat parameter holds pieces of several original parameters (and
//! padding). PyTorch's optimizers take `param_groups`, each with its own `weight_decay` and `lr`;
//! nanoGPT uses two (weight decay on matrices, none on biases and LayerNorm weights). Here a
//! [`ShardGroups`] records which contiguous runs of a shard belong to which group, and
//! [`OptimizerState::step_grouped`] (`f32` parameters) or [`OptimizerState::step_grouped_bf16`]
//! (bf16 parameters, AnyPrecisionAdamW) applies the optimizer run by run with the run's
//! [`ParamGroupOptions`]. Every update is element-wise, so this equals updating every original
//! parameter with its own group's settings.

use std::ops::Range;

use fsdp_device::half::bf16;
use fsdp_flatparam::FlatParamLayout;

use super::{
    adamw_step, non_negative, same_len, sgd_step, state_mismatch, AdamWConfig,
    AnyPrecisionAdamWConfig, AnyPrecisionAdamWState, OptimizerConfig, OptimizerState, ParamElement,
    SgdConfig,
};
use crate::FsdpError;

/// The group of shard elements that are never updated: padding, and parameters a rule of
/// [`ShardGroups::new`] maps here (frozen parameters). Their values and optimizer state are
/// left untouched by [`OptimizerState::step_grouped`].
pub const SKIP_GROUP: usize = usize::MAX;

/// Index of the weight-decayed group of [`decay_2d_only`] (parameters with at least 2
/// dimensions).
pub const DECAY_GROUP: usize = 0;

/// Index of the group without weight decay of [`decay_2d_only`] (parameters with fewer than 2
/// dimensions: biases, LayerNorm weights, scalars).
pub const NO_DECAY_GROUP: usize = 1;

/// The settings of one optimizer parameter group. The PyTorch analogue is one entry of an
/// optimizer's `param_groups` with its own `weight_decay` and `lr`
/// (`torch.optim.AdamW([{"params": ..., "weight_decay": 0.0}, ...])`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamGroupOptions {
    /// The group's weight decay; `None` uses the optimizer config's. It is AdamW's decoupled
    /// decay or SGD's L2 penalty, as the config's is.
    pub weight_decay: Option<f64>,
    /// Multiplies the (scheduled) learning rate for this group: the group's learning rate is
    /// `lr · lr_scale`. Must be finite and `≥ 0`.
    pub lr_scale: f64,
}

impl Default for ParamGroupOptions {
    /// The optimizer config's settings unchanged: `weight_decay: None`, `lr_scale: 1.0`.
    fn default() -> Self {
        ParamGroupOptions {
            weight_decay: None,
            lr_scale: 1.0,
        }
    }
}

impl ParamGroupOptions {
    /// A group with its own weight decay and the unscaled learning rate.
    pub fn with_weight_decay(weight_decay: f64) -> Self {
        ParamGroupOptions {
            weight_decay: Some(weight_decay),
            lr_scale: 1.0,
        }
    }

    /// Checks `weight_decay` (when given) and `lr_scale` finite and `≥ 0`.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] naming the bad setting (`weight_decay` or
    /// `lr_scale`).
    pub fn validate(&self) -> Result<(), FsdpError> {
        if let Some(wd) = self.weight_decay {
            non_negative("weight_decay", wd)?;
        }
        if !self.lr_scale.is_finite() || self.lr_scale < 0.0 {
            return Err(FsdpError::InvalidHyperparameter {
                name: "lr_scale",
                value: self.lr_scale,
                reason: "must be a finite number ≥ 0",
            });
        }
        Ok(())
    }

    /// `cfg` with this group's learning rate (`lr · lr_scale`, `cfg`'s own `lr` ignored) and
    /// weight decay.
    fn apply(&self, cfg: &OptimizerConfig, lr: f64) -> OptimizerConfig {
        let lr = lr * self.lr_scale;
        match *cfg {
            OptimizerConfig::AdamW(c) => OptimizerConfig::AdamW(AdamWConfig {
                lr,
                weight_decay: self.weight_decay.unwrap_or(c.weight_decay),
                ..c
            }),
            OptimizerConfig::Sgd(c) => OptimizerConfig::Sgd(SgdConfig {
                lr,
                weight_decay: self.weight_decay.unwrap_or(c.weight_decay),
                ..c
            }),
            OptimizerConfig::AnyPrecisionAdamW(c) => {
                OptimizerConfig::AnyPrecisionAdamW(AnyPrecisionAdamWConfig {
                    lr,
                    weight_decay: self.weight_decay.unwrap_or(c.weight_decay),
                    ..c
                })
            }
        }
    }
}

/// nanoGPT's two groups (`GPT.configure_optimizers`): group [`DECAY_GROUP`] (0) with
/// `weight_decay`, group [`NO_DECAY_GROUP`] (1) with weight decay 0; both at the unscaled
/// learning rate. Pair it with [`decay_2d_only_group`] as the rule of [`ShardGroups::new`].
pub fn decay_2d_only(weight_decay: f64) -> Vec<ParamGroupOptions> {
    vec![
        ParamGroupOptions::with_weight_decay(weight_decay),
        ParamGroupOptions::with_weight_decay(0.0),
    ]
}

/// nanoGPT's group rule: parameters with at least 2 dimensions (matmul weights, embeddings) go
/// to group [`DECAY_GROUP`] (0), the others (biases, LayerNorm weights, scalars) to group
/// [`NO_DECAY_GROUP`] (1) — `p.dim() >= 2` in `GPT.configure_optimizers`.
pub fn decay_2d_only_group(shape: &[usize]) -> usize {
    if shape.len() >= 2 {
        DECAY_GROUP
    } else {
        NO_DECAY_GROUP
    }
}

/// The optimizer groups of one flat shard: consecutive runs covering the shard exactly, each
/// with its group index (into the `groups` of [`OptimizerState::step_grouped`]) or
/// [`SKIP_GROUP`] for elements that are never updated (padding). Adjacent runs of the same
/// group are merged, so a shard has at most one run per parameter piece and padding gap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardGroups {
    len: usize,
    segments: Vec<(Range<usize>, usize)>,
    /// For each segment, the first parameter in it (`None` for padding or a whole-shard group):
    /// what an out-of-range group error names.
    first_param: Vec<Option<String>>,
}

impl ShardGroups {
    /// One group (index 0) covering all `len` elements: [`OptimizerState::step_grouped`] with
    /// it and the default [`ParamGroupOptions`] is [`OptimizerState::step`].
    pub fn single(len: usize) -> Self {
        let mut g = ShardGroups {
            len,
            segments: Vec::new(),
            first_param: Vec::new(),
        };
        g.push(0..len, 0, None);
        g
    }

    /// The groups of shard `shard_index` (the rank) of `layout`: each parameter piece in the
    /// shard gets the group `group_of(name, shape)` of its parameter (tied aliases hold no
    /// elements and are not asked about); alignment gaps and end padding get [`SKIP_GROUP`].
    /// A rule may return [`SKIP_GROUP`] itself to freeze a parameter. Whether the indices
    /// exist is checked against the groups given to [`OptimizerState::step_grouped`] (or
    /// [`check_groups`](Self::check_groups)).
    ///
    /// ```
    /// use fsdp::optim::{decay_2d_only_group, ShardGroups};
    /// use fsdp_flatparam::FlatParamLayout;
    ///
    /// // 12 + 3 + 5 elements, shards of 10.
    /// let layout = FlatParamLayout::builder(2)
    ///     .param("w", &[4, 3])
    ///     .param("b", &[3])
    ///     .param("ln", &[5])
    ///     .build()?;
    /// let g = ShardGroups::new(&layout, 1, |_, shape| decay_2d_only_group(shape))?;
    /// assert_eq!(g.segments(), &[(0..2, 0), (2..10, 1)]);
    /// # Ok::<(), fsdp::FsdpError>(())
    /// ```
    ///
    /// # Errors
    /// [`FsdpError::FlatParam`] if `shard_index` is not a rank of the layout.
    pub fn new(
        layout: &FlatParamLayout,
        shard_index: usize,
        group_of: impl Fn(&str, &[usize]) -> usize,
    ) -> Result<Self, FsdpError> {
        let infos = layout.shard_param_infos(shard_index)?;
        let len = layout.shard_numel();
        let mut g = ShardGroups {
            len,
            segments: Vec::new(),
            first_param: Vec::new(),
        };
        let mut pos = 0;
        for (p, info) in layout.params().iter().zip(&infos) {
            if !info.in_shard || info.numel_in_shard == 0 {
                continue;
            }
            let r = info.shard_range();
            g.push(pos..r.start, SKIP_GROUP, None);
            pos = r.end;
            g.push(r, group_of(p.name(), p.shape()), Some(p.name()));
        }
        g.push(pos..len, SKIP_GROUP, None);
        Ok(g)
    }

    /// Appends a run (ignored when empty), merging it into the last one of the same group.
    fn push(&mut self, range: Range<usize>, group: usize, param: Option<&str>) {
        if range.is_empty() {
            return;
        }
        if let Some((last, last_group)) = self.segments.last_mut() {
            if *last_group == group && last.end == range.start {
                last.end = range.end;
                let first = self.first_param.last_mut().expect("one label per segment");
                if first.is_none() {
                    *first = param.map(str::to_owned);
                }
                return;
            }
        }
        self.segments.push((range, group));
        self.first_param.push(param.map(str::to_owned));
    }

    /// Number of elements of the shard.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the shard has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The runs in order, each with its group index ([`SKIP_GROUP`] for padding); they cover
    /// `0..len()` exactly, and no two neighbours share a group.
    pub fn segments(&self) -> &[(Range<usize>, usize)] {
        &self.segments
    }

    /// The runs of `group`, in order.
    pub fn ranges_of(&self, group: usize) -> impl Iterator<Item = Range<usize>> + '_ {
        self.segments
            .iter()
            .filter(move |(_, g)| *g == group)
            .map(|(r, _)| r.clone())
    }

    /// Number of elements in `group`.
    pub fn numel_in(&self, group: usize) -> usize {
        self.ranges_of(group).map(|r| r.len()).sum()
    }

    /// The largest group index used, [`SKIP_GROUP`] aside; `None` if every element is skipped.
    pub fn max_group(&self) -> Option<usize> {
        self.segments
            .iter()
            .map(|&(_, g)| g)
            .filter(|&g| g != SKIP_GROUP)
            .max()
    }

    /// Checks that every group index used (other than [`SKIP_GROUP`]) is below `num_groups`.
    ///
    /// # Errors
    /// [`FsdpError::InvalidFsdpConfig`] naming the first parameter whose group does not exist.
    pub fn check_groups(&self, num_groups: usize) -> Result<(), FsdpError> {
        for ((_, group), param) in self.segments.iter().zip(&self.first_param) {
            if *group != SKIP_GROUP && *group >= num_groups {
                let what = match param {
                    Some(name) => format!("parameter `{name}`"),
                    None => "the shard".to_owned(),
                };
                return Err(FsdpError::InvalidFsdpConfig {
                    reason: format!(
                        "{what} is in optimizer parameter group {group}, but only {num_groups} \
                         group(s) are configured"
                    ),
                });
            }
        }
        Ok(())
    }
}

impl OptimizerState {
    /// Takes one step over a shard made of parameter groups and counts it once: each run of
    /// `segments` is updated by [`adamw_step`] / [`sgd_step`] / AnyPrecisionAdamW (its state
    /// in its dtypes, the `f32` parameter rounded to `f32`) with its group's learning rate
    /// `lr · lr_scale` and weight decay (the config's when the group's is `None`); runs of
    /// [`SKIP_GROUP`] (padding, frozen parameters) are left untouched, state included. `lr`
    /// replaces the config's learning rate (pass `schedule.lr_at(cfg.lr(), state.steps())`, or
    /// `cfg.lr()`).
    ///
    /// All runs use the same step number, so AdamW's bias correction is the one of this step
    /// for every group, as in a `torch.optim.AdamW.step()` over all its `param_groups`. With one
    /// group of default options covering the shard ([`ShardGroups::single`]) and
    /// `lr == cfg.lr()`, this is bitwise [`OptimizerState::step`].
    ///
    /// # Errors
    /// Checked before anything changes, so the state, `param` and the step count are unchanged
    /// then: [`FsdpError::InvalidHyperparameter`] for a bad setting of `cfg`, `lr` or a group,
    /// or a state made for the other optimizer; [`FsdpError::OptimizerLength`] if `grad`,
    /// `segments` or the state do not have `param.len()` elements;
    /// [`FsdpError::InvalidFsdpConfig`] naming the parameter whose group index is not below
    /// `groups.len()`.
    pub fn step_grouped(
        &mut self,
        cfg: &OptimizerConfig,
        lr: f64,
        groups: &[ParamGroupOptions],
        segments: &ShardGroups,
        param: &mut [f32],
        grad: &[f32],
    ) -> Result<(), FsdpError> {
        self.step_grouped_as(cfg, lr, groups, segments, param, grad)
    }

    /// [`step_grouped`](Self::step_grouped) for a **bf16** parameter shard (pure-bf16
    /// training, no `f32` master weights) with its `f32` gradient shard: the state must be
    /// AnyPrecisionAdamW's. Each run of `segments` is updated with its group's learning rate
    /// `lr · lr_scale` and weight decay, all runs with the same step number; [`SKIP_GROUP`]
    /// runs are left untouched, state included; the step is counted once. The operations and
    /// their bf16 roundings are torchdistx's (see [`AnyPrecisionAdamWState::step`]).
    ///
    /// ```
    /// use fsdp::optim::{AnyPrecisionAdamWConfig, OptimizerConfig, OptimizerState};
    /// use fsdp::optim::{ParamGroupOptions, ShardGroups};
    /// use fsdp_device::half::bf16;
    ///
    /// let cfg = OptimizerConfig::from(AnyPrecisionAdamWConfig::default());
    /// let mut state = OptimizerState::try_new(&cfg, 4)?;
    /// let mut shard = vec![bf16::from_f32(1.0); 4];
    /// let grad = [1.0f32; 4];
    /// state.step_grouped_bf16(
    ///     &cfg,
    ///     cfg.lr(),
    ///     &[ParamGroupOptions::default()],
    ///     &ShardGroups::single(4),
    ///     &mut shard,
    ///     &grad,
    /// )?;
    /// assert_eq!(state.steps(), 1);
    /// // 1 − 1e-3 rounds back to 1 in bf16; the Kahan compensation keeps the −1e-3.
    /// assert_eq!(shard[0], bf16::from_f32(1.0));
    /// # Ok::<(), fsdp::FsdpError>(())
    /// ```
    ///
    /// # Errors
    /// As [`step_grouped`](Self::step_grouped), checked before anything changes; a state or
    /// config of AdamW or SGD (which update `f32` parameters) is
    /// [`FsdpError::InvalidHyperparameter`] (`optimizer`).
    pub fn step_grouped_bf16(
        &mut self,
        cfg: &OptimizerConfig,
        lr: f64,
        groups: &[ParamGroupOptions],
        segments: &ShardGroups,
        param: &mut [bf16],
        grad: &[f32],
    ) -> Result<(), FsdpError> {
        self.step_grouped_as(cfg, lr, groups, segments, param, grad)
    }

    /// [`step_grouped`](Self::step_grouped) for any parameter element type: AnyPrecisionAdamW
    /// for all, AdamW and SGD for `f32` shards only.
    pub(crate) fn step_grouped_as<P: ParamElement>(
        &mut self,
        cfg: &OptimizerConfig,
        lr: f64,
        groups: &[ParamGroupOptions],
        segments: &ShardGroups,
        param: &mut [P],
        grad: &[f32],
    ) -> Result<(), FsdpError> {
        let configs = group_configs(cfg, lr, groups, segments, param.len(), grad.len())?;
        match (self, cfg) {
            (OptimizerState::AnyPrecisionAdamW(state), OptimizerConfig::AnyPrecisionAdamW(c)) => {
                any_precision_grouped(state, c, &configs, segments, param, grad)
            }
            (state @ (OptimizerState::AdamW(_) | OptimizerState::Sgd { .. }), _) => {
                match P::as_f32_mut(param) {
                    Some(param) => f32_grouped(state, cfg, &configs, segments, param, grad),
                    None => Err(FsdpError::InvalidHyperparameter {
                        name: "optimizer",
                        value: f64::NAN,
                        reason: "bf16 parameter shards need AnyPrecisionAdamW (AdamW and SGD \
                                 update f32 parameters)",
                    }),
                }
            }
            _ => Err(state_mismatch()),
        }
    }
}

/// The checks shared by the grouped steps (`cfg`, `lr`, every group and its index, the lengths
/// of `grad` and `segments`), then each group's config: `cfg` with the group's learning rate
/// and weight decay.
fn group_configs(
    cfg: &OptimizerConfig,
    lr: f64,
    groups: &[ParamGroupOptions],
    segments: &ShardGroups,
    param_len: usize,
    grad_len: usize,
) -> Result<Vec<OptimizerConfig>, FsdpError> {
    cfg.validate()?;
    non_negative("lr", lr)?;
    for g in groups {
        g.validate()?;
    }
    segments.check_groups(groups.len())?;
    same_len("grad", param_len, grad_len)?;
    same_len("shard groups", param_len, segments.len())?;
    groups
        .iter()
        .map(|g| {
            let c = g.apply(cfg, lr);
            c.validate().map(|()| c)
        })
        .collect()
}

/// AnyPrecisionAdamW over the runs of `segments`, each with its group's config (`configs`, from
/// [`group_configs`] of the same base config, so every group has the state's dtypes).
pub(crate) fn any_precision_grouped<P: ParamElement>(
    state: &mut AnyPrecisionAdamWState,
    cfg: &AnyPrecisionAdamWConfig,
    configs: &[OptimizerConfig],
    segments: &ShardGroups,
    param: &mut [P],
    grad: &[f32],
) -> Result<(), FsdpError> {
    state.check(cfg, param.len())?;
    let step = state.step + 1;
    for (range, group) in segments.segments() {
        let Some(OptimizerConfig::AnyPrecisionAdamW(c)) = configs.get(*group) else {
            continue; // SKIP_GROUP
        };
        state.update_range(
            c,
            step,
            range.clone(),
            &mut param[range.clone()],
            &grad[range.clone()],
        )?;
    }
    state.step = step;
    Ok(())
}

/// AdamW or SGD (whichever `state` is for) over the runs of `segments` of an `f32` shard, each
/// with its group's config (`configs`, from [`group_configs`]).
fn f32_grouped(
    state: &mut OptimizerState,
    cfg: &OptimizerConfig,
    configs: &[OptimizerConfig],
    segments: &ShardGroups,
    param: &mut [f32],
    grad: &[f32],
) -> Result<(), FsdpError> {
    match (state, cfg) {
        (OptimizerState::AdamW(state), OptimizerConfig::AdamW(_)) => {
            same_len("exp_avg", param.len(), state.exp_avg.len())?;
            same_len("exp_avg_sq", param.len(), state.exp_avg_sq.len())?;
            let step = state.step + 1;
            let moments: &mut [&mut [f32]] = &mut [&mut state.exp_avg, &mut state.exp_avg_sq];
            f32_runs(configs, segments, step, param, grad, moments)?;
            state.step = step;
            Ok(())
        }
        (
            OptimizerState::Sgd {
                step,
                momentum_buffer,
            },
            OptimizerConfig::Sgd(sgd),
        ) => {
            let next = *step + 1;
            if sgd.momentum != 0.0 {
                same_len("momentum_buffer", param.len(), momentum_buffer.len())?;
                f32_runs(configs, segments, next, param, grad, &mut [momentum_buffer])?;
            } else {
                f32_runs(configs, segments, next, param, grad, &mut [])?;
            }
            *step = next;
            Ok(())
        }
        _ => Err(state_mismatch()),
    }
}

/// AdamW or SGD over the runs of `segments` of an `f32` shard at step number `step` (counted
/// from 1), each run with its group's config (`configs`, from [`f32_step_configs`]), with the
/// optimizer's state as slices of the shard's length: AdamW's `exp_avg` and `exp_avg_sq`,
/// SGD's momentum buffer (none without momentum). The arithmetic of
/// [`OptimizerState::step_grouped`], for state kept elsewhere (the engine's shards on a
/// device).
///
/// # Errors
/// [`FsdpError::OptimizerLength`] for state slices of another length; state slices that do
/// not fit the optimizer are [`FsdpError::InvalidHyperparameter`] (`optimizer`).
pub(crate) fn f32_step_runs(
    configs: &[OptimizerConfig],
    segments: &ShardGroups,
    step: u64,
    param: &mut [f32],
    grad: &[f32],
    moments: &mut [&mut [f32]],
) -> Result<(), FsdpError> {
    same_len("grad", param.len(), grad.len())?;
    for m in moments.iter() {
        same_len("optimizer state", param.len(), m.len())?;
    }
    f32_runs(configs, segments, step, param, grad, moments)
}

/// The checks of a grouped step on a device ([`f32_step_runs`], [`any_precision_grouped`]),
/// on the host before the device runs it (the settings, groups and lengths are valid, and
/// `step` counts from 1), and each group's config: `cfg` with the group's learning rate and
/// weight decay.
///
/// # Errors
/// As [`OptimizerState::step_grouped`].
pub(crate) fn step_configs(
    cfg: &OptimizerConfig,
    lr: f64,
    groups: &[ParamGroupOptions],
    segments: &ShardGroups,
    step: u64,
    param_len: usize,
    grad_len: usize,
) -> Result<Vec<OptimizerConfig>, FsdpError> {
    if step == 0 {
        return Err(state_mismatch());
    }
    group_configs(cfg, lr, groups, segments, param_len, grad_len)
}

/// The runs of [`f32_grouped`] and [`f32_step_runs`]: each run of `segments` updated by its
/// group's config (`configs`), runs of [`SKIP_GROUP`] left untouched.
fn f32_runs(
    configs: &[OptimizerConfig],
    segments: &ShardGroups,
    step: u64,
    param: &mut [f32],
    grad: &[f32],
    moments: &mut [&mut [f32]],
) -> Result<(), FsdpError> {
    for (range, group) in segments.segments() {
        let r = range.clone();
        let (p, g) = (&mut param[r.clone()], &grad[r.clone()]);
        match (configs.get(*group), &mut *moments) {
            (None, _) => {} // SKIP_GROUP
            (Some(OptimizerConfig::AdamW(c)), [m, v]) => {
                adamw_step(c, step, p, g, &mut m[r.clone()], &mut v[r])?;
            }
            (Some(OptimizerConfig::Sgd(c)), [b]) => sgd_step(c, step, p, g, &mut b[r])?,
            (Some(OptimizerConfig::Sgd(c)), []) => sgd_step(c, step, p, g, &mut [])?,
            _ => return Err(state_mismatch()),
        }
    }
    Ok(())
}
