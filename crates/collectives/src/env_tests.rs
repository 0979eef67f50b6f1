//! Unit tests of [`super`] (the launcher's environment): the variables read, torchrun's
//! defaults, the errors naming a bad variable, and the backends' names.

use super::*;

fn lookup<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

#[test]
fn no_launcher_is_none() {
    assert_eq!(LaunchEnv::from_lookup(lookup(&[])).unwrap(), None);
}

#[test]
fn full_environment_is_read() {
    let env = LaunchEnv::from_lookup(lookup(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "1234"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(
        env,
        LaunchEnv {
            rank: 3,
            world_size: 4,
            local_rank: 1,
            local_world_size: 2,
            master_addr: "10.0.0.1".into(),
            master_port: 1234,
            token: None,
            job_id: None,
            use_agent_store: false,
            restart_count: 0,
        }
    );
}

#[test]
fn defaults_follow_torchrun() {
    let env = LaunchEnv::from_lookup(lookup(&[("RANK", "1"), ("WORLD_SIZE", "2")]))
        .unwrap()
        .unwrap();
    assert_eq!((env.local_rank, env.local_world_size), (1, 2));
    assert_eq!(
        (env.master_addr.as_str(), env.master_port),
        ("127.0.0.1", 29500)
    );
}

#[test]
fn bad_variables_are_named() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("RANK", "0")], "RANK is set but WORLD_SIZE is not"),
        (&[("WORLD_SIZE", "2")], "WORLD_SIZE is set but RANK is not"),
        (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=\"x\""),
        (
            &[("RANK", "2"), ("WORLD_SIZE", "2")],
            "RANK=2 is not below WORLD_SIZE=2",
        ),
        (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE=0"),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")],
            "MASTER_PORT=\"70000\"",
        ),
        (
            &[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "2"),
                ("LOCAL_WORLD_SIZE", "2"),
            ],
            "LOCAL_RANK=2",
        ),
    ];
    for (vars, want) in cases {
        let err = LaunchEnv::from_lookup(lookup(vars)).unwrap_err();
        assert!(err.to_string().contains(want), "{vars:?}: {err}");
    }
}

#[test]
fn backend_names_round_trip() {
    for b in [Backend::Tcp, Backend::Nccl, Backend::Mpi] {
        assert_eq!(b.name().parse::<Backend>().unwrap(), b);
    }
    assert_eq!("gloo".parse::<Backend>().unwrap(), Backend::Tcp);
    assert!("ring"
        .parse::<Backend>()
        .unwrap_err()
        .contains("expected tcp, nccl or mpi"));
}
