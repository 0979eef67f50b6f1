//! Runs every collective of the MPI backend against a naive host reference.
//!
//! ```text
//! cargo build --release -p fsdp-collectives --features mpi --examples
//! mpirun -np 3 target/release/examples/mpi_reference             # every collective, op, dtype
//! mpirun -np 3 target/release/examples/mpi_reference --mismatch  # mismatched calls fail cleanly
//! mpirun -np 3 target/release/examples/mpi_reference --timeout   # a missing rank times out
//! mpirun -np 3 target/release/examples/mpi_reference --conformance  # the shared suite
//! ```
//!
//! `--conformance` runs the conformance cases every backend runs (`tests/support/cases.rs`);
//! the timeout case is `--timeout` here (MPI's message cannot name the missing rank, and a
//! process whose MPI operation timed out must end without finalizing MPI).
//!
//! Each rank builds deterministic inputs for every rank of its group (values `k/2` with
//! `|k| <= 10`, so that sums and products over up to three ranks are exact in `f32` and `f64`),
//! computes the expected result naively in `f64` and rounds it once to the element type, and
//! compares bit for bit (NaN matches NaN). It prints one summary line per rank and exits non-zero
//! on any mismatch.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use fsdp_collectives::mpi::{MpiCommunicator, MpiOptions};
use fsdp_collectives::{CollectiveError, Communicator, ReduceOp};
use fsdp_device::half::bf16;
use fsdp_device::{with_element, Buffer, DType, Element};

#[path = "../tests/support/mod.rs"]
mod support;

/// Counts checks and records failures.
struct Checker {
    rank: usize,
    checks: usize,
    failures: Vec<String>,
}

impl Checker {
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        self.checks += 1;
        if !ok {
            let what = what();
            eprintln!("rank {}: FAILED: {what}", self.rank);
            self.failures.push(what);
        }
    }

    fn result<T>(&mut self, r: Result<T, CollectiveError>, what: &str) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.check(false, || format!("{what}: {e}"));
                None
            }
        }
    }
}

/// The input of `rank` at element `i` for test `salt`: `k/2` with `k` in `-10..=10`.
fn value(rank: usize, i: usize, salt: usize) -> f64 {
    let k = ((rank * 7 + i * 3 + salt * 5) % 21) as f64 - 10.0;
    k / 2.0
}

/// With `nan`, the last rank of the group has NaN at every 7th element (from 3).
fn input<T: Element>(rank: usize, world: usize, len: usize, salt: usize, nan: bool) -> Vec<T> {
    (0..len)
        .map(|i| {
            if nan && rank + 1 == world && i % 7 == 3 {
                T::from_f64(f64::NAN)
            } else {
                T::from_f64(value(rank, i, salt))
            }
        })
        .collect()
}

/// `op` over the ranks' values, exactly in f64, rounded once to `T`.
fn reference<T: Element>(op: ReduceOp, values: &[T]) -> T {
    let mut acc = values[0].to_f64();
    for v in &values[1..] {
        acc = op.combine(acc, v.to_f64());
    }
    T::from_f64(op.finish(acc, values.len()))
}

fn same<T: Element>(a: T, b: T) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

fn first_diff<T: Element>(got: &[T], want: &[T]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("length {} != {}", got.len(), want.len()));
    }
    got.iter()
        .zip(want)
        .position(|(&g, &w)| !same(g, w))
        .map(|i| format!("element {i}: got {:?}, want {:?}", got[i], want[i]))
}

fn wait(chk: &mut Checker, r: Result<fsdp_collectives::Work, CollectiveError>, what: &str) -> bool {
    match r.and_then(|w| w.wait()) {
        Ok(()) => true,
        Err(e) => {
            chk.check(false, || format!("{what}: {e}"));
            false
        }
    }
}

