//! The conformance suite ([`support::cases`]) on NCCL: three ranks as threads on GPU 0 (NCCL >=
//! 2.30, `NCCL_MULTI_RANK_GPU_ENABLE=1`, in a child process so that the variable is set before
//! NCCL reads it). The suite's cases build host buffers; each rank runs them through
//! [`Staged`], a communicator that uploads the host buffers into device buffers of the caching
//! allocator, runs the NCCL collective on them, waits for it and downloads the results (in-place
//! calls stay in place on the device). NCCL's reductions are not the ring's bitwise, so
//! `bitwise_ring` is off. `Avg` runs as NCCL's `Sum` (exact on the suite's small integers)
//! divided by the world size on the host in the element type, as the suite's reference does:
//! NCCL's own `ncclAvg` pre-multiplies each input by 1/n, which rounds differently over three
//! ranks (`tests/nccl.rs` checks `ncclAvg` within a bound). The timeout case runs on a fresh
//! group. Prints `skipped: <reason>`
//! without a GPU, NCCL or NCCL >= 2.30.
#![cfg(feature = "nccl")]

mod nccl_common;
mod support;

use std::time::Duration;

use fsdp_allocator::cuda::CudaAllocator;
use fsdp_collectives::nccl::{NcclCommunicator, UniqueId};
use fsdp_collectives::{Communicator, ReduceOp, Result, Work};
use fsdp_device::{with_element, Buffer, Stream};
use nccl_common::{allocator, opts, skip_reason_shared_gpu, spawn_self, ROLE};
use support::cases::{suite, timeout_case, Expect, WORLD};

/// An NCCL communicator that takes host buffers (see the module docs).
struct Staged {
    comm: NcclCommunicator,
    alloc: CudaAllocator,
}

impl Staged {
    fn new(comm: NcclCommunicator) -> Staged {
        Staged {
            comm,
            alloc: allocator(),
        }
    }

    /// A device copy of the host buffer `host`.
    fn upload(&self, host: &Buffer) -> Result<Buffer> {
        let dev = self
            .alloc
            .allocate_buffer(host.dtype(), host.len(), self.comm.cuda_stream())
            .map_err(|e| fsdp_collectives::CollectiveError::InvalidArgument {
                rank: self.comm.rank(),
                op: "allocate",
                reason: e.to_string(),
            })?;
        with_element!(host.dtype(), T => {
            self.comm.copy_from_host(&dev, &host.to_vec::<T>().unwrap())?;
        });
        Ok(dev)
    }

    /// Copy `dev` back into the host buffer `host`; for `Avg` (run as `Sum`, see the module
    /// docs) divide by the world size in the element type.
    fn download_reduced(&self, dev: &Buffer, host: &Buffer, op: ReduceOp) -> Result<()> {
        let world = self.comm.world_size();
        with_element!(host.dtype(), T => {
            let mut v = self.comm.copy_to_host::<T>(dev)?;
            if op == ReduceOp::Avg {
                v.iter_mut().for_each(|x| *x = ReduceOp::Avg.finish(*x, world));
            }
            host.copy_from_slice(&v).unwrap();
        });
        Ok(())
    }

    /// Copy `dev` back into the host buffer `host`.
    fn download(&self, dev: &Buffer, host: &Buffer) -> Result<()> {
        self.download_reduced(dev, host, ReduceOp::Sum)
    }

    /// The op NCCL runs for `op`.
    fn nccl_op(op: ReduceOp) -> ReduceOp {
        if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        }
    }

    /// The device buffer standing for `inner`, a sub-range of the host buffer `outer` whose
    /// device copy is `dev` (in-place calls); `None` when `inner` is not inside `outer`.
    fn inner(outer: &Buffer, dev: &Buffer, inner: &Buffer) -> Option<Buffer> {
        if !inner.same_storage(outer) || !inner.overlaps(outer) {
            return None;
        }
        let esz = outer.dtype().size_in_bytes();
        let (o, i) = (outer.byte_range(), inner.byte_range());
        if i.start < o.start || i.end > o.end {
            return None;
        }
        let start = (i.start - o.start) / esz;
        dev.slice(start..start + inner.len()).ok()
    }

    /// Wait for the work on the host; the caller downloads the results.
    fn finish(&self, work: Result<Work>) -> Result<Work> {
        work?.synchronize()?;
        Ok(Work::completed("staged", self.comm.rank()))
    }
}

