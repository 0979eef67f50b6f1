//! The collectives of the CUDA ring: each describes and checks its call like the host ring, then
//! issues a body that enqueues the shared [`schedule`] with the device addresses of its buffers.

use std::time::Instant;

use fsdp_device::{AccessGuard, Buffer, Device, Stream};

use super::rank::{Layout, Rank};
use super::transport::{lock, SharedRank};
use super::CudaRingCommunicator;
use crate::flavors::check::Access;
use crate::flavors::desc::OpDesc;
use crate::flavors::engine::algo::Chunks;
use crate::flavors::engine::schedule::{self, Step};
use crate::flavors::engine::{Body, DataError};
use crate::{CollectiveError, Communicator, ReduceOp, Result, Work};

/// Device address of a guard's first element.
fn ptr(g: &AccessGuard) -> u64 {
    g.as_ptr() as u64
}

/// Enqueue the phases of a collective with `enqueue`, then wait (bounded by the collective's
/// deadline) until the end event completed, so that the buffers are released only after the
/// GPU is done with them.
fn execute(
    state: &SharedRank,
    enqueue: impl FnOnce(&mut Rank) -> std::result::Result<fsdp_device::Event, DataError>,
) -> std::result::Result<(), DataError> {
    let (end, rank, seq, deadline) = {
        let mut r = lock(state);
        let end = enqueue(&mut r)?;
        (end, r.rank, r.seq(), r.deadline())
    };
    let left = deadline.saturating_duration_since(Instant::now());
    end.synchronize_timeout(left).map_err(|e| match e {
        fsdp_device::DeviceError::Timeout { .. } => DataError::Timeout {
            waiting_for: format!(
                "the GPU to finish collective #{seq} on rank {rank}'s CUDA stream ({e})"
            ),
        },
        // A fault of the GPU (a kernel's, the context's) is not a timeout.
        e => DataError::Protocol {
            reason: format!("collective #{seq} failed on rank {rank}'s CUDA stream: {e}"),
        },
    })
}

/// Run `steps` with `layout` on the rank.
fn run(
    r: &mut Rank,
    steps: impl Iterator<Item = Step>,
    layout: &Layout<'_>,
) -> std::result::Result<fsdp_device::Event, DataError> {
    r.run(steps, layout)
}

impl CudaRingCommunicator {
    fn seg_elems(&self, dtype: fsdp_device::DType) -> usize {
        (self.opts.segment_bytes / dtype.size_in_bytes()).max(1)
    }

    fn not_offered(&self, op: &'static str) -> CollectiveError {
        CollectiveError::InvalidArgument {
            rank: self.engine.rank(),
            op,
            reason: format!("the CUDA ring does not offer {op}"),
        }
    }
}

impl Communicator for CudaRingCommunicator {
    fn rank(&self) -> usize {
        self.engine.rank()
    }

    fn world_size(&self) -> usize {
        self.engine.world_size()
    }

    fn stream(&self) -> &Stream {
        self.engine.stream()
    }

    fn device(&self) -> Device {
        self.cuda_stream.device()
    }

    fn orders_stream_ordered_buffers(&self) -> bool {
        true
    }

