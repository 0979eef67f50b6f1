//! Two `fsdp launch` jobs started at the same moment on one port never cross (issue 14): one
//! trains with its own ranks, the other fails clearly (its rank 0 finds the port in use, its
//! other ranks are refused by the first job's store). The library-level test
//! (`fsdp-collectives`' `auth_identity`) repeats the race 50 times; this one runs real launches.

mod common;

use common::cli::{command, free_port, text, SMALL_MODEL};

#[test]
fn two_launches_on_one_port_never_cross() {
    for round in 0..5 {
        let port = free_port().to_string();
        let mut args = vec!["launch", "-n", "3", "--master-port", &port, "train"];
        args.extend_from_slice(&SMALL_MODEL);
        args.extend_from_slice(&["--batch-size", "6", "--steps", "30"]);
        let a = command(&args).spawn_output();
        let b = command(&args).spawn_output();
        let outs = [a.join().unwrap(), b.join().unwrap()];
        let trained: Vec<bool> = outs
            .iter()
            .map(|o| o.status.success() && text(&o.stdout).contains("[rank 0] done: 30 steps"))
            .collect();
        assert_eq!(
            trained.iter().filter(|&&t| t).count(),
            1,
            "round {round}: {:?}",
            outs.iter()
                .map(|o| (o.status, text(&o.stderr)))
                .collect::<Vec<_>>()
        );
        let loser = &outs[trained.iter().position(|&t| !t).unwrap()];
        let err = text(&loser.stderr);
        assert!(
            err.contains("already in use")
                || err.contains("belongs to job")
                || err.contains("wrong token"),
            "round {round}: {err}"
        );
    }
}

trait SpawnOutput {
    fn spawn_output(&mut self) -> std::thread::JoinHandle<std::process::Output>;
}

impl SpawnOutput for std::process::Command {
    /// Starts the command now and collects its output on a thread.
    fn spawn_output(&mut self) -> std::thread::JoinHandle<std::process::Output> {
        let child = self
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::spawn(move || child.wait_with_output().unwrap())
    }
}
