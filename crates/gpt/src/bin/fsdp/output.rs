//! What `fsdp train` writes: the loss log (as training goes), the final weights, the Chrome
//! trace and the summary of every rank's memory and traffic.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fsdp::checkpoint::{check_output_path, resolve_output_path};
use fsdp::human_bytes;

use fsdp_collectives::Communicator;
use fsdp_device::{Buffer, DType};
use fsdp_gpt::model::GptConfig;

use crate::args::TrainArgs;
use crate::paths::output_error;
use crate::progress::say_done;
use crate::say;
use crate::{fail, CliError};

/// The first line of the loss log.
pub(crate) const LOSS_LOG_HEADER: &str = "step,loss,tokens_per_s,peak_allocated_bytes_rank0";

/// The loss log (`--loss-log`), written by rank 0 as training goes: the header when it is
/// created, then one line `step,loss,tokens_per_s,peak_allocated_bytes_rank0` per step, each
/// handed to the system at once (one `write`, no buffering), so a run that is killed or fails
/// keeps every finished step as a complete line. A regular file (or a symbolic link's target) is
/// written in place — an existing file is truncated when training starts — and a character
/// device or a FIFO is written into directly. A failed write stops the log and is reported when
/// training ends (the other outputs are still written).
pub(crate) struct LossLog {
    path: PathBuf,
    file: File,
    regular: bool,
    error: Option<std::io::Error>,
}

impl LossLog {
    /// Opens (creates or truncates) the log at `path` and writes its header. A FIFO waits here
    /// for its reader.
    pub(crate) fn create(path: &Path) -> Result<Self, CliError> {
        let named = |e| output_error("--loss-log", e);
        let kind = check_output_path(path, true).map_err(named)?;
        let target = resolve_output_path(path).map_err(named)?;
        let regular = !kind.is_stream();
        let file = File::options()
            .write(true)
            .create(regular)
            .truncate(regular)
            .open(&target)
            .map_err(|e| fail(format!("--loss-log {}: cannot open: {e}", path.display())))?;
        let mut log = LossLog {
            path: path.to_path_buf(),
            file,
            regular,
            error: None,
        };
        log.write(&format!("{LOSS_LOG_HEADER}\n"));
        match log.error.take() {
            Some(e) => Err(log.write_error(e)),
            None => Ok(log),
        }
    }

    /// Opens the log of a run resumed at step `start` (`--resume`): an existing log keeps its
    /// header and its complete lines of steps before `start` (the lines of steps the resumed
    /// run repeats are dropped), and the new lines follow; an absent one is created with its
    /// header, and a character device or a FIFO gets the header. An existing file whose first
    /// line is not the loss log's header is an error (it is not written).
    pub(crate) fn resume(path: &Path, start: usize) -> Result<Self, CliError> {
        use std::io::{Read, Seek, SeekFrom};
        let named = |e| output_error("--loss-log", e);
        let kind = check_output_path(path, true).map_err(named)?;
        if kind.is_stream() || !resolve_output_path(path).map_err(named)?.exists() {
            return Self::create(path);
        }
        let target = resolve_output_path(path).map_err(named)?;
        let cannot = |what: &str, e: std::io::Error| {
            fail(format!("--loss-log {}: cannot {what}: {e}", path.display()))
        };
        let mut file = File::options()
            .read(true)
            .write(true)
            .open(&target)
            .map_err(|e| cannot("open", e))?;
        let mut text = String::new();
        file.read_to_string(&mut text)
            .map_err(|e| cannot("read", e))?;
        if text.is_empty() {
            drop(file);
            return Self::create(path);
        }
        let header = format!("{LOSS_LOG_HEADER}\n");
        if !text.starts_with(&header) {
            return Err(fail(format!(
                "--loss-log {}: its first line is not `{LOSS_LOG_HEADER}`: not a loss log to \
                 continue (give another path)",
                path.display()
            )));
        }
        // Complete lines of steps before `start`, in order.
        let mut keep = header.len();
        for line in text[header.len()..].split_inclusive('\n') {
            let step = line.split(',').next().and_then(|s| s.parse::<usize>().ok());
            match step {
                Some(s) if s < start && line.ends_with('\n') => keep += line.len(),
                _ => break,
            }
        }
        file.set_len(keep as u64)
            .and_then(|()| file.seek(SeekFrom::End(0)).map(drop))
            .map_err(|e| cannot("write", e))?;
        Ok(LossLog {
            path: path.to_path_buf(),
            file,
            regular: true,
            error: None,
        })
    }

    /// Writes the line of one finished step.
    pub(crate) fn step(&mut self, step: usize, loss: f32, tokens_per_s: f64, peak: u64) {
        self.write(&format!("{step},{loss:.8},{tokens_per_s:.1},{peak}\n"));
    }

    fn write(&mut self, line: &str) {
        if self.error.is_none() {
            if let Err(e) = self.file.write_all(line.as_bytes()) {
                self.error = Some(e);
            }
        }
    }

    fn write_error(&self, e: std::io::Error) -> CliError {
        fail(format!(
            "--loss-log {}: cannot write: {e}",
            self.path.display()
        ))
    }

    /// Ends the log: a regular file is synced to its disk; a write that failed is the error.
    pub(crate) fn finish(mut self) -> Result<(), CliError> {
        if self.regular && self.error.is_none() {
            if let Err(e) = self.file.sync_all() {
                self.error = Some(e);
            }
        }
        match self.error.take() {
            Some(e) => Err(self.write_error(e)),
            None => Ok(()),
        }
    }
}

