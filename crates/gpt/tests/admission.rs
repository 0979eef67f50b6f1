//! Memory admission of `fsdp train`, run as a process: before any allocation the plan's
//! prediction of every rank is checked against the memory available (or `--memory-limit`), and
//! a run that does not fit ends at once with one error line naming both figures; absurd sizes
//! are errors, never a panic or an abort; `fsdp plan` says whether the configuration fits. And
//! the parsers of `/proc/meminfo` and the cgroup files, on sample texts.
//!
//! The refusals below do not depend on the machine: where the memory detected here would be
//! enough (a host with hundreds of GiB), the test passes `--memory-limit 16G` instead, which
//! replaces the detected figure.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

// Exactly one `error: ...` line containing every needle, exit status 1 (not an abort, 134, or
// a signal) and no panic; returns the line.
use common::cli::one_error_status_1 as one_error;
use common::cli::{command, free_port, ok, ONE_LAYER};
use fsdp::human_bytes;
use fsdp::plan::{
    available_memory, available_memory_from, cgroup_headroom, parse_cgroup_paths,
    parse_meminfo_available, CgroupPaths, CgroupVersion,
};

fn fsdp(args: &[&str]) -> (Output, Duration) {
    let t0 = Instant::now();
    let out = common::cli::fsdp(args);
    (out, t0.elapsed())
}

/// `args`, plus `--memory-limit 16G` when this machine has `needed` bytes available (so that
/// the run is refused here as on any machine).
fn refused_anywhere<'a>(args: &[&'a str], needed: u64) -> Vec<&'a str> {
    let mut v = args.to_vec();
    if available_memory().is_some_and(|a| a.bytes >= needed) {
        v.extend(["--memory-limit", "16G"]);
    }
    v
}

/// `train`, the [`ONE_LAYER`] model, then `extra`.
fn one_layer_train<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["train"];
    args.extend_from_slice(&ONE_LAYER);
    args.extend_from_slice(extra);
    args
}

const GIB: u64 = 1 << 30;

