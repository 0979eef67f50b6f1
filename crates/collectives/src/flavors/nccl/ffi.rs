//! The thin layer over cudarc's NCCL and driver bindings: probing the libraries before anything
//! calls into them (cudarc panics when a library or symbol is missing), the version, the
//! communicator configuration, error strings, and the mapping of element types and reduce ops.

use std::ffi::{c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use cudarc::nccl::sys;
use fsdp_device::DType;

use crate::{CollectiveError, ReduceOp, Result};

/// The oldest NCCL this backend accepts: `ncclCommSplit` and non-blocking communicators with
/// `ncclCommGetAsyncError` polling are used throughout (NCCL 2.18, 2023).
pub(crate) const MIN_VERSION: (u32, u32, u32) = (2, 18, 0);

/// `NCCL_SPLIT_NOCOLOR`.
pub(crate) const SPLIT_NOCOLOR: i32 = -1;

/// `NCCL_VERSION(2, 30, 0)`: the version of the `ncclConfig_t` layout cudarc's bindings carry.
/// A library of another version reads `min(size, its own sizeof)` bytes of it (NCCL's
/// `parseCommConfig`), so the struct is accepted by older and newer libraries alike.
const CONFIG_VERSION: u32 = 23000;

fn unavailable(rank: usize, reason: String) -> CollectiveError {
    CollectiveError::Unavailable {
        rank,
        backend: "nccl",
        reason,
    }
}

/// Directories the dynamic loader searches by default, plus `LD_LIBRARY_PATH`.
fn library_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
        "/usr/local/cuda/lib64",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

/// A `libnccl.so.2` that the loader could find but cudarc does not look for (it asks for
/// `libnccl.so`, `libnccl.so.1`, `.so.12`, … but not `.so.2`, the only name the pip wheel
/// `nvidia-nccl-cu12` ships).
fn unversioned_nccl_hint() -> Option<PathBuf> {
    library_dirs().into_iter().find_map(|d| {
        let two = d.join("libnccl.so.2");
        (two.exists() && !d.join("libnccl.so").exists()).then_some(two)
    })
}

/// Check that the CUDA driver and NCCL libraries can be loaded, without calling into them.
/// Errors are [`CollectiveError::Unavailable`] naming the missing library.
pub(crate) fn probe_libraries(rank: usize) -> Result<()> {
    // Open NCCL from a Python package's site-packages (or FSDP_NCCL_LIB) when it is not on the
    // loader path; the checks below report what is still missing.
    let site = fsdp_device::cuda::libs::load_nccl().err();
    // SAFETY: only tries to open the driver's shared library by its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(unavailable(
            rank,
            "the CUDA driver library (libcuda.so) could not be loaded: no NVIDIA driver is \
             installed, or its directory is not on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    // SAFETY: only tries to open NCCL's shared library by the names cudarc knows.
    if !unsafe { sys::is_culib_present() } {
        let hint = match unversioned_nccl_hint() {
            Some(p) => format!(
                "; found {} but cudarc looks for libnccl.so: make a symlink \
                 `ln -s {} <dir>/libnccl.so` in a directory on LD_LIBRARY_PATH",
                p.display(),
                p.display()
            ),
            None => "; install NCCL (e.g. `pip install nvidia-nccl-cu12`, then put its \
                     nvidia/nccl/lib directory, with a libnccl.so symlink to libnccl.so.2, on \
                     LD_LIBRARY_PATH)"
                .into(),
        };
        let searched = site.map_or_else(String::new, |e| format!(" ({e})"));
        return Err(unavailable(
            rank,
            format!("the NCCL library (libnccl.so) could not be loaded{searched}{hint}"),
        ));
    }
    Ok(())
}

/// Run `f`, which calls into a library that [`probe_libraries`] found, turning a panic (cudarc
/// panics when a symbol is missing from an old library) into an `Unavailable` error.
pub(crate) fn guarded<T>(rank: usize, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Err(unavailable(rank, format!("{what}: {msg}")))
    })
}

/// NCCL's version as (major, minor, patch). Probes the libraries first.
pub fn version() -> Result<(u32, u32, u32)> {
    probe_libraries(0)?;
    guarded(0, "ncclGetVersion", || {
        let mut code: std::ffi::c_int = 0;
        // SAFETY: the library is present (probed); the pointer is to a live local.
        let r = unsafe { sys::ncclGetVersion(&mut code) };
        check(0, "ncclGetVersion", r)?;
        let code = code.max(0) as u32;
        Ok(if code >= 10000 {
            (code / 10000, (code % 10000) / 100, code % 100)
        } else {
            // Before 2.9 the code was X*1000 + Y*100 + Z.
            (code / 1000, (code % 1000) / 100, code % 100)
        })
    })
}

/// Whether the result is a success (or a non-blocking call still in progress).
pub(crate) fn is_ok_or_in_progress(r: sys::ncclResult_t) -> bool {
    matches!(
        r,
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
    )
}

/// NCCL's description of a result code.
pub(crate) fn error_string(r: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a pointer to a static NUL-terminated string (or null).
    let p = unsafe { sys::ncclGetErrorString(r) };
    if p.is_null() {
        return format!("{r:?}");
    }
    // SAFETY: non-null, NUL-terminated, static.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    format!("{s} ({r:?})")
}

