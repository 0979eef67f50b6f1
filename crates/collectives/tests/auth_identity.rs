//! The job token and the job identity (issue 14): forged store clients and data-link peers are
//! refused, a wrong WORLD_SIZE fails at once naming both values, two jobs started at once on one
//! port never cross, a store without a token binds only loopback, and the collectives' timeout is
//! the one given.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use fsdp_collectives::auth::JobToken;
use fsdp_collectives::store::{StoreOptions, TcpStore};
use fsdp_collectives::tcp::{TcpCommunicator, TcpOptions};
use fsdp_collectives::{init_with_store, Backend, CollectiveError, InitOptions, LaunchEnv};

const HOST: &str = "127.0.0.1";

fn token(s: &str) -> Option<JobToken> {
    Some(JobToken::new(s).unwrap())
}

fn server(world: usize, tok: Option<JobToken>) -> TcpStore {
    TcpStore::new(
        StoreOptions::new(HOST, 0, 0, world)
            .with_timeout(Duration::from_secs(5))
            .with_token(tok),
    )
    .unwrap()
}

fn client(
    port: u16,
    rank: usize,
    world: usize,
    tok: Option<JobToken>,
) -> Result<TcpStore, CollectiveError> {
    TcpStore::new(
        StoreOptions::new(HOST, port, rank, world)
            .with_timeout(Duration::from_secs(5))
            .with_token(tok),
    )
}

