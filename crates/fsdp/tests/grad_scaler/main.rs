//! Dynamic loss scaling (`GradScaler`, PyTorch's `ShardedGradScaler`) in the engine, on a small
//! two-unit model whose backward can inject a non-finite (or huge) gradient on a chosen rank at
//! a chosen step:
//!
//! - a hand-computed sequence of scales (growth interval 3, overflows injected at steps 2, 6
//!   and 7), the skipped steps counted, parameters unchanged on skipped steps and changed on
//!   the others; a gradient that is finite but overflows once scaled is skipped at `2^16` and
//!   taken at `2^15`;
//! - an infinity on one rank only is skipped on every rank, at worlds 2 and 3 (and 4 for the
//!   2×2 hybrid mesh), for every strategy, the run then equal to the run without that step;
//! - without overflow, training with the scaler is bitwise the training without it (scaled by
//!   a power of two, then unscaled), with `no_sync` accumulation and clipping;
//! - the trainer's path (a non-finite `grad_norm`, then `skip_step`) is the scaler's skip; a
//!   backward after unscaling is refused; the state survives a sharded checkpoint;
//! - configuration errors.

use std::collections::HashMap;

use fsdp::engine::{
    load_grad_scaler_state, Fsdp, FsdpConfig, FsdpModel, GradScaler, GradScalerConfig,
    GradScalerState, ParamInit, ShardingStrategy, Span, GRAD_SCALER_FILE,
};
use fsdp::optim::{OptimizerConfig, SgdConfig};
use fsdp::units::{ParamSpec, UnitPlan, UnitSpec};
use fsdp::{FsdpError, Grads, Params};
use fsdp_collectives::{ring, Communicator};

#[path = "../common/mod.rs"]
mod common;
mod scales;
mod skips;
mod state;

use common::{bits, mesh, ring_options, Bits, Map, GLOBAL};

/// Inputs per example.
const IN: usize = 5;

/// `h = tanh(a · x)` (unit `a`, 5 weights), `y = b0·h + b1·h² + b2` (unit `b`, 3 weights, so
/// shards are padded at worlds 2 and 4), loss `Σ (y − t)² / (2·GLOBAL)`.
struct Net;

/// One rank's examples, and the value added to `b.w[index]`'s gradient in backward, if any.
struct Batch {
    x: Vec<[f32; IN]>,
    t: Vec<f32>,
    poison: Option<(usize, f32)>,
}

#[derive(Default)]
struct Tape {
    h: Vec<f32>,
    y: Vec<f32>,
    dh: Vec<f32>,
    loss: f32,
}

impl FsdpModel for Net {
    type Batch = Batch;
    type Tape = Tape;

    fn spans(&self) -> Vec<Span> {
        vec![Span::new("a", ["a.w"]), Span::new("b", ["b.w"])]
    }

    fn forward(
        &self,
        span: usize,
        p: &dyn Params,
        batch: &Batch,
        tape: &mut Tape,
    ) -> Result<(), FsdpError> {
        if span == 0 {
            let a = p.param("a.w")?;
            tape.h = batch
                .x
                .iter()
                .map(|x| x.iter().zip(a).map(|(x, a)| x * a).sum::<f32>().tanh())
                .collect();
        } else {
            let b = p.param("b.w")?;
            tape.y = tape
                .h
                .iter()
                .map(|h| b[0] * h + b[1] * h * h + b[2])
                .collect();
            tape.loss = tape
                .y
                .iter()
                .zip(&batch.t)
                .map(|(y, t)| (y - t) * (y - t))
                .sum::<f32>()
                / (2 * GLOBAL) as f32;
        }
        Ok(())
    }

    fn loss(&self, tape: &Tape) -> Result<f32, FsdpError> {
        Ok(tape.loss)
    }