impl Communicator for Staged {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn stream(&self) -> &Stream {
        self.comm.stream()
    }

    fn all_gather_base(&self, input: &Buffer, output: &Buffer) -> Result<Work> {
        let out = self.upload(output)?;
        let inp = match Self::inner(output, &out, input) {
            Some(i) => i,
            None => self.upload(input)?,
        };
        let w = self.finish(self.comm.all_gather_base(&inp, &out))?;
        self.download(&out, output)?;
        Ok(w)
    }

    fn reduce_scatter_base(&self, input: &Buffer, output: &Buffer, op: ReduceOp) -> Result<Work> {
        let inp = self.upload(input)?;
        let out = match Self::inner(input, &inp, output) {
            Some(o) => o,
            None => self.upload(output)?,
        };
        let w = self.finish(self.comm.reduce_scatter_base(&inp, &out, Self::nccl_op(op)))?;
        self.download_reduced(&out, output, op)?;
        Ok(w)
    }

    fn all_reduce(&self, buf: &Buffer, op: ReduceOp) -> Result<Work> {
        let dev = self.upload(buf)?;
        let w = self.finish(self.comm.all_reduce(&dev, Self::nccl_op(op)))?;
        self.download_reduced(&dev, buf, op)?;
        Ok(w)
    }

    fn broadcast(&self, buf: &Buffer, root: usize) -> Result<Work> {
        let dev = self.upload(buf)?;
        let w = self.finish(self.comm.broadcast(&dev, root))?;
        self.download(&dev, buf)?;
        Ok(w)
    }

    fn reduce(&self, buf: &Buffer, op: ReduceOp, root: usize) -> Result<Work> {
        let dev = self.upload(buf)?;
        let w = self.finish(self.comm.reduce(&dev, Self::nccl_op(op), root))?;
        if self.comm.rank() == root {
            self.download_reduced(&dev, buf, op)?;
        }
        Ok(w)
    }

    fn barrier(&self) -> Result<Work> {
        self.finish(self.comm.barrier())
    }

    fn all_gather(&self, input: &Buffer, outputs: &[Buffer]) -> Result<Work> {
        let inp = self.upload(input)?;
        let outs = outputs
            .iter()
            .map(|o| self.upload(o))
            .collect::<Result<Vec<_>>>()?;
        let w = self.finish(self.comm.all_gather(&inp, &outs))?;
        for (d, h) in outs.iter().zip(outputs) {
            self.download(d, h)?;
        }
        Ok(w)
    }

    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Box<dyn Communicator>>> {
        Ok(self
            .comm
            .split_nccl(color, key)?
            .map(|c| Box::new(Staged::new(c)) as Box<dyn Communicator>))
    }
}

#[test]
fn nccl_threads_on_one_gpu() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    if let Some(why) = skip_reason_shared_gpu() {
        println!("skipped: {why}");
        return;
    }
    let (ok, out) = spawn_self("conformance_child", "conformance").wait(Duration::from_secs(600));
    println!("{out}");
    assert!(ok, "child failed:\n{out}");
    assert!(out.contains("nccl-conformance ok"), "{out}");
}

/// The body of `nccl_threads_on_one_gpu`, in a child process with
/// `NCCL_MULTI_RANK_GPU_ENABLE=1`; does nothing when run directly.
#[test]
fn conformance_child() {
    if std::env::var(ROLE).as_deref() != Ok("conformance") {
        return;
    }
    let expect = Expect {
        bitwise_ring: false,
    };
    let id = UniqueId::new().unwrap();
    std::thread::scope(|s| {
        for r in 0..WORLD {
            let expect = &expect;
            s.spawn(move || {
                let comm = NcclCommunicator::from_unique_id(&id, r, WORLD, 0, opts()).unwrap();
                suite(&Staged::new(comm), expect);
            });
        }
    });
    let short = Duration::from_secs(2);
    let id = UniqueId::new().unwrap();
    std::thread::scope(|s| {
        for r in 0..WORLD {
            s.spawn(move || {
                let o = opts().with_timeout(short);
                let comm = NcclCommunicator::from_unique_id(&id, r, WORLD, 0, o).unwrap();
                timeout_case(&Staged::new(comm), short);
            });
        }
    });
    println!("nccl-conformance ok");
}