/// Every collective with every op on one dtype and length.
fn suite<T: Element>(comm: &dyn Communicator, chk: &mut Checker, group: &str, len: usize) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dt = T::DTYPE;
    let tag = |what: &str| format!("[{group} {dt} len={len}] {what}");
    let from = |v: &[T]| Buffer::from_slice(v).expect("host buffer");
    let read = |b: &Buffer| b.to_vec::<T>().expect("readable buffer");

    // all_gather_base, out of place and in place.
    for in_place in [false, true] {
        let ins: Vec<Vec<T>> = (0..world).map(|r| input(r, world, len, 1, false)).collect();
        let want: Vec<T> = ins.concat();
        let output = Buffer::zeros(dt, len * world).unwrap();
        let what = tag(&format!("all_gather_base(in_place={in_place})"));
        let r = if in_place {
            output
                .slice(rank * len..(rank + 1) * len)
                .unwrap()
                .copy_from_slice(&ins[rank])
                .unwrap();
            let own = output.slice(rank * len..(rank + 1) * len).unwrap();
            comm.all_gather_base(&own, &output)
        } else {
            comm.all_gather_base(&from(&ins[rank]), &output)
        };
        if wait(chk, r, &what) {
            let d = first_diff(&read(&output), &want);
            chk.check(d.is_none(), || format!("{what}: {}", d.unwrap()));
        }
    }

    for (oi, op) in ReduceOp::ALL.into_iter().enumerate() {
        let nan = matches!(op, ReduceOp::Min | ReduceOp::Max);
        let salt = 10 + oi;
        // reduce_scatter_base (in place for Sum).
        {
            let ins: Vec<Vec<T>> = (0..world)
                .map(|r| input(r, world, len * world, salt, nan))
                .collect();
            let want: Vec<T> = (0..len)
                .map(|j| {
                    let vals: Vec<T> = ins.iter().map(|v| v[rank * len + j]).collect();
                    reference(op, &vals)
                })
                .collect();
            let in_place = op == ReduceOp::Sum;
            let what = tag(&format!("reduce_scatter_base({op}, in_place={in_place})"));
            let input_buf = from(&ins[rank]);
            let output = if in_place {
                input_buf.slice(rank * len..(rank + 1) * len).unwrap()
            } else {
                Buffer::zeros(dt, len).unwrap()
            };
            if wait(
                chk,
                comm.reduce_scatter_base(&input_buf, &output, op),
                &what,
            ) {
                let d = first_diff(&read(&output), &want);
                chk.check(d.is_none(), || format!("{what}: {}", d.unwrap()));
            }
        }
        // all_reduce
        let ins: Vec<Vec<T>> = (0..world)
            .map(|r| input(r, world, len, salt + 20, nan))
            .collect();
        let want: Vec<T> = (0..len)
            .map(|j| {
                let vals: Vec<T> = ins.iter().map(|v| v[j]).collect();
                reference(op, &vals)
            })
            .collect();
        {
            let what = tag(&format!("all_reduce({op})"));
            let buf = from(&ins[rank]);
            if wait(chk, comm.all_reduce(&buf, op), &what) {
                let d = first_diff(&read(&buf), &want);
                chk.check(d.is_none(), || format!("{what}: {}", d.unwrap()));
            }
        }
        // reduce to a root that varies with the op.
        {
            let root = (oi + len) % world;
            let what = tag(&format!("reduce({op}, root={root})"));
            let buf = from(&ins[rank]);
            if wait(chk, comm.reduce(&buf, op, root), &what) {
                let expect = if rank == root { &want } else { &ins[rank] };
                let d = first_diff(&read(&buf), expect);
                chk.check(d.is_none(), || format!("{what}: {}", d.unwrap()));
            }
        }
    }

    // broadcast from every root.
    for root in 0..world {
        let what = tag(&format!("broadcast(root={root})"));
        let buf = from(&input(rank, world, len, 40 + root, false));
        if wait(chk, comm.broadcast(&buf, root), &what) {
            let d = first_diff(&read(&buf), &input(root, world, len, 40 + root, false));
            chk.check(d.is_none(), || format!("{what}: {}", d.unwrap()));
        }
    }

    // Unequal all_gather: rank 1 contributes nothing, the others len + rank.
    {
        let lens: Vec<usize> = (0..world)
            .map(|r| if r == 1 { 0 } else { len + r })
            .collect();
        let ins: Vec<Vec<T>> = (0..world)
            .map(|r| input(r, world, lens[r], 50, false))
            .collect();
        let outputs: Vec<Buffer> = lens
            .iter()
            .map(|&l| Buffer::zeros(dt, l).unwrap())
            .collect();
        let what = tag(&format!("all_gather(lens={lens:?})"));
        if wait(chk, comm.all_gather(&from(&ins[rank]), &outputs), &what) {
            for (r, o) in outputs.iter().enumerate() {
                let d = first_diff(&read(o), &ins[r]);
                chk.check(d.is_none(), || {
                    format!("{what}: from rank {r}: {}", d.unwrap())
                });
            }
        }
    }

    let what = tag("barrier");
    wait(chk, comm.barrier(), &what);
}

