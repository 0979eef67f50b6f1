//! `fsdp launch --nnodes 2` with both nodes on this machine, over loopback: needs no root, so
//! it runs wherever the tests run (`two_nodes.rs` repeats these checks across a real network
//! link between network namespaces, as root).
//!
//! Two nodes of two ranks each train with HYBRID_SHARD, the ranks per node taken from the
//! launcher's LOCAL_WORLD_SIZE (no `--ranks-per-node`), and give bitwise the losses of four
//! threads with `--ranks-per-node 2`; node 0 without node 1 fails after its `--init-timeout`,
//! naming node 1 and its ranks.

mod common;

use std::process::{Child, Stdio};
use std::time::Duration;

use common::cli::{
    assert_same_losses, both_nodes_ok, command, finish, free_port, fsdp, ok, small_train_args,
    text, SMALL_MODEL,
};

const SMALL: [&str; 6] = ["--batch-size", "8", "--steps", "4", "--seed", "5"];

fn tmp(name: &str) -> std::path::PathBuf {
    common::cli::tmp("launch_nodes", name)
}

/// `fsdp launch --nnodes 2 --node-rank NODE --nproc-per-node 2` on loopback, then `train`,
/// [`SMALL_MODEL`] and the arguments `train`. Without a job token: the nodes meet on loopback.
fn node(node: usize, port: u16, init_timeout: &str, train: &[&str]) -> Child {
    let (node, port) = (node.to_string(), port.to_string());
    command(&["launch", "--nnodes", "2", "--node-rank", &node])
        .args(["--nproc-per-node", "2", "--master-addr", "127.0.0.1"])
        .args(["--master-port", &port, "--timeout", "60"])
        .args(["--init-timeout", init_timeout, "train"])
        .args(SMALL_MODEL)
        .args(train)
        .env_remove("FSDP_JOB_TOKEN")
        .env_remove("FSDP_JOB_TOKEN_FILE")
        .env_remove("LOCAL_WORLD_SIZE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start fsdp launch")
}

/// HYBRID_SHARD over two nodes on loopback equals four threads with two ranks per node,
/// bitwise. The grouping shows in the losses: a full shard of the four ranks (what the
/// launched ranks would run without LOCAL_WORLD_SIZE) rounds differently by step 2.
#[test]
fn hybrid_shard_on_two_loopback_nodes_equals_four_threads() {
    hybrid_on_two_nodes(
        "hybrid",
        &[],
        &[],
        "[rank 0] fsdp train: 4 ranks, HYBRID_SHARD",
    );
}

/// The device trainer's ranks as processes (`--device host-twin`: `StagedComm` over TCP, the
/// code NCCL runs on GPUs) on two loopback nodes: HYBRID_SHARD takes the node from the
/// launcher's LOCAL_WORLD_SIZE, as the engine does, and equals four threads of the device
/// trainer in two simulated nodes, bitwise.
#[test]
fn device_hybrid_shard_on_two_loopback_nodes_equals_four_threads() {
    let device = ["--device", "host-twin", "--param-dtype", "f32"];
    hybrid_on_two_nodes(
        "device-hybrid",
        &device,
        &["--forward-prefetch"],
        "[rank 0] fsdp train: rank 0 of 4 processes on host-twin (tcp)",
    );
}

/// HYBRID_SHARD with `extra` on four threads in two simulated nodes and on two loopback nodes
/// of two ranks (those with `nodes_extra` too): bitwise the same losses, node 0 saying
/// `header`.
fn hybrid_on_two_nodes(name: &str, extra: &[&str], nodes_extra: &[&str], header: &str) {
    let threads_log = tmp(&format!("{name}-threads.csv"));
    let mut args = small_train_args(&SMALL, &["--strategy", "hybrid-shard"]);
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--ranks", "4", "--ranks-per-node", "2"]);
    args.extend_from_slice(&["--loss-log", threads_log.to_str().unwrap()]);
    ok(&fsdp(&args), "the thread run");

    let nodes_log = tmp(&format!("{name}-nodes.csv"));
    let _ = std::fs::remove_file(&nodes_log);
    let mut train = vec!["--strategy", "hybrid-shard"];
    train.extend_from_slice(extra);
    train.extend_from_slice(nodes_extra);
    train.extend_from_slice(&SMALL);
    train.extend_from_slice(&["--loss-log", nodes_log.to_str().unwrap()]);
    let port = free_port();
    let node1 = node(1, port, "60", &train);
    let node0 = node(0, port, "60", &train);
    let stdout0 = both_nodes_ok(node0, node1, Duration::from_secs(90));
    assert!(
        stdout0.contains(header),
        "node 0 did not run the 4-rank job:\n{stdout0}"
    );
    assert_same_losses("", &threads_log, &nodes_log, 4);
}

/// Node 1 never starts: node 0 fails once its rendezvous timeout has passed (not before, not
/// long after), naming node 1 and its ranks [2, 3].
#[test]
fn node_0_alone_names_node_1_and_its_ranks() {
    let mut train = vec!["--steps", "100000"];
    train.extend_from_slice(&SMALL[..2]);
    let node0 = node(0, free_port(), "3", &train);
    let (out, took) = finish(node0, Duration::from_secs(60), "node 0");
    let err = text(&out.stderr);
    println!("node 0 alone failed after {took:?}:\n{err}");
    assert!(!out.status.success(), "node 0 succeeded alone:\n{err}");
    assert!(
        took >= Duration::from_secs(3) && took < Duration::from_secs(30),
        "node 0 failed after {took:?}, not just after its 3 s --init-timeout:\n{err}"
    );
    assert!(
        err.contains("rendezvous timed out after 3s")
            && err.contains("ranks [2, 3] never arrived")
            && err.contains("node 1 never arrived (ranks [2, 3])"),
        "node 0 did not name node 1 and its ranks:\n{err}"
    );
}

/// `--master-port 0` with several nodes is refused before any rank starts, in one readable
/// line (no runs of spaces left by a broken line continuation).
#[test]
fn several_nodes_need_an_explicit_port() {
    let out = command(&[
        "launch",
        "--nnodes",
        "2",
        "-n",
        "1",
        "--master-port",
        "0",
        "train",
    ])
    .env_remove("FSDP_JOB_TOKEN")
    .env_remove("FSDP_JOB_TOKEN_FILE")
    .output()
    .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--master-port 0 (a free port) works on one node only: the other 1 nodes could not know it"),
        "{err}"
    );
    assert!(!err.contains("  "), "runs of spaces in {err:?}");
}
