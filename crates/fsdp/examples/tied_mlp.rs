//! A tied-weight MLP on the FSDP engine: one matrix `S` (`body.shared.weight`, `[H, H]`) is read
//! by two submodules that are different FSDP units, so it lives in their common ancestor's unit.
//!
//! ```text
//! x → inp:  h0 = tanh(Wi·x + bi)           root unit ""
//!   → enc:  h1 = tanh(S·(We·h0 + be))      unit "body.enc", and S from unit "body"
//!   → dec:  h2 = tanh(Wd·(Sᵀ·h1 + bd))     unit "body.dec", and S from unit "body"
//!   → head: y = Wo·h2 + bo, loss Σ‖y − t‖² / N over the global batch (root unit "")
//! ```
//!
//! A custom wrap policy wraps `body`, `body.enc` and `body.dec`; `S` belongs to `body` through
//! its child `body.shared`, and `body.enc.proj` and `body.dec.proj` are tied aliases of it
//! (`Module::with_tied_param`): the planner keeps the storage in `body`, the lowest common
//! ancestor unit of its two users. The `enc` and `dec` spans list `S` by its storage name next
//! to their own parameters, so the engine keeps unit `body` gathered from `enc` to `dec` and
//! reduces its gradient once both uses have added to it.
//!
//! `cargo run -p fsdp --example tied_mlp`: FULL_SHARD on 2 ranks (threads), AdamW, 6 steps.

#[path = "common/mod.rs"]
mod common;

use std::collections::HashMap;

use common::{acc, mm, Batch, R};
use fsdp::engine::{FsdpConfig, FsdpModel, ShardingStrategy, Span};
use fsdp::wrap::{plan_units, Module, WrapOptions, WrapPolicy};
use fsdp::{Grads, Params};

/// Widths of input, inner layer, `S` and output: unit sizes 65, 121, 77, 77, none a multiple
/// of 2, 3 or 4, so shards are padded at every world size.
pub(crate) const I: usize = 4;
pub(crate) const D: usize = 6;
pub(crate) const H: usize = 11;
pub(crate) const O: usize = 5;
pub(crate) const SHARED: &str = "body.shared.weight";

/// The module tree (a Linear's weight is `[out, in]`).
pub(crate) fn tree() -> Module {
    let lin = |n: &str, ty: &str, r, c| Module::new(n, ty).with_param("weight", vec![r, c]);
    let body = Module::new("body", "Body")
        .with_child(lin("body.shared", "Linear", H, H))
        .with_child(
            lin("body.enc", "Enc", H, D)
                .with_param("bias", vec![H])
                .with_tied_param("proj", vec![H, H], SHARED),
        )
        .with_child(
            lin("body.dec", "Dec", D, H)
                .with_param("bias", vec![H])
                .with_tied_param("proj", vec![H, H], SHARED),
        );
    Module::new("", "TiedMlp")
        .with_child(lin("inp", "Linear", D, I).with_param("bias", vec![D]))
        .with_child(body)
        .with_child(lin("head", "Linear", O, D).with_param("bias", vec![O]))
}

/// Units `""`, `body`, `body.enc`, `body.dec`.
pub(crate) fn wrap() -> WrapOptions {
    let units = |m: &Module, _| matches!(m.name.as_str(), "body" | "body.enc" | "body.dec");
    WrapOptions::new(WrapPolicy::custom(units))
}

/// Initial values: normal with std `1/√(last dim)`, mean 0.
pub(crate) fn init_params(tree: &Module) -> HashMap<String, Vec<f32>> {
    common::init_params(tree, 7, |_| 0.0)
}

/// Rank `rank`'s slice of a `global`-example batch split evenly over `world` ranks.
pub(crate) fn batch(global: usize, rank: usize, world: usize) -> Batch {
    common::batch(3, (I, O), global, rank, world)
}

/// Rows `+ b`.
fn bias(mut v: Vec<f32>, b: &[f32]) -> Vec<f32> {
    v.iter_mut()
        .zip(b.iter().cycle())
        .for_each(|(v, b)| *v += b);
    v
}

fn tanh(v: Vec<f32>) -> Vec<f32> {
    v.into_iter().map(f32::tanh).collect()
}

/// `g ⊙ (1 − t²)`: back through `t = tanh(z)`.
fn dtanh(g: &[f32], t: &[f32]) -> Vec<f32> {
    g.iter().zip(t).map(|(g, t)| g * (1.0 - t * t)).collect()
}

/// Rows `W·x + b` of Linear `n` (`b` is `[r]`, `W` `[r, c]`).
fn linear(p: &dyn Params, n: &str, x: &[f32]) -> R<Vec<f32>> {
    let b = p.param(&format!("{n}.bias"))?;
    let w = p.param(&format!("{n}.weight"))?;
    Ok(bias(mm(x, w, b.len(), false), b))
}

