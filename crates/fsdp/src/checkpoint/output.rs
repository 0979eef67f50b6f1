//! Output files that never damage what is already there.
//!
//! - [`check_output_path`] tells, before any work starts, whether a path may be written and what
//!   it names ([`OutputKind`]): nothing yet, a regular file, or (for streams such as a loss log
//!   or a trace) a character device or a FIFO. A directory, a block device, a socket — and,
//!   where streams are not allowed, a character device or a FIFO — is an error naming what it
//!   is. Symbolic links are followed ([`resolve_output_path`]): the file at the end of the chain
//!   is written and the links stay links; a dangling link names the file to create. For a new
//!   or regular file the directory must exist and be writable: a probe file named
//!   `.NAME.fsdp-probe.PID.N` is created and removed to find out.
//! - [`write_atomic`] replaces a regular file (or creates one): the bytes go to a temporary file
//!   `.NAME.fsdp-tmp.PID.N` in the same directory (PID: the writer's process id, N: a counter
//!   of the process), which is flushed, `fsync`ed and renamed over the file, and the directory
//!   is `fsync`ed; a failure leaves the previous file as it was. A replaced file keeps its
//!   permissions. [`write_output`] does the same for regular files and writes into a character
//!   device or a FIFO directly (opened for writing, nothing created, nothing replaced).
//! - Temporary files of writers that died ([`remove_stale_temporaries`]): before each write of
//!   `NAME`, the directory's `.NAME.fsdp-tmp.PID[.N]` files whose process no longer exists are
//!   removed. A process is known to be gone when `/proc/PID` does not exist on Linux (with
//!   `/proc` mounted); elsewhere nothing is removed, and the temporaries of this process and of
//!   live processes never are. (A writer in another PID namespace that shares the directory is
//!   invisible in `/proc`: do not let two such writers write the same file at once.)

use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::err;
use crate::FsdpError;

/// What an output path names, after following symbolic links ([`check_output_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// Nothing yet (or a dangling symbolic link, whose target is created): a regular file is
    /// created.
    Absent,
    /// A regular file: replaced atomically ([`write_atomic`]).
    File,
    /// A character device such as `/dev/null`: written into directly, never replaced.
    CharDevice,
    /// A FIFO (named pipe), e.g. read by another program: written into directly, never
    /// replaced.
    Fifo,
}

impl OutputKind {
    /// A character device or a FIFO: written into directly rather than replaced.
    pub fn is_stream(self) -> bool {
        matches!(self, OutputKind::CharDevice | OutputKind::Fifo)
    }
}

/// The marker of temporary files in their names: `.NAME.fsdp-tmp.PID.N`.
pub const TEMPORARY_MARKER: &str = ".fsdp-tmp.";
/// The marker of writability probes in their names: `.NAME.fsdp-probe.PID.N`.
pub const PROBE_MARKER: &str = ".fsdp-probe.";

/// Symbolic links followed at most (Linux's limit).
const MAX_LINKS: usize = 40;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// The directory holding `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The file a write to `path` lands in: `path` itself, or the end of its chain of symbolic
/// links (a relative link is relative to the link's directory). A dangling link gives the path
/// it points to, which a write creates.
///
/// # Errors
/// [`FsdpError::Checkpoint`] when a link cannot be read or the chain is longer than 40 links (a
/// loop).
pub fn resolve_output_path(path: &Path) -> Result<PathBuf, FsdpError> {
    let mut p = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        match fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let target = fs::read_link(&p)
                    .map_err(|e| err(path, format!("cannot read the link {}: {e}", p.display())))?;
                // Joined without normalising `..`: the system resolves it as it does for the
                // link itself.
                p = if target.is_absolute() {
                    target
                } else {
                    parent_dir(&p).join(target)
                };
            }
            _ => return Ok(p),
        }
    }
    Err(err(path, "too many levels of symbolic links"))
}

