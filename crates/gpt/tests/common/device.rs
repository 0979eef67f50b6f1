//! The device trainer's tests' shared run: the tiny GPT (2 layers, 2 heads, 32 wide, 16
//! tokens, a vocabulary of 64), 8 rows a step, AdamW lr 3e-3, betas (0.9, 0.95), eps 1e-8,
//! weight decay 0.1.

use std::collections::HashMap;

use fsdp::optim::{decay_2d_only as decay_groups, decay_2d_only_group, AdamWConfig, LrSchedule};
use fsdp::wrap::{plan_units, WrapOptions, WrapPolicy};
use fsdp::ParamInit;
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::get_batch;
use fsdp_gpt::device_train::DeviceTrainConfig;
use fsdp_gpt::init::gpt2_init;
use fsdp_gpt::model::GptConfig;
use fsdp_gpt::runtime::{FsdpConfig, FsdpGpt, ShardingStrategy};
use fsdp_gpt::tree::gpt_module_tree;

/// The shared run with `schedule`, nanoGPT's groups when `decay_2d_only`, clipping at `clip`
/// and `accum` micro-batches a step; no offload, no checkpointing.
pub fn device_config(
    schedule: LrSchedule,
    decay_2d_only: bool,
    clip: Option<f64>,
    accum: usize,
) -> DeviceTrainConfig {
    DeviceTrainConfig {
        cfg: GptConfig::new(2, 2, 32, 16, 64).unwrap(),
        adamw: AdamWConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        schedule,
        decay_2d_only,
        grad_clip: clip,
        batch_size: 8,
        grad_accum: accum,
        offload: false,
        activation_checkpointing: false,
    }
}

/// Every parameter's bits, sorted by name (for bitwise comparisons).
pub fn param_bits(p: HashMap<String, Vec<f32>>) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<_> = p
        .into_iter()
        .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    v.sort();
    v
}

/// (loss, gradient norm before clipping) of the first `steps` steps of the engine at `world`
/// ranks (threads of the ring) with `strategy`, from the seeded weights of `seed`, each rank
/// taking its rows of every micro-batch as `fsdp train` does (rank 0's view: every rank's is
/// the same).
pub fn engine_run(
    c: &DeviceTrainConfig,
    tokens: &[u16],
    world: usize,
    strategy: ShardingStrategy,
    steps: usize,
    seed: u64,
) -> Vec<(f32, f64)> {
    let cfg = c.cfg;
    let plan = plan_units(
        &gpt_module_tree(&cfg),
        &WrapOptions::new(WrapPolicy::module_type(["Block"])),
    )
    .unwrap();
    let (accum, t) = (c.grad_accum, cfg.block_size);
    let micro = c.batch_size / accum;
    let global_tokens = c.batch_size * t;
    let mut out = ring::run_ranks(world, ring::RingOptions::default(), |comm| {
        let rank = comm.rank();
        let rule = gpt2_init(cfg.n_layer);
        let init = ParamInit::Seeded { seed, rule: &rule };
        let config = FsdpConfig::new(strategy);
        let mut model =
            FsdpGpt::with_init(Box::new(comm), cfg, &plan, init, config, c.adamw).unwrap();
        model.set_lr_schedule(c.schedule).unwrap();
        if c.decay_2d_only {
            model
                .set_param_groups(decay_groups(c.adamw.weight_decay), |_, shape| {
                    decay_2d_only_group(shape)
                })
                .unwrap();
        }
        let mut v = Vec::new();
        for step in 0..steps {
            let mut loss = 0.0f32;
            for m in 0..accum {
                let k = (step * accum + m) as u64;
                let b = get_batch(tokens, k, micro, t, rank, world).unwrap();
                loss += if m + 1 < accum {
                    model
                        .no_sync(|f| f.forward_backward(&b, global_tokens))
                        .unwrap()
                } else {
                    model.forward_backward(&b, global_tokens).unwrap()
                };
            }
            let norm = match c.grad_clip {
                Some(max) => model.clip_grad_norm(max).unwrap(),
                None => model.grad_norm().unwrap(),
            };
            model.optimizer_step().unwrap();
            v.push((loss, norm));
        }
        v
    })
    .unwrap();
    out.swap_remove(0)
}