/// The suite over every dtype and several lengths (including 0 and non-multiples of anything).
fn full(comm: &dyn Communicator, chk: &mut Checker, group: &str, lens: &[usize]) {
    for dtype in DType::ALL {
        for &len in lens {
            with_element!(dtype, T => suite::<T>(comm, chk, group, len));
        }
    }
}

/// bf16 sums are reduced in f32 and rounded once: 256 + 1 + 1 = 258 (the ring, rounding after
/// every addition, gives 256).
fn bf16_rounding(comm: &dyn Communicator, chk: &mut Checker) {
    let world = comm.world_size();
    let mine = if comm.rank() == 0 { 256.0 } else { 1.0 };
    let buf = Buffer::from_slice(&[bf16::from_f32(mine)]).unwrap();
    if wait(chk, comm.all_reduce(&buf, ReduceOp::Sum), "bf16 rounding") {
        let got = buf.to_vec::<bf16>().unwrap()[0];
        let exact = bf16::from_f64(256.0 + (world - 1) as f64);
        chk.check(got == exact, || {
            format!("bf16 256 + 1 + ...: got {got}, want the once-rounded {exact}")
        });
        if world == 3 {
            let ring = ReduceOp::Sum.reduce_in_order(
                &[
                    bf16::from_f32(256.0),
                    bf16::from_f32(1.0),
                    bf16::from_f32(1.0),
                ],
                0,
            );
            chk.check(
                ring == bf16::from_f32(256.0) && got == bf16::from_f32(258.0),
                || format!("bf16 256 + 1 + 1: mpi {got}, ring order {ring}"),
            );
        }
    }
}

fn run_full(world: &MpiCommunicator, chk: &mut Checker) {
    let (rank, n) = (world.rank(), world.world_size());
    full(world, chk, "world", &[0, 1, 5, 1000, 4099]);
    bf16_rounding(world, chk);

    // Split A: by parity, keys reversing the order.
    match chk.result(
        world.split(Some((rank % 2) as u32), n - rank),
        "split by parity",
    ) {
        Some(Some(sub)) => {
            let mut members: Vec<usize> = (0..n).filter(|r| r % 2 == rank % 2).collect();
            members.reverse();
            let want_rank = members.iter().position(|&r| r == rank).unwrap();
            chk.check(
                sub.rank() == want_rank && sub.world_size() == members.len(),
                || {
                    format!(
                        "parity split: got rank {}/{}, want {want_rank}/{}",
                        sub.rank(),
                        sub.world_size(),
                        members.len()
                    )
                },
            );
            full(sub.as_ref(), chk, "parity", &[0, 3, 1001]);
        }
        Some(None) => chk.check(false, || "parity split returned no group".into()),
        None => {}
    }

    // Split B: the last rank joins no group.
    let color = (rank + 1 != n).then_some(7);
    match chk.result(world.split(color, rank), "split without the last rank") {
        Some(Some(sub)) => {
            chk.check(
                color.is_some() && sub.rank() == rank && sub.world_size() == n - 1,
                || format!("split B: got {}/{}", sub.rank(), sub.world_size()),
            );
            full(sub.as_ref(), chk, "first", &[2, 777]);
        }
        Some(None) => chk.check(color.is_none(), || "split B: no group for a member".into()),
        None => {}
    }

    // A second world() shares the MPI initialization.
    if let Some(again) = chk.result(
        MpiCommunicator::world(MpiOptions::default().with_timeout(Duration::from_secs(60))),
        "second world()",
    ) {
        chk.check(again.rank() == rank && again.world_size() == n, || {
            "second world(): different rank or size".into()
        });
        suite::<f64>(&again, chk, "world#2", 9);
    }
}

