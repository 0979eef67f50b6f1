//! `fsdp train --alloc-conf` (default: `PYTORCH_ALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF`):
//! every rank's caching allocator takes PyTorch's allocator settings. An allocation policy
//! must not change the numbers: the loss log is bitwise that of a run without it, while the
//! memory snapshot shows the expandable segments the ranks used. A bad text is one error line,
//! naming the key, before any rank starts; `fsdp plan` takes the same option.

#![cfg(unix)]

mod common;

use std::process::{Command, Output};

use common::cli::{command, loss_column, ok, one_error, s, small_train_args, TWO_RANKS};

/// The command, with the PyTorch variables of this process's environment removed (or set to
/// `env`).
fn run(args: &[&str], env: Option<(&str, &str)>) -> Output {
    let mut c: Command = command(args);
    c.env_remove("PYTORCH_ALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF");
    if let Some((k, v)) = env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// Whether every segment of the pickled snapshot at `path` is expandable (`None` without
/// python3).
fn all_expandable(path: &std::path::Path) -> Option<(usize, bool)> {
    const PY: &str = "import pickle, sys\n\
                      s = pickle.load(open(sys.argv[1], 'rb'))\n\
                      segs = s['segments']\n\
                      print(len(segs), all(g['is_expandable'] for g in segs))\n";
    let py = Command::new("python3")
        .arg("-c")
        .arg(PY)
        .arg(path)
        .output()
        .ok()?;
    let out = String::from_utf8_lossy(&py.stdout).to_string();
    assert!(
        py.status.success(),
        "python3: {out}{}",
        String::from_utf8_lossy(&py.stderr)
    );
    let mut w = out.split_whitespace();
    Some((w.next()?.parse().ok()?, w.next()? == "True"))
}

#[test]
fn expandable_segments_train_the_same_losses() {
    let d = common::cli::scratch("alloc-conf", "train");
    let (plain_log, exp_log, env_log) = (d.join("plain.csv"), d.join("exp.csv"), d.join("env.csv"));
    let (plain_snap, exp_snap) = (d.join("plain.pickle"), d.join("exp.pickle"));
    let extra = |log: &std::path::Path, snap: &std::path::Path| -> Vec<String> {
        vec![
            "--steps".into(),
            "3".into(),
            "--loss-log".into(),
            s(log).into(),
            "--memory-snapshot".into(),
            s(snap).into(),
        ]
    };
    let plain_extra = extra(&plain_log, &plain_snap);
    let plain_extra: Vec<&str> = plain_extra.iter().map(String::as_str).collect();
    let plain = ok(
        &run(&small_train_args(&TWO_RANKS, &plain_extra), None),
        "plain run",
    );
    assert!(!plain.contains("allocator:"), "{plain}");

    let mut exp_extra = extra(&exp_log, &exp_snap);
    exp_extra.extend(["--alloc-conf".into(), "expandable_segments:True".into()]);
    let exp_extra: Vec<&str> = exp_extra.iter().map(String::as_str).collect();
    let exp = ok(
        &run(&small_train_args(&TWO_RANKS, &exp_extra), None),
        "expandable run",
    );
    assert!(exp.contains("allocator: expandable_segments:True"), "{exp}");

    // The same losses, bitwise, and the same allocated bytes (rank 0's peak per step).
    let plain_losses = loss_column(&plain_log);
    assert_eq!(plain_losses.len(), 3);
    assert_eq!(loss_column(&exp_log), plain_losses);
    let peak = |p: &std::path::Path| -> Vec<String> {
        let text = std::fs::read_to_string(p).unwrap();
        text.lines()
            .skip(1)
            .map(|l| l.split(',').nth(3).unwrap().to_string())
            .collect()
    };
    assert_eq!(peak(&exp_log), peak(&plain_log));

    // The ranks used expandable segments: every segment of rank 0's snapshot is one; none is
    // without the option.
    match (all_expandable(&exp_snap), all_expandable(&plain_snap)) {
        (Some((n_exp, all_exp)), Some((n_plain, all_plain))) => {
            assert!(
                n_exp > 0 && all_exp,
                "expandable run: {n_exp} segments, all: {all_exp}"
            );
            assert!(n_plain > 0 && !all_plain, "plain run: {n_plain} segments");
        }
        _ => println!("skipped the snapshot check: no python3"),
    }

    // The environment variable is the default; the option overrides it.
    let env_extra = ["--steps", "3", "--loss-log", s(&env_log)];
    let via_env = ok(
        &run(
            &small_train_args(&TWO_RANKS, &env_extra),
            Some(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")),
        ),
        "run with PYTORCH_CUDA_ALLOC_CONF",
    );
    assert!(
        via_env.contains("allocator: expandable_segments:True"),
        "{via_env}"
    );
    assert_eq!(loss_column(&env_log), plain_losses);
    let overridden = ok(
        &run(
            &small_train_args(&TWO_RANKS, &["--steps", "1", "--alloc-conf", ""]),
            Some(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")),
        ),
        "run with an empty --alloc-conf",
    );
    assert!(!overridden.contains("allocator:"), "{overridden}");
}

#[test]
fn bad_alloc_conf_is_one_error_naming_the_key() {
    let d = common::cli::scratch("alloc-conf", "bad");
    let log = d.join("never.csv");
    let args = ["--steps", "1", "--loss-log", s(&log), "--alloc-conf"];
    for (conf, needles) in [
        (
            "expandable_segments:True,max_split_mb:128",
            &["--alloc-conf", "max_split_mb", "128"][..],
        ),
        (
            "expandable_segments:yes",
            &["expandable_segments", "yes", "True"][..],
        ),
        (
            "garbage_collection_threshold:1.5",
            &["garbage_collection_threshold", "1.5"][..],
        ),
        (
            "backend:cudaMallocAsync",
            &["backend:cudaMallocAsync", "--device cuda", "backend:native"][..],
        ),
    ] {
        let mut a = args.to_vec();
        a.push(conf);
        one_error(&run(&small_train_args(&TWO_RANKS, &a), None), needles);
        // Refused before any rank started: no loss log.
        assert!(!log.exists(), "{conf}: a rank started");
    }
    one_error(
        &run(
            &small_train_args(&TWO_RANKS, &["--steps", "1"]),
            Some(("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:3")),
        ),
        &["PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions", "3"],
    );
}

#[test]
fn plan_takes_the_alloc_conf() {
    // Units of 6 MiB unsharded: large-pool blocks, where expandable segments change what is
    // reserved (pages of 20 MiB here, more than the segments without them for this model).
    let plan = |conf: &str| {
        let a = [
            "plan",
            "--ranks",
            "2",
            "--n-embd",
            "512",
            "--n-layer",
            "2",
            "--alloc-conf",
        ];
        let mut a = a.to_vec();
        a.push(conf);
        run(&a, None)
    };
    let exp = ok(
        &plan("expandable_segments:True"),
        "plan with expandable segments",
    );
    let plain = ok(&plan(""), "plan");
    // The same allocated peak; the reserved bytes are the expandable segments' mapped pages.
    let row = |text: &str| -> Vec<String> {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with("0-1"))
            .unwrap();
        line.split_whitespace().map(str::to_string).collect()
    };
    let (e, p) = (row(&exp), row(&plain));
    assert_eq!(
        e[..9],
        p[..9],
        "sharded state .. peak allocated:\n{exp}\n{plain}"
    );
    assert_ne!(e[9..11], p[9..11], "peak reserved:\n{exp}\n{plain}");
    one_error(
        &plan("max_split_size_mb:16"),
        &["max_split_size_mb", "16", "too small"],
    );
}