#[test]
fn a_hundred_thousand_ranks_are_refused_at_once() {
    let args = refused_anywhere(
        &[
            &[
                "train",
                "--ranks",
                "100000",
                "--batch-size",
                "100000",
                "--steps",
                "1",
            ][..],
            &ONE_LAYER,
        ]
        .concat(),
        400 * GIB,
    );
    let (out, took) = fsdp(&args);
    let line = one_error(
        &out,
        &[
            "not enough memory",
            "predicted",
            "100000 ranks",
            "available",
            "bytes",
            "hint",
        ],
    );
    println!("{took:?}: {line}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn a_model_beyond_any_memory_is_one_error_not_an_abort() {
    // About 3.3·10^12 parameters: 48 TiB for the shards and the AdamW state alone.
    let (out, took) = fsdp(&["train", "--n-embd", "65536", "--n-layer", "64"]);
    let line = one_error(
        &out,
        &["not enough memory", "predicted", "TiB", "available"],
    );
    println!("{took:?}: {line}");
    // The plan of it prints, and says it does not fit.
    let (out, _) = fsdp(&["plan", "--n-embd", "65536", "--n-layer", "64"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("does not fit"), "{stdout}");
}

#[test]
fn sizes_that_overflow_are_one_error() {
    // The parameter count overflows 64 bits.
    let (out, _) = fsdp(&["train", "--n-embd", "4294967296", "--n-head", "1"]);
    one_error(&out, &["overflows"]);
    // The activations of a huge batch overflow 64 bits (the shards alone fit).
    let (out, _) = fsdp(&one_layer_train(&[
        "--ranks",
        "1",
        "--batch-size",
        "18446744073709551615",
    ]));
    one_error(&out, &["overflow"]);
    // --memory-limit beyond 64 bits: the parser's error (exit status 2).
    let (out, _) = fsdp(&["train", "--memory-limit", "99999999999T"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("--memory-limit") && stderr.contains("overflows"),
        "{stderr}"
    );
}

#[test]
fn the_largest_step_count_trains_or_is_an_error_but_never_panics() {
    let args = [
        &["train", "--steps", "18446744073709551615"][..],
        &ONE_LAYER,
    ]
    .concat();
    let mut child = command(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running the fsdp binary");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    // Wait for the first step's line (or the end of the process).
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut trained = false;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with("step 0 ") => {
                trained = true;
                break;
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    if trained {
        child.kill().unwrap();
        child.wait().unwrap();
    } else {
        let out = child.wait_with_output().unwrap();
        one_error(&out, &[]);
    }
}

#[test]
fn memory_limit_refuses_below_the_need_and_trains_above_it() {
    let (out, _) = fsdp(&["train", "--memory-limit", "1M"]);
    let line = one_error(
        &out,
        &[
            "not enough memory",
            "predicted",
            "available 1.0 MiB (1048576 bytes, --memory-limit)",
        ],
    );
    println!("{line}");
    // Comfortably above the need of a small model (17.4 MiB), then just below it.
    let (out, _) = fsdp(&one_layer_train(&[
        "--steps",
        "2",
        "--memory-limit",
        "256M",
    ]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("done: 2 steps"));
    // Past the cheap lower bound (the shards), refused by the full plan's prediction.
    let (out, _) = fsdp(&one_layer_train(&["--steps", "2", "--memory-limit", "16M"]));
    let line = one_error(
        &out,
        &[
            "not enough memory",
            "allocator peak",
            "optimizer state",
            "activations",
        ],
    );
    println!("{line}");
    // Bad values are refused by the parser.
    let (out, _) = fsdp(&["train", "--memory-limit", "lots"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--memory-limit"));
}

#[test]
fn a_large_model_is_refused_quickly_without_allocating() {
    // 2.4·10^9 parameters: 36 GiB for the shards and the AdamW state of 4 ranks at least.
    let args = refused_anywhere(&["train", "--n-embd", "2048", "--n-layer", "48"], 64 * GIB);
    let (out, took) = fsdp(&args);
    let line = one_error(&out, &["not enough memory", "predicted", "available"]);
    println!("{took:?}: {line}");
    assert!(took < Duration::from_secs(3), "took {took:?}");
}

#[test]
fn plan_prints_the_available_memory_and_whether_it_fits() {
    let (out, _) = fsdp(&["plan"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("memory: "))
        .unwrap_or_else(|| panic!("no memory line: {stdout}"));
    assert!(
        line.contains("predicted") && line.contains("for 4 ranks"),
        "{line}"
    );
    if available_memory().is_some() {
        assert!(
            line.contains("available") && line.ends_with(": fits"),
            "{line}"
        );
    }
    let (out, _) = fsdp(&["plan", "--memory-limit", "1M"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("available 1.0 MiB (1048576 bytes, --memory-limit): does not fit"),
        "{stdout}"
    );
}

#[test]
fn meminfo_and_cgroup_texts_are_parsed() {
    let meminfo = "MemTotal:       24684092 kB\nMemFree:        16746712 kB\n\
                   MemAvailable:   23877972 kB\n";
    assert_eq!(parse_meminfo_available(meminfo), Some(23_877_972 * 1024));
    assert_eq!(parse_meminfo_available("MemFree: 1 kB\n"), None);
    assert_eq!(
        parse_cgroup_paths("12:memory:/slurm/job_7\n0::/slurm/job_7\n"),
        CgroupPaths {
            v2: Some("/slurm/job_7".into()),
            v1_memory: Some("/slurm/job_7".into()),
        }
    );
    assert_eq!(parse_cgroup_paths("0::/\n").v1_memory, None);
    // v2: "max" is no limit; a limit less the usage (less inactive file cache).
    assert_eq!(cgroup_headroom(CgroupVersion::V2, "max", "5", None), None);
    assert_eq!(
        cgroup_headroom(
            CgroupVersion::V2,
            "8589934592\n",
            "1073741824\n",
            Some("inactive_file 1024\n")
        ),
        Some(8589934592 - 1073741824 + 1024)
    );
    // v1: the kernel's "unlimited" (i64::MAX rounded to a page) is no limit.
    assert_eq!(
        cgroup_headroom(CgroupVersion::V1, "9223372036854771712", "1", None),
        None
    );
    assert_eq!(
        cgroup_headroom(CgroupVersion::V1, "1048576", "4096", None),
        Some(1048576 - 4096)
    );
    // All together: the smaller of MemAvailable and the cgroup's headroom.
    let files = move |p: &std::path::Path| -> Option<String> {
        Some(
            match p.to_str()? {
                "/proc/meminfo" => meminfo,
                "/proc/self/cgroup" => "0::/job\n",
                "/proc/self/mountinfo" => "1 0 0:1 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                "/sys/fs/cgroup/job/memory.max" => "1073741824\n",
                "/sys/fs/cgroup/job/memory.current" => "73741824\n",
                _ => return None,
            }
            .to_string(),
        )
    };
    let a = available_memory_from(files).unwrap();
    assert_eq!(a.bytes, 1_000_000_000);
    assert!(a.source.contains("cgroup v2") && a.source.contains("/sys/fs/cgroup/job"));
}

/// `fsdp launch -n 2 train`, the [`ONE_LAYER`] model, one step, `--memory-limit limit`.
fn launched(limit: &str) -> Output {
    let mut args = vec!["launch", "-n", "2", "--master-port", "0"];
    args.extend(one_layer_train(&["--steps", "1", "--memory-limit", limit]));
    fsdp(&args).0
}

/// The error lines of the ranks (`[rank N] error: rank N: ...`), at least one; each checked
/// to name its own rank.
fn rank_errors(out: &Output) -> Vec<String> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let lines: Vec<String> = stderr
        .lines()
        .filter(|l| l.starts_with("[rank ") && l.contains("] error: "))
        .map(str::to_string)
        .collect();
    assert!(!lines.is_empty(), "no rank's error line: {stderr}");
    for l in &lines {
        let rank = &l["[rank ".len()..l.find(']').unwrap()];
        assert!(
            l.contains(&format!("] error: rank {rank}: ")),
            "the line does not name its rank: {l}"
        );
    }
    lines
}

/// `N` of `predicted X (N bytes) for the 2 ranks of node 0` in `line`.
fn host_total(line: &str) -> u64 {
    let end = line
        .find(" bytes) for the 2 ranks of node 0 (")
        .unwrap_or_else(|| panic!("no host total in {line}"));
    let start = line[..end].rfind('(').unwrap() + 1;
    line[start..end].parse().unwrap()
}

#[test]
fn under_a_launcher_the_ranks_of_a_host_add_up_their_predictions() {
    // Far below the need: refused by the plan's prediction (the lower bound fits), which gives
    // the host's total in bytes.
    let out = launched("1M");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let line = &rank_errors(&out)[0];
    assert!(
        line.contains("not enough memory") && line.contains("allocator peak"),
        "{line}"
    );
    let total = host_total(line);
    // The two ranks predict the same, so each one's share is half the total: one byte below
    // the total, each rank fits alone but the host's sum does not.
    let (share, limit) = (total / 2, total - 1);
    assert!(share <= limit);
    let out = launched(&limit.to_string());
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let lines = rank_errors(&out);
    for l in &lines {
        for needle in [
            "not enough memory: predicted",
            &format!("({total} bytes) for the 2 ranks of node 0 (rank 0 "),
            ", rank 1 ",
            "; this rank ",
            &format!(
                "available {} ({limit} bytes, --memory-limit)",
                human_bytes(limit)
            ),
            "hint: ",
        ] {
            assert!(l.contains(needle), "{l:?} does not mention {needle:?}");
        }
    }
    println!("{}", lines[0]);
    // Exactly the sum: admitted, and trains.
    let out = launched(&total.to_string());
    let stdout = ok(&out, "the run at the host's total");
    assert!(stdout.contains("done: 1 steps"), "{stdout}");
}

#[test]
fn a_rank_that_fails_before_the_admission_stops_the_others_of_its_host() {
    // Two ranks started as a launcher would, but by the test: no launcher ends the other rank
    // when one fails, so the other must stop by itself, well before the store's timeout.
    for failing in [0, 1] {
        let port = free_port().to_string();
        let mut children: Vec<_> = (0..2)
            .map(|rank| {
                // The failing rank's batch does not split over 2 ranks: it fails after the
                // ranks met at the store and added up their lower bounds.
                let batch = if rank == failing { "3" } else { "4" };
                let rank = rank.to_string();
                command(&one_layer_train(&["--steps", "1", "--batch-size", batch]))
                    .envs([
                        ("RANK", rank.as_str()),
                        ("WORLD_SIZE", "2"),
                        ("LOCAL_RANK", rank.as_str()),
                        ("LOCAL_WORLD_SIZE", "2"),
                        ("GROUP_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", port.as_str()),
                    ])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("running the fsdp binary")
            })
            .collect();
        let t0 = Instant::now();
        while children.iter_mut().any(|c| c.try_wait().unwrap().is_none()) {
            if t0.elapsed() > Duration::from_secs(60) {
                for c in &mut children {
                    let _ = c.kill();
                }
                panic!("rank {failing} failed and a rank was still running after 60 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let outs: Vec<Output> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        let cause = "--batch-size 3 (3 rows per micro-batch) is not divisible by --ranks 2";
        one_error(&outs[failing], &[cause]);
        let other = 1 - failing;
        let line = one_error(
            &outs[other],
            &[
                &format!(
                    "rank {other}: rank {failing} of node 0 failed before the memory admission: "
                ),
                cause,
            ],
        );
        println!("{:?}: {line}", t0.elapsed());
    }
}

#[test]
fn an_allocation_the_system_refuses_is_an_error_naming_the_rank_and_the_bytes() {
    if !cfg!(target_os = "linux") {
        println!("skipped: needs Linux (ulimit -v)");
        return;
    }
    // Admitted by --memory-limit, but the process may map only 2 GiB: the logits of a large
    // batch (16384 tokens × 50304 classes, 3.1 GiB) cannot be allocated.
    let mut args = vec![
        "-c",
        "ulimit -v 2097152 && exec \"$0\" \"$@\"",
        env!("CARGO_BIN_EXE_fsdp"),
        "train",
    ];
    args.extend([
        "--ranks",
        "1",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--block-size",
        "256",
        "--vocab-size",
        "50304",
        "--batch-size",
        "64",
        "--steps",
        "1",
        "--memory-limit",
        "64G",
    ]);
    let out = std::process::Command::new("sh")
        .args(&args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    let line = one_error(
        &out,
        &[
            "rank 0: out of host memory: cannot allocate 3296722944 bytes (3.1 GiB)",
            "logits",
        ],
    );
    println!("{line}");
}
