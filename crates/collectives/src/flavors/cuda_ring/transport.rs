//! The engine's view of a CUDA ring rank: the description exchange on the group's board, the
//! start of a collective and the release after a failure. The data steps are not moved through
//! this trait: the collectives' bodies enqueue the shared schedule on the rank's CUDA stream
//! ([`Rank::run`]), since a device step is an enqueue rather than a host copy.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::rank::Rank;
use crate::flavors::desc::OpDesc;
use crate::flavors::engine::{DataError, Transport};
use crate::flavors::ring::board::Board;

/// A rank's state, shared by its transport and the bodies of its collectives.
pub(crate) type SharedRank = Arc<Mutex<Rank>>;

/// Lock a rank's state (a panic while it was held leaves nothing half-done that matters: the
/// next collective starts over with `begin`).
pub(crate) fn lock(rank: &SharedRank) -> MutexGuard<'_, Rank> {
    rank.lock().unwrap_or_else(|e| e.into_inner())
}

/// The transport of one rank of a CUDA ring.
pub(crate) struct CudaTransport {
    pub rank: SharedRank,
    pub board: Arc<Board>,
    pub index: usize,
}

impl Drop for CudaTransport {
    fn drop(&mut self) {
        self.board.depart(self.index);
    }
}

fn not_here() -> DataError {
    DataError::Protocol {
        reason: "the CUDA ring enqueues its schedule on its stream, not through host transfers"
            .into(),
    }
}

impl Transport for CudaTransport {
    fn exchange(
        &mut self,
        seq: u64,
        own: &OpDesc,
        deadline: Instant,
    ) -> Result<Vec<OpDesc>, DataError> {
        let left = deadline.saturating_duration_since(Instant::now());
        self.board
            .exchange(self.index, seq, own.clone(), left)
            .map_err(|f| f.into_data_error(seq))
    }

    fn begin(&mut self, seq: u64, deadline: Instant) {
        lock(&self.rank).begin(seq, deadline);
    }

    unsafe fn send(&mut self, _src: *const u8, _bytes: usize) -> Result<(), DataError> {
        Err(not_here())
    }

    fn recv(&mut self, _bytes: usize, _f: &mut dyn FnMut(*const u8)) -> Result<(), DataError> {
        Err(not_here())
    }

    fn recv_forward(
        &mut self,
        _bytes: usize,
        _f: &mut dyn FnMut(*const u8, *mut u8),
    ) -> Result<(), DataError> {
        Err(not_here())
    }

    fn drain(&mut self) -> Result<(), DataError> {
        Ok(())
    }

    fn release(&mut self, grace: Duration) -> bool {
        lock(&self.rank).release(grace)
    }
}
