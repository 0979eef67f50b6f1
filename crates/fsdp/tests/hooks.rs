//! The engine's hooks driven by a hand-written loop give bitwise what the `FsdpModel` driver
//! gives (same schedule, same parameters), and misuse of the hooks is an error, not a panic.

use std::collections::HashMap;

use fsdp::engine::{FsdpConfig, ScheduleEvent, ShardingStrategy};
use fsdp::optim::AdamWConfig;
use fsdp::units::{ParamSpec, UnitPlan, UnitSpec};
use fsdp::{Fsdp, FsdpError, FsdpModel, Grads, ParamInit, Params};
use fsdp_collectives::{ring, Communicator};

/// Three layers `y = c ⊙ tanh(B · tanh(A · x))` over vectors of 5, each layer a unit.
struct Net;

#[derive(Default)]
struct Tape {
    h1: Vec<f32>,
    h2: Vec<f32>,
    y: Vec<f32>,
    d: Vec<f32>,
}

const N: usize = 5;

fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks(N)
        .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

impl Net {
    fn forward_span(s: usize, p: &dyn Params, x: &[f32], t: &mut Tape) -> Result<(), FsdpError> {
        match s {
            0 => t.h1 = matvec(p.param("a")?, x).iter().map(|v| v.tanh()).collect(),
            1 => {
                t.h2 = matvec(p.param("b")?, &t.h1)
                    .iter()
                    .map(|v| v.tanh())
                    .collect()
            }
            _ => {
                t.y = p
                    .param("c")?
                    .iter()
                    .zip(&t.h2)
                    .map(|(c, h)| c * h)
                    .collect()
            }
        }
        Ok(())
    }

    fn backward_span(
        s: usize,
        p: &dyn Params,
        g: &mut dyn Grads,
        x: &[f32],
        t: &mut Tape,
    ) -> Result<(), FsdpError> {
        let outer = |gw: &mut [f32], d: &[f32], inp: &[f32]| {
            for (i, di) in d.iter().enumerate() {
                for (j, xj) in inp.iter().enumerate() {
                    gw[i * N + j] += di * xj;
                }
            }
        };
        match s {
            2 => {
                // d loss / d y with loss = Σ y² / 4 (2 ranks, averaged).
                let dy: Vec<f32> = t.y.iter().map(|y| y / 2.0).collect();
                let gc = g.grad_mut("c")?;
                for i in 0..N {
                    gc[i] += dy[i] * t.h2[i];
                }
                let c = p.param("c")?;
                t.d = (0..N)
                    .map(|i| dy[i] * c[i] * (1.0 - t.h2[i] * t.h2[i]))
                    .collect();
            }
            1 => {
                outer(g.grad_mut("b")?, &t.d, &t.h1);
                let b = p.param("b")?;
                t.d = (0..N)
                    .map(|j| (0..N).map(|i| t.d[i] * b[i * N + j]).sum::<f32>())
                    .zip(&t.h1)
                    .map(|(v, h)| v * (1.0 - h * h))
                    .collect();
            }
            _ => outer(g.grad_mut("a")?, &t.d, x),
        }
        Ok(())
    }
}

impl FsdpModel for Net {
    type Batch = Vec<f32>;
    type Tape = Tape;
    fn spans(&self) -> Vec<fsdp::engine::Span> {
        ["a", "b", "c"]
            .iter()
            .map(|n| fsdp::engine::Span::new(*n, [*n]))
            .collect()
    }
    fn forward(
        &self,
        s: usize,
        p: &dyn Params,
        x: &Vec<f32>,
        t: &mut Tape,
    ) -> Result<(), FsdpError> {
        Net::forward_span(s, p, x, t)
    }
    fn loss(&self, t: &Tape) -> Result<f32, FsdpError> {
        Ok(t.y.iter().map(|y| y * y).sum::<f32>() / 4.0)
    }
    fn backward(
        &self,
        s: usize,
        p: &dyn Params,
        g: &mut dyn Grads,
        x: &Vec<f32>,
        t: &mut Tape,
    ) -> Result<(), FsdpError> {
        Net::backward_span(s, p, g, x, t)
    }
}

fn plan() -> UnitPlan {
    let unit = |n: &str, shape: Vec<usize>| UnitSpec {
        name: n.into(),
        params: vec![ParamSpec::new(n, shape)],
    };
    UnitPlan {
        units: vec![
            unit("a", vec![N, N]),
            unit("b", vec![N, N]),
            unit("c", vec![N]),
        ],
        ignored: Vec::new(),
    }
}

fn init() -> HashMap<String, Vec<f32>> {
    let v = |n: usize, k: f32| (0..n).map(|i| ((i as f32 * k).sin()) * 0.5).collect();
    HashMap::from([
        ("a".to_string(), v(N * N, 0.7)),
        ("b".to_string(), v(N * N, 1.3)),
        ("c".to_string(), v(N, 2.1)),
    ])
}

