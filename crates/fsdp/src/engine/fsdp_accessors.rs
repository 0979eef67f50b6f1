//! The read-only accessors of [`Fsdp`]: its rank and world, configuration, process groups,
//! param groups and layouts, the parameter table, the step counts, the recorded schedule and
//! trace, and the caching allocator's statistics, history and snapshot.

use fsdp_allocator::MemoryStats;
use fsdp_flatparam::FlatParamLayout;

use super::super::comm_context::ProcessGroups;
use super::super::config::{FsdpConfig, ScheduleEvent};
use super::super::param_group::ParamGroup;
use super::super::views::ParamId;
use super::Fsdp;
use crate::trace::TraceEvent;
use crate::FsdpError;

#[cfg(doc)]
use super::super::views::{GradViews, ParamViews};

impl Fsdp {
    /// This rank's index in the world.
    pub fn rank(&self) -> usize {
        self.ctx.groups.world().rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.ctx.groups.world().world_size()
    }

    /// The sharding factor `F` of the units (1 for `NO_SHARD` or a shard group of one rank).
    pub fn sharding_factor(&self) -> usize {
        self.ctx.groups.factor_and_index().0
    }

    /// The configuration.
    pub fn config(&self) -> &FsdpConfig {
        &self.ctx.config
    }

    /// The process groups.
    pub fn process_groups(&self) -> &ProcessGroups {
        &self.ctx.groups
    }

    /// The param groups (one per unit; ignored parameters form a last, unsharded one).
    pub fn param_groups(&self) -> &[ParamGroup] {
        &self.groups
    }

    /// The flat-parameter layout of unit `unit`.
    pub fn layout(&self, unit: usize) -> Option<&FlatParamLayout> {
        self.groups.get(unit).map(|g| &g.layout)
    }

    /// Number of flat parameters (the plan's units, plus one for ignored parameters if any).
    pub fn num_units(&self) -> usize {
        self.groups.len()
    }

    /// The handle of parameter `name`, for allocation-free access through [`ParamViews::get`]
    /// and [`GradViews::get_mut`].
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`].
    pub fn param_id(&self, name: &str) -> Result<ParamId, FsdpError> {
        self.table.id(name)
    }

    /// The unit that owns parameter `name`.
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`].
    pub fn unit_of(&self, name: &str) -> Result<usize, FsdpError> {
        Ok(self.table.entries[self.table.id(name)?.0].group)
    }

    /// Every parameter's name and shape, in unit order.
    pub fn named_shapes(&self) -> impl Iterator<Item = (&str, &[usize])> + '_ {
        self.table
            .entries
            .iter()
            .map(|e| (e.name.as_str(), e.shape.as_slice()))
    }

    /// Forward/backward passes begun so far (micro-batches; the `step` of [`ScheduleEvent`]s).
    pub fn steps(&self) -> u64 {
        self.ctx.step
    }

    /// Number of optimizer steps taken. With a grad scaler on a device, which decides there
    /// whether a step is taken, this waits for the device's decisions so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps + self.unread_steps_lossy()
    }

    /// The collectives and frees issued so far, in issue order.
    pub fn schedule(&self) -> &[ScheduleEvent] {
        &self.ctx.schedule
    }

    /// Forget the recorded schedule.
    pub fn clear_schedule(&mut self) {
        self.ctx.schedule.clear();
    }

    /// The timeline trace recorded so far (empty unless [`FsdpConfig::trace`] is on): compute
    /// spans, communication spans per collective (those run so far by the communication
    /// streams) and allocator counters. Write it with [`crate::trace::write_chrome_trace`].
    pub fn trace_events(&self) -> Vec<TraceEvent> {
        self.ctx
            .tracer
            .as_ref()
            .map_or_else(Vec::new, |t| t.events())
    }

    /// Forget the recorded trace.
    pub fn clear_trace(&self) {
        if let Some(t) = &self.ctx.tracer {
            t.clear();
        }
    }

    /// The statistics of the rank's caching allocator (shards, unsharded parameters and
    /// gradients).
    pub fn memory_stats(&self) -> MemoryStats {
        self.ctx.pool.memory_stats()
    }

    /// Reset the allocator's peak statistics.
    pub fn reset_peak_memory_stats(&self) {
        self.ctx.pool.reset_peak_stats();
    }

    /// Start (`Some`) or stop (`None`) recording the allocator's memory history (PyTorch's
    /// `torch.cuda.memory._record_memory_history`); the engine names its allocations' frames
    /// ("unit N (name) all-gather", "unit N (name) gradient").
    pub fn record_memory_history(&self, config: Option<fsdp_allocator::HistoryConfig>) {
        self.ctx.pool.record_memory_history(config);
    }

    /// The allocator's segments, blocks and recorded history (PyTorch's
    /// `torch.cuda.memory._snapshot()`; write it with
    /// [`Snapshot::write_pickle`](fsdp_allocator::Snapshot::write_pickle)), if the pool has them.
    pub fn memory_snapshot(&self) -> Option<fsdp_allocator::Snapshot> {
        self.ctx.pool.snapshot()
    }
}
