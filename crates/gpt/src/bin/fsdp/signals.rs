//! SIGTERM, SIGINT, SIGHUP and SIGQUIT of a rank under torchrun.
//!
//! torchrun ends every worker with SIGTERM when one fails (or it is interrupted). A rank that
//! receives one gets a short grace to fail on its own (it usually has just seen the peer that
//! left, and its error names that peer); otherwise it writes torchelastic's error file saying it
//! was stopped by the signal, aborts its communicator with that reason (the peers' collectives
//! fail at once with `communicator aborted: rank R: stopped by SIGTERM ...`, not a bare "rank R
//! has left"), and exits. A second signal ends it without the grace.

use std::sync::Mutex;
use std::time::Duration;

use fsdp_collectives::{AbortHandle, Communicator};

use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
use signal_hook::iterator::Signals;

/// How long a signalled rank waits for its own error before it reports the signal.
const GRACE: Duration = Duration::from_millis(1500);

/// The communicators a signal aborts.
static ABORTS: Mutex<Vec<AbortHandle>> = Mutex::new(Vec::new());

/// A signal handled by [`install_under_torchrun`] aborts `comm`'s group with its reason (where
/// the backend can: [`Communicator::abort_handle`]).
pub(crate) fn abort_on_signal(comm: &dyn Communicator) {
    if let Some(h) = comm.abort_handle() {
        ABORTS.lock().unwrap_or_else(|e| e.into_inner()).push(h);
    }
}

/// Under torchrun (`TORCHELASTIC_RESTART_COUNT` is set), starts the thread that handles the
/// signals; elsewhere the default actions stay.
pub(crate) fn install_under_torchrun() {
    if std::env::var_os(fsdp_collectives::torchelastic::RESTART_COUNT_ENV).is_none() {
        return;
    }
    let Ok(mut signals) = Signals::new([SIGTERM, SIGINT, SIGHUP, SIGQUIT]) else {
        return;
    };
    let (tx, rx) = std::sync::mpsc::channel::<i32>();
    let listen = std::thread::Builder::new()
        .name("fsdp-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                if tx.send(sig).is_err() {
                    return;
                }
            }
        });
    let spawned = listen.and_then(|_| {
        std::thread::Builder::new()
            .name("fsdp-signal-exit".into())
            .spawn(move || {
                let Ok(sig) = rx.recv() else { return };
                let rank = std::env::var("RANK").unwrap_or_else(|_| "?".into());
                // The main thread ends the process if it fails within the grace; a second
                // signal cuts the grace short.
                let _ = rx.recv_timeout(GRACE);
                let msg = format!(
                    "rank {rank}: stopped by {} from the launcher (torchrun ends every rank when \
                     one fails or the job is interrupted) before this rank saw a failure of its \
                     own",
                    name(sig)
                );
                fsdp_collectives::torchelastic::write_error_file(&msg);
                eprintln!("error: {msg}");
                for h in ABORTS.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                    h.abort(msg.clone());
                }
                std::process::exit(128 + sig);
            })
    });
    if let Err(e) = spawned {
        eprintln!("warning: cannot start the signal thread: {e}");
    }
}

fn name(sig: i32) -> &'static str {
    match sig {
        SIGTERM => "SIGTERM",
        SIGINT => "SIGINT",
        SIGHUP => "SIGHUP",
        SIGQUIT => "SIGQUIT",
        _ => "a signal",
    }
}
