//! What every backend does when a collective is issued: the argument checks, and enqueueing the
//! task under the next sequence number, ordered by the stream-ordered buffers it uses
//! ([`enqueue_collective`]).
//!
//! The argument checks run on the issuing rank before anything is
//! enqueued and give either the buffer accesses the collective needs — tickets taken now, in
//! program order, so that the stream task runs after earlier work on the same buffers — or the
//! reason the call is invalid (which the backends still post, so that peers fail at once).
//!
//! The rules are NCCL's: one element type per call, `output = world × input` for all-gather
//! base and `input = world × output` for reduce-scatter base, buffers may overlap only in the
//! in-place forms (all-gather input = this rank's block of the output, reduce-scatter output =
//! this rank's chunk of the input), roots below the world size.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fsdp_device::{
    AccessGuard, AccessMode, AccessTicket, Buffer, DType, Device, Stream, StreamOrder,
};

use crate::{CollectiveError, Work};

/// Why a call is invalid, for [`CollectiveError::InvalidArgument`](crate::CollectiveError).
pub(crate) type Check<T> = std::result::Result<T, String>;

/// The buffers a collective touches, checked out in program order at issue time.
pub(crate) struct Access {
    pub(crate) tickets: Vec<AccessTicket>,
    /// Whether the call is in place (all-gather / reduce-scatter base with overlapping buffers).
    pub(crate) in_place: bool,
}

/// The [`StreamOrder`]s of the stream-ordered buffers among `tickets`' buffers, each with the
/// mode of its use ([`Access::stream_orders`]; NCCL's launch orders them on the GPU).
pub(crate) fn stream_orders(tickets: &[AccessTicket]) -> Vec<(Arc<StreamOrder>, AccessMode)> {
    tickets
        .iter()
        .filter_map(|t| t.buffer().stream_order().map(|o| (o, t.mode())))
        .collect()
}

impl Access {
    fn new(tickets: Vec<AccessTicket>) -> Access {
        Access {
            tickets,
            in_place: false,
        }
    }

    /// No buffers (barrier, split).
    pub(crate) fn none() -> Access {
        Access::new(Vec::new())
    }

    /// The [`StreamOrder`]s of the stream-ordered buffers among the tickets' (memory that work
    /// uses through [`Buffer::use_on`]), each with the mode of its use: a backend that runs
    /// the collective as a task of its stream orders that task after their conflicting work
    /// ([`StreamOrder::before_read`]/[`before_write`](StreamOrder::before_write) on the
    /// stream, before it enqueues the task) and records the use after it.
    pub(crate) fn stream_orders(&self) -> Vec<(Arc<StreamOrder>, AccessMode)> {
        stream_orders(&self.tickets)
    }

    /// Wait for every ticket, all within `timeout`.
    pub(crate) fn acquire(self, timeout: Duration) -> Check<Vec<AccessGuard>> {
        let deadline = Instant::now() + timeout;
        let mut guards = Vec::with_capacity(self.tickets.len());
        for t in self.tickets {
            let left = deadline.saturating_duration_since(Instant::now());
            guards.push(t.acquire(left).map_err(|e| e.to_string())?);
        }
        Ok(guards)
    }
}

/// Where a backend's buffers must live, and its name for the messages.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Placement {
    backend: &'static str,
    /// The one device the buffers must be on; `None`: any device (the dry run, which never
    /// touches their memory).
    device: Option<Device>,
}

impl Placement {
    /// The checks of a backend whose buffers must all be on `device`.
    pub(crate) const fn on(backend: &'static str, device: Device) -> Placement {
        Placement {
            backend,
            device: Some(device),
        }
    }

    /// The same checks without the device's: for a backend that accepts buffers on any device
    /// (including [`Device::Meta`]), because it never touches their memory.
    pub(crate) const fn any_device(backend: &'static str) -> Placement {
        Placement {
            backend,
            device: None,
        }
    }

