//! One unit's flat parameter on one rank (FSDP2's `FSDPParamGroup`, with FSDP1's one flat
//! buffer per unit): its shard, gradient shard and optimizer state, and the unsharded buffers
//! while gathered. `unshard` issues the all-gather, `wait_for_unshard` waits for it,
//! `reshard` frees the unsharded parameters.

use fsdp_collectives::Work;
use fsdp_device::{Buffer, DType};
use fsdp_flatparam::FlatParamLayout;

use super::comm_context::{internal, CommContext};
use super::config::{Phase, ScheduleKind};
use super::mixed_precision::{load, load_exact, store_exact, MixedPrecisionPolicy};
use crate::optim::{OptimizerState, ShardGroups};
use crate::trace::SpanKind;
use crate::FsdpError;

/// The element types of a param group, as run-time values: the sharded parameters (the
/// optimizer's master weights), the unsharded parameters the model reads (what the all-gather
/// moves), and the gradients as reduced (see [`MixedPrecisionPolicy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupDtypes {
    /// The dtype of the shard and of the optimizer state.
    pub shard: DType,
    /// The dtype of the unsharded parameters (all-gathered).
    pub param: DType,
    /// The dtype gradients are reduced in.
    pub reduce: DType,
}

impl Default for GroupDtypes {
    fn default() -> Self {
        GroupDtypes {
            shard: DType::F32,
            param: DType::F32,
            reduce: DType::F32,
        }
    }
}

/// One unit's flat parameter on this rank (see the [engine](super) documentation).
pub struct ParamGroup {
    /// The unit's index.
    pub(crate) index: usize,
    /// The unit's module path (`""` for the root, `"(ignored)"` for ignored parameters).
    pub(crate) name: String,
    pub(crate) layout: FlatParamLayout,
    pub(crate) dtypes: GroupDtypes,
    /// The unit's mixed-precision policy (`dtypes.param`/`dtypes.reduce` follow it).
    pub(crate) policy: MixedPrecisionPolicy,
    /// The sharding factor of the unit (1: never gathered, the shard is the whole parameter).
    pub(crate) factor: usize,
    /// Which of the `factor` shards this rank holds.
    pub(crate) shard_index: usize,
    /// Ignored parameters: replicated on every rank, gradients all-reduced over the world.
    pub(crate) replicated_all: bool,
    /// The rank's shard (padding included).
    pub(crate) shard: Buffer,
    /// The rank's reduced gradient shard, accumulated over micro-batches until the optimizer
    /// step.
    pub(crate) grad_shard: Buffer,
    /// Whether `grad_shard` holds zeros (then a reduction writes it directly).
    pub(crate) grad_shard_zero: bool,
    /// The pending reduction of this unsharded unit replaces `grad_shard` (which held zeros).
    pub(crate) replace_shard: bool,
    pub(crate) optim_state: OptimizerState,
    /// The optimizer groups of the shard's elements.
    pub(crate) segments: ShardGroups,
    /// The unsharded parameters while gathered (for `factor == 1`: always the shard).
    pub(crate) full: Option<Buffer>,
    /// The all-gather filling `full` and its issue index, until waited for.
    pub(crate) gather: Option<(Work, u64)>,
    /// The shard cast to `param_dtype` that the pending all-gather reads (mixed precision),
    /// held until the wait so that its release does not depend on when the stream ran.
    pub(crate) gather_input: Option<Buffer>,
    /// Whether the limiter counts `full`.
    pub(crate) counted: bool,
    /// The unsharded gradient during backward (kept across micro-batches under `no_sync`).
    pub(crate) full_grad: Option<Buffer>,
    /// For an unsharded (`F = 1`) unit whose `param_dtype` is not `f32`: the shard rounded
    /// to `param_dtype`, which the model reads during the current pass.
    pub(crate) rounded: Option<Buffer>,
    /// On a [`ComputeDevice`](super::ComputeDevice), for an unsharded (`F = 1`) unit: its
    /// parameters copied to the device (in `param_dtype`), which the model reads.
    pub(crate) uploaded: Option<Buffer>,
    /// With the shards on a device ([`FsdpConfig::offload_params`](super::FsdpConfig::offload_params)
    /// off): the optimizer's state there (AdamW: `exp_avg`, `exp_avg_sq`; SGD: the momentum
    /// buffer, or none); `optim_state` then keeps only the step count.
    pub(crate) device_moments: Vec<Buffer>,
}

