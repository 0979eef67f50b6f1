//! Conformance of the store to PyTorch's TCPStore wire protocol, against recorded byte
//! sequences of every query (no PyTorch needed).
//!
//! The sequences are what `torch.distributed.TCPStore` 2.15 sends and receives (recorded through
//! a proxy between a Python client and a Python server; they follow c10d's `TCPStore.cpp` and
//! `TCPStoreLibUvBackend.cpp`): keys carry TCPStore's `/` prefix, integers are little-endian,
//! strings a `u64` length and the bytes.
//! - Our server answers a PyTorch client's bytes with PyTorch's server's bytes.
//! - Our client, speaking PyTorch's protocol to a scripted server, sends PyTorch's client's
//!   bytes for each operation.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

use fsdp_collectives::auth::JobToken;
use fsdp_collectives::store::{StoreOptions, StoreProtocol, TcpStore};

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The greeting: VALIDATE with the magic number, PING with a nonce, echoed.
const VALIDATE: &str = "00 cef7853c";
const PING: &str = "0d ab0d0000";
const PONG: &str = "ab0d0000";

/// (what the client sends, what the server answers), in order, as recorded.
const SESSION: &[(&str, &str)] = &[
    // set("k", b"v1")
    ("01 0200000000000000 2f6b 0200000000000000 7631", ""),
    // get("k"): WAIT for it, then GET.
    ("06 0100000000000000 0200000000000000 2f6b", "00"),
    ("03 0200000000000000 2f6b", "0200000000000000 7631"),
    // add("n", 5)
    (
        "04 0200000000000000 2f6e 0500000000000000",
        "0500000000000000",
    ),
    // check(["k", "zz"]): NOT_READY
    (
        "05 0200000000000000 0200000000000000 2f6b 0300000000000000 2f7a7a",
        "01",
    ),
    // compare_set("k", b"v1", b"v2")
    (
        "02 0200000000000000 2f6b 0200000000000000 7631 0200000000000000 7632",
        "0200000000000000 7632",
    ),
    // multi_get(["k", "n"]): WAIT, then MULTI_GET.
    (
        "06 0200000000000000 0200000000000000 2f6b 0200000000000000 2f6e",
        "00",
    ),
    (
        "0a 0200000000000000 0200000000000000 2f6b 0200000000000000 2f6e",
        "0200000000000000 7632 0100000000000000 35",
    ),
    // multi_set(["a", "b"], [b"1", b"22"])
    (
        "0b 0200000000000000 0200000000000000 2f61 0100000000000000 31 \
         0200000000000000 2f62 0200000000000000 3232",
        "",
    ),
    // delete_key("a")
    ("08 0200000000000000 2f61", "0100000000000000"),
    // num_keys(): "/k", "/n", "/b"
    ("07", "0300000000000000"),
    // append("b", b"3")
    ("09 0200000000000000 2f62 0100000000000000 33", ""),
    // get("b") after the append
    ("06 0100000000000000 0200000000000000 2f62", "00"),
    ("03 0200000000000000 2f62", "0300000000000000 323233"),
];

/// A wait that runs out: WAIT, then CANCEL_WAIT answered WAIT_CANCELED.
const WAIT_NEVER: &str = "06 0100000000000000 0600000000000000 2f6e65766572";
const CANCEL_WAIT: &str = "0c";
const WAIT_CANCELED: &str = "01";

fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).unwrap();
    b
}

/// Asserts the peer closed `s` within a few seconds (a server that kept the connection open
/// fails here with the read timeout) and sent nothing before closing. A close is an end of
/// stream (`Ok(0)`), or, with `reset_ok`, a reset: Linux resets a connection closed with
/// bytes it never read, which is what a server that refuses a client at its first bytes does.
fn assert_closed_without_answer(s: &mut TcpStream, reset_ok: bool) {
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut rest = Vec::new();
    let got = s.read_to_end(&mut rest);
    let closed = match &got {
        Ok(n) => *n == 0,
        Err(e) => reset_ok && e.kind() == std::io::ErrorKind::ConnectionReset,
    };
    assert!(
        closed,
        "expected the server to close the connection, got {got:?}"
    );
    assert!(rest.is_empty(), "unexpected answer: {}", to_hex(&rest));
}

