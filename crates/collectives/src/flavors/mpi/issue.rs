//! Issuing and running a collective: the stream task takes the buffers, exchanges the call
//! descriptions with one `MPI_Iallgather`, compares them, then runs the body; every MPI request
//! is polled until it completes or the deadline passes.

use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ::mpi::ffi;
use fsdp_device::{AccessGuard, Device};

use super::runtime::{error_string, mpi_u8, request_null, UserOps};
use super::{CommInner, MpiCommunicator, BACKEND};
use crate::flavors::check::{enqueue_collective, Access, Placement};
use crate::flavors::desc::{check_exchanged, decode_all_fixed, OpDesc, FIXED_BYTES};
use crate::{CollectiveError, Result, Work};

/// Why a wait or an MPI call failed.
pub(super) enum Fail {
    /// An MPI call returned an error.
    Mpi { call: &'static str, reason: String },
    /// The request did not complete before the deadline (it is still pending).
    Timeout,
}

/// Poll `req` until it completes or `deadline` passes: spin briefly, then yield, then sleep in
/// growing steps up to 1 ms (MPI progresses inside `MPI_Test`).
pub(super) fn wait_request(
    req: &mut ffi::MPI_Request,
    deadline: Instant,
) -> std::result::Result<(), Fail> {
    let start = Instant::now();
    let mut polls: u32 = 0;
    loop {
        let mut flag: c_int = 0;
        // SAFETY: `req` is a request started by this crate (or MPI_REQUEST_NULL, which tests as
        // complete); the status is ignored.
        let rc = unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        if rc != ffi::MPI_SUCCESS as c_int {
            return Err(Fail::Mpi {
                call: "MPI_Test",
                reason: error_string(rc),
            });
        }
        if flag != 0 {
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Fail::Timeout);
        }
        polls = polls.saturating_add(1);
        let waited = now - start;
        if polls < 200 {
            std::hint::spin_loop();
        } else if waited < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            let nap = (waited / 64).clamp(Duration::from_micros(20), Duration::from_millis(1));
            std::thread::sleep(nap.min(deadline - now));
        }
    }
}

/// What a collective's body gets: the communicator, the deadline and scratch memory that is
/// leaked (never freed under MPI) if the collective times out.
pub(super) struct Ctx<'a> {
    pub(super) inner: &'a CommInner,
    deadline: Instant,
    scratch: Vec<Vec<u64>>,
}

impl Ctx<'_> {
    pub(super) fn comm(&self) -> ffi::MPI_Comm {
        self.inner.comm
    }

    pub(super) fn ops(&self) -> &UserOps {
        &self.inner.runtime.ops
    }

    /// Zeroed scratch memory of at least `bytes` bytes (8-byte aligned, never null), valid until
    /// the collective ends.
    pub(super) fn temp(&mut self, bytes: usize) -> *mut u8 {
        let mut v = vec![0u64; bytes.div_ceil(8).max(1)];
        let p = v.as_mut_ptr() as *mut u8;
        self.scratch.push(v);
        p
    }

    pub(super) fn check(&self, rc: c_int, call: &'static str) -> std::result::Result<(), Fail> {
        if rc == ffi::MPI_SUCCESS as c_int {
            Ok(())
        } else {
            Err(Fail::Mpi {
                call,
                reason: error_string(rc),
            })
        }
    }

    /// Start a non-blocking call (`start` writes the request) and wait for it.
    pub(super) fn run(
        &self,
        call: &'static str,
        start: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
    ) -> std::result::Result<(), Fail> {
        let mut req = request_null();
        self.check(start(&mut req), call)?;
        wait_request(&mut req, self.deadline).map_err(|f| match f {
            Fail::Mpi { reason, .. } => Fail::Mpi { call, reason },
            Fail::Timeout => Fail::Timeout,
        })
    }
}