    fn all_gather_base(&self, input: &Buffer, output: &Buffer) -> Result<Work> {
        let (world, rank) = (self.world_size(), self.rank());
        let n = input.len();
        let mut desc = OpDesc::new("all_gather_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        let check = self
            .engine
            .placement()
            .all_gather_base(rank, world, input, output);
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let (dtype, seg, state) = (
            input.dtype(),
            self.seg_elems(input.dtype()),
            self.rank.clone(),
        );
        let body: Body = Box::new(move |_, guards, ctx, _| {
            let esz = dtype.size_in_bytes() as u64;
            let chunks = Chunks::equal(world, n, seg);
            let out = ptr(&guards[guards.len() - 1]);
            let block = |c: usize| out + chunks.start(c) as u64 * esz;
            let own = if in_place {
                block(rank)
            } else {
                ptr(&guards[0])
            };
            let layout = Layout {
                own: &|_| own,
                out: &block,
                result: 0,
                dtype,
                op: ReduceOp::Sum,
            };
            execute(&state, |r| {
                run(
                    r,
                    schedule::all_gather(ctx.world, ctx.rank, &chunks),
                    &layout,
                )
            })
        });
        self.engine.issue(desc, check, body)
    }

    fn reduce_scatter_base(&self, input: &Buffer, output: &Buffer, op: ReduceOp) -> Result<Work> {
        let (world, rank) = (self.world_size(), self.rank());
        let n = output.len();
        let mut desc = OpDesc::new("reduce_scatter_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let check = self
            .engine
            .placement()
            .reduce_scatter_base(rank, world, input, output);
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let (dtype, seg, state) = (
            input.dtype(),
            self.seg_elems(input.dtype()),
            self.rank.clone(),
        );
        let body: Body = Box::new(move |_, guards, ctx, _| {
            let esz = dtype.size_in_bytes() as u64;
            let chunks = Chunks::equal(world, n, seg);
            let inp = ptr(&guards[0]);
            let chunk = |c: usize| inp + chunks.start(c) as u64 * esz;
            let result = if in_place {
                chunk(rank)
            } else {
                ptr(&guards[1])
            };
            let layout = Layout {
                own: &chunk,
                out: &|_| result,
                result,
                dtype,
                op,
            };
            execute(&state, |r| {
                run(
                    r,
                    schedule::reduce_scatter(ctx.world, ctx.rank, &chunks),
                    &layout,
                )
            })
        });
        self.engine.issue(desc, check, body)
    }

    fn all_reduce(&self, buf: &Buffer, op: ReduceOp) -> Result<Work> {
        let (world, rank) = (self.world_size(), self.rank());
        let total = buf.len();
        let mut desc = OpDesc::new("all_reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.reduce = Some(op);
        let check = self.engine.placement().all_reduce(buf);
        let (dtype, seg, state) = (buf.dtype(), self.seg_elems(buf.dtype()), self.rank.clone());
        let body: Body = Box::new(move |_, guards, ctx, _| {
            let esz = dtype.size_in_bytes() as u64;
            let chunks = Chunks::balanced(world, total, seg);
            let p = ptr(&guards[0]);
            let chunk = |c: usize| p + chunks.start(c) as u64 * esz;
            let own = chunk(rank);
            // Reduce-scatter in place, then all-gather in place (the host ring's all-reduce).
            let scatter = Layout {
                own: &chunk,
                out: &|_| own,
                result: own,
                dtype,
                op,
            };
            let gather = Layout {
                own: &|_| own,
                out: &chunk,
                result: 0,
                dtype,
                op,
            };
            execute(&state, |r| {
                run(
                    r,
                    schedule::reduce_scatter(ctx.world, ctx.rank, &chunks),
                    &scatter,
                )?;
                run(
                    r,
                    schedule::all_gather(ctx.world, ctx.rank, &chunks),
                    &gather,
                )
            })
        });
        self.engine.issue(desc, check, body)
    }

    fn broadcast(&self, buf: &Buffer, root: usize) -> Result<Work> {
        let (world, rank) = (self.world_size(), self.rank());
        let total = buf.len();
        let mut desc = OpDesc::new("broadcast");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.root = Some(root);
        let check = self.engine.placement().broadcast(rank, world, buf, root);
        let (dtype, seg, state) = (buf.dtype(), self.seg_elems(buf.dtype()), self.rank.clone());
        let body: Body = Box::new(move |_, guards, ctx, _| {
            let p = ptr(&guards[0]);
            let layout = Layout {
                own: &|_| p,
                out: &|_| p,
                result: p,
                dtype,
                op: ReduceOp::Sum,
            };
            execute(&state, |r| {
                let steps = schedule::broadcast(ctx.world, ctx.rank, root, total, seg);
                run(r, steps, &layout)
            })
        });
        self.engine.issue(desc, check, body)
    }

    fn reduce(&self, buf: &Buffer, op: ReduceOp, root: usize) -> Result<Work> {
        let (world, rank) = (self.world_size(), self.rank());
        let total = buf.len();
        let mut desc = OpDesc::new("reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = total;
        desc.reduce = Some(op);
        desc.root = Some(root);
        let check = self.engine.placement().reduce(rank, world, buf, root);
        let (dtype, seg, state) = (buf.dtype(), self.seg_elems(buf.dtype()), self.rank.clone());
        let body: Body = Box::new(move |_, guards, ctx, _| {
            let p = ptr(&guards[0]);
            let layout = Layout {
                own: &|_| p,
                out: &|_| p,
                result: p,
                dtype,
                op,
            };
            execute(&state, |r| {
                let steps = schedule::reduce(ctx.world, ctx.rank, root, total, seg);
                run(r, steps, &layout)
            })
        });
        self.engine.issue(desc, check, body)
    }

    fn barrier(&self) -> Result<Work> {
        // The description exchange alone is the barrier: it completes once every rank posted.
        let body: Body = Box::new(|_, _, _, _| Ok(()));
        self.engine
            .issue(OpDesc::new("barrier"), Ok(Access::none()), body)
    }

    fn all_gather(&self, _input: &Buffer, _outputs: &[Buffer]) -> Result<Work> {
        Err(self.not_offered("all_gather"))
    }

    fn split(&self, _color: Option<u32>, _key: usize) -> Result<Option<Box<dyn Communicator>>> {
        Err(self.not_offered("split"))
    }
}
