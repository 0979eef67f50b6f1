//! Activation checkpointing of the GPT's blocks in the engine, and the activation memory it
//! saves, measured by the engine and predicted by the plan:
//!
//! - (a) losses and final parameters are bitwise the same with and without checkpointing, for
//!   every strategy at worlds 1–3 (and hybrid over 2×2, and with prefetching variants);
//! - (b) the schedule (every all-gather, free, reduce-scatter and all-reduce, in order, with
//!   its prefetch flag and in-flight count) is the same with and without: recomputation adds no
//!   all-gather;
//! - (c) the peak of the blocks' saved activations with every block checkpointed is at most
//!   `1/L + I/C` of the peak without (L blocks; `C` one block's saved activations, `I` its
//!   input), for L = 4 and 6, measured through the engine's activation statistics with a model
//!   that reports only the blocks' bytes (the head's logits are not blocks' activations);
//! - (d) the plan's activation peak and allocated-plus-activations peak equal the measured ones
//!   byte for byte (and the closed form), with and without checkpointing, with gradient
//!   accumulation too;
//! - (e) `fsdp train --activation-checkpointing` writes the same loss log as without.

mod common;

use std::collections::HashMap;

use fsdp::engine::{ActivationStats, ScheduleEvent, Span};
use fsdp::optim::AdamWConfig;
use fsdp::{FsdpError, FsdpModel, Grads, Params};
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::{get_batch, Batch};
use fsdp_gpt::plan::{peak_activation_bytes, plan_accumulated};
use fsdp_gpt::runtime::{BackwardPrefetch, FsdpConfig, GptModel, GptTape, ShardingStrategy};
use fsdp_gpt::tree::gpt_block_plan;

use common::cli::{fsdp, loss_log_rows, ok, s, scratch, small_train_args, TWO_RANKS};
use common::training::{self, ring_options};

const SEQ: usize = 16;
const ROWS_PER_RANK: usize = 2;

type Setup = training::Setup<AdamWConfig>;

fn setup(n_layer: usize) -> Setup {
    Setup::new(n_layer, 7, 3, common::adamw())
}

/// What one rank saw.
struct RankRun {
    losses: Vec<u32>,
    params: HashMap<String, Vec<u32>>,
    schedule: Vec<ScheduleEvent>,
    activations: ActivationStats,
    peak_allocated: u64,
}

/// `steps` optimizer steps of `micro` micro-batches (under `no_sync` but the last) on `world`
/// ranks, every unit checkpointed or none.
fn train(
    s: &Setup,
    world: usize,
    config: FsdpConfig,
    checkpointing: bool,
    steps: u64,
    micro: u64,
) -> Vec<RankRun> {
    let plan = gpt_block_plan(&s.cfg);
    let rows = ROWS_PER_RANK * world;
    ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let config = FsdpConfig {
            activation_checkpointing: checkpointing,
            ..config
        };
        let mut f = s.engine(comm, &plan, config);
        let mut losses = Vec::new();
        for step in 0..steps {
            let mut loss = 0.0f32;
            for m in 0..micro {
                let b = get_batch(&s.tokens, step * micro + m, rows, SEQ, rank, world).unwrap();
                let global = rows * SEQ * micro as usize;
                loss += if m + 1 < micro {
                    f.no_sync(|f| f.forward_backward(&b, global)).unwrap()
                } else {
                    f.forward_backward(&b, global).unwrap()
                };
            }
            f.optimizer_step().unwrap();
            losses.push(loss.to_bits());
        }
        let params = f
            .full_params()
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
            .collect();
        RankRun {
            losses,
            params,
            schedule: f.schedule().to_vec(),
            activations: f.activation_stats(),
            peak_allocated: f.memory_stats().allocated_bytes.all.peak,
        }
    })
    .unwrap()
}

