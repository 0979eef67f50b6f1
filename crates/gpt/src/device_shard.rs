//! FSDP's units on a device: [`ShardedUnits`], the [`Units`] hooks of a sharded trainer's pass.
//!
//! Every parameter tensor is sharded alone, flat, over the `factor` ranks that shard it (as
//! FSDP2 shards each parameter; `factor` 1 replicates it, FSDP's `NO_SHARD`): rank `r` holds
//! elements `r·s .. (r+1)·s` of the flattened tensor, `s = ⌈numel / factor⌉`, zero-padded.
//! The hooks then do what FSDP's do for each unit (the root — `wte`, `wpe`, `ln_f` — and
//! each block):
//!
//! - `pre_forward` / `pre_backward`: unshard (one all-gather of the unit's shards into full
//!   tensors) unless the unit is unsharded already; `pre_backward` also gives zero gradients;
//! - `post_forward`: with `reshard_after_forward` (`FULL_SHARD`), a block frees its full
//!   parameters (the root keeps them, as FSDP's root does);
//! - `post_backward`: the unit's gradients reduced to this rank's shards with the ranks'
//!   mean (one reduce-scatter; an all-reduce when replicated; under the hybrid strategies the
//!   reduce-scatter inside the node, then an all-reduce of the shards over the nodes), added
//!   to the step's gradient
//!   accumulators as `acc += alpha·g`, and the full gradients and parameters freed.

use fsdp_device::DType;
use fsdp_kernels::gpt::{
    block_product_weights, Block, GptDims, GptOps, Unit, Units, Weights, WithGrads,
};
use fsdp_kernels::KernelError;

use crate::device_comm::{bytes, CommVolume, DeviceComm};
use crate::device_config::DeviceTrainError;

#[path = "device_shard_offload.rs"]
mod offload;
use offload::{copy_in, host_unshard};

/// The root unit's tensors: the embeddings and the final layer norm's two.
const ROOT_TENSORS: usize = 4;

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
    /// In forward, the next block's all-gather in each unit's `pre_forward` (FSDP's
    /// `forward_prefetch`). Default off, as FSDP's.
    pub forward: bool,
    /// In backward, the previous block's all-gather in each unit's `pre_backward` (FSDP's
    /// `BackwardPrefetch.BACKWARD_PRE`, its default). Default on.
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

/// The lengths of `unit`'s shards over `factor` ranks, in the order of its buffers.
fn unit_shard_lens(dims: &GptDims, factor: usize, unit: Unit) -> Result<Vec<usize>, KernelError> {
    let len = |_: &str, n: usize| Ok::<_, KernelError>(shard_len(n, factor));
    Ok(match unit {
        Unit::Root => Weights::try_build_root(dims, len)?
            .root_bufs()
            .into_iter()
            .copied()
            .collect(),
        Unit::Block(_) => Block::try_build(dims.n_embd, len)?
            .bufs()
            .into_iter()
            .copied()
            .collect(),
    })
}

/// The [`Units`] of one pass of a sharded trainer (see the [module](self) documentation).
pub(crate) struct ShardedUnits<'a, O: GptOps, C: ?Sized> {
    comm: &'a C,
    /// Under the hybrid strategies, the ranks holding the same shards in the other nodes.
    replicas: Option<&'a C>,
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
    root: Option<Weights<O::Buf>>,
    root_grads: Option<Weights<O::Buf>>,
    blocks: Vec<Option<Block<O::Buf>>>,
    block_grads: Vec<Option<Block<O::Buf>>>,
    /// Under CPU offload, the shards of the block whose all-gather was prefetched, copied in
    /// and kept until the all-gather that completes it.
    copied_in: Option<(usize, Vec<O::Buf>)>,
    /// The bytes this pass's collectives moved.
    volume: CommVolume,
}

impl<'a, O: GptOps, C: DeviceComm<O> + ?Sized> ShardedUnits<'a, O, C> {
    /// The hooks of one pass over `shards` (sharded over `factor` ranks of `comm`), adding
    /// `alpha ×` the reduced gradients into the accumulators of `sink`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        comm: &'a C,
        replicas: Option<&'a C>,
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
            root: None,
            root_grads: None,
            blocks: (0..dims.n_layer).map(|_| None).collect(),
            block_grads: (0..dims.n_layer).map(|_| None).collect(),
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

    /// The dtypes `unit`'s tensors are all-gathered in (its tensors' order).
    fn dtypes(&self, unit: Unit) -> Vec<DType> {
        match unit {
            Unit::Root => vec![self.gather_dtype; ROOT_TENSORS],
            Unit::Block(_) => block_product_weights()
                .map(|w| {
                    if w && self.bf16_weights {
                        DType::BF16
                    } else {
                        self.gather_dtype
                    }
                })
                .to_vec(),
        }
    }

