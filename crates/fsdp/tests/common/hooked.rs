//! A ring communicator with hooks, for the engine's error tests on a device (`device_engine`,
//! `device_steady_state` include this file with `#[path]`): it may say that it does not order
//! stream-ordered buffers (as a backend that does not), and it may fail one of its all-gathers or all-reduces
//! without taking part, so that its peers' collective times out.

use std::sync::atomic::{AtomicUsize, Ordering};

use fsdp_collectives::{ring, CollectiveError, Communicator, ReduceOp, Result, Work};
use fsdp_device::{Buffer, Stream};

/// `inner` with hooks.
pub struct Hooked {
    pub inner: ring::RingCommunicator,
    /// What [`Communicator::orders_stream_ordered_buffers`] answers.
    pub ordered: bool,
    /// Fail this all-gather (counted from 0) without calling `inner`.
    pub fail_all_gather: Option<usize>,
    pub all_gathers: AtomicUsize,
    /// Fail this all-reduce (counted from 0) without calling `inner`.
    pub fail_all_reduce: Option<usize>,
    pub all_reduces: AtomicUsize,
}

impl Hooked {
    /// `inner` unchanged but for the hooks given after.
    pub fn new(inner: ring::RingCommunicator) -> Self {
        Hooked {
            inner,
            ordered: true,
            fail_all_gather: None,
            all_gathers: AtomicUsize::new(0),
            fail_all_reduce: None,
            all_reduces: AtomicUsize::new(0),
        }
    }
}

impl Hooked {
    /// The error of a collective failed on purpose.
    fn failed(&self, op: &'static str, what: String) -> CollectiveError {
        CollectiveError::Backend {
            rank: self.rank(),
            backend: "hooked",
            op,
            reason: format!("{what} failed on purpose"),
        }
    }
}

impl Communicator for Hooked {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn stream(&self) -> &Stream {
        self.inner.stream()
    }
    fn orders_stream_ordered_buffers(&self) -> bool {
        self.ordered
    }
    fn all_gather_base(&self, i: &Buffer, o: &Buffer) -> Result<Work> {
        let n = self.all_gathers.fetch_add(1, Ordering::SeqCst);
        if self.fail_all_gather == Some(n) {
            return Err(self.failed("all_gather_base", format!("all-gather {n}")));
        }
        self.inner.all_gather_base(i, o)
    }
    fn reduce_scatter_base(&self, i: &Buffer, o: &Buffer, op: ReduceOp) -> Result<Work> {
        self.inner.reduce_scatter_base(i, o, op)
    }
    fn all_reduce(&self, b: &Buffer, op: ReduceOp) -> Result<Work> {
        let n = self.all_reduces.fetch_add(1, Ordering::SeqCst);
        if self.fail_all_reduce == Some(n) {
            return Err(self.failed("all_reduce", format!("all-reduce {n}")));
        }
        self.inner.all_reduce(b, op)
    }
    fn broadcast(&self, b: &Buffer, root: usize) -> Result<Work> {
        self.inner.broadcast(b, root)
    }
    fn reduce(&self, b: &Buffer, op: ReduceOp, root: usize) -> Result<Work> {
        self.inner.reduce(b, op, root)
    }
    fn barrier(&self) -> Result<Work> {
        self.inner.barrier()
    }
    fn all_gather(&self, i: &Buffer, o: &[Buffer]) -> Result<Work> {
        self.inner.all_gather(i, o)
    }
    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Box<dyn Communicator>>> {
        self.inner.split(color, key)
    }
}