fn configs() -> Vec<(usize, FsdpConfig)> {
    let mut v = Vec::new();
    for world in 1..=3 {
        for strategy in ShardingStrategy::ALL {
            v.push((world, FsdpConfig::new(strategy)));
        }
    }
    v.push((
        4,
        FsdpConfig {
            ranks_per_node: Some(2),
            ..FsdpConfig::new(ShardingStrategy::HybridShard)
        },
    ));
    v.push((
        4,
        FsdpConfig {
            ranks_per_node: Some(2),
            ..FsdpConfig::new(ShardingStrategy::HybridShardZero2)
        },
    ));
    v.push((
        3,
        FsdpConfig {
            forward_prefetch: true,
            backward_prefetch: BackwardPrefetch::Post,
            ..FsdpConfig::new(ShardingStrategy::FullShard)
        },
    ));
    v.push((
        2,
        FsdpConfig {
            limit_all_gathers: None,
            backward_prefetch: BackwardPrefetch::None,
            ..FsdpConfig::new(ShardingStrategy::ShardGradOp)
        },
    ));
    v
}

/// (a) and (b): bitwise the same losses and parameters, the same schedule.
#[test]
fn checkpointing_changes_neither_results_nor_schedule() {
    let s = setup(3);
    let blocks = s.cfg.n_layer as u64;
    for (world, config) in configs() {
        let what = format!("{:?} at world {world}", config.strategy);
        let plain = train(&s, world, config, false, 3, 1);
        let ckpt = train(&s, world, config, true, 3, 1);
        for (rank, (p, c)) in plain.iter().zip(&ckpt).enumerate() {
            assert_eq!(p.losses, c.losses, "{what} rank {rank}: losses");
            assert_eq!(p.params, c.params, "{what} rank {rank}: parameters");
            assert_eq!(p.schedule, c.schedule, "{what} rank {rank}: schedule");
            assert_eq!(p.activations.recomputations, 0);
            assert_eq!(c.activations.recomputations, 3 * blocks, "{what}");
            // The allocator's figures are untouched; activations are lower.
            assert_eq!(p.peak_allocated, c.peak_allocated, "{what}");
            assert!(c.activations.peak < p.activations.peak, "{what}");
        }
        let gathers = plain[0]
            .schedule
            .iter()
            .filter(|e| e.kind == fsdp_gpt::runtime::ScheduleKind::AllGather)
            .count();
        println!(
            "{what}: bitwise equal over 3 steps, {gathers} all-gathers on rank 0 with and \
             without; activations peak {} -> {} bytes",
            plain[0].activations.peak, ckpt[0].activations.peak
        );
    }
}

/// The GPT counting only its blocks' saved activations (their caches, or their inputs when
/// checkpointed): the head's and the hand-offs between spans are left out.
struct BlocksOnly(GptModel);

impl FsdpModel for BlocksOnly {
    type Batch = Batch;
    type Tape = GptTape;
    fn spans(&self) -> Vec<Span> {
        self.0.spans()
    }
    fn forward(
        &self,
        s: usize,
        p: &dyn Params,
        b: &Batch,
        t: &mut GptTape,
    ) -> Result<(), FsdpError> {
        self.0.forward(s, p, b, t)
    }
    fn loss(&self, t: &GptTape) -> Result<f32, FsdpError> {
        self.0.loss(t)
    }
    fn backward(
        &self,
        s: usize,
        p: &dyn Params,
        g: &mut dyn Grads,
        b: &Batch,
        t: &mut GptTape,
    ) -> Result<(), FsdpError> {
        self.0.backward(s, p, g, b, t)
    }
    fn checkpointable(&self, s: usize) -> bool {
        self.0.checkpointable(s)
    }
    fn discard_saved(&self, s: usize, t: &mut GptTape) -> Result<(), FsdpError> {
        self.0.discard_saved(s, t)
    }
    fn recompute(
        &self,
        s: usize,
        p: &dyn Params,
        b: &Batch,
        t: &mut GptTape,
    ) -> Result<(), FsdpError> {
        self.0.recompute(s, p, b, t)
    }
    fn tape_bytes(&self, t: &GptTape) -> u64 {
        t.block_bytes()
    }
}

