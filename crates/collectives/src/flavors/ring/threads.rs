//! The in-process transport: ranks are threads, and data moves by *pulling*. A rank publishes the
//! address of a segment that is ready (in its input, its output or one of its scratch slots) to
//! its successor over a channel; the successor copies — or reduces — it into memory the
//! successor owns, then acknowledges. A rank therefore writes only its own buffers, and each
//! byte crosses between ranks exactly once (NCCL's P2P-read protocol, on threads).
//!
//! Reductions write partial sums into `slots` scratch slots; a slot is reused only after the
//! successor acknowledged reading it. With at least two slots this cannot deadlock: the rank
//! furthest behind can always progress (its predecessor has published what it needs, its
//! successor has consumed all but at most one of its slots).
//!
//! Safety protocol for published addresses (what makes the `unsafe` below sound):
//! 1. An address is published only after the board exchange, i.e. once every rank holds the
//!    access guards of its buffers for this collective, and it points into memory the publisher
//!    does not write again until the successor acknowledged it (inputs are never written; an
//!    output block or a slot is written once before it is published).
//! 2. A rank finishes (and releases its guards) only after every address it published was
//!    acknowledged, or — on failure — after its successor said it released them or left.
//! 3. Channel send/receive gives the happens-before edge between the publisher's writes and the
//!    successor's reads, and between the successor's reads and the acknowledgement.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use fsdp_device::{HostStorage, Storage};

use super::board::Board;
use crate::flavors::desc::OpDesc;
use crate::flavors::engine::{Control, DataError, Transport};

/// How often a blocked rank checks whether the group was aborted.
const POLL: Duration = Duration::from_millis(20);

/// An address published to the successor. Only dereferenced under the protocol above.
#[derive(Clone, Copy, Debug)]
struct SendPtr(*const u8);
// SAFETY: the pointer is only an address in transit; the receiving thread dereferences it under
// the publication protocol documented above (published memory is not written until the
// receiver acknowledges it, and outlives every acknowledgement).
unsafe impl Send for SendPtr {}

#[derive(Debug)]
pub(crate) struct Msg {
    seq: u64,
    ptr: SendPtr,
    bytes: usize,
}

#[derive(Debug)]
pub(crate) enum Ack {
    /// The oldest unacknowledged segment of collective `.0` has been read.
    Done(#[allow(dead_code)] u64),
    /// The sender gave up on collective `.0` and will not read anything more.
    Released(u64),
}

/// A rank's channel endpoints in its ring.
pub(crate) struct Links {
    to_next: Sender<Msg>,
    from_prev: Receiver<Msg>,
    ack_to_prev: Sender<Ack>,
    acks_from_next: Receiver<Ack>,
}

/// The channels of a ring of `world` ranks: element `r` is rank `r`'s.
pub(crate) fn make_links(world: usize) -> Vec<Links> {
    let data: Vec<(Sender<Msg>, Receiver<Msg>)> = (0..world).map(|_| unbounded()).collect();
    let acks: Vec<(Sender<Ack>, Receiver<Ack>)> = (0..world).map(|_| unbounded()).collect();
    // data[r]: r -> r+1.   acks[r]: r+1 -> r.
    (0..world)
        .map(|r| {
            let prev = (r + world - 1) % world;
            Links {
                to_next: data[r].0.clone(),
                from_prev: data[prev].1.clone(),
                ack_to_prev: acks[prev].0.clone(),
                acks_from_next: acks[r].1.clone(),
            }
        })
        .collect()
}

impl Control for Board {
    fn aborted(&self) -> Option<String> {
        Board::aborted(self)
    }

