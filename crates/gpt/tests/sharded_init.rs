//! Sharded construction of the reference GPT ([`ParamInit`]): the seeded initialisation gives
//! bitwise the same model at every world size and strategy, and trains; construction allocates
//! only the shards (and trains under a per-rank capacity below the full model); rank 0's model
//! is broadcast unit by unit (`sync_module_states`); a full safetensors checkpoint (F32 or BF16)
//! streams straight into the shards. Ranks are threads (the ring backend).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fsdp::init::materialize;
use fsdp::{Fsdp, FsdpError, ParamInit};
use fsdp_allocator::round_size;
use fsdp_collectives::ring::{self, RingOptions};
use fsdp_collectives::Communicator;
use fsdp_gpt::checkpoint::save_full;
use fsdp_gpt::data::{get_batch, synthetic_corpus};
use fsdp_gpt::init::gpt2_init;
use fsdp_gpt::model::{init_params, named_params, param_specs, GptConfig};
use fsdp_gpt::runtime::{FsdpConfig, FsdpGpt, ShardingStrategy};
use fsdp_gpt::tree::gpt_block_plan;

use ShardingStrategy::{FullShard, HybridShard, NoShard, ShardGradOp};

type Params = HashMap<String, Vec<f32>>;

/// A small GPT whose sizes (E = 16, vocabulary 50, block size 8) are not multiples of 3, so
/// that the shards of world 3 are padded.
fn small() -> GptConfig {
    GptConfig::new(2, 2, 16, 8, 50).unwrap()
}

fn opts() -> RingOptions {
    RingOptions::default().with_timeout(Duration::from_secs(60))
}

fn config(strategy: ShardingStrategy, world: usize) -> FsdpConfig {
    let mut c = FsdpConfig::new(strategy);
    if strategy.is_hybrid() {
        // 2 × 2: shard over the 2 ranks of a "node", replicate across the 2 nodes.
        c.ranks_per_node = Some(world / 2);
    }
    c
}

/// Bytes of one allocator block of `numel` f32.
fn block_bytes(numel: usize) -> u64 {
    round_size(numel * 4).unwrap() as u64
}

/// What the engine's construction allocates when nothing else is needed: the parameter shard
/// and the gradient shard of every unit, each one allocator block.
fn shards_bytes(f: &Fsdp) -> u64 {
    (0..f.num_units())
        .map(|u| 2 * block_bytes(f.layout(u).unwrap().shard_numel()))
        .sum()
}

/// One unit's unsharded (padded) flat parameter, the largest of the model, as one block.
fn largest_unit_bytes(f: &Fsdp) -> u64 {
    (0..f.num_units())
        .map(|u| block_bytes(f.layout(u).unwrap().padded_numel()))
        .max()
        .unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `actual` holds exactly the tensors of `expected`, bitwise.
fn assert_bitwise(actual: &Params, expected: &Params, what: &str) {
    let mut a: Vec<_> = actual.keys().collect();
    let mut e: Vec<_> = expected.keys().collect();
    a.sort();
    e.sort();
    assert_eq!(a, e, "{what}: tensor names");
    for (name, v) in expected {
        assert!(
            bits(&actual[name]) == bits(v),
            "{what}: tensor `{name}` differs"
        );
    }
}

/// What one rank reports after construction.
struct Built {
    /// `allocated_bytes.all.peak` right after construction.
    peak: u64,
    /// [`shards_bytes`].
    shards: u64,
    /// [`largest_unit_bytes`].
    unit: u64,
    /// The full state dict.
    params: Params,
}

fn built(f: &FsdpGpt) -> Built {
    let peak = f.memory_stats().allocated_bytes.all.peak;
    Built {
        peak,
        shards: shards_bytes(f),
        unit: largest_unit_bytes(f),
        params: f.full_params().unwrap(),
    }
}

/// Construct at `world` with `strategy`, each rank's init from `init(rank)`.
fn build<'a>(
    cfg: GptConfig,
    world: usize,
    strategy: ShardingStrategy,
    init: impl Fn(usize) -> ParamInit<'a> + Sync,
) -> Vec<Built> {
    let plan = gpt_block_plan(&cfg);
    ring::run_ranks(world, opts(), |comm| {
        let rank = comm.rank();
        let f = FsdpGpt::with_init(
            Box::new(comm),
            cfg,
            &plan,
            init(rank),
            config(strategy, world),
            common::adamw(),
        )
        .unwrap();
        built(&f)
    })
    .unwrap()
}