    /// Starts the all-gather of block `layer` (when it exists and is not unsharded; under CPU
    /// offload its shards are copied in first, and kept until it is gathered).
    fn prefetch_block(&mut self, ops: &O, layer: Option<usize>) -> Result<(), DeviceTrainError> {
        let Some(l) = layer.filter(|&l| l < self.dims.n_layer) else {
            return Ok(());
        };
        if !self.sharded() || self.blocks.get(l).is_some_and(Option::is_some) {
            return Ok(());
        }
        let dtypes = self.dtypes(Unit::Block(l));
        match &mut self.shards {
            ShardSource::Device(w) => {
                self.comm
                    .prefetch_all_gather(ops, &w.blocks[l].bufs(), &dtypes)?;
            }
            ShardSource::Host(st) if self.copied_in.is_none() => {
                let lens = unit_shard_lens(&self.dims, self.factor, Unit::Block(l))?;
                let staged = st.blocks[l].bufs_mut();
                let shards = copy_in(ops, staged, &lens)?;
                let refs: Vec<&O::Buf> = shards.iter().collect();
                if self.comm.prefetch_all_gather(ops, &refs, &dtypes)? {
                    self.copied_in = Some((l, shards));
                }
            }
            ShardSource::Host(_) => {}
        }
        Ok(())
    }

    /// The block after `unit` in forward order.
    fn next_block(unit: Unit) -> Option<usize> {
        match unit {
            Unit::Root => Some(0),
            Unit::Block(l) => Some(l + 1),
        }
    }

    /// The block after `unit` in backward order.
    fn previous_block(&self, unit: Unit) -> Option<usize> {
        match unit {
            Unit::Root => self.dims.n_layer.checked_sub(1),
            Unit::Block(l) => l.checked_sub(1),
        }
    }

    /// Gathers `unit`'s full parameters unless held (under CPU offload, copies its shards in
    /// first; replicated, copies them in as its parameters).
    fn unshard(&mut self, ops: &O, unit: Unit) -> Result<(), DeviceTrainError> {
        if self.resident().is_some() {
            return Ok(());
        }
        let (d, factor, comm) = (self.dims, self.factor, self.comm);
        let dtypes = self.dtypes(unit);
        let dtypes = dtypes.as_slice();
        let gathered = match unit {
            Unit::Root if self.root.is_none() => {
                let mut full = Weights::try_build_root(&d, |_, len| ops.empty(len))?;
                let fulls = full.root_bufs_mut();
                match &mut self.shards {
                    ShardSource::Device(w) => comm.all_gather(
                        ops,
                        &w.root_bufs(),
                        &mut fulls.into_iter().collect::<Vec<_>>(),
                        dtypes,
                    )?,
                    ShardSource::Host(st) => host_unshard(
                        (comm, ops, factor, &d, dtypes),
                        st,
                        &mut self.copied_in,
                        unit,
                        fulls.into_iter().collect(),
                    )?,
                }
                self.root = Some(full);
                true
            }
            Unit::Block(l) if self.blocks.get(l).is_some_and(Option::is_none) => {
                let mut full = Block::try_build(d.n_embd, |_, len| ops.empty(len))?;
                match &mut self.shards {
                    ShardSource::Device(w) => {
                        comm.all_gather(ops, &w.blocks[l].bufs(), &mut full.bufs_mut(), dtypes)?
                    }
                    ShardSource::Host(st) => host_unshard(
                        (comm, ops, factor, &d, dtypes),
                        st,
                        &mut self.copied_in,
                        unit,
                        full.bufs_mut(),
                    )?,
                }
                self.blocks[l] = Some(full);
                true
            }
            _ => false,
        };
        if gathered {
            for (&s, &dtype) in unit_shard_lens(&d, factor, unit)?.iter().zip(dtypes) {
                self.volume.all_gathered += bytes(s * factor, dtype);
            }
        }
        Ok(())
    }

