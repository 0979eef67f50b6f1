//! The running children: spawning them so that they die with the launcher, forwarding their
//! output line by line, stopping and reaping them.

use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{RankOutcome, OUTPUT_GRACE, POLL, REAP_GRACE};

pub(super) type Sink = Arc<Mutex<Box<dyn Write + Send>>>;

pub(super) struct Proc {
    pub(super) rank: usize,
    pub(super) local_rank: usize,
    pub(super) child: Child,
    pub(super) outcome: Option<(RankOutcome, Duration)>,
    /// Its error file says it failed because a peer left.
    pub(super) peer_left: bool,
}

/// The running children and their output forwarders; stops the children on drop.
pub(super) struct Job {
    pub(super) procs: Vec<Proc>,
    pub(super) forwarders: Vec<JoinHandle<()>>,
    pub(super) forwarders_done: Arc<AtomicUsize>,
}

impl Job {
    pub(super) fn forward<R: Read + Send + 'static>(&mut self, pipe: R, rank: usize, sink: &Sink) {
        let sink = Arc::clone(sink);
        let done = Arc::clone(&self.forwarders_done);
        let spawned = std::thread::Builder::new()
            .name(format!("launch-output-{rank}"))
            .spawn(move || {
                forward_lines(pipe, rank, &sink);
                done.fetch_add(1, Ordering::SeqCst);
            });
        match spawned {
            Ok(h) => self.forwarders.push(h),
            // The pipe is dropped with the closure: the child gets EPIPE if it writes.
            Err(e) => tracing::warn!(rank, error = %e, "cannot start an output forwarder"),
        }
    }

    /// Kills every child still running and reaps it (boundedly).
    pub(super) fn stop_all(&mut self, start: Instant) {
        // One that ended on its own since the last look keeps its real status (a `kill -9`
        // from outside included).
        for p in self.procs.iter_mut().filter(|p| p.outcome.is_none()) {
            if let Ok(Some(status)) = p.child.try_wait() {
                p.outcome = Some((outcome_of(status), start.elapsed()));
            }
        }
        for p in self.procs.iter_mut().filter(|p| p.outcome.is_none()) {
            let _ = p.child.kill();
        }
        let deadline = Instant::now() + REAP_GRACE;
        for p in self.procs.iter_mut().filter(|p| p.outcome.is_none()) {
            loop {
                match p.child.try_wait() {
                    Ok(Some(status)) => {
                        // One that ended on its own before the kill keeps its real status.
                        let outcome = match outcome_of(status) {
                            RankOutcome::Signaled(9) => RankOutcome::Stopped,
                            o => o,
                        };
                        p.outcome = Some((outcome, start.elapsed()));
                        break;
                    }
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
                    _ => {
                        tracing::warn!(rank = p.rank, "a killed child could not be reaped");
                        p.outcome = Some((RankOutcome::Stopped, start.elapsed()));
                        break;
                    }
                }
            }
        }
    }

    /// Waits (boundedly) for the forwarders to drain the children's output.
    pub(super) fn finish_output(&mut self, err: &Sink) {
        let total = self.forwarders.len();
        let deadline = Instant::now() + OUTPUT_GRACE;
        while self.forwarders_done.load(Ordering::SeqCst) < total && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        let open = total - self.forwarders_done.load(Ordering::SeqCst).min(total);
        if open > 0 {
            launcher_message(
                err,
                &format!(
                    "{open} output stream(s) are still open after the ranks ended (processes \
                     they started are still running?); no longer waiting for them"
                ),
            );
        }
        for h in std::mem::take(&mut self.forwarders) {
            if h.is_finished() {
                let _ = h.join();
            }
            // Unfinished forwarders are detached; they end when the pipe closes.
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let start = Instant::now();
        self.stop_all(start);
    }
}

/// Copies `pipe` to `sink` line by line with the rank's prefix.
pub(super) fn forward_lines<R: Read>(pipe: R, rank: usize, sink: &Sink) {
    let prefix = format!("[rank {rank}] ");
    let mut reader = BufReader::new(pipe);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) => {
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                let mut w = sink.lock().unwrap_or_else(|e| e.into_inner());
                // A closed or failing sink must not stall the child: keep draining.
                let _ = w
                    .write_all(prefix.as_bytes())
                    .and_then(|()| w.write_all(&line))
                    .and_then(|()| w.flush());
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

pub(super) fn launcher_message(sink: &Sink, msg: &str) {
    tracing::info!("{msg}");
    let mut w = sink.lock().unwrap_or_else(|e| e.into_inner());
    let _ = writeln!(w, "[launcher] {msg}").and_then(|()| w.flush());
}

/// Makes the child started by `cmd` die with this process (Linux; elsewhere nothing): the
/// child asks for `SIGKILL` on its parent's death, then checks that its parent is still this
/// process — if the launcher died before the request took effect, the child was re-parented
/// already and no signal will come, so it exits before executing the program.
#[cfg(target_os = "linux")]
pub(super) fn die_with_launcher(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let launcher = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-safe
    // calls are allowed: `prctl` and `getppid` are system calls, and building an `io::Error`
    // from an error number does not allocate. It touches no memory shared with the parent.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                // The launcher is gone: do not start an orphan rank.
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn die_with_launcher(_cmd: &mut Command) {}

pub(super) fn outcome_of(status: ExitStatus) -> RankOutcome {
    if let Some(code) = status.code() {
        return RankOutcome::Exited(code);
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return RankOutcome::Signaled(sig);
        }
    }
    RankOutcome::Stopped
}

pub(super) fn spawn_error(program: &OsString, e: &io::Error) -> String {
    let shown = program.to_string_lossy();
    let searched = !shown.contains('/');
    match e.kind() {
        io::ErrorKind::NotFound if searched => {
            format!("cannot start program {shown:?}: not found in PATH")
        }
        io::ErrorKind::NotFound => format!("cannot start program {shown:?}: not found"),
        io::ErrorKind::PermissionDenied => {
            format!("cannot start program {shown:?}: permission denied (not executable?)")
        }
        _ => format!("cannot start program {shown:?}: {e}"),
    }
}

/// A port that is free on `addr` right now (the operating system's choice).
pub(super) fn free_port(addr: &str) -> io::Result<u16> {
    Ok(TcpListener::bind((addr, 0))?.local_addr()?.port())
}
