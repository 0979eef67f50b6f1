//! The process-wide MPI state: initialization and finalization, the user-defined reduce ops,
//! MPI's error strings and predefined handles.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use ::mpi::environment::{self, Threading, Universe};
use ::mpi::ffi;
use fsdp_device::{DType, Element};

use super::BACKEND;
use crate::{CollectiveError, Result};

/// NaN-propagating min and max as MPI ops, for `MPI_FLOAT` and `MPI_DOUBLE`.
pub(super) struct UserOps {
    pub(super) min_f32: ffi::MPI_Op,
    pub(super) max_f32: ffi::MPI_Op,
    pub(super) min_f64: ffi::MPI_Op,
    pub(super) max_f64: ffi::MPI_Op,
}

/// `inout[i] = in[i] ⊕ inout[i]` with NaN-propagating min (`MAX == false`) or max.
///
/// # Safety
/// Called by MPI with `invec` and `inoutvec` pointing to `*len` elements of `T` (the op is only
/// used with the MPI type of `T`).
unsafe extern "C" fn nan_min_max<T: Element, const MAX: bool>(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _datatype: *mut ffi::MPI_Datatype,
) {
    // SAFETY: MPI passes valid pointers to `*len` elements of the op's datatype, which is `T`'s
    // (see `UserOps`); the two vectors do not overlap.
    let (a, b) = unsafe {
        let n = usize::try_from(*len).unwrap_or(0);
        (
            std::slice::from_raw_parts(invec as *const T, n),
            std::slice::from_raw_parts_mut(inoutvec as *mut T, n),
        )
    };
    for (d, &x) in b.iter_mut().zip(a) {
        *d = if MAX { x.max_nan(*d) } else { x.min_nan(*d) };
    }
}

impl UserOps {
    fn create() -> std::result::Result<UserOps, String> {
        fn one(f: ffi::MPI_User_function) -> std::result::Result<ffi::MPI_Op, String> {
            let mut op = std::mem::MaybeUninit::<ffi::MPI_Op>::uninit();
            // SAFETY: MPI is initialized; `f` is a valid user function and `op` an out-pointer.
            let rc = unsafe { ffi::MPI_Op_create(f, 1, op.as_mut_ptr()) };
            if rc != ffi::MPI_SUCCESS as c_int {
                return Err(format!("MPI_Op_create: {}", error_string(rc)));
            }
            // SAFETY: MPI_Op_create succeeded and wrote the handle.
            Ok(unsafe { op.assume_init() })
        }
        Ok(UserOps {
            min_f32: one(Some(nan_min_max::<f32, false>))?,
            max_f32: one(Some(nan_min_max::<f32, true>))?,
            min_f64: one(Some(nan_min_max::<f64, false>))?,
            max_f64: one(Some(nan_min_max::<f64, true>))?,
        })
    }

    fn free(&mut self) {
        for op in [
            &mut self.min_f32,
            &mut self.max_f32,
            &mut self.min_f64,
            &mut self.max_f64,
        ] {
            // SAFETY: each op was created by MPI_Op_create and is freed once, before finalize.
            unsafe { ffi::MPI_Op_free(op) };
        }
    }
}

/// What every communicator of the process shares: the MPI initialization and the user ops.
pub(super) struct Runtime {
    /// `Some` when this crate initialized MPI (and so finalizes it).
    universe: Option<Universe>,
    pub(super) ops: UserOps,
    /// Set when an operation timed out: MPI still owns a pending request, so it is not finalized.
    pub(super) poisoned: AtomicBool,
}

// SAFETY: the MPI handles in `UserOps` are plain handles to process-global MPI objects; with
// MPI_THREAD_MULTIPLE (checked at initialization) they may be used from any thread.
unsafe impl Send for Runtime {}
// SAFETY: as for `Send`; the handles are only read after construction.
unsafe impl Sync for Runtime {}

impl Drop for Runtime {
    fn drop(&mut self) {
        let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
        let universe = self.universe.take();
        let owned = universe.is_some();
        slot.owned_alive = false;
        if self.poisoned.load(Ordering::SeqCst) {
            tracing::error!(
                "an MPI operation timed out and is still pending: MPI is not finalized"
            );
            std::mem::forget(universe);
            slot.closed = Some(
                "an MPI operation of this process timed out earlier and is still pending; MPI \
                 cannot be used any more in this process",
            );
            return;
        }
        if !environment::is_finalized() {
            self.ops.free();
        }
        // Dropping rsmpi's universe calls MPI_Finalize.
        drop(universe);
        if owned {
            slot.closed = Some(
                "MPI was finalized when the last MPI communicator of this process was dropped, \
                 and MPI cannot be initialized twice in a process: keep one communicator alive \
                 for as long as MPI is needed",
            );
        }
    }
}

