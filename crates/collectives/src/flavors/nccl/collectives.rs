//! The collectives of [`NcclCommunicator`]: checked, (optionally) verified across ranks, then
//! launched on the calling thread on the NCCL stream after the current stream's work (and
//! after the conflicting work on stream-ordered buffers, on the GPU), with an end event the
//! watchdog watches (and the stream-ordered buffers' newest use).

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::driver::result as cu;
use cudarc::nccl::sys;
use fsdp_device::{AccessTicket, Buffer, Device};

use super::comm::lock;
use super::work::Pending;
use super::{ffi, validate, NcclCommunicator};
use crate::flavors::check::Placement;
use crate::flavors::desc::{OpDesc as Desc, Sizes};
use crate::{CollectiveError, Communicator, ReduceOp, Result, Work};

/// The NCCL call(s) of a collective, given the device pointers of its buffers (in ticket
/// order), its sequence number and deadline.
type Launch<'a> = Box<dyn FnOnce(&NcclCommunicator, &[*mut u8], u64, Instant) -> Result<()> + 'a>;

impl NcclCommunicator {
    /// Make the NCCL stream wait (on the GPU) for the work enqueued on the current stream.
    pub(crate) fn order_after_current(&self) -> Result<()> {
        let current = self.current_stream();
        if current != self.stream {
            self.stream
                .wait_event(&current.record_event())
                .map_err(|source| CollectiveError::Device {
                    rank: self.rank,
                    source,
                })?;
        }
        Ok(())
    }

    fn nccl_stream(&self) -> sys::cudaStream_t {
        self.cuda.cu_stream() as sys::cudaStream_t
    }

    /// One NCCL call on this communicator's stream, bounded (see `Comm::call`).
    fn nccl(
        &self,
        op: &'static str,
        seq: u64,
        deadline: Instant,
        f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<()> {
        let s = self.nccl_stream();
        self.comm
            .call(op, seq, deadline, self.opts.timeout, |c| f(c, s))
    }

    /// Issue a collective: check, verify across ranks (a call that failed validation still
    /// takes part, so the peers fail too), order after the current stream, launch, record the
    /// end event and hand the work to the watchdog.
    fn issue(
        &self,
        mut desc: Desc,
        check: std::result::Result<Vec<AccessTicket>, String>,
        launch: Option<Launch<'_>>,
    ) -> Result<Work> {
        let (rank, op) = (self.rank, desc.op);
        if self.comm.abort_reason().is_some() {
            return Err(self.comm.aborted_error());
        }
        let seq = self.seq();
        desc.seq = seq;
        let (tickets, local_error) = match check {
            Ok(t) => (t, None),
            Err(reason) => {
                desc.invalid = Some(reason.clone());
                (Vec::new(), Some(self.invalid_arg(op, reason)))
            }
        };
        if let Err(e) = self.ctx.bind_to_thread() {
            // Publish it (defect 3 of issue 15): the peers would wait for this rank otherwise.
            let reason = format!(
                "rank {rank}: cuCtxSetCurrent on cuda:{}: {e:?}",
                self.ordinal
            );
            self.comm.abort(reason.clone(), true);
            return Err(CollectiveError::Backend {
                rank,
                backend: "nccl",
                op,
                reason,
            });
        }
        if self.world > 1 && (self.opts.verify || op == "barrier") {
            let mut slot = lock(&self.scratch);
            let checked = validate::exchange(&self.comm, &mut slot, &desc, seq, self.opts.timeout);
            // A call invalid here took part only so that the peers fail too; its own error is
            // the local one.
            if local_error.is_none() {
                checked?;
            }
        }
        if let Some(e) = local_error {
            return Err(e);
        }
        let Some(launch) = launch else {
            return Ok(Work::completed(op, rank));
        };
        // From here on the peers launch too: a failure on this rank alone must abort every
        // rank, or they would wait for it until their timeout.
        let abort_all = |e: CollectiveError| {
            if op != "split" {
                self.comm
                    .abort(format!("rank {rank} failed to launch {op}: {e}"), true);
            }
            e
        };
        self.order_after_current().map_err(abort_all)?;
        // Stream-ordered buffers: the NCCL stream waits (on the GPU) for the work that
        // conflicts with the collective, and its end becomes their newest use.
        let orders = crate::flavors::check::stream_orders(&tickets);
        for (order, mode) in &orders {
            order
                .before(&self.stream, *mode)
                .map_err(|source| abort_all(CollectiveError::Device { rank, source }))?;
        }
        let deadline = Instant::now() + self.opts.timeout;
        let buffers: Vec<Buffer> = tickets.iter().map(|t| t.buffer().clone()).collect();
        let mut guards = Vec::with_capacity(tickets.len());
        for t in tickets {
            let left = deadline.saturating_duration_since(Instant::now());
            let g = t
                .acquire(left)
                .map_err(|source| abort_all(CollectiveError::Device { rank, source }))?;
            guards.push(g);
        }
        let ptrs: Vec<*mut u8> = guards.iter().map(|g| g.as_ptr()).collect();
        let launched = launch(self, &ptrs, seq, deadline);
        // The GPU orders the buffers' later users after the end event; the guards only gave
        // the pointers.
        drop(guards);
        let end = self.stream.record_event();
        for (order, mode) in orders {
            order.after(&self.stream, mode);
        }
        let current = self.current_stream();
        let (pending, work) =
            Pending::new(op, rank, seq, end, self.opts.timeout, buffers, &current);
        if let Err(e) = launched {
            let e = abort_all(e);
            // Part of the launch may be on the GPU: the buffers are released only once the end
            // event completed (leaked if it does not within the grace period).
            pending.fail(e.clone(), Duration::from_secs(10));
            return Err(e);
        }
        if let Some(w) = &self.watchdog {
            w.push(pending);
        }
        Ok(work)
    }

    fn invalid_arg(&self, op: &'static str, reason: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            rank: self.rank,
            op,
            reason,
        }
    }