/// What a file type is, in words (`a directory`, `a FIFO`, ...).
fn describe(ft: &fs::FileType) -> &'static str {
    if ft.is_dir() {
        return "a directory";
    }
    if ft.is_file() {
        return "a regular file";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
        if ft.is_fifo() {
            return "a FIFO";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    "not a regular file"
}

/// The stream kind of `ft`, if it is a character device or a FIFO.
fn stream_kind(ft: &fs::FileType) -> Option<OutputKind> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_char_device() {
            return Some(OutputKind::CharDevice);
        }
        if ft.is_fifo() {
            return Some(OutputKind::Fifo);
        }
    }
    let _ = ft;
    None
}

/// What an output path may be, for the error messages.
fn accepted(allow_stream: bool) -> &'static str {
    if allow_stream {
        "expected an absent path, a regular file, a symbolic link to one, a character device \
         or a FIFO"
    } else {
        "expected an absent path, a regular file or a symbolic link to one"
    }
}

/// Checks that `path` may be written as an output, before any work starts, and says what it
/// names (symbolic links followed, see [`resolve_output_path`]).
///
/// Accepted: an absent path or a dangling link ([`OutputKind::Absent`]) and a regular file
/// ([`OutputKind::File`]), whose directory must exist and be writable (a probe file
/// `.NAME.fsdp-probe.PID.N` is created and removed); with `allow_stream`, also a character
/// device ([`OutputKind::CharDevice`]) or a FIFO ([`OutputKind::Fifo`]), which are written into
/// directly (a FIFO is not opened here: that would wait for its reader).
///
/// # Errors
/// [`FsdpError::Checkpoint`] naming `path` and what is wrong: what it is (`is a directory;
/// expected ...`, through a link `is a symbolic link to T, which is a directory; expected ...`),
/// or that its directory does not exist, is not a directory or is not writable.
pub fn check_output_path(path: &Path, allow_stream: bool) -> Result<OutputKind, FsdpError> {
    if path.file_name().is_none() {
        return Err(err(path, "names no file"));
    }
    let target = resolve_output_path(path)?;
    let kind = match fs::symlink_metadata(&target) {
        // A missing directory (or a file where a directory should be) is named below.
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
            ) =>
        {
            OutputKind::Absent
        }
        Err(e) => return Err(err(path, format!("cannot inspect: {e}"))),
        Ok(m) => {
            let ft = m.file_type();
            match (ft.is_file(), stream_kind(&ft)) {
                (true, _) => OutputKind::File,
                (false, Some(k)) if allow_stream => k,
                _ => {
                    let what = describe(&ft);
                    let is = if target == path {
                        format!("is {what}")
                    } else {
                        format!(
                            "is a symbolic link to {}, which is {what}",
                            target.display()
                        )
                    };
                    return Err(err(path, format!("{is}; {}", accepted(allow_stream))));
                }
            }
        }
    };
    if !kind.is_stream() {
        check_directory(path, &target)?;
    }
    Ok(kind)
}

/// The directory of `target` exists and a file can be created in it.
fn check_directory(path: &Path, target: &Path) -> Result<(), FsdpError> {
    let dir = parent_dir(target);
    match fs::metadata(&dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(err(
                path,
                format!("directory {} does not exist", dir.display()),
            ))
        }
        Err(e) => {
            return Err(err(
                path,
                format!("cannot inspect directory {}: {e}", dir.display()),
            ))
        }
        Ok(m) if !m.is_dir() => {
            return Err(err(path, format!("{} is not a directory", dir.display())))
        }
        Ok(_) => {}
    }
    let probe = side_file(target, PROBE_MARKER);
    match File::options().write(true).create_new(true).open(&probe) {
        Ok(f) => {
            drop(f);
            let _ = fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(err(
            path,
            format!("directory {} is not writable ({e})", dir.display()),
        )),
    }
}