/// The process's runtime while any communicator lives, and why MPI cannot be used any more.
pub(super) struct Slot {
    runtime: Weak<Runtime>,
    /// Set once this crate finalized MPI (or gave up on it after a timeout).
    closed: Option<&'static str>,
    /// Whether a runtime that owns MPI exists (until its drop has finalized MPI).
    owned_alive: bool,
}

pub(super) static RUNTIME: Mutex<Slot> = Mutex::new(Slot {
    runtime: Weak::new(),
    closed: None,
    owned_alive: false,
});

pub(super) fn unavailable(reason: String) -> CollectiveError {
    CollectiveError::Unavailable {
        rank: 0,
        backend: BACKEND,
        reason,
    }
}

/// The shared runtime, initializing MPI if this is the first communicator of the process.
pub(super) fn runtime() -> Result<Arc<Runtime>> {
    let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rt) = slot.runtime.upgrade() {
        return Ok(rt);
    }
    if let Some(why) = slot.closed {
        return Err(unavailable(why.into()));
    }
    if slot.owned_alive {
        return Err(unavailable(
            "the last MPI communicator of this process is being dropped on another thread, \
             which finalizes MPI"
                .into(),
        ));
    }
    if environment::is_finalized() {
        return Err(unavailable(
            "MPI was already finalized by the application".into(),
        ));
    }
    let universe = if environment::is_initialized() {
        // Someone else (the application, through rsmpi or C) initialized MPI: use it as is.
        let level = environment::threading_support();
        if level < Threading::Multiple {
            return Err(unavailable(format!(
                "MPI was initialized by the application with thread level {level:?}; this \
                 backend needs MPI_THREAD_MULTIPLE (initialize with \
                 mpi::initialize_with_threading(Threading::Multiple) or let this crate do it)"
            )));
        }
        None
    } else {
        let Some((universe, level)) = environment::initialize_with_threading(Threading::Multiple)
        else {
            return Err(unavailable(
                "MPI_Init_thread could not be called (MPI is already initialized)".into(),
            ));
        };
        if level < Threading::Multiple {
            // Finalize (dropping the universe) and report.
            drop(universe);
            slot.closed = Some(
                "the MPI library does not provide MPI_THREAD_MULTIPLE (MPI was initialized and \
                 finalized once in this process)",
            );
            return Err(unavailable(format!(
                "the MPI library provides thread level {level:?}, this backend needs \
                 MPI_THREAD_MULTIPLE (collectives run on a worker thread per communicator); \
                 use an MPI built with thread support"
            )));
        }
        Some(universe)
    };
    let ops = match UserOps::create() {
        Ok(ops) => ops,
        Err(reason) => {
            if universe.is_some() {
                slot.closed = Some("MPI_Op_create failed once in this process");
            }
            drop(universe);
            return Err(CollectiveError::Backend {
                rank: 0,
                backend: BACKEND,
                op: "world",
                reason,
            });
        }
    };
    slot.owned_alive = universe.is_some();
    let rt = Arc::new(Runtime {
        universe,
        ops,
        poisoned: AtomicBool::new(false),
    });
    slot.runtime = Arc::downgrade(&rt);
    Ok(rt)
}

/// MPI's description of an error code.
pub(super) fn error_string(code: c_int) -> String {
    let mut buf = [0 as std::ffi::c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `buf` holds MPI_MAX_ERROR_STRING characters plus a terminator, as MPI requires.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return format!("MPI error code {code}");
    }
    let len = usize::try_from(len).unwrap_or(0).min(buf.len());
    let bytes: Vec<u8> = buf[..len].iter().map(|&c| c as u8).collect();
    format!(
        "{} (MPI error code {code})",
        String::from_utf8_lossy(&bytes)
    )
}

// SAFETY (for the helpers below): the predefined MPI handles are link-time constants of the
// rsmpi shim, valid for reading at any time and meaningful once MPI is initialized.
pub(super) fn mpi_float() -> ffi::MPI_Datatype {
    // SAFETY: see above.
    unsafe { ffi::RSMPI_FLOAT }
}
pub(super) fn mpi_double() -> ffi::MPI_Datatype {
    // SAFETY: see above.
    unsafe { ffi::RSMPI_DOUBLE }
}
pub(super) fn mpi_u16() -> ffi::MPI_Datatype {
    // SAFETY: see above.
    unsafe { ffi::RSMPI_UINT16_T }
}
pub(super) fn mpi_u8() -> ffi::MPI_Datatype {
    // SAFETY: see above.
    unsafe { ffi::RSMPI_UINT8_T }
}
pub(super) fn request_null() -> ffi::MPI_Request {
    // SAFETY: see above.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// The MPI type that moves elements of `dtype` bit for bit.
pub(super) fn move_type(dtype: DType) -> ffi::MPI_Datatype {
    match dtype {
        DType::F32 => mpi_float(),
        DType::F64 => mpi_double(),
        DType::BF16 | DType::F16 => mpi_u16(),
    }
}
