//! The rendezvous board of a ring group: before any data moves, every rank posts a description
//! of the collective it issued; each rank then compares all of them. The board also records which
//! ranks have left and whether the group was aborted, so that no wait outlives a dead peer.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::threads::Links;
pub(crate) use crate::flavors::desc::OpDesc;
use crate::flavors::engine::recorder::{Progress, ProgressBoard, SharedProgress};
use crate::flavors::engine::DataError;

/// Why an exchange did not complete.
#[derive(Debug)]
pub(crate) enum ExchangeFail {
    Timeout { missing: Vec<usize> },
    Departed { peer: usize },
    Aborted { reason: String },
}

impl ExchangeFail {
    /// The engine's error for a failed exchange of collective `seq`.
    pub(crate) fn into_data_error(self, seq: u64) -> DataError {
        match self {
            ExchangeFail::Timeout { missing } => DataError::Timeout {
                waiting_for: format!(
                    "rank{} {missing:?} did not reach this collective",
                    if missing.len() == 1 { "" } else { "s" }
                ),
            },
            ExchangeFail::Departed { peer } => DataError::Departed {
                peer,
                why: format!("it left the group before collective #{seq}"),
            },
            ExchangeFail::Aborted { reason } => DataError::Aborted { reason },
        }
    }
}

struct Slot {
    descs: Vec<Option<OpDesc>>,
    unread: usize,
}

/// A sub-group being created by `split`: its board and each member's links, taken once.
pub(crate) struct PendingSplit {
    pub board: Arc<Board>,
    pub links: Vec<Option<Links>>,
}

#[derive(Default)]
struct State {
    slots: HashMap<u64, Slot>,
    departed: Vec<bool>,
    aborted: Option<String>,
    splits: HashMap<(u64, u32), PendingSplit>,
}

pub(crate) struct Board {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
    /// The flight recorder's progress of each rank.
    progress: SharedProgress,
}

impl Board {
    pub fn new(world: usize) -> Board {
        Board {
            world,
            state: Mutex::new(State {
                departed: vec![false; world],
                ..State::default()
            }),
            cv: Condvar::new(),
            progress: SharedProgress::new(world),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Post `desc` for collective `seq` and wait until every rank has posted (or a peer left, the
    /// group was aborted, or `timeout` passed).
    pub fn exchange(
        &self,
        rank: usize,
        seq: u64,
        desc: OpDesc,
        timeout: Duration,
    ) -> Result<Vec<OpDesc>, ExchangeFail> {
        let deadline = Instant::now() + timeout;
        let world = self.world;
        let mut st = self.lock();
        if let Some(reason) = &st.aborted {
            return Err(ExchangeFail::Aborted {
                reason: reason.clone(),
            });
        }
        {
            let slot = st.slots.entry(seq).or_insert_with(|| Slot {
                descs: vec![None; world],
                unread: world,
            });
            slot.descs[rank] = Some(desc);
        }
        self.cv.notify_all();
        loop {
            let slot = st
                .slots
                .get(&seq)
                .expect("slot lives until every rank read it");
            if slot.descs.iter().all(Option::is_some) {
                let descs: Vec<OpDesc> = slot.descs.iter().flatten().cloned().collect();
                let slot = st.slots.get_mut(&seq).expect("present");
                slot.unread -= 1;
                if slot.unread == 0 {
                    st.slots.remove(&seq);
                }
                return Ok(descs);
            }
            if let Some(reason) = &st.aborted {
                return Err(ExchangeFail::Aborted {
                    reason: reason.clone(),
                });
            }
            if let Some(peer) = (0..world).find(|&p| st.departed[p] && slot.descs[p].is_none()) {
                return Err(ExchangeFail::Departed { peer });
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = (0..world).filter(|&p| slot.descs[p].is_none()).collect();
                return Err(ExchangeFail::Timeout { missing });
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Mark the group as unusable; every waiter wakes up and fails.
    pub fn abort(&self, reason: String) {
        let mut st = self.lock();
        if st.aborted.is_none() {
            st.aborted = Some(reason);
        }
        drop(st);
        self.cv.notify_all();
    }

    pub fn aborted(&self) -> Option<String> {
        self.lock().aborted.clone()
    }

    /// Record that `rank` left the group.
    pub fn depart(&self, rank: usize) {
        self.lock().departed[rank] = true;
        self.cv.notify_all();
    }

    /// Run `f` on the pending split `(seq, color)`, creating it with `create` if this is the first
    /// member to arrive.
    pub fn with_split<R>(
        &self,
        key: (u64, u32),
        create: impl FnOnce() -> PendingSplit,
        f: impl FnOnce(&mut PendingSplit) -> R,
    ) -> R {
        let mut st = self.lock();
        let pending = st.splits.entry(key).or_insert_with(create);
        let out = f(pending);
        if pending.links.iter().all(Option::is_none) {
            st.splits.remove(&key);
        }
        out
    }
}

impl ProgressBoard for Board {
    fn publish(&self, rank: usize, p: &Progress) {
        self.progress.publish(rank, p);
    }

    fn read(&self) -> Result<Vec<Option<Progress>>, String> {
        self.progress.read()
    }
}
