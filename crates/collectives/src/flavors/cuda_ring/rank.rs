//! One rank's executor: it enqueues the steps of a [`schedule`](crate::flavors::engine::schedule)
//! on the rank's CUDA stream as device-to-device copies and reduction kernels.
//!
//! Data moves by *pulling*, as in the host thread ring: a rank publishes the device address of a
//! ready segment (in its input, its output or one of its scratch slots) with a CUDA event
//! recorded after the segment was written; the successor's stream waits for that event
//! (GPU-side), then copies — or reduces — the segment into memory the successor owns, records a
//! *consumed* event and sends it back. A rank writes only its own memory.
//!
//! Ordering rules (what makes the device accesses race-free):
//! 1. A published segment is not written again before the successor's consumed event: inputs
//!    are never written; an output block or a slot is written once before it is published; a
//!    scratch slot is reused only after this rank's stream waited for the consumed event of its
//!    previous use.
//! 2. At the end of a collective the rank's stream waits for the consumed events of everything
//!    it published, then records the end event; the collective's buffers are released (and its
//!    `Work` completes) only once the end event completed, so no peer reads them afterwards.
//! 3. After a failure a rank synchronises its stream (so it no longer reads its predecessor's
//!    memory), tells the predecessor, and waits for the successor to say the same; otherwise
//!    its buffers are leaked rather than freed under a reader.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, CudaSlice, CudaStream, DevicePtr};
use fsdp_device::{DType, DeviceError, Event, Stream};
use fsdp_kernels::host::ReduceKind;

use super::links::{recv_bounded, Ack, Links, Msg};
use crate::flavors::engine::schedule::Step;
use crate::flavors::engine::{Control, DataError};
use crate::ReduceOp;

/// Where the steps of one collective read and write, as device addresses. `chunk(c)` is the
/// start of chunk `c` of the buffer the schedule's chunks index.
pub(crate) struct Layout<'a> {
    /// This rank's own data of chunk `c` (what `Send` and `RecvReduce` read).
    pub own: &'a dyn Fn(usize) -> u64,
    /// Where chunk `c` is written (`RecvCopy`; `CopyOwn` writes chunk `rank`'s place).
    pub out: &'a dyn Fn(usize) -> u64,
    /// Where this rank's final reduction lands, at the chunk's offset.
    pub result: u64,
    pub dtype: DType,
    pub op: ReduceOp,
}

/// One rank's stream, scratch and links.
pub(crate) struct Rank {
    pub rank: usize,
    pub world: usize,
    pub stream: Stream,
    control: Arc<dyn Control>,
    links: Links,
    /// `slots` scratch slots of `slot_bytes` each (empty for groups of one or two).
    scratch: Option<CudaSlice<u8>>,
    slot_bytes: usize,
    /// Per slot: the consumed event of its last use, not yet waited for.
    slot_consumed: Vec<Option<Event>>,
    free_slots: usize,
    next_slot: usize,
    /// For each published, unanswered segment: the slot it occupies.
    outstanding: VecDeque<Option<usize>>,
    /// The successor said it gave up on the collective under way (it says so once: whoever
    /// receives it, `answer` or `release`, records it here).
    next_released: bool,
    seq: u64,
    deadline: Instant,
}

fn device(op: &'static str, e: impl std::fmt::Debug) -> DataError {
    DataError::Protocol {
        reason: format!("{op} failed: {e:?}"),
    }
}

fn device_error(e: DeviceError) -> DataError {
    DataError::Protocol {
        reason: e.to_string(),
    }
}

