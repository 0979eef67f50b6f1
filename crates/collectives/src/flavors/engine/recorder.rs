//! The flight recorder (PyTorch's NCCL flight recorder): every communicator keeps its last N
//! collectives — sequence number, operation, input and output sizes, element type, state
//! (scheduled, started, completed, failed) and times — in a ring buffer. On the first timeout or
//! abort it writes them as JSON (`<dir>/fsdp_flight_recorder_rank<R>.json`), logs one summary
//! line, and names the rank that is behind: the ranks publish their progress (last collective
//! entered, last completed) on a [`ProgressBoard`], the group's shared board for threads and the
//! rendezvous store for processes.
//!
//! `FSDP_FLIGHT_RECORDER_SIZE` sets N (default 2000, as PyTorch's; 0 disables the recorder) and
//! `FSDP_FLIGHT_RECORDER_DIR` the directory (default: the system's temporary directory).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::flavors::desc::{OpDesc, Sizes, OPS};

/// Entries kept when `FSDP_FLIGHT_RECORDER_SIZE` is not set.
pub(crate) const DEFAULT_SIZE: usize = 2000;
/// Number of entries kept (0 disables the recorder).
pub const SIZE_ENV: &str = "FSDP_FLIGHT_RECORDER_SIZE";
/// Directory of the dumps.
pub const DIR_ENV: &str = "FSDP_FLIGHT_RECORDER_DIR";

/// How far one rank got: the last collective it entered (its sequence number and operation) and
/// the last it completed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Progress {
    pub entered: Option<(u64, &'static str)>,
    pub completed: Option<u64>,
}

impl Progress {
    /// Text form, for the store: `<entered> <op> <completed>` with `-` for none.
    pub fn encode(&self) -> String {
        let (e, op) = self
            .entered
            .map_or(("-".to_string(), "-"), |(s, op)| (s.to_string(), op));
        let c = self.completed.map_or("-".to_string(), |c| c.to_string());
        format!("{e} {op} {c}")
    }

    /// Parse [`encode`](Progress::encode)'s text; `None` if it is not that.
    pub fn decode(s: &str) -> Option<Progress> {
        let mut it = s.split(' ');
        let (e, op, c) = (it.next()?, it.next()?, it.next()?);
        let entered = match e {
            "-" => None,
            e => Some((e.parse().ok()?, *OPS.iter().find(|&&o| o == op)?)),
        };
        let completed = match c {
            "-" => None,
            c => Some(c.parse().ok()?),
        };
        Some(Progress { entered, completed })
    }

    /// Order of "how far": entered first, then completed (`None` is before everything).
    fn key(&self) -> (Option<u64>, Option<u64>) {
        (self.entered.map(|(s, _)| s), self.completed)
    }
}

/// Where the ranks of a group publish their progress for each other.
pub(crate) trait ProgressBoard: Send + Sync {
    /// Publish `rank`'s progress (cheap; may be coalesced and published later).
    fn publish(&self, rank: usize, p: &Progress);
    /// Every rank's last published progress (`None`: nothing known), by rank; an error when the
    /// board itself could not be read (a store behind the failure being reported), naming why.
    fn read(&self) -> Result<Vec<Option<Progress>>, String>;
}

/// A progress board in memory, for ranks that are threads of one process (one lock per rank, so
/// that ranks never wait for each other to publish).
pub(crate) struct SharedProgress(Vec<Mutex<Option<Progress>>>);

impl SharedProgress {
    pub fn new(world: usize) -> SharedProgress {
        SharedProgress((0..world).map(|_| Mutex::new(None)).collect())
    }
}

impl ProgressBoard for SharedProgress {
    fn publish(&self, rank: usize, p: &Progress) {
        *self.0[rank].lock().unwrap_or_else(|e| e.into_inner()) = Some(p.clone());
    }

    fn read(&self) -> Result<Vec<Option<Progress>>, String> {
        Ok(self
            .0
            .iter()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .collect())
    }
}

/// State of a recorded collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Scheduled,
    Started,
    Completed,
    Failed,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Scheduled => "scheduled",
            State::Started => "started",
            State::Completed => "completed",
            State::Failed => "failed",
        }
    }
}

struct Entry {
    seq: u64,
    op: &'static str,
    input: Vec<usize>,
    output: Vec<usize>,
    dtype: Option<&'static str>,
    state: State,
    scheduled: Instant,
    started: Option<Instant>,
    ended: Option<Instant>,
}

/// What a recorder needs to know about its communicator.
pub(crate) struct RecorderParts {
    pub rank: usize,
    pub world: usize,
    pub backend: &'static str,
    /// The group's name: the dump of a sub-group gets it in its file name.
    pub group: String,
    /// Whether this is the group every rank starts with (its dump is `..._rank<R>.json`).
    pub root_group: bool,
    pub progress: Option<Arc<dyn ProgressBoard>>,
}

