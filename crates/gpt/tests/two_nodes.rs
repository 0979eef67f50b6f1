//! Two nodes × two ranks: `fsdp launch --nnodes 2` on two hosts made of network namespaces joined
//! by a veth pair (`scripts/two-hosts.sh`), so that the ranks of different nodes really talk over
//! a network link, not loopback or shared memory.
//!
//! Needs root and iproute2's `ip`; each test says `skipped: ...` and passes otherwise. Every test
//! removes its namespaces when it ends, also when it fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::cli::{
    assert_same_losses, both_nodes_ok, finish, fsdp, ok, small_train_args, text, SMALL_MODEL,
};
use fsdp_gpt::model::{param_specs, GptConfig};

const HOST0: &str = "10.77.0.1";
const TOKEN: &str = "two-nodes-test-token-0123456789";

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/two-hosts.sh")
}

fn tmp(name: &str) -> PathBuf {
    common::cli::tmp("two_nodes", name)
}

/// Two hosts, removed on drop.
struct Hosts {
    name: String,
}

impl Hosts {
    /// Create them, or the reason this machine cannot.
    fn up() -> Result<Hosts, String> {
        let uid = Command::new("id")
            .arg("-u")
            .output()
            .map(|o| text(&o.stdout));
        if uid.ok().as_deref().map(str::trim) != Some("0") {
            return Err("not root (network namespaces need CAP_NET_ADMIN)".into());
        }
        if Command::new("ip").arg("-V").output().is_err() {
            return Err("iproute2's `ip` is not installed".into());
        }
        static N: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "fn{}x{}",
            std::process::id() % 100_000,
            N.fetch_add(1, Ordering::Relaxed)
        );
        let hosts = Hosts { name };
        let out = hosts.script(&["up"]);
        if !out.status.success() {
            return Err(format!(
                "cannot create network namespaces: {}",
                text(&out.stderr).trim()
            ));
        }
        Ok(hosts)
    }

    fn script(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("bash");
        cmd.arg(script())
            .arg(args[0])
            .arg(&self.name)
            .args(&args[1..]);
        cmd.output().expect("run scripts/two-hosts.sh")
    }

    /// `fsdp launch --nnodes 2 --node-rank NODE -n 2 ... train TRAIN` on host `node`, with
    /// `token` as the job token.
    fn launch(&self, node: usize, token: &str, launch: &[&str], train: &[String]) -> Child {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &format!("{}-{node}", self.name)])
            .arg(env!("CARGO_BIN_EXE_fsdp"))
            .args(["launch", "--nnodes", "2", "--node-rank", &node.to_string()])
            .args(["-n", "2", "--master-addr", HOST0, "--master-port", "29450"])
            .args(launch)
            .arg("train")
            .args(train)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("FSDP_JOB_TOKEN_FILE")
            .env("FSDP_JOB_TOKEN", token)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd.spawn().expect("start fsdp launch in a namespace")
    }
}

impl Hosts {
    /// The bytes host 0's end of the link (`NAME-v0`) has sent and received so far: what
    /// crossed the link from node 0 to node 1 and back (the kernel's counters of the veth
    /// device, read in host 0's namespace).
    fn link_bytes(&self) -> (u64, u64) {
        let ns = format!("{}-0", self.name);
        let read = |counter: &str| -> u64 {
            let path = format!("/sys/class/net/{}-v0/statistics/{counter}", self.name);
            let out = Command::new("ip")
                .args(["netns", "exec", &ns, "cat", &path])
                .output()
                .expect("run ip netns exec");
            assert!(
                out.status.success(),
                "cannot read {path} in {ns}: {}",
                text(&out.stderr)
            );
            let value = text(&out.stdout);
            value
                .trim()
                .parse()
                .unwrap_or_else(|e| panic!("{path} in {ns} holds {value:?}: {e}"))
        };
        (read("tx_bytes"), read("rx_bytes"))
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = self.script(&["down"]);
    }
}

macro_rules! hosts_or_skip {
    () => {
        match Hosts::up() {
            Ok(h) => h,
            Err(why) => {
                println!("skipped: {why}");
                return;
            }
        }
    };
}

/// The steps of [`SMALL`].
const STEPS: u64 = 6;
const SMALL: [&str; 6] = ["--batch-size", "8", "--steps", "6", "--seed", "5"];

/// Train on 4 threads and on 2 nodes × 2 processes; the loss logs must be bitwise equal.
fn compare(name: &str, threads_extra: &[&str], nodes_extra: &[&str]) {
    compare_with_header(name, threads_extra, nodes_extra, "fsdp train: 4 ranks");
}

