//! Activation checkpointing in the engine's driver on a model that is not the GPT: a chain of
//! elementwise layers `y = tanh(w ⊙ x)`, one unit per layer, whose tape saves each layer's
//! input and output. Checked: bitwise the same losses and parameters and the same schedule with
//! and without checkpointing, the recomputation reading the parameters unsharded for backward;
//! the measured activation figures equal the plan's dry run over the declared per-span bytes;
//! a model that does not implement checkpointing runs unchanged with it on.

use std::collections::HashMap;
use std::time::Duration;

use fsdp::engine::{
    ActivationStats, Fsdp, FsdpConfig, FsdpModel, ParamInit, ScheduleEvent, ShardingStrategy, Span,
    SpanActivations,
};
use fsdp::optim::SgdConfig;
use fsdp::plan::plan_with_activations;
use fsdp::units::{ParamSpec, UnitPlan, UnitSpec};
use fsdp::{FsdpError, Grads, Params};
use fsdp_collectives::{ring, Communicator};

/// Elements per layer (5: padded at worlds 2 and 3).
const N: usize = 5;
const LAYERS: usize = 4;

struct Chain {
    /// Whether spans may be checkpointed (the trait's methods are used).
    recomputable: bool,
}

enum Saved {
    Full { x: Vec<f32>, y: Vec<f32> },
    Input(Vec<f32>),
}

#[derive(Default)]
struct Tape {
    cur: Vec<f32>,
    saved: Vec<Saved>,
    dy: Vec<f32>,
    loss: f32,
}

fn name(s: usize) -> String {
    format!("w{s}")
}

fn layer(p: &dyn Params, s: usize, x: &[f32]) -> Result<Vec<f32>, FsdpError> {
    let w = p.param(&name(s))?;
    Ok(x.iter().zip(w).map(|(x, w)| (x * w).tanh()).collect())
}

impl FsdpModel for Chain {
    type Batch = Vec<f32>;
    type Tape = Tape;

    fn spans(&self) -> Vec<Span> {
        (0..LAYERS).map(|s| Span::new(name(s), [name(s)])).collect()
    }

    fn forward(
        &self,
        s: usize,
        p: &dyn Params,
        b: &Vec<f32>,
        t: &mut Tape,
    ) -> Result<(), FsdpError> {
        let x = if s == 0 {
            b.clone()
        } else {
            std::mem::take(&mut t.cur)
        };
        let y = layer(p, s, &x)?;
        t.cur = y.clone();
        t.saved.push(Saved::Full { x, y });
        if s + 1 == LAYERS {
            t.loss = t.cur.iter().sum::<f32>() / 8.0;
        }
        Ok(())
    }

    fn loss(&self, t: &Tape) -> Result<f32, FsdpError> {
        Ok(t.loss)
    }

    fn backward(
        &self,
        s: usize,
        p: &dyn Params,
        g: &mut dyn Grads,
        _: &Vec<f32>,
        t: &mut Tape,
    ) -> Result<(), FsdpError> {
        let Some(Saved::Full { x, y }) = t.saved.pop() else {
            return Err(FsdpError::InvalidShape {
                reason: "no saved activations".into(),
            });
        };
        if s + 1 == LAYERS {
            t.cur = Vec::new();
            t.dy = vec![1.0 / 8.0; N];
        }
        let w = p.param(&name(s))?.to_vec();
        let gw = g.grad_mut(&name(s))?;
        for i in 0..N {
            let d = t.dy[i] * (1.0 - y[i] * y[i]);
            gw[i] += d * x[i];
            t.dy[i] = d * w[i];
        }
        Ok(())
    }

    fn checkpointable(&self, _: usize) -> bool {
        self.recomputable
    }

    fn discard_saved(&self, _: usize, t: &mut Tape) -> Result<(), FsdpError> {
        match t.saved.pop() {
            Some(Saved::Full { x, .. }) => t.saved.push(Saved::Input(x)),
            _ => panic!("discard without saved activations"),
        }
        Ok(())
    }

    fn recompute(
        &self,
        s: usize,
        p: &dyn Params,
        _: &Vec<f32>,
        t: &mut Tape,
    ) -> Result<(), FsdpError> {
        let Some(Saved::Input(x)) = t.saved.pop() else {
            panic!("recompute without a kept input");
        };
        let y = layer(p, s, &x)?;
        t.saved.push(Saved::Full { x, y });
        Ok(())
    }

    fn tape_bytes(&self, t: &Tape) -> u64 {
        let saved: usize = t
            .saved
            .iter()
            .map(|s| match s {
                Saved::Full { x, y } => x.len() + y.len(),
                Saved::Input(x) => x.len(),
            })
            .sum();
        ((t.cur.len() + t.dy.len() + saved) * 4) as u64
    }
}