/// One communicator's flight recorder.
pub(crate) struct FlightRecorder {
    parts: RecorderParts,
    capacity: usize,
    dir: PathBuf,
    entries: Mutex<VecDeque<Entry>>,
    mine: Mutex<Progress>,
    dumped: AtomicBool,
}

/// The recorder's size from `FSDP_FLIGHT_RECORDER_SIZE` (default [`DEFAULT_SIZE`]); a value
/// that is not a number is reported and the default used.
fn configured_size() -> usize {
    match std::env::var(SIZE_ENV) {
        Err(_) => DEFAULT_SIZE,
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!("{SIZE_ENV}={v:?} is not a number of entries; using {DEFAULT_SIZE}");
            DEFAULT_SIZE
        }),
    }
}

impl FlightRecorder {
    /// A recorder configured from the environment; `None` when disabled (size 0).
    pub fn from_env(parts: RecorderParts) -> Option<Arc<FlightRecorder>> {
        if cfg!(miri) {
            // Miri isolates the file system and the wall clock that a dump needs.
            return None;
        }
        let capacity = configured_size();
        let dir = std::env::var_os(DIR_ENV).map_or_else(std::env::temp_dir, PathBuf::from);
        (capacity > 0).then(|| Arc::new(FlightRecorder::new(parts, capacity, dir)))
    }

    pub fn new(parts: RecorderParts, capacity: usize, dir: PathBuf) -> FlightRecorder {
        FlightRecorder {
            parts,
            capacity,
            dir,
            entries: Mutex::new(VecDeque::with_capacity(capacity.min(4096))),
            mine: Mutex::new(Progress::default()),
            dumped: AtomicBool::new(false),
        }
    }

    fn entries(&self) -> MutexGuard<'_, VecDeque<Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Collective `seq` was issued (enqueued on the communication stream).
    pub fn scheduled(&self, seq: u64, desc: &OpDesc) {
        let n = self.parts.world;
        let c = desc.count;
        let (input, output) = match desc.op {
            "all_gather_base" => (vec![c], vec![c * n]),
            "reduce_scatter_base" => (vec![c * n], vec![c]),
            "all_reduce" | "broadcast" | "reduce" => (vec![c], vec![c]),
            "all_gather" => match &desc.sizes {
                Some(Sizes::List(s)) => (vec![c], s.clone()),
                _ => (vec![c], Vec::new()),
            },
            _ => (Vec::new(), Vec::new()),
        };
        let mut entries = self.entries();
        if entries.len() == self.capacity {
            entries.pop_front();
        }
        entries.push_back(Entry {
            seq,
            op: desc.op,
            input,
            output,
            dtype: desc.dtype.map(|d| d.name()),
            state: State::Scheduled,
            scheduled: Instant::now(),
            started: None,
            ended: None,
        });
    }

    fn update(&self, seq: u64, f: impl FnOnce(&mut Entry)) {
        if let Some(e) = self.entries().iter_mut().rev().find(|e| e.seq == seq) {
            f(e);
        }
    }

    fn publish(&self, change: impl FnOnce(&mut Progress)) {
        let mut mine = self.mine.lock().unwrap_or_else(|e| e.into_inner());
        change(&mut mine);
        if let Some(board) = &self.parts.progress {
            board.publish(self.parts.rank, &mine);
        }
    }

    /// The stream started collective `seq` (it enters the exchange with its peers).
    pub fn started(&self, seq: u64, op: &'static str) {
        self.update(seq, |e| {
            e.state = State::Started;
            e.started = Some(Instant::now());
        });
        self.publish(|p| p.entered = Some((seq, op)));
    }

    /// Collective `seq` ended, successfully or not.
    pub fn ended(&self, seq: u64, ok: bool) {
        self.update(seq, |e| {
            if e.ended.is_none() {
                e.state = if ok { State::Completed } else { State::Failed };
                e.ended = Some(Instant::now());
            }
        });
        if ok {
            self.publish(|p| p.completed = Some(seq));
        }
    }

    /// On the first failure of the communicator: write the dump, log the summary line and return
    /// what the error should add (the rank that is behind and where the dump is). Later calls
    /// return `None`.
    pub fn dump(&self, reason: &str) -> Option<String> {
        if self.dumped.swap(true, Ordering::SeqCst) {
            return None;
        }
        let rank = self.parts.rank;
        let read = self
            .parts
            .progress
            .as_ref()
            .map_or_else(|| Ok(vec![None; self.parts.world]), |b| b.read());
        let (mut progress, unread) = match read {
            Ok(p) => (p, None),
            Err(why) => (vec![None; self.parts.world], Some(why)),
        };
        progress[rank] = Some(self.mine.lock().unwrap_or_else(|e| e.into_inner()).clone());
        let behind = match unread {
            None => self.behind(&progress),
            Some(why) => format!("the other ranks' progress is unknown: {why}"),
        };
        let path = self.path();
        let written = self.write(&path, reason, &progress, &behind);
        let summary = match &written {
            Ok(()) => format!("{behind}; flight recorder dump: {}", path.display()),
            Err(e) => format!(
                "{behind}; the flight recorder could not write {}: {e}",
                path.display()
            ),
        };
        tracing::error!(
            rank,
            backend = self.parts.backend,
            group = %self.parts.group,
            "flight recorder: {summary}"
        );
        Some(summary)
    }