/// NCCL's description of the last error on `comm` (more detail than the code), if any.
pub(crate) fn last_error(comm: sys::ncclComm_t) -> Option<String> {
    // SAFETY: ncclGetLastError accepts any communicator (or null) and returns a pointer to a
    // NUL-terminated string owned by NCCL, valid until the next NCCL call on this thread.
    let p = unsafe { sys::ncclGetLastError(comm) };
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated; copied out at once.
    let s = unsafe { CStr::from_ptr(p) }
        .to_string_lossy()
        .trim()
        .to_string();
    (!s.is_empty()).then_some(s)
}

/// The state `ncclCommGetAsyncError` reports for a communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CommState {
    /// No error and nothing in progress.
    Ready,
    /// A non-blocking call (initialisation, split, a launch during lazy connection set-up) is
    /// still in progress.
    InProgress,
    /// An error, with NCCL's description.
    Failed(String),
}

/// The NCCL result of a known numeric code (NCCL 2.18–2.30: 0–8); `None` for a code this
/// build does not know (a newer library), which must never be written into the Rust enum.
pub(crate) fn known_result(code: c_int) -> Option<sys::ncclResult_t> {
    use sys::ncclResult_t as R;
    Some(match code {
        0 => R::ncclSuccess,
        1 => R::ncclUnhandledCudaError,
        2 => R::ncclSystemError,
        3 => R::ncclInternalError,
        4 => R::ncclInvalidArgument,
        5 => R::ncclInvalidUsage,
        6 => R::ncclRemoteError,
        7 => R::ncclInProgress,
        _ => return None,
    })
}

/// `ncclCommGetAsyncError`, read as an integer (defect 8 of issue 15): NCCL writes an `int`,
/// and a code this build does not know becomes [`CommState::Failed`] naming it.
///
/// # Safety
/// `comm` must be a live communicator (not aborted or destroyed).
pub(crate) unsafe fn comm_state(comm: sys::ncclComm_t) -> CommState {
    let mut code: c_int = 0;
    // SAFETY: `comm` is live (caller); NCCL writes one `int` (the size and alignment of
    // `ncclResult_t`, a C enum) through the pointer, which is to a live local `c_int`.
    let r = unsafe { sys::ncclCommGetAsyncError(comm, (&mut code as *mut c_int).cast()) };
    if r != sys::ncclResult_t::ncclSuccess {
        return CommState::Failed(format!("ncclCommGetAsyncError: {}", error_string(r)));
    }
    match known_result(code) {
        Some(sys::ncclResult_t::ncclSuccess) => CommState::Ready,
        Some(sys::ncclResult_t::ncclInProgress) => CommState::InProgress,
        Some(r) => CommState::Failed(error_string(r)),
        None => CommState::Failed(format!("unknown NCCL result code {code}")),
    }
}

/// `Ok` for success, a `Backend` error with NCCL's string otherwise.
pub(crate) fn check(rank: usize, op: &'static str, r: sys::ncclResult_t) -> Result<()> {
    if r == sys::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    Err(CollectiveError::Backend {
        rank,
        backend: "nccl",
        op,
        reason: error_string(r),
    })
}

/// A non-blocking communicator configuration (`NCCL_CONFIG_INITIALIZER` with `blocking = 0`):
/// every NCCL call returns at once and its completion is polled with `ncclCommGetAsyncError`,
/// so that no wait on a peer is unbounded.
pub(crate) fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN; // NCCL_CONFIG_UNDEF_INT
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// NCCL's element type for ours (all four are supported: `ncclBfloat16` since NCCL 2.10).
pub(crate) fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
    }
}

/// NCCL's reduce op for ours; `None` for an op this backend does not know.
pub(crate) fn nccl_op(op: ReduceOp) -> Option<sys::ncclRedOp_t> {
    Some(match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Product => sys::ncclRedOp_t::ncclProd,
        #[allow(unreachable_patterns)]
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_matches_the_initializer() {
        let c = nonblocking_config();
        assert_eq!(c.magic, 0xcafebeef);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!(c.minCTAs, i32::MIN);
        assert!(c.netName.is_null());
    }

    #[test]
    fn result_codes_are_read_as_integers() {
        assert_eq!(known_result(0), Some(sys::ncclResult_t::ncclSuccess));
        assert_eq!(known_result(7), Some(sys::ncclResult_t::ncclInProgress));
        assert_eq!(known_result(6), Some(sys::ncclResult_t::ncclRemoteError));
        assert_eq!(known_result(8), None);
        assert_eq!(known_result(-1), None);
        assert_eq!(known_result(1234), None);
    }

    #[test]
    fn every_dtype_and_op_maps() {
        for d in DType::ALL {
            let _ = nccl_dtype(d);
        }
        for op in ReduceOp::ALL {
            assert!(nccl_op(op).is_some(), "{op:?}");
        }
        assert_eq!(
            nccl_op(ReduceOp::Avg),
            Some(sys::ncclRedOp_t::ncclAvg),
            "Avg must map to ncclAvg"
        );
    }
}