/// The peak of the blocks' saved activations and of the whole tape over one step on world 2.
fn blocks_peak(s: &Setup, checkpointing: bool) -> (u64, u64) {
    let plan = gpt_block_plan(&s.cfg);
    let world = 2;
    let rows = ROWS_PER_RANK * world;
    let peaks = ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let config = FsdpConfig::new(ShardingStrategy::FullShard);
        let mut f = s.engine(comm, &plan, config);
        if checkpointing {
            // Every unit (the blocks; the root's spans, the embedding and the head, cannot be).
            let n = f.num_units();
            f.set_activation_checkpointing(0..n).unwrap();
        }
        let b = get_batch(&s.tokens, 0, rows, SEQ, rank, world).unwrap();
        let model = GptModel::new(s.cfg, rows * SEQ).unwrap();
        f.engine().forward_backward(&BlocksOnly(model), &b).unwrap();
        let blocks = f.activation_stats().peak;
        f.reset_peak_memory_stats();
        f.engine().forward_backward(&model, &b).unwrap();
        (blocks, f.activation_stats().peak)
    })
    .unwrap();
    assert!(peaks.iter().all(|p| *p == peaks[0]));
    peaks[0]
}

/// (c): the blocks' activations with every block checkpointed are at most `1/L + I/C` of those
/// without.
#[test]
fn checkpointing_every_block_keeps_one_block_and_the_inputs() {
    for n_layer in [4, 6] {
        let s = setup(n_layer);
        let (without, tape_without) = blocks_peak(&s, false);
        let (with, tape_with) = blocks_peak(&s, true);
        let l = n_layer as f64;
        // One block's saved activations C and input I, per rank (2 rows of 16 tokens).
        let c = without as f64 / l;
        let input = (ROWS_PER_RANK * SEQ * s.cfg.n_embd * 4) as f64;
        let ratio = with as f64 / without as f64;
        let bound = 1.0 / l + input / c;
        println!(
            "L = {n_layer}: blocks' saved activations peak {without} B without, {with} B with \
             checkpointing (ratio {ratio:.4} <= 1/L + I/C = {bound:.4}); whole tape (head's \
             logits included) {tape_without} B -> {tape_with} B"
        );
        assert_eq!(without as f64, l * c);
        // Measured exactly: the inputs of L-1 blocks plus one block's recomputed activations.
        assert_eq!(with as f64, (l - 1.0) * input + c);
        assert!(ratio <= bound, "{ratio} > {bound}");
        assert!(tape_with < tape_without);
    }
}

/// (d): the plan predicts the activation figures byte for byte.
#[test]
fn plan_predicts_activation_memory_exactly() {
    let s = setup(3);
    let cases = [
        (2, FsdpConfig::new(ShardingStrategy::FullShard), 1),
        (3, FsdpConfig::new(ShardingStrategy::ShardGradOp), 1),
        (2, FsdpConfig::new(ShardingStrategy::NoShard), 2),
        (
            4,
            FsdpConfig {
                ranks_per_node: Some(2),
                ..FsdpConfig::new(ShardingStrategy::HybridShard)
            },
            1,
        ),
        (
            2,
            FsdpConfig {
                forward_prefetch: true,
                ..FsdpConfig::new(ShardingStrategy::FullShard)
            },
            3,
        ),
        (1, FsdpConfig::new(ShardingStrategy::HybridShardZero2), 1),
    ];
    for (world, config, micro) in cases {
        for checkpointing in [false, true] {
            let what = format!(
                "{:?} at world {world}, {micro} micro-batches, checkpointing {checkpointing}",
                config.strategy
            );
            let config = FsdpConfig {
                activation_checkpointing: checkpointing,
                ..config
            };
            let units = gpt_block_plan(&s.cfg);
            let p = plan_accumulated(
                &s.cfg,
                world,
                &config,
                &units,
                ROWS_PER_RANK,
                SEQ,
                micro as usize,
            )
            .unwrap();
            let runs = train(&s, world, config, checkpointing, 2, micro);
            let closed = peak_activation_bytes(&s.cfg, ROWS_PER_RANK, SEQ, checkpointing).unwrap();
            for (rank, r) in runs.iter().enumerate() {
                let m = &p.per_rank[rank];
                assert_eq!(m.activations, r.activations.peak, "{what}: rank {rank}");
                assert_eq!(
                    m.peak_allocated_with_activations, r.activations.peak_allocated,
                    "{what}: rank {rank}"
                );
                assert_eq!(m.peak_allocated, r.peak_allocated, "{what}: rank {rank}");
                assert_eq!(r.activations.current, 0);
            }
            assert_eq!(p.per_rank[0].activations, closed, "{what}: closed form");
            let expected = if checkpointing { s.cfg.n_layer } else { 0 };
            assert_eq!(p.recomputed_spans, expected, "{what}");
            println!(
                "{what}: activations {} B, allocated + activations {} B (allocator {} B): \
                 planned = measured",
                p.per_rank[0].activations,
                p.per_rank[0].peak_allocated_with_activations,
                p.per_rank[0].peak_allocated
            );
        }
    }
}