impl Rank {
    /// Rank `rank` of `world` on `stream`, with `slots` scratch slots of `slot_bytes` for the
    /// partial reductions it forwards.
    pub fn new(
        (rank, world): (usize, usize),
        stream: Stream,
        control: Arc<dyn Control>,
        links: Links,
        (slots, slot_bytes): (usize, usize),
    ) -> Result<Rank, DeviceError> {
        let slot_bytes = slot_bytes.next_multiple_of(8);
        let scratch = if world > 2 {
            let cu = stream.cuda_stream().ok_or_else(|| {
                DeviceError::InvalidArgument("the CUDA ring needs a CUDA stream".into())
            })?;
            let s = cu.alloc_zeros::<u8>(slots * slot_bytes).map_err(|e| {
                DeviceError::InvalidArgument(format!(
                    "rank {rank}: allocating {} bytes of ring scratch: {e:?}",
                    slots * slot_bytes
                ))
            })?;
            Some(s)
        } else {
            None
        };
        Ok(Rank {
            rank,
            world,
            stream,
            control,
            links,
            scratch,
            slot_bytes,
            slot_consumed: vec![None; slots],
            free_slots: slots,
            next_slot: 0,
            outstanding: VecDeque::new(),
            next_released: false,
            seq: 0,
            deadline: Instant::now(),
        })
    }

    fn cu(&self) -> &Arc<CudaStream> {
        self.stream.cuda_stream().expect("checked at construction")
    }

    /// The sequence number of the collective under way.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The deadline of the collective under way.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Start collective `seq`, bounded by `deadline`.
    pub fn begin(&mut self, seq: u64, deadline: Instant) {
        self.seq = seq;
        self.deadline = deadline;
        self.outstanding.clear();
        self.next_released = false;
    }

    /// Enqueue `steps` on this rank's stream, then the wait for the successor's consumption and
    /// the end event; return the end event. Host waits are for peers' enqueues only.
    pub fn run(
        &mut self,
        steps: impl Iterator<Item = Step>,
        at: &Layout<'_>,
    ) -> Result<Event, DataError> {
        self.cu()
            .context()
            .bind_to_thread()
            .map_err(|e| device("cuCtxSetCurrent", e))?;
        let esz = at.dtype.size_in_bytes() as u64;
        for step in steps {
            match step {
                Step::Send { chunk, off, len } => {
                    let ready = self.stream.record_event();
                    self.publish(
                        (at.own)(chunk) + off as u64 * esz,
                        len,
                        at.dtype,
                        ready,
                        None,
                    )?;
                }
                Step::CopyOwn { off, len } => {
                    let (src, dst) = (
                        (at.own)(self.rank) + off as u64 * esz,
                        (at.out)(self.rank) + off as u64 * esz,
                    );
                    if src != dst {
                        self.copy(dst, src, len as u64 * esz)?;
                    }
                }
                Step::RecvCopy {
                    chunk,
                    off,
                    len,
                    forward,
                } => {
                    let dst = (at.out)(chunk) + off as u64 * esz;
                    let msg = self.receive(len as u64 * esz)?;
                    self.copy(dst, msg.ptr, len as u64 * esz)?;
                    let done = self.consumed()?;
                    if forward {
                        self.publish(dst, len, at.dtype, done, None)?;
                    }
                }
                Step::RecvReduce {
                    chunk,
                    off,
                    len,
                    last,
                } => {
                    let mine = (at.own)(chunk) + off as u64 * esz;
                    let msg = self.receive(len as u64 * esz)?;
                    if last {
                        let dst = at.result + off as u64 * esz;
                        self.reduce(at, dst, msg.ptr, mine, len, Some(self.world))?;
                        self.consumed()?;
                    } else {
                        let slot = self.take_slot()?;
                        let dst = self.slot_ptr(slot);
                        self.reduce(at, dst, msg.ptr, mine, len, None)?;
                        let done = self.consumed()?;
                        self.publish(dst, len, at.dtype, done, Some(slot))?;
                    }
                }
            }
        }
        self.drain()?;
        Ok(self.stream.record_event())
    }

    /// The device address of scratch slot `slot`.
    fn slot_ptr(&self, slot: usize) -> u64 {
        let s = self
            .scratch
            .as_ref()
            .expect("slots exist when partials are forwarded");
        let (base, _sync) = s.device_ptr(self.cu());
        base + (slot * self.slot_bytes) as u64
    }

