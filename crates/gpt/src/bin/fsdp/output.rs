//! What `fsdp train` writes: the loss log, the final weights, the Chrome trace and the summary
//! of every rank's memory and traffic.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fsdp_collectives::Communicator;
use fsdp_device::{Buffer, DType};
use fsdp_gpt::model::GptConfig;

use crate::args::TrainArgs;
use crate::{fail, CliError};

/// What each rank reports at the end.
pub(crate) struct RankReport {
    /// Per step: the global loss, the step's seconds and the peak allocated bytes so far.
    pub(crate) losses: Vec<(f32, f64, u64)>,
    pub(crate) peak_allocated: u64,
    pub(crate) peak_reserved: u64,
    pub(crate) num_alloc_retries: u64,
    pub(crate) all_gathered: u64,
    pub(crate) reduce_scattered: u64,
    pub(crate) all_reduced: u64,
    pub(crate) final_params: Option<HashMap<String, Vec<f32>>>,
    pub(crate) trace: Vec<fsdp::trace::TraceEvent>,
}

pub(crate) fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Write `contents` to `path` atomically: a temporary file in the same directory, fsync,
/// rename.
fn write_atomic(path: &Path, contents: &[u8]) -> Result<(), CliError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| fail(format!("{} is not a file path", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let io = |e: std::io::Error| fail(format!("cannot write {}: {e}", path.display()));
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(contents).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(e)
    })
}

fn save_checkpoint(
    path: &Path,
    cfg: &GptConfig,
    params: &HashMap<String, Vec<f32>>,
) -> Result<(), CliError> {
    Ok(fsdp_gpt::checkpoint::save_full(path, cfg, params)?)
}

/// The outputs of a finished run, from rank 0's report (and every report's trace): the loss log,
/// the final weights and the Chrome trace.
pub(crate) fn write_outputs(
    args: &TrainArgs,
    cfg: &GptConfig,
    reports: &mut [RankReport],
    global_tokens: usize,
) -> Result<(), CliError> {
    let rank0 = &reports[0];
    if let Some(path) = &args.loss_log {
        let mut csv = String::from("step,loss,tokens_per_s,peak_allocated_bytes_rank0\n");
        for (i, (loss, dt, peak)) in rank0.losses.iter().enumerate() {
            csv.push_str(&format!(
                "{i},{loss:.8},{:.1},{peak}\n",
                global_tokens as f64 / dt
            ));
        }
        write_atomic(path, csv.as_bytes())?;
    }
    if let Some(path) = &args.save {
        let params = rank0
            .final_params
            .as_ref()
            .ok_or_else(|| fail("rank 0 returned no parameters"))?;
        save_checkpoint(path, cfg, params)?;
    }
    if let Some(path) = &args.trace {
        // Under a launcher only rank 0's events are here (the others wrote their own files).
        let per_rank: Vec<Vec<fsdp::trace::TraceEvent>> = reports
            .iter_mut()
            .map(|r| std::mem::take(&mut r.trace))
            .filter(|t| !t.is_empty())
            .collect();
        fsdp::trace::write_chrome_trace(path, &per_rank)?;
    }
    Ok(())
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

/// Every rank's memory and traffic figures, gathered on every rank (for rank 0's summary).
pub(crate) fn gather_rank_stats(
    comm: &dyn Communicator,
    own: &RankReport,
) -> Result<Vec<RankReport>, CliError> {
    // f64 holds these integers exactly (all far below 2^53).
    let mine = [
        own.peak_allocated,
        own.peak_reserved,
        own.num_alloc_retries,
        own.all_gathered,
        own.reduce_scattered,
        own.all_reduced,
    ]
    .map(|v| v as f64);
    let world = comm.world_size();
    let input = Buffer::from_slice(&mine).map_err(|e| fail(e.to_string()))?;
    let output = Buffer::zeros(DType::F64, mine.len() * world).map_err(|e| fail(e.to_string()))?;
    comm.all_gather_base(&input, &output)?.wait()?;
    let all = output.to_vec::<f64>().map_err(|e| fail(e.to_string()))?;
    Ok(all
        .chunks(mine.len())
        .map(|v| RankReport {
            losses: Vec::new(),
            peak_allocated: v[0] as u64,
            peak_reserved: v[1] as u64,
            num_alloc_retries: v[2] as u64,
            all_gathered: v[3] as u64,
            reduce_scattered: v[4] as u64,
            all_reduced: v[5] as u64,
            final_params: None,
            trace: Vec::new(),
        })
        .collect())
}

pub(crate) fn print_summary(
    reports: &[RankReport],
    elapsed: Duration,
    global_tokens: usize,
    steps: usize,
) {
    let losses = &reports[0].losses;
    let first = losses.first().map_or(f32::NAN, |l| l.0);
    let last = losses.last().map_or(f32::NAN, |l| l.0);
    let secs = elapsed.as_secs_f64();
    println!(
        "done: {steps} steps in {secs:.1} s ({:.0} tokens/s); loss {first:.4} -> {last:.4}",
        (global_tokens * steps) as f64 / secs
    );
    println!(
        "{:>4}  {:>14}  {:>14}  {:>11}  {:>16}  {:>16}  {:>16}",
        "rank",
        "peak allocated",
        "peak reserved",
        "alloc retries",
        "all-gathered",
        "reduce-scattered",
        "all-reduced"
    );
    for (rank, r) in reports.iter().enumerate() {
        println!(
            "{:>4}  {:>14}  {:>14}  {:>11}  {:>16}  {:>16}  {:>16}",
            rank,
            human_bytes(r.peak_allocated),
            human_bytes(r.peak_reserved),
            r.num_alloc_retries,
            human_bytes(r.all_gathered),
            human_bytes(r.reduce_scattered),
            human_bytes(r.all_reduced)
        );
    }
}
