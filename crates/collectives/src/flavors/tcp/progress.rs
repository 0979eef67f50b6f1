//! The flight recorder's progress board for ranks that are processes: each rank's progress is a
//! key of the rendezvous store (`fsdp/tcp/<group>/progress/<rank>`), written by a background
//! thread that coalesces updates (at most one write per [`PERIOD`]), so that a collective costs
//! no store round trip.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::flavors::engine::recorder::{Progress, ProgressBoard};
use crate::store::TcpStore;

/// Least time between two writes of one rank's progress.
const PERIOD: Duration = Duration::from_millis(20);

/// How long a failure report waits for the store's copy of the ranks' progress.
const READ_BOUND: Duration = Duration::from_secs(2);

#[derive(Default)]
struct Pending {
    latest: Option<Progress>,
    closed: bool,
    /// The publisher waits for an update (and needs a wake-up); false while it writes or rests.
    idle: bool,
}

/// One rank's view of the progress board of a group of processes.
pub(crate) struct StoreProgress {
    store: TcpStore,
    group: String,
    world: usize,
    pending: Arc<(Mutex<Pending>, Condvar)>,
}

fn key(group: &str, rank: usize) -> String {
    format!("fsdp/tcp/{group}/progress/{rank}")
}

impl StoreProgress {
    /// Start the publisher of `rank`'s progress in `group`.
    pub fn new(store: &TcpStore, group: &str, rank: usize, world: usize) -> StoreProgress {
        let pending = Arc::new((Mutex::new(Pending::default()), Condvar::new()));
        let (p, s, k) = (pending.clone(), store.clone(), key(group, rank));
        let spawned = std::thread::Builder::new()
            .name(format!("fsdp-progress-{rank}"))
            .spawn(move || publisher(&p, &s, &k));
        if let Err(e) = spawned {
            tracing::warn!(rank, %e, "flight recorder: no progress publisher");
        }
        StoreProgress {
            store: store.clone(),
            group: group.to_string(),
            world,
            pending,
        }
    }
}

/// Write the latest progress whenever it changes, at most once per [`PERIOD`], until closed or
/// the store fails (the job is ending then).
fn publisher(pending: &(Mutex<Pending>, Condvar), store: &TcpStore, key: &str) {
    let (lock, cv) = pending;
    loop {
        let value = {
            let mut p = lock.lock().unwrap_or_else(|e| e.into_inner());
            while p.latest.is_none() && !p.closed {
                p.idle = true;
                p = cv.wait(p).unwrap_or_else(|e| e.into_inner());
            }
            p.idle = false;
            if p.closed {
                return;
            }
            p.latest.take().expect("checked")
        };
        if let Err(e) = store.set(key, value.encode().as_bytes()) {
            tracing::debug!(%e, "flight recorder: progress not published; publisher stops");
            return;
        }
        // Rest without being woken by updates (a wake-up per collective would cost more than
        // the collective); a close is noticed after the rest.
        std::thread::sleep(PERIOD);
    }
}

impl Drop for StoreProgress {
    fn drop(&mut self) {
        let (lock, cv) = &*self.pending;
        lock.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        cv.notify_all();
    }
}

impl ProgressBoard for StoreProgress {
    fn publish(&self, _rank: usize, p: &Progress) {
        let (lock, cv) = &*self.pending;
        let mut pending = lock.lock().unwrap_or_else(|e| e.into_inner());
        pending.latest = Some(p.clone());
        if pending.idle {
            cv.notify_one();
        }
    }

    /// The ranks' last published progress, as far as the store answers within [`READ_BOUND`]:
    /// the store may be unreachable when this runs (a failure is being reported; the link to the
    /// store's host may be what failed), and the report must not wait for it.
    fn read(&self) -> Result<Vec<Option<Progress>>, String> {
        let (store, group, world) = (self.store.clone(), self.group.clone(), self.world);
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::Builder::new()
            .name("fsdp-progress-read".into())
            .spawn(move || {
                let got: Result<Vec<Option<Progress>>, String> = (0..world)
                    .map(|r| match store.try_get(&key(&group, r)) {
                        Ok(v) => {
                            Ok(v.and_then(|v| Progress::decode(std::str::from_utf8(&v).ok()?)))
                        }
                        Err(e) => Err(format!("the store did not answer ({e})")),
                    })
                    .collect();
                let _ = tx.send(got);
            });
        match reader {
            // A reader still blocked after the bound is left to the store's own timeout.
            Ok(_) => rx.recv_timeout(READ_BOUND).unwrap_or_else(|_| {
                Err(format!(
                    "the store did not answer within {} s (it may be behind the failure)",
                    READ_BOUND.as_secs()
                ))
            }),
            Err(e) => Err(format!("no thread to read the store: {e}")),
        }
    }
}
