//! The per-device CUDA event pool and the CUDA points of [`Event`](crate::Event).

use std::fmt;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::driver_error;
use crate::DeviceError;

/// Free events, by device ordinal.
static POOLS: Mutex<Vec<Vec<CudaEvent>>> = Mutex::new(Vec::new());

/// How many events the pool of device `ordinal` holds now (free ones, not those in use).
pub fn pooled_events(ordinal: usize) -> usize {
    let pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    pools.get(ordinal).map_or(0, Vec::len)
}

/// A CUDA event (timing disabled) borrowed from its device's pool; it goes back on drop.
pub struct PooledEvent {
    event: Option<CudaEvent>,
    ordinal: usize,
}

impl PooledEvent {
    /// An event of `ctx`'s device: a free one of the pool, or a new one.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] when `cuEventCreate` fails.
    pub fn acquire(ctx: &Arc<CudaContext>) -> Result<PooledEvent, DeviceError> {
        let ordinal = ctx.ordinal();
        let free = {
            let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
            pools.get_mut(ordinal).and_then(Vec::pop)
        };
        let event = match free {
            Some(e) => e,
            None => ctx
                .new_event(None)
                .map_err(|e| driver_error("cuEventCreate", e))?,
        };
        Ok(PooledEvent {
            event: Some(event),
            ordinal,
        })
    }

    /// The cudarc event.
    pub fn event(&self) -> &CudaEvent {
        self.event.as_ref().expect("present until drop")
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
            if pools.len() <= self.ordinal {
                pools.resize_with(self.ordinal + 1, Vec::new);
            }
            pools[self.ordinal].push(event);
        }
    }
}

impl fmt::Debug for PooledEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda:{} event", self.ordinal)
    }
}

/// A recorded CUDA event (or why recording failed) and the host-wait timeout of its stream.
#[derive(Clone, Debug)]
pub(crate) struct CudaPoint {
    event: Result<Arc<PooledEvent>, DeviceError>,
    timeout: Duration,
}

impl CudaPoint {
    /// Record a pooled event at the current end of `stream`.
    pub(crate) fn record(stream: &CudaStream, timeout: Duration) -> CudaPoint {
        let event = PooledEvent::acquire(stream.context()).and_then(|ev| {
            ev.event()
                .record(stream)
                .map_err(|e| driver_error("cuEventRecord", e))?;
            Ok(Arc::new(ev))
        });
        CudaPoint { event, timeout }
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether the work before the event has completed. Never when no event could be
    /// recorded (its creation or recording failed): that work, a copy say, may still run, so
    /// what waits for the point to release memory keeps it (leaked rather than freed under the
    /// device) and `synchronize` reports the error. A failing query of a recorded event (a
    /// broken context, which runs nothing more) counts as completed.
    pub(crate) fn query(&self) -> bool {
        match &self.event {
            Ok(ev) => ev.event().try_is_complete().unwrap_or(true),
            Err(_) => false,
        }
    }

    /// Poll the event until it completes or `timeout` passes: spin briefly, then yield, then
    /// sleep 50 µs between queries (bounded latency, no unbounded `cuEventSynchronize`).
    pub(crate) fn synchronize(&self, timeout: Duration) -> Result<(), DeviceError> {
        let ev = self.event.as_ref().map_err(Clone::clone)?;
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            match ev.event().try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(driver_error("cuEventQuery", e)),
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(DeviceError::Timeout {
                    what: "a CUDA event".into(),
                    waited,
                });
            }
            polls += 1;
            if polls < 64 {
                std::hint::spin_loop();
            } else if polls < 256 {
                thread::yield_now();
            } else {
                thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Make `stream` wait (on the GPU) for the event.
    pub(crate) fn stream_wait(&self, stream: &CudaStream) -> Result<(), DeviceError> {
        let ev = self.event.as_ref().map_err(Clone::clone)?;
        stream
            .wait(ev.event())
            .map_err(|e| driver_error("cuStreamWaitEvent", e))
    }
}
