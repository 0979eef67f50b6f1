//! Gradient reduction of a param group as one function (FSDP2's `foreach_reduce`):
//! reduce-scatter over the shard group, then the all-reduce of the shard over the replicas
//! (hybrid strategies), or the all-reduce over the world for unsharded units (`NO_SHARD`,
//! ignored parameters); and the accumulation of the reduced shards once they arrive.

use fsdp_collectives::ReduceOp;
use fsdp_device::{Buffer, DType};

use super::comm_context::{internal, CommContext, PendingReduce};
use super::config::ScheduleKind;
use super::device::ComputeDevice;
use super::mixed_precision::{
    accumulate_reduced, divide_factors, fill_reduce_input, DivideFactors,
};
use super::param_group::ParamGroup;
use crate::trace::SpanKind;
use crate::FsdpError;

/// Reduced gradients to add into the groups' gradient shards once the reductions completed:
/// the unit, the reduced buffer (in the reduce dtype; on a device, device memory copied to the
/// host then), the post-divide factor, and whether it replaces a gradient shard of zeros
/// (copied in, not added: the same bits as a reduction straight into the shard).
pub(crate) type PendingGrads = Vec<(usize, Buffer, Option<f32>, bool)>;

/// The data-parallel size of a unit's gradient: the ranks whose gradients it sums.
fn data_parallel_size(group: &ParamGroup, ctx: &CommContext) -> usize {
    let size = |c: Option<&dyn fsdp_collectives::Communicator>| c.map_or(1, |c| c.world_size());
    if group.replicated_all {
        return ctx.groups.world().world_size();
    }
    let shard = if group.factor > 1 {
        size(ctx.groups.shard())
    } else {
        1
    };
    shard * size(ctx.groups.replicate())
}

/// The division factors of `group`'s reduction.
fn reduce_factors(group: &ParamGroup, ctx: &CommContext) -> DivideFactors {
    divide_factors(
        ctx.config.gradient_divide,
        group.dtypes.reduce,
        data_parallel_size(group, ctx),
    )
}

/// Whether the reduction runs on the `f32` gradient itself (nothing to cast or divide).
fn is_plain(group: &ParamGroup, factors: DivideFactors) -> bool {
    group.dtypes.param == DType::F32
        && group.dtypes.reduce == DType::F32
        && factors == DivideFactors::NONE
}

/// Whether `group`'s unsharded gradient is reduced as it is (so an unsharded unit may
/// accumulate straight into its gradient shard).
pub(crate) fn reduces_in_place(group: &ParamGroup, ctx: &CommContext) -> bool {
    is_plain(group, reduce_factors(group, ctx))
}

/// Issue the reduction of `group`'s unsharded gradient (which it hands over). The reduced
/// shard lands straight in the gradient shard when that holds zeros, otherwise in a new buffer
/// that [`finish_reductions`] adds into it.
///
/// # Errors
/// A failing allocation or collective.
pub(crate) fn foreach_reduce(
    group: &mut ParamGroup,
    ctx: &mut CommContext,
    pending_grads: &mut PendingGrads,
) -> Result<(), FsdpError> {
    let g = group
        .full_grad
        .take()
        .ok_or_else(|| internal("reduce of a unit without gradients"))?;
    let u = group.index;
    let factors = reduce_factors(group, ctx);
    if let Some(dev) = ctx.device.clone() {
        return reduce_on_device(group, ctx, pending_grads, &dev, g, factors);
    }
    let plain = is_plain(group, factors);
    // Mixed precision or a division: the reduction runs on a copy in the reduce dtype (the
    // gradient rounded to the parameter dtype, pre-divided); the f32 gradient is freed.
    let g = if plain {
        g
    } else {
        let comm = ctx
            .groups
            .shard()
            .map_or_else(|| ctx.groups.world().stream(), |c| c.stream());
        let send = ctx.alloc_typed(group.dtypes.reduce, g.len(), &ctx.compute, comm)?;
        if !ctx.is_meta() {
            fill_reduce_input(&g.read::<f32>()?, &send, group.dtypes.param, factors)?;
        }
        send
    };
    let direct = group.grad_shard_zero && plain;
    let target = if group.factor > 1 {
        let out = if direct {
            group.grad_shard.clone()
        } else {
            let stream = shard_group(ctx)?.stream().clone();
            let n = group.layout.shard_numel();
            ctx.alloc_typed(group.dtypes.reduce, n, &stream, &ctx.compute)?
        };
        reduce_scatter(group, ctx, g, &out)?;
        out
    } else {
        g
    };
    all_reduce_replicas(group, ctx, &target)?;
    if !(direct && group.factor > 1) {
        pending_grads.push((u, target, factors.post_divide, false));
    }
    group.grad_shard_zero = false;
    group.replace_shard = direct && group.factor == 1;
    Ok(())
}