    /// Where this communicator's buffers live.
    fn placement(&self) -> Placement {
        Placement::on("nccl", Device::Cuda(self.ordinal))
    }

    /// NCCL's operation for `op` in this group. In a group of one rank the average is the
    /// sum (both are the rank's own values): NCCL 2.28.9's one-rank `ncclAvg` left the last
    /// element of a 4099-element f64 reduce-scatter unwritten on an H100, while its sum was
    /// exact.
    fn check_op(&self, op: ReduceOp) -> std::result::Result<sys::ncclRedOp_t, String> {
        let op = if self.world == 1 && op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        };
        ffi::nccl_op(op).ok_or_else(|| format!("reduce op {op} is not supported by NCCL"))
    }

    /// One in-place-or-not NCCL call over one or two buffers of `n` elements.
    #[allow(clippy::too_many_arguments)]
    fn simple(
        &self,
        desc: Desc,
        check: std::result::Result<Vec<AccessTicket>, String>,
        n: usize,
        call: impl FnOnce(&[*mut u8], sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<Work> {
        let op = desc.op;
        let launch: Launch<'_> = Box::new(move |me, ptrs, seq, deadline| {
            if n == 0 {
                return Ok(());
            }
            me.nccl(op, seq, deadline, |c, s| call(ptrs, c, s))
        });
        self.issue(desc, check, Some(launch))
    }

    /// [`Communicator::split`] returning the concrete type. A failure of the new communicator
    /// fails the split on every rank without aborting this one.
    pub fn split_nccl(&self, color: Option<u32>, key: usize) -> Result<Option<NcclCommunicator>> {
        let rank = self.rank;
        let check = (|| {
            if let Some(c) = color {
                if c > i32::MAX as u32 {
                    return Err(format!("color {c} > {} (NCCL takes an int)", i32::MAX));
                }
            }
            if key > i32::MAX as usize {
                return Err(format!("key {key} > {} (NCCL takes an int)", i32::MAX));
            }
            Ok(Vec::new())
        })();
        // Every rank numbers its splits alike (the child's abort flag is named by it).
        let n = self
            .splits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let color_c = color.map_or(ffi::SPLIT_NOCOLOR, |c| c as i32);
        let key_c = key.min(i32::MAX as usize) as i32;
        let child_flag = self.comm.flag.child(n, color_c);
        let mut child = None;
        let launch: Launch<'_> = Box::new(|me, _ptrs, _seq, deadline| {
            match me.comm.split(color_c, key_c, deadline, me.opts.timeout) {
                Ok(c) => {
                    child = Some(c);
                    Ok(())
                }
                Err(e) => {
                    // The child's other ranks fail fast; the parent stays usable.
                    if color.is_some() {
                        child_flag.publish(&format!("rank {rank} failed to split: {e}"));
                    }
                    Err(e)
                }
            }
        });
        self.issue(Desc::new("split"), check, Some(launch))?
            .synchronize()?;
        let Some(raw) = child.filter(|c| !c.is_null()) else {
            return Ok(None);
        };
        let abort_child = |why: String| {
            // SAFETY: the new communicator is not handed out; aborted once.
            unsafe { sys::ncclCommAbort(raw) };
            CollectiveError::Backend {
                rank,
                backend: "nccl",
                op: "split",
                reason: why,
            }
        };
        let (mut new_rank, mut new_world) = (0i32, 0i32);
        // SAFETY: `raw` is a ready communicator that only this thread holds.
        let r1 = unsafe { sys::ncclCommUserRank(raw, &mut new_rank) };
        // SAFETY: as above.
        let r2 = unsafe { sys::ncclCommCount(raw, &mut new_world) };
        if r1 != sys::ncclResult_t::ncclSuccess || r2 != sys::ncclResult_t::ncclSuccess {
            return Err(abort_child("could not query the new communicator".into()));
        }
        let stream = fsdp_device::Stream::cuda_with_timeout(
            self.ordinal,
            format!("nccl:{new_rank}/{new_world}:cuda{}", self.ordinal),
            self.opts.timeout,
        )
        .map_err(|e| abort_child(format!("no stream for the new communicator: {e}")))?;
        NcclCommunicator::from_parts(
            raw,
            new_rank as usize,
            new_world as usize,
            self.ordinal,
            self.opts.clone(),
            self.ctx.clone(),
            stream,
            child_flag,
        )
        .map(Some)
    }
}

