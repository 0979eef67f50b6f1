//! The output paths of `fsdp train` — `--save`, `--loss-log`, `--trace` and, under a launcher,
//! the other ranks' trace files — checked before any rank starts, with the library's rules
//! ([`fsdp::checkpoint::check_output_path`]): `--save` takes an absent path, a regular file or a
//! symbolic link to one; `--loss-log` and `--trace` also a character device or a FIFO, written
//! into directly. Every error is one line naming the option, the path and what is wrong.

use std::path::{Path, PathBuf};

use fsdp::checkpoint::{check_output_path, resolve_output_path, OutputKind};
use fsdp::FsdpError;

use crate::args::TrainArgs;
use crate::{fail, CliError};

/// An error about the output of `option`: `OPTION PATH: what is wrong`.
pub(crate) fn output_error(option: &str, e: FsdpError) -> CliError {
    match e {
        FsdpError::Checkpoint { path, reason } => {
            fail(format!("{option} {}: {reason}", path.display()))
        }
        other => fail(format!("{option}: {other}")),
    }
}

/// `path` with `.rankN` before its extension.
pub(crate) fn rank_path(path: &Path, rank: usize) -> PathBuf {
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// The trace file of rank `rank` > 0 under a launcher: `--trace` with `.rankN` before its
/// extension, or `--trace` itself when it is a character device (`/dev/null`: every rank writes
/// into it rather than creating `/dev/null.rankN`).
pub(crate) fn rank_trace_path(trace: &Path, rank: usize) -> PathBuf {
    match check_output_path(trace, true) {
        Ok(OutputKind::CharDevice) => trace.to_path_buf(),
        _ => rank_path(trace, rank),
    }
}

/// The file a path will be written to, for comparing outputs: its directory made canonical
/// (symbolic links followed) and its name.
fn identity(path: &Path) -> Option<PathBuf> {
    let target = resolve_output_path(path).ok()?;
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    Some(std::fs::canonicalize(dir).ok()?.join(target.file_name()?))
}

/// Checks every output path of `args` before any rank starts: what it names (see the module
/// documentation), that the directory of a file to write exists and is writable, that no two
/// outputs are the same file and that no output is an input (`--data`, `--init-from`; except
/// that `--save` may replace `--init-from`). `world` ranks started by a launcher (`launched`)
/// also write `--trace` with `.rankN` (ranks 1 to `world - 1`); every process checks all of
/// them, so all fail alike.
pub(crate) fn check_output_paths(
    args: &TrainArgs,
    world: usize,
    launched: bool,
) -> Result<(), CliError> {
    let mut outputs: Vec<(String, PathBuf, bool)> = Vec::new();
    if let Some(p) = &args.save {
        outputs.push(("--save".into(), p.clone(), false));
    }
    if let Some(p) = &args.loss_log {
        outputs.push(("--loss-log".into(), p.clone(), true));
    }
    if let Some(p) = &args.memory_snapshot {
        outputs.push(("--memory-snapshot".into(), p.clone(), true));
    }
    if let Some(p) = &args.trace {
        outputs.push(("--trace".into(), p.clone(), true));
        if launched {
            for rank in 1..world {
                outputs.push((
                    format!("--trace (rank {rank}'s file)"),
                    rank_trace_path(p, rank),
                    true,
                ));
            }
        }
    }
    // The inputs: `--save` may replace the `--init-from` file (continuing a run in place; the
    // weights are read before training and replaced atomically after it), nothing else may.
    let inputs: Vec<(&str, PathBuf)> = [("--data", &args.data), ("--init-from", &args.init_from)]
        .into_iter()
        .filter_map(|(option, p)| Some((option, identity(p.as_ref()?)?)))
        .collect();
    let mut files: Vec<(&str, PathBuf)> = Vec::new();
    for (option, path, allow_stream) in &outputs {
        let kind = check_output_path(path, *allow_stream).map_err(|e| output_error(option, e))?;
        if kind.is_stream() {
            continue;
        }
        if let Some(id) = identity(path) {
            let replaceable = |input: &str| option == "--save" && input == "--init-from";
            if let Some((input, _)) = inputs
                .iter()
                .find(|(input, f)| *f == id && !replaceable(input))
            {
                return Err(fail(format!(
                    "{option} {} is the {input} file: an output never overwrites an input",
                    path.display()
                )));
            }
            if let Some((first, _)) = files.iter().find(|(_, f)| *f == id) {
                return Err(fail(format!(
                    "{first} and {option} name the same file {}",
                    path.display()
                )));
            }
            files.push((option, id));
        }
    }
    Ok(())
}
