//! The TCP transport of the ring engine: segments travel as frames over the socket to the
//! successor (a copy into the kernel and out of it, instead of the thread ring's read in place);
//! descriptions travel around the ring as frames too.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::link::{AbortState, Links, RecvFail, SendFail};
use super::wire::{Header, Payload, KIND_ABORT, KIND_DATA, KIND_DESC};
use crate::flavors::desc::OpDesc;
use crate::flavors::engine::{exchange_around_ring, Control, DataError, Transport};

/// Abort state of a tcp group: set once, and the successor is told (it passes the notice on
/// around the ring).
pub(crate) struct TcpControl {
    pub rank: usize,
    pub group: String,
    pub abort: Arc<AbortState>,
    /// `None` for a group of one rank.
    pub links: Option<Arc<Links>>,
}

impl Control for TcpControl {
    fn aborted(&self) -> Option<String> {
        self.abort.get()
    }

    fn abort(&self, seq: u64, reason: String) {
        if self.abort.set(reason.clone()) {
            tracing::warn!(rank = self.rank, group = %self.group, %reason, "communicator aborted");
            if let Some(l) = &self.links {
                l.out().send_abort(seq, self.rank, &reason);
            }
        }
    }
}

/// One rank's tcp transport.
pub(crate) struct Tcp {
    rank: usize,
    world: usize,
    links: Option<Arc<Links>>,
    seq: u64,
    deadline: Instant,
    /// Room for a partial sum to send on (8-byte aligned).
    tmp: Vec<u64>,
}

impl Tcp {
    pub fn new(rank: usize, world: usize, links: Option<Arc<Links>>) -> Tcp {
        Tcp {
            rank,
            world,
            links,
            seq: 0,
            deadline: Instant::now(),
            tmp: Vec::new(),
        }
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn links(&self) -> Result<&Links, DataError> {
        self.links.as_deref().ok_or_else(|| DataError::Protocol {
            reason: "a group of one rank has no peers to talk to".into(),
        })
    }

    fn send_frame(&self, kind: u8, origin: usize, bytes: &[u8]) -> Result<(), DataError> {
        let header = Header {
            kind,
            seq: self.seq,
            origin: origin as u32,
            len: bytes.len() as u64,
        };
        let links = self.links()?;
        // A peer's abort notice may be waiting: report it rather than what it caused here.
        if let Some(reason) = links.aborted() {
            return Err(DataError::Aborted { reason });
        }
        links
            .out()
            .send(&header, bytes, self.deadline)
            .map_err(|f| match f {
                SendFail::NoTime => DataError::Timeout {
                    waiting_for: format!(
                        "time to send to rank {}: the collective's time ran out before",
                        self.next()
                    ),
                },
                SendFail::Timeout => DataError::Timeout {
                    waiting_for: format!(
                        "rank {} to take this rank's data (its socket stayed full)",
                        self.next()
                    ),
                },
                SendFail::Departed(why) => DataError::Departed {
                    peer: self.next(),
                    why,
                },
            })
    }

    fn recv_frame(
        &self,
        kind: u8,
        waiting_for: impl FnOnce() -> String,
    ) -> Result<(Header, Payload), DataError> {
        let links = self.links()?;
        let (h, p) = links.recv(self.deadline).map_err(|f| match f {
            RecvFail::Timeout => match links.aborted() {
                Some(reason) => DataError::Aborted { reason },
                None => DataError::Timeout {
                    waiting_for: waiting_for(),
                },
            },
            RecvFail::Closed(why) => DataError::Departed {
                peer: self.prev(),
                why,
            },
            RecvFail::Aborted(reason) => DataError::Aborted { reason },
        })?;
        if h.kind != kind || h.seq != self.seq {
            return Err(DataError::Protocol {
                reason: format!(
                    "expected a {} frame of collective #{} from rank {}, got a {} frame of #{}",
                    kind_name(kind),
                    self.seq,
                    self.prev(),
                    kind_name(h.kind),
                    h.seq
                ),
            });
        }
        Ok((h, p))
    }

    /// The predecessor's next segment, which must be `expect` bytes long.
    fn recv_data(&self, expect: usize) -> Result<Payload, DataError> {
        let prev = self.prev();
        let (_, p) = self.recv_frame(KIND_DATA, || format!("data from rank {prev}"))?;
        if p.len() != expect {
            return Err(DataError::Protocol {
                reason: format!(
                    "expected {expect} bytes of collective #{} from rank {prev}, got {}",
                    self.seq,
                    p.len()
                ),
            });
        }
        Ok(p)
    }
}

fn kind_name(kind: u8) -> &'static str {
    match kind {
        KIND_DATA => "data",
        KIND_DESC => "description",
        KIND_ABORT => "abort",
        _ => "unknown",
    }
}

impl Transport for Tcp {
    fn exchange(
        &mut self,
        seq: u64,
        own: &OpDesc,
        deadline: Instant,
    ) -> Result<Vec<OpDesc>, DataError> {
        self.seq = seq;
        self.deadline = deadline;
        let this = &*self;
        exchange_around_ring(
            self.rank,
            self.world,
            own,
            &mut |origin, bytes| this.send_frame(KIND_DESC, origin, bytes),
            &mut |origin| {
                let (h, p) = this.recv_frame(KIND_DESC, || {
                    format!("rank [{origin}] did not reach this collective")
                })?;
                Ok((h.origin as usize, p.as_bytes().to_vec()))
            },
        )
    }

    fn begin(&mut self, seq: u64, deadline: Instant) {
        self.seq = seq;
        self.deadline = deadline;
    }

    unsafe fn send(&mut self, src: *const u8, bytes: usize) -> Result<(), DataError> {
        let data = if bytes == 0 {
            &[][..]
        } else {
            // SAFETY: readable for `bytes` bytes (caller's contract).
            unsafe { std::slice::from_raw_parts(src, bytes) }
        };
        self.send_frame(KIND_DATA, self.rank, data)
    }

    fn recv(&mut self, bytes: usize, f: &mut dyn FnMut(*const u8)) -> Result<(), DataError> {
        let p = self.recv_data(bytes)?;
        f(p.as_bytes().as_ptr());
        Ok(())
    }

    fn recv_forward(
        &mut self,
        bytes: usize,
        f: &mut dyn FnMut(*const u8, *mut u8),
    ) -> Result<(), DataError> {
        let p = self.recv_data(bytes)?;
        let mut tmp = std::mem::take(&mut self.tmp);
        tmp.resize(bytes.div_ceil(8), 0);
        let out = tmp.as_mut_ptr().cast::<u8>();
        f(p.as_bytes().as_ptr(), out);
        // SAFETY: `tmp` holds `bytes` bytes written by `f` and is not touched until sent.
        let sent = unsafe { self.send(out, bytes) };
        self.tmp = tmp;
        sent
    }

    fn drain(&mut self) -> Result<(), DataError> {
        // Frames are copies: nothing of this rank's memory is read after `send` returned.
        Ok(())
    }

    fn release(&mut self, _grace: Duration) -> bool {
        true
    }
}
