//! Optimizer parameter groups inside flat shards and the learning-rate schedule of the engine
//! (PyTorch's `param_groups` and an `LRScheduler`; nanoGPT's `configure_optimizers` and
//! `get_lr`).

use std::collections::HashMap;

use super::fsdp::Fsdp;
use crate::optim::{LrSchedule, ParamGroupOptions, ShardGroups};
use crate::FsdpError;

/// The optimizer setup the engine applies at each step: the parameter groups, which group each
/// parameter is in, and the learning-rate schedule. Sharded checkpoints carry it.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerSetup {
    /// The groups (group `i` is `groups[i]`).
    pub groups: Vec<ParamGroupOptions>,
    /// Parameter name → its group (parameters not listed are in group 0).
    pub group_of: HashMap<String, usize>,
    /// The learning-rate schedule over optimizer steps.
    pub lr_schedule: LrSchedule,
}

impl Default for OptimizerSetup {
    fn default() -> Self {
        OptimizerSetup {
            groups: vec![ParamGroupOptions::default()],
            group_of: HashMap::new(),
            lr_schedule: LrSchedule::Constant,
        }
    }
}

impl Fsdp {
    /// Put the parameters in optimizer groups: `rule(name, shape)` gives each parameter's index
    /// into `groups` (each group with its own weight decay and learning-rate scale; e.g.
    /// [`crate::optim::decay_2d_only`] with [`crate::optim::decay_2d_only_group`], nanoGPT's
    /// "weight decay only for tensors of 2 or more dimensions"). Padding is never updated.
    /// Local: every rank must set the same groups.
    ///
    /// # Errors
    /// An invalid group option, or a rule that gives a parameter a group out of range (the
    /// error names it); the engine is then unchanged.
    pub fn set_param_groups(
        &mut self,
        groups: Vec<ParamGroupOptions>,
        rule: impl Fn(&str, &[usize]) -> usize,
    ) -> Result<(), FsdpError> {
        let group_of: HashMap<String, usize> = self
            .table
            .entries
            .iter()
            .map(|e| (e.name.clone(), rule(&e.name, &e.shape)))
            .collect();
        self.apply_setup(OptimizerSetup {
            groups,
            group_of,
            lr_schedule: self.setup.lr_schedule,
        })
    }

    /// Set the learning-rate schedule: step `i` (from 0) uses `schedule.lr_at(base_lr, i)`,
    /// where `base_lr` is the optimizer's learning rate.
    ///
    /// # Errors
    /// An invalid schedule.
    pub fn set_lr_schedule(&mut self, schedule: LrSchedule) -> Result<(), FsdpError> {
        schedule.validate()?;
        self.setup.lr_schedule = schedule;
        Ok(())
    }

    /// The optimizer setup (groups and schedule).
    pub fn optimizer_setup(&self) -> &OptimizerSetup {
        &self.setup
    }

    /// The learning rate of the next optimizer step (before each group's scale).
    pub fn lr(&self) -> f64 {
        self.lr_at(self.optimizer_steps())
    }

    /// The learning rate of the step after `steps` optimizer steps.
    pub(crate) fn lr_at(&self, steps: u64) -> f64 {
        self.setup.lr_schedule.lr_at(self.optim.lr(), steps)
    }

    /// Apply `setup` (validated first; the engine is unchanged on error).
    pub(crate) fn apply_setup(&mut self, setup: OptimizerSetup) -> Result<(), FsdpError> {
        for g in &setup.groups {
            g.validate()?;
        }
        setup.lr_schedule.validate()?;
        let single = setup.groups.len() == 1 && setup.group_of.values().all(|&g| g == 0);
        let mut segments = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let s = if single {
                ShardGroups::single(g.layout.shard_numel())
            } else {
                let s = ShardGroups::new(&g.layout, g.shard_index, |name, _| {
                    setup.group_of.get(name).copied().unwrap_or(0)
                })?;
                s.check_groups(setup.groups.len())?;
                s
            };
            segments.push(s);
        }
        for (g, s) in self.groups.iter_mut().zip(segments) {
            g.segments = s;
        }
        self.setup = setup;
        Ok(())
    }
}
