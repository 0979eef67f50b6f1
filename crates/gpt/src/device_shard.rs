//! FSDP's units on a device: [`ShardedUnits`], the [`Units`] hooks of a sharded trainer's pass.
//!
//! Every parameter tensor is sharded alone, flat, over the `factor` ranks that shard it (as
//! FSDP2 shards each parameter; `factor` 1 replicates it, FSDP's `NO_SHARD`): rank `r` holds
//! elements `r·s .. (r+1)·s` of the flattened tensor, `s = ⌈numel / factor⌉`, zero-padded.
//! The hooks then do what FSDP's do for each unit of the wrap policy (by default the root —
//! `wte`, `wpe`, `ln_f` — and each block), at the spans where [`UnitLayout`] opens and closes
//! it:
//!
//! - `pre_forward` / `pre_backward`: unshard (one all-gather of the unit's shards into full
//!   tensors) unless the unit is unsharded already; `pre_backward` also gives zero gradients;
//! - `post_forward`: with `reshard_after_forward` (`FULL_SHARD`), a unit other than the root
//!   frees its full parameters (the root keeps them, as FSDP's root does);
//! - `post_backward`: the unit's gradients reduced to this rank's shards with the ranks'
//!   mean (one reduce-scatter; an all-reduce when replicated; under the hybrid strategies the
//!   reduce-scatter inside the node, then an all-reduce of the shards over the nodes), added
//!   to the step's gradient accumulators as `acc += alpha·g`, and the full gradients and
//!   parameters freed.

use fsdp_device::DType;
use fsdp_kernels::gpt::{Block, GptDims, GptOps, Unit, Units, Weights, WithGrads};
use fsdp_kernels::KernelError;

use crate::device_comm::{bytes, CommVolume, DeviceComm};
use crate::device_config::DeviceTrainError;
use crate::device_units::{pick, UnitLayout};

#[path = "device_shard_offload.rs"]
mod offload;
use offload::{copy_in, host_unshard};
#[path = "device_shard_slots.rs"]
mod slots;
use slots::Slots;

/// A hook's result.
type DeviceResult = Result<(), DeviceTrainError>;

/// Elements of one shard of a tensor of `numel` elements over `factor` ranks.
pub(crate) fn shard_len(numel: usize, factor: usize) -> usize {
    numel.div_ceil(factor.max(1))
}

/// Rank `rank`'s shard of `full` over `factor` ranks, zero-padded.
pub(crate) fn shard_of(full: &[f32], rank: usize, factor: usize) -> Vec<f32> {
    let s = shard_len(full.len(), factor);
    let mut v = vec![0.0; s];
    let start = (rank * s).min(full.len());
    let end = ((rank + 1) * s).min(full.len());
    v[..end - start].copy_from_slice(&full[start..end]);
    v
}

fn not_held(what: &str) -> DeviceTrainError {
    KernelError::InvalidArgument {
        kernel: "fsdp units",
        reason: format!("{what} is not unsharded now"),
    }
    .into()
}

/// Which all-gathers a sharded pass issues ahead of their use (FSDP's explicit prefetch), so
/// that a communicator with a stream of its own (NCCL through
/// [`StagedComm`](crate::device_staged::StagedComm)) gathers the next unit while this one
/// computes. Communicators that run each collective whole ignore it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefetch {
    /// In forward, at each span's `pre_forward`, the all-gather of the first unit the next
    /// block opens (the next block's, under the block plan; FSDP's `forward_prefetch`).
    /// Default off, as FSDP's.
    pub forward: bool,
    /// In backward, at each span's `pre_backward`, the all-gather of the first unit the
    /// previous block opens (FSDP's `BackwardPrefetch.BACKWARD_PRE`, its default). Default
    /// on.
    pub backward: bool,
}

impl Prefetch {
    /// No all-gather issued ahead.
    pub const NONE: Prefetch = Prefetch {
        forward: false,
        backward: false,
    };
}

impl Default for Prefetch {
    fn default() -> Self {
        Prefetch {
            forward: false,
            backward: true,
        }
    }
}