    fn abort(&self, _seq: u64, reason: String) {
        Board::abort(self, reason)
    }
}

/// One rank's in-process transport.
pub(crate) struct Threads {
    rank: usize,
    world: usize,
    board: Arc<Board>,
    links: Links,
    scratch: HostStorage,
    slot_bytes: usize,
    num_slots: usize,
    seq: u64,
    deadline: Instant,
    /// For each published, unacknowledged message: whether it occupies a slot.
    outstanding: VecDeque<bool>,
    /// The successor said it gave up on the collective under way (it sends that once: whoever
    /// receives it, `recv_ack` or `release`, records it here).
    next_released: bool,
    free_slots: usize,
    next_slot: usize,
}

impl Drop for Threads {
    fn drop(&mut self) {
        self.board.depart(self.rank);
    }
}

impl Threads {
    /// The transport of `rank`: `slots` scratch slots of `slot_bytes` (only allocated for groups
    /// of more than two ranks, which forward partial sums).
    pub fn new(
        rank: usize,
        world: usize,
        board: Arc<Board>,
        links: Links,
        slot_bytes: usize,
        slots: usize,
    ) -> Result<Threads, fsdp_device::DeviceError> {
        let slot_bytes = slot_bytes.next_multiple_of(fsdp_device::HOST_ALIGN);
        let scratch = HostStorage::zeroed(if world > 2 { slot_bytes * slots } else { 0 })?;
        Ok(Threads {
            rank,
            world,
            board,
            links,
            scratch,
            slot_bytes,
            num_slots: slots,
            seq: 0,
            deadline: Instant::now(),
            outstanding: VecDeque::new(),
            next_released: false,
            free_slots: slots,
            next_slot: 0,
        })
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    /// A peer's endpoint is gone: report the abort that made it leave, if there was one.
    fn departed(&self, peer: usize) -> DataError {
        match self.board.aborted() {
            Some(reason) => DataError::Aborted { reason },
            None => DataError::Departed {
                peer,
                why: "its channel closed".into(),
            },
        }
    }

    fn check_abort(&self, waiting_for: impl FnOnce() -> String) -> Result<(), DataError> {
        if let Some(reason) = self.board.aborted() {
            return Err(DataError::Aborted { reason });
        }
        if Instant::now() >= self.deadline {
            return Err(DataError::Timeout {
                waiting_for: waiting_for(),
            });
        }
        Ok(())
    }

    fn publish(&mut self, ptr: *const u8, bytes: usize, uses_slot: bool) -> Result<(), DataError> {
        let msg = Msg {
            seq: self.seq,
            ptr: SendPtr(ptr),
            bytes,
        };
        self.links
            .to_next
            .send(msg)
            .map_err(|_| self.departed(self.next()))?;
        self.outstanding.push_back(uses_slot);
        Ok(())
    }

    /// The address of the predecessor's next segment.
    fn next_published(&mut self, expect_bytes: usize) -> Result<*const u8, DataError> {
        loop {
            let wait = POLL.min(self.deadline.saturating_duration_since(Instant::now()));
            match self.links.from_prev.recv_timeout(wait) {
                Ok(msg) => {
                    if msg.seq != self.seq || msg.bytes != expect_bytes {
                        return Err(DataError::Protocol {
                            reason: format!(
                                "expected {expect_bytes} bytes of collective #{} from rank {}, \
                                 got {} bytes of #{}",
                                self.seq,
                                self.prev(),
                                msg.bytes,
                                msg.seq
                            ),
                        });
                    }
                    return Ok(msg.ptr.0);
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.departed(self.prev())),
                Err(RecvTimeoutError::Timeout) => {
                    let prev = self.prev();
                    self.check_abort(|| format!("data from rank {prev}"))?
                }
            }
        }
    }

    /// Tell the predecessor its last segment has been read.
    fn ack_prev(&self) -> Result<(), DataError> {
        self.links
            .ack_to_prev
            .send(Ack::Done(self.seq))
            .map_err(|_| self.departed(self.prev()))
    }

    /// Wait for one acknowledgement from the successor.
    fn recv_ack(&mut self) -> Result<(), DataError> {
        loop {
            let wait = POLL.min(self.deadline.saturating_duration_since(Instant::now()));
            match self.links.acks_from_next.recv_timeout(wait) {
                Ok(Ack::Done(_)) => {
                    if let Some(true) = self.outstanding.pop_front() {
                        self.free_slots += 1;
                    }
                    return Ok(());
                }
                Ok(Ack::Released(s)) => return Err(self.next_gave_up(s)),
                Err(RecvTimeoutError::Disconnected) => return Err(self.departed(self.next())),
                Err(RecvTimeoutError::Timeout) => {
                    let next = self.next();
                    self.check_abort(|| format!("rank {next} to read this rank's data"))?
                }
            }
        }
    }

    /// The successor's release of collective `seq` arrived while this rank waited for an
    /// acknowledgement: remember it (`release` must not wait for it again) and report the
    /// failure, with the reason the group was aborted for when there is one.
    fn next_gave_up(&mut self, seq: u64) -> DataError {
        let (next, current) = (self.next(), self.seq);
        if seq != current {
            return DataError::Protocol {
                reason: format!(
                    "rank {next} released collective #{seq} during collective #{current}"
                ),
            };
        }
        self.next_released = true;
        DataError::gave_up(next, seq, self.board.aborted())
    }

    /// A free scratch slot (waiting for the successor to release one if needed).
    fn acquire_slot(&mut self) -> Result<*mut u8, DataError> {
        while self.free_slots == 0 {
            self.recv_ack()?;
        }
        self.free_slots -= 1;
        let slot = self.next_slot;
        self.next_slot = (self.next_slot + 1) % self.num_slots;
        Ok(self.scratch.as_ptr().wrapping_add(slot * self.slot_bytes))
    }
}

impl Transport for Threads {
    fn exchange(
        &mut self,
        seq: u64,
        own: &OpDesc,
        deadline: Instant,
    ) -> Result<Vec<OpDesc>, DataError> {
        let left = deadline.saturating_duration_since(Instant::now());
        self.board
            .exchange(self.rank, seq, own.clone(), left)
            .map_err(|f| f.into_data_error(seq))
    }