fn expect_mismatch(chk: &mut Checker, r: Result<(), CollectiveError>, what: &str, needle: &str) {
    match r {
        Err(CollectiveError::Mismatch { rank, details, .. }) if details.contains(needle) => {
            if rank <= 1 {
                println!("rank {rank}: {what}: expected mismatch: {details}");
            }
            chk.check(true, String::new)
        }
        other => chk.check(false, || {
            format!("{what}: expected a mismatch mentioning {needle:?}, got {other:?}")
        }),
    }
}

fn run_mismatch(comm: &MpiCommunicator, chk: &mut Checker) {
    let (rank, world) = (comm.rank(), comm.world_size());
    assert!(world >= 3, "--mismatch needs at least 3 ranks");
    // 1. Different lengths.
    let len = if rank == 1 { 5 } else { 4 };
    let buf = Buffer::from_slice(&vec![1.0f32; len]).unwrap();
    let r = comm.all_reduce(&buf, ReduceOp::Sum).and_then(|w| w.wait());
    expect_mismatch(
        chk,
        r,
        "length mismatch",
        "rank 1 issued all_reduce(dtype=float32, count=5, op=sum)",
    );
    chk.check(buf.to_vec::<f32>().unwrap() == vec![1.0; len], || {
        "a mismatched all_reduce changed the buffer".into()
    });
    // 2. Invalid arguments on rank 0.
    let input = Buffer::from_slice(&[1.0f32; 3]).unwrap();
    let output = Buffer::zeros(DType::F32, if rank == 0 { 7 } else { 3 * world }).unwrap();
    let r = comm.all_gather_base(&input, &output);
    if rank == 0 {
        chk.check(
            matches!(r, Err(CollectiveError::InvalidArgument { rank: 0, .. })),
            || format!("invalid all_gather_base on rank 0: {r:?}"),
        );
    } else {
        expect_mismatch(
            chk,
            r.and_then(|w| w.wait()),
            "invalid peer",
            "rank 0 issued all_gather_base with invalid arguments: output has 7 elements",
        );
    }
    // 3. Different operations.
    let buf = Buffer::from_slice(&[2.0f64; 4]).unwrap();
    let r = if rank == 2 {
        comm.broadcast(&buf, 0)
    } else {
        comm.all_reduce(&buf, ReduceOp::Max)
    };
    expect_mismatch(
        chk,
        r.and_then(|w| w.wait()),
        "op mismatch",
        "rank 2 issued broadcast(dtype=float64, count=4, root=0)",
    );
    // 4. Different element types.
    let buf = if rank == 0 {
        Buffer::from_slice(&[1.0f64; 4]).unwrap()
    } else {
        Buffer::from_slice(&[bf16::ONE; 4]).unwrap()
    };
    let r = comm.reduce(&buf, ReduceOp::Sum, 1).and_then(|w| w.wait());
    expect_mismatch(
        chk,
        r,
        "dtype mismatch",
        "rank 0 issued reduce(dtype=float64",
    );
    // 5. Different roots.
    let buf = Buffer::from_slice(&[1.0f32; 2]).unwrap();
    let root = if rank == 0 { 1 } else { 0 };
    let r = comm.broadcast(&buf, root).and_then(|w| w.wait());
    expect_mismatch(
        chk,
        r,
        "root mismatch",
        "rank 0 issued broadcast(dtype=float32, count=2, root=1)",
    );
    // 6. Unequal all_gather whose output sizes disagree.
    let lens: Vec<usize> = (0..world).map(|r| r + 1).collect();
    let mut sizes = lens.clone();
    if rank == 2 {
        sizes[0] += 1;
    }
    let outputs: Vec<Buffer> = sizes
        .iter()
        .map(|&l| Buffer::zeros(DType::F32, l).unwrap())
        .collect();
    let input = Buffer::from_slice(&vec![1.0f32; lens[rank]]).unwrap();
    let r = comm.all_gather(&input, &outputs).and_then(|w| w.wait());
    expect_mismatch(
        chk,
        r,
        "all_gather sizes",
        "rank 2 issued all_gather(dtype=float32",
    );
    // The communicator is still usable.
    let buf = Buffer::from_slice(&[rank as f32 + 1.0; 3]).unwrap();
    if wait(
        chk,
        comm.all_reduce(&buf, ReduceOp::Sum),
        "all_reduce after mismatches",
    ) {
        let want = (world * (world + 1) / 2) as f32;
        chk.check(buf.to_vec::<f32>().unwrap() == vec![want; 3], || {
            "all_reduce after mismatches: wrong result".into()
        });
    }
}