/// What each rank reports at the end.
pub(crate) struct RankReport {
    /// Per step: the global loss, the step's seconds and the peak allocated bytes so far.
    pub(crate) losses: Vec<(f32, f64, u64)>,
    pub(crate) peak_allocated: u64,
    pub(crate) peak_reserved: u64,
    pub(crate) num_alloc_retries: u64,
    /// The model's activations (peak, peak with the allocator's bytes, recomputations).
    pub(crate) activations: fsdp::engine::ActivationStats,
    pub(crate) all_gathered: u64,
    pub(crate) reduce_scattered: u64,
    pub(crate) all_reduced: u64,
    pub(crate) final_params: Option<HashMap<String, Vec<f32>>>,
    pub(crate) trace: Vec<fsdp::trace::TraceEvent>,
}

pub(crate) fn save_checkpoint(
    path: &Path,
    cfg: &GptConfig,
    params: &HashMap<String, Vec<f32>>,
) -> Result<(), CliError> {
    fsdp_gpt::checkpoint::save_full(path, cfg, params).map_err(|e| output_error("--save", e))
}

/// The outputs of a finished run, from rank 0's report (and every report's trace): the final
/// weights and the Chrome trace (the loss log is written as training goes: [`LossLog`]).
pub(crate) fn write_outputs(
    args: &TrainArgs,
    cfg: &GptConfig,
    reports: &mut [RankReport],
) -> Result<(), CliError> {
    let rank0 = &reports[0];
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
        fsdp::trace::write_chrome_trace(path, &per_rank).map_err(|e| output_error("--trace", e))?;
    }
    Ok(())
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
        own.activations.peak,
        own.activations.peak_allocated,
        own.activations.recomputations,
    ]
    .map(|v| v as f64);
    let all = all_gather_f64(comm, &mine)?;
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
            activations: fsdp::engine::ActivationStats {
                current: 0,
                peak: v[6] as u64,
                peak_allocated: v[7] as u64,
                recomputations: v[8] as u64,
            },
            final_params: None,
            trace: Vec::new(),
        })
        .collect())
}

/// Every rank's `mine`, in rank order, over `comm`: in host memory, or staged through its GPU
/// when the backend moves buffers on one (NCCL).
fn all_gather_f64(comm: &dyn Communicator, mine: &[f64]) -> Result<Vec<f64>, CliError> {
    let dev = |e: fsdp_device::DeviceError| fail(format!("gathering the ranks' statistics: {e}"));
    let world = comm.world_size();
    let fsdp_device::Device::Cuda(n) = comm.device() else {
        let host = Buffer::from_slice(mine).map_err(dev)?;
        let output = Buffer::zeros(DType::F64, mine.len() * world).map_err(dev)?;
        comm.all_gather_base(&host, &output)?.wait()?;
        return output.to_vec::<f64>().map_err(dev);
    };
    let stream = fsdp_device::Stream::cuda(n, "statistics").map_err(dev)?;
    let pinned = Buffer::pinned_zeros(DType::F64, mine.len()).map_err(dev)?;
    pinned.write::<f64>().map_err(dev)?.copy_from_slice(mine);
    let input = Buffer::cuda_zeros(DType::F64, mine.len(), &stream).map_err(dev)?;
    input.copy_from_host_async(&pinned, &stream).map_err(dev)?;
    let output = Buffer::cuda_zeros(DType::F64, mine.len() * world, &stream).map_err(dev)?;
    comm.all_gather_base(&input, &output)?.wait()?;
    let back = Buffer::pinned_zeros(DType::F64, mine.len() * world).map_err(dev)?;
    output.copy_to_host_async(&back, &stream).map_err(dev)?;
    // The read waits for the copy (the pinned buffer's ticket).
    back.to_vec::<f64>().map_err(dev)
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
    say_done(steps, elapsed, global_tokens, first, last);
    say!(
        "{:>4}  {:>14}  {:>14}  {:>11}  {:>16}  {:>16}  {:>16}  {:>11}  {:>14}",
        "rank",
        "peak allocated",
        "peak reserved",
        "alloc retries",
        "all-gathered",
        "reduce-scattered",
        "all-reduced",
        "activations",
        "alloc + activ."
    );
    for (rank, r) in reports.iter().enumerate() {
        say!(
            "{:>4}  {:>14}  {:>14}  {:>11}  {:>16}  {:>16}  {:>16}  {:>11}  {:>14}",
            rank,
            human_bytes(r.peak_allocated),
            human_bytes(r.peak_reserved),
            r.num_alloc_retries,
            human_bytes(r.all_gathered),
            human_bytes(r.reduce_scattered),
            human_bytes(r.all_reduced),
            human_bytes(r.activations.peak),
            human_bytes(r.activations.peak_allocated)
        );
    }
    say!(
        "(activations: the peak of the model's saved activations (host memory); alloc + \
         activ.: the peak of the allocator's bytes plus the activations held at the same moment)"
    );
    if let Some(r) = reports.first().filter(|r| r.activations.recomputations > 0) {
        say!(
            "activation checkpointing: {} block forwards recomputed by each rank, no extra \
             all-gather",
            r.activations.recomputations
        );
    }
}