impl std::fmt::Debug for ParamGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamGroup")
            .field("index", &self.index)
            .field("name", &self.name)
            .field("factor", &self.factor)
            .field("numel", &self.layout.unpadded_numel())
            .field("unsharded", &self.full.is_some())
            .finish()
    }
}

impl ParamGroup {
    /// The unit's index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The unit's module path.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether this is the root unit (module path `""`): it stays unsharded between forward
    /// and backward.
    pub fn is_root(&self) -> bool {
        self.name.is_empty() && !self.replicated_all
    }

    /// The flat-parameter layout.
    pub fn layout(&self) -> &FlatParamLayout {
        &self.layout
    }

    /// The element types.
    pub fn dtypes(&self) -> GroupDtypes {
        self.dtypes
    }

    /// Bytes of the optimizer state of the shard: host memory, outside the allocator, or with
    /// the shards on a device, the device's.
    pub fn optimizer_state_bytes(&self) -> usize {
        self.optim_state.size_in_bytes()
            + self
                .device_moments
                .iter()
                .map(Buffer::byte_len)
                .sum::<usize>()
    }

    /// The sharding factor.
    pub fn factor(&self) -> usize {
        self.factor
    }

    /// Whether the unsharded parameters are (being) gathered.
    pub fn is_unsharded(&self) -> bool {
        self.full.is_some()
    }

    /// Whether the limiter counts this unit's gathered buffer in the current pass (it will be
    /// freed before the pass ends): all units in backward, non-root units in forward when the
    /// strategy reshards after forward.
    fn counts(&self, ctx: &CommContext) -> bool {
        match ctx.phase {
            Phase::Forward => !self.is_root() && ctx.config.strategy.reshard_after_forward(),
            Phase::Backward => true,
        }
    }

    /// Issue the all-gather of the unit unless it is unsharded already (`prefetch`: issued
    /// ahead of the compute that needs it; recorded as such).
    ///
    /// # Errors
    /// A failing allocation or collective.
    pub fn unshard(&mut self, ctx: &mut CommContext, prefetch: bool) -> Result<(), FsdpError> {
        if self.factor == 1 {
            return self.upload_unsharded(ctx);
        }
        if self.full.is_some() {
            return Ok(());
        }
        // On a device, the limiter may first wait for freed units' work there.
        let counted = self.counts(ctx);
        ctx.wait_for_frees(counted)?;
        let group = ctx
            .groups
            .shard()
            .ok_or_else(|| internal("a sharded unit without a shard group"))?;
        let p = self.dtypes.param;
        let _frame = fsdp_allocator::memory_context_with(|| {
            format!("unit {} ({}) all-gather", self.index, self.name)
        });
        // Mixed precision: the shard is cast to `param_dtype` before the all-gather (with the
        // shard on the device, there, on the transfer stream).
        let resident = ctx.shards_on_device().cloned();
        let input = if self.shard.dtype() == p {
            self.shard.clone()
        } else if let Some(dev) = &resident {
            let t = dev.transfer_stream();
            let b = dev.alloc(p, self.layout.shard_numel(), t)?;
            dev.cast(&self.shard, &b, t)?;
            b
        } else {
            let b = ctx.alloc_typed(p, self.layout.shard_numel(), group.stream(), &ctx.compute)?;
            if !ctx.is_meta() {
                cast_buffer(&self.shard, &b)?;
            }
            b
        };
        // On a device: the input copied there, gathered into device memory.
        let staged = input.dtype() != self.shard.dtype() || ctx.device.is_some();
        let (input, out) = match &ctx.device {
            None => {
                let out =
                    ctx.alloc_typed(p, self.layout.padded_numel(), group.stream(), &ctx.compute)?;
                (input, out)
            }
            Some(dev) => {
                let t = dev.transfer_stream();
                let input = match resident {
                    Some(_) => input,
                    None => dev.copy_from_host(&input, t)?,
                };
                (input, dev.alloc(p, self.layout.padded_numel(), t)?)
            }
        };
        let work = ctx.traced(
            group.stream(),
            SpanKind::AllGather,
            vec![self.index],
            self.layout.shard_numel() * p.size_in_bytes(),
            || Ok(group.all_gather_base(&input, &out)?),
        )?;
        self.gather_input = staged.then_some(input);
        let issued = ctx.next_issue();
        ctx.unsharded_bytes += block_bytes(&out);
        self.full = Some(out);
        self.gather = Some((work, issued));
        self.counted = counted;
        if counted {
            ctx.in_flight += 1;
        }
        ctx.record(self.index, ScheduleKind::AllGather, prefetch);
        ctx.sample_peak();
        Ok(())
    }