    fn begin(&mut self, seq: u64, deadline: Instant) {
        self.seq = seq;
        self.deadline = deadline;
        self.outstanding.clear();
        self.next_released = false;
        self.free_slots = self.num_slots;
    }

    unsafe fn send(&mut self, src: *const u8, bytes: usize) -> Result<(), DataError> {
        self.publish(src, bytes, false)
    }

    fn recv(&mut self, bytes: usize, f: &mut dyn FnMut(*const u8)) -> Result<(), DataError> {
        let p = self.next_published(bytes)?;
        f(p);
        self.ack_prev()
    }

    fn recv_forward(
        &mut self,
        bytes: usize,
        f: &mut dyn FnMut(*const u8, *mut u8),
    ) -> Result<(), DataError> {
        let p = self.next_published(bytes)?;
        let slot = self.acquire_slot()?;
        // The slot is ours and acknowledged by the successor (not being read).
        f(p, slot);
        self.publish(slot, bytes, true)?;
        self.ack_prev()
    }

    fn drain(&mut self) -> Result<(), DataError> {
        while !self.outstanding.is_empty() {
            self.recv_ack()?;
        }
        Ok(())
    }

    fn release(&mut self, grace: Duration) -> bool {
        let _ = self.links.ack_to_prev.send(Ack::Released(self.seq));
        let deadline = Instant::now() + grace;
        // Once the successor said it released this collective (received by `recv_ack`), it
        // reads nothing of ours any more and sends nothing else.
        while !self.outstanding.is_empty() && !self.next_released {
            let wait = deadline.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                return false;
            }
            match self.links.acks_from_next.recv_timeout(wait) {
                Ok(Ack::Done(_)) => {
                    self.outstanding.pop_front();
                }
                Ok(Ack::Released(s)) if s == self.seq => self.next_released = true,
                // A release of an earlier collective: not an answer for this one.
                Ok(Ack::Released(_)) => {}
                Err(RecvTimeoutError::Disconnected) => return true,
                Err(RecvTimeoutError::Timeout) => return false,
            }
        }
        true
    }
}
