//! Ranks as processes for the tests: the test binary re-executes itself once per rank (the child
//! runs only the named test, in a role), the ranks meeting through a store the parent hosts.

use std::ffi::OsStr;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fsdp_collectives::store::{StoreOptions, TcpStore};

const ROLE: &str = "FSDP_TEST_PROCS_ROLE";
const PORT: &str = "FSDP_TEST_PROCS_PORT";
const RANK: &str = "FSDP_TEST_PROCS_RANK";

/// This process's role when it is a rank process (`None` in the parent).
pub fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// In a rank process: its rank and a client of the parent's store.
pub fn child_store(world: usize, timeout: Duration) -> (usize, TcpStore) {
    let port: u16 = std::env::var(PORT).unwrap().parse().unwrap();
    let rank: usize = std::env::var(RANK).unwrap().parse().unwrap();
    let store = TcpStore::new(
        StoreOptions::new("127.0.0.1", port, rank, world)
            .with_server(false)
            .with_timeout(timeout),
    )
    .unwrap();
    (rank, store)
}

/// Kills and reaps the children on every path out of the parent.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Spawn `world` rank processes running `test` in `role` (with `envs` added), wait for all of
/// them (at most `limit`), and return each one's exit code and output.
pub fn run_children(
    test: &str,
    role: &str,
    world: usize,
    envs: &[(&str, &OsStr)],
    limit: Duration,
) -> Vec<(Option<i32>, String)> {
    let server =
        TcpStore::new(StoreOptions::new("127.0.0.1", 0, 0, world).with_timeout(limit)).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut children = Children(Vec::new());
    let mut readers = Vec::new();
    for rank in 0..world {
        let mut cmd = Command::new(&exe);
        cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env(PORT, server.port().to_string())
            .env(RANK, rank.to_string());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning a rank process");
        let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        readers.push(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            let _ = err.read_to_string(&mut s);
            s
        }));
        children.0.push(child);
    }
    let deadline = Instant::now() + limit;
    let mut codes: Vec<Option<Option<i32>>> = vec![None; world];
    while codes.iter().any(Option::is_none) {
        for (rank, c) in children.0.iter_mut().enumerate() {
            if codes[rank].is_none() {
                if let Some(status) = c.try_wait().unwrap() {
                    codes[rank] = Some(status.code());
                }
            }
        }
        if Instant::now() > deadline {
            drop(children);
            panic!("rank processes of {test} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(children);
    codes
        .into_iter()
        .zip(readers)
        .map(|(c, r)| (c.flatten(), r.join().unwrap()))
        .collect()
}

/// Assert that every rank exited 0 and printed `"rank <r>: <said>"`.
pub fn assert_all_said(test: &str, results: &[(Option<i32>, String)], said: &str) {
    for (rank, (code, out)) in results.iter().enumerate() {
        assert!(
            *code == Some(0) && out.contains(&format!("rank {rank}: {said}")),
            "rank {rank} ({test}): exit {code:?}\n{out}"
        );
    }
}
