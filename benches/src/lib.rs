//! Shared machinery of the benchmarks: a persistent group of ring ranks (one thread each) that
//! runs a collective `iters` times back to back and reports the elapsed time, the way nccl-tests
//! measures (S = total output bytes, algbw = S / t, busbw = algbw × (n − 1) / n).

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use fsdp_collectives::{ring, Communicator};
use fsdp_device::{Buffer, DType};

/// Which all-gather flavour to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// `all_gather_base`: equal sizes into one preallocated output.
    Base,
    /// `all_gather` with one output buffer per rank, equal sizes (copies into and out of a flat
    /// buffer).
    List,
    /// `all_gather` with unequal input sizes (rank r contributes in proportion to r + 1).
    Unequal,
    /// `all_gather_base` in place: the input is this rank's block of the output (what FSDP does
    /// when the shard lives inside the unsharded buffer), so no local copy is needed.
    BaseInPlace,
}

impl Flavor {
    /// Every flavour.
    pub const ALL: [Flavor; 4] = [
        Flavor::Base,
        Flavor::BaseInPlace,
        Flavor::List,
        Flavor::Unequal,
    ];

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Flavor::Base => "base",
            Flavor::List => "list",
            Flavor::Unequal => "unequal",
            Flavor::BaseInPlace => "in-place",
        }
    }
}

/// A measurement request: `count` collectives, each gathering `out_bytes` of total output.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    /// The flavour.
    pub flavor: Flavor,
    /// Total output bytes of one collective (S).
    pub out_bytes: usize,
    /// Collectives issued back to back per iteration.
    pub count: usize,
}

enum Cmd {
    Prepare(Job),
    Run(u64),
    Stop,
}

/// Elements of rank `r`'s input for a job on `world` ranks (f32).
fn input_len(job: &Job, world: usize, r: usize) -> usize {
    let total = job.out_bytes / 4;
    match job.flavor {
        Flavor::Base | Flavor::BaseInPlace | Flavor::List => total / world,
        Flavor::Unequal => {
            // proportional to r + 1, summing to about `total`
            let weight = world * (world + 1) / 2;
            total * (r + 1) / weight
        }
    }
}

struct RankBuffers {
    inputs: Vec<Buffer>,
    outputs: Vec<Vec<Buffer>>,
}

fn prepare(comm: &ring::RingCommunicator, job: &Job) -> RankBuffers {
    let world = comm.world_size();
    let r = comm.rank();
    let mut inputs = Vec::new();
    let mut outputs = Vec::new();
    for _ in 0..job.count {
        let n = input_len(job, world, r);
        if job.flavor == Flavor::BaseInPlace {
            let out = Buffer::zeros(DType::F32, n * world).expect("output");
            let own = out.slice(r * n..(r + 1) * n).expect("own block");
            own.copy_from_slice(&vec![r as f32; n]).expect("input");
            inputs.push(own);
            outputs.push(vec![out]);
            continue;
        }
        inputs.push(Buffer::from_slice(&vec![r as f32; n]).expect("input"));
        outputs.push(match job.flavor {
            Flavor::Base | Flavor::BaseInPlace => {
                vec![Buffer::zeros(DType::F32, n * world).expect("output")]
            }
            Flavor::List | Flavor::Unequal => (0..world)
                .map(|q| Buffer::zeros(DType::F32, input_len(job, world, q)).expect("output"))
                .collect(),
        });
    }
    RankBuffers { inputs, outputs }
}

fn run_once(comm: &ring::RingCommunicator, job: &Job, bufs: &RankBuffers) {
    let mut works = Vec::with_capacity(job.count);
    for (input, outs) in bufs.inputs.iter().zip(&bufs.outputs) {
        works.push(
            match job.flavor {
                Flavor::Base | Flavor::BaseInPlace => comm.all_gather_base(input, &outs[0]),
                Flavor::List | Flavor::Unequal => comm.all_gather(input, outs),
            }
            .expect("issue all-gather"),
        );
    }
    for w in works {
        w.wait().expect("all-gather");
    }
}

/// A persistent group of ring ranks for benchmarking.
pub struct Bench {
    world: usize,
    cmds: Vec<Sender<Cmd>>,
    done: Receiver<Duration>,
    threads: Vec<JoinHandle<()>>,
}

