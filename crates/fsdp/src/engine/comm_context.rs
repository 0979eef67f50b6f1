//! State shared by all param groups of a rank (FSDP2's `FSDPCommContext` and the cross-group
//! parts of `FSDPState`): the process groups, the streams, the caching allocator, the
//! all-gather limiter, pending reductions, the recorded schedule, the tracer and the recorded
//! execution order.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use fsdp_collectives::{mesh_2d, Communicator, HybridMesh, ReduceOp, Work};
use fsdp_device::{Buffer, DType, Device, Stream};

use super::config::{
    CrossStreamSafety, FsdpConfig, Phase, ScheduleEvent, ScheduleKind, ShardingStrategy,
};
use super::device::ComputeDevice;
use super::order::ExecOrder;
use super::pool::MemoryPool;
use crate::trace::{now_us, SpanKind, TraceEvent, Tracer};
use crate::FsdpError;

/// The process groups of a rank: the world, and for the hybrid strategies a
/// `replicate × shard` mesh.
pub struct ProcessGroups {
    strategy: ShardingStrategy,
    world: Box<dyn Communicator>,
    mesh: Option<HybridMesh>,
}

impl std::fmt::Debug for ProcessGroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroups")
            .field("strategy", &self.strategy)
            .field("rank", &self.world.rank())
            .field("world_size", &self.world.world_size())
            .field("mesh", &self.mesh)
            .finish()
    }
}

impl ProcessGroups {
    /// The groups of `strategy` over `world`: the hybrid strategies split it into a mesh of
    /// `world / ranks_per_node` replicas of `ranks_per_node` ranks (a collective: every rank
    /// calls it).
    ///
    /// # Errors
    /// [`FsdpError::InvalidFsdpConfig`] when `ranks_per_node` does not divide the world size;
    /// a failing split.
    pub fn new(
        world: Box<dyn Communicator>,
        strategy: ShardingStrategy,
        ranks_per_node: Option<usize>,
    ) -> Result<Self, FsdpError> {
        let mesh = if strategy.is_hybrid() {
            let n = world.world_size();
            let per_node = ranks_per_node.unwrap_or(n);
            if per_node == 0 || n % per_node != 0 {
                return Err(FsdpError::InvalidFsdpConfig {
                    reason: format!("ranks_per_node {per_node} does not divide the world size {n}"),
                });
            }
            Some(mesh_2d(world.as_ref(), n / per_node, per_node)?)
        } else {
            None
        };
        Ok(ProcessGroups {
            strategy,
            world,
            mesh,
        })
    }

    /// Groups from a mesh built elsewhere (for example a dry run's, which cannot split).
    pub fn with_mesh(
        world: Box<dyn Communicator>,
        strategy: ShardingStrategy,
        mesh: Option<HybridMesh>,
    ) -> Self {
        ProcessGroups {
            strategy,
            world,
            mesh,
        }
    }

    /// The whole group.
    pub fn world(&self) -> &dyn Communicator {
        self.world.as_ref()
    }

    /// The group parameters are sharded over, when it has more than one rank.
    pub fn shard(&self) -> Option<&dyn Communicator> {
        let g: &dyn Communicator = match self.strategy {
            ShardingStrategy::FullShard | ShardingStrategy::ShardGradOp => self.world.as_ref(),
            ShardingStrategy::NoShard => return None,
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2 => {
                self.mesh.as_ref()?.shard.as_ref()
            }
        };
        (g.world_size() > 1).then_some(g)
    }

    /// The group a shard is replicated over (gradients all-reduced), when it has more than one
    /// rank.
    pub fn replicate(&self) -> Option<&dyn Communicator> {
        let g: &dyn Communicator = match self.strategy {
            ShardingStrategy::FullShard | ShardingStrategy::ShardGradOp => return None,
            ShardingStrategy::NoShard => self.world.as_ref(),
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2 => {
                self.mesh.as_ref()?.replicate.as_ref()
            }
        };
        (g.world_size() > 1).then_some(g)
    }

    /// The world, when it has more than one rank.
    pub fn world_multi(&self) -> Option<&dyn Communicator> {
        (self.world.world_size() > 1).then_some(self.world.as_ref())
    }

