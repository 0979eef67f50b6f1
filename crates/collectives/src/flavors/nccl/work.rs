//! The outstanding collectives of a communicator: each one's end event (recorded on the NCCL
//! stream after its launch, from the device's event pool), the buffers it holds until that
//! event completed, and the completer of its [`Work`].

use std::time::{Duration, Instant};

use fsdp_device::{Buffer, Event, Stream};

use crate::work::WorkCompleter;
use crate::{CollectiveError, Result, Work};

/// One launched collective the watchdog watches.
pub(crate) struct Pending {
    pub(crate) op: &'static str,
    pub(crate) seq: u64,
    /// Recorded on the NCCL stream right after the launch.
    pub(crate) end: Event,
    /// When the collective counts as hung: launch time plus the collective timeout.
    pub(crate) deadline: Instant,
    /// Clones of the buffers the collective reads or writes: their memory (and the allocator
    /// block under it) cannot be freed or reused before the end event completed.
    buffers: Vec<Buffer>,
    completer: WorkCompleter,
}

impl Pending {
    /// A launched collective and the [`Work`] handed to the caller: `wait` makes `current` (the
    /// caller's stream) wait for `end` on the device; `synchronize` blocks the host until the
    /// watchdog published the result.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        op: &'static str,
        rank: usize,
        seq: u64,
        end: Event,
        timeout: Duration,
        buffers: Vec<Buffer>,
        current: &Stream,
    ) -> (Pending, Work) {
        let (completer, make) = Work::pending(op, rank, timeout);
        let work = make(end.clone()).with_stream_wait(current.clone());
        let pending = Pending {
            op,
            seq,
            end,
            deadline: Instant::now() + timeout,
            buffers,
            completer,
        };
        (pending, work)
    }

    /// Whether the collective has finished on the GPU (or its stream failed).
    pub(crate) fn done(&self) -> bool {
        self.end.query()
    }

    /// Complete the work with `result` and release the buffers.
    pub(crate) fn finish(self, result: Result<()>) {
        self.completer.complete(result);
        drop(self.buffers);
    }

    /// After an abort: complete the work with `error`, then release the buffers once the end
    /// event completed (the abort stops NCCL's kernels), or leak them after `grace` so that no
    /// memory NCCL may still touch is reused.
    pub(crate) fn fail(self, error: CollectiveError, grace: Duration) {
        self.completer.complete(Err(error));
        let stopped = self.end.synchronize_timeout(grace);
        if stopped.is_err() {
            tracing::error!(
                op = self.op,
                seq = self.seq,
                "NCCL work did not stop after abort; leaking its buffers"
            );
            std::mem::forget(self.buffers);
        }
    }
}
