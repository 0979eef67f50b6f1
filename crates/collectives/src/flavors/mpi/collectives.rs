//! The collectives: each describes its call, checks its arguments and enqueues a body that runs
//! the matching non-blocking MPI call; 16-bit reductions go through `f32` scratch.

use std::ffi::{c_int, c_void};

use ::mpi::ffi;
use fsdp_device::{with_element, Buffer, DType, Element, Stream};

use super::issue::{c_count, ptr, Body, Ctx};
use super::runtime::{move_type, mpi_double, mpi_float};
use super::MpiCommunicator;
use crate::flavors::check::Access;
use crate::flavors::desc::{sizes_fingerprint, OpDesc, Sizes};
use crate::{Communicator, ReduceOp, Result, Work};

/// The MPI op and datatype that reduce `dtype` (16-bit types are reduced as `f32`).
pub(super) fn reduce_op_type(
    ctx: &Ctx<'_>,
    dtype: DType,
    op: ReduceOp,
) -> (ffi::MPI_Op, ffi::MPI_Datatype) {
    let ops = ctx.ops();
    let f64 = dtype == DType::F64;
    let mpi_op = match op {
        // SAFETY: reading predefined constants.
        ReduceOp::Sum | ReduceOp::Avg => unsafe { ffi::RSMPI_SUM },
        // SAFETY: as above.
        ReduceOp::Product => unsafe { ffi::RSMPI_PROD },
        ReduceOp::Min if f64 => ops.min_f64,
        ReduceOp::Min => ops.min_f32,
        ReduceOp::Max if f64 => ops.max_f64,
        ReduceOp::Max => ops.max_f32,
    };
    (mpi_op, if f64 { mpi_double() } else { mpi_float() })
}