#[test]
fn forged_store_clients_are_refused_and_cannot_touch_keys() {
    let s = server(2, token("the-job-secret"));
    s.set("k", b"v").unwrap();
    // Without the token, with a wrong one: refused at once (no retry until the timeout).
    let start = Instant::now();
    let err = client(s.port(), 1, 2, None).unwrap_err().to_string();
    assert!(
        err.contains("requires the job token") || err.contains("FSDP_JOB_TOKEN"),
        "{err}"
    );
    let err = client(s.port(), 1, 2, token("guess"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("wrong token"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(3));
    // A plain TCP client: a request without the greeting gets an error and the connection closed.
    let mut raw = TcpStream::connect((HOST, s.port())).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut req = vec![2u8]; // Set
    for field in [&b"k"[..], &b"forged"[..]] {
        req.extend_from_slice(&(field.len() as u32).to_be_bytes());
        req.extend_from_slice(field);
    }
    let mut frame = (req.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&req);
    raw.write_all(&frame).unwrap();
    let mut answer = Vec::new();
    let _ = raw.read_to_end(&mut answer);
    assert!(
        String::from_utf8_lossy(&answer).contains("not a client of this store"),
        "{answer:?}"
    );
    // Nothing was written, and the right token still works.
    assert_eq!(s.get("k").unwrap(), b"v");
    let good = client(s.port(), 1, 2, token("the-job-secret")).unwrap();
    assert_eq!(good.get("k").unwrap(), b"v");
    // A client with a token cannot join a store without one either.
    let open = server(2, None);
    let err = client(open.port(), 1, 2, token("x"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("has a job token"), "{err}");
}

#[test]
fn a_store_without_a_token_binds_only_loopback() {
    let err = TcpStore::new(StoreOptions::new("0.0.0.0", 0, 0, 1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("FSDP_JOB_TOKEN"), "{err}");
    assert!(!err.contains("secret"), "{err}");
    TcpStore::new(StoreOptions::new("0.0.0.0", 0, 0, 1).with_token(token("secret"))).unwrap();
}

#[test]
fn a_wrong_world_size_fails_every_rank_at_once_naming_both_values() {
    let port = TcpListener::bind((HOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let env = move |rank: usize, world: usize| {
        let vars = [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("MASTER_PORT", port.to_string()),
        ];
        LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()))
            .unwrap()
            .unwrap()
    };
    let start = Instant::now();
    let r0 = std::thread::spawn(move || env(0, 2).rendezvous(Duration::from_secs(60)).map(|_| ()));
    std::thread::sleep(Duration::from_millis(200));
    let e1 = env(1, 3)
        .rendezvous(Duration::from_secs(60))
        .unwrap_err()
        .to_string();
    let e0 = r0.join().unwrap().unwrap_err().to_string();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    let want = "rank 1 says WORLD_SIZE 3, rank 0 (the store's host) says 2";
    assert!(e1.contains(want), "{e1}");
    assert!(e0.contains(want), "{e0}");
}

/// One job of three ranks (threads) with its own token: rendezvous, a tcp communicator and a
/// barrier; each rank also checks that every rank of the store is of its job.
fn job(port: u16, name: &'static str) -> Vec<Result<(), String>> {
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            std::thread::spawn(move || -> Result<(), String> {
                let vars = [
                    ("RANK", rank.to_string()),
                    ("WORLD_SIZE", "3".to_string()),
                    ("MASTER_PORT", port.to_string()),
                    ("FSDP_JOB_TOKEN", format!("token-of-{name}")),
                    ("FSDP_JOB_ID", name.to_string()),
                ];
                let env = LaunchEnv::from_lookup(|k| {
                    vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
                })
                .unwrap()
                .unwrap();
                let e = |e: CollectiveError| e.to_string();
                // Short: a loser's rank still trying after the winner ended (which a launcher
                // would have killed when the loser's rank 0 failed) gives up soon.
                let store = env.rendezvous(Duration::from_secs(3)).map_err(e)?;
                store
                    .set(&format!("who/{rank}"), name.as_bytes())
                    .map_err(e)?;
                for r in 0..3 {
                    let who = store.get(&format!("who/{r}")).map_err(e)?;
                    assert_eq!(
                        who,
                        name.as_bytes(),
                        "rank {r} of another job in {name}'s store"
                    );
                }
                let comm = TcpCommunicator::new(
                    &store,
                    TcpOptions::default().with_timeout(Duration::from_secs(10)),
                )
                .map_err(e)?;
                use fsdp_collectives::Communicator;
                comm.barrier().and_then(|w| w.wait()).map_err(e)?;
                store.barrier("done", Duration::from_secs(10)).map_err(e)?;
                // Rank 0's store (the server) lives until the others are through.
                if rank == 0 {
                    store
                        .wait(&["left/1", "left/2"], Duration::from_secs(10))
                        .map_err(e)?;
                } else {
                    store.set(&format!("left/{rank}"), b"1").map_err(e)?;
                }
                Ok(())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn two_jobs_started_at_once_on_one_port_never_cross() {
    let (mut round, mut void) = (0, 0);
    while round < 50 {
        let port = TcpListener::bind((HOST, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let a = std::thread::spawn(move || job(port, "a"));
        let b = std::thread::spawn(move || job(port, "b"));
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        // Neither rank 0 could listen: a third program took the port between its choice and the
        // jobs' start (an outgoing connection elsewhere can get it from the ephemeral range).
        // Nothing crossed; the round is run again on another port.
        let refused = |j: &[Result<(), String>]| {
            j[0].as_ref()
                .is_err_and(|e| e.contains("store bind failed") && e.contains("already in use"))
        };
        if refused(&a) && refused(&b) {
            void += 1;
            assert!(
                void <= 10,
                "the port was taken by a third program {void} times"
            );
            continue;
        }
        round += 1;
        let ok = |j: &[Result<(), String>]| j.iter().all(Result::is_ok);
        // Exactly one job trains, with its own ranks (each checked the store's `who/` keys);
        // every rank of the other fails clearly.
        assert!(ok(&a) != ok(&b), "round {round}: a {a:?}, b {b:?}");
        let loser = if ok(&a) { &b } else { &a };
        for r in loser {
            let e = r.as_ref().unwrap_err();
            assert!(
                e.contains("already in use")
                    || e.contains("wrong token")
                    || e.contains("another job")
                    || e.contains("belongs to job")
                    // The winner ended before this rank reached its store.
                    || e.contains("could not connect")
                    || e.contains("did not prove"),
                "round {round}: {e}"
            );
        }
    }
}

#[test]
fn a_data_link_peer_with_a_wrong_token_is_refused() {
    let tok = token("link-secret");
    let s = server(2, tok.clone());
    let port = s.port();
    let rank0 = std::thread::spawn(move || {
        TcpCommunicator::new(
            &s,
            TcpOptions::default().with_timeout(Duration::from_secs(5)),
        )
        .map(|_| ())
    });
    // A forger with store access (the right token) but not the data link's: it poses as rank 1.
    let store = client(port, 1, 2, tok).unwrap();
    let listener = TcpListener::bind((HOST, 0)).unwrap();
    store
        .set(
            "fsdp/tcp/g1/addr/1",
            listener.local_addr().unwrap().to_string().as_bytes(),
        )
        .unwrap();
    let addr0 = String::from_utf8(store.get("fsdp/tcp/g1/addr/0").unwrap()).unwrap();
    // Its hello to rank 0 (the tcp wire format), with a nonce.
    let mut hello = b"FSDPTCP\x01".to_vec();
    hello.extend_from_slice(&1u32.to_le_bytes());
    hello.extend_from_slice(&0x0102_0304u32.to_ne_bytes());
    hello.extend_from_slice(&[4, 8, 2, 2]);
    for v in [2u64, 1, 0] {
        hello.extend_from_slice(&v.to_le_bytes());
    }
    hello.extend_from_slice(&2u32.to_le_bytes());
    hello.extend_from_slice(b"g1");
    hello.extend_from_slice(&[7u8; 32]);
    let mut to0 = TcpStream::connect(addr0.as_str()).unwrap();
    to0.write_all(&hello).unwrap();
    // Rank 0 connects to "rank 1": answer its hello with a proof made without the token.
    let (mut from0, _) = listener.accept().unwrap();
    let mut their_hello = vec![0u8; 48 + 2 + 32];
    from0.read_exact(&mut their_hello).unwrap();
    let mut answer = vec![0u8];
    answer.extend_from_slice(&[9u8; 32]);
    answer.extend_from_slice(&[0u8; 32]);
    from0.write_all(&answer).unwrap();
    let err = rank0.join().unwrap().unwrap_err().to_string();
    assert!(
        err.contains("did not prove that it knows the job token"),
        "{err}"
    );
}

#[test]
fn the_collectives_timeout_is_the_one_given() {
    let port = TcpListener::bind((HOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let run = move |rank: usize| {
        let vars = [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "2".to_string()),
            ("MASTER_PORT", port.to_string()),
        ];
        let env =
            LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()))
                .unwrap()
                .unwrap();
        let opts = InitOptions::default()
            .with_timeout(Duration::from_secs(1))
            .with_init_timeout(Duration::from_secs(20));
        let store = env.rendezvous(opts.effective_init_timeout()).unwrap();
        let comm = init_with_store(Backend::Tcp, &store, &env, &opts).unwrap();
        (store, comm)
    };
    let r1 = std::thread::spawn(move || {
        let kept = run(1);
        // Rank 1 never enters the barrier.
        std::thread::sleep(Duration::from_secs(4));
        drop(kept);
    });
    let (_store, comm) = run(0);
    let start = Instant::now();
    let err = comm.barrier().and_then(|w| w.wait()).unwrap_err();
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}: {err}"
    );
    assert!(matches!(err, CollectiveError::Timeout { .. }), "{err}");
    r1.join().unwrap();
}
