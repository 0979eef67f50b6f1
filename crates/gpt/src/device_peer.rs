//! [`PeerComm`]: the collectives of sharded training for ranks that are threads over one
//! device ([`PeerOps`]: `CudaOps` on one GPU, each rank on its own stream, or the host twins),
//! each rank reading its peers' buffers directly.
//!
//! A collective is two exchanges of small host records between the threads (a board with a
//! condition variable; every wait bounded by the group's timeout) around work enqueued on each
//! rank's stream, so that the host never waits for the device:
//!
//! 1. each rank records an event after the writes of its inputs and posts the inputs'
//!    addresses, the event and a description of the call; once every rank has posted, each
//!    checks that the descriptions agree (else every rank fails with
//!    [`CollectiveError::Mismatch`], naming each rank's call);
//! 2. each rank's stream waits for every peer's event, then copies (all-gather) or reduces
//!    (reduce-scatter, all-reduce: the peers' values folded in rank order with the
//!    collectives' arithmetic, an average divided at the last step) what it needs from the
//!    peers' memory into its own outputs;
//! 3. each rank records an event after those reads and posts it; its stream waits for every
//!    peer's, so that nothing it enqueues later — a write of an input, or its free — runs
//!    before the peers have read it.
//!
//! A reduction in bf16 (FSDP's `reduce_dtype`) posts each rank's inputs rounded to bf16 into
//! buffers of its own ([`PeerOps::Half`]), which the peers fold in bf16 and widen into their
//! outputs; the rounded copies live until step 3, as the inputs do.
//!
//! A rank whose communicator is dropped (its thread failed) makes the others fail with
//! [`CollectiveError::PeerDeparted`] at their next exchange, and a rank that does not arrive
//! makes them fail with [`CollectiveError::Timeout`].

use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use fsdp_collectives::{CollectiveError, ReduceOp};
use fsdp_device::DType;
use fsdp_kernels::gpt::{PeerCopy, PeerOps, PeerPtr};
use fsdp_kernels::host::ReduceKind;

use crate::device_comm::{gathers_in_bf16, reduces_in_half, DeviceComm, Packing};
use crate::device_config::DeviceTrainError;

/// What a rank posts in one exchange.
struct Post<E> {
    /// The call, as every rank must make it.
    desc: String,
    /// Its inputs' memory.
    ptrs: Vec<PeerPtr>,
    /// Recorded on its stream after the inputs' writes (or after its reads).
    event: E,
}

/// The exchanges' board.
struct Board<E> {
    /// Exchanges completed.
    round: u64,
    posted: Vec<Option<Post<E>>>,
    /// The last completed exchange's posts, by rank.
    results: Arc<Vec<Post<E>>>,
    /// Ranks whose communicator was dropped.
    left: Vec<bool>,
}

struct Group<E> {
    board: Mutex<Board<E>>,
    changed: Condvar,
}

/// One rank's collectives over the threads of its group (see the [module](self)
/// documentation).
pub struct PeerComm<O: PeerOps> {
    rank: usize,
    world: usize,
    timeout: Duration,
    group: Arc<Group<O::Event>>,
    /// Collectives issued (for errors).
    seq: Cell<u64>,
    /// The scalars' all-reduce's result, kept from one call to the next (no allocation, and
    /// on a GPU no upload, a step).
    scratch: RefCell<Option<O::Scalars>>,
}

impl<O: PeerOps> PeerComm<O> {
    /// A group of `world` ranks, every wait bounded by `timeout`: one communicator per rank,
    /// to move into its thread.
    pub fn group(world: usize, timeout: Duration) -> Vec<PeerComm<O>> {
        let group = Arc::new(Group {
            board: Mutex::new(Board {
                round: 0,
                posted: (0..world).map(|_| None).collect(),
                results: Arc::new(Vec::new()),
                left: vec![false; world],
            }),
            changed: Condvar::new(),
        });
        (0..world)
            .map(|rank| PeerComm {
                rank,
                world,
                timeout,
                group: group.clone(),
                seq: Cell::new(0),
                scratch: RefCell::new(None),
            })
            .collect()
    }

