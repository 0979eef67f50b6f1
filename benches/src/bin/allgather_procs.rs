//! All-gather over the ring engine's transports, side by side: threads (one process), and
//! processes over shared memory and over TCP, started as `fsdp launch` starts them (`RANK`,
//! `WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`/`MASTER_PORT`, one process per rank). Prints time,
//! algbw and busbw (nccl-tests' definitions) and the efficiency against one thread's memcpy of
//! the bytes that must cross (`memcpy_median`, as `allgather-report`) per world size and
//! message size.
//!
//! Shared memory runs three ways: `shm-procs(shared)` allocates the all-gather's buffers in
//! [`SharedHostStorage`] (peers read them in place: one copy per hop), `shm-procs(cma)` uses
//! ordinary buffers that peers read by cross-memory attach, `shm-procs(copy)` copies through
//! the ring's slots (two copies per hop).
//!
//! `allgather-procs [--worlds 2,4] [--sizes-mib 1,16] [--iters 20]`

use std::process::Command;
use std::time::{Duration, Instant};

use fsdp_benches::{bandwidths, memcpy_median};
use fsdp_collectives::store::{StoreOptions, TcpStore};
use fsdp_collectives::{ring, tcp, Communicator};
use fsdp_device::shared::SharedHostStorage;
use fsdp_device::{Buffer, DType};

/// `len` f32 zeros, in shared memory if `shared`.
fn zeros(len: usize, shared: bool) -> Buffer {
    if shared {
        let s = SharedHostStorage::zeroed(len * 4).unwrap();
        Buffer::from_storage(Box::new(s), DType::F32).unwrap()
    } else {
        Buffer::zeros(DType::F32, len).unwrap()
    }
}

fn time_all_gather(comm: &dyn Communicator, bytes: usize, iters: usize, shared: bool) -> Duration {
    let world = comm.world_size();
    let n = bytes / 4 / world;
    let input = zeros(n, shared);
    let output = zeros(n * world, shared);
    for _ in 0..3 {
        comm.all_gather_base(&input, &output)
            .unwrap()
            .wait()
            .unwrap();
    }
    comm.barrier().unwrap().wait().unwrap();
    let t0 = Instant::now();
    for _ in 0..iters {
        comm.all_gather_base(&input, &output)
            .unwrap()
            .wait()
            .unwrap();
    }
    comm.barrier().unwrap().wait().unwrap();
    t0.elapsed() / iters as u32
}

/// Prints a row; `ideal` is one thread's memcpy of the bytes that cross. Returns busbw.
fn report(label: &str, world: usize, bytes: usize, t: Duration, ideal: Duration) -> f64 {
    let (algbw, busbw) = bandwidths(bytes, world, t);
    println!(
        "{label:<17} world {world}  {:>6.1} MiB  time {:>9.1} us  algbw {algbw:>6.2} GB/s  busbw {busbw:>6.2} GB/s  efficiency {:>5.2}",
        bytes as f64 / (1 << 20) as f64,
        t.as_secs_f64() * 1e6,
        ideal.as_secs_f64() / t.as_secs_f64()
    );
    busbw
}

fn list(args: &[String], flag: &str, default: &[usize]) -> Vec<usize> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or_else(|| default.to_vec())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let iters = list(&args, "--iters", &[20])[0];
    let sizes = list(&args, "--sizes-mib", &[1, 16]);
    if let Ok(rank) = std::env::var("RANK") {
        // A rank process, as the launcher starts it.
        let rank: usize = rank.parse().unwrap();
        let world: usize = std::env::var("WORLD_SIZE").unwrap().parse().unwrap();
        let port: u16 = std::env::var("MASTER_PORT").unwrap().parse().unwrap();
        let store =
            TcpStore::new(StoreOptions::new("127.0.0.1", port, rank, world).with_server(false))
                .unwrap();
        let comm = tcp::TcpCommunicator::new(&store, tcp::TcpOptions::default()).unwrap();
        let shared = std::env::var("BENCH_SHARED_BUFFERS").is_ok_and(|v| v == "1");
        for &mib in &sizes {
            let t = time_all_gather(&comm, mib << 20, iters, shared);
            if rank == 0 {
                println!("{} {} {}", comm.transport().name(), mib, t.as_nanos());
            }
        }
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for world in list(&args, "--worlds", &[2, 4]) {
        let mut thread_bw = Vec::new();
        let ideal: Vec<Duration> = sizes
            .iter()
            .map(|&mib| memcpy_median(mib << 20, world - 1, Duration::from_millis(100), 5))
            .collect();
        for (i, &mib) in sizes.iter().enumerate() {
            let ts = ring::run_ranks(world, ring::RingOptions::default(), |c| {
                time_all_gather(&c, mib << 20, iters, false)
            })
            .unwrap();
            thread_bw.push(report("ring-threads", world, mib << 20, ts[0], ideal[i]));
        }
        let runs = [
            ("shm", "1", "1", "shm-procs(shared)"),
            ("shm", "1", "0", "shm-procs(cma)"),
            ("shm", "0", "0", "shm-procs(copy)"),
            ("tcp", "1", "0", "tcp-procs"),
        ];
        for (transport, cma, shared, label) in runs {
            let server = TcpStore::new(StoreOptions::new("127.0.0.1", 0, 0, world)).unwrap();
            let children: Vec<_> = (0..world)
                .map(|rank| {
                    Command::new(&exe)
                        .args(&args[1..])
                        .env("RANK", rank.to_string())
                        .env("WORLD_SIZE", world.to_string())
                        .env("LOCAL_RANK", rank.to_string())
                        .env("LOCAL_WORLD_SIZE", world.to_string())
                        .env("GROUP_RANK", "0")
                        .env("MASTER_ADDR", "127.0.0.1")
                        .env("MASTER_PORT", server.port().to_string())
                        .env("FSDP_TRANSPORT", transport)
                        .env("FSDP_SHM_CMA", cma)
                        .env("BENCH_SHARED_BUFFERS", shared)
                        .output_handle()
                })
                .collect();
            let outs: Vec<_> = children
                .into_iter()
                .map(|c| c.wait_with_output().unwrap())
                .collect();
            let text = String::from_utf8_lossy(&outs[0].stdout).into_owned();
            for (i, line) in text.lines().enumerate() {
                let f: Vec<&str> = line.split_whitespace().collect();
                let (mib, ns): (usize, u64) = (f[1].parse().unwrap(), f[2].parse().unwrap());
                let bw = report(label, world, mib << 20, Duration::from_nanos(ns), ideal[i]);
                println!("{:>14} = {:.2}x ring-threads busbw", "", bw / thread_bw[i]);
            }
        }
    }
}

trait Spawn {
    fn output_handle(&mut self) -> std::process::Child;
}

impl Spawn for Command {
    fn output_handle(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawning a rank process")
    }
}
