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
//! its child `body.shared`. The `enc` and `dec` spans list `S` by its storage name next to
//! their own parameters, so the engine keeps unit `body` gathered from `enc` to `dec` and
//! reduces its gradient once both uses have added to it. The tie is not declared as an alias
//! (`Module::with_tied_param`) in `body.enc` or `body.dec`: the planner wants an alias and its
//! target in one unit and rejects that tree with `FsdpError::TiedParametersSplit`.
//!
//! `cargo run -p fsdp --example tied_mlp`: FULL_SHARD on 2 ranks (threads), AdamW, 6 steps.

use std::collections::HashMap;

use fsdp::engine::{Fsdp, FsdpConfig, FsdpModel, ParamInit, ShardingStrategy, Span};
use fsdp::init::{materialize, Init};
use fsdp::optim::AdamWConfig;
use fsdp::wrap::{plan_units, Module, WrapOptions, WrapPolicy};
use fsdp::{FsdpError, Grads, Params};
use fsdp_collectives::{ring, Communicator};

/// Widths of input, inner layer, `S` and output: unit sizes 65, 121, 77, 77, none a multiple
/// of 2, 3 or 4, so shards are padded at every world size.
pub(crate) const I: usize = 4;
pub(crate) const D: usize = 6;
pub(crate) const H: usize = 11;
pub(crate) const O: usize = 5;
pub(crate) const SHARED: &str = "body.shared.weight";
type R<T = ()> = Result<T, FsdpError>;

/// The module tree (a Linear's weight is `[out, in]`).
pub(crate) fn tree() -> Module {
    let lin = |n: &str, ty: &str, r, c| Module::new(n, ty).with_param("weight", vec![r, c]);
    let body = Module::new("body", "Body")
        .with_child(lin("body.shared", "Linear", H, H))
        .with_child(lin("body.enc", "Enc", H, D).with_param("bias", vec![H]))
        .with_child(lin("body.dec", "Dec", D, H).with_param("bias", vec![H]));
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

/// Initial values: normal with std `1/√(last dim)`.
pub(crate) fn init_params(tree: &Module) -> HashMap<String, Vec<f32>> {
    let mut out = HashMap::new();
    for p in tree.named_parameters() {
        let std = 1.0 / (p.shape[p.shape.len() - 1] as f64).sqrt();
        let init = Init::Normal { mean: 0.0, std };
        let value = materialize(&p.name, &p.shape, &init, 7).unwrap();
        out.insert(p.name, value);
    }
    out
}

/// Inputs `x` `[n, I]` and targets `y` `[n, O]`, row-major.
pub(crate) struct Batch {
    pub(crate) x: Vec<f32>,
    pub(crate) y: Vec<f32>,
}

/// Rank `rank`'s slice of a `global`-example batch split evenly over `world` ranks (the
/// generator is counter-based: the same examples whatever the split).
pub(crate) fn batch(global: usize, rank: usize, world: usize) -> Batch {
    let (n, first, (low, high)) = (global / world, rank * (global / world), (-1.0, 1.0));
    let data = |name: &str, w: usize| {
        let mut v = vec![0.0; n * w];
        let fill = Init::Uniform { low, high }.fill(3, name, (first * w) as u64, &mut v);
        fill.map(|()| v).unwrap()
    };
    Batch {
        x: data("x", I),
        y: data("y", O),
    }
}

/// Each row of `x` times `W` (`[r, c]`), or times `Wᵀ` if `t`.
fn mm(x: &[f32], w: &[f32], r: usize, t: bool) -> Vec<f32> {
    let c = w.len() / r;
    let (n_in, n_out) = if t { (r, c) } else { (c, r) };
    let mut out = vec![0.0; x.len() / n_in * n_out];
    for (x, o) in x.chunks(n_in).zip(out.chunks_mut(n_out)) {
        for (i, j) in (0..r).flat_map(|i| (0..c).map(move |j| (i, j))) {
            let (to, from) = if t { (j, i) } else { (i, j) };
            o[to] += w[i * c + j] * x[from];
        }
    }
    out
}

/// `gw += Σ_rows g ⊗ x` (`gw` is `[r, c]`); for a bias (`c = 1`, `x` empty) `gw += Σ_rows g`.
fn acc(gw: &mut [f32], g: &[f32], x: &[f32], r: usize) {
    let c = gw.len() / r;
    for (k, g) in g.chunks(r).enumerate() {
        for (i, j) in (0..r).flat_map(|i| (0..c).map(move |j| (i, j))) {
            gw[i * c + j] += g[i] * x.get(k * c + j).unwrap_or(&1.0);
        }
    }
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

/// Activations `h0, a1, h1, a2, h2, y`, the loss, and the gradient flowing back (`g`).
#[derive(Default)]
pub(crate) struct Tape {
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
            0 => h[0] = tanh(linear(p, "inp", &b.x)?),
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
                let res: Vec<f32> = h[5].iter().zip(&b.y).map(|(y, y0)| y - y0).collect();
                let n = self.global as f32;
                t.loss = res.iter().map(|r| r * r / n).sum();
                t.g = res.iter().map(|r| 2.0 * r / n).collect(); // dy
            }
        }
        Ok(())
    }

    fn loss(&self, t: &Tape) -> R<f32> {
        Ok(t.loss)
    }

    fn backward(&self, s: usize, p: &dyn Params, g: &mut dyn Grads, b: &Batch, t: &mut Tape) -> R {
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
            _ => linear_back(p, g, "inp", &dtanh(&t.g, &h[0]), &b.x)?,
        };
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (tree, global, world) = (tree(), 12, 2);
    for u in plan_units(&tree, &wrap())?.units {
        let names: Vec<&str> = u.params.iter().map(|p| p.name.as_str()).collect();
        println!("unit {:?}: {} elements {names:?}", u.name, u.numel());
    }
    let (init, model) = (init_params(&tree), TiedMlp { global });
    let ranks = ring::run_ranks(world, ring::RingOptions::default(), |comm| -> R {
        let batch = batch(global, comm.rank(), world);
        let config = FsdpConfig::new(ShardingStrategy::FullShard);
        let opt = AdamWConfig {
            lr: 1e-2,
            ..AdamWConfig::default()
        };
        let init = ParamInit::Full(&init);
        let mut fsdp = Fsdp::from_module(Box::new(comm), &tree, &wrap(), init, config, opt)?;
        for step in 0..6 {
            let loss = fsdp.step(&model, &batch)?;
            if fsdp.rank() == 0 {
                println!("step {step}: loss {loss:.6}");
            }
        }
        Ok(())
    })?;
    Ok(ranks.into_iter().collect::<R>()?)
}