/// The last rank never issues the all-reduce: the others time out within the timeout and say
/// so. (MPI is not finalized afterwards, so mpirun ends the job with an error.)
fn run_timeout(comm: &MpiCommunicator, chk: &mut Checker, timeout: Duration) {
    let (rank, world) = (comm.rank(), comm.world_size());
    if rank + 1 == world {
        std::thread::sleep(timeout * 3);
        return;
    }
    let buf = Buffer::from_slice(&[1.0f32; 8]).unwrap();
    let t0 = Instant::now();
    let r = comm.all_reduce(&buf, ReduceOp::Sum).and_then(|w| w.wait());
    let took = t0.elapsed();
    chk.check(
        matches!(r, Err(CollectiveError::Timeout { .. })) && took < timeout * 2,
        || {
            format!(
                "expected a timeout within {:?}, got {r:?} after {took:?}",
                timeout * 2
            )
        },
    );
    if let Err(e) = &r {
        println!("rank {rank}: expected timeout after {took:.2?}: {e}");
    }
    let again = comm.barrier();
    chk.check(
        matches!(again, Err(CollectiveError::Aborted { .. })),
        || format!("after a timeout the communicator should be aborted, got {again:?}"),
    );
}

fn main() -> ExitCode {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let timeout = if mode == "--timeout" {
        Duration::from_secs(2)
    } else {
        Duration::from_secs(60)
    };
    let comm = match MpiCommunicator::world(MpiOptions::default().with_timeout(timeout)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mpi_reference: {e}");
            return ExitCode::FAILURE;
        }
    };
    let t0 = Instant::now();
    let mut chk = Checker {
        rank: comm.rank(),
        checks: 0,
        failures: Vec::new(),
    };
    match mode.as_str() {
        "" => run_full(&comm, &mut chk),
        "--mismatch" => run_mismatch(&comm, &mut chk),
        "--timeout" => run_timeout(&comm, &mut chk, timeout),
        "--conformance" => {
            let expect = support::cases::Expect {
                bitwise_ring: false,
            };
            support::cases::suite(&comm, &expect);
            chk.check(true, String::new);
            println!("rank {}: conformant", comm.rank());
        }
        other => {
            eprintln!("mpi_reference: unknown mode {other:?} (use --mismatch, --timeout or --conformance)");
            return ExitCode::FAILURE;
        }
    }
    let version = MpiCommunicator::library_version();
    let version = version.lines().next().unwrap_or("").trim();
    println!(
        "mpi_reference rank {}/{} {}: {} checks, {} failed in {:.2?} ({version})",
        comm.rank(),
        comm.world_size(),
        if mode.is_empty() {
            "reference"
        } else {
            &mode[2..]
        },
        chk.checks,
        chk.failures.len(),
        t0.elapsed()
    );
    drop(comm);
    if chk.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
