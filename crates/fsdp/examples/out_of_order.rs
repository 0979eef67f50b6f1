//! Units that run in another order than they are defined, with a skip connection: the engine
//! prefetches by the execution order it records in the first pass, not by definition order.
//!
//! ```text
//! units (definition order): "" (head), "a", "b", "c", "d"
//! execution:  x → c → a → d → b(d + a) → head → loss Σ‖y − t‖² / N
//!                      └────────┘ skip: a's output feeds d and b
//! ```
//!
//! Every block is `out = s · tanh(W·in + b)` (weight, bias and a scalar gain `s`); the root
//! owns the head `y = Wo·out_b`. Blocks are wrapped by module type (`Block`), so the units are
//! listed root first then `a, b, c, d`, while the spans run `c, a, d, b, head`. In backward the
//! gradient of `a`'s output is the sum of what `b` (the skip) and `d` send back: the tape keeps
//! one incoming gradient per block and backward adds into it. With forward prefetch on, the
//! first pass prefetches by definition order (nothing is recorded yet), later passes gather
//! `c, a, d, b` in forward and `b, d, a, c` in backward (see `Fsdp::schedule`).
//!
//! `cargo run -p fsdp --example out_of_order`: FULL_SHARD, forward prefetch, 2 ranks (threads).

#[path = "common/mod.rs"]
mod common;

use std::collections::HashMap;

use common::{acc, mm, Batch, R};
use fsdp::engine::{FsdpConfig, FsdpModel, ScheduleKind, ShardingStrategy, Span};
use fsdp::wrap::{plan_units, Module, WrapOptions, WrapPolicy};
use fsdp::{Grads, Params};

/// Widths of input, blocks and output: unit sizes 55 (root), 133 (`a`, `b`, `d`), 67 (`c`),
/// none a multiple of 2, 3 or 4, so shards are padded at every world size.
pub(crate) const I: usize = 5;
pub(crate) const H: usize = 11;
pub(crate) const O: usize = 5;
/// The blocks in execution order.
pub(crate) const EXEC: [&str; 4] = ["c", "a", "d", "b"];

/// The module tree: blocks registered `a, b, c, d` (`c` reads the input), then the head.
pub(crate) fn tree() -> Module {
    let mut root = Module::new("", "SkipNet");
    for (n, c) in [("a", H), ("b", H), ("c", I), ("d", H)] {
        let block = Module::new(n, "Block").with_param("weight", vec![H, c]);
        root = root.with_child(
            block
                .with_param("bias", vec![H])
                .with_param("gain", vec![1]),
        );
    }
    root.with_child(Module::new("head", "Linear").with_param("weight", vec![O, H]))
}

/// One unit per `Block`.
pub(crate) fn wrap() -> WrapOptions {
    WrapOptions::new(WrapPolicy::module_type(["Block"]))
}

/// Initial values: normal, std `1/√(last dim)`, mean 1 for the gains and 0 for the rest.
pub(crate) fn init_params(tree: &Module) -> HashMap<String, Vec<f32>> {
    let mean = |name: &str| if name.ends_with("gain") { 1.0 } else { 0.0 };
    common::init_params(tree, 11, mean)
}

/// Rank `rank`'s slice of a `global`-example batch split evenly over `world` ranks.
pub(crate) fn batch(global: usize, rank: usize, world: usize) -> Batch {
    common::batch(5, (I, O), global, rank, world)
}

/// `acc += v` (an empty `acc` counts as zeros).
fn add(acc: &mut Vec<f32>, v: &[f32]) {
    acc.resize(v.len(), 0.0);
    acc.iter_mut().zip(v).for_each(|(a, v)| *a += v);
}

/// The model; `global` is the number of examples over all ranks (the loss normaliser).
pub(crate) struct SkipNet {
    pub(crate) global: usize,
}

/// Per block (execution order): input, `tanh(W·in + b)`, output and incoming gradient; the
/// loss and its gradient `dy`.
#[derive(Default)]
pub(crate) struct Tape {
    inp: [Vec<f32>; 4],
    act: [Vec<f32>; 4],
    out: [Vec<f32>; 4],
    grad: [Vec<f32>; 4],
    dy: Vec<f32>,
    loss: f32,
}

