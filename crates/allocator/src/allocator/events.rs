//! Record-stream events: returning blocks whose events completed, and waiting for pending
//! events.

use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use super::{Shared, State};
use crate::{AllocError, MemorySource};

impl<S: MemorySource> State<S> {
    /// Return the blocks whose record-stream events have all completed to their pools.
    pub(super) fn process_events(&mut self, source: &S) -> Result<(), AllocError> {
        if self.outstanding == 0 {
            return Ok(());
        }
        let mut done = Vec::new();
        let mut error = None;
        for queue in self.events.values_mut() {
            // Events of one stream complete in record order.
            while let Some(front) = queue.front() {
                match source.query_event(&front.event) {
                    Ok(true) => {
                        done.push(front.block);
                        queue.pop_front();
                    }
                    Ok(false) => break,
                    Err(e) => {
                        error = Some(e);
                        break;
                    }
                }
            }
        }
        self.events.retain(|_, q| !q.is_empty());
        self.outstanding -= done.len();
        for id in done {
            let b = self.blk_mut(id);
            b.event_count -= 1;
            if b.event_count == 0 {
                self.free_block(id);
            }
        }
        error.map_or(Ok(()), Err)
    }

    pub(super) fn pending_events(&self) -> Vec<Arc<S::Event>> {
        self.events
            .values()
            .flat_map(|q| q.iter().map(|p| p.event.clone()))
            .collect()
    }
}

impl<S: MemorySource> Shared<S> {
    /// Wait (without the lock) for `events`, within the configured timeout in all.
    fn wait_events(&self, events: &[Arc<S::Event>]) -> Result<(), AllocError> {
        let deadline = Instant::now() + self.config.sync_timeout;
        for ev in events {
            let left = deadline.saturating_duration_since(Instant::now());
            self.source.synchronize_event(ev, left)?;
        }
        Ok(())
    }

    /// Wait for every pending record-stream event and return those blocks to their pools
    /// (PyTorch's `synchronize_and_free_events`). Takes and returns the lock.
    pub(super) fn synchronize_and_free_events<'a>(
        &'a self,
        st: MutexGuard<'a, State<S>>,
    ) -> Result<MutexGuard<'a, State<S>>, AllocError> {
        let pending = st.pending_events();
        drop(st);
        // Stream work may itself free blocks (drop handles), so the wait must not hold the lock.
        let waited = self.wait_events(&pending);
        drop(pending);
        let mut st = self.lock();
        waited?;
        st.stats.num_sync_all_streams += 1;
        st.process_events(&self.source)?;
        Ok(st)
    }
}
