//! The collectives of the engine: each describes its call, checks its arguments and issues a
//! body that runs one of the [`algo`](super::algo) schedules over the transport.

use fsdp_device::{with_element, AccessGuard, Buffer, HostStorage, Storage};

use super::algo::{self, Chunks};
use super::{copy, Body, DataError, Engine};
use crate::flavors::check::Access;
use crate::flavors::desc::{OpDesc, Sizes};
use crate::{CollectiveError, ReduceOp, Result, Work};

/// The outcome of a split's exchange: the sub-group this rank joins.
pub(crate) struct SplitPlan {
    /// The collective's sequence number in the parent group (unique per split).
    pub seq: u64,
    pub color: u32,
    pub new_rank: usize,
    pub new_world: usize,
}

impl Engine {
    pub fn all_gather_base(&self, input: &Buffer, output: &Buffer) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let n = input.len();
        let mut desc = OpDesc::new("all_gather_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        let check = self.placement().all_gather_base(rank, world, input, output);
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let seg = self.core.seg_elems(input.dtype());
        let dtype = input.dtype();
        let body: Body = Box::new(move |t, guards, ctx, _| {
            let out = ptr(&guards[guards.len() - 1]);
            let chunks = Chunks::equal(world, n, seg);
            let own = if in_place {
                out.wrapping_add(chunks.start(rank) * dtype.size_in_bytes())
            } else {
                ptr(&guards[0])
            };
            // SAFETY: guards give this rank exclusive use of the output and shared use of the
            // input for the whole call; sizes were checked at issue time.
            with_element!(dtype, T => unsafe { algo::all_gather::<T>(t, ctx, own, out, &chunks) })
        });
        self.issue(desc, check, body)
    }

    pub fn reduce_scatter_base(
        &self,
        input: &Buffer,
        output: &Buffer,
        op: ReduceOp,
    ) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let n = output.len();
        let mut desc = OpDesc::new("reduce_scatter_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let check = self
            .placement()
            .reduce_scatter_base(rank, world, input, output);
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let seg = self.core.seg_elems(input.dtype());
        let dtype = input.dtype();
        let body: Body = Box::new(move |t, guards, ctx, _| {
            let inp = ptr(&guards[0]);
            let chunks = Chunks::equal(world, n, seg);
            let out = if in_place {
                inp.wrapping_add(chunks.start(rank) * dtype.size_in_bytes())
            } else {
                ptr(&guards[1])
            };
            // SAFETY: guards cover input (shared, or exclusive in place) and output (exclusive).
            with_element!(dtype, T => unsafe {
                algo::reduce_scatter::<T>(t, ctx, op, inp, out, &chunks)
            })
        });
        self.issue(desc, check, body)
    }

    pub fn all_reduce(&self, buf: &Buffer, op: ReduceOp) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let total = buf.len();
        let mut desc = OpDesc::new("all_reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.reduce = Some(op);
        let check = self.placement().all_reduce(buf);
        let seg = self.core.seg_elems(buf.dtype());
        let dtype = buf.dtype();
        let body: Body = Box::new(move |t, guards, ctx, _| {
            let p = ptr(&guards[0]);
            let chunks = Chunks::balanced(world, total, seg);
            let own = p.wrapping_add(chunks.start(rank) * dtype.size_in_bytes());
            // SAFETY: exclusive guard over the whole buffer; reduce-scatter in place, then
            // all-gather in place (each phase drains before the next).
            with_element!(dtype, T => unsafe {
                algo::reduce_scatter::<T>(t, ctx, op, p, own, &chunks)?;
                algo::all_gather::<T>(t, ctx, own, p, &chunks)
            })
        });
        self.issue(desc, check, body)
    }

