//! `split`: the description exchange shows that every rank reached it, then `MPI_Comm_split`.

use std::ffi::c_int;

use ::mpi::ffi;

use super::issue::Body;
use super::MpiCommunicator;
use crate::flavors::check::Access;
use crate::flavors::desc::OpDesc;
use crate::{CollectiveError, Result};

impl MpiCommunicator {
    /// [`Communicator::split`] returning the concrete type.
    pub fn split_mpi(&self, color: Option<u32>, key: usize) -> Result<Option<MpiCommunicator>> {
        let rank = self.inner.rank;
        let mut desc = OpDesc::new("split");
        let mpi_color = match color {
            None => None,
            Some(c) => match c_int::try_from(c) {
                Ok(c) => Some(c),
                Err(_) => {
                    desc.invalid = Some(format!("color {c} exceeds MPI's largest color (int)"));
                    None
                }
            },
        };
        let mpi_key = match c_int::try_from(key) {
            Ok(k) => k,
            Err(_) => {
                desc.invalid = Some(format!("key {key} exceeds MPI's largest key (int)"));
                0
            }
        };
        let check = match desc.invalid.clone() {
            Some(why) => Err(why),
            None => Ok(Access::none()),
        };
        desc.invalid = None;
        let (tx, rx) = crossbeam_channel::bounded::<Result<Option<MpiCommunicator>>>(1);
        let opts = self.inner.opts.clone();
        let body: Body = Box::new(move |ctx, _, _| {
            // SAFETY: reading a predefined constant.
            let undefined = unsafe { ffi::RSMPI_UNDEFINED };
            let mut newcomm = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
            // SAFETY: valid communicator and out-pointer; every rank has reached this split
            // (the exchange completed), so the blocking call returns.
            let rc = unsafe {
                ffi::MPI_Comm_split(
                    ctx.comm(),
                    mpi_color.unwrap_or(undefined),
                    mpi_key,
                    newcomm.as_mut_ptr(),
                )
            };
            ctx.check(rc, "MPI_Comm_split")?;
            // SAFETY: MPI_Comm_split succeeded and wrote the handle.
            let newcomm = unsafe { newcomm.assume_init() };
            // SAFETY: reading a predefined constant.
            let result = if newcomm == unsafe { ffi::RSMPI_COMM_NULL } {
                Ok(None)
            } else {
                MpiCommunicator::from_comm(newcomm, opts, ctx.inner.runtime.clone(), "split")
                    .map(Some)
            };
            let _ = tx.send(result);
            Ok(())
        });
        let work = self.issue(desc, check, body)?;
        let waited = work.wait();
        match rx.try_recv() {
            Ok(r) => r,
            Err(_) => Err(waited.err().unwrap_or(CollectiveError::Aborted {
                rank,
                reason: "split ended without a result".into(),
            })),
        }
    }
}
