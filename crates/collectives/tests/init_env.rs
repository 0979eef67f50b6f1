//! `init_from_env` across processes: ranks started with the launcher's variables meet at the
//! store and build a working tcp communicator; a rank that never arrives is named; a backend
//! that this build lacks is a clear error. The test binary re-executes itself as the ranks
//! (`FSDP_INIT_ENV_CHILD` selects what a child does).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fsdp_collectives::{init_from_env, Backend, CollectiveError, InitOptions, ReduceOp};
use fsdp_device::Buffer;

const ROLE: &str = "FSDP_INIT_ENV_CHILD";

/// A port that was free a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills the child on drop unless it was waited for.
struct Guard(Option<Child>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn(test: &str, role: &str, rank: usize, world: usize, port: u16) -> Guard {
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    Guard(Some(child))
}

/// Wait for every child (at most `limit` in all) and return their outputs.
fn wait_all(children: Vec<Guard>, limit: Duration) -> Vec<(bool, String)> {
    let deadline = Instant::now() + limit;
    let mut out = Vec::new();
    for mut g in children {
        let mut child = g.0.take().unwrap();
        loop {
            if let Some(_status) = child.try_wait().unwrap() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let o = child.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        out.push((o.status.success(), text));
    }
    out
}

/// Child: build the tcp communicator from the environment and all-reduce the ranks.
fn child_all_reduce() {
    let comm = init_from_env(
        Backend::Tcp,
        &InitOptions::default().with_timeout(Duration::from_secs(20)),
    )
    .unwrap();
    let world = comm.world_size();
    let buf = Buffer::from_slice(&[comm.rank() as f64 + 1.0; 3]).unwrap();
    comm.all_reduce(&buf, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    let want = (world * (world + 1) / 2) as f64;
    assert_eq!(buf.to_vec::<f64>().unwrap(), vec![want; 3]);
    println!("rank {} of {world}: all_reduce ok", comm.rank());
}

#[test]
fn three_processes_build_a_tcp_group_from_the_environment() {
    if std::env::var(ROLE).as_deref() == Ok("all_reduce") {
        child_all_reduce();
        return;
    }
    let port = free_port();
    let test = "three_processes_build_a_tcp_group_from_the_environment";
    let children = (0..3)
        .map(|r| spawn(test, "all_reduce", r, 3, port))
        .collect();
    for (rank, (ok, text)) in wait_all(children, Duration::from_secs(60))
        .into_iter()
        .enumerate()
    {
        assert!(ok, "rank {rank} failed:\n{text}");
        assert!(
            text.contains(&format!("rank {rank} of 3: all_reduce ok")),
            "{text}"
        );
    }
}

#[test]
fn a_rank_that_never_arrives_is_named() {
    if std::env::var(ROLE).as_deref() == Ok("alone") {
        let t0 = Instant::now();
        let err = init_from_env(
            Backend::Tcp,
            &InitOptions::default().with_timeout(Duration::from_secs(2)),
        )
        .err()
        .expect("init_from_env succeeded without rank 1");
        println!("error after {:?}: {err}", t0.elapsed());
        assert!(
            matches!(&err, CollectiveError::MissingRanks { missing, .. } if missing == &[1]),
            "{err:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
        return;
    }
    // Only rank 0 of a world of 2 starts.
    let port = free_port();
    let child = spawn("a_rank_that_never_arrives_is_named", "alone", 0, 2, port);
    let (ok, text) = wait_all(vec![child], Duration::from_secs(30)).remove(0);
    assert!(ok, "{text}");
    assert!(text.contains("ranks [1] never arrived"), "{text}");
}

#[test]
fn missing_variables_and_backends_are_clear_errors() {
    if std::env::var("RANK").is_err() && std::env::var("WORLD_SIZE").is_err() {
        let err = init_from_env(Backend::Tcp, &InitOptions::default())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("RANK and WORLD_SIZE are not set"), "{err}");
    }
    if !cfg!(feature = "mpi") {
        let err = init_from_env(Backend::Mpi, &InitOptions::default())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("backend mpi is not available"), "{err}");
        assert!(err.contains("cargo feature `mpi`"), "{err}");
    }
}