    fn backward(
        &self,
        span: usize,
        p: &dyn Params,
        g: &mut dyn Grads,
        batch: &Batch,
        tape: &mut Tape,
    ) -> Result<(), FsdpError> {
        if span == 1 {
            let b = p.param("b.w")?.to_vec();
            let gb = g.grad_mut("b.w")?;
            tape.dh.clear();
            for ((y, h), t) in tape.y.iter().zip(&tape.h).zip(&batch.t) {
                let d = (y - t) / GLOBAL as f32;
                gb[0] += d * h;
                gb[1] += d * h * h;
                gb[2] += d;
                tape.dh.push(d * (b[0] + 2.0 * b[1] * h));
            }
            if let Some((i, v)) = batch.poison {
                gb[i] += v;
            }
        } else {
            let ga = g.grad_mut("a.w")?;
            for ((x, h), dh) in batch.x.iter().zip(&tape.h).zip(&tape.dh) {
                let dz = dh * (1.0 - h * h);
                for (g, x) in ga.iter_mut().zip(x) {
                    *g += dz * x;
                }
            }
        }
        Ok(())
    }
}

fn plan() -> UnitPlan {
    let unit = |n: &str, len| UnitSpec {
        name: n.into(),
        params: vec![ParamSpec::new(format!("{n}.w"), vec![len])],
    };
    UnitPlan {
        units: vec![unit("a", IN), unit("b", 3)],
        ignored: vec![],
    }
}

fn init() -> Map {
    HashMap::from([
        ("a.w".to_string(), vec![0.3, -0.2, 0.5, 0.1, -0.4]),
        ("b.w".to_string(), vec![0.7, -0.3, 0.2]),
    ])
}

/// Rank `rank`'s slice of the global batch.
fn batch(rank: usize, world: usize, poison: Option<(usize, f32)>) -> Batch {
    let per = GLOBAL / world;
    let rows = rank * per..(rank + 1) * per;
    Batch {
        x: rows
            .clone()
            .map(|i| std::array::from_fn(|j| ((i * IN + j) as f32 * 0.7).sin()))
            .collect(),
        t: rows.map(|i| (i as f32 * 0.3).cos()).collect(),
        poison,
    }
}

fn adamw() -> OptimizerConfig {
    common::adamw().into()
}

/// One engine per rank on `world` threads; `body(fsdp, rank)` drives it.
fn on_ranks<T: Send>(
    world: usize,
    config: FsdpConfig,
    optim: OptimizerConfig,
    scaler: Option<GradScalerConfig>,
    body: impl Fn(&mut Fsdp, usize) -> T + Sync,
) -> Vec<T> {
    let (plan, init) = (plan(), init());
    ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let mut fsdp =
            Fsdp::new(Box::new(comm), &plan, ParamInit::Full(&init), config, optim).unwrap();
        fsdp.set_grad_scaler(scaler).unwrap();
        body(&mut fsdp, rank)
    })
    .unwrap()
}

/// What one rank saw after each step.
#[derive(Debug, Clone, PartialEq)]
struct Trace {
    /// The full parameters after each step.
    params: Vec<Map>,
    /// The scale and growth tracker after each step.
    scales: Vec<(f32, u32)>,
    skipped: u64,
    optimizer_steps: u64,
}

/// `steps` steps of [`Net`] with `poison(rank, step)` injected into backward.
fn train(
    world: usize,
    config: FsdpConfig,
    optim: OptimizerConfig,
    scaler: Option<GradScalerConfig>,
    steps: usize,
    poison: impl Fn(usize, usize) -> Option<(usize, f32)> + Sync,
) -> Vec<Trace> {
    on_ranks(world, config, optim, scaler, |fsdp, rank| {
        let mut t = Trace {
            params: Vec::new(),
            scales: Vec::new(),
            skipped: 0,
            optimizer_steps: 0,
        };
        for step in 0..steps {
            fsdp.step(&Net, &batch(rank, world, poison(rank, step)))
                .unwrap();
            t.params.push(fsdp.full_state_dict().unwrap());
            if let Some(s) = fsdp.grad_scaler() {
                assert_eq!(s.found_inf(), None, "the step's unscaling is forgotten");
                t.scales.push((s.scale(), s.growth_tracker()));
            }
        }
        t.skipped = fsdp.grad_scaler().map_or(0, GradScaler::skipped_steps);
        t.optimizer_steps = fsdp.optimizer_steps();
        t
    })
}