/// [`compare`], node 0's output holding `header`.
fn compare_with_header(name: &str, threads_extra: &[&str], nodes_extra: &[&str], header: &str) {
    let hosts = hosts_or_skip!();
    let threads_log = tmp(&format!("{name}-threads.csv"));
    let mut args = small_train_args(&SMALL, threads_extra);
    args.extend_from_slice(&["--ranks", "4", "--loss-log", threads_log.to_str().unwrap()]);
    ok(&fsdp(&args), "the thread run");

    let nodes_log = tmp(&format!("{name}-nodes.csv"));
    let mut train: Vec<String> = SMALL_MODEL.iter().map(|s| s.to_string()).collect();
    train.extend(SMALL.iter().chain(nodes_extra).map(|s| s.to_string()));
    train.extend(["--loss-log".into(), nodes_log.to_str().unwrap().into()]);
    let timeouts = ["--timeout", "60", "--init-timeout", "60"];
    let (tx0, rx0) = hosts.link_bytes();
    let node1 = hosts.launch(1, TOKEN, &timeouts, &train);
    let node0 = hosts.launch(0, TOKEN, &timeouts, &train);
    let stdout0 = both_nodes_ok(node0, node1, Duration::from_secs(120));
    assert!(
        stdout0.contains(header),
        "node 0 did not run a 4-rank job:\n{stdout0}"
    );
    let (tx1, rx1) = hosts.link_bytes();
    assert_same_losses(
        &format!("{name}: "),
        &threads_log,
        &nodes_log,
        STEPS as usize,
    );
    // The training traffic crossed the veth link, both ways: every step each node sends the
    // other at least the gradients' share it reduces across nodes (HYBRID_SHARD: the whole
    // gradient, all-reduced between the two replicas of each shard; FULL_SHARD: the
    // parameters' all-gathers and the gradients' reduce-scatter, more still). Half the f32
    // parameter bytes a step is a clear lower bound; loopback or shared memory moves none.
    let (sent, received) = (tx1 - tx0, rx1 - rx0);
    let bound = STEPS * param_bytes() / 2;
    println!(
        "{name}: node 0 -> node 1 {sent} bytes, node 1 -> node 0 {received} bytes over the link \
         (lower bound {bound})"
    );
    assert!(
        sent >= bound && received >= bound,
        "only {sent} bytes from node 0 to node 1 and {received} back crossed the link, less \
         than {bound} each way: the ranks did not talk over it"
    );
}

/// The f32 bytes of [`SMALL_MODEL`]'s parameters.
fn param_bytes() -> u64 {
    let arg = |flag: &str| -> usize {
        let i = SMALL_MODEL.iter().position(|a| *a == flag).unwrap();
        SMALL_MODEL[i + 1].parse().unwrap()
    };
    let cfg = GptConfig::new(
        arg("--n-layer"),
        arg("--n-head"),
        arg("--n-embd"),
        arg("--block-size"),
        arg("--vocab-size"),
    )
    .unwrap();
    let numel: usize = param_specs(&cfg).iter().map(|p| p.numel()).sum();
    4 * numel as u64
}

#[test]
fn full_shard_across_two_nodes_equals_four_threads() {
    compare("full-shard", &[], &[]);
}

/// HYBRID_SHARD shards inside each node and replicates across them; under the launcher the
/// ranks per node come from LOCAL_WORLD_SIZE, with no option.
#[test]
fn hybrid_shard_across_two_nodes_equals_four_threads() {
    compare(
        "hybrid",
        &["--strategy", "hybrid-shard", "--ranks-per-node", "2"],
        &["--strategy", "hybrid-shard"],
    );
}

/// The device trainer's ranks as processes (`--device host-twin`: `StagedComm` over TCP, the
/// code NCCL runs on GPUs) across the link, the node from LOCAL_WORLD_SIZE: four threads of
/// the device trainer in two simulated nodes, bitwise.
#[test]
fn device_hybrid_shard_across_two_nodes_equals_four_threads() {
    let device = ["--device", "host-twin", "--param-dtype", "f32"];
    let mut threads = vec!["--strategy", "hybrid-shard", "--ranks-per-node", "2"];
    threads.extend_from_slice(&device);
    let mut nodes = vec!["--strategy", "hybrid-shard", "--forward-prefetch"];
    nodes.extend_from_slice(&device);
    compare_with_header(
        "device-hybrid",
        &threads,
        &nodes,
        "fsdp train: rank 0 of 4 processes on host-twin (tcp)",
    );
}