/// Where a sharded pass's parameter shards are.
pub(crate) enum ShardSource<'a, O: GptOps> {
    /// On the device (the full parameters when replicated).
    Device(&'a Weights<O::Buf>),
    /// CPU offload (FSDP's `offload_params`): in host staging memory, kept by the optimizer
    /// on the host; each unit's shards are copied in without a wait before it is gathered
    /// (replicated: copied in as its parameters; prefetched: copied in with the prefetch and
    /// kept until the all-gather) and freed after, so the device holds no shards between
    /// uses.
    Host(&'a mut Weights<O::Staging>),
}

/// The parameters held on the device throughout: the shards when they are on the device and
/// replicated (`factor` 1), not under CPU offload.
fn resident<'s, O: GptOps>(
    shards: &'s ShardSource<'_, O>,
    factor: usize,
) -> Option<&'s Weights<O::Buf>> {
    match shards {
        ShardSource::Device(w) if factor == 1 => Some(w),
        _ => None,
    }
}

/// The [`Units`] of one pass of a sharded trainer (see the [module](self) documentation).
pub(crate) struct ShardedUnits<'a, O: GptOps, C: ?Sized> {
    comm: &'a C,
    /// Under the hybrid strategies, the ranks holding the same shards in the other nodes.
    replicas: Option<&'a C>,
    /// The units and where the pass opens and closes them.
    layout: &'a UnitLayout,
    dims: GptDims,
    /// Ranks sharding each tensor (1: replicated).
    factor: usize,
    reshard_after_forward: bool,
    prefetch: Prefetch,
    /// This rank's parameter shards (the full parameters when replicated).
    shards: ShardSource<'a, O>,
    /// Where the reduced gradients go: the step's accumulators, shaped as `shards`.
    sink: GradSink<'a, O>,
    /// The weight of this pass's gradients in the accumulators (`1 / micro-batches`).
    alpha: f32,
    /// The dtype the gradients are reduced in (FSDP's `reduce_dtype`: f32, bf16 or f16).
    reduce_dtype: DType,
    /// The dtype the parameters are all-gathered in (f32, or bf16 where every parameter's
    /// value is a bf16: pure-bf16 training).
    gather_dtype: DType,
    /// Whether the blocks' weights that only products read are gathered in bf16 (with bf16
    /// products, which read them rounded to bf16 anyway).
    bf16_weights: bool,
    /// The full parameters of the unsharded units.
    params: Slots<O::Buf>,
    /// The full gradients of the units between their opening and closing in backward.
    grads: Slots<O::Buf>,
    /// Which units are unsharded now.
    unsharded: Vec<bool>,
    /// Under CPU offload, the shards of the unit whose all-gather was prefetched, copied in
    /// and kept until the all-gather that completes it.
    copied_in: Option<(usize, Vec<O::Buf>)>,
    /// The bytes this pass's collectives moved.
    volume: CommVolume,
}

