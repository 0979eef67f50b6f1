//! `fsdp`: sharded GPT training on the CPU — ranks as threads on the embedded ring backend, or
//! as processes started by `fsdp launch` (TCP backend) or `mpirun` (MPI backend).
//!
//! `fsdp train` trains the reference GPT with FSDP and shows a progress bar and a summary
//! (`--device cuda`: one rank on one GPU without the sharded engine, see `device_cmd`);
//! `fsdp plan` prints the memory and communication plan of the same options; `fsdp launch`
//! starts one process per rank with the launcher's environment (like `torchrun`). Every option
//! is checked before any rank starts, and an invalid one ends with a single `error: ...` line and
//! a non-zero exit status.

mod admission;
mod args;
mod checkpointing;
mod device_checks;
mod device_cmd;
mod device_plan_cmd;
mod device_process_cmd;
mod device_report;
mod device_sharded_cmd;
mod engine_cmd;
mod engine_plan_cmd;
mod host_admission;
mod launch_cmd;
mod optimizer;
mod output;
mod paths;
mod plan_cmd;
mod progress;
mod resume;
mod run_config;
mod setup;
mod signals;
mod train;
mod train_checks;

use std::process::ExitCode;

use fsdp::FsdpError;

use args::Command;
use launch_cmd::run_launch;
use plan_cmd::print_plan;
use train::train;

/// `println!` that ends the program quietly, with the status a shell gives a process killed by
/// `SIGPIPE` (141), when standard output was closed (`fsdp train | head`), instead of panicking
/// as `println!` does (Rust ignores `SIGPIPE`, so the write fails with `BrokenPipe`).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        if let Err(e) = writeln!(out, $($arg)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(141);
            }
        }
    }};
}
pub(crate) use say;

/// An error for the user: printed as one `error: ...` line.
#[derive(Debug)]
struct CliError {
    /// The line.
    msg: String,
    /// Whether it says that this rank failed because a peer left (typed: from
    /// `caused_by_peer` of the error it came from).
    peer_left: bool,
}

impl From<FsdpError> for CliError {
    fn from(e: FsdpError) -> Self {
        CliError {
            peer_left: e.caused_by_peer(),
            msg: e.to_string(),
        }
    }
}

impl From<fsdp_collectives::CollectiveError> for CliError {
    fn from(e: fsdp_collectives::CollectiveError) -> Self {
        CliError {
            peer_left: e.caused_by_peer(),
            msg: e.to_string(),
        }
    }
}

/// `e` with `prefix` before its message; still secondary when `e` is.
fn fail_with(prefix: &str, e: FsdpError) -> CliError {
    CliError {
        peer_left: e.caused_by_peer(),
        msg: format!("{prefix}: {e}"),
    }
}

/// The device trainer's `e` with `prefix` before its message; still secondary when `e` is.
fn fail_device(prefix: &str, e: fsdp_gpt::device_train::DeviceTrainError) -> CliError {
    CliError {
        peer_left: e.caused_by_peer(),
        msg: format!("{prefix}: {e}"),
    }
}

/// An error of this rank's own.
fn fail(msg: impl Into<String>) -> CliError {
    CliError {
        msg: msg.into(),
        peer_left: false,
    }
}

fn main() -> ExitCode {
    // clap's parser, which also records the options given (`--resume` and `--init-from` fill
    // in the others).
    let cli = match resume::parse_cli() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion)
                || matches!(
                    e.kind(),
                    ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
                )
            {
                let _ = e.print();
                return if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                    ExitCode::from(2)
                } else {
                    ExitCode::SUCCESS
                };
            }
            // clap's first line is the error itself ("error: ..."); the rest is usage help.
            let text = e.render().to_string();
            let line = text.lines().next().unwrap_or("error: invalid arguments");
            eprintln!("{line}");
            return ExitCode::from(2);
        }
    };
    signals::install_under_torchrun();
    let r = match cli.command {
        Command::Train(args) => train(&args),
        Command::Plan(args) => print_plan(&args),
        Command::Launch(args) => return run_launch(args),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError { msg, peer_left }) => {
            // Under `fsdp launch`: tell the launcher whether this failure was caused by a peer
            // leaving (secondary) or is this rank's own.
            fsdp_collectives::launch::write_error_file(&msg, peer_left);
            // Under torchrun: its error file, for the summary's root cause.
            fsdp_collectives::torchelastic::write_error_file(&msg);
            // One line, whatever the message holds.
            eprintln!("error: {}", msg.replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}
