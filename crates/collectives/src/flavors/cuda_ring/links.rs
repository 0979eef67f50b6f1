//! What neighbouring ranks of a CUDA ring tell each other on the host: the device address of a
//! segment and the CUDA event after which it is ready (to the successor), and the CUDA event
//! after which the successor has consumed it (back to the predecessor). The host threads only
//! pass these handles; every wait on data is a GPU-side `cuStreamWaitEvent`. A host wait here is
//! for a peer's *enqueue*, bounded by the collective's deadline and cut short by an abort.

use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use fsdp_device::Event;

use crate::flavors::engine::{Control, DataError};

/// How often a rank blocked on a peer checks whether the group was aborted.
const POLL: Duration = Duration::from_millis(20);

/// A segment published to the successor: `bytes` at device address `ptr`, readable once the
/// successor's stream has waited for `ready`.
pub(crate) struct Msg {
    pub seq: u64,
    pub ptr: u64,
    pub bytes: usize,
    pub ready: Event,
}

/// The successor's answer to a [`Msg`].
pub(crate) enum Ack {
    /// Collective `.0`'s oldest unanswered segment is read once `.1` has completed.
    Consumed(u64, Event),
    /// The successor gave up on collective `.0`: its stream no longer reads this rank's memory.
    Released(u64),
}

/// A rank's channel endpoints in its ring.
pub(crate) struct Links {
    pub to_next: Sender<Msg>,
    pub from_prev: Receiver<Msg>,
    pub ack_to_prev: Sender<Ack>,
    pub acks_from_next: Receiver<Ack>,
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

/// Receive from `rx` before `deadline`, failing early when the group is aborted. `what` names
/// what is awaited (for the timeout error), `peer` the rank it comes from.
pub(crate) fn recv_bounded<T>(
    rx: &Receiver<T>,
    control: &dyn Control,
    deadline: Instant,
    peer: usize,
    what: &dyn Fn() -> String,
) -> Result<T, DataError> {
    loop {
        if let Some(reason) = control.aborted() {
            return Err(DataError::Aborted { reason });
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(DataError::Timeout {
                waiting_for: what(),
            });
        }
        match rx.recv_timeout((deadline - now).min(POLL)) {
            Ok(v) => return Ok(v),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                return Err(DataError::Departed {
                    peer,
                    why: "its CUDA ring endpoint was dropped".into(),
                })
            }
        }
    }
}
