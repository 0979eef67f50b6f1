//! The store against PyTorch itself: a Python `torch.distributed.TCPStore` client against our
//! server, and our client (`StoreProtocol::Torch`) against a Python server, every operation.
//!
//! Needs a Python with torch, named by `FSDP_TORCH_PYTHON` (e.g. a virtual environment's
//! `bin/python`); without it each test prints `skipped: no torch` and passes.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use fsdp_collectives::store::{StoreOptions, StoreProtocol, TcpStore};

fn torch_python() -> Option<String> {
    let py = std::env::var("FSDP_TORCH_PYTHON").ok()?;
    let ok = Command::new(&py)
        .args(["-c", "import torch.distributed"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(py)
}

const CLIENT: &str = r#"
import sys
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=20))
assert s.get("from_rust") == b"hello", s.get("from_rust")
s.set("from_py", b"world")
assert s.add("counter", 3) == 10
assert s.compare_set("cas", b"old", b"new") == b"new"
assert s.compare_set("cas", b"zzz", b"other") == b"new"
s.multi_set(["m1", "m2"], [b"a", b"bb"])
assert s.multi_get(["m1", "m2", "from_rust"]) == [b"a", b"bb", b"hello"]
s.append("log", b"+py")
assert s.check(["from_rust", "m1"]) and not s.check(["absent"])
assert s.delete_key("gone") and not s.delete_key("gone")
n = s.num_keys()
s.set("counted", b"1")
try:
    s.wait(["absent"], timedelta(milliseconds=200))
    raise SystemExit("wait did not time out")
except dist.DistStoreError:
    pass
s.wait(["late"], timedelta(seconds=20))
assert s.get("late") == b"1"
print("python client ok, num_keys", n, flush=True)
"#;

#[test]
#[cfg_attr(miri, ignore = "processes")]
fn a_pytorch_client_uses_our_server() {
    let Some(py) = torch_python() else {
        println!("skipped: no torch");
        return;
    };
    let t = Duration::from_secs(20);
    let store = TcpStore::new(StoreOptions::new("127.0.0.1", 0, 0, 1).with_timeout(t)).unwrap();
    store.set("from_rust", b"hello").unwrap();
    store.add("counter", 7).unwrap();
    store.set("cas", b"old").unwrap();
    store.set("log", b"rust").unwrap();
    store.set("gone", b"x").unwrap();
    let child = Command::new(&py)
        .args(["-c", CLIENT, &store.port().to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The Python client waits for "late": a wait served while we set it.
    store.wait(&["counted"], t).unwrap();
    store.set("late", b"1").unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{}", stdout.trim());
    assert_eq!(store.get("from_py").unwrap(), b"world");
    assert_eq!(store.get("counter").unwrap(), b"10");
    assert_eq!(store.get("cas").unwrap(), b"new");
    assert_eq!(
        store.multi_get(&["m1", "m2"]).unwrap(),
        [b"a".to_vec(), b"bb".to_vec()]
    );
    assert_eq!(store.get("log").unwrap(), b"rust+py");
    assert!(!store.check(&["gone"]).unwrap());
    // from_rust counter cas log from_py m1 m2 (gone was deleted; counted and late came after).
    assert!(stdout.contains("num_keys 7"), "{stdout}");
}

const SERVER: &str = r#"
import sys
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
print(s.port, flush=True)
s.set("from_py", b"hello")
s.set("counter", b"7")
s.set("gone", b"x")
s.wait(["done"], timedelta(seconds=30))
assert s.get("from_rust") == b"world"
assert s.get("counter") == b"10"
assert s.get("cas") == b"new"
assert s.get("log") == b"rust+more"
assert s.multi_get(["m1", "m2"]) == [b"a", b"bb"]
assert not s.check(["gone"])
print("python server ok", flush=True)
"#;

#[test]
#[cfg_attr(miri, ignore = "processes")]
fn our_client_uses_a_pytorch_server() {
    let Some(py) = torch_python() else {
        println!("skipped: no torch");
        return;
    };
    let mut child = Command::new(&py)
        .args(["-c", SERVER])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let port: u16 = lines.next().unwrap().unwrap().trim().parse().unwrap();
    let c = TcpStore::new(
        StoreOptions::new("127.0.0.1", port, 1, 2)
            .with_protocol(StoreProtocol::Torch)
            .with_timeout(Duration::from_secs(20)),
    )
    .unwrap();
    assert_eq!(c.get("from_py").unwrap(), b"hello");
    c.set("from_rust", b"world").unwrap();
    assert_eq!(c.add("counter", 3).unwrap(), 10);
    assert_eq!(c.compare_set("cas", b"", b"new").unwrap(), b"new");
    assert_eq!(c.compare_set("cas", b"zzz", b"x").unwrap(), b"new");
    c.multi_set(&["m1", "m2"], &[b"a", b"bb"]).unwrap();
    assert_eq!(
        c.multi_get(&["m1", "from_py"]).unwrap(),
        [b"a".to_vec(), b"hello".to_vec()]
    );
    c.set("log", b"rust").unwrap();
    c.append("log", b"+more").unwrap();
    assert!(c.check(&["from_py", "m2"]).unwrap());
    assert!(!c.check(&["absent"]).unwrap());
    assert_eq!(c.try_get("absent").unwrap(), None);
    assert_eq!(c.try_get("m2").unwrap().as_deref(), Some(&b"bb"[..]));
    assert!(c.delete_key("gone").unwrap());
    assert!(!c.delete_key("gone").unwrap());
    // from_py counter from_rust cas m1 m2 log
    assert_eq!(c.num_keys().unwrap(), 7);
    let err = c
        .get_timeout("absent", Duration::from_millis(300))
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"absent\" did not appear"), "{err}");
    c.barrier("b", Duration::from_millis(300)).unwrap_err();
    c.set("done", b"1").unwrap();
    let status = child.wait().unwrap();
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "python: {rest:?} {stderr}");
    println!("{}", rest.join("\n"));
}