/// Wait for the issued reductions and accumulate their results into the gradient shards.
///
/// # Errors
/// A failed collective or buffer access.
pub(crate) fn finish_reductions(
    groups: &mut [ParamGroup],
    ctx: &mut CommContext,
    pending_grads: &mut PendingGrads,
) -> Result<(), FsdpError> {
    for p in std::mem::take(&mut ctx.pending) {
        ctx.wait_or_defer(p.work)?;
    }
    let mut grads = std::mem::take(pending_grads);
    if let Some(dev) = ctx.shards_on_device().cloned() {
        // The shards are on the device too: the reduced shards are added there, on the
        // compute stream after their collectives; the host does not wait.
        for (u, g, post_divide, copy_in) in grads {
            let s = dev.compute_stream();
            dev.scale_divide(&g, None, post_divide, s)?;
            dev.accumulate(&groups[u].grad_shard, &g, copy_in, s)?;
        }
        // The pass is over: the freed gathered parameters go to the reaper, which returns
        // their memory once the device's work on them completed.
        ctx.freeing.clear();
        return Ok(());
    }
    if let Some(dev) = ctx.device.clone() {
        // The reduced shards come to host memory after their reductions, then the device's
        // streams and the collectives are waited for (and their errors reported) before they
        // are read.
        for (_, g, _, _) in &mut grads {
            *g = dev.copy_to_host(g, dev.transfer_stream())?;
        }
        ctx.synchronize()?;
        // The device is idle: the freed gathered parameters' memory goes back too.
        ctx.reap_freed();
    }
    for (u, g, post_divide, copy_in) in grads {
        let group = &mut groups[u];
        if copy_in {
            if !ctx.is_meta() {
                let mut acc = group.grad_shard.write::<f32>()?;
                accumulate_reduced(&g, &mut acc, post_divide, true)?;
            }
            continue;
        }
        if std::mem::take(&mut group.replace_shard) {
            // The first reduction of an unsharded unit: its buffer becomes the shard.
            group.grad_shard = g;
            continue;
        }
        if ctx.is_meta() {
            continue;
        }
        if g.dtype() != DType::F32 || post_divide.is_some() {
            let mut acc = group.grad_shard.write::<f32>()?;
            accumulate_reduced(&g, &mut acc, post_divide, false)?;
            continue;
        }
        let add = g.read::<f32>()?;
        let mut acc = group.grad_shard.write::<f32>()?;
        for (a, b) in acc.iter_mut().zip(add.iter()) {
            *a += *b;
        }
    }
    Ok(())
}