/// The declared bytes of the spans (as the forward and backward above change the tape).
fn declared() -> Vec<SpanActivations> {
    let n = (N * 4) as i64;
    (0..LAYERS)
        .map(|s| SpanActivations {
            // Layer 0 copies the batch; the others move `cur` into their saved input.
            forward: if s == 0 { 3 * n } else { 2 * n },
            // Every backward drops the saved input and output (the last one also replaces
            // `cur` by `dy`, of the same size).
            backward: -2 * n,
            recomputable: Some(n as u64),
        })
        .collect()
}

fn units() -> UnitPlan {
    UnitPlan {
        units: (0..LAYERS)
            .map(|s| UnitSpec {
                name: name(s),
                params: vec![ParamSpec::new(name(s), vec![N])],
            })
            .collect(),
        ignored: vec![],
    }
}

struct Run {
    losses: Vec<u32>,
    params: Vec<(String, Vec<u32>)>,
    schedule: Vec<ScheduleEvent>,
    activations: ActivationStats,
    peak_allocated: u64,
}

fn train(world: usize, config: FsdpConfig, model: &Chain) -> Vec<Run> {
    let init: HashMap<String, Vec<f32>> = (0..LAYERS)
        .map(|s| {
            (
                name(s),
                (0..N).map(|i| 0.5 + 0.1 * (s + i) as f32).collect(),
            )
        })
        .collect();
    let plan = units();
    let opts = ring::RingOptions::default().with_timeout(Duration::from_secs(60));
    ring::run_ranks(world, opts, |comm| {
        let rank = comm.rank();
        let opt = SgdConfig::with_momentum(0.1, 0.9);
        let mut f = Fsdp::new(Box::new(comm), &plan, ParamInit::Full(&init), config, opt).unwrap();
        let losses = (0..2)
            .map(|k| {
                let batch: Vec<f32> = (0..N).map(|i| (k + rank + i) as f32 * 0.25 - 0.5).collect();
                f.step(model, &batch).unwrap().to_bits()
            })
            .collect();
        let mut params: Vec<(String, Vec<u32>)> = f
            .full_state_dict()
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
            .collect();
        params.sort();
        Run {
            losses,
            params,
            schedule: f.schedule().to_vec(),
            activations: f.activation_stats(),
            peak_allocated: f.memory_stats().allocated_bytes.all.peak,
        }
    })
    .unwrap()
}

#[test]
fn checkpointed_chain_is_bitwise_the_same_and_predicted() {
    for (world, strategy) in [
        (1, ShardingStrategy::FullShard),
        (2, ShardingStrategy::FullShard),
        (3, ShardingStrategy::ShardGradOp),
        (2, ShardingStrategy::NoShard),
    ] {
        let base = FsdpConfig::new(strategy);
        let on = FsdpConfig {
            activation_checkpointing: true,
            ..base
        };
        let model = Chain { recomputable: true };
        let plain = train(world, base, &model);
        let ckpt = train(world, on, &model);
        let n = (N * 4) as u64;
        for (p, c) in plain.iter().zip(&ckpt) {
            assert_eq!(p.losses, c.losses);
            assert_eq!(p.params, c.params);
            assert_eq!(p.schedule, c.schedule);
            assert_eq!(p.peak_allocated, c.peak_allocated);
            assert_eq!(c.activations.recomputations, 2 * LAYERS as u64);
            // Without: every layer's input and output, plus `cur`; with: the inputs, one
            // layer's output and `cur` (or `dy`).
            assert_eq!(p.activations.peak, (2 * LAYERS as u64 + 1) * n);
            assert_eq!(c.activations.peak, (LAYERS as u64 + 2) * n);
        }
        for (config, runs) in [(base, &plain), (on, &ckpt)] {
            let p = plan_with_activations(
                &units(),
                &Chain { recomputable: true }.spans(),
                &declared(),
                world,
                &config,
                1,
            )
            .unwrap();
            let m = &p.per_rank[0];
            assert_eq!(
                m.activations, runs[0].activations.peak,
                "{strategy:?} {world}"
            );
            assert_eq!(
                m.peak_allocated_with_activations, runs[0].activations.peak_allocated,
                "{strategy:?} {world}"
            );
            assert_eq!(m.peak_allocated, runs[0].peak_allocated);
        }
    }
}

#[test]
fn a_model_without_checkpointing_runs_unchanged_with_it_on() {
    let model = Chain {
        recomputable: false,
    };
    let base = FsdpConfig::new(ShardingStrategy::FullShard);
    let plain = train(2, base, &model);
    let on = train(
        2,
        FsdpConfig {
            activation_checkpointing: true,
            ..base
        },
        &model,
    );
    assert_eq!(plain[0].losses, on[0].losses);
    assert_eq!(on[0].activations.recomputations, 0);
    assert_eq!(plain[0].activations, on[0].activations);
}
