//! All-gather report: time, algbw and busbw of the ring backend's all-gather flavours, the
//! fixed-total experiment of the FSDP paper, and the efficiency against a one-thread memcpy of
//! the bytes that must move — all measured in the same run.
//!
//! ```text
//! cargo run --release -p fsdp-benches --bin allgather-report -- --quick
//! ```

use std::time::Duration;

use clap::Parser;
use fsdp_benches::{bandwidths, human, memcpy_median, Bench, Flavor, Job};

#[derive(Parser, Debug)]
#[command(about = "All-gather benchmark of the ring backend (nccl-tests style table)")]
struct Args {
    /// Fewer sizes and shorter measurements (about a minute on 2 cores).
    #[arg(long)]
    quick: bool,
    /// World sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    worlds: Vec<usize>,
    /// Largest total output size in MiB.
    #[arg(long, default_value_t = 256)]
    max_mib: usize,
    /// World size of the fixed-total experiment.
    #[arg(long, default_value_t = 4)]
    split_world: usize,
    /// Total output of the fixed-total experiment in MiB.
    #[arg(long, default_value_t = 256)]
    split_total_mib: usize,
}

fn main() {
    let args = Args::parse();
    let (target, reps) = if args.quick {
        (Duration::from_millis(60), 3)
    } else {
        (Duration::from_millis(300), 5)
    };
    let max = args.max_mib << 20;
    let sizes: Vec<usize> = if args.quick {
        vec![4 << 10, 256 << 10, 4 << 20, 16 << 20, 64 << 20]
    } else {
        (0..)
            .map(|i| (4usize << 10) << (2 * i))
            .take_while(|&s| s <= max)
            .chain(std::iter::once(16 << 20))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect()
    };
    let sizes: Vec<usize> = sizes.into_iter().filter(|&s| s <= max).collect();

    println!(
        "All-gather, ring backend, f32; S = total output bytes; algbw = S/t; busbw = algbw*(n-1)/n"
    );
    println!(
        "ideal = one thread memcpy of (n-1)*S bytes; efficiency = ideal / time (base and in-place)"
    );
    println!();
    println!(
        "{:>5} {:>9} {:>8} {:>12} {:>11} {:>11} {:>12} {:>10}",
        "world",
        "size",
        "flavor",
        "time(us)",
        "algbw GB/s",
        "busbw GB/s",
        "ideal(us)",
        "efficiency"
    );
    let mut summary = Vec::new();
    for &world in &args.worlds {
        let bench = Bench::new(world);
        for &s in &sizes {
            let ideal = memcpy_median(s, world - 1, target, reps);
            let mut base_t = None;
            for flavor in Flavor::ALL {
                bench.prepare(Job {
                    flavor,
                    out_bytes: s,
                    count: 1,
                });
                let t = bench.median_per_iter(target, reps);
                let (alg, bus) = bandwidths(s, world, t);
                let eff = match flavor {
                    Flavor::Base | Flavor::BaseInPlace => {
                        if flavor == Flavor::Base {
                            base_t = Some(t);
                        }
                        format!("{:.2}", ideal.as_secs_f64() / t.as_secs_f64())
                    }
                    _ => String::new(),
                };
                println!(
                    "{:>5} {:>9} {:>8} {:>12.1} {:>11.2} {:>11.2} {:>12.1} {:>10}",
                    world,
                    human(s),
                    flavor.name(),
                    t.as_secs_f64() * 1e6,
                    alg,
                    bus,
                    if matches!(flavor, Flavor::Base | Flavor::BaseInPlace) {
                        ideal.as_secs_f64() * 1e6
                    } else {
                        f64::NAN
                    },
                    eff
                );
                if flavor == Flavor::List {
                    if let Some(b) = base_t {
                        summary.push((
                            world,
                            s,
                            ideal.as_secs_f64() / b.as_secs_f64(),
                            t.as_secs_f64() / b.as_secs_f64(),
                        ));
                    }
                }
            }
        }
        bench.prepare(Job {
            flavor: Flavor::Base,
            out_bytes: 0,
            count: 1,
        });
    }

    println!();
    println!("Summary (base all-gather): efficiency vs ideal, and speed-up of base over list");
    println!(
        "{:>5} {:>9} {:>11} {:>15}",
        "world", "size", "efficiency", "base/list x"
    );
    for (world, s, eff, speedup) in &summary {
        println!(
            "{:>5} {:>9} {:>11.2} {:>15.2}",
            world,
            human(*s),
            eff,
            speedup
        );
    }

    // The paper's fixed-total experiment (Fig. 2b): the same total output, split into more and
    // more collectives issued back to back.
    let total = args.split_total_mib << 20;
    let world = args.split_world;
    let bench = Bench::new(world);
    println!();
    println!(
        "Fixed total: {} of all-gather output on {world} ranks, split into k base all-gathers",
        human(total)
    );
    println!(
        "{:>6} {:>12} {:>14} {:>11}",
        "k", "each", "total time(ms)", "algbw GB/s"
    );
    let splits: &[usize] = if args.quick {
        &[1, 16, 256, 1024]
    } else {
        &[1, 4, 16, 64, 256, 1024]
    };
    for &k in splits {
        let each = (total / k) / (4 * world) * (4 * world);
        bench.prepare(Job {
            flavor: Flavor::Base,
            out_bytes: each,
            count: k,
        });
        let t = bench.median_per_iter(target, reps);
        let (alg, _) = bandwidths(each * k, world, t);
        println!(
            "{:>6} {:>12} {:>14.2} {:>11.2}",
            k,
            human(each),
            t.as_secs_f64() * 1e3,
            alg
        );
    }
}