pub(super) type Body = Box<
    dyn FnOnce(&mut Ctx<'_>, &[AccessGuard], &[OpDesc]) -> std::result::Result<(), Fail> + Send,
>;

pub(super) fn c_count(n: usize, what: &str) -> std::result::Result<c_int, String> {
    c_int::try_from(n).map_err(|_| {
        format!(
            "{what} of {n} elements exceeds MPI's largest count ({})",
            c_int::MAX
        )
    })
}

impl MpiCommunicator {
    /// Issue a collective: take a sequence number, enqueue the task and return its work. When
    /// `check` failed, the task still posts the (invalid) description so that the peers fail at
    /// once instead of waiting, and the error is returned here.
    pub(super) fn issue(
        &self,
        mut desc: OpDesc,
        check: std::result::Result<Access, String>,
        body: Body,
    ) -> Result<Work> {
        let inner = &self.inner;
        let (rank, op) = (inner.rank, desc.op);
        if let Some(reason) = inner.aborted() {
            return Err(CollectiveError::Aborted { rank, reason });
        }
        let (access, local_error) = desc.take_check(rank, check);
        let task_inner = inner.clone();
        let work = enqueue_collective(
            &self.stream,
            &inner.next_seq,
            rank,
            op,
            inner.opts.timeout,
            access,
            move |seq, access| run_collective(&task_inner, seq, desc, access, body),
        )?;
        match local_error {
            Some(e) => Err(e),
            None => Ok(work),
        }
    }

    /// Where this backend's buffers live.
    pub(super) fn placement(&self) -> Placement {
        Placement::on("mpi", Device::Cpu)
    }
}

/// The stream task of one collective: take the buffers, compare descriptions with the peers, move
/// the data.
pub(super) fn run_collective(
    inner: &CommInner,
    seq: u64,
    mut desc: OpDesc,
    access: Option<Access>,
    body: Body,
) -> Result<()> {
    let (rank, world, op) = (inner.rank, inner.world, desc.op);
    let timeout = inner.opts.timeout;
    if let Some(reason) = inner.aborted() {
        return Err(CollectiveError::Aborted { rank, reason });
    }
    // One budget for the whole collective: buffers, exchange and data.
    let deadline = Instant::now() + timeout;
    let mut local_failure = None;
    let guards = match access {
        Some(a) => {
            let mut guards = Vec::with_capacity(a.tickets.len());
            for t in a.tickets {
                let left = deadline.saturating_duration_since(Instant::now());
                match t.acquire(left) {
                    Ok(g) => guards.push(g),
                    Err(e) => {
                        desc.invalid = Some(format!("its buffers stayed busy: {e}"));
                        local_failure = Some(e.to_string());
                        guards.clear();
                        break;
                    }
                }
            }
            guards
        }
        None => Vec::new(),
    };
    let mut ctx = Ctx {
        inner,
        deadline,
        scratch: Vec::new(),
    };
    let fail = |ctx: Ctx<'_>, guards: Vec<AccessGuard>, what: String, f: Fail| {
        let err = match f {
            Fail::Timeout => {
                // MPI still owns the request and the memory it was given: leak it all.
                std::mem::forget(ctx.scratch);
                std::mem::forget(guards);
                inner.runtime.poisoned.store(true, Ordering::SeqCst);
                CollectiveError::Timeout {
                    rank,
                    op,
                    seq,
                    waited: timeout,
                    waiting_for: what,
                }
            }
            Fail::Mpi { call, reason } => CollectiveError::Backend {
                rank,
                backend: BACKEND,
                op,
                reason: format!("{call} (collective #{seq}): {reason}"),
            },
        };
        inner.abort(err.to_string());
        err
    };
    // The exchange of descriptions.
    let send = ctx.temp(FIXED_BYTES);
    let recv = ctx.temp(FIXED_BYTES * world);
    desc.seq = seq;
    let wire = desc.encode_fixed();
    // SAFETY: `send` holds FIXED_BYTES bytes of scratch.
    unsafe { std::ptr::copy_nonoverlapping(wire.as_ptr(), send, FIXED_BYTES) };
    let exchanged = ctx.run("MPI_Iallgather", |req| {
        // SAFETY: send and recv are scratch of FIXED_BYTES and world × FIXED_BYTES bytes that live
        // until the request completes (or are leaked on timeout).
        unsafe {
            ffi::MPI_Iallgather(
                send as *const c_void,
                FIXED_BYTES as c_int,
                mpi_u8(),
                recv as *mut c_void,
                FIXED_BYTES as c_int,
                mpi_u8(),
                inner.comm,
                req,
            )
        }
    });
    if let Err(f) = exchanged {
        return Err(fail(
            ctx,
            guards,
            "the peers to reach this collective (MPI does not tell which ranks are missing)".into(),
            f,
        ));
    }
    // SAFETY: the exchange completed and wrote world × FIXED_BYTES bytes.
    let all = unsafe { std::slice::from_raw_parts(recv as *const u8, FIXED_BYTES * world) };
    let raw: Vec<&[u8]> = all.chunks_exact(FIXED_BYTES).collect();
    let descs = decode_all_fixed(&raw).map_err(|details| CollectiveError::Mismatch {
        rank,
        seq,
        details,
    })?;
    check_exchanged(rank, seq, &descs, local_failure, timeout)?;
    match body(&mut ctx, &guards, &descs) {
        Ok(()) => Ok(()),
        Err(f) => {
            let what = format!("MPI to complete {op} (a peer stopped taking part?)");
            Err(fail(ctx, guards, what, f))
        }
    }
}

/// Pointer to a guard's first element.
pub(super) fn ptr(g: &AccessGuard) -> *mut u8 {
    g.as_ptr()
}