/// `.NAME{marker}PID.N` next to `target`.
fn side_file(target: &Path, marker: &str) -> PathBuf {
    let name = target
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    parent_dir(target).join(format!(
        ".{name}{marker}{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Whether process `pid` may be running: `false` only when it is known to be gone (Linux:
/// `/proc` is mounted and has no `/proc/PID`).
fn process_may_exist(pid: u32) -> bool {
    if cfg!(target_os = "linux") && Path::new("/proc/self").exists() {
        Path::new("/proc").join(pid.to_string()).exists()
    } else {
        true
    }
}

/// The process id in a temporary file's name `.NAME.fsdp-tmp.PID` or `.NAME.fsdp-tmp.PID.N`
/// (`None` for any other name).
fn temporary_pid(entry: &str, name: &str) -> Option<u32> {
    let rest = entry.strip_prefix('.')?.strip_prefix(name)?;
    let rest = rest.strip_prefix(TEMPORARY_MARKER)?;
    let (pid, n) = match rest.split_once('.') {
        Some((pid, n)) => (pid, Some(n)),
        None => (rest, None),
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(pid) || !n.is_none_or(digits) {
        return None;
    }
    pid.parse().ok()
}

/// Removes the temporary files that writers of `path` left behind when they died: the regular
/// files `.NAME.fsdp-tmp.PID` or `.NAME.fsdp-tmp.PID.N` in `path`'s directory (`NAME`: its file
/// name) whose process is known to be gone (Linux: no `/proc/PID`). Those of this process and of
/// running processes stay, and elsewhere than Linux nothing is removed. Best effort: what cannot
/// be read or removed stays. Returns the files removed.
pub fn remove_stale_temporaries(path: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return removed;
    };
    let Ok(entries) = fs::read_dir(parent_dir(path)) else {
        return removed;
    };
    let me = std::process::id();
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name.to_str().and_then(|s| temporary_pid(s, name)) else {
            continue;
        };
        if pid == me || process_may_exist(pid) {
            continue;
        }
        let p = entry.path();
        let is_file = fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_file());
        if is_file && fs::remove_file(&p).is_ok() {
            removed.push(p);
        }
    }
    removed
}

/// Writes `path` atomically: `write` fills a temporary file `.NAME.fsdp-tmp.PID.N` in the same
/// directory, which is then flushed, `fsync`ed and renamed over `path` (and the directory
/// `fsync`ed, where the platform allows). A symbolic link's target is replaced, not the link; a
/// replaced file keeps its permissions. Stale temporaries of `NAME` are removed first
/// ([`remove_stale_temporaries`]). If `write` or any step fails, the temporary file is removed
/// and `path` keeps its previous content.
///
/// # Errors
/// [`FsdpError::Checkpoint`] naming `path`: it is not an absent path, a regular file or a link
/// to one, or its directory is missing or not writable ([`check_output_path`] with
/// `allow_stream = false`), or the write fails.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<(), FsdpError> {
    check_output_path(path, false)?;
    replace(path, &resolve_output_path(path)?, write)
}

/// Writes an output that may also be a stream: a character device or a FIFO (after following
/// symbolic links) is opened for writing and written into directly — nothing is created or
/// replaced; anything else is written as [`write_atomic`] does.
///
/// # Errors
/// [`FsdpError::Checkpoint`] naming `path`: [`check_output_path`] with `allow_stream = true`
/// refuses it, or the write fails.
pub fn write_output(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<(), FsdpError> {
    let kind = check_output_path(path, true)?;
    let target = resolve_output_path(path)?;
    if !kind.is_stream() {
        return replace(path, &target, write);
    }
    let result = (|| -> io::Result<()> {
        let file = File::options().write(true).open(&target)?;
        let mut w = BufWriter::new(file);
        write(&mut w)?;
        w.flush()
    })();
    result.map_err(|e| err(path, format!("cannot write: {e}")))
}

/// The atomic replacement of `target` (the resolved `path`).
fn replace(
    path: &Path,
    target: &Path,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<(), FsdpError> {
    remove_stale_temporaries(target);
    let dir = parent_dir(target);
    let tmp = side_file(target, TEMPORARY_MARKER);
    // The permissions of the file replaced, if any.
    let keep = fs::metadata(target).ok().map(|m| m.permissions());
    let result = (|| -> io::Result<()> {
        let file = File::options().write(true).create_new(true).open(&tmp)?;
        let mut w = BufWriter::new(file);
        write(&mut w)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        if let Some(p) = keep {
            file.set_permissions(p)?;
        }
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, target)?;
        // Make the rename durable. Opening a directory is not possible everywhere (Windows):
        // the rename itself is still atomic there.
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    result.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        err(path, format!("cannot write: {e}"))
    })
}

#[cfg(test)]
mod tests;