    /// Reduces the full gradients `full` of `unit` in the reduction's dtype, adds `alpha ×`
    /// this rank's part of them to the unit's accumulators in the sink, and counts the bytes
    /// moved.
    fn reduce(
        &mut self,
        ops: &O,
        unit: Unit,
        mut full: Vec<&mut O::Buf>,
    ) -> Result<(), DeviceTrainError> {
        let (comm, replicas, factor) = (self.comm, self.replicas, self.factor);
        let (alpha, dtype) = (self.alpha, self.reduce_dtype);
        let sink = &mut self.sink;
        let mut volume = CommVolume::default();
        if factor > 1 {
            let lens = unit_shard_lens(&self.dims, factor, unit)?;
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
            sink.add(ops, alpha, unit, reduced.iter().collect())?;
        } else {
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
            sink.add(ops, alpha, unit, full.iter().map(|g| &**g).collect())?;
        }
        self.volume += volume;
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

/// `unit`'s tensors of `w`, mutably.
fn unit_mut<B>(w: &mut Weights<B>, unit: Unit) -> Result<Vec<&mut B>, DeviceTrainError> {
    match unit {
        Unit::Root => Ok(w.root_bufs_mut().into_iter().collect()),
        Unit::Block(l) => {
            let n = w.blocks.len();
            w.blocks
                .get_mut(l)
                .map(Block::bufs_mut)
                .ok_or_else(|| not_held(&format!("block {l} of {n}")))
        }
    }
}

impl<O: GptOps> GradSink<'_, O> {
    /// Adds `alpha × grads` (on the device, in `unit`'s order) to `unit`'s accumulators, or
    /// starts copying them out into `unit`'s staging memory (`alpha` is applied on the host).
    fn add(
        &mut self,
        ops: &O,
        alpha: f32,
        unit: Unit,
        grads: Vec<&O::Buf>,
    ) -> Result<(), DeviceTrainError> {
        match self {
            GradSink::Device(w) => {
                for (a, g) in unit_mut(w, unit)?.into_iter().zip(grads) {
                    ops.axpby(alpha, g, 1.0, a)?;
                }
            }
            GradSink::Staged(staging) => {
                for (s, g) in unit_mut(staging, unit)?.into_iter().zip(grads) {
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

    fn pre_forward(&mut self, ops: &O, unit: Unit) -> Result<(), DeviceTrainError> {
        self.unshard(ops, unit)?;
        if self.prefetch.forward {
            self.prefetch_block(ops, Self::next_block(unit))?;
        }
        Ok(())
    }

    fn post_forward(&mut self, _: &O, unit: Unit) -> Result<(), DeviceTrainError> {
        if let Unit::Block(l) = unit {
            if self.reshard_after_forward {
                if let Some(b) = self.blocks.get_mut(l) {
                    *b = None;
                }
            }
        }
        Ok(())
    }

    fn pre_backward(&mut self, ops: &O, unit: Unit) -> Result<(), DeviceTrainError> {
        self.unshard(ops, unit)?;
        let d = self.dims;
        match unit {
            Unit::Root => {
                self.root_grads = Some(Weights::try_build_root(&d, |_, len| ops.zeros(len))?);
            }
            Unit::Block(l) => {
                let g = Block::try_build(d.n_embd, |_, len| ops.zeros(len))?;
                match self.block_grads.get_mut(l) {
                    Some(slot) => *slot = Some(g),
                    None => return Err(not_held(&format!("block {l}"))),
                }
            }
        }
        if self.prefetch.backward {
            self.prefetch_block(ops, self.previous_block(unit))?;
        }
        Ok(())
    }

    fn post_backward(&mut self, ops: &O, unit: Unit) -> Result<(), DeviceTrainError> {
        match unit {
            Unit::Root => {
                let mut g = self.root_grads.take().ok_or_else(|| not_held("the root"))?;
                self.reduce(ops, unit, g.root_bufs_mut().into_iter().collect())?;
                self.root = None;
            }
            Unit::Block(l) => {
                let what = || not_held(&format!("block {l}"));
                let mut g = self
                    .block_grads
                    .get_mut(l)
                    .and_then(Option::take)
                    .ok_or_else(what)?;
                self.reduce(ops, unit, g.bufs_mut())?;
                self.blocks[l] = None;
            }
        }
        Ok(())
    }

    fn root(&self) -> Result<&Weights<O::Buf>, DeviceTrainError> {
        match &self.root {
            Some(r) => Ok(r),
            None => self.resident().ok_or_else(|| not_held("the root")),
        }
    }

    fn block(&self, layer: usize) -> Result<&Block<O::Buf>, DeviceTrainError> {
        let what = || not_held(&format!("block {layer}"));
        match self.blocks.get(layer) {
            Some(Some(b)) => Ok(b),
            Some(None) => self
                .resident()
                .and_then(|w| w.blocks.get(layer))
                .ok_or_else(what),
            None => Err(what()),
        }
    }

    fn root_grads(&mut self) -> Result<WithGrads<'_, Weights<O::Buf>>, DeviceTrainError> {
        let resident = resident(&self.shards, self.factor);
        let params = match &self.root {
            Some(r) => r,
            None => resident.ok_or_else(|| not_held("the root"))?,
        };
        let grads = self
            .root_grads
            .as_mut()
            .ok_or_else(|| not_held("the root's gradients"))?;
        Ok((params, grads))
    }

    fn block_grads(
        &mut self,
        layer: usize,
    ) -> Result<WithGrads<'_, Block<O::Buf>>, DeviceTrainError> {
        let what = || not_held(&format!("block {layer}"));
        let resident = resident(&self.shards, self.factor);
        let params = match self.blocks.get(layer) {
            Some(Some(b)) => b,
            Some(None) => resident
                .and_then(|w| w.blocks.get(layer))
                .ok_or_else(what)?,
            None => return Err(what()),
        };
        let grads = self
            .block_grads
            .get_mut(layer)
            .and_then(Option::as_mut)
            .ok_or_else(what)?;
        Ok((params, grads))
    }
}
