//! Helpers shared by the tests that train the tiny GPT with FSDP against a reference
//! (`equivalence.rs`, `accumulation.rs`, `activation_checkpointing.rs`): the set-up (model,
//! corpus, initial parameters), the ring options, rank 0's run on a [`Place`], one rank's engine, the reference's optimizer
//! step on whole tensors, and the comparison of final parameters with the key-bias rule.

use std::collections::HashMap;
use std::time::Duration;

use fsdp::engine::ComputeDevice;
use fsdp::optim::OptimizerConfig;
use fsdp::units::UnitPlan;
use fsdp_collectives::cuda_ring::{self, CudaRingOptions};
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::synthetic_corpus;
use fsdp_gpt::model::{init_params, named_params, GptConfig};
use fsdp_gpt::runtime::{FsdpConfig, FsdpGpt};

/// A tiny GPT (2 heads, `E = 32`, block size 16, vocabulary 96), a synthetic corpus, the
/// initial parameters and the optimizer.
pub struct Setup<O> {
    pub cfg: GptConfig,
    pub tokens: Vec<u16>,
    pub init: HashMap<String, Vec<f32>>,
    pub opt: O,
}

impl<O: Copy + Into<OptimizerConfig>> Setup<O> {
    /// `n_layer` blocks, 20 000 tokens from `corpus_seed`, parameters from `init_seed`.
    pub fn new(n_layer: usize, corpus_seed: u64, init_seed: u64, opt: O) -> Self {
        let cfg = GptConfig::new(n_layer, 2, 32, 16, 96).unwrap();
        Setup {
            cfg,
            tokens: synthetic_corpus(20_000, 96, corpus_seed),
            init: named_params(&cfg, init_params(&cfg, init_seed)).unwrap(),
            opt,
        }
    }

    /// The engine of the rank of `comm` with `config`, from the full initial parameters.
    pub fn engine<C: Communicator + 'static>(
        &self,
        comm: C,
        plan: &UnitPlan,
        config: FsdpConfig,
    ) -> FsdpGpt {
        FsdpGpt::new(Box::new(comm), self.cfg, plan, &self.init, config, self.opt).unwrap()
    }
}

/// The ring engine's options with a 60 s timeout (generous for a loaded machine).
pub fn ring_options() -> ring::RingOptions {
    ring::RingOptions::default().with_timeout(Duration::from_secs(60))
}

/// Where a run's unsharded parameters live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// The host engine: host memory, no device.
    Host,
    /// The host twin of a device, a millisecond of latency per operation.
    HostTwin,
    /// GPU 0, the ranks over the CUDA ring.
    Gpu,
}

/// Rank 0's result of `world` ranks as threads, each running `body` with its communicator
/// and its device in `place`: the ring's threads without a device (`Host`) or each on its
/// own host twin (`HostTwin`), or the CUDA ring's threads each on `ComputeDevice::cuda(0)`
/// (`Gpu`).
pub fn rank0_on<R: Send>(
    place: Place,
    world: usize,
    body: impl Fn(Box<dyn Communicator>, Option<ComputeDevice>) -> R + Sync,
) -> R {
    let mut out = if place == Place::Gpu {
        let opts = CudaRingOptions::default().with_timeout(Duration::from_secs(120));
        cuda_ring::run_ranks(0, world, opts, |comm| {
            let dev = ComputeDevice::cuda(0, Default::default()).unwrap();
            body(Box::new(comm), Some(dev))
        })
        .unwrap()
    } else {
        ring::run_ranks(world, ring_options(), |comm| {
            let dev = (place == Place::HostTwin).then(|| {
                let latency = Duration::from_millis(1);
                ComputeDevice::host_twin_with_latency(1 << 28, Default::default(), latency).unwrap()
            });
            body(Box::new(comm), dev)
        })
        .unwrap()
    };
    out.swap_remove(0)
}

/// One optimizer step of every parameter on whole tensors, each with its own state in `states`:
/// `step(state, param, grad)`.
pub fn step_each<S>(
    params: &mut HashMap<String, Vec<f32>>,
    states: &mut HashMap<String, S>,
    grads: &HashMap<String, Vec<f32>>,
    step: impl Fn(&mut S, &mut [f32], &[f32]),
) {
    for (name, p) in params.iter_mut() {
        step(states.get_mut(name).unwrap(), p, &grads[name]);
    }
}

/// Checks `got` against `want`, parameter by parameter: the same names, every tensor within
/// 1e-4 of `want`'s largest magnitude. The key third of each `attn.c_attn.bias` (`e` is the
/// embedding width) is the exception: its gradient is zero in exact arithmetic (the softmax
/// ignores a constant added to a row of scores), so its values are rounding noise that AdamW
/// amplifies; they must stay below 1e-5 in both and are left out of the comparison.
pub fn assert_params_close(
    what: &str,
    e: usize,
    got: &HashMap<String, Vec<f32>>,
    want: &HashMap<String, Vec<f32>>,
) {
    assert_eq!(got.len(), want.len(), "{what}: parameter count");
    for (name, want) in want {
        let got = &got[name];
        let key_bias = name.ends_with("attn.c_attn.bias");
        if key_bias {
            for v in [got, want] {
                let noise = v[e..2 * e].iter().fold(0f32, |m, x| m.max(x.abs()));
                assert!(noise < 1e-5, "{what}: `{name}` key bias {noise:e}");
            }
        }
        let keep = |i: &usize| !(key_bias && (e..2 * e).contains(i));
        let scale = (0..want.len())
            .filter(keep)
            .fold(0f32, |m, i| m.max(want[i].abs()));
        let err = (0..want.len())
            .filter(keep)
            .fold(0f32, |m, i| m.max((got[i] - want[i]).abs()));
        assert!(
            err <= 1e-4 * scale,
            "{what}: `{name}` max error {err:e} (scale {scale:e})"
        );
    }
}
