//! The optimizer side of the engine: `no_sync`, the global gradient norm and clipping by it,
//! the optimizer step on the shards (or skipping it), and the loss all-reduce.

use fsdp_collectives::ReduceOp;
use fsdp_device::Buffer;

use super::fsdp::Fsdp;
use super::param_group::ParamGroup;
use crate::optim::{OptimizerConfig, ParamGroupOptions};
use crate::trace::SpanKind;
use crate::FsdpError;

impl Fsdp {
    /// Run `f` with gradient synchronisation off (PyTorch's `no_sync()`): backward passes
    /// inside keep the unsharded gradients and accumulate into them; the first backward after
    /// the scope reduces the accumulated gradients. Costs one unsharded gradient buffer per
    /// unit meanwhile.
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let before = std::mem::replace(&mut self.no_sync, true);
        let r = f(self);
        self.no_sync = before;
        r
    }

    /// Turn gradient synchronisation off (`true`) or on, returning the previous setting: the
    /// scope-free form of [`no_sync`](Self::no_sync) for wrappers.
    pub fn set_no_sync(&mut self, on: bool) -> bool {
        std::mem::replace(&mut self.no_sync, on)
    }

    /// The optimizer (AdamW or SGD) on every shard with the accumulated gradient shards, each
    /// element with its parameter group's options and the scheduled learning rate
    /// ([`set_param_groups`](Self::set_param_groups), [`set_lr_schedule`](Self::set_lr_schedule)),
    /// then [`zero_grad`](Self::zero_grad). With a grad scaler
    /// ([`set_grad_scaler`](Self::set_grad_scaler)) the gradients are first unscaled (unless
    /// [`unscale_grads`](Self::unscale_grads) did it), a step whose gradients overflowed on any
    /// rank is skipped on every rank (as [`skip_step`](Self::skip_step), counted in
    /// [`GradScaler::skipped_steps`](super::GradScaler::skipped_steps)), and the scale is updated.
    /// Every rank must call it.
    ///
    /// # Errors
    /// [`FsdpError::InvalidFsdpConfig`] when unsharded gradients are still unreduced (the last
    /// backward ran under `no_sync`); an optimizer error; with a grad scaler, a failing
    /// collective.
    pub fn optimizer_step(&mut self) -> Result<(), FsdpError> {
        self.check_reduced()?;
        if let Some(dev) = self.decisions().map(|d| d.device.clone()) {
            return self.step_decided(&dev, None);
        }
        if self.grad_scaler_skips()? {
            return Ok(());
        }
        if let Some(dev) = self.ctx.shards_on_device().cloned() {
            let lr = self.lr();
            self.step_on_device(&dev, lr)?;
        } else if !self.ctx.is_meta() {
            let lr = self.lr();
            for g in &mut self.groups {
                if g.shard.dtype() == fsdp_device::DType::BF16 {
                    // AnyPrecisionAdamW on bf16 shards (no f32 master weights).
                    step_shard::<half::bf16>(g, &self.optim, lr, &self.setup.groups)?;
                } else {
                    step_shard::<f32>(g, &self.optim, lr, &self.setup.groups)?;
                }
            }
        }
        self.optimizer_steps += 1;
        self.grad_scaler_stepped();
        self.zero_grad()
    }

    /// Zero the gradient shards and drop unreduced unsharded gradients.
    ///
    /// # Errors
    /// A failing buffer access.
    pub fn zero_grad(&mut self) -> Result<(), FsdpError> {
        let dev = self.ctx.shards_on_device().cloned();
        for g in &mut self.groups {
            match &dev {
                Some(dev) => dev.zero(&g.grad_shard, dev.compute_stream())?,
                None => self.ctx.fill(&g.grad_shard, 0.0)?,
            }
            g.grad_shard_zero = true;
            g.full_grad = None;
        }
        self.keep_step_squares(None);
        if let Some(s) = &mut self.grad_scaler {
            s.reset_step();
        }
        Ok(())
    }

    pub(crate) fn check_reduced(&self) -> Result<(), FsdpError> {
        if self.groups.iter().any(|g| g.full_grad.is_some()) {
            return Err(FsdpError::InvalidFsdpConfig {
                reason: "gradients accumulated under no_sync are not reduced yet: run the last \
                         micro-batch outside no_sync before the optimizer step"
                    .into(),
            });
        }
        Ok(())
    }

    /// The global L2 norm of the gradients (what [`clip_grad_norm`](Self::clip_grad_norm)
    /// returns, without clipping): the squared norms of the rank's gradient shards are summed
    /// over the ranks that hold distinct shards (the shard group; nothing for `NO_SHARD` and
    /// ignored parameters, whose gradients are replicated). Every rank gets the same value,
    /// bitwise, so a check of it (`is_finite`) takes the same branch on every rank without
    /// further communication. NaN or infinite gradients give a NaN or infinite norm. Call it
    /// after the last backward of a step. Every rank must call it (one all-reduce of 8 bytes
    /// over the shard group). With a grad scaler the gradients are unscaled first
    /// ([`unscale_grads`](Self::unscale_grads)), so the norm is the true gradients' (infinite
    /// or NaN after an overflow).
    ///
    /// # Errors
    /// Unreduced gradients as in [`optimizer_step`](Self::optimizer_step); a failing
    /// collective.
    pub fn grad_norm(&self) -> Result<f64, FsdpError> {
        if self.ctx.shards_on_device().is_some() {
            return self.wait_for(self.grad_norm_async()?);
        }
        self.check_reduced()?;
        self.unscale_shared()?;
        if self.ctx.is_meta() {
            // A dry run's gradients hold no values.
            return Ok(0.0);
        }
        let sq = |b: &Buffer| -> Result<f64, FsdpError> {
            Ok(b.read::<f32>()?
                .iter()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum())
        };
        let (mut sharded, mut replicated) = (0.0, 0.0);
        for g in &self.groups {
            if g.factor > 1 {
                sharded += sq(&g.grad_shard)?;
            } else {
                replicated += sq(&g.grad_shard)?;
            }
        }
        sharded = self.all_reduce_sum(self.ctx.groups.shard(), sharded)?;
        let norm = (sharded + replicated).sqrt();
        self.keep_step_squares(Some(super::decided_step::StepSquares::Host(norm)));
        Ok(norm)
    }

    /// Clip the gradients by their global L2 norm (PyTorch's `FSDP.clip_grad_norm_`): the
    /// norm of [`grad_norm`](Self::grad_norm), and every gradient is scaled by
    /// `max_norm / (total_norm + 1e-6)` when that is below 1. Returns the total norm before
    /// clipping. A non-finite norm leaves the gradients unchanged (check the returned value, and
    /// [`skip_step`](Self::skip_step) or stop). Call it after the last backward of a step. Every
    /// rank must call it.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] for a negative or non-finite `max_norm`; those of
    /// [`grad_norm`](Self::grad_norm).
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, FsdpError> {
        if self.ctx.shards_on_device().is_some() {
            let norm = self.clip_grad_norm_async(max_norm)?;
            return self.wait_for(norm);
        }
        crate::optim::check_max_norm(max_norm)?;
        let total = self.grad_norm()?;
        if let Some(c) = crate::optim::clip_coefficient(max_norm, total) {
            for g in &self.groups {
                g.grad_shard
                    .write::<f32>()?
                    .iter_mut()
                    .for_each(|x| *x *= c);
            }
        }
        Ok(total)
    }

    /// The norm's value, a wait on the host counted in [`host_waits`](Self::host_waits).
    fn wait_for(&self, norm: super::DeviceScalar) -> Result<f64, FsdpError> {
        self.ctx.count_host_wait();
        norm.value()
    }

    /// Skip this step's optimizer step and discard its gradients, as PyTorch's `GradScaler`
    /// skips the `optimizer.step()` of a step whose gradients overflowed: the parameters, the
    /// optimizer state (its step count included) and the learning-rate schedule's position
    /// ([`optimizer_steps`](Self::optimizer_steps)) are unchanged, and the gradients are zeroed
    /// as by [`zero_grad`](Self::zero_grad), unreduced `no_sync` gradients included. Local: no
    /// collective, so ranks that agree to skip (e.g. on a non-finite global
    /// [`grad_norm`](Self::grad_norm) or loss, which every rank sees alike) stay in step. With
    /// a grad scaler, skipping a step whose unscaled gradients overflowed (seen by
    /// [`grad_norm`](Self::grad_norm), [`clip_grad_norm`](Self::clip_grad_norm) or
    /// [`unscale_grads`](Self::unscale_grads)) is the scaler's skip, as in
    /// [`optimizer_step`](Self::optimizer_step): counted, and the scale backs off.
    ///
    /// # Errors
    /// A failing buffer access.
    pub fn skip_step(&mut self) -> Result<(), FsdpError> {
        self.grad_scaler_on_skip()?;
        self.zero_grad()
    }

    /// The sum over all ranks of `local` (a loss): one all-reduce of 4 bytes over the world.
    ///
    /// # Errors
    /// A failing collective.
    pub fn all_reduce_loss(&self, local: f32) -> Result<f32, FsdpError> {
        self.all_reduce_sum(self.ctx.groups.world_multi(), local)
    }

    /// The sum of `local` over the ranks of `group` (`None`: this rank alone): one all-reduce
    /// of one element, the host waiting for it.
    pub(crate) fn all_reduce_sum<T: fsdp_device::Element>(
        &self,
        group: Option<&dyn fsdp_collectives::Communicator>,
        local: T,
    ) -> Result<T, FsdpError> {
        let Some(world) = group else {
            return Ok(local);
        };
        let b = Buffer::from_slice(&[local])?;
        let bytes = std::mem::size_of::<T>();
        let sum = self.ctx.collective_to_host(world, &b, 1, true, |_, b| {
            self.ctx.traced(
                world.stream(),
                SpanKind::AllReduce,
                Vec::new(),
                bytes,
                || Ok(world.all_reduce(b, ReduceOp::Sum)?),
            )
        })?;
        Ok(sum.to_vec::<T>()?[0])
    }
}

/// One optimizer step on the shard of `g`, whose elements are `P`, with its `f32` gradient.
fn step_shard<P: crate::optim::ParamElement>(
    g: &mut ParamGroup,
    optim: &OptimizerConfig,
    lr: f64,
    groups: &[ParamGroupOptions],
) -> Result<(), FsdpError> {
    let grad = g.grad_shard.read::<f32>()?;
    let mut p = g.shard.write::<P>()?;
    g.optim_state
        .step_grouped_as(optim, lr, groups, &g.segments, &mut p, &grad)
}