    /// Every buffer on this placement's device (if it has one), all of one element type
    /// (returned).
    pub(crate) fn buffers(self, bufs: &[&Buffer]) -> Check<DType> {
        let dtype = bufs.first().map_or(DType::F32, |b| b.dtype());
        for b in bufs {
            if let Some(device) = self.device.filter(|&d| b.device() != d) {
                let wanted = match device {
                    Device::Cpu => "host buffers".to_string(),
                    d => format!("buffers on {d}"),
                };
                return Err(format!(
                    "the {} backend works on {wanted}, got a buffer on {}",
                    self.backend,
                    b.device()
                ));
            }
            if b.dtype() != dtype {
                return Err(format!(
                    "buffers of different element types ({} and {})",
                    dtype,
                    b.dtype()
                ));
            }
        }
        Ok(dtype)
    }

    /// `all_gather_base(input, output)` on `rank` of `world`.
    pub(crate) fn all_gather_base(
        self,
        rank: usize,
        world: usize,
        input: &Buffer,
        output: &Buffer,
    ) -> Check<Access> {
        self.buffers(&[input, output])?;
        let n = input.len();
        if Some(output.len()) != n.checked_mul(world) {
            return Err(format!(
                "output has {} elements, expected world size {world} x input {n} = {}",
                output.len(),
                n.saturating_mul(world)
            ));
        }
        if input.overlaps(output) {
            let own_block = output
                .slice(rank * n..(rank + 1) * n)
                .map_err(|e| e.to_string())?;
            if input.byte_range() != own_block.byte_range() || !input.same_storage(output) {
                return Err("input overlaps output other than as this rank's block".into());
            }
            return Ok(Access {
                tickets: vec![output.access(AccessMode::Exclusive)],
                in_place: true,
            });
        }
        Ok(Access::new(vec![
            input.access(AccessMode::Shared),
            output.access(AccessMode::Exclusive),
        ]))
    }

    /// `reduce_scatter_base(input, output, _)` on `rank` of `world`.
    pub(crate) fn reduce_scatter_base(
        self,
        rank: usize,
        world: usize,
        input: &Buffer,
        output: &Buffer,
    ) -> Check<Access> {
        self.buffers(&[input, output])?;
        let n = output.len();
        if Some(input.len()) != n.checked_mul(world) {
            return Err(format!(
                "input has {} elements, expected world size {world} x output {n} = {}",
                input.len(),
                n.saturating_mul(world)
            ));
        }
        if input.overlaps(output) {
            let own = input
                .slice(rank * n..(rank + 1) * n)
                .map_err(|e| e.to_string())?;
            if own.byte_range() != output.byte_range() || !input.same_storage(output) {
                return Err("output overlaps input other than as this rank's chunk".into());
            }
            return Ok(Access {
                tickets: vec![input.access(AccessMode::Exclusive)],
                in_place: true,
            });
        }
        Ok(Access::new(vec![
            input.access(AccessMode::Shared),
            output.access(AccessMode::Exclusive),
        ]))
    }

    /// `all_reduce(buf, _)`: the buffer is read and written.
    pub(crate) fn all_reduce(self, buf: &Buffer) -> Check<Access> {
        self.buffers(&[buf])?;
        Ok(Access::new(vec![buf.access(AccessMode::Exclusive)]))
    }

    /// `broadcast(buf, root)`: the root only reads its buffer, the others write theirs.
    pub(crate) fn broadcast(
        self,
        rank: usize,
        world: usize,
        buf: &Buffer,
        root: usize,
    ) -> Check<Access> {
        self.buffers(&[buf])?;
        check_root(root, world)?;
        let mode = if rank == root {
            AccessMode::Shared
        } else {
            AccessMode::Exclusive
        };
        Ok(Access::new(vec![buf.access(mode)]))
    }

    /// `reduce(buf, _, root)`: the root writes its buffer, the others only read theirs.
    pub(crate) fn reduce(
        self,
        rank: usize,
        world: usize,
        buf: &Buffer,
        root: usize,
    ) -> Check<Access> {
        self.buffers(&[buf])?;
        check_root(root, world)?;
        let mode = if rank == root {
            AccessMode::Exclusive
        } else {
            AccessMode::Shared
        };
        Ok(Access::new(vec![buf.access(mode)]))
    }

