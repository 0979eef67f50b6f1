//! The tcp backend across real processes: the test binary re-executes itself as three rank
//! processes that meet through a store hosted by the parent on 127.0.0.1 (a free port).
//!
//! - every collective, for every element type and reduce op, checked against a naive host
//!   reference, and the reductions checked bitwise against the in-process ring backend run
//!   inside each child on the same data;
//! - a rank process that dies in the middle of a collective makes the others fail with an error
//!   naming it, well within the timeout.

#![allow(clippy::needless_range_loop)] // index arithmetic mirrors the collectives' definitions

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fsdp_collectives::store::{StoreOptions, TcpStore};
use fsdp_collectives::{ring, tcp, CollectiveError, Communicator, ReduceOp};
use fsdp_device::{with_element, Buffer, DType, Element};

const ROLE: &str = "FSDP_TCP_MP_ROLE";
const PORT: &str = "FSDP_TCP_MP_PORT";
const RANK: &str = "FSDP_TCP_MP_RANK";
const WORLD: usize = 3;
/// Bound of every wait inside the children; the parent gives them this long in all.
const TIMEOUT: Duration = Duration::from_secs(60);

/// Kills and reaps the children on every path out of the parent.
struct Children(Vec<(usize, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Spawn `WORLD` children running `test` in `role`, wait for all of them (at most `TIMEOUT`),
/// and return each one's exit code and output.
fn run_children(test: &str, role: &str) -> Vec<(Option<i32>, String)> {
    let server = TcpStore::new(StoreOptions::new("127.0.0.1", 0, 0, WORLD).with_timeout(TIMEOUT))
        .expect("hosting the store");
    let exe = std::env::current_exe().unwrap();
    let mut children = Children(Vec::new());
    let mut readers = Vec::new();
    for rank in 0..WORLD {
        let mut child = Command::new(&exe)
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env(PORT, server.port().to_string())
            .env(RANK, rank.to_string())
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
        children.0.push((rank, child));
    }
    let deadline = Instant::now() + TIMEOUT;
    let mut codes = vec![None; WORLD];
    let mut done = vec![false; WORLD];
    while done.iter().any(|d| !d) {
        for (rank, c) in &mut children.0 {
            if !done[*rank] {
                if let Some(status) = c.try_wait().unwrap() {
                    codes[*rank] = status.code();
                    done[*rank] = true;
                }
            }
        }
        if Instant::now() > deadline {
            drop(children);
            panic!("rank processes did not finish within {TIMEOUT:?} (done: {done:?})");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(children);
    codes
        .into_iter()
        .zip(readers)
        .map(|(c, r)| (c, r.join().unwrap()))
        .collect()
}

/// The child's communicator, through the parent's store.
fn child_comm(opts: tcp::TcpOptions) -> (TcpStore, tcp::TcpCommunicator) {
    let port: u16 = std::env::var(PORT).unwrap().parse().unwrap();
    let rank: usize = std::env::var(RANK).unwrap().parse().unwrap();
    let store = TcpStore::new(
        StoreOptions::new("127.0.0.1", port, rank, WORLD)
            .with_server(false)
            .with_timeout(TIMEOUT),
    )
    .unwrap();
    let comm = tcp::TcpCommunicator::new(&store, opts).unwrap();
    (store, comm)
}

fn val(op: ReduceOp, rank: usize, i: usize) -> f64 {
    match op {
        ReduceOp::Product => [1.0, -1.0, 2.0, 0.5][(rank * 3 + i) % 4],
        _ => ((rank * 7 + i * 13) % 17) as f64 - 8.0,
    }
}

fn make(dtype: DType, vals: &[f64]) -> Buffer {
    with_element!(dtype, T => {
        let v: Vec<T> = vals.iter().map(|&x| T::from_f64(x)).collect();
        Buffer::from_slice(&v).unwrap()
    })
}

fn read(buf: &Buffer) -> Vec<f64> {
    with_element!(buf.dtype(), T => buf.to_vec::<T>().unwrap().into_iter().map(|x| x.to_f64()).collect())
}

fn reduced(dtype: DType, op: ReduceOp, world: usize, i: usize) -> f64 {
    with_element!(dtype, T => {
        let mut acc = T::from_f64(val(op, 0, i));
        for r in 1..world {
            acc = op.combine(acc, T::from_f64(val(op, r, i)));
        }
        op.finish(acc, world).to_f64()
    })
}

/// Every collective once, checked against the host reference.
fn check_all(comm: &dyn Communicator, dtype: DType, op: ReduceOp, len: usize, root: usize) {
    let (r, world) = (comm.rank(), comm.world_size());
    let mine: Vec<f64> = (0..len).map(|i| val(op, r, i)).collect();
    let input = make(dtype, &mine);
    let output = Buffer::zeros(dtype, world * len).unwrap();
    let rs_in = make(
        dtype,
        &(0..world * len).map(|j| val(op, r, j)).collect::<Vec<_>>(),
    );
    let rs_out = Buffer::zeros(dtype, len).unwrap();
    let ar = make(dtype, &mine);
    let bc = make(dtype, &mine);
    let red = make(dtype, &mine);
    let sizes: Vec<usize> = (0..world).map(|q| len + 2 * q).collect();
    let ug_in = make(
        dtype,
        &(0..sizes[r]).map(|i| val(op, r, i)).collect::<Vec<_>>(),
    );
    let ug_out: Vec<Buffer> = sizes
        .iter()
        .map(|&s| Buffer::zeros(dtype, s).unwrap())
        .collect();
    let works = vec![
        comm.all_gather_base(&input, &output).unwrap(),
        comm.reduce_scatter_base(&rs_in, &rs_out, op).unwrap(),
        comm.all_reduce(&ar, op).unwrap(),
        comm.broadcast(&bc, root).unwrap(),
        comm.reduce(&red, op, root).unwrap(),
        comm.all_gather(&ug_in, &ug_out).unwrap(),
        comm.barrier().unwrap(),
    ];
    for w in works {
        w.wait().unwrap();
    }
    let what = format!("{dtype} {op} rank {r}");
    let got = read(&output);
    for q in 0..world {
        for i in 0..len {
            let want = with_element!(dtype, T => T::from_f64(val(op, q, i)).to_f64());
            assert_eq!(
                got[q * len + i],
                want,
                "all_gather_base {what} block {q} elem {i}"
            );
        }
    }
    let got = read(&rs_out);
    for i in 0..len {
        assert_eq!(
            got[i],
            reduced(dtype, op, world, r * len + i),
            "reduce_scatter {what} {i}"
        );
    }
    let got = read(&ar);
    for i in 0..len {
        assert_eq!(
            got[i],
            reduced(dtype, op, world, i),
            "all_reduce {what} elem {i}"
        );
    }
    let got = read(&bc);
    for i in 0..len {
        assert_eq!(got[i], val(op, root, i), "broadcast {what} elem {i}");
    }
    let got = read(&red);
    for i in 0..len {
        let want = if r == root {
            reduced(dtype, op, world, i)
        } else {
            val(op, r, i)
        };
        assert_eq!(got[i], want, "reduce {what} elem {i}");
    }
    for (q, o) in ug_out.iter().enumerate() {
        let got = read(o);
        assert_eq!(got.len(), sizes[q]);
        for (i, g) in got.iter().enumerate() {
            assert_eq!(*g, val(op, q, i), "all_gather {what} from {q} elem {i}");
        }
    }
}

/// Order-sensitive data: values of very different magnitudes and signs.
fn noisy(seed: u64, i: usize) -> f64 {
    let mut x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    let mant = (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
    mant * 2f64.powi(((x >> 3) % 24) as i32 - 12)
}

/// The bits of all-reduce, reduce-scatter and reduce results for every type and op.
fn reductions(comm: &dyn Communicator, len: usize) -> Vec<Vec<u8>> {
    let (r, world) = (comm.rank(), comm.world_size());
    let mut out = Vec::new();
    for (di, dtype) in DType::ALL.into_iter().enumerate() {
        for (oi, op) in ReduceOp::ALL.into_iter().enumerate() {
            let seed = (r as u64 + 1) * 1000 + di as u64 * 10 + oi as u64;
            let data = |n: usize, salt: u64| -> Vec<f64> {
                (0..n).map(|i| noisy(seed ^ (salt << 32), i)).collect()
            };
            let ar = make(dtype, &data(len, 1));
            let rs_in = make(dtype, &data(world * len, 2));
            let rs_out = Buffer::zeros(dtype, len).unwrap();
            let red = make(dtype, &data(len, 3));
            let ws = [
                comm.all_reduce(&ar, op).unwrap(),
                comm.reduce_scatter_base(&rs_in, &rs_out, op).unwrap(),
                comm.reduce(&red, op, 0).unwrap(),
            ];
            for w in ws {
                w.wait().unwrap();
            }
            for b in [&ar, &rs_out, &red] {
                // f64 holds every element type exactly, NaN aside (there is none in this data).
                out.push(read(b).iter().flat_map(|x| x.to_le_bytes()).collect());
            }
        }
    }
    out
}

#[test]
fn three_processes_run_every_collective() {
    if std::env::var(ROLE).as_deref() == Ok("collectives") {
        let opts = tcp::TcpOptions::default()
            .with_timeout(TIMEOUT)
            .with_segment_bytes(24);
        let (_store, comm) = child_comm(opts);
        let r = comm.rank();
        for (di, dtype) in DType::ALL.into_iter().enumerate() {
            for (oi, op) in ReduceOp::ALL.into_iter().enumerate() {
                check_all(&comm, dtype, op, 37, (di + oi) % WORLD);
                check_all(&comm, dtype, op, 0, 0);
            }
        }
        // The same reductions in-process on the ring backend: this rank's results must be
        // bitwise identical.
        let mine = reductions(&comm, 203);
        let ring = ring::run_ranks(
            WORLD,
            ring::RingOptions::default().with_segment_bytes(24),
            |c| reductions(&c, 203),
        )
        .unwrap();
        assert!(
            mine == ring[r],
            "rank {r}: tcp reductions differ from the ring backend"
        );
        // Sub-groups across processes: {0, 2} and {1}.
        let sub = comm.split(Some((r % 2) as u32), r).unwrap().unwrap();
        let b = Buffer::from_slice(&[r as f32 + 1.0]).unwrap();
        sub.all_reduce(&b, ReduceOp::Sum).unwrap().wait().unwrap();
        let want = if r % 2 == 0 { 4.0 } else { 2.0 };
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![want]);
        comm.barrier().unwrap().wait().unwrap();
        println!("rank {r}: all collectives match the reference");
        return;
    }
    if std::env::var(ROLE).is_ok() {
        return; // a child of the other test
    }
    let results = run_children("three_processes_run_every_collective", "collectives");
    for (rank, (code, out)) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank} failed:\n{out}");
        assert!(
            out.contains(&format!("rank {rank}: all collectives match the reference")),
            "{out}"
        );
    }
}

#[test]
fn a_process_that_dies_fails_the_others() {
    if std::env::var(ROLE).as_deref() == Ok("dies") {
        let (_store, comm) = child_comm(
            tcp::TcpOptions::default()
                .with_timeout(TIMEOUT)
                .with_segment_bytes(4096),
        );
        let r = comm.rank();
        let buf = Buffer::from_slice(&vec![1.0f32; 1 << 18]).unwrap();
        comm.all_reduce(&buf, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(buf.to_vec::<f32>().unwrap()[0], 3.0);
        if r == 2 {
            // Die abruptly while the next all-reduce is in flight (no destructors run).
            let _w = comm.all_reduce(&buf, ReduceOp::Sum).unwrap();
            std::thread::sleep(Duration::from_millis(5));
            std::process::exit(17);
        }
        let t0 = Instant::now();
        let mut err = None;
        for _ in 0..100 {
            if let Err(e) = comm.all_reduce(&buf, ReduceOp::Sum).and_then(|w| w.wait()) {
                err = Some(e);
                break;
            }
        }
        let err = err.expect("the collectives kept succeeding without rank 2");
        let took = t0.elapsed();
        println!("rank {r}: failed after {took:?} with: {err}");
        assert!(
            matches!(
                err,
                CollectiveError::PeerDeparted { peer: 2, .. } | CollectiveError::Aborted { .. }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("rank 2"), "{err}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
        // The communicator is aborted for good.
        assert!(matches!(
            comm.barrier(),
            Err(CollectiveError::Aborted { .. })
        ));
        println!("rank {r}: failed as expected");
        return;
    }
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let results = run_children("a_process_that_dies_fails_the_others", "dies");
    assert_eq!(results[2].0, Some(17), "rank 2:\n{}", results[2].1);
    for rank in 0..2 {
        let (code, out) = &results[rank];
        assert_eq!(*code, Some(0), "rank {rank} failed:\n{out}");
        assert!(
            out.contains(&format!("rank {rank}: failed as expected")),
            "{out}"
        );
        for line in out.lines().filter(|l| l.contains("failed after")) {
            println!("{line}");
        }
    }
}