    /// The sharding factor `F` and this rank's shard index.
    pub fn factor_and_index(&self) -> (usize, usize) {
        self.shard().map_or((1, 0), |g| (g.world_size(), g.rank()))
    }
}

/// A gradient reduction in flight: its work, and the unsharded gradient its reduce-scatter
/// reads, held until the host waits for a collective issued after it on the same stream (so
/// the memory is released at the same point whatever the backend).
pub(crate) struct PendingReduce {
    pub(crate) work: Work,
    pub(crate) issued: u64,
    pub(crate) holds: Option<Buffer>,
}

/// The cross-group state of one rank (see the [engine](super) documentation).
pub struct CommContext {
    pub(crate) config: FsdpConfig,
    pub(crate) groups: ProcessGroups,
    pub(crate) compute: Stream,
    pub(crate) pool: Arc<dyn MemoryPool>,
    /// All-gathered buffers counted by the limiter.
    pub(crate) in_flight: usize,
    /// Collectives issued so far (an issue index, for release points).
    pub(crate) issued: u64,
    pub(crate) pending: Vec<PendingReduce>,
    /// Every pending reduction issued before this index has released its gradient
    /// ([`release_before`](Self::release_before)): issue indices only grow, and `pending` is
    /// in issue order, so a release touches only the entries not released yet.
    pub(crate) released_before: u64,
    pub(crate) phase: Phase,
    /// Forward/backward passes begun.
    pub(crate) step: u64,
    pub(crate) schedule: Vec<ScheduleEvent>,
    pub(crate) tracer: Option<Tracer>,
    /// Bytes of the all-gathered (unsharded) parameter buffers held now.
    pub(crate) unsharded_bytes: u64,
    /// At the highest allocated total seen after an allocation: (total, unsharded parameter
    /// bytes).
    pub(crate) peak_sample: (u64, u64),
    /// The recorded execution order (prefetch follows it).
    pub(crate) order: ExecOrder,
    /// Where the unsharded parameters and gradients live and the model computes, when not in
    /// host memory (see [`ComputeDevice`]).
    pub(crate) device: Option<ComputeDevice>,
    /// On a device: the gathered buffers of units counted by the limiter that were freed
    /// (resharded) while the device may still use them, oldest first. Held here, not handed to
    /// the reaper, so that the limiter can wait for them and return them to the allocator at
    /// once ([`wait_for_frees`](Self::wait_for_frees)).
    pub(crate) freeing: VecDeque<Buffer>,
    /// How many times the limiter waited for a freed unit's work on the device.
    pub(crate) free_waits: u64,
    /// On a device: issued collectives the host did not wait for (the device's streams are
    /// ordered after them by events), until they are known to have succeeded.
    pub(crate) deferred: Mutex<Vec<Work>>,
    /// How many times the engine blocked the host on a collective or the device.
    pub(crate) host_waits: AtomicU64,
}

impl std::fmt::Debug for CommContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommContext")
            .field("groups", &self.groups)
            .field("in_flight", &self.in_flight)
            .field("step", &self.step)
            .finish()
    }
}

impl CommContext {
    pub(crate) fn new(
        config: FsdpConfig,
        groups: ProcessGroups,
        pool: Arc<dyn MemoryPool>,
    ) -> Self {
        CommContext {
            config,
            groups,
            compute: Stream::inline("compute"),
            pool,
            in_flight: 0,
            issued: 0,
            pending: Vec::new(),
            released_before: 0,
            phase: Phase::Forward,
            step: 0,
            schedule: Vec::new(),
            tracer: config.trace.then(Tracer::default),
            unsharded_bytes: 0,
            peak_sample: (0, 0),
            order: ExecOrder::default(),
            device: None,
            freeing: VecDeque::new(),
            free_waits: 0,
            deferred: Mutex::new(Vec::new()),
            host_waits: AtomicU64::new(0),
        }
    }

    /// The device holding the shards, gradient shards and optimizer state: the compute device
    /// unless [`FsdpConfig::offload_params`](super::FsdpConfig::offload_params) keeps them in host
    /// memory.
    pub(crate) fn shards_on_device(&self) -> Option<&ComputeDevice> {
        self.device.as_ref().filter(|_| !self.config.offload_params)
    }