    /// The unequal `all_gather(input, outputs)`: one output per rank, this rank's of the input's
    /// length, no overlaps. Tickets: the input, then the outputs in rank order.
    pub(crate) fn all_gather(
        self,
        rank: usize,
        world: usize,
        input: &Buffer,
        outputs: &[Buffer],
    ) -> Check<Access> {
        if outputs.len() != world {
            return Err(format!(
                "{} output buffers given, expected one per rank ({world})",
                outputs.len()
            ));
        }
        let mut all: Vec<&Buffer> = vec![input];
        all.extend(outputs.iter());
        self.buffers(&all)?;
        if outputs[rank].len() != input.len() {
            return Err(format!(
                "outputs[{rank}] has {} elements but this rank's input has {}",
                outputs[rank].len(),
                input.len()
            ));
        }
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                if a.overlaps(b) {
                    return Err("input and output buffers must not overlap".into());
                }
            }
        }
        let mut tickets = vec![input.access(AccessMode::Shared)];
        tickets.extend(outputs.iter().map(|o| o.access(AccessMode::Exclusive)));
        Ok(Access::new(tickets))
    }
}

/// Enqueue `task` on `stream` under the next sequence number of `next_seq` (taken, and passed
/// to the task, only if the enqueue succeeds) with the collective's buffer `access`, and return
/// its [`Work`]. Holding the counter's lock across the enqueue keeps sequence numbers in stream
/// order when several threads issue. Stream-ordered buffers among the access's
/// ([`Access::stream_orders`]): the stream first waits for the work that conflicts with the
/// task, and the task is recorded as their newest use (module docs of `fsdp_device::order`).
pub(crate) fn enqueue_collective(
    stream: &Stream,
    next_seq: &Mutex<u64>,
    rank: usize,
    op: &'static str,
    timeout: Duration,
    access: Option<Access>,
    task: impl FnOnce(u64, Option<Access>) -> crate::Result<()> + Send + 'static,
) -> crate::Result<Work> {
    let orders = access
        .as_ref()
        .map(Access::stream_orders)
        .unwrap_or_default();
    for (order, mode) in &orders {
        order
            .before(stream, *mode)
            .map_err(|source| CollectiveError::Device { rank, source })?;
    }
    let mut next = next_seq.lock().unwrap_or_else(|e| e.into_inner());
    let seq = *next;
    let (completer, make_work) = Work::pending(op, rank, timeout);
    let on = stream.clone();
    stream
        .enqueue(move || {
            // A wait before it failed (a writer's event not reached within the timeout, say):
            // the buffers are not known to be ready, so the collective does not run.
            let r = match on.error() {
                Some(source) => Err(CollectiveError::Device { rank, source }),
                None => task(seq, access),
            };
            completer.complete(r);
        })
        .map_err(|source| CollectiveError::Device { rank, source })?;
    *next += 1;
    let work = make_work(stream.record_event());
    drop(next);
    for (order, mode) in orders {
        order.after(stream, mode);
    }
    Ok(work)
}