#[test]
#[cfg_attr(miri, ignore = "sockets")]
fn our_server_answers_pytorch_clients_bytes() {
    let t = Duration::from_secs(10);
    let server = TcpStore::new(StoreOptions::new("127.0.0.1", 0, 0, 1).with_timeout(t)).unwrap();
    let mut c = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    c.set_read_timeout(Some(t)).unwrap();
    c.write_all(&hex(VALIDATE)).unwrap();
    c.write_all(&hex(PING)).unwrap();
    assert_eq!(to_hex(&read_n(&mut c, 4)), PONG);
    for (send, want) in SESSION {
        c.write_all(&hex(send)).unwrap();
        let want = hex(want);
        assert_eq!(
            to_hex(&read_n(&mut c, want.len())),
            to_hex(&want),
            "reply to {send}"
        );
    }
    // Our own client sees PyTorch's keys (the same `/` prefix), and the other way round.
    assert_eq!(server.get("k").unwrap(), b"v2");
    assert_eq!(server.get("b").unwrap(), b"223");
    server.set("ours", b"x").unwrap();
    c.write_all(&hex("03 0500000000000000 2f6f757273")).unwrap();
    assert_eq!(to_hex(&read_n(&mut c, 9)), "010000000000000078");
    // A wait that runs out: the cancel is answered.
    c.write_all(&hex(WAIT_NEVER)).unwrap();
    thread::sleep(Duration::from_millis(100));
    c.write_all(&hex(CANCEL_WAIT)).unwrap();
    assert_eq!(to_hex(&read_n(&mut c, 1)), WAIT_CANCELED);
    // An unknown query code ends the connection: the server closes it (end of stream well
    // before the read timeout) without sending anything.
    c.write_all(&[0x63]).unwrap();
    assert_closed_without_answer(&mut c, false);
}

#[test]
#[cfg_attr(miri, ignore = "sockets")]
fn a_store_with_a_token_refuses_pytorch_clients() {
    let t = Duration::from_secs(10);
    let token = JobToken::new(b"0123456789abcdef0123456789abcdef").unwrap();
    let server = TcpStore::new(
        StoreOptions::new("127.0.0.1", 0, 0, 1)
            .with_timeout(t)
            .with_token(Some(token)),
    )
    .unwrap();
    let mut c = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    c.set_read_timeout(Some(t)).unwrap();
    c.write_all(&hex(VALIDATE)).unwrap();
    c.write_all(&hex(PING)).unwrap();
    // Closed without an answer to PING (reset: the refusal leaves the greeting unread).
    assert_closed_without_answer(&mut c, true);
    // And our client, speaking PyTorch's protocol, is told what happened.
    let err = TcpStore::new(
        StoreOptions::new("127.0.0.1", server.port(), 0, 1)
            .with_server(false)
            .with_protocol(StoreProtocol::Torch)
            .with_timeout(Duration::from_secs(1)),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("PING"), "{err}");
}

#[test]
#[cfg_attr(miri, ignore = "sockets")]
fn our_client_sends_pytorch_clients_bytes() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let script = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut log = Vec::new();
        // The greeting: the nonce is the client's own; echo it.
        assert_eq!(to_hex(&read_n(&mut s, 5)), VALIDATE.replace(' ', ""));
        let ping = read_n(&mut s, 5);
        assert_eq!(ping[0], 0x0d);
        s.write_all(&ping[1..]).unwrap();
        for (send, reply) in SESSION {
            let want = hex(send);
            let got = read_n(&mut s, want.len());
            log.push((to_hex(&got), to_hex(&want)));
            s.write_all(&hex(reply)).unwrap();
        }
        // wait(["never"]) with a short timeout: WAIT, CANCEL_WAIT, then a CHECK of the key.
        let got = read_n(&mut s, hex(WAIT_NEVER).len());
        log.push((to_hex(&got), to_hex(&hex(WAIT_NEVER))));
        let got = read_n(&mut s, 1);
        log.push((to_hex(&got), CANCEL_WAIT.into()));
        s.write_all(&hex(WAIT_CANCELED)).unwrap();
        let check = "05 0100000000000000 0600000000000000 2f6e65766572";
        let got = read_n(&mut s, hex(check).len());
        log.push((to_hex(&got), to_hex(&hex(check))));
        s.write_all(&hex("01")).unwrap();
        log
    });
    let c = TcpStore::new(
        StoreOptions::new("127.0.0.1", port, 1, 2)
            .with_protocol(StoreProtocol::Torch)
            .with_timeout(Duration::from_secs(10)),
    )
    .unwrap();
    c.set("k", b"v1").unwrap();
    assert_eq!(c.get("k").unwrap(), b"v1");
    assert_eq!(c.add("n", 5).unwrap(), 5);
    assert!(!c.check(&["k", "zz"]).unwrap());
    assert_eq!(c.compare_set("k", b"v1", b"v2").unwrap(), b"v2");
    assert_eq!(
        c.multi_get(&["k", "n"]).unwrap(),
        vec![b"v2".to_vec(), b"5".to_vec()]
    );
    c.multi_set(&["a", "b"], &[b"1", b"22"]).unwrap();
    assert!(c.delete_key("a").unwrap());
    assert_eq!(c.num_keys().unwrap(), 3);
    c.append("b", b"3").unwrap();
    assert_eq!(c.get("b").unwrap(), b"223");
    let err = c
        .wait(&["never"], Duration::from_millis(200))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"never\"") && err.contains("did not appear"),
        "{err}"
    );
    for (got, want) in script.join().unwrap() {
        assert_eq!(got, want);
    }
}