/// Whether `dtype` is reduced through an `f32` copy.
pub(super) fn widened(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `dst[i] = src[i] as f32` for `n` elements of `T`.
///
/// # Safety
/// `src` points to `n` readable elements of `T`, `dst` to `n` writable `f32`s.
pub(super) unsafe fn widen<T: Element>(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: guaranteed by the caller; both are aligned (host buffers and scratch).
    let (s, d) = unsafe {
        (
            std::slice::from_raw_parts(src as *const T, n),
            std::slice::from_raw_parts_mut(dst as *mut f32, n),
        )
    };
    for (d, s) in d.iter_mut().zip(s) {
        *d = s.to_f32();
    }
}

/// `dst[i] = T::from_f32(finish(src[i]))` for `n` elements: the one rounding of a widened
/// reduction (after Avg's division in f32).
///
/// # Safety
/// `src` points to `n` readable `f32`s, `dst` to `n` writable elements of `T`.
pub(super) unsafe fn narrow<T: Element>(
    src: *const u8,
    dst: *mut u8,
    n: usize,
    op: ReduceOp,
    world: usize,
) {
    // SAFETY: guaranteed by the caller.
    let (s, d) = unsafe {
        (
            std::slice::from_raw_parts(src as *const f32, n),
            std::slice::from_raw_parts_mut(dst as *mut T, n),
        )
    };
    for (d, &s) in d.iter_mut().zip(s) {
        *d = T::from_f32(op.finish(s, world));
    }
}

/// Avg's division, in place, for `n` elements of `dtype` (f32 or f64).
///
/// # Safety
/// `p` points to `n` writable elements of `dtype`.
pub(super) unsafe fn finish_in_place(
    p: *mut u8,
    n: usize,
    dtype: DType,
    op: ReduceOp,
    world: usize,
) {
    if op != ReduceOp::Avg {
        return;
    }
    with_element!(dtype, T => {
        // SAFETY: guaranteed by the caller.
        let s = unsafe { std::slice::from_raw_parts_mut(p as *mut T, n) };
        for v in s {
            *v = op.finish(*v, world);
        }
    })
}

/// `dtype`'s element size.
pub(super) fn esz(dtype: DType) -> usize {
    dtype.size_in_bytes()
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world_size(&self) -> usize {
        self.inner.world
    }

    fn stream(&self) -> &Stream {
        &self.stream
    }

    fn all_gather_base(&self, input: &Buffer, output: &Buffer) -> Result<Work> {
        let (world, rank) = (self.inner.world, self.inner.rank);
        let n = input.len();
        let mut desc = OpDesc::new("all_gather_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        let check = c_count(n, "input")
            .and_then(|_| self.placement().all_gather_base(rank, world, input, output));
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let dtype = input.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            if n == 0 {
                return Ok(());
            }
            let bytes = n * esz(dtype);
            let out = ptr(&guards[guards.len() - 1]);
            let send = if in_place {
                // MPI_IN_PLACE is not exposed portably by rsmpi: send a copy of the own block.
                let t = ctx.temp(bytes);
                // SAFETY: the exclusive guard covers the output, whose block `rank` holds n
                // elements; `t` is fresh scratch of `bytes` bytes.
                unsafe { std::ptr::copy_nonoverlapping(out.add(rank * bytes), t, bytes) };
                t
            } else {
                ptr(&guards[0])
            };
            let count = n as c_int;
            ctx.run("MPI_Iallgather", |req| {
                // SAFETY: `send` holds n elements, `out` world × n (checked at issue), both held
                // by guards or scratch until the request completes (leaked on timeout).
                unsafe {
                    ffi::MPI_Iallgather(
                        send as *const c_void,
                        count,
                        move_type(dtype),
                        out as *mut c_void,
                        count,
                        move_type(dtype),
                        ctx.comm(),
                        req,
                    )
                }
            })
        });
        self.issue(desc, check, body)
    }

    fn reduce_scatter_base(&self, input: &Buffer, output: &Buffer, op: ReduceOp) -> Result<Work> {
        let (world, rank) = (self.inner.world, self.inner.rank);
        let n = output.len();
        let mut desc = OpDesc::new("reduce_scatter_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let check = c_count(n, "output").and_then(|_| {
            self.placement()
                .reduce_scatter_base(rank, world, input, output)
        });
        let in_place = check.as_ref().is_ok_and(|a| a.in_place);
        let dtype = input.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            if n == 0 {
                return Ok(());
            }
            let inp = ptr(&guards[0]);
            let out = if in_place {
                inp.wrapping_add(rank * n * esz(dtype))
            } else {
                ptr(&guards[1])
            };
            let (mpi_op, mpi_type) = reduce_op_type(ctx, dtype, op);
            let wide = widened(dtype);
            // Send: the input (widened to f32 for 16-bit types). Receive: scratch when the
            // result must be post-processed or the call is in place, else the output itself.
            let send = if wide {
                let t = ctx.temp(world * n * 4);
                // SAFETY: the guard covers world × n input elements; `t` holds as many f32s.
                with_element!(dtype, T => unsafe { widen::<T>(inp, t, world * n) });
                t
            } else {
                inp
            };
            let recv = if wide || in_place {
                ctx.temp(n * if wide { 4 } else { esz(dtype) })
            } else {
                out
            };
            let count = n as c_int;
            ctx.run("MPI_Ireduce_scatter_block", |req| {
                // SAFETY: `send` holds world × n and `recv` n elements of `mpi_type`, held by
                // guards or scratch until the request completes (leaked on timeout).
                unsafe {
                    ffi::MPI_Ireduce_scatter_block(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        mpi_type,
                        mpi_op,
                        ctx.comm(),
                        req,
                    )
                }
            })?;
            if wide {
                // SAFETY: `recv` holds n f32s; `out` n elements of T under an exclusive guard.
                with_element!(dtype, T => unsafe { narrow::<T>(recv, out, n, op, world) });
            } else {
                if in_place {
                    // SAFETY: `recv` is scratch of n elements; `out` is this rank's chunk of the
                    // input, held exclusively.
                    unsafe { std::ptr::copy_nonoverlapping(recv, out, n * esz(dtype)) };
                }
                // SAFETY: `out` holds n elements of dtype under an exclusive guard.
                unsafe { finish_in_place(out, n, dtype, op, world) };
            }
            Ok(())
        });
        self.issue(desc, check, body)
    }

    fn all_reduce(&self, buf: &Buffer, op: ReduceOp) -> Result<Work> {
        let world = self.inner.world;
        let n = buf.len();
        let mut desc = OpDesc::new("all_reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let check = c_count(n, "buffer").and_then(|_| self.placement().all_reduce(buf));
        let dtype = buf.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            if n == 0 {
                return Ok(());
            }
            let p = ptr(&guards[0]);
            let (mpi_op, mpi_type) = reduce_op_type(ctx, dtype, op);
            let wide = widened(dtype);
            let send = ctx.temp(n * if wide { 4 } else { esz(dtype) });
            if wide {
                // SAFETY: the guard covers n elements; `send` holds n f32s.
                with_element!(dtype, T => unsafe { widen::<T>(p, send, n) });
            } else {
                // SAFETY: as above, n elements of dtype.
                unsafe { std::ptr::copy_nonoverlapping(p, send, n * esz(dtype)) };
            }
            let recv = if wide { ctx.temp(n * 4) } else { p };
            let count = n as c_int;
            ctx.run("MPI_Iallreduce", |req| {
                // SAFETY: `send` and `recv` hold n elements of `mpi_type`, held by the guard or
                // scratch until the request completes (leaked on timeout).
                unsafe {
                    ffi::MPI_Iallreduce(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        mpi_type,
                        mpi_op,
                        ctx.comm(),
                        req,
                    )
                }
            })?;
            if wide {
                // SAFETY: `recv` holds n f32s; `p` n elements of T under an exclusive guard.
                with_element!(dtype, T => unsafe { narrow::<T>(recv, p, n, op, world) });
            } else {
                // SAFETY: `p` holds n elements of dtype under an exclusive guard.
                unsafe { finish_in_place(p, n, dtype, op, world) };
            }
            Ok(())
        });
        self.issue(desc, check, body)
    }

    fn broadcast(&self, buf: &Buffer, root: usize) -> Result<Work> {
        let rank = self.inner.rank;
        let n = buf.len();
        let mut desc = OpDesc::new("broadcast");
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.root = Some(root);
        let check = c_count(n, "buffer").and_then(|_| {
            self.placement()
                .broadcast(rank, self.inner.world, buf, root)
        });
        let dtype = buf.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            if n == 0 {
                return Ok(());
            }
            let p = ptr(&guards[0]);
            let count = n as c_int;
            ctx.run("MPI_Ibcast", |req| {
                // SAFETY: `p` holds n elements under the guard (the root's is only read) until
                // the request completes (leaked on timeout).
                unsafe {
                    ffi::MPI_Ibcast(
                        p as *mut c_void,
                        count,
                        move_type(dtype),
                        root as c_int,
                        ctx.comm(),
                        req,
                    )
                }
            })
        });
        self.issue(desc, check, body)
    }

    fn reduce(&self, buf: &Buffer, op: ReduceOp, root: usize) -> Result<Work> {
        let (rank, world) = (self.inner.rank, self.inner.world);
        let n = buf.len();
        let mut desc = OpDesc::new("reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        desc.root = Some(root);
        let check =
            c_count(n, "buffer").and_then(|_| self.placement().reduce(rank, world, buf, root));
        let dtype = buf.dtype();
        let body: Body = Box::new(move |ctx, guards, _| {
            if n == 0 {
                return Ok(());
            }
            let p = ptr(&guards[0]);
            let (mpi_op, mpi_type) = reduce_op_type(ctx, dtype, op);
            let wide = widened(dtype);
            let is_root = rank == root;
            let send = if wide {
                let t = ctx.temp(n * 4);
                // SAFETY: the guard covers n elements; `t` holds n f32s.
                with_element!(dtype, T => unsafe { widen::<T>(p, t, n) });
                t
            } else if is_root {
                let t = ctx.temp(n * esz(dtype));
                // SAFETY: as above, n elements of dtype.
                unsafe { std::ptr::copy_nonoverlapping(p, t, n * esz(dtype)) };
                t
            } else {
                p
            };
            let recv = match (is_root, wide) {
                (true, true) => ctx.temp(n * 4),
                (true, false) => p,
                // Ignored by MPI on non-root ranks.
                (false, _) => std::ptr::null_mut(),
            };
            let count = n as c_int;
            ctx.run("MPI_Ireduce", |req| {
                // SAFETY: `send` holds n elements of `mpi_type` and, on the root, `recv` too;
                // held by the guard or scratch until the request completes (leaked on timeout).
                unsafe {
                    ffi::MPI_Ireduce(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        mpi_type,
                        mpi_op,
                        root as c_int,
                        ctx.comm(),
                        req,
                    )
                }
            })?;
            if is_root {
                if wide {
                    // SAFETY: `recv` holds n f32s; `p` n elements of T under an exclusive guard.
                    with_element!(dtype, T => unsafe { narrow::<T>(recv, p, n, op, world) });
                } else {
                    // SAFETY: `p` holds n elements of dtype under an exclusive guard.
                    unsafe { finish_in_place(p, n, dtype, op, world) };
                }
            }
            Ok(())
        });
        self.issue(desc, check, body)
    }

    fn barrier(&self) -> Result<Work> {
        // The exchange of descriptions is itself the barrier.
        let body: Body = Box::new(|_, _, _| Ok(()));
        self.issue(OpDesc::new("barrier"), Ok(Access::none()), body)
    }

    fn all_gather(&self, input: &Buffer, outputs: &[Buffer]) -> Result<Work> {
        let (world, rank) = (self.inner.world, self.inner.rank);
        let sizes: Vec<usize> = outputs.iter().map(Buffer::len).collect();
        let mut desc = OpDesc::new("all_gather");
        desc.dtype = Some(input.dtype());
        desc.count = input.len();
        desc.sizes = Some(Sizes::Fingerprint(sizes_fingerprint(&sizes)));
        let check = c_count(sizes.iter().sum(), "the total output")
            .and_then(|_| self.placement().all_gather(rank, world, input, outputs));
        let dtype = input.dtype();
        let body: Body = Box::new(move |ctx, guards, descs| {
            // The exchange already compared the sizes: descs[i].count is rank i's length.
            let lens: Vec<usize> = descs.iter().map(|d| d.count).collect();
            let total: usize = lens.iter().sum();
            if total == 0 {
                return Ok(());
            }
            let e = esz(dtype);
            let counts: Vec<c_int> = lens.iter().map(|&l| l as c_int).collect();
            let displs: Vec<c_int> = lens
                .iter()
                .scan(0usize, |acc, &l| {
                    let d = *acc;
                    *acc += l;
                    Some(d as c_int)
                })
                .collect();
            let flat = ctx.temp(total * e);
            let send = if lens[rank] == 0 {
                ctx.temp(e)
            } else {
                ptr(&guards[0])
            };
            // The counts and displacements must outlive the request too.
            let meta = ctx.temp(2 * world * std::mem::size_of::<c_int>()) as *mut c_int;
            // SAFETY: `meta` is scratch for 2 × world ints.
            unsafe {
                std::ptr::copy_nonoverlapping(counts.as_ptr(), meta, world);
                std::ptr::copy_nonoverlapping(displs.as_ptr(), meta.add(world), world);
            }
            let own = counts[rank];
            ctx.run("MPI_Iallgatherv", |req| {
                // SAFETY: `send` holds lens[rank] elements, `flat` the total; counts and
                // displacements describe `flat`; all live until the request completes.
                unsafe {
                    ffi::MPI_Iallgatherv(
                        send as *const c_void,
                        own,
                        move_type(dtype),
                        flat as *mut c_void,
                        meta,
                        meta.add(world),
                        move_type(dtype),
                        ctx.comm(),
                        req,
                    )
                }
            })?;
            for (i, g) in guards[1..].iter().enumerate() {
                // SAFETY: exclusive guard over outputs[i] of lens[i] elements (the exchange
                // checked the sizes); block i of `flat` holds them.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        flat.add(displs[i] as usize * e),
                        ptr(g),
                        lens[i] * e,
                    )
                };
            }
            Ok(())
        });
        self.issue(desc, check, body)
    }

    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Box<dyn Communicator>>> {
        Ok(self
            .split_mpi(color, key)?
            .map(|c| Box::new(c) as Box<dyn Communicator>))
    }

    fn orders_stream_ordered_buffers(&self) -> bool {
        true
    }
}
