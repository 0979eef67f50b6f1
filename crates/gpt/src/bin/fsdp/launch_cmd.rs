//! `fsdp launch`: one process per rank, like `torchrun`.

use std::ffi::OsString;
use std::process::ExitCode;

use fsdp_collectives::launch::{self, LaunchOptions};
use fsdp_collectives::{INIT_TIMEOUT_ENV, TIMEOUT_ENV};

use crate::args::LaunchArgs;

/// `fsdp launch`: the exit status is the first failed rank's, or success.
pub(crate) fn run_launch(args: LaunchArgs) -> ExitCode {
    let mut command = args.command.into_iter();
    let Some(first) = command.next() else {
        eprintln!("error: launch: no program given");
        return ExitCode::FAILURE;
    };
    let mut rest: Vec<OsString> = command.collect();
    if first == "train" && asks_for_ring(&rest) {
        eprintln!(
            "error: launch: {}",
            crate::train_checks::RING_UNDER_LAUNCHER
        );
        return ExitCode::from(2);
    }
    // `train ...` / `plan ...`: this program's subcommands.
    let program = if first == "train" || first == "plan" {
        match std::env::current_exe() {
            Ok(exe) => {
                rest.insert(0, first);
                exe.into_os_string()
            }
            Err(e) => {
                eprintln!("error: launch: cannot find this program's path: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        first
    };
    if args.nproc_per_node == 0 {
        eprintln!("error: launch: --nproc-per-node must be at least 1");
        return ExitCode::FAILURE;
    }
    let mut opts = LaunchOptions::new(args.nproc_per_node, program)
        .with_args(rest)
        .with_master(args.master_addr, args.master_port);
    if let Some(t) = args.timeout {
        opts = opts.with_env(TIMEOUT_ENV, t.as_secs_f64().to_string());
    }
    if let Some(t) = args.init_timeout {
        opts = opts.with_env(INIT_TIMEOUT_ENV, t.as_secs_f64().to_string());
    }
    match launch::run(&opts) {
        Ok(report) => {
            if let Some((rank, status)) = report.first_failure() {
                let secondary = report.secondary_failures();
                let after = if secondary.is_empty() {
                    String::new()
                } else {
                    format!("; ranks {secondary:?} failed after it (secondary)")
                };
                eprintln!(
                    "error: launch: rank {rank} failed ({status}){after}; the others were ended"
                );
            }
            // Statuses outside 0..=255 (none on Unix) become 1.
            ExitCode::from(u8::try_from(report.exit_code()).unwrap_or(1))
        }
        Err(e) => {
            eprintln!("error: launch: {}", e.to_string().replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

/// Whether `train`'s arguments ask for `--backend ring` (`--backend ring` or `--backend=ring`).
fn asks_for_ring(args: &[OsString]) -> bool {
    args.iter().enumerate().any(|(i, a)| {
        a == "--backend=ring" || (a == "--backend" && args.get(i + 1).is_some_and(|v| v == "ring"))
    })
}
