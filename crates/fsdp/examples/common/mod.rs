//! What the examples share: seeded initial values, the batch generator, two row-major matrix
//! products and the training driver of their `main`. Each example includes this file with
//! `#[path = "common/mod.rs"] mod common;` (so does `tests/generic_models.rs`, through the
//! examples it includes); cargo does not build it as an example of its own.

use std::collections::HashMap;

use fsdp::engine::{Fsdp, FsdpConfig, FsdpModel, ParamInit};
use fsdp::init::{materialize, Init};
use fsdp::optim::AdamWConfig;
use fsdp::units::UnitPlan;
use fsdp::wrap::Module;
use fsdp::FsdpError;
use fsdp_collectives::{ring, Communicator};

pub(crate) type R<T = ()> = Result<T, FsdpError>;

/// Initial values drawn with `seed`: normal with std `1/√(last dim)` and mean `mean(name)`.
pub(crate) fn init_params(
    tree: &Module,
    seed: u64,
    mean: fn(&str) -> f64,
) -> HashMap<String, Vec<f32>> {
    let mut out = HashMap::new();
    for p in tree.named_parameters() {
        let (mean, std) = (
            mean(&p.name),
            1.0 / (p.shape[p.shape.len() - 1] as f64).sqrt(),
        );
        let value = materialize(&p.name, &p.shape, &Init::Normal { mean, std }, seed).unwrap();
        out.insert(p.name, value);
    }
    out
}

/// Inputs `x` `[n, i]` and targets `y` `[n, o]`, row-major.
pub(crate) struct Batch {
    pub(crate) x: Vec<f32>,
    pub(crate) y: Vec<f32>,
}

/// Rank `rank`'s slice of a `global`-example batch split evenly over `world` ranks: inputs `i`
/// and targets `o` wide, uniform in `[-1, 1)` drawn with `seed` (the generator is
/// counter-based: the same examples whatever the split).
pub(crate) fn batch(
    seed: u64,
    (i, o): (usize, usize),
    global: usize,
    rank: usize,
    world: usize,
) -> Batch {
    let (n, first, (low, high)) = (global / world, rank * (global / world), (-1.0, 1.0));
    let data = |name: &str, w: usize| {
        let mut v = vec![0.0; n * w];
        let fill = Init::Uniform { low, high }.fill(seed, name, (first * w) as u64, &mut v);
        fill.map(|()| v).unwrap()
    };
    Batch {
        x: data("x", i),
        y: data("y", o),
    }
}

/// Each row of `x` times `W` (`[r, c]`), or times `Wᵀ` if `t`.
pub(crate) fn mm(x: &[f32], w: &[f32], r: usize, t: bool) -> Vec<f32> {
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
pub(crate) fn acc(gw: &mut [f32], g: &[f32], x: &[f32], r: usize) {
    let c = gw.len() / r;
    for (k, g) in g.chunks(r).enumerate() {
        for (i, j) in (0..r).flat_map(|i| (0..c).map(move |j| (i, j))) {
            gw[i * c + j] += g[i] * x.get(k * c + j).unwrap_or(&1.0);
        }
    }
}

/// Train `model` on `world` ranks (threads) with `config`: the units of `plan` from `init`,
/// AdamW (lr 1e-2), 6 steps, each rank on its slice `batch(rank)` of the global batch. Rank 0
/// prints the losses; `report` then runs on every rank's engine.
pub(crate) fn train<M: FsdpModel + Sync>(
    model: &M,
    plan: &UnitPlan,
    init: &HashMap<String, Vec<f32>>,
    batch: impl Fn(usize) -> M::Batch + Sync,
    world: usize,
    config: FsdpConfig,
    report: impl Fn(&Fsdp) + Sync,
) -> Result<(), Box<dyn std::error::Error>>
where
    M::Batch: Sized,
{
    let ranks = ring::run_ranks(world, ring::RingOptions::default(), |comm| -> R {
        let batch = batch(comm.rank());
        let opt = AdamWConfig {
            lr: 1e-2,
            ..AdamWConfig::default()
        };
        let init = ParamInit::Full(init);
        let mut fsdp = Fsdp::new(Box::new(comm), plan, init, config, opt)?;
        for step in 0..6 {
            let loss = fsdp.step(model, &batch)?;
            if fsdp.rank() == 0 {
                println!("step {step}: loss {loss:.6}");
            }
        }
        report(&fsdp);
        Ok(())
    })?;
    Ok(ranks.into_iter().collect::<R>()?)
}