fn long_train() -> Vec<String> {
    let mut train: Vec<String> = SMALL_MODEL.iter().map(|s| s.to_string()).collect();
    train.extend(["--batch-size", "8", "--steps", "100000"].map(String::from));
    train
}

/// The link between the nodes goes down mid-run: both nodes fail within the collective timeout
/// (every rank reports the timeout or is ended by its launcher after its node's first failure),
/// and the ranks waiting for data across the link name the peer on the other node.
///
/// A rank whose predecessor is on its own node names that predecessor (it is the one it waits
/// for, itself stuck on the link); so the test asks that each node's failure is a timeout and
/// that the other node's ranks are named by the ranks of at least one node (as the peer it
/// waits for, as behind, or as publishing no progress: which rank reports first is a race).
#[test]
fn link_down_fails_every_rank_on_both_nodes_naming_the_peer() {
    let hosts = hosts_or_skip!();
    let timeouts = ["--timeout", "5", "--init-timeout", "60"];
    let train = long_train();
    let node1 = hosts.launch(1, TOKEN, &timeouts, &train);
    let node0 = hosts.launch(0, TOKEN, &timeouts, &train);
    // Let training start (the rendezvous and a few steps), then cut the link.
    std::thread::sleep(Duration::from_secs(4));
    let out = hosts.script(&["link", "down"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let cut = Instant::now();
    let (out0, _) = finish(node0, Duration::from_secs(60), "node 0");
    let (out1, _) = finish(node1, Duration::from_secs(60), "node 1");
    let after = cut.elapsed();
    println!("both nodes ended {after:?} after the link went down");
    assert!(
        after < Duration::from_secs(30),
        "the nodes took {after:?} to fail after the link went down (timeout 5 s)"
    );
    let mut across = false;
    for (node, out, peers) in [(0, &out0, [2, 3]), (1, &out1, [0, 1])] {
        let err = text(&out.stderr);
        println!("node {node}:\n{err}");
        assert!(!out.status.success(), "node {node} succeeded:\n{err}");
        assert!(
            err.contains("timed out after 5s"),
            "node {node} did not report the timeout:\n{err}"
        );
        for r in [2 * node, 2 * node + 1] {
            let reported = err.contains(&format!("[rank {r}] error: rank {r}:"));
            let ended = err.contains("the others were ended");
            assert!(
                reported || ended,
                "rank {r} of node {node} neither failed with an error nor was ended:\n{err}"
            );
        }
        across |= peers.iter().any(|&p| names_rank(&err, p));
    }
    assert!(
        across,
        "no rank named a peer on the other node:\n{}\n{}",
        text(&out0.stderr),
        text(&out1.stderr)
    );
}

/// Whether an error text names rank `p` in a rank's own words: "rank P" (as in "data from rank
/// P" or "rank P is behind") or a list "ranks [.., P, ..]"; never the "[rank P]" line prefix of
/// a rank's own output.
fn names_rank(err: &str, p: usize) -> bool {
    let single = err.match_indices("rank ").any(|(i, _)| {
        let prefixed = err[..i].ends_with('[');
        let digits: String = err[i + 5..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        !prefixed && digits.parse() == Ok(p)
    });
    let listed = err.match_indices("ranks [").any(|(i, m)| {
        let rest = &err[i + m.len()..];
        let list = &rest[..rest.find(']').unwrap_or(0)];
        list.split(',').any(|n| n.trim().parse() == Ok(p))
    });
    single || listed
}

#[test]
fn names_rank_reads_single_names_and_lists() {
    let err = "[rank 1] error: rank 1: timed out: data from rank 0; rank 12 is behind; \
               ranks [3, 4] published no progress";
    assert!(names_rank(err, 0) && names_rank(err, 12) && names_rank(err, 3) && names_rank(err, 4));
    assert!(names_rank(err, 1), "\"rank 1:\" names rank 1");
    assert!(!names_rank(err, 2) && !names_rank(err, 5));
    assert!(!names_rank("[rank 7] error: timed out", 7));
}

/// Node 1 never starts: node 0 fails after the rendezvous timeout naming node 1 and its ranks.
#[test]
fn a_node_that_never_starts_is_named() {
    let hosts = hosts_or_skip!();
    let timeouts = ["--timeout", "60", "--init-timeout", "3"];
    let node0 = hosts.launch(0, TOKEN, &timeouts, &long_train());
    let (out, took) = finish(node0, Duration::from_secs(60), "node 0");
    let err = text(&out.stderr);
    println!("node 0 alone failed after {took:?}:\n{err}");
    assert!(!out.status.success());
    assert!(
        err.contains("ranks [2, 3] never arrived")
            && err.contains("node 1 never arrived (ranks [2, 3])"),
        "node 0 did not name node 1 and its ranks:\n{err}"
    );
}

/// A node with another job token is refused at once by the store on node 0.
#[test]
fn a_node_with_a_wrong_token_is_refused() {
    let hosts = hosts_or_skip!();
    let timeouts = ["--timeout", "60", "--init-timeout", "20"];
    let node0 = hosts.launch(0, TOKEN, &timeouts, &long_train());
    let node1 = hosts.launch(1, "another-job-token-9876543210", &timeouts, &long_train());
    let (out1, took1) = finish(node1, Duration::from_secs(60), "node 1");
    let (out0, _) = finish(node0, Duration::from_secs(60), "node 0");
    let err1 = text(&out1.stderr);
    println!("node 1 (wrong token) failed after {took1:?}:\n{err1}");
    assert!(!out1.status.success() && !out0.status.success());
    assert!(
        err1.contains("refused") && err1.contains("job token"),
        "node 1 was not refused for its token:\n{err1}"
    );
    assert!(
        took1 < Duration::from_secs(15),
        "node 1 was refused only after {took1:?}"
    );
}

/// `--nnodes 2` off loopback without a job token is an error before any rank starts.
#[test]
fn several_nodes_off_loopback_need_a_token() {
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(["launch", "--nnodes", "2", "--node-rank", "0", "-n", "1"])
        .args([
            "--master-addr",
            "10.77.0.1",
            "--master-port",
            "29451",
            "train",
        ])
        .env_remove("FSDP_JOB_TOKEN")
        .env_remove("FSDP_JOB_TOKEN_FILE")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("needs a job token") && err.contains("FSDP_JOB_TOKEN"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args([
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "-n",
            "1",
            "train",
        ])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--node-rank 2 is out of range for --nnodes 2"),
        "{err}"
    );
}

/// The MPI backend across the two hosts: `mpirun` in host 0's namespace starts host 1's ranks
/// through `scripts/two-hosts.sh agent` (Open MPI's remote-shell agent, in place of ssh); MPI
/// reduces in its own order, so the losses agree with the threads' to rounding.
#[cfg(feature = "mpi")]
#[test]
fn mpirun_across_two_nodes_matches_four_threads() {
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => {
            println!("skipped: mpirun not found");
            return;
        }
    }
    let hosts = hosts_or_skip!();
    let threads_log = tmp("mpi-threads.csv");
    let mut args = small_train_args(&SMALL, &[]);
    args.extend_from_slice(&["--ranks", "4", "--loss-log", threads_log.to_str().unwrap()]);
    ok(&fsdp(&args), "the thread run");

    let mpi_log = tmp("mpi-nodes.csv");
    let agent = format!("bash {}", script().display());
    let child = Command::new("ip")
        .args(["netns", "exec", &format!("{}-0", hosts.name), "mpirun"])
        .args(["--mca", "plm_rsh_agent", &format!("{agent} agent")])
        .args(["--mca", "oob_tcp_if_include", "10.77.0.0/24"])
        .args(["--mca", "btl", "self,tcp"])
        .args(["--mca", "btl_tcp_if_include", "10.77.0.0/24"])
        .args(["--bind-to", "none", "--oversubscribe"])
        .args(["-H", "10.77.0.1:2,10.77.0.2:2", "-np", "4"])
        .args(["-x", "PATH"])
        .arg(env!("CARGO_BIN_EXE_fsdp"))
        .args(["train", "--backend", "mpi"])
        .args(SMALL_MODEL)
        .args(SMALL)
        .args(["--loss-log", mpi_log.to_str().unwrap()])
        .env("TWO_HOSTS_NAME", &hosts.name)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start mpirun");
    let (out, _) = finish(child, Duration::from_secs(120), "mpirun");
    ok(&out, "mpirun across the two hosts");
    let a: Vec<f64> = common::cli::loss_column(&threads_log)
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    let b: Vec<f64> = common::cli::loss_column(&mpi_log)
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    println!("mpi: 4 threads {a:?}\nmpi: 2 hosts × 2 MPI processes {b:?}");
    assert_eq!(a.len(), 6);
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!(
            (x - y).abs() <= 1e-6 * x.abs(),
            "losses differ: {a:?} vs {b:?}"
        );
    }
}