fn void(p: *mut u8) -> *mut c_void {
    p.cast()
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    /// The NCCL stream (a CUDA stream).
    fn stream(&self) -> &fsdp_device::Stream {
        &self.stream
    }

    fn orders_stream_ordered_buffers(&self) -> bool {
        true
    }

    fn all_gather_base(&self, input: &Buffer, output: &Buffer) -> Result<Work> {
        let (world, rank) = (self.world, self.rank);
        let n = input.len();
        let mut desc = Desc::new("all_gather_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        let in_place = input.overlaps(output);
        let check = self
            .placement()
            .all_gather_base(rank, world, input, output)
            .map(|a| a.tickets);
        let dtype = input.dtype();
        self.simple(desc, check, n, move |p, comm, s| {
            let out = p[p.len() - 1];
            let inp = if in_place {
                out.wrapping_add(rank * n * dtype.size_in_bytes())
            } else {
                p[0]
            };
            // SAFETY: device buffers of the checked sizes on this communicator's GPU, held by
            // the work until its end event completed.
            unsafe {
                sys::ncclAllGather(
                    inp as *const c_void,
                    void(out),
                    n,
                    ffi::nccl_dtype(dtype),
                    comm,
                    s,
                )
            }
        })
    }

    fn reduce_scatter_base(&self, input: &Buffer, output: &Buffer, op: ReduceOp) -> Result<Work> {
        let (world, rank) = (self.world, self.rank);
        let n = output.len();
        let mut desc = Desc::new("reduce_scatter_base");
        desc.dtype = Some(input.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let in_place = input.overlaps(output);
        let nop = self.check_op(op);
        let check = nop.clone().and_then(|_| {
            self.placement()
                .reduce_scatter_base(rank, world, input, output)
                .map(|a| a.tickets)
        });
        let nop = nop.unwrap_or(sys::ncclRedOp_t::ncclSum);
        let dtype = input.dtype();
        self.simple(desc, check, n, move |p, comm, s| {
            let inp = p[0];
            let out = if in_place {
                inp.wrapping_add(rank * n * dtype.size_in_bytes())
            } else {
                p[1]
            };
            // SAFETY: device buffers of the checked sizes, held until the end event.
            unsafe {
                sys::ncclReduceScatter(
                    inp as *const c_void,
                    void(out),
                    n,
                    ffi::nccl_dtype(dtype),
                    nop,
                    comm,
                    s,
                )
            }
        })
    }

    fn all_reduce(&self, buf: &Buffer, op: ReduceOp) -> Result<Work> {
        let n = buf.len();
        let mut desc = Desc::new("all_reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        let nop = self.check_op(op);
        let check = nop
            .clone()
            .and_then(|_| self.placement().all_reduce(buf).map(|a| a.tickets));
        let nop = nop.unwrap_or(sys::ncclRedOp_t::ncclSum);
        let dtype = buf.dtype();
        self.simple(desc, check, n, move |p, comm, s| {
            // SAFETY: one device buffer (in place) of `n` elements, held until the end event.
            unsafe {
                sys::ncclAllReduce(
                    p[0] as *const c_void,
                    void(p[0]),
                    n,
                    ffi::nccl_dtype(dtype),
                    nop,
                    comm,
                    s,
                )
            }
        })
    }

    fn broadcast(&self, buf: &Buffer, root: usize) -> Result<Work> {
        let n = buf.len();
        let mut desc = Desc::new("broadcast");
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.root = Some(root);
        let check = self
            .placement()
            .broadcast(self.rank, self.world, buf, root)
            .map(|a| a.tickets);
        let dtype = buf.dtype();
        self.simple(desc, check, n, move |p, comm, s| {
            // SAFETY: one device buffer (in place) of `n` elements, held until the end event;
            // the root was checked to be a rank.
            unsafe {
                sys::ncclBroadcast(
                    p[0] as *const c_void,
                    void(p[0]),
                    n,
                    ffi::nccl_dtype(dtype),
                    root as i32,
                    comm,
                    s,
                )
            }
        })
    }

    fn reduce(&self, buf: &Buffer, op: ReduceOp, root: usize) -> Result<Work> {
        let n = buf.len();
        let mut desc = Desc::new("reduce");
        desc.dtype = Some(buf.dtype());
        desc.count = n;
        desc.reduce = Some(op);
        desc.root = Some(root);
        let nop = self.check_op(op);
        let check = nop.clone().and_then(|_| {
            self.placement()
                .reduce(self.rank, self.world, buf, root)
                .map(|a| a.tickets)
        });
        let nop = nop.unwrap_or(sys::ncclRedOp_t::ncclSum);
        let dtype = buf.dtype();
        self.simple(desc, check, n, move |p, comm, s| {
            // SAFETY: one device buffer (in place; NCCL writes it only on the root) of `n`
            // elements, held until the end event.
            unsafe {
                sys::ncclReduce(
                    p[0] as *const c_void,
                    void(p[0]),
                    n,
                    ffi::nccl_dtype(dtype),
                    nop,
                    root as i32,
                    comm,
                    s,
                )
            }
        })
    }

    fn barrier(&self) -> Result<Work> {
        // The description exchange (a small all-gather and a host wait) is the barrier.
        self.issue(Desc::new("barrier"), Ok(Vec::new()), None)
    }

    fn all_gather(&self, input: &Buffer, outputs: &[Buffer]) -> Result<Work> {
        let (world, rank) = (self.world, self.rank);
        let sizes: Vec<usize> = outputs.iter().map(Buffer::len).collect();
        let mut desc = Desc::new("all_gather");
        desc.dtype = Some(input.dtype());
        desc.count = input.len();
        desc.sizes = Some(Sizes::List(sizes.clone()));
        let dtype = input.dtype();
        let esz = dtype.size_in_bytes();
        let max = sizes.iter().copied().max().unwrap_or(0);
        let check = (|| {
            if max
                .checked_mul(esz)
                .and_then(|b| b.checked_mul(world + 1))
                .is_none()
            {
                return Err("the padded temporary buffer would overflow usize".into());
            }
            self.placement()
                .all_gather(rank, world, input, outputs)
                .map(|a| a.tickets)
        })();
        let launch: Launch<'_> = Box::new(move |me, ptrs, seq, deadline| {
            if max == 0 {
                return Ok(());
            }
            let s = me.cuda.cu_stream();
            let bytes = max * esz * (world + 1);
            // Pad every input to the largest, all-gather base into one flat temporary, copy
            // out. SAFETY: stream-ordered allocation on the NCCL stream (no device-wide
            // synchronisation), freed below after the copies in stream order.
            let tmp =
                unsafe { cu::malloc_async(s, bytes) }.map_err(|e| me.drv("cuMemAllocAsync", e))?;
            let flat = tmp + (max * esz) as u64;
            let result = (|| {
                if sizes[rank] > 0 {
                    // SAFETY: ptrs[0] is this rank's input (sizes[rank] elements); tmp holds
                    // at least that many bytes.
                    unsafe { cu::memcpy_dtod_async(tmp, ptrs[0] as u64, sizes[rank] * esz, s) }
                        .map_err(|e| me.drv("cuMemcpyDtoDAsync", e))?;
                }
                me.nccl("all_gather", seq, deadline, |comm, st| {
                    // SAFETY: padded input and flat output are private to this call.
                    unsafe {
                        sys::ncclAllGather(
                            tmp as *const c_void,
                            flat as *mut c_void,
                            max,
                            ffi::nccl_dtype(dtype),
                            comm,
                            st,
                        )
                    }
                })?;
                for (i, p) in ptrs[1..].iter().enumerate() {
                    if sizes[i] == 0 {
                        continue;
                    }
                    // SAFETY: outputs[i] holds sizes[i] elements; block i of the flat
                    // temporary holds at least that many.
                    unsafe {
                        cu::memcpy_dtod_async(
                            *p as u64,
                            flat + (i * max * esz) as u64,
                            sizes[i] * esz,
                            s,
                        )
                    }
                    .map_err(|e| me.drv("cuMemcpyDtoDAsync", e))?;
                }
                Ok(())
            })();
            // SAFETY: allocated above on this stream; freed after the work enqueued on it.
            let freed = unsafe { cu::free_async(tmp, s) };
            result?;
            freed.map_err(|e| me.drv("cuMemFreeAsync", e))
        });
        self.issue(desc, check, Some(launch))
    }

    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Box<dyn Communicator>>> {
        Ok(self
            .split_nccl(color, key)?
            .map(|c| Box::new(c) as Box<dyn Communicator>))
    }
}

impl NcclCommunicator {
    fn drv(&self, op: &'static str, e: cu::DriverError) -> CollectiveError {
        CollectiveError::Backend {
            rank: self.rank,
            backend: "nccl",
            op,
            reason: format!("cuda:{}: CUDA driver error {e:?}", self.ordinal),
        }
    }
}