impl Bench {
    /// Start `world` ranks, each on its own thread.
    pub fn new(world: usize) -> Bench {
        let comms = ring::new_group(world, ring::RingOptions::default()).expect("ring group");
        let (done_tx, done) = bounded(world);
        let mut cmds = Vec::new();
        let mut threads = Vec::new();
        for comm in comms {
            let (tx, rx) = bounded::<Cmd>(1);
            cmds.push(tx);
            let done_tx = done_tx.clone();
            threads.push(std::thread::spawn(move || {
                let mut bufs = None;
                let mut job = None;
                for cmd in rx {
                    match cmd {
                        Cmd::Prepare(j) => {
                            drop(bufs.take()); // free the previous buffers first
                            bufs = Some(prepare(&comm, &j));
                            job = Some(j);
                            done_tx.send(Duration::ZERO).expect("driver alive");
                        }
                        Cmd::Run(iters) => {
                            let (j, b) = (
                                job.as_ref().expect("prepared"),
                                bufs.as_ref().expect("prepared"),
                            );
                            comm.barrier().and_then(|w| w.wait()).expect("barrier");
                            let t0 = Instant::now();
                            for _ in 0..iters {
                                run_once(&comm, j, b);
                            }
                            comm.barrier().and_then(|w| w.wait()).expect("barrier");
                            done_tx.send(t0.elapsed()).expect("driver alive");
                        }
                        Cmd::Stop => break,
                    }
                }
            }));
        }
        Bench {
            world,
            cmds,
            done,
            threads,
        }
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Allocate the buffers of `job` on every rank.
    pub fn prepare(&self, job: Job) {
        for c in &self.cmds {
            c.send(Cmd::Prepare(job)).expect("rank alive");
        }
        for _ in 0..self.world {
            self.done.recv().expect("rank alive");
        }
    }

    /// Run the prepared job `iters` times; the slowest rank's elapsed time.
    pub fn run(&self, iters: u64) -> Duration {
        for c in &self.cmds {
            c.send(Cmd::Run(iters)).expect("rank alive");
        }
        (0..self.world)
            .map(|_| self.done.recv().expect("rank alive"))
            .max()
            .unwrap_or_default()
    }

    /// Median over `reps` repetitions of the time per iteration, with `iters` chosen so one
    /// repetition lasts about `target`.
    pub fn median_per_iter(&self, target: Duration, reps: usize) -> Duration {
        let probe = self.run(1).max(Duration::from_micros(1));
        let iters = (target.as_secs_f64() / probe.as_secs_f64()).clamp(1.0, 10_000.0) as u64;
        let mut times: Vec<Duration> = (0..reps).map(|_| self.run(iters) / iters as u32).collect();
        times.sort();
        times[times.len() / 2]
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        for c in &self.cmds {
            let _ = c.send(Cmd::Stop);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Median time for one thread to copy a `bytes`-byte buffer `times` times. The ideal of an
/// all-gather of `S` output bytes over `n` ranks is `memcpy_median(S, n - 1, ..)`: the bytes that
/// must cross between ranks, moved by one thread.
pub fn memcpy_median(bytes: usize, times: usize, target: Duration, reps: usize) -> Duration {
    let src = vec![1u8; bytes.max(1)];
    let mut dst = vec![0u8; bytes.max(1)];
    let mut once = || {
        let t0 = Instant::now();
        for _ in 0..times {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
        t0.elapsed()
    };
    let probe = once().max(Duration::from_nanos(100));
    let iters = (target.as_secs_f64() / probe.as_secs_f64()).clamp(1.0, 100_000.0) as u32;
    let mut v: Vec<Duration> = (0..reps)
        .map(|_| (0..iters).map(|_| once()).sum::<Duration>() / iters)
        .collect();
    v.sort();
    v[v.len() / 2]
}

/// `(algbw, busbw)` in GB/s (10^9 bytes per second) for `out_bytes` of output in `t` on `n`
/// ranks, as nccl-tests defines them.
pub fn bandwidths(out_bytes: usize, n: usize, t: Duration) -> (f64, f64) {
    let algbw = out_bytes as f64 / t.as_secs_f64() / 1e9;
    (algbw, algbw * (n as f64 - 1.0) / n as f64)
}

/// Human-readable byte count (KiB/MiB).
pub fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_definitions() {
        let (alg, bus) = bandwidths(1_000_000_000, 4, Duration::from_secs(1));
        assert!((alg - 1.0).abs() < 1e-12);
        assert!((bus - 0.75).abs() < 1e-12);
    }

    #[test]
    fn bench_group_runs_every_flavor() {
        let b = Bench::new(3);
        for flavor in Flavor::ALL {
            b.prepare(Job {
                flavor,
                out_bytes: 3 * 4096,
                count: 2,
            });
            assert!(b.run(2) > Duration::ZERO);
        }
    }
}