/// Train `steps` steps (global batch 4 × 8) from `init`; every rank's losses.
fn train<'a>(
    cfg: GptConfig,
    world: usize,
    strategy: ShardingStrategy,
    capacity: Option<usize>,
    steps: u64,
    init: impl Fn(usize) -> ParamInit<'a> + Sync,
) -> Result<Vec<(Vec<f32>, u64)>, FsdpError> {
    let plan = gpt_block_plan(&cfg);
    let tokens = synthetic_corpus(4_000, cfg.vocab_size as u16, 1);
    let (batch, seq) = (4, cfg.block_size);
    ring::run_ranks(world, opts(), |comm| {
        let rank = comm.rank();
        let mut c = config(strategy, world);
        if let Some(cap) = capacity {
            c.memory_capacity = cap;
        }
        let mut f = FsdpGpt::with_init(Box::new(comm), cfg, &plan, init(rank), c, common::adamw())?;
        let mut losses = Vec::new();
        for k in 0..steps {
            let b = get_batch(&tokens, k, batch, seq, rank, world)?;
            losses.push(f.step(&b, batch * seq)?);
        }
        Ok((losses, f.memory_stats().reserved_bytes.all.peak))
    })
    .unwrap()
    .into_iter()
    .collect()
}

#[test]
fn seeded_init_is_the_same_model_at_every_world_size() {
    let cfg = small();
    let seed = 7;
    let rule = gpt2_init(cfg.n_layer);
    let seeded = |_| ParamInit::Seeded { seed, rule: &rule };

    // The single-process reference: every tensor materialised whole.
    let reference: Params = param_specs(&cfg)
        .into_iter()
        .map(|s| {
            let init = rule(&s.name, &s.shape).unwrap();
            let v = materialize(&s.name, &s.shape, &init, seed).unwrap();
            (s.name, v)
        })
        .collect();

    let runs = [
        (1, FullShard),
        (2, FullShard),
        (3, FullShard),
        (4, FullShard),
        (2, ShardGradOp),
        (4, HybridShard),
        (3, NoShard),
    ];
    for (world, strategy) in runs {
        let ranks = build(cfg, world, strategy, seeded);
        let peaks: Vec<u64> = ranks.iter().map(|r| r.peak).collect();
        println!("{strategy:?} at world {world}: construction peaks {peaks:?}");
        for (rank, r) in ranks.iter().enumerate() {
            let what = format!("{strategy:?} at world {world}, rank {rank}");
            assert_bitwise(&r.params, &reference, &what);
            // Only the shards: each rank wrote its own, with no unit-sized buffer.
            assert_eq!(r.peak, r.shards, "{what}: construction peak");
        }
    }

    // The model trains, and alike on 1 and 4 ranks.
    let one = train(cfg, 1, FullShard, None, 3, seeded).unwrap();
    let four = train(cfg, 4, FullShard, None, 3, seeded).unwrap();
    let (l1, l4) = (&one[0].0, &four[0].0);
    println!("losses: world 1 {l1:?}, world 4 {l4:?}");
    assert!(
        four.iter().all(|(l, _)| l == l4),
        "the loss differs by rank"
    );
    assert!(l1[2] < l1[0], "the loss does not decrease: {l1:?}");
    for (a, b) in l1.iter().zip(l4) {
        let rel = (f64::from(*a) - f64::from(*b)).abs() / f64::from(a.abs());
        assert!(rel <= 1e-5, "losses {l1:?} (world 1) vs {l4:?} (world 4)");
    }
}

