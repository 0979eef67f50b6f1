//! `fsdp launch`: one process per rank, like `torchrun`.

use std::ffi::OsString;
use std::process::ExitCode;

use fsdp_collectives::launch::{self, LaunchOptions};
use fsdp_collectives::{INIT_TIMEOUT_ENV, TIMEOUT_ENV};

use crate::args::LaunchArgs;

/// `fsdp launch`: the exit status is the first failed rank's, or success.
pub(crate) fn run_launch(args: LaunchArgs) -> ExitCode {
    if let Err(e) = check_nodes(&args) {
        eprintln!("error: launch: {e}");
        return ExitCode::from(2);
    }
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
        .with_master(args.master_addr, args.master_port)
        .with_nodes(args.nnodes, args.node_rank);
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

/// The multi-node options make sense: a node rank in range, and a job token when the nodes
/// meet off loopback (the store refuses a non-loopback address without one, but only after the
/// ranks started; and every node must hold the same token, which the launcher cannot invent).
fn check_nodes(args: &LaunchArgs) -> Result<(), String> {
    if args.nnodes == 0 {
        return Err("--nnodes must be at least 1".into());
    }
    if args.node_rank >= args.nnodes {
        return Err(format!(
            "--node-rank {} is out of range for --nnodes {} (0..{})",
            args.node_rank, args.nnodes, args.nnodes
        ));
    }
    if args.nnodes > 1 {
        if args.master_port == 0 {
            return Err(format!(
                "--master-port 0 (a free port) works on one node only: the other {} nodes could \
                 not know it; give the same explicit port to every node",
                args.nnodes - 1
            ));
        }
        let loopback = args
            .master_addr
            .parse::<std::net::IpAddr>()
            .map(|a| a.is_loopback())
            .unwrap_or(args.master_addr == "localhost");
        let token = [
            fsdp_collectives::auth::TOKEN_ENV,
            fsdp_collectives::auth::TOKEN_FILE_ENV,
        ]
        .iter()
        .any(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()));
        if !loopback && !token {
            return Err(format!(
                "--nnodes {} with --master-addr {} needs a job token shared by every node: set \
                 {} (or {} to a file holding it) to the same secret on each node",
                args.nnodes,
                args.master_addr,
                fsdp_collectives::auth::TOKEN_ENV,
                fsdp_collectives::auth::TOKEN_FILE_ENV
            ));
        }
    }
    Ok(())
}

/// Whether `train`'s arguments ask for `--backend ring` (`--backend ring` or `--backend=ring`).
fn asks_for_ring(args: &[OsString]) -> bool {
    args.iter().enumerate().any(|(i, a)| {
        a == "--backend=ring" || (a == "--backend" && args.get(i + 1).is_some_and(|v| v == "ring"))
    })
}