    /// The 2-D mesh of the hybrid strategies over `world` ranks in nodes of `ranks_per_node`:
    /// for each rank (in order), its node's group (its shard group: rank `r % ranks_per_node`
    /// of it) and the group of the ranks at its position in every node (its replicas: rank
    /// `r / ranks_per_node` of it). `None` when `ranks_per_node` is 0 or does not divide
    /// `world`.
    pub fn mesh(
        world: usize,
        ranks_per_node: usize,
        timeout: Duration,
    ) -> Option<Vec<(PeerComm<O>, PeerComm<O>)>> {
        if ranks_per_node == 0 || world % ranks_per_node != 0 {
            return None;
        }
        let nodes = world / ranks_per_node;
        let mut shard: Vec<Vec<Option<PeerComm<O>>>> = (0..nodes)
            .map(|_| {
                Self::group(ranks_per_node, timeout)
                    .into_iter()
                    .map(Some)
                    .collect()
            })
            .collect();
        let mut replica: Vec<Vec<Option<PeerComm<O>>>> = (0..ranks_per_node)
            .map(|_| Self::group(nodes, timeout).into_iter().map(Some).collect())
            .collect();
        (0..world)
            .map(|r| {
                let (node, pos) = (r / ranks_per_node, r % ranks_per_node);
                Some((shard[node][pos].take()?, replica[pos][node].take()?))
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, Board<O::Event>> {
        self.group
            .board
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Posts `post` and waits for every rank's; checks that their descriptions agree.
    fn exchange(
        &self,
        op: &'static str,
        post: Post<O::Event>,
    ) -> Result<Arc<Vec<Post<O::Event>>>, CollectiveError> {
        let (rank, seq) = (self.rank, self.seq.get());
        let departed = |b: &Board<O::Event>| {
            b.left
                .iter()
                .position(|&l| l)
                .map(|peer| CollectiveError::PeerDeparted {
                    rank,
                    peer,
                    op,
                    seq,
                })
        };
        let mut b = self.lock();
        if let Some(e) = departed(&b) {
            return Err(e);
        }
        let round = b.round;
        b.posted[rank] = Some(post);
        let posts = if b.posted.iter().all(Option::is_some) {
            let all: Vec<_> = b.posted.iter_mut().filter_map(Option::take).collect();
            b.results = Arc::new(all);
            b.round += 1;
            self.group.changed.notify_all();
            b.results.clone()
        } else {
            let start = Instant::now();
            loop {
                if b.round != round {
                    break b.results.clone();
                }
                if let Some(e) = departed(&b) {
                    return Err(e);
                }
                let waited = start.elapsed();
                if waited >= self.timeout {
                    let missing: Vec<usize> =
                        (0..self.world).filter(|&r| b.posted[r].is_none()).collect();
                    return Err(CollectiveError::Timeout {
                        rank,
                        op,
                        seq,
                        waited,
                        waiting_for: format!("ranks {missing:?} did not reach this collective"),
                    });
                }
                b = self
                    .group
                    .changed
                    .wait_timeout(b, self.timeout - waited)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        };
        drop(b);
        let mine = &posts[rank].desc;
        if posts.iter().any(|p| &p.desc != mine) {
            let details = posts
                .iter()
                .enumerate()
                .map(|(r, p)| format!("rank {r}: {}", p.desc))
                .collect::<Vec<_>>()
                .join("; ");
            return Err(CollectiveError::Mismatch { rank, seq, details });
        }
        Ok(posts)
    }

    /// Step 1: posts the inputs `ptrs` after their writes; waits on the stream for every
    /// peer's.
    fn begin(
        &self,
        ops: &O,
        op: &'static str,
        desc: String,
        ptrs: Vec<PeerPtr>,
    ) -> Result<Arc<Vec<Post<O::Event>>>, DeviceTrainError> {
        let event = ops.record_event()?;
        let posts = self.exchange(op, Post { desc, ptrs, event })?;
        for p in posts.iter() {
            ops.wait_event(&p.event)?;
        }
        Ok(posts)
    }

    /// Step 3: posts the end of this rank's reads; waits on the stream for every peer's.
    fn finish(&self, ops: &O, op: &'static str, desc: String) -> Result<(), DeviceTrainError> {
        let event = ops.record_event()?;
        let posts = self.exchange(
            op,
            Post {
                desc,
                ptrs: Vec::new(),
                event,
            },
        )?;
        for p in posts.iter() {
            ops.wait_event(&p.event)?;
        }
        self.seq.set(self.seq.get() + 1);
        Ok(())
    }
}

impl<O: PeerOps> Drop for PeerComm<O> {
    fn drop(&mut self) {
        let mut b = self.lock();
        b.left[self.rank] = true;
        self.group.changed.notify_all();
    }
}

/// Each of `bufs` rounded to `half` (bf16 or f16) into a half of its own (enqueued on the
/// operations' stream).
fn halves_of<O: PeerOps>(
    ops: &O,
    bufs: &[&O::Buf],
    half: DType,
) -> Result<Vec<O::Half>, DeviceTrainError> {
    bufs.iter()
        .map(|b| {
            let len = O::buf_len(b);
            let h = ops.half(len)?;
            // SAFETY: `h` is new, this rank's, and written here first on its stream; the
            // peers read it only after `begin`'s exchange, which follows this cast.
            unsafe { ops.cast_to_half_ptr(half, b, 0, ops.half_ptr(&h), 0, len)? };
            Ok(h)
        })
        .collect()
}

/// `dst[..m]` = the mean in `half` (bf16 or f16) of the ranks' halves of tensor `i`
/// (`posts`) from element `start`, widened; the rest of `dst` (a shard's padding) zero.
fn reduce_half_into<O: PeerOps>(
    ops: &O,
    half: DType,
    posts: &[Post<O::Event>],
    i: usize,
    start: usize,
    m: usize,
    dst: &mut O::Buf,
) -> Result<(), DeviceTrainError> {
    if m < O::buf_len(dst) {
        ops.fill_zero(dst)?;
    }
    if m == 0 {
        return Ok(());
    }
    let srcs: Vec<(PeerPtr, usize)> = posts.iter().map(|p| (p.ptrs[i], start)).collect();
    let mut out = ops.half(m)?;
    // SAFETY: the peers' halves, live and unwritten until every rank's `finish` (they are
    // dropped after it); this stream waited for their casts in `begin`; `out` is new.
    unsafe { ops.reduce_half_from_peers(half, ReduceKind::Avg, &srcs, &mut out, 0, m)? };
    // SAFETY: `out` is this rank's, written above on this stream.
    unsafe { ops.widen_half_ptr(half, ops.half_ptr(&out), 0, dst, 0, m)? };
    Ok(())
}

fn kind(op: ReduceOp) -> Result<ReduceKind, DeviceTrainError> {
    Ok(match op {
        ReduceOp::Sum => ReduceKind::Sum,
        ReduceOp::Avg => ReduceKind::Avg,
        ReduceOp::Min => ReduceKind::Min,
        ReduceOp::Max => ReduceKind::Max,
        ReduceOp::Product => ReduceKind::Product,
        other => {
            return Err(DeviceTrainError::Fsdp(fsdp::FsdpError::InvalidShape {
                reason: format!("scalars: reduction {other:?} is not offered"),
            }))
        }
    })
}

impl<O: PeerOps> DeviceComm<O> for PeerComm<O> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_gather(
        &self,
        ops: &O,
        shards: &[&O::Buf],
        fulls: &mut [&mut O::Buf],
        dtypes: &[DType],
    ) -> Result<(), DeviceTrainError> {
        let bf16 = gathers_in_bf16(dtypes, shards.len())?;
        let p = Packing::all_gather::<O>(shards, fulls, self.world)?;
        let (lens, full_lens) = (&p.lens, &p.full_lens);
        let desc = format!("all-gather ({dtypes:?}) of shards {lens:?} into {full_lens:?}");
        // A tensor gathered in bf16 is posted as this rank's bf16 rounding of its shard, which
        // lives until `finish`.
        let mut halves = Vec::new();
        let mut ptrs = Vec::with_capacity(shards.len());
        for (&s, &half) in shards.iter().zip(&bf16) {
            if half {
                halves.extend(halves_of(ops, &[s], DType::BF16)?);
                ptrs.extend(halves.last().map(|h| ops.half_ptr(h)));
            } else {
                ptrs.push(ops.peer_ptr(s));
            }
        }
        let posts = self.begin(ops, "all-gather", desc.clone(), ptrs)?;
        // Every rank's piece of every tensor, enqueued together (one kernel on a GPU).
        let copies: Vec<PeerCopy> = (0..fulls.len())
            .flat_map(|i| {
                let posts = &posts;
                let widen = bf16[i];
                p.gathered(i, self.world).map(move |c| PeerCopy {
                    src: posts[c.rank].ptrs[i],
                    src_offset: 0,
                    dst: i,
                    dst_offset: c.start,
                    len: c.len,
                    widen,
                })
            })
            .collect();
        // SAFETY: each peer's shard (or its bf16 rounding), live until the peers' reads finish
        // (step 3 orders its writes and frees after them); this stream waited for its writes
        // in `begin`; the pieces of a tensor are disjoint.
        unsafe { ops.copy_from_peers(&copies, fulls)? };
        self.finish(ops, "all-gather", desc)
    }

    fn reduce_scatter_avg(
        &self,
        ops: &O,
        fulls: &[&O::Buf],
        shards: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError> {
        let half = reduces_in_half("reduce-scatter", dtype)?;
        let p = Packing::reduce_scatter::<O>(fulls, shards, self.world)?;
        let (lens, full_lens) = (&p.lens, &p.full_lens);
        let desc = format!("reduce-scatter (avg, {dtype}) of {full_lens:?} into shards {lens:?}");
        if let Some(half) = half {
            let halves = halves_of(ops, fulls, half)?;
            let ptrs = halves.iter().map(|h| ops.half_ptr(h)).collect();
            let posts = self.begin(ops, "reduce-scatter", desc.clone(), ptrs)?;
            for (i, shard) in shards.iter_mut().enumerate() {
                let start = self.rank * lens[i];
                let m = lens[i].min(full_lens[i].saturating_sub(start));
                reduce_half_into(ops, half, &posts, i, start, m, shard)?;
            }
            // The peers' reads of `halves` end here.
            return self.finish(ops, "reduce-scatter", desc);
        }
        let ptrs = fulls.iter().map(|f| ops.peer_ptr(f)).collect();
        let posts = self.begin(ops, "reduce-scatter", desc.clone(), ptrs)?;
        for (i, shard) in shards.iter_mut().enumerate() {
            let (s, f) = (lens[i], full_lens[i]);
            let start = self.rank * s;
            let m = if start < f { s.min(f - start) } else { 0 };
            if m < s {
                // The padding past the tensor's end.
                ops.fill_zero(shard)?;
            }
            if m > 0 {
                let srcs: Vec<(PeerPtr, usize)> =
                    posts.iter().map(|p| (p.ptrs[i], start)).collect();
                // SAFETY: as in `all_gather`; the sources are the peers' full gradients,
                // distinct from this rank's shard.
                unsafe { ops.reduce_from_peers(ReduceKind::Avg, &srcs, shard, 0, m)? };
            }
        }
        self.finish(ops, "reduce-scatter", desc)
    }

    fn all_reduce_avg(
        &self,
        ops: &O,
        bufs: &mut [&mut O::Buf],
        dtype: DType,
    ) -> Result<(), DeviceTrainError> {
        let half = reduces_in_half("all-reduce", dtype)?;
        let lens: Vec<usize> = bufs.iter().map(|b| O::buf_len(b)).collect();
        let desc = format!("all-reduce (avg, {dtype}) of {lens:?}");
        if let Some(half) = half {
            // The peers read the 16-bit roundings, so the means go straight into `bufs`.
            let inputs: Vec<&O::Buf> = bufs.iter().map(|b| &**b).collect();
            let halves = halves_of(ops, &inputs, half)?;
            let ptrs = halves.iter().map(|h| ops.half_ptr(h)).collect();
            let posts = self.begin(ops, "all-reduce", desc.clone(), ptrs)?;
            for (i, b) in bufs.iter_mut().enumerate() {
                reduce_half_into(ops, half, &posts, i, 0, lens[i], b)?;
            }
            return self.finish(ops, "all-reduce", desc);
        }
        let ptrs = bufs.iter().map(|b| ops.peer_ptr(b)).collect();
        let posts = self.begin(ops, "all-reduce", desc.clone(), ptrs)?;
        let mut outs = Vec::with_capacity(bufs.len());
        for (i, &len) in lens.iter().enumerate() {
            let mut out = ops.empty(len)?;
            if len > 0 {
                let srcs: Vec<(PeerPtr, usize)> = posts.iter().map(|p| (p.ptrs[i], 0)).collect();
                // SAFETY: as in `all_gather`; `out` is new, distinct from every source.
                unsafe { ops.reduce_from_peers(ReduceKind::Avg, &srcs, &mut out, 0, len)? };
            }
            outs.push(out);
        }
        self.finish(ops, "all-reduce", desc)?;
        // The peers have read the inputs: the means take their place.
        for (b, out) in bufs.iter_mut().zip(&mut outs) {
            std::mem::swap(*b, out);
        }
        Ok(())
    }

    fn all_reduce_scalars(
        &self,
        ops: &O,
        scalars: &mut O::Scalars,
        slots: Range<usize>,
        op: ReduceOp,
    ) -> Result<(), DeviceTrainError> {
        let kind = kind(op)?;
        let ptr = ops.scalars_ptr(scalars);
        if slots.start > slots.end || slots.end > ptr.len {
            return Err(DeviceTrainError::Fsdp(fsdp::FsdpError::InvalidShape {
                reason: format!("scalars: slots {slots:?} of {}", ptr.len),
            }));
        }
        let len = slots.len();
        let desc = format!("all-reduce ({op:?}) of scalars {slots:?}");
        let posts = self.begin(ops, "all-reduce", desc.clone(), vec![ptr])?;
        let kept = self.scratch.borrow_mut().take();
        let mut reduced = match kept {
            Some(k) if ops.scalars_ptr(&k).len == ptr.len => k,
            _ => ops.scalars(&vec![0.0; ptr.len])?,
        };
        let srcs: Vec<(PeerPtr, usize)> = posts.iter().map(|p| (p.ptrs[0], slots.start)).collect();
        // SAFETY: as in `all_gather`; `reduced` is this rank's own (written on its stream
        // only), distinct from every source.
        unsafe { ops.reduce_scalars_from_peers(kind, &srcs, &mut reduced, slots.start, len)? };
        self.finish(ops, "all-reduce", desc)?;
        let from = [(ops.scalars_ptr(&reduced), slots.start)];
        // SAFETY: `reduced` is this rank's, written above on this stream, distinct from
        // `scalars`; one source is a copy.
        unsafe {
            ops.reduce_scalars_from_peers(ReduceKind::Sum, &from, scalars, slots.start, len)?
        };
        *self.scratch.borrow_mut() = Some(reduced);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_kernels::gpt::{GptOps, HostOps};

    /// Two ranks as threads gather and reduce-scatter a unit of two tensors (one shorter than
    /// the world's shards) by reading each other's buffers, in f32 and in bf16.
    /// (Under Miri: every read by address is of a live buffer its owner does not write
    /// meanwhile.)
    #[test]
    fn two_threads_gather_and_reduce_scatter_a_unit() {
        let comms = PeerComm::<HostOps>::group(2, Duration::from_secs(30));
        std::thread::scope(|s| {
            for comm in comms {
                s.spawn(move || {
                    let ops = HostOps::new();
                    let r = comm.rank as f32;
                    let shards = [
                        ops.upload(&[r, r + 0.5]).unwrap(),
                        ops.upload(&[r]).unwrap(),
                    ];
                    let mut fulls = [ops.zeros(4).unwrap(), ops.zeros(1).unwrap()];
                    let mut outs: Vec<_> = fulls.iter_mut().collect();
                    comm.all_gather(&ops, &[&shards[0], &shards[1]], &mut outs, &[DType::F32; 2])
                        .unwrap();
                    assert_eq!(fulls[0].to_vec(), [0.0, 0.5, 1.0, 1.5]);
                    assert_eq!(fulls[1].to_vec(), [0.0]);
                    let own = [
                        ops.upload(&[r; 4]).unwrap(),
                        ops.upload(&[2.0 * r]).unwrap(),
                    ];
                    let mut red = [ops.zeros(2).unwrap(), ops.zeros(1).unwrap()];
                    let mut outs: Vec<_> = red.iter_mut().collect();
                    comm.reduce_scatter_avg(&ops, &[&own[0], &own[1]], &mut outs, DType::F32)
                        .unwrap();
                    assert_eq!(red[0].to_vec(), [0.5, 0.5]);
                    // Rank 1's chunk of the one-element tensor is padding.
                    let want = if comm.rank == 0 { 1.0 } else { 0.0 };
                    assert_eq!(red[1].to_vec(), [want]);
                    // The same in bf16, through each rank's rounded copies: 1 + 2⁻⁸ rounds
                    // to 1 (and 2 + 2⁻⁸ to 2), so the mean is 1.5 (in f32: 1.5039062).
                    let own = [
                        ops.upload(&[1.0 + r + 1.0 / 256.0; 4]).unwrap(),
                        ops.upload(&[2.0 * r]).unwrap(),
                    ];
                    let mut outs: Vec<_> = red.iter_mut().collect();
                    comm.reduce_scatter_avg(&ops, &[&own[0], &own[1]], &mut outs, DType::BF16)
                        .unwrap();
                    assert_eq!(red[0].to_vec(), [1.5, 1.5]);
                    assert_eq!(red[1].to_vec(), [want]);
                    // An all-gather in bf16, through each rank's rounded copies of its shards:
                    // 1 + 2⁻⁹ rounds to 1.
                    let shards = [
                        ops.upload(&[r + 1.0 / 512.0, r + 0.5]).unwrap(),
                        ops.upload(&[r]).unwrap(),
                    ];
                    let mut outs: Vec<_> = fulls.iter_mut().collect();
                    comm.all_gather(
                        &ops,
                        &[&shards[0], &shards[1]],
                        &mut outs,
                        &[DType::BF16; 2],
                    )
                    .unwrap();
                    assert_eq!(fulls[0].to_vec(), [1.0 / 512.0, 0.5, 1.0, 1.5]);
                    assert_eq!(fulls[1].to_vec(), [0.0]);
                });
            }
        });
    }
}