#[test]
fn construction_peak_is_the_shards_plus_at_most_one_unit() {
    // The caching allocator reserves whole segments: buffers of up to 1 MiB share 2 MiB
    // segments, larger ones take 20 MiB segments (or their own above 10 MiB). A GPT such as
    // (4, 2, 32, 16, 96) has 0.2 MiB of parameters, far below a single segment, so no
    // capacity could be below its full size and still hold one segment. Here every block
    // (0.76 MiB unsharded) is below 1 MiB, so everything lives in 2 MiB segments, and the
    // model is 24 such blocks (18.2 MiB): a rank at world 4 holds a quarter of the parameters
    // and of the gradients (9.1 MiB) plus the unsharded root and a few blocks in flight.
    let cfg = GptConfig::new(24, 4, 128, 16, 96).unwrap();
    const WORLD: usize = 4;
    let seed = 11;
    let rule = gpt2_init(cfg.n_layer);
    let seeded = |_| ParamInit::Seeded { seed, rule: &rule };
    let full_model_bytes = cfg.num_params() * 4;

    // Construction allocates exactly the shards: no unit buffer at all.
    let plan = gpt_block_plan(&cfg);
    let peaks = ring::run_ranks(WORLD, opts(), |comm| {
        let f = FsdpGpt::with_init(
            Box::new(comm),
            cfg,
            &plan,
            seeded(0),
            config(FullShard, WORLD),
            common::adamw(),
        )
        .unwrap();
        (f.memory_stats().allocated_bytes.all.peak, shards_bytes(&f))
    })
    .unwrap();
    println!("construction peaks (allocated, shards) at world {WORLD}: {peaks:?}");
    for (rank, (peak, shards)) in peaks.iter().enumerate() {
        assert_eq!(peak, shards, "rank {rank}");
    }

    // What the allocator reserves over construction and two steps with no limit (4 GiB).
    let free = train(cfg, WORLD, FullShard, None, 2, seeded).unwrap();
    let need = free.iter().map(|r| r.1).max().unwrap() as usize;
    // A capacity of 90% of the full model, in whole 2 MiB segments.
    let segment = 2 << 20;
    let capacity = full_model_bytes * 9 / 10 / segment * segment;
    println!(
        "full model {full_model_bytes} bytes, reserved peak per rank without a limit {need}, \
         capacity {capacity}"
    );
    assert!(capacity < full_model_bytes, "the limit is no limit");
    assert!(need <= capacity, "the run needs {need} bytes > {capacity}");

    // Under that capacity, world 4 constructs and trains, with the same losses.
    let capped = train(cfg, WORLD, FullShard, Some(capacity), 2, seeded).unwrap();
    for (rank, (losses, reserved)) in capped.iter().enumerate() {
        assert!(
            losses.iter().all(|l| l.is_finite()),
            "rank {rank}: {losses:?}"
        );
        assert_eq!(losses, &free[rank].0, "rank {rank}");
        assert!(*reserved as usize <= capacity, "rank {rank}");
    }

    // The same capacity cannot hold the model on one rank: the limit is real.
    let alone = train(cfg, 1, FullShard, Some(capacity), 0, seeded);
    assert!(
        matches!(alone, Err(FsdpError::Alloc(_))),
        "one rank under {capacity} bytes: {alone:?}"
    );
}

#[test]
fn sync_module_states_broadcasts_rank_0s_model() {
    let cfg = small();
    let params = named_params(&cfg, init_params(&cfg, 3)).unwrap();
    let from_rank0 = |rank: usize| ParamInit::SyncFromRank0((rank == 0).then_some(&params));
    for world in [2, 3] {
        let ranks = build(cfg, world, FullShard, from_rank0);
        let peaks: Vec<u64> = ranks.iter().map(|r| r.peak).collect();
        println!(
            "SyncFromRank0 at world {world}: construction peaks {peaks:?} (shards {}, + one \
             unit {})",
            ranks[0].shards,
            ranks[0].shards + ranks[0].unit
        );
        for (rank, r) in ranks.iter().enumerate() {
            let what = format!("world {world}, rank {rank}");
            assert_bitwise(&r.params, &params, &what);
            // The shards plus the unit being broadcast, at most one at a time.
            assert!(r.peak > r.shards, "{what}: no unit buffer?");
            assert!(
                r.peak <= r.shards + r.unit,
                "{what}: peak {} > shards {} + one unit {}",
                r.peak,
                r.shards,
                r.unit
            );
        }
    }

    // Values on the wrong ranks: every rank fails (the failing rank leaves the group, and the
    // others' broadcast reports it), none hangs.
    let plan = gpt_block_plan(&cfg);
    let short = RingOptions::default().with_timeout(Duration::from_secs(10));
    // Every rank passes values (rank 1 is wrong), or none does (rank 0 is wrong).
    for (case, values_everywhere, culprit) in [
        ("rank 1 passes values", true, 1),
        ("rank 0 passes none", false, 0),
    ] {
        let t = Instant::now();
        let results = ring::run_ranks(2, short.clone(), |comm| {
            let init = ParamInit::SyncFromRank0(values_everywhere.then_some(&params));
            let r = FsdpGpt::with_init(
                Box::new(comm),
                cfg,
                &plan,
                init,
                config(FullShard, 2),
                common::adamw(),
            );
            r.err()
        })
        .unwrap();
        let elapsed = t.elapsed();
        println!("{case}: {results:?} in {elapsed:?}");
        assert!(elapsed < Duration::from_secs(8), "{case}: {elapsed:?}");
        assert!(
            matches!(results[culprit], Some(FsdpError::InvalidFsdpConfig { .. })),
            "{case}: rank {culprit}: {:?}",
            results[culprit]
        );
        assert!(
            results[1 - culprit].is_some(),
            "{case}: rank {} constructed",
            1 - culprit
        );
    }
}

/// A directory under the system's temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir =
            std::env::temp_dir().join(format!("fsdp-gpt-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// f32 → bf16 bits, rounding to nearest, ties to even (the values here are finite).
fn bf16(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// A safetensors file of `tensors` (name, shape, dtype, little-endian bytes).
fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, safetensors::Dtype, Vec<u8>)]) {
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, s, d, b)| {
            let view = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.as_str(), view)
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, &None).unwrap()).unwrap();
}