/// Back through rows `z = W·x + b` of Linear `n`: add `dW`, `db`; return `dx = Wᵀ·dz`.
fn linear_back(p: &dyn Params, g: &mut dyn Grads, n: &str, dz: &[f32], x: &[f32]) -> R<Vec<f32>> {
    let (w, b) = (format!("{n}.weight"), format!("{n}.bias"));
    let r = p.param(&b)?.len();
    acc(g.grad_mut(&w)?, dz, x, r);
    acc(g.grad_mut(&b)?, dz, &[], r);
    Ok(mm(dz, p.param(&w)?, r, true))
}

/// The model; `global` is the number of examples over all ranks (the loss normaliser).
pub(crate) struct TiedMlp {
    pub(crate) global: usize,
}

/// The input as the model read it (`x`, cast to the parameter dtype under a mixed-precision
/// policy with `cast_forward_inputs`), activations `h0, a1, h1, a2, h2, y`, the loss, and the
/// gradient flowing back (`g`).
#[derive(Default)]
pub(crate) struct Tape {
    x: Vec<f32>,
    h: [Vec<f32>; 6],
    g: Vec<f32>,
    loss: f32,
}

impl FsdpModel for TiedMlp {
    type Batch = Batch;
    type Tape = Tape;

    fn spans(&self) -> Vec<Span> {
        vec![
            Span::new("inp", ["inp.weight", "inp.bias"]),
            Span::new("enc", ["body.enc.weight", "body.enc.bias", SHARED]),
            Span::new("dec", ["body.dec.weight", "body.dec.bias", SHARED]),
            Span::new("head", ["head.weight", "head.bias"]),
        ]
    }

    fn forward(&self, s: usize, p: &dyn Params, b: &Batch, t: &mut Tape) -> R {
        let h = &mut t.h;
        match s {
            0 => {
                t.x = b.x.clone();
                if let Some(mp) = p.mixed_precision() {
                    mp.cast_forward_input(&mut t.x);
                }
                h[0] = tanh(linear(p, "inp", &t.x)?);
            }
            1 => {
                h[1] = linear(p, "body.enc", &h[0])?;
                h[2] = tanh(mm(&h[1], p.param(SHARED)?, H, false));
            }
            2 => {
                h[3] = bias(
                    mm(&h[2], p.param(SHARED)?, H, true),
                    p.param("body.dec.bias")?,
                );
                h[4] = tanh(mm(&h[3], p.param("body.dec.weight")?, D, false));
            }
            _ => {
                h[5] = linear(p, "head", &h[4])?;
                let mp = p.mixed_precision();
                if let Some(mp) = mp {
                    mp.cast_output(&mut h[5]);
                }
                let res: Vec<f32> = h[5].iter().zip(&b.y).map(|(y, y0)| y - y0).collect();
                let n = self.global as f32;
                t.loss = res.iter().map(|r| r * r / n).sum();
                t.g = res.iter().map(|r| 2.0 * r / n).collect(); // dy
                if let Some(mp) = mp {
                    mp.cast_output_grad(&mut t.g);
                }
            }
        }
        Ok(())
    }

    fn loss(&self, t: &Tape) -> R<f32> {
        Ok(t.loss)
    }

    fn backward(&self, s: usize, p: &dyn Params, g: &mut dyn Grads, _: &Batch, t: &mut Tape) -> R {
        let h = &t.h;
        t.g = match s {
            3 => linear_back(p, g, "head", &t.g, &h[4])?,
            2 => {
                let dz = dtanh(&t.g, &h[4]);
                acc(g.grad_mut("body.dec.weight")?, &dz, &h[3], D);
                let da2 = mm(&dz, p.param("body.dec.weight")?, D, true);
                acc(g.grad_mut("body.dec.bias")?, &da2, &[], H);
                acc(g.grad_mut(SHARED)?, &h[2], &da2, H); // a2 = Sᵀ·h1: dS += h1 ⊗ da2
                mm(&da2, p.param(SHARED)?, H, false)
            }
            1 => {
                let dz = dtanh(&t.g, &h[2]);
                acc(g.grad_mut(SHARED)?, &dz, &h[1], H); // z1 = S·a1: dS += dz ⊗ a1
                let da1 = mm(&dz, p.param(SHARED)?, H, true);
                linear_back(p, g, "body.enc", &da1, &h[0])?
            }
            _ => linear_back(p, g, "inp", &dtanh(&t.g, &h[0]), &t.x)?,
        };
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (tree, global, world) = (tree(), 12, 2);
    let plan = plan_units(&tree, &wrap())?;
    for u in &plan.units {
        let names: Vec<&str> = u.params.iter().map(|p| p.name.as_str()).collect();
        println!("unit {:?}: {} elements {names:?}", u.name, u.numel());
    }
    let (init, model) = (init_params(&tree), TiedMlp { global });
    let config = FsdpConfig::new(ShardingStrategy::FullShard);
    let batch = |rank| batch(global, rank, world);
    common::train(&model, &plan, &init, batch, world, config, |_| {})
}