impl<'a, O: GptOps, C: DeviceComm<O> + ?Sized> ShardedUnits<'a, O, C> {
    /// The hooks of one pass over `shards` (sharded over `factor` ranks of `comm`) with the
    /// units of `layout`, adding `alpha ×` the reduced gradients into the accumulators of
    /// `sink`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        comm: &'a C,
        replicas: Option<&'a C>,
        layout: &'a UnitLayout,
        dims: GptDims,
        factor: usize,
        reshard_after_forward: bool,
        shards: ShardSource<'a, O>,
        sink: GradSink<'a, O>,
        alpha: f32,
    ) -> Self {
        ShardedUnits {
            comm,
            replicas,
            layout,
            dims,
            factor,
            reshard_after_forward,
            prefetch: Prefetch::default(),
            shards,
            sink,
            alpha,
            reduce_dtype: DType::F32,
            gather_dtype: DType::F32,
            bf16_weights: false,
            params: Slots::new(layout.numels.len(), dims.n_layer),
            grads: Slots::new(layout.numels.len(), dims.n_layer),
            unsharded: vec![false; layout.units.len()],
            copied_in: None,
            volume: CommVolume::default(),
        }
    }

    /// The bytes this pass's collectives have moved so far.
    pub(crate) fn volume(&self) -> CommVolume {
        self.volume
    }

    fn sharded(&self) -> bool {
        self.factor > 1
    }

    /// The parameters held on the device throughout: the shards when replicated on the
    /// device (not under CPU offload).
    fn resident(&self) -> Option<&Weights<O::Buf>> {
        resident(&self.shards, self.factor)
    }

    /// These hooks with `prefetch`.
    pub(crate) fn with_prefetch(mut self, prefetch: Prefetch) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// These hooks reducing the gradients in `dtype` (f32, bf16 or f16; checked by the
    /// collectives).
    pub(crate) fn with_reduce_dtype(mut self, dtype: DType) -> Self {
        self.reduce_dtype = dtype;
        self
    }

    /// These hooks all-gathering the parameters in `dtype` (f32, or bf16 when their values
    /// are bf16; checked by the collectives), and with `bf16_weights` the blocks' weights
    /// that only products read in bf16 (bf16 products read nothing else of them).
    pub(crate) fn with_gather_dtype(mut self, dtype: DType, bf16_weights: bool) -> Self {
        self.gather_dtype = dtype;
        self.bf16_weights = bf16_weights;
        self
    }

    /// The dtypes unit `u`'s tensors are all-gathered in (its tensors' order).
    fn dtypes(&self, u: usize) -> Vec<DType> {
        let l = self.layout;
        l.units[u]
            .tensors
            .iter()
            .map(|&i| {
                if self.bf16_weights && l.product_weight(i) {
                    DType::BF16
                } else {
                    self.gather_dtype
                }
            })
            .collect()
    }

    /// The lengths of unit `u`'s shards, in its tensors' order.
    fn shard_lens(&self, u: usize) -> Vec<usize> {
        let l = self.layout;
        let lens = l.units[u].tensors.iter().map(|&i| l.numels[i]);
        lens.map(|n| shard_len(n, self.factor)).collect()
    }

    /// Starts the all-gather of the first unit that `span` opens and that is not unsharded
    /// (`forward`: in forward, else in backward); under CPU offload its shards are copied in
    /// first, and kept until it is gathered.
    fn prefetch(&mut self, ops: &O, span: Option<Unit>, forward: bool) -> DeviceResult {
        let (Some(span), true) = (span, self.sharded()) else {
            return Ok(());
        };
        let layout = self.layout;
        let held = |u: &usize| self.unsharded[*u];
        let first = if forward {
            layout.forward_opens(span).find(|u| !held(u))
        } else {
            layout.backward_opens(span).find(|u| !held(u))
        };
        let Some(u) = first else {
            return Ok(());
        };
        let (dtypes, lens) = (self.dtypes(u), self.shard_lens(u));
        let tensors = &layout.units[u].tensors;
        match &mut self.shards {
            ShardSource::Device(w) => {
                self.comm
                    .prefetch_all_gather(ops, &pick(w.all(), tensors), &dtypes)?;
            }
            ShardSource::Host(st) if self.copied_in.is_none() => {
                let shards = copy_in(ops, pick(st.all_mut(), tensors), &lens)?;
                let refs: Vec<&O::Buf> = shards.iter().collect();
                if self.comm.prefetch_all_gather(ops, &refs, &dtypes)? {
                    self.copied_in = Some((u, shards));
                }
            }
            ShardSource::Host(_) => {}
        }
        Ok(())
    }

    /// The block after `span` in forward order.
    fn next_block(&self, span: Unit) -> Option<Unit> {
        let next = match span {
            Unit::Root => 0,
            Unit::Block(l) => l + 1,
        };
        (next < self.dims.n_layer).then_some(Unit::Block(next))
    }

    /// The block after `span` in backward order.
    fn previous_block(&self, span: Unit) -> Option<Unit> {
        match span {
            Unit::Root => self.dims.n_layer.checked_sub(1),
            Unit::Block(l) => l.checked_sub(1),
        }
        .map(Unit::Block)
    }

    /// Gathers unit `u`'s full parameters into their slots unless held (under CPU offload,
    /// copies its shards in first; replicated, copies them in as its parameters).
    fn unshard(&mut self, ops: &O, u: usize) -> DeviceResult {
        if self.resident().is_some() || self.unsharded[u] {
            return Ok(());
        }
        let (factor, comm, layout) = (self.factor, self.comm, self.layout);
        let (dtypes, lens) = (self.dtypes(u), self.shard_lens(u));
        let unit = &layout.units[u];
        let mut fulls = unit
            .tensors
            .iter()
            .map(|&i| ops.empty(layout.numels[i]))
            .collect::<Result<Vec<_>, _>>()?;
        let mut outs: Vec<&mut O::Buf> = fulls.iter_mut().collect();
        match &mut self.shards {
            ShardSource::Device(w) => {
                comm.all_gather(ops, &pick(w.all(), &unit.tensors), &mut outs, &dtypes)?
            }
            ShardSource::Host(st) => {
                let staged = pick(st.all_mut(), &unit.tensors);
                let how = (comm, ops, factor, dtypes.as_slice());
                host_unshard(
                    how,
                    staged,
                    lens.clone(),
                    &mut self.copied_in,
                    (u, unit),
                    outs,
                )?
            }
        }
        for (&i, b) in unit.tensors.iter().zip(fulls) {
            self.params.put(i, b);
        }
        self.unsharded[u] = true;
        for (s, &dtype) in lens.into_iter().zip(&dtypes) {
            self.volume.all_gathered += bytes(s * factor, dtype);
        }
        Ok(())
    }

    /// Frees unit `u`'s full parameters.
    fn free(&mut self, u: usize) {
        if std::mem::take(&mut self.unsharded[u]) {
            for &i in &self.layout.units[u].tensors {
                drop(self.params.take(i));
            }
        }
    }

    /// Reduces unit `u`'s full gradients (taken from their slots) in the reduction's dtype,
    /// adds `alpha ×` this rank's part of them to the unit's accumulators in the sink, frees
    /// its parameters and counts the bytes moved.
    fn reduce(&mut self, ops: &O, u: usize) -> DeviceResult {
        let layout = self.layout;
        let unit = &layout.units[u];
        let mut grads = Vec::with_capacity(unit.tensors.len());
        for &i in &unit.tensors {
            let g = self.grads.take(i);
            grads.push(g.ok_or_else(|| not_held(&format!("{unit}'s gradients")))?);
        }
        let full: Vec<&mut O::Buf> = grads.iter_mut().collect();
        let (comm, replicas, factor) = (self.comm, self.replicas, self.factor);
        let (alpha, dtype) = (self.alpha, self.reduce_dtype);
        let lens = self.shard_lens(u);
        let sink = &mut self.sink;
        let mut volume = CommVolume::default();
        if factor > 1 {
            let shards: usize = lens.iter().sum();
            volume.reduce_scattered = bytes(shards * factor, dtype);
            let mut reduced = lens
                .iter()
                .map(|&n| ops.empty(n))
                .collect::<Result<Vec<_>, _>>()?;
            let fulls: Vec<&O::Buf> = full.iter().map(|f| &**f).collect();
            let mut outs: Vec<&mut O::Buf> = reduced.iter_mut().collect();
            comm.reduce_scatter_avg(ops, &fulls, &mut outs, dtype)?;
            if let Some(r) = replicas {
                // The nodes' means of the same shards, averaged: the mean over every rank.
                r.all_reduce_avg(ops, &mut outs, dtype)?;
                if r.world_size() > 1 {
                    volume.all_reduced = bytes(shards, dtype);
                }
            }
            sink.add(ops, alpha, &unit.tensors, reduced.iter().collect())?;
        } else {
            let mut full = full;
            let n = bytes(full.iter().map(|g| O::buf_len(g)).sum(), dtype);
            comm.all_reduce_avg(ops, &mut full, dtype)?;
            if comm.world_size() > 1 {
                volume.all_reduced = n;
            }
            if let Some(r) = replicas {
                // Nodes of one rank: the shards are whole tensors, averaged over the nodes.
                r.all_reduce_avg(ops, &mut full, dtype)?;
                if r.world_size() > 1 {
                    volume.all_reduced = volume.all_reduced.saturating_add(n);
                }
            }
            sink.add(
                ops,
                alpha,
                &unit.tensors,
                full.iter().map(|g| &**g).collect(),
            )?;
        }
        self.volume += volume;
        // The parameters are freed before the gradients, as the unit's buffers go.
        self.free(u);
        drop(grads);
        Ok(())
    }
}