impl FsdpModel for SkipNet {
    type Batch = Batch;
    type Tape = Tape;

    fn spans(&self) -> Vec<Span> {
        let block = |n: &str| Span::new(n, ["weight", "bias", "gain"].map(|p| format!("{n}.{p}")));
        let mut spans: Vec<Span> = EXEC.iter().map(|n| block(n)).collect();
        spans.push(Span::new("head", ["head.weight"]));
        spans
    }

    fn forward(&self, s: usize, p: &dyn Params, b: &Batch, t: &mut Tape) -> R {
        let Some(n) = EXEC.get(s) else {
            let y = mm(&t.out[3], p.param("head.weight")?, O, false);
            let res: Vec<f32> = y.iter().zip(&b.y).map(|(y, y0)| y - y0).collect();
            let n = self.global as f32;
            t.loss = res.iter().map(|r| r * r / n).sum();
            t.dy = res.iter().map(|r| 2.0 * r / n).collect();
            return Ok(());
        };
        let param = |k: &str| p.param(&format!("{n}.{k}"));
        t.inp[s] = match s {
            0 => b.x.clone(),
            3 => t.out[2].iter().zip(&t.out[1]).map(|(d, a)| d + a).collect(), // b(d + a)
            _ => t.out[s - 1].clone(),
        };
        let z = mm(&t.inp[s], param("weight")?, H, false);
        let bias = param("bias")?.iter().cycle();
        t.act[s] = z.iter().zip(bias).map(|(z, b)| (z + b).tanh()).collect();
        let gain = param("gain")?[0];
        t.out[s] = t.act[s].iter().map(|a| gain * a).collect();
        Ok(())
    }

    fn loss(&self, t: &Tape) -> R<f32> {
        Ok(t.loss)
    }

    fn backward(&self, s: usize, p: &dyn Params, g: &mut dyn Grads, _: &Batch, t: &mut Tape) -> R {
        let Some(n) = EXEC.get(s) else {
            acc(g.grad_mut("head.weight")?, &t.dy, &t.out[3], O);
            t.grad[3] = mm(&t.dy, p.param("head.weight")?, O, true);
            return Ok(());
        };
        let name = |k: &str| format!("{n}.{k}");
        let (dout, act) = (std::mem::take(&mut t.grad[s]), &t.act[s]);
        let gain = p.param(&name("gain"))?[0];
        g.grad_mut(&name("gain"))?[0] += dout.iter().zip(act).map(|(d, a)| d * a).sum::<f32>();
        let dz: Vec<f32> = dout
            .iter()
            .zip(act)
            .map(|(d, a)| d * gain * (1.0 - a * a))
            .collect();
        acc(g.grad_mut(&name("weight"))?, &dz, &t.inp[s], H);
        acc(g.grad_mut(&name("bias"))?, &dz, &[], H);
        let din = mm(&dz, p.param(&name("weight"))?, H, true);
        match s {
            0 => {} // the input
            3 => {
                add(&mut t.grad[2], &din); // to d
                add(&mut t.grad[1], &din); // to a: the skip
            }
            _ => add(&mut t.grad[s - 1], &din),
        }
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (tree, global, world) = (tree(), 12, 2);
    let (init, model) = (init_params(&tree), SkipNet { global });
    let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
    config.forward_prefetch = true;
    let batch = |rank| batch(global, rank, world);
    let plan = plan_units(&tree, &wrap())?;
    common::train(&model, &plan, &init, batch, world, config, |fsdp| {
        let gathers = fsdp
            .schedule()
            .iter()
            .filter(|e| e.kind == ScheduleKind::AllGather);
        for e in gathers.filter(|e| e.step == 2 && fsdp.rank() == 0) {
            let (unit, ahead) = (fsdp.param_groups()[e.unit].name(), e.prefetch);
            println!(
                "pass 2: {:?} all-gather of unit {unit:?}, prefetch {ahead}",
                e.phase
            );
        }
    })
}