    fn publish(
        &mut self,
        ptr: u64,
        len: usize,
        dtype: DType,
        ready: Event,
        slot: Option<usize>,
    ) -> Result<(), DataError> {
        let next = (self.rank + 1) % self.world;
        let msg = Msg {
            seq: self.seq,
            ptr,
            bytes: len * dtype.size_in_bytes(),
            ready,
        };
        self.links
            .to_next
            .send(msg)
            .map_err(|_| DataError::Departed {
                peer: next,
                why: "its CUDA ring endpoint was dropped".into(),
            })?;
        self.outstanding.push_back(slot);
        Ok(())
    }

    /// The predecessor's next segment (`bytes` long), with this stream made to wait for it.
    fn receive(&mut self, bytes: u64) -> Result<Msg, DataError> {
        let (rank, world, seq) = (self.rank, self.world, self.seq);
        let prev = (rank + world - 1) % world;
        let msg = recv_bounded(
            &self.links.from_prev,
            &*self.control,
            self.deadline,
            prev,
            &|| {
                format!("rank {prev} to enqueue its next segment of collective #{seq} (rank {rank} waited)")
            },
        )?;
        if msg.seq != seq || msg.bytes as u64 != bytes {
            return Err(DataError::Protocol {
                reason: format!(
                    "rank {rank} expected {bytes} bytes of collective #{seq} from rank {prev}, got {} of #{}",
                    msg.bytes, msg.seq
                ),
            });
        }
        self.stream.wait_event(&msg.ready).map_err(device_error)?;
        Ok(msg)
    }

    /// Record that the segment just read is consumed, tell the predecessor, and return the event.
    fn consumed(&mut self) -> Result<Event, DataError> {
        let done = self.stream.record_event();
        let prev = (self.rank + self.world - 1) % self.world;
        self.links
            .ack_to_prev
            .send(Ack::Consumed(self.seq, done.clone()))
            .map_err(|_| DataError::Departed {
                peer: prev,
                why: "its CUDA ring endpoint was dropped".into(),
            })?;
        Ok(done)
    }

    /// The successor's answer to this rank's oldest outstanding segment.
    fn answer(&mut self) -> Result<(), DataError> {
        let (rank, world, seq) = (self.rank, self.world, self.seq);
        let next = (rank + 1) % world;
        let ack = recv_bounded(
            &self.links.acks_from_next,
            &*self.control,
            self.deadline,
            next,
            &|| format!("rank {next} to take rank {rank}'s segments of collective #{seq}"),
        )?;
        let event = match ack {
            Ack::Consumed(s, e) if s == seq => e,
            Ack::Released(s) if s == seq => {
                // Its stream no longer reads this rank's memory; `release` must not wait for
                // this message again.
                self.next_released = true;
                return Err(DataError::gave_up(next, seq, self.control.aborted()));
            }
            Ack::Consumed(s, _) | Ack::Released(s) => {
                return Err(DataError::Protocol {
                    reason: format!(
                        "rank {rank} expected rank {next}'s answer for collective #{seq}, got one for #{s}"
                    ),
                })
            }
        };
        match self.outstanding.pop_front() {
            Some(Some(slot)) => {
                self.slot_consumed[slot] = Some(event);
                self.free_slots += 1;
            }
            Some(None) => {
                // The end of the collective waits for every answer (see `drain`).
                self.stream.wait_event(&event).map_err(device_error)?;
            }
            None => {
                return Err(DataError::Protocol {
                    reason: format!("rank {rank}: an answer from rank {next} for nothing sent"),
                })
            }
        }
        Ok(())
    }

    /// A free scratch slot, this stream ordered after its previous reader.
    fn take_slot(&mut self) -> Result<usize, DataError> {
        while self.free_slots == 0 {
            self.answer()?;
        }
        let slot = self.next_slot;
        self.next_slot = (slot + 1) % self.slot_consumed.len();
        self.free_slots -= 1;
        if let Some(e) = self.slot_consumed[slot].take() {
            self.stream.wait_event(&e).map_err(device_error)?;
        }
        Ok(slot)
    }