    /// Prefetch: [`unshard`](Self::unshard) unless the limiter is full
    /// ([`FsdpConfig::limit_all_gathers`](super::FsdpConfig::limit_all_gathers)), in which
    /// case the unit is gathered when needed.
    ///
    /// # Errors
    /// As [`unshard`](Self::unshard).
    pub fn prefetch(&mut self, ctx: &mut CommContext) -> Result<(), FsdpError> {
        if self.full.is_some() || self.factor == 1 {
            return Ok(());
        }
        if let Some(limit) = ctx.config.limit_all_gathers {
            if self.counts(ctx) && ctx.in_flight >= limit {
                return Ok(());
            }
        }
        self.unshard(ctx, true)
    }

    /// Wait for the unit's all-gather, if one is pending. The communication stream runs in
    /// issue order, so the reductions issued before it are complete too: their unsharded
    /// gradients are released. On a device the host does not wait: the model's work waits for
    /// the all-gather there (FSDP2's `wait_for_unshard` makes the compute stream wait on the
    /// all-gather's event), and the gradients released are stream-ordered, their memory
    /// returned once the device is done with them.
    ///
    /// # Errors
    /// A failed or timed-out collective (on a device, one issued earlier that is known to have
    /// failed).
    pub fn wait_for_unshard(&mut self, ctx: &mut CommContext) -> Result<(), FsdpError> {
        if let Some((w, issued)) = self.gather.take() {
            // On a device the model's work waits for the all-gather there, not the host.
            ctx.wait_or_defer(w)?;
            ctx.release_before(issued);
            self.gather_input = None;
            self.widen(ctx)?;
        }
        Ok(())
    }

    /// Mixed precision on the CPU: replace the gathered `param_dtype` buffer by its exact
    /// `f32` widening, which the model reads (the low-precision buffer is freed).
    fn widen(&mut self, ctx: &mut CommContext) -> Result<(), FsdpError> {
        let Some(full) = self.full.as_ref().filter(|_| ctx.device.is_none()) else {
            // On a device the model reads `param_dtype` itself.
            return Ok(());
        };
        if full.dtype() == DType::F32 {
            return Ok(());
        }
        let wide = ctx.alloc_local(full.len())?;
        if !ctx.is_meta() {
            load_exact(full, &mut wide.write::<f32>()?)?;
        }
        ctx.unsharded_bytes += block_bytes(&wide);
        ctx.unsharded_bytes -= block_bytes(full);
        self.full = Some(wide);
        ctx.sample_peak();
        Ok(())
    }

    /// For an unsharded (`F = 1`) unit with a low-precision `param_dtype`: the shard rounded
    /// to it, once per pass (see [`MixedPrecisionPolicy`]).
    pub(crate) fn ensure_rounded(&mut self, ctx: &mut CommContext) -> Result<(), FsdpError> {
        if self.factor != 1
            || self.dtypes.param == DType::F32
            || self.rounded.is_some()
            || ctx.device.is_some()
        {
            return Ok(());
        }
        let r = ctx.alloc_local(self.shard.len())?;
        if !ctx.is_meta() {
            let p = self.dtypes.param;
            let mut w = r.write::<f32>()?;
            load(&self.shard, |i, v| {
                w[i] = super::mixed_precision::round_to(p, v)
            })?;
        }
        self.rounded = Some(r);
        ctx.sample_peak();
        Ok(())
    }

    /// The buffer the model reads while the unit is unsharded.
    pub(crate) fn compute_params(&self) -> Option<&Buffer> {
        if self.factor == 1 && self.uploaded.is_none() && self.full.is_some() {
            // Host memory: the shard itself, or its rounding to `param_dtype`.
            return self.rounded.as_ref().or(self.full.as_ref());
        }
        self.uploaded.as_ref().or(self.full.as_ref())
    }

    /// On a device, an unsharded (`F = 1`) unit's parameters are copied there (cast to
    /// `param_dtype` on the host first), once until [`reshard`](Self::reshard) or the next
    /// pass; nothing on the host.
    fn upload_unsharded(&mut self, ctx: &mut CommContext) -> Result<(), FsdpError> {
        let Some(dev) = ctx.device.clone() else {
            return Ok(());
        };
        if self.uploaded.is_some() {
            return Ok(());
        }
        let p = self.dtypes.param;
        if ctx.shards_on_device().is_some() {
            // The shard is on the device: read as it is, or cast there.
            self.uploaded = Some(if self.shard.dtype() == p {
                self.shard.clone()
            } else {
                let t = dev.transfer_stream();
                let b = dev.alloc(p, self.shard.len(), t)?;
                dev.cast(&self.shard, &b, t)?;
                b
            });
            return Ok(());
        }
        let host = if self.shard.dtype() == p {
            self.shard.clone()
        } else {
            let b = ctx.alloc_typed(p, self.shard.len(), &ctx.compute, &ctx.compute)?;
            cast_buffer(&self.shard, &b)?;
            b
        };
        self.uploaded = Some(dev.copy_from_host(&host, dev.transfer_stream())?);
        Ok(())
    }