/// Where a sharded pass's reduced gradients are accumulated: on the device, or under CPU
/// offload copied out into host staging memory without a wait (the trainer adds them to the
/// host's accumulators with the host twins' `axpby` once the copies are done, bitwise the
/// device's).
pub(crate) enum GradSink<'a, O: GptOps> {
    /// The accumulators on the device.
    Device(&'a mut Weights<O::Buf>),
    /// Staging memory on the host, shaped as the shards.
    Staged(&'a mut Weights<O::Staging>),
}

impl<O: GptOps> GradSink<'_, O> {
    /// Adds `alpha × grads` (on the device, of the tensors `tensors`) to their accumulators,
    /// or starts copying them out into their staging memory (`alpha` is applied on the host).
    fn add(&mut self, ops: &O, alpha: f32, tensors: &[usize], grads: Vec<&O::Buf>) -> DeviceResult {
        match self {
            GradSink::Device(w) => {
                for (a, g) in pick(w.all_mut(), tensors).into_iter().zip(grads) {
                    ops.axpby(alpha, g, 1.0, a)?;
                }
            }
            GradSink::Staged(staging) => {
                for (s, g) in pick(staging.all_mut(), tensors).into_iter().zip(grads) {
                    ops.copy_out(g, s)?;
                }
            }
        }
        Ok(())
    }
}

