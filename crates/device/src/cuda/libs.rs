//! Finding the NVRTC and NCCL libraries of Python packages at run time.
//!
//! cudarc opens its libraries by name (`libnvrtc.so`, `libnvrtc.so.13`, `libnccl.so`, …), so
//! they must be on the loader path. PyTorch's CUDA wheels install them under `site-packages`
//! instead (`nvidia/cu13/lib/libnvrtc.so.13` for CUDA 13, `nvidia/cuda_nvrtc/lib` for CUDA 12,
//! `nvidia/nccl/lib/libnccl.so.2`). [`load_nvrtc`] finds the library there and opens it by its
//! full path first: glibc then answers cudarc's later `dlopen("libnvrtc.so.13")` with the
//! loaded library, whose `DT_SONAME` is that name. NVRTC's builtins library
//! (`libnvrtc-builtins.so.13.0`, which NVRTC opens by name) is opened from the same folder.
//!
//! Where to look, in order:
//! 1. `FSDP_NVRTC_LIB` / `FSDP_NCCL_LIB`: the full path of the library (an error if it does not
//!    load);
//! 2. the loader path (what cudarc finds by itself);
//! 3. `nvidia/*/lib/` under each `site-packages` folder of `FSDP_PYTHON_SITE` (`:`-separated),
//!    `$VIRTUAL_ENV`, `$CONDA_PREFIX`, and what `python3 -c 'import site; …'` prints.
//!
//! NCCL's soname is `libnccl.so.2`, a name cudarc does not try: a copy found in
//! `site-packages` only helps once a `libnccl.so` link to it is in a folder of
//! `LD_LIBRARY_PATH` when the process starts (`scripts/gpu-check.sh` makes one);
//! [`load_nccl`] says so, with the path.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::DeviceError;

/// The NVRTC library of the CUDA version cudarc is built for (its `cuda-13000` feature).
pub const NVRTC_SONAME: &str = "libnvrtc.so.13";
/// NCCL's library name in its wheels.
pub const NCCL_SONAME: &str = "libnccl.so.2";

/// `site-packages` (and `dist-packages`) folders to search, in order, without duplicates.
pub fn site_packages() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(list) = env::var_os("FSDP_PYTHON_SITE") {
        dirs.extend(env::split_paths(&list));
    }
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = env::var_os(var) {
            dirs.extend(python_lib_dirs(Path::new(&prefix)));
        }
    }
    const PRINT_SITES: &str = "import site,sys\ntry:\n  p=site.getsitepackages()+[site.getusersitepackages()]\nexcept Exception:\n  p=[]\nprint('\\n'.join(p+sys.path))";
    if let Ok(out) = Command::new("python3").args(["-c", PRINT_SITES]).output() {
        let text = String::from_utf8_lossy(&out.stdout);
        dirs.extend(text.lines().filter(|l| !l.is_empty()).map(PathBuf::from));
    }
    let mut unique = Vec::new();
    for d in dirs {
        if d.is_dir() && !unique.contains(&d) {
            unique.push(d);
        }
    }
    unique
}

/// `prefix/lib/python3.*/site-packages` folders.
fn python_lib_dirs(prefix: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages"))
        .collect();
    out.sort();
    out
}

/// The first `nvidia/*/lib/<file>` under the given `site-packages` folders.
pub fn find_in(sites: &[PathBuf], file: &str) -> Option<PathBuf> {
    for site in sites {
        let Ok(entries) = std::fs::read_dir(site.join("nvidia")) else {
            continue;
        };
        let mut pkgs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        pkgs.sort();
        for pkg in pkgs {
            let candidate = pkg.join("lib").join(file);
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    None
}

/// Where a library was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// On the loader path: cudarc opens it by name.
    LoaderPath,
    /// Opened from this file (it stays loaded for the life of the process).
    File(PathBuf),
}

fn open(path: &Path, library: &str) -> Result<(), DeviceError> {
    // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions on us;
    // the handle is leaked so that the library stays loaded for cudarc's later lookups.
    let lib =
        unsafe { libloading::Library::new(path) }.map_err(|e| DeviceError::LibraryNotFound {
            library: library.into(),
            detail: format!("{} does not load: {e}", path.display()),
        })?;
    std::mem::forget(lib);
    Ok(())
}

/// Open the files of `dir` whose names start with `prefix` (NVRTC opens its builtins library,
/// `libnvrtc-builtins.so.13.0`, by name when it compiles).
fn open_companions(dir: &Path, prefix: &str) -> Result<(), DeviceError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .collect();
    files.sort();
    for f in files {
        open(&f, prefix)?;
    }
    Ok(())
}