    /// Free (reshard) the unsharded parameters. An unsharded (`F = 1`) unit keeps its shard:
    /// nothing on the host; on a device, its copy there is freed.
    pub fn reshard(&mut self, ctx: &mut CommContext) {
        if self.factor == 1 {
            // On a device its copy is freed (copied again when next needed).
            self.uploaded = None;
            return;
        }
        let Some(full) = self.full.take() else {
            return;
        };
        ctx.unsharded_bytes -= block_bytes(&full);
        self.gather = None;
        self.gather_input = None;
        if std::mem::take(&mut self.counted) {
            ctx.in_flight -= 1;
            if ctx.device.is_some() {
                // Still used by the device's work until it completes: the limiter counts it.
                ctx.freeing.push_back(full);
            }
        }
        ctx.record(self.index, ScheduleKind::Free, false);
    }

    /// Allocate and zero the unsharded gradient, unless it exists (accumulating under
    /// `no_sync`). An unsharded unit whose gradient shard still holds zeros accumulates in it
    /// directly (reduced in place).
    ///
    /// # Errors
    /// A failing allocation.
    pub(crate) fn ensure_grad(&mut self, ctx: &mut CommContext) -> Result<(), FsdpError> {
        if self.full_grad.is_some() {
            return Ok(());
        }
        // An unsharded unit whose gradient needs no cast or division accumulates straight
        // into its gradient shard of zeros (on the host, or with the shard on the device).
        let in_place = ctx.device.is_none() || ctx.shards_on_device().is_some();
        if in_place
            && self.factor == 1
            && self.grad_shard_zero
            && super::reduce::reduces_in_place(self, ctx)
        {
            self.full_grad = Some(self.grad_shard.clone());
            return Ok(());
        }
        if let Some(dev) = &ctx.device {
            // On the device, zeroed on the compute stream (before the model's backward).
            let s = dev.compute_stream();
            let g = dev.alloc(DType::F32, self.layout.padded_numel(), s)?;
            dev.zero(&g, s)?;
            self.full_grad = Some(g);
            return Ok(());
        }
        let comm = ctx
            .groups
            .shard()
            .map_or_else(|| ctx.groups.world().stream(), |g| g.stream());
        let _frame = fsdp_allocator::memory_context_with(|| {
            format!("unit {} ({}) gradient", self.index, self.name)
        });
        let g = ctx.alloc(self.layout.padded_numel(), &ctx.compute, comm)?;
        ctx.fill(&g, 0.0)?;
        self.full_grad = Some(g);
        ctx.sample_peak();
        Ok(())
    }

    /// Drop the unsharded buffers and pending work (after a failed step).
    pub(crate) fn reset_transient(&mut self, ctx: &mut CommContext) {
        if self.factor > 1 {
            if let Some(full) = self.full.take() {
                ctx.unsharded_bytes -= block_bytes(&full);
            }
        }
        self.gather = None;
        self.gather_input = None;
        self.counted = false;
        if let Some(g) = self.full_grad.take() {
            // A gradient accumulated in the gradient shard itself (`ensure_grad`): the shard
            // holds the aborted pass's part, no longer zeros (until `zero_grad`).
            if g.overlaps(&self.grad_shard) {
                self.grad_shard_zero = false;
            }
        }
        self.replace_shard = false;
        self.rounded = None;
        self.uploaded = None;
    }
}

/// Cast `src` into `dst` (any dtypes, same length), rounding once to `dst`'s dtype.
pub(crate) fn cast_buffer(src: &Buffer, dst: &Buffer) -> Result<(), FsdpError> {
    if src.dtype() == DType::F32 {
        return store_exact(dst, &src.read::<f32>()?);
    }
    let mut wide = crate::try_filled_vec(src.len(), 0.0f32, "a cast buffer")?;
    load_exact(src, &mut wide)?;
    store_exact(dst, &wide)
}

/// The allocator's size of a buffer's block (its rounding of the request).
fn block_bytes(b: &Buffer) -> u64 {
    fsdp_allocator::round_size(b.byte_len()).unwrap_or(usize::MAX) as u64
}