/// [`foreach_reduce`] on a [`ComputeDevice`]: the `f32` gradient rounded to `param_dtype` and
/// cast to the reduce dtype on the device (unless both are `f32`), reduce-scattered (and
/// all-reduced over replicas) there; [`finish_reductions`] adds the result into the gradient
/// shard there, or offloaded, copies it to the host and adds it there.
fn reduce_on_device(
    group: &mut ParamGroup,
    ctx: &mut CommContext,
    pending_grads: &mut PendingGrads,
    dev: &ComputeDevice,
    g: Buffer,
    factors: DivideFactors,
) -> Result<(), FsdpError> {
    let u = group.index;
    let (param, reduce) = (group.dtypes.param, group.dtypes.reduce);
    let s = dev.compute_stream();
    let plain = is_plain(group, factors);
    let send = if plain {
        g
    } else {
        // Rounded to `param_dtype`, cast to the reduce dtype, pre-multiplied or pre-divided.
        let send = dev.alloc(reduce, g.len(), s)?;
        dev.round_into(&g, &send, param, s)?;
        dev.scale_divide(&send, factors.premul, factors.pre_divide, s)?;
        send
    };
    // As on the host: a gradient shard of zeros takes the reduction as it is only when nothing
    // is cast or divided (else zeros plus the result, which differ for −0).
    let copy_in = group.grad_shard_zero && plain;
    // With the shard on the device, a gradient shard of zeros receives the reduce-scatter
    // itself (as on the host); an unsharded unit's gradient is the shard itself then
    // (`ParamGroup::ensure_grad`), all-reduced over replicas in place.
    let on_device = ctx.shards_on_device().is_some();
    let in_shard = group.factor == 1 && send.overlaps(&group.grad_shard);
    let direct = copy_in && on_device && (group.factor > 1 || in_shard);
    let target = if group.factor > 1 {
        let out = if direct {
            group.grad_shard.clone()
        } else {
            dev.alloc(reduce, group.layout.shard_numel(), s)?
        };
        reduce_scatter(group, ctx, send, &out)?;
        out
    } else {
        send
    };
    all_reduce_replicas(group, ctx, &target)?;
    if !direct {
        pending_grads.push((u, target, factors.post_divide, copy_in));
    }
    group.grad_shard_zero = false;
    group.replace_shard = false;
    Ok(())
}

/// The group a sharded unit's parameters are sharded over.
fn shard_group(ctx: &CommContext) -> Result<&dyn fsdp_collectives::Communicator, FsdpError> {
    ctx.groups
        .shard()
        .ok_or_else(|| internal("a sharded unit without a shard group"))
}

/// Issue the reduce-scatter of `group`'s reduction input `send` into `out` over the shard
/// group; `send` is held until the host waits for a collective issued after it.
fn reduce_scatter(
    group: &ParamGroup,
    ctx: &mut CommContext,
    send: Buffer,
    out: &Buffer,
) -> Result<(), FsdpError> {
    let u = group.index;
    let bytes = group.layout.shard_numel() * group.dtypes.reduce.size_in_bytes();
    let shard = shard_group(ctx)?;
    let work = ctx.traced(
        shard.stream(),
        SpanKind::ReduceScatter,
        vec![u],
        bytes,
        || Ok(shard.reduce_scatter_base(&send, out, ReduceOp::Sum)?),
    )?;
    let issued = ctx.next_issue();
    ctx.sample_peak();
    ctx.pending.push(PendingReduce {
        work,
        issued,
        holds: Some(send),
    });
    ctx.record(u, ScheduleKind::ReduceScatter, false);
    Ok(())
}

/// Issue the all-reduce of `group`'s reduced `target` over its replicas (the world for
/// ignored parameters), if it has any.
fn all_reduce_replicas(
    group: &ParamGroup,
    ctx: &mut CommContext,
    target: &Buffer,
) -> Result<(), FsdpError> {
    let replicas = if group.replicated_all {
        ctx.groups.world_multi()
    } else {
        ctx.groups.replicate()
    };
    let Some(replicas) = replicas else {
        return Ok(());
    };
    let bytes = target.len() * group.dtypes.reduce.size_in_bytes();
    let work = ctx.traced(
        replicas.stream(),
        SpanKind::AllReduce,
        vec![group.index],
        bytes,
        || Ok(replicas.all_reduce(target, ReduceOp::Sum)?),
    )?;
    let issued = ctx.next_issue();
    ctx.pending.push(PendingReduce {
        work,
        issued,
        holds: None,
    });
    ctx.record(group.index, ScheduleKind::AllReduce, false);
    Ok(())
}