/// The per-unit setting: checkpointing only some blocks recomputes only those, and the
/// engine refuses an unknown unit.
#[test]
fn per_unit_checkpointing() {
    let s = setup(3);
    let plan = gpt_block_plan(&s.cfg);
    let out = ring::run_ranks(2, ring_options(), |comm| {
        let rank = comm.rank();
        let config = FsdpConfig::new(ShardingStrategy::FullShard);
        let mut f = s.engine(comm, &plan, config);
        assert!(f.activation_checkpointed_units().is_empty());
        let n = f.num_units();
        assert!(f.set_activation_checkpointing([n]).is_err());
        // Units 1 and 3: blocks 0 and 2 (unit 0 is the root).
        f.set_activation_checkpointing([1, 3]).unwrap();
        assert_eq!(f.activation_checkpointed_units(), vec![1, 3]);
        let b = get_batch(&s.tokens, 0, 4, SEQ, rank, 2).unwrap();
        let loss = f.step(&b, 4 * SEQ).unwrap();
        let recomputed = f.activation_stats().recomputations;
        f.set_activation_checkpointing([]).unwrap();
        f.step(&b, 4 * SEQ).unwrap();
        (loss, recomputed, f.activation_stats().recomputations)
    })
    .unwrap();
    for (_, recomputed, after) in out {
        assert_eq!(recomputed, 2);
        assert_eq!(after, 2);
    }
}

/// (e): the program's loss log is the same with `--activation-checkpointing`.
#[test]
fn cli_loss_log_is_the_same_with_activation_checkpointing() {
    let dir = scratch("activation_checkpointing", "cli");
    let run = |extra: &[&str], name: &str| {
        let log = dir.join(name);
        let mut args = vec!["--steps", "4", "--loss-log", s(&log)];
        args.extend_from_slice(extra);
        let out = fsdp(&small_train_args(&TWO_RANKS, &args));
        let stdout = ok(&out, name);
        (std::fs::read_to_string(&log).unwrap(), stdout)
    };
    let (plain, _) = run(&[], "plain.csv");
    let (ckpt, stdout) = run(&["--activation-checkpointing"], "ckpt.csv");
    println!("{stdout}");
    assert!(stdout.contains("activation checkpointing"), "{stdout}");
    let rows = |t: &str| -> Vec<(String, String, String)> {
        loss_log_rows(t)
            .into_iter()
            .map(|f| (f[0].to_string(), f[1].to_string(), f[3].to_string()))
            .collect()
    };
    // Step, loss and the allocator's peak; the throughput column is timing.
    assert_eq!(rows(&plain), rows(&ckpt));
    assert_eq!(rows(&plain).len(), 4);
    // The plan shows the activation memory and the recomputation.
    let out = fsdp(&["plan", "--n-layer", "2", "--activation-checkpointing"]);
    let plan = ok(&out, "plan");
    assert!(
        plan.contains("with activation checkpointing (2 spans recomputed per pass"),
        "{plan}"
    );
}