/// A root below the world size.
pub(crate) fn check_root(root: usize, world: usize) -> Check<()> {
    if root >= world {
        return Err(format!("root {root} >= world size {world}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: Placement = Placement::on("test", Device::Cpu);
    const ANY: Placement = Placement::any_device("dryrun");

    #[test]
    fn all_gather_base_sizes_and_in_place() {
        let out = Buffer::zeros(DType::F32, 6).unwrap();
        let inp = Buffer::zeros(DType::F32, 2).unwrap();
        let a = HOST.all_gather_base(1, 3, &inp, &out).unwrap();
        assert_eq!((a.tickets.len(), a.in_place), (2, false));
        let own = out.slice(2..4).unwrap();
        let a = HOST.all_gather_base(1, 3, &own, &out).unwrap();
        assert_eq!((a.tickets.len(), a.in_place), (1, true));
        let wrong_block = out.slice(0..2).unwrap();
        let e = HOST
            .all_gather_base(1, 3, &wrong_block, &out)
            .err()
            .unwrap();
        assert!(e.contains("other than as this rank's block"), "{e}");
        let e = HOST.all_gather_base(0, 2, &inp, &out).err().unwrap();
        assert!(
            e.contains("output has 6 elements, expected world size 2 x input 2 = 4"),
            "{e}"
        );
        let half = Buffer::zeros(DType::BF16, 2).unwrap();
        let e = HOST.all_gather_base(0, 3, &half, &out).err().unwrap();
        assert!(e.contains("different element types"), "{e}");
    }

    #[test]
    fn reduce_scatter_base_sizes_and_in_place() {
        let inp = Buffer::zeros(DType::F64, 8).unwrap();
        let out = Buffer::zeros(DType::F64, 2).unwrap();
        assert!(!HOST.reduce_scatter_base(3, 4, &inp, &out).unwrap().in_place);
        let own = inp.slice(6..8).unwrap();
        assert!(HOST.reduce_scatter_base(3, 4, &inp, &own).unwrap().in_place);
        let other = inp.slice(0..2).unwrap();
        let e = HOST.reduce_scatter_base(3, 4, &inp, &other).err().unwrap();
        assert!(e.contains("other than as this rank's chunk"), "{e}");
        let e = HOST.reduce_scatter_base(0, 3, &inp, &out).err().unwrap();
        assert!(
            e.contains("input has 8 elements, expected world size 3 x output 2 = 6"),
            "{e}"
        );
    }

    #[test]
    fn roots_devices_and_unequal_outputs() {
        let b = Buffer::zeros(DType::F32, 3).unwrap();
        assert!(HOST
            .broadcast(0, 2, &b, 2)
            .err()
            .unwrap()
            .contains("root 2 >= world size 2"));
        assert!(HOST.reduce(1, 2, &b, 1).is_ok());
        let gpu = Placement::on("nccl", Device::Cuda(0));
        let e = gpu.all_reduce(&b).err().unwrap();
        assert_eq!(
            e,
            "the nccl backend works on buffers on cuda:0, got a buffer on cpu"
        );
        let outs = [
            Buffer::zeros(DType::F32, 1).unwrap(),
            Buffer::zeros(DType::F32, 3).unwrap(),
        ];
        assert_eq!(HOST.all_gather(1, 2, &b, &outs).unwrap().tickets.len(), 3);
        let e = HOST.all_gather(0, 2, &b, &outs).err().unwrap();
        assert!(
            e.contains("outputs[0] has 1 elements but this rank's input has 3"),
            "{e}"
        );
        let e = HOST.all_gather(0, 3, &b, &outs).err().unwrap();
        assert!(
            e.contains("2 output buffers given, expected one per rank (3)"),
            "{e}"
        );
    }

    #[test]
    fn any_device_skips_only_the_device_check() {
        let meta = |n| Buffer::meta(DType::F32, n).unwrap();
        let e = HOST.all_reduce(&meta(3)).err().unwrap();
        assert_eq!(
            e,
            "the test backend works on host buffers, got a buffer on meta"
        );
        // Meta, host and mixed buffers pass...
        assert!(ANY.all_reduce(&meta(3)).is_ok());
        assert!(ANY.all_gather_base(1, 3, &meta(2), &meta(6)).is_ok());
        let host_in = Buffer::zeros(DType::F32, 2).unwrap();
        assert!(ANY.all_gather_base(1, 3, &host_in, &meta(6)).is_ok());
        let out = meta(6);
        let own = out.slice(2..4).unwrap();
        assert!(ANY.all_gather_base(1, 3, &own, &out).unwrap().in_place);
        // ...and every other rule still holds.
        for (any, host) in [
            (
                ANY.all_gather_base(0, 2, &meta(2), &meta(6)),
                HOST.all_gather_base(0, 2, &host_in, &Buffer::zeros(DType::F32, 6).unwrap()),
            ),
            (
                ANY.reduce_scatter_base(0, 3, &meta(8), &meta(2)),
                HOST.reduce_scatter_base(
                    0,
                    3,
                    &Buffer::zeros(DType::F32, 8).unwrap(),
                    &Buffer::zeros(DType::F32, 2).unwrap(),
                ),
            ),
            (
                ANY.broadcast(0, 2, &meta(1), 2),
                HOST.broadcast(0, 2, &host_in, 2),
            ),
        ] {
            assert_eq!(any.err().unwrap(), host.err().unwrap());
        }
        let e = ANY
            .all_gather_base(1, 3, &out.slice(0..2).unwrap(), &out)
            .err()
            .unwrap();
        assert!(e.contains("other than as this rank's block"), "{e}");
        let e = ANY
            .buffers(&[&meta(2), &Buffer::meta(DType::BF16, 2).unwrap()])
            .err()
            .unwrap();
        assert!(
            e.contains("different element types (float32 and bfloat16)"),
            "{e}"
        );
    }
}