    fn path(&self) -> PathBuf {
        let r = self.parts.rank;
        let name = if self.parts.root_group {
            format!("fsdp_flight_recorder_rank{r}.json")
        } else {
            let g: String = self
                .parts
                .group
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            format!("fsdp_flight_recorder_rank{r}_{g}.json")
        };
        self.dir.join(name)
    }

    /// Name the ranks that are behind (the least far, by last entered then last completed) and
    /// the collective they never entered.
    fn behind(&self, progress: &[Option<Progress>]) -> String {
        let known: Vec<(usize, &Progress)> = progress
            .iter()
            .enumerate()
            .filter_map(|(r, p)| p.as_ref().map(|p| (r, p)))
            .collect();
        let silent: Vec<usize> = (0..progress.len())
            .filter(|&r| progress[r].is_none())
            .collect();
        let Some(min) = known.iter().map(|(_, p)| p.key()).min() else {
            return "no rank's progress is known".into();
        };
        let lagging: Vec<usize> = known
            .iter()
            .filter(|(_, p)| p.key() == min)
            .map(|(r, _)| *r)
            .collect();
        let furthest = known.iter().map(|(_, p)| p).max_by_key(|p| p.key());
        let fmt_seq = |s: Option<u64>| s.map_or("none".to_string(), |s| format!("#{s}"));
        let next = min.0.map_or(0, |s| s + 1);
        let who = if lagging.len() == 1 {
            format!("rank {}", lagging[0])
        } else {
            format!("ranks {lagging:?}")
        };
        let mut out = if furthest.is_some_and(|f| f.key() == min) {
            format!(
                "every rank reporting progress reached the same point (last entered {}, last \
                 completed {})",
                fmt_seq(min.0),
                fmt_seq(min.1)
            )
        } else {
            let never = self.op_of(next).or_else(|| {
                furthest
                    .and_then(|f| f.entered)
                    .filter(|&(s, _)| s == next)
                    .map(|(_, op)| op)
            });
            format!(
                "{who} {} behind (lowest progress: last entered {}, last completed {}) and \
                 never entered {} (collective #{next})",
                if lagging.len() == 1 { "is" } else { "are" },
                fmt_seq(min.0),
                fmt_seq(min.1),
                never.unwrap_or("the next collective"),
            )
        };
        if !silent.is_empty() {
            out.push_str(&format!("; ranks {silent:?} published no progress"));
        }
        out
    }

    /// The operation of collective `seq` as this rank recorded it.
    fn op_of(&self, seq: u64) -> Option<&'static str> {
        self.entries().iter().find(|e| e.seq == seq).map(|e| e.op)
    }

    fn write(
        &self,
        path: &Path,
        reason: &str,
        progress: &[Option<Progress>],
        behind: &str,
    ) -> std::io::Result<()> {
        // Wall-clock times: the clock read once, here (no clock read per collective).
        let (now, wall_now) = (Instant::now(), SystemTime::now());
        let ns = |t: Instant| -> u128 {
            let wall = wall_now - now.saturating_duration_since(t);
            wall.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
        };
        let entries: Vec<Value> = self
            .entries()
            .iter()
            .enumerate()
            .map(|(i, e)| {
                json!({
                    "record_id": i,
                    "collective_seq_id": e.seq,
                    "profiling_name": e.op,
                    "input_sizes": e.input,
                    "output_sizes": e.output,
                    "dtype": e.dtype,
                    "state": e.state.name(),
                    "time_created_ns": ns(e.scheduled),
                    "time_discovered_started_ns": e.started.map(ns),
                    "time_discovered_completed_ns": e.ended.map(ns),
                    "duration_ms": e.started.zip(e.ended)
                        .map(|(s, d)| d.saturating_duration_since(s).as_secs_f64() * 1e3),
                })
            })
            .collect();
        let progress: Vec<Value> = progress
            .iter()
            .enumerate()
            .map(|(r, p)| match p {
                None => json!({ "rank": r }),
                Some(p) => json!({
                    "rank": r,
                    "last_entered": p.entered.map(|(s, _)| s),
                    "last_entered_op": p.entered.map(|(_, op)| op),
                    "last_completed": p.completed,
                }),
            })
            .collect();
        let doc = json!({
            "version": "1",
            "rank": self.parts.rank,
            "world_size": self.parts.world,
            "backend": self.parts.backend,
            "group": self.parts.group,
            "reason": reason,
            "behind": behind,
            "progress": progress,
            "entries": entries,
        });
        std::fs::create_dir_all(&self.dir)?;
        // Write then rename, so that a reader never sees half a file.
        let tmp = path.with_extension(format!("json.tmp{}", std::process::id()));
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(&doc).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
#[path = "recorder_tests.rs"]
mod tests;