    /// Make this stream wait until the successor consumed everything this rank published.
    fn drain(&mut self) -> Result<(), DataError> {
        while !self.outstanding.is_empty() {
            self.answer()?;
        }
        for e in self.slot_consumed.iter_mut().filter_map(Option::take) {
            self.stream.wait_event(&e).map_err(device_error)?;
        }
        self.free_slots = self.slot_consumed.len();
        Ok(())
    }

    fn copy(&self, dst: u64, src: u64, bytes: u64) -> Result<(), DataError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `src` and `dst` are device addresses of this context valid for `bytes` (the
        // collective's buffers under their guards, a peer's published segment, or scratch),
        // ordered by the events of the protocol above; they do not overlap (distinct blocks).
        unsafe { result::memcpy_dtod_async(dst, src, bytes as usize, self.cu().cu_stream()) }
            .map_err(|e| device("cuMemcpyDtoDAsync", e))
    }

    fn reduce(
        &self,
        at: &Layout<'_>,
        dst: u64,
        acc: u64,
        mine: u64,
        len: usize,
        finish: Option<usize>,
    ) -> Result<(), DataError> {
        let kind = match at.op {
            ReduceOp::Sum => ReduceKind::Sum,
            ReduceOp::Avg => ReduceKind::Avg,
            ReduceOp::Min => ReduceKind::Min,
            ReduceOp::Max => ReduceKind::Max,
            ReduceOp::Product => ReduceKind::Product,
        };
        let finish = finish.map(|n| n as u32);
        let s = self.cu();
        use fsdp_kernels::launch::reduce_raw;
        // SAFETY: `acc` is the predecessor's published segment (this stream waited for it),
        // `mine` this rank's data and `dst` this rank's result or a slot it owns, all valid for
        // `len` elements of the dtype and ordered by the protocol above; `dst` equals `mine`
        // only in place.
        let r = unsafe {
            match at.dtype {
                DType::F32 => reduce_raw::<f32>(s, kind, dst, acc, mine, len, finish),
                DType::F64 => reduce_raw::<f64>(s, kind, dst, acc, mine, len, finish),
                DType::BF16 => reduce_raw::<half::bf16>(s, kind, dst, acc, mine, len, finish),
                DType::F16 => reduce_raw::<half::f16>(s, kind, dst, acc, mine, len, finish),
            }
        };
        r.map_err(|e| DataError::Protocol {
            reason: format!("rank {}: reduction kernel: {e}", self.rank),
        })
    }

    /// After a failure: stop reading the predecessor's memory (synchronise this stream), tell
    /// it so, and make sure the successor no longer reads this rank's memory: every segment it
    /// took has its consumed event completed, and for the others it said it released them.
    /// False (the caller then leaks its buffers) if that could not be established within
    /// `grace`.
    pub fn release(&mut self, grace: Duration) -> bool {
        let deadline = Instant::now() + grace;
        // Slot readers and (through `answer`) the other readers seen so far are ordered before
        // this synchronisation.
        let mut ok = true;
        for e in self.slot_consumed.iter_mut().filter_map(Option::take) {
            ok &= self.stream.wait_event(&e).is_ok();
        }
        ok &= self.stream.synchronize().is_ok();
        if ok {
            let _ = self.links.ack_to_prev.send(Ack::Released(self.seq));
        }
        // A release the successor sent already (received by `answer`) is not sent again.
        while !self.outstanding.is_empty() && !self.next_released {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.links.acks_from_next.recv_timeout(left) {
                Ok(Ack::Released(s)) if s == self.seq => self.next_released = true,
                Ok(Ack::Consumed(s, e)) if s == self.seq => {
                    self.outstanding.pop_front();
                    ok &= e.synchronize_timeout(left).is_ok();
                }
                Ok(_) => {}
                // Timed out, or the successor left without saying: it may still read ours.
                Err(_) => return false,
            }
        }
        self.outstanding.clear();
        self.free_slots = self.slot_consumed.len();
        ok
    }
}

#[cfg(test)]
#[path = "rank_tests.rs"]
mod tests;