fn probe(
    library: &str,
    env_var: &str,
    present: fn() -> bool,
    site_file: &str,
    companion: Option<&str>,
) -> Result<Found, DeviceError> {
    let path = if let Some(path) = env::var_os(env_var) {
        PathBuf::from(path)
    } else if present() {
        return Ok(Found::LoaderPath);
    } else {
        let sites = site_packages();
        find_in(&sites, site_file).ok_or_else(|| DeviceError::LibraryNotFound {
            library: library.into(),
            detail: format!(
                "not on the loader path, {env_var} unset, and no nvidia/*/lib/{site_file} \
                 under {sites:?}"
            ),
        })?
    };
    open(&path, library)?;
    if let (Some(prefix), Some(dir)) = (companion, path.parent()) {
        open_companions(dir, prefix)?;
    }
    if !present() {
        return Err(DeviceError::LibraryNotFound {
            library: library.into(),
            detail: format!(
                "{} loaded, but cudarc looks it up by another name: put a link named {library} \
                 to it in a folder of LD_LIBRARY_PATH before the process starts",
                path.display()
            ),
        });
    }
    Ok(Found::File(path))
}

/// Make NVRTC loadable by cudarc (see the module docs); the result is kept for the process.
///
/// # Errors
/// [`DeviceError::LibraryNotFound`] naming what was searched.
pub fn load_nvrtc() -> Result<Found, DeviceError> {
    static RESULT: OnceLock<Result<Found, DeviceError>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            // SAFETY: only tries to dlopen the library by cudarc's names.
            let present = || unsafe { cudarc::nvrtc::sys::is_culib_present() };
            probe(
                NVRTC_SONAME,
                "FSDP_NVRTC_LIB",
                present,
                NVRTC_SONAME,
                Some("libnvrtc-builtins.so"),
            )
        })
        .clone()
}

/// Make NCCL loadable by cudarc (see the module docs); the result is kept for the process.
///
/// # Errors
/// [`DeviceError::LibraryNotFound`] naming what was searched, or the link to make.
pub fn load_nccl() -> Result<Found, DeviceError> {
    static RESULT: OnceLock<Result<Found, DeviceError>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            // SAFETY: only tries to dlopen the library by cudarc's names.
            let present = || unsafe { cudarc::nccl::sys::is_culib_present() };
            probe("libnccl.so", "FSDP_NCCL_LIB", present, NCCL_SONAME, None)
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "reads the file system")]
    fn finds_a_library_in_a_fake_site_packages() {
        let root = env::temp_dir().join(format!("fsdp-libs-{}", std::process::id()));
        let lib = root.join("nvidia/cu13/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libnvrtc.so.13"), b"not really").unwrap();
        let other = root.join("empty-site");
        std::fs::create_dir_all(&other).unwrap();
        let sites = vec![other.clone(), root.clone()];
        assert_eq!(
            find_in(&sites, "libnvrtc.so.13"),
            Some(lib.join("libnvrtc.so.13"))
        );
        assert_eq!(find_in(&sites, "libnccl.so.2"), None);
        // A file that is not a library gives an error naming it, not a crash.
        let err = open(&lib.join("libnvrtc.so.13"), NVRTC_SONAME).unwrap_err();
        assert!(err.to_string().contains("does not load"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