impl<O: GptOps, C: DeviceComm<O> + ?Sized> Units<O> for ShardedUnits<'_, O, C> {
    type Error = DeviceTrainError;

    fn traced(&self) -> bool {
        true
    }

    fn pre_forward(&mut self, ops: &O, span: Unit) -> DeviceResult {
        let layout = self.layout;
        for u in layout.forward_opens(span) {
            self.unshard(ops, u)?;
        }
        if self.resident().is_none() {
            self.params
                .assemble(layout, &self.dims, span, "the parameters")?;
        }
        if self.prefetch.forward {
            self.prefetch(ops, self.next_block(span), true)?;
        }
        Ok(())
    }

    fn post_forward(&mut self, _: &O, span: Unit) -> DeviceResult {
        let layout = self.layout;
        self.params.disassemble(layout, span);
        if self.reshard_after_forward {
            // FSDP does not reshard its root after forward: backward gathers it at once.
            for u in layout.forward_closes(span) {
                if !layout.units[u].is_root() {
                    self.free(u);
                }
            }
        }
        Ok(())
    }

    fn pre_backward(&mut self, ops: &O, span: Unit) -> DeviceResult {
        let layout = self.layout;
        for u in layout.backward_opens(span) {
            self.unshard(ops, u)?;
            for &i in &layout.units[u].tensors {
                self.grads.put(i, ops.zeros(layout.numels[i])?);
            }
        }
        if self.resident().is_none() {
            self.params
                .assemble(layout, &self.dims, span, "the parameters")?;
        }
        self.grads
            .assemble(layout, &self.dims, span, "the gradients")?;
        if self.prefetch.backward {
            self.prefetch(ops, self.previous_block(span), false)?;
        }
        Ok(())
    }

    fn post_backward(&mut self, ops: &O, span: Unit) -> DeviceResult {
        let layout = self.layout;
        self.params.disassemble(layout, span);
        self.grads.disassemble(layout, span);
        for u in layout.backward_closes(span) {
            self.reduce(ops, u)?;
        }
        Ok(())
    }

    fn root(&self) -> Result<&Weights<O::Buf>, DeviceTrainError> {
        self.params
            .root()
            .or_else(|| self.resident())
            .ok_or_else(|| not_held("the root"))
    }

    fn block(&self, layer: usize) -> Result<&Block<O::Buf>, DeviceTrainError> {
        let what = || not_held(&format!("block {layer}"));
        match self.params.block(layer) {
            Some(b) => Ok(b),
            None => self
                .resident()
                .and_then(|w| w.blocks.get(layer))
                .ok_or_else(what),
        }
    }

    fn root_grads(&mut self) -> Result<WithGrads<'_, Weights<O::Buf>>, DeviceTrainError> {
        let resident = resident(&self.shards, self.factor);
        let params = self.params.root().or(resident);
        let params = params.ok_or_else(|| not_held("the root"))?;
        let grads = self.grads.root_mut();
        Ok((
            params,
            grads.ok_or_else(|| not_held("the root's gradients"))?,
        ))
    }

    fn block_grads(
        &mut self,
        layer: usize,
    ) -> Result<WithGrads<'_, Block<O::Buf>>, DeviceTrainError> {
        let what = || not_held(&format!("block {layer}"));
        let resident = resident(&self.shards, self.factor).and_then(|w| w.blocks.get(layer));
        let params = self.params.block(layer).or(resident).ok_or_else(what)?;
        let grads = self.grads.block_mut(layer).ok_or_else(what)?;
        Ok((params, grads))
    }
}