    /// Count a wait of the host on the device or a collective.
    pub(crate) fn count_host_wait(&self) {
        self.host_waits.fetch_add(1, Ordering::Relaxed);
    }

    /// Wait on the host for `work` (counted in `host_waits`).
    ///
    /// # Errors
    /// The work's failure or timeout.
    pub(crate) fn wait(&self, work: &Work) -> Result<(), FsdpError> {
        self.host_waits.fetch_add(1, Ordering::Relaxed);
        Ok(work.wait()?)
    }

    /// On a device, leave `work` to the device's ordering instead of waiting for it on the
    /// host (the buffers it uses are stream-ordered: what reads its results waits for its
    /// event there), and report any deferred collective that has failed by now; on the host,
    /// wait for it.
    ///
    /// # Errors
    /// A failed collective (this one on the host; any deferred one known to have failed on a
    /// device).
    pub(crate) fn wait_or_defer(&self, work: Work) -> Result<(), FsdpError> {
        if self.device.is_none() {
            return self.wait(&work);
        }
        self.deferred_works().push(work);
        self.check_deferred()
    }

    /// A collective whose result the host reads: `f(input, output)` over `comm`, the result
    /// returned in host memory (`output` is `input` when `in_place`, as an all-reduce, else a
    /// new buffer of `out_len` elements of its type, as an all-gather). With a compute device,
    /// a stream-ordered `input` (a shard on the device) is used there, and a host `input` is
    /// copied there first when `comm` moves device buffers (the CUDA ring); the result is
    /// copied back and the host waits for it.
    ///
    /// # Errors
    /// A failing allocation, copy or collective.
    pub(crate) fn collective_to_host(
        &self,
        comm: &dyn Communicator,
        input: &Buffer,
        out_len: usize,
        in_place: bool,
        f: impl FnOnce(&Buffer, &Buffer) -> Result<Work, FsdpError>,
    ) -> Result<Buffer, FsdpError> {
        let on_device = input.stream_order().is_some() || comm.device() != Device::Cpu;
        match self.device.as_ref().filter(|_| on_device) {
            Some(dev) => {
                let t = dev.transfer_stream();
                let input = match input.stream_order() {
                    Some(_) => input.clone(),
                    None => dev.copy_from_host(input, t)?,
                };
                let output = match in_place {
                    true => input.clone(),
                    false => dev.alloc(input.dtype(), out_len, t)?,
                };
                self.wait_or_defer(f(&input, &output)?)?;
                self.host_copy(&output)
            }
            None => {
                let output = match in_place {
                    true => input.clone(),
                    false => Buffer::zeros(input.dtype(), out_len)?,
                };
                self.wait(&f(input, &output)?)?;
                Ok(output)
            }
        }
    }

    /// The sum over `comm` (if there is one) of the small device buffer `buf`, in place: one
    /// all-reduce the host does not wait for (deferred, see
    /// [`wait_or_defer`](Self::wait_or_defer)); returns a handle to it for what reads the
    /// result on the host later.
    ///
    /// # Errors
    /// A failing collective known when it is issued.
    pub(crate) fn sum_on_device(
        &self,
        comm: Option<&dyn Communicator>,
        buf: &Buffer,
    ) -> Result<Option<Work>, FsdpError> {
        let Some(comm) = comm else {
            return Ok(None);
        };
        let bytes = buf.byte_len();
        let w = self.traced(
            comm.stream(),
            SpanKind::AllReduce,
            Vec::new(),
            bytes,
            || Ok(comm.all_reduce(buf, ReduceOp::Sum)?),
        )?;
        self.wait_or_defer(w.clone())?;
        Ok(Some(w))
    }

