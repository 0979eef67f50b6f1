//! Deferred releases: things that queued stream work still uses (device memory of a dropped
//! buffer, the access guard of a pinned buffer under an async copy, the memory of a dropped
//! [`OrderedStorage`](crate::OrderedStorage)) are kept until the events of that work have
//! completed, then dropped.
//!
//! One thread per process (started on first use) holds them: it queries the events (never
//! blocks in the driver, never synchronises the context) every 50 µs while anything is pending
//! and sleeps on its channel, up to a second at a time, when nothing is. A dedicated thread,
//! rather than draining on later allocations, because a pinned buffer's guard must be released
//! promptly even when no further allocation comes: the host read of that buffer waits for it.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, RecvTimeoutError, Sender};

use crate::{DeviceError, Event};

struct Pending {
    events: Vec<Event>,
    _payload: Box<dyn Any + Send>,
}

/// Releases handed over and not yet dropped.
static PENDING: AtomicUsize = AtomicUsize::new(0);

static REAPER: OnceLock<Mutex<Option<Sender<Pending>>>> = OnceLock::new();

/// How many deferred releases (device frees, pinned-buffer guards) wait for their events now.
pub fn pending_releases() -> usize {
    PENDING.load(Ordering::SeqCst)
}

/// Wait until no deferred release is pending, polling up to `timeout`.
///
/// # Errors
/// [`DeviceError::Timeout`] naming how many are still pending.
pub fn wait_for_releases(timeout: Duration) -> Result<(), DeviceError> {
    let start = Instant::now();
    loop {
        let n = pending_releases();
        if n == 0 {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            return Err(DeviceError::Timeout {
                what: format!("{n} deferred releases of device memory or pinned buffers"),
                waited: start.elapsed(),
            });
        }
        thread::sleep(Duration::from_micros(100));
    }
}

fn sender() -> Option<Sender<Pending>> {
    // Miri checks that every thread has ended when a test does: there, releases wait in place.
    if cfg!(miri) {
        return None;
    }
    let slot = REAPER.get_or_init(|| {
        let (tx, rx) = unbounded::<Pending>();
        let spawned = thread::Builder::new()
            .name("fsdp-device-reaper".into())
            .spawn(move || {
                let mut held: Vec<Pending> = Vec::new();
                loop {
                    if held.is_empty() {
                        match rx.recv_timeout(Duration::from_secs(1)) {
                            Ok(p) => held.push(p),
                            Err(RecvTimeoutError::Timeout) => continue,
                            Err(RecvTimeoutError::Disconnected) => return,
                        }
                    }
                    held.extend(rx.try_iter());
                    let before = held.len();
                    held.retain(|p| !p.events.iter().all(Event::query));
                    PENDING.fetch_sub(before - held.len(), Ordering::SeqCst);
                    if !held.is_empty() {
                        thread::sleep(Duration::from_micros(50));
                    }
                }
            });
        Mutex::new(spawned.ok().map(|_| tx))
    });
    slot.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Drop `payload` once every event of `events` has completed: now if they all have, else on
/// the reaper thread. The events may be of CUDA streams or of CPU streams alike. Without a
/// reaper thread (it could not be started, or under Miri) the caller waits for the events,
/// each up to its stream's timeout, and leaks the payload if one does not complete: a leak,
/// never a use after free.
pub fn release_after(events: Vec<Event>, payload: Box<dyn Any + Send>) {
    if events.iter().all(Event::query) {
        drop(payload);
        return;
    }
    PENDING.fetch_add(1, Ordering::SeqCst);
    let pending = Pending {
        events,
        _payload: payload,
    };
    let Some(tx) = sender() else {
        return release_here(pending);
    };
    if let Err(e) = tx.send(pending) {
        release_here(e.into_inner());
    }
}

fn release_here(pending: Pending) {
    if pending.events.iter().all(|e| e.synchronize().is_ok()) {
        drop(pending);
    } else {
        std::mem::forget(pending);
    }
    PENDING.fetch_sub(1, Ordering::SeqCst);
}