/// Every rank's construction result from the checkpoint at `path`.
fn load_at(
    cfg: GptConfig,
    world: usize,
    strategy: ShardingStrategy,
    path: &Path,
) -> Vec<Result<Built, FsdpError>> {
    let plan = gpt_block_plan(&cfg);
    ring::run_ranks(world, opts(), |comm| {
        let f = FsdpGpt::with_init(
            Box::new(comm),
            cfg,
            &plan,
            ParamInit::Safetensors(path),
            config(strategy, world),
            common::adamw(),
        )?;
        Ok(built(&f))
    })
    .unwrap()
}

#[test]
fn a_full_checkpoint_streams_into_the_shards() {
    let cfg = small();
    let params = named_params(&cfg, init_params(&cfg, 5)).unwrap();
    let tmp = TempDir::new("sharded-init");
    let path = tmp.0.join("model.safetensors");
    save_full(&path, &cfg, &params).unwrap();

    for (world, strategy) in [(1, FullShard), (2, FullShard), (3, FullShard), (2, NoShard)] {
        let ranks = load_at(cfg, world, strategy, &path);
        let peaks: Vec<u64> = ranks.iter().map(|r| r.as_ref().unwrap().peak).collect();
        println!("Safetensors, {strategy:?} at world {world}: construction peaks {peaks:?}");
        for (rank, r) in ranks.into_iter().enumerate() {
            let what = format!("{strategy:?} at world {world}, rank {rank}");
            let r = r.unwrap();
            assert_bitwise(&r.params, &params, &what);
            assert_eq!(r.peak, r.shards, "{what}: construction peak");
        }
    }

    // The same model in BF16: loaded as the bf16 values widened exactly.
    let specs = param_specs(&cfg);
    let mut widened = Params::new();
    let mut tensors = Vec::new();
    for s in &specs {
        let h: Vec<u16> = params[&s.name].iter().map(|&x| bf16(x)).collect();
        let w: Vec<f32> = h
            .iter()
            .map(|&h| f32::from_bits(u32::from(h) << 16))
            .collect();
        let bytes = h.iter().flat_map(|h| h.to_le_bytes()).collect();
        tensors.push((
            s.name.clone(),
            s.shape.clone(),
            safetensors::Dtype::BF16,
            bytes,
        ));
        widened.insert(s.name.clone(), w);
    }
    assert_ne!(widened, params, "the bf16 copy is not rounded");
    let bf16_path = tmp.0.join("bf16.safetensors");
    write_safetensors(&bf16_path, &tensors);
    for world in [1, 3] {
        for (rank, r) in load_at(cfg, world, FullShard, &bf16_path)
            .into_iter()
            .enumerate()
        {
            let r = r.unwrap();
            assert_bitwise(
                &r.params,
                &widened,
                &format!("bf16, world {world}, rank {rank}"),
            );
        }
    }

    // F32 tensors as `save_full` writes them.
    let f32_tensors = || -> Vec<_> {
        specs
            .iter()
            .map(|s| {
                let bytes = params[&s.name]
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect();
                (
                    s.name.clone(),
                    s.shape.clone(),
                    safetensors::Dtype::F32,
                    bytes,
                )
            })
            .collect()
    };
    // A missing tensor: the last (16 elements) of the last block, so that it lies in one
    // rank's shard only. Every rank must report it, not only that one.
    let missing = "transformer.h.1.mlp.c_proj.bias";
    let mut t = f32_tensors();
    t.retain(|(n, ..)| n != missing);
    let missing_path = tmp.0.join("missing.safetensors");
    write_safetensors(&missing_path, &t);
    // A wrong shape: `wpe` transposed (same number of elements).
    let wrong = "transformer.wpe.weight";
    let mut t = f32_tensors();
    for (n, s, ..) in &mut t {
        if n == wrong {
            s.reverse();
        }
    }
    let wrong_path = tmp.0.join("wrong_shape.safetensors");
    write_safetensors(&wrong_path, &t);
    for (p, name) in [(&missing_path, missing), (&wrong_path, wrong)] {
        for world in [1, 2, 3] {
            for (rank, r) in load_at(cfg, world, FullShard, p).into_iter().enumerate() {
                match r {
                    Err(FsdpError::Checkpoint { path, reason }) => {
                        assert_eq!(&path, p);
                        assert!(
                            reason.contains(name),
                            "world {world}, rank {rank}: {reason}"
                        );
                    }
                    Err(e) => panic!("{name}, world {world}, rank {rank}: {e}"),
                    Ok(_) => panic!("{name}, world {world}, rank {rank}: constructed"),
                }
            }
        }
    }
}