    /// `bufs` in host memory: each itself (a handle) unless it is on the device, then a copy;
    /// the host waits once for all the copies (a host synchronisation point).
    ///
    /// # Errors
    /// A failing copy; those of [`synchronize`](Self::synchronize).
    pub(crate) fn host_copies(&self, bufs: &[&Buffer]) -> Result<Vec<Buffer>, FsdpError> {
        let mut copied = false;
        let out = bufs
            .iter()
            .map(|b| match self.device.as_ref().filter(|d| d.holds(b)) {
                Some(dev) => {
                    copied = true;
                    dev.copy_to_host(b, dev.transfer_stream())
                }
                None => Ok((*b).clone()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if copied {
            self.synchronize()?;
        }
        Ok(out)
    }

    /// One buffer of [`host_copies`](Self::host_copies).
    ///
    /// # Errors
    /// As [`host_copies`](Self::host_copies).
    pub(crate) fn host_copy(&self, b: &Buffer) -> Result<Buffer, FsdpError> {
        let mut one = self.host_copies(&[b])?;
        one.pop()
            .ok_or_else(|| internal("a host copy of one buffer gave none"))
    }

    /// The deferred collectives (a poisoned lock is taken over: the list stays valid).
    fn deferred_works(&self) -> std::sync::MutexGuard<'_, Vec<Work>> {
        self.deferred
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Drop the deferred collectives that have succeeded; the first failure is an error
    /// (never blocks).
    ///
    /// # Errors
    /// A deferred collective that failed.
    pub(crate) fn check_deferred(&self) -> Result<(), FsdpError> {
        let mut failed = None;
        self.deferred_works().retain(|w| match w.poll() {
            None => true,
            Some(Ok(())) => false,
            Some(Err(e)) => {
                failed.get_or_insert(e);
                false
            }
        });
        failed.map_or(Ok(()), |e| Err(e.into()))
    }

    /// Wait on the host for the device's streams and every deferred collective, then report
    /// their errors (a host synchronisation point: reading results on the host).
    ///
    /// # Errors
    /// A failed or timed-out collective; a device stream that failed or timed out.
    pub(crate) fn synchronize(&self) -> Result<(), FsdpError> {
        let deferred = std::mem::take(&mut *self.deferred_works());
        let mut first = None;
        for w in &deferred {
            self.host_waits.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = w.synchronize() {
                first.get_or_insert(FsdpError::from(e));
            }
        }
        if let Some(dev) = &self.device {
            self.host_waits.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = dev.synchronize() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// On a device: drop the oldest freed gathered buffers whose work on the device has
    /// completed (their memory returns to the allocator now).
    pub(crate) fn reap_freed(&mut self) {
        while self
            .freeing
            .front()
            .is_some_and(|b| b.stream_order().is_none_or(|o| o.is_idle()))
        {
            self.freeing.pop_front();
        }
    }

    /// The limiter on a device (FSDP1's rate limiter, which waits on free events): before an
    /// all-gather that the limiter counts, while the counted units gathered now and those freed
    /// but still used by the device reach the limit, wait on the host for the work of the
    /// oldest freed one and release its memory. So at most `limit_all_gathers` counted
    /// gathered buffers exist on the device, and a prefetch waits instead of gathering beyond
    /// them. (Units still gathered on the host are not waited for: the limiter skips a
    /// prefetch for them, as on the host, since only later hooks free them.)
    ///
    /// # Errors
    /// A device's work that does not complete within its compute stream's timeout.
    pub(crate) fn wait_for_frees(&mut self, counted: bool) -> Result<(), FsdpError> {
        self.reap_freed();
        let (Some(limit), Some(dev), true) =
            (self.config.limit_all_gathers, self.device.as_ref(), counted)
        else {
            return Ok(());
        };
        let timeout = dev.compute_stream().timeout();
        while self.in_flight + self.freeing.len() >= limit {
            let Some(b) = self.freeing.pop_front() else {
                break;
            };
            if let Some(order) = b.stream_order() {
                for e in order.events() {
                    e.synchronize_timeout(timeout)?;
                }
            }
            self.free_waits += 1;
            self.host_waits.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Whether buffers hold no bytes (a dry run on the meta device): the engine then moves no
    /// data and only allocates.
    pub(crate) fn is_meta(&self) -> bool {
        self.pool.device() == Device::Meta
    }

    /// An `f32` buffer allocated on `stream` and used also on `other` (recorded there with
    /// [`CrossStreamSafety::RecordStream`]).
    pub(crate) fn alloc(
        &self,
        numel: usize,
        stream: &Stream,
        other: &Stream,
    ) -> Result<Buffer, FsdpError> {
        self.alloc_typed(DType::F32, numel, stream, other)
    }

    /// A buffer of `dtype` allocated on `stream` and used also on `other` (as
    /// [`alloc`](Self::alloc)).
    pub(crate) fn alloc_typed(
        &self,
        dtype: DType,
        numel: usize,
        stream: &Stream,
        other: &Stream,
    ) -> Result<Buffer, FsdpError> {
        let also = (self.config.cross_stream == CrossStreamSafety::RecordStream).then_some(other);
        self.pool.allocate(dtype, numel, stream, also)
    }

    /// Note the allocator's current total after an allocation (for the memory breakdown of a
    /// plan: which part of the peak are unsharded parameters).
    pub(crate) fn sample_peak(&mut self) {
        let now = self.pool.memory_stats().allocated_bytes.all.current;
        if now > self.peak_sample.0 {
            self.peak_sample = (now, self.unsharded_bytes);
        }
    }

    /// An `f32` buffer on the compute stream only.
    pub(crate) fn alloc_local(&self, numel: usize) -> Result<Buffer, FsdpError> {
        self.pool.allocate(DType::F32, numel, &self.compute, None)
    }

    /// Fill `buf` with `value` (nothing on the meta device).
    pub(crate) fn fill(&self, buf: &Buffer, value: f32) -> Result<(), FsdpError> {
        if !self.is_meta() {
            buf.write::<f32>()?.fill(value);
        }
        Ok(())
    }

    /// Record a schedule event.
    pub(crate) fn record(&mut self, unit: usize, kind: ScheduleKind, prefetch: bool) {
        self.schedule.push(ScheduleEvent {
            step: self.step,
            phase: self.phase,
            unit,
            kind,
            prefetch,
            in_flight: self.in_flight,
        });
    }

    /// Next issue index.
    pub(crate) fn next_issue(&mut self) -> u64 {
        self.issued += 1;
        self.issued
    }

    /// Release the gradients held by reductions issued before collective `issued` (which the
    /// host just waited for: its stream ran them first).
    pub(crate) fn release_before(&mut self, issued: u64) {
        if issued <= self.released_before {
            return;
        }
        let from = self.released_before;
        let start = self.pending.partition_point(|p| p.issued < from);
        let end = self.pending.partition_point(|p| p.issued < issued);
        for p in &mut self.pending[start..end] {
            p.holds = None;
        }
        self.released_before = issued;
    }

    /// Issue a collective through `f`, with a communication span on `stream` when tracing.
    pub(crate) fn traced<T>(
        &self,
        stream: &Stream,
        kind: SpanKind,
        units: Vec<usize>,
        bytes: usize,
        f: impl FnOnce() -> Result<T, FsdpError>,
    ) -> Result<T, FsdpError> {
        match &self.tracer {
            Some(t) => t.comm(stream, kind, self.step, units, bytes as u64, f),
            None => f(),
        }
    }

    /// When tracing: sample the allocator counters and return the time (a compute span's
    /// begin).
    pub(crate) fn trace_begin(&self) -> f64 {
        match &self.tracer {
            Some(t) => {
                let now = now_us();
                self.trace_counter(t, now);
                now
            }
            None => 0.0,
        }
    }

    fn trace_counter(&self, t: &Tracer, time_us: f64) {
        let st = self.pool.memory_stats();
        t.push(TraceEvent::Counter {
            time_us,
            allocated: st.allocated_bytes.all.current,
            reserved: st.reserved_bytes.all.current,
        });
    }

    /// When tracing: record a compute span named `name` over `units`, begun at `begin_us`.
    pub(crate) fn trace_end(&self, kind: SpanKind, name: &str, units: &[usize], begin_us: f64) {
        if let Some(t) = &self.tracer {
            let end_us = now_us();
            t.push(TraceEvent::Span {
                kind,
                name: format!("{} {name}", kind.as_str()),
                step: self.step,
                units: units.to_vec(),
                begin_us,
                end_us,
                bytes: None,
            });
            self.trace_counter(t, end_us);
        }
    }
}

/// The error of an engine state that should be impossible.
pub(crate) fn internal(reason: &str) -> FsdpError {
    FsdpError::InvalidFsdpConfig {
        reason: format!("internal engine state: {reason}"),
    }
}