    pub fn broadcast(&self, buf: &Buffer, root: usize) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let total = buf.len();
        let mut desc = OpDesc::new("broadcast");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.root = Some(root);
        let check = self.placement().broadcast(rank, world, buf, root);
        let seg = self.core.seg_elems(buf.dtype());
        let dtype = buf.dtype();
        let body: Body = Box::new(move |t, guards, ctx, _| {
            let p = ptr(&guards[0]);
            // SAFETY: the root only reads its buffer (shared guard); others own theirs.
            with_element!(dtype, T => unsafe { algo::broadcast::<T>(t, ctx, p, total, root, seg) })
        });
        self.issue(desc, check, body)
    }

    pub fn reduce(&self, buf: &Buffer, op: ReduceOp, root: usize) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let total = buf.len();
        let mut desc = OpDesc::new("reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.reduce = Some(op);
        desc.root = Some(root);
        let check = self.placement().reduce(rank, world, buf, root);
        let seg = self.core.seg_elems(buf.dtype());
        let dtype = buf.dtype();
        let body: Body = Box::new(move |t, guards, ctx, _| {
            let p = ptr(&guards[0]);
            // SAFETY: non-root ranks only read their buffer; the root owns its exclusively.
            with_element!(dtype, T => unsafe { algo::reduce::<T>(t, ctx, op, p, total, root, seg) })
        });
        self.issue(desc, check, body)
    }

    pub fn barrier(&self) -> Result<Work> {
        // The description exchange alone is the barrier: it completes once every rank posted.
        let body: Body = Box::new(|_, _, _, _| Ok(()));
        self.issue(OpDesc::new("barrier"), Ok(Access::none()), body)
    }

    pub fn all_gather(&self, input: &Buffer, outputs: &[Buffer]) -> Result<Work> {
        let (world, rank) = (self.core.world, self.core.rank);
        let sizes: Vec<usize> = outputs.iter().map(Buffer::len).collect();
        let mut desc = OpDesc::new("all_gather");
        desc.dtype = Some(input.dtype());
        desc.count = input.len();
        desc.sizes = Some(Sizes::List(sizes.clone()));
        let check = self.placement().all_gather(rank, world, input, outputs);
        let dtype = input.dtype();
        let esz = dtype.size_in_bytes();
        let max = sizes.iter().copied().max().unwrap_or(0);
        let seg = self.core.seg_elems(dtype);
        let body: Body = Box::new(move |t, guards, ctx, _| {
            // Pad every input to the largest, all-gather base into one flat buffer, copy out.
            let tmp =
                HostStorage::zeroed(max * esz * (world + 1)).map_err(|e| DataError::Protocol {
                    reason: e.to_string(),
                })?;
            let padded_in = tmp.as_ptr();
            let flat = padded_in.wrapping_add(max * esz);
            // SAFETY: `tmp` is private to this task and sized for the padded input plus the flat
            // output; guards[0] is this rank's input of sizes[rank] elements.
            unsafe { copy(ptr(&guards[0]), padded_in, sizes[rank] * esz) };
            let chunks = Chunks::equal(world, max, seg);
            // SAFETY: as for all_gather_base, with private input and output.
            with_element!(dtype, T => unsafe {
                algo::all_gather::<T>(t, ctx, padded_in, flat, &chunks)
            })?;
            for (i, g) in guards[1..].iter().enumerate() {
                // SAFETY: exclusive guard over outputs[i] (sizes[i] elements); block i of the
                // flat buffer holds at least that many.
                unsafe { copy(flat.wrapping_add(i * max * esz), ptr(g), sizes[i] * esz) };
            }
            Ok(())
        });
        self.issue(desc, check, body)
    }

    /// The collective half of `split`: every rank posts `(color, key)`; returns the sub-group
    /// this rank joins (`None` for no color). The backend then builds it.
    pub fn split_plan(&self, color: Option<u32>, key: usize) -> Result<Option<SplitPlan>> {
        let rank = self.core.rank;
        let mut desc = OpDesc::new("split");
        desc.split = Some((color, key));
        let (tx, rx) = crossbeam_channel::bounded::<(u64, Vec<OpDesc>)>(1);
        let body: Body = Box::new(move |_, _, ctx, descs| {
            let _ = tx.send((ctx.seq, descs.to_vec()));
            Ok(())
        });
        let work = self.issue(desc, Ok(Access::none()), body)?;
        work.wait()?;
        let (seq, descs) = rx.try_recv().map_err(|_| CollectiveError::Aborted {
            rank,
            reason: "split ended without a result".into(),
        })?;
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<(usize, usize)> = descs
            .iter()
            .enumerate()
            .filter_map(|(r, d)| match d.split {
                Some((Some(c), key)) if c == color => Some((key, r)),
                _ => None,
            })
            .collect();
        members.sort();
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == rank)
            .ok_or_else(|| CollectiveError::Aborted {
                rank,
                reason: "split: this rank is missing from its own color".into(),
            })?;
        Ok(Some(SplitPlan {
            seq,
            color,
            new_rank,
            new_world: members.len(),
        }))
    }
}

/// Pointer to a guard's first element.
fn ptr(g: &AccessGuard) -> *mut u8 {
    g.as_ptr()
}