fn input(rank: usize) -> Vec<f32> {
    (0..N).map(|i| (i + rank) as f32 * 0.3 - 0.5).collect()
}

/// One step by hand: the hooks around each span, as `Fsdp::forward_backward` calls them.
fn step_by_hand(fsdp: &mut Fsdp, x: &[f32]) -> Result<f32, FsdpError> {
    let mut t = Tape::default();
    for u in 0..3 {
        fsdp.pre_forward(u)?;
        Net::forward_span(u, &fsdp.param_views(&[u])?, x, &mut t)?;
        fsdp.post_forward(u)?;
    }
    let local = t.y.iter().map(|y| y * y).sum::<f32>() / 4.0;
    for u in (0..3).rev() {
        fsdp.pre_backward(u)?;
        {
            let p = fsdp.param_views(&[u])?;
            let mut g = fsdp.grad_views(&[u])?;
            Net::backward_span(u, &p, &mut g, x, &mut t)?;
        }
        fsdp.post_backward(u)?;
    }
    let loss = fsdp.all_reduce_loss(local)?;
    fsdp.finalize_backward()?;
    fsdp.optimizer_step()?;
    Ok(loss)
}

type Run = (Vec<f32>, HashMap<String, Vec<f32>>, Vec<ScheduleEvent>);

fn run(by_hand: bool, strategy: ShardingStrategy) -> Vec<Run> {
    let (plan, init) = (plan(), init());
    ring::run_ranks(2, ring::RingOptions::default(), |comm| {
        let x = input(comm.rank());
        let config = FsdpConfig {
            forward_prefetch: true,
            ..FsdpConfig::new(strategy)
        };
        let opt = AdamWConfig::default();
        let mut fsdp =
            Fsdp::new(Box::new(comm), &plan, ParamInit::Full(&init), config, opt).unwrap();
        let losses = (0..3)
            .map(|_| {
                if by_hand {
                    step_by_hand(&mut fsdp, &x).unwrap()
                } else {
                    fsdp.step(&Net, &x).unwrap()
                }
            })
            .collect();
        (
            losses,
            fsdp.full_state_dict().unwrap(),
            fsdp.schedule().to_vec(),
        )
    })
    .unwrap()
}

#[test]
fn hooks_by_hand_equal_the_driver_bitwise() {
    for strategy in ShardingStrategy::ALL {
        let (hand, driver) = (run(true, strategy), run(false, strategy));
        for (h, d) in hand.iter().zip(&driver) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&h.0), bits(&d.0), "{strategy:?}: losses");
            for (name, v) in &d.1 {
                assert_eq!(bits(&h.1[name]), bits(v), "{strategy:?}: `{name}`");
            }
            assert_eq!(h.2, d.2, "{strategy:?}: schedule");
        }
        // The model learned something (the loss falls).
        assert!(
            driver[0].0[2] < driver[0].0[0],
            "{strategy:?}: {:?}",
            driver[0].0
        );
    }
}

#[test]
fn misused_hooks_are_errors() {
    let (plan, init) = (plan(), init());
    let errors = ring::run_ranks(2, ring::RingOptions::default(), |comm| {
        let config = FsdpConfig::new(ShardingStrategy::FullShard);
        let opt = AdamWConfig::default();
        let mut fsdp =
            Fsdp::new(Box::new(comm), &plan, ParamInit::Full(&init), config, opt).unwrap();
        let mut errors = Vec::new();
        // A unit that does not exist.
        errors.push(fsdp.pre_forward(7).unwrap_err().to_string());
        // Backward before any forward of the pass.
        errors.push(fsdp.pre_backward(0).unwrap_err().to_string());
        // Views of a unit that is sharded.
        errors.push(fsdp.param_views(&[1]).err().unwrap().to_string());
        // Gradient views before pre_backward.
        fsdp.pre_forward(0).unwrap();
        errors.push(fsdp.grad_views(&[0]).err().unwrap().to_string());
        // A parameter of a unit the views do not cover.
        let views = fsdp.param_views(&[0]).unwrap();
        errors.push(views.param("b").unwrap_err().to_string());
        drop(views);
        // After abort_pass the engine is usable again.
        fsdp.abort_pass();
        step_by_hand(&mut fsdp, &input(0)).unwrap();
        errors
    })
    .unwrap();
    for e in &errors[0] {
        println!("{e}");
    }
    assert!(errors[0][0].contains("unit 7 does not exist"));
    assert!(errors[0][1].contains("outside a pass"));
    assert!(errors[0][2].contains("unit 1 is sharded"));
    assert!(errors[0][3].contains("gradients are not allocated"));
    assert!(errors[0][4].contains("`b`") || errors[0][4].contains("b (its unit"));
}
