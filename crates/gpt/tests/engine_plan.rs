//! The plan of the GPT on the engine on a device (`engine_plan`, `fsdp plan --device
//! --engine`): the engine's buffers and the kernels' buffers, predicted by a dry run of the
//! engine over the meta device driven by the GPT's pass over the meta operations, against the
//! host twins' counts of three steps of `EngineGpt::train_step` (the engine's caching
//! allocator on the host twin of a device, 1 ms per operation; the kernels' count): every
//! strategy, accumulation, bf16 products with activation checkpointing, offloaded shards.

mod common;

use std::time::Duration;

use fsdp::engine::{ComputeDevice, Fsdp, FsdpConfig, ParamInit, ShardingStrategy};
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::data::get_batch;
use fsdp_gpt::engine_gpt::EngineGpt;
use fsdp_gpt::engine_plan::{plan_engine_memory, EngineMemoryPlan, EnginePlanRun};
use fsdp_gpt::tree::gpt_block_plan;
use fsdp_kernels::gpt::{GptOps, GptPass, HostOps, HostProducts};

use common::training::{ring_options, Setup};

const SEQ: usize = 16;
/// Rows of a micro-batch on each rank.
const ROWS: usize = 2;

/// A run's settings.
#[derive(Clone, Copy, Debug)]
struct Case {
    world: usize,
    config: FsdpConfig,
    accum: usize,
    products: HostProducts,
    checkpointing: bool,
}

fn case(world: usize, strategy: ShardingStrategy) -> Case {
    Case {
        world,
        config: FsdpConfig::new(strategy),
        accum: 1,
        products: HostProducts::F32,
        checkpointing: false,
    }
}

/// Rank 0's measured peaks over 3 clipped steps: the engine's allocator (allocated and
/// reserved), the kernels' count, the host's (the engine's host allocator's reserved peak, the
/// optimizer state and, with the state placed on the device, one moment's copy).
fn measured(s: &Setup<fsdp::optim::AdamWConfig>, c: Case) -> Measured {
    let units = gpt_block_plan(&s.cfg);
    let world = c.world;
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let latency = Duration::from_millis(1);
        let dev =
            ComputeDevice::host_twin_with_latency(1 << 28, Default::default(), latency).unwrap();
        let init = ParamInit::Full(&s.init);
        let fsdp = Fsdp::new_on(Box::new(comm), dev, &units, init, c.config, s.opt).unwrap();
        let mut pass = GptPass::new(HostOps::with_products(c.products), s.cfg.dims()).unwrap();
        pass.set_activation_checkpointing(c.checkpointing);
        let mut gpt = EngineGpt::new(fsdp, pass).unwrap();
        let rows = ROWS * world;
        for k in 0..3u64 {
            let micro: Vec<_> = (0..c.accum as u64)
                .map(|m| get_batch(&s.tokens, k * c.accum as u64 + m, rows, SEQ, rank, world))
                .collect::<Result<_, _>>()
                .unwrap();
            gpt.train_step(&micro, rows * c.accum * SEQ, Some(1.0))
                .unwrap();
        }
        gpt.flush_steps().unwrap();
        gpt.synchronize().unwrap();
        let dev = gpt.compute_device().unwrap().memory_stats();
        let state: usize = gpt
            .param_groups()
            .iter()
            .map(|g| g.optimizer_state_bytes())
            .sum();
        // Placing the state copies one moment at a time through a host buffer: the largest
        // unit's shard in f32 (none offloaded: the state stays).
        let copy = match c.config.offload_params {
            true => 0,
            false => gpt
                .param_groups()
                .iter()
                .map(|g| g.layout().shard_numel() * 4)
                .max()
                .unwrap_or(0),
        };
        let host = gpt.memory_stats().reserved_bytes.all.peak + (state + copy) as u64;
        Measured {
            engine: dev.allocated_bytes.all.peak,
            reserved: dev.reserved_bytes.all.peak,
            activations: gpt.pass().ops().memory().peak,
            host,
            state: state as u64,
        }
    })
    .unwrap();
    out.swap_remove(0)
}

fn plan(s: &Setup<fsdp::optim::AdamWConfig>, c: Case) -> EngineMemoryPlan {
    let units = gpt_block_plan(&s.cfg);
    plan_engine_memory(&EnginePlanRun {
        cfg: s.cfg,
        units: &units,
        world: c.world,
        config: c.config,
        optim: s.opt.into(),
        rows: ROWS,
        micro_batches: c.accum,
        products: c.products,
        activation_checkpointing: c.checkpointing,
        attention: Default::default(),
        logits: Default::default(),
        copied_views: true,
        grad_clip: Some(1.0),
        steps: 2,
    })
    .unwrap()
}

/// What [`measured`] measures.
#[derive(Clone, Copy, Debug)]
struct Measured {
    engine: u64,
    reserved: u64,
    activations: u64,
    host: u64,
    state: u64,
}

/// The kernels' measured buffers and the host's exactly the plan's; the engine's from the plan
/// (the device keeping up with the host) to one unit's gradient more (the device behind it).
fn assert_within_plan(p: &EngineMemoryPlan, m: Measured, what: &str) {
    let Measured {
        engine,
        reserved,
        activations,
        host,
        state,
    } = m;
    assert_eq!(activations, p.activations_peak, "{what}");
    assert_eq!(host, p.host_peak, "{what}: the host's peak");
    assert_eq!(state, p.host_state, "{what}: the optimizer state");
    assert!(
        reserved >= p.engine_reserved && reserved <= p.engine_reserved + p.lag_margin,
        "{what}: reserved {reserved}, planned {} + {}",
        p.engine_reserved,
        p.lag_margin
    );
    assert!(
        engine >= p.engine_peak && engine <= p.engine_peak + p.lag_margin,
        "{what}: measured {engine}, planned {} + {}",
        p.engine_peak,
        p.lag_margin
    );
}

/// The host twins' peaks are the plan's, byte for byte: the engine's buffers (its caching
/// allocator on the device) and the kernels' buffers apart (on the host twins each counts its
/// own; on CUDA one allocator holds both, `peak_allocated`).
#[test]
fn the_plan_is_the_host_twins_count() {
    let s = Setup::new(2, 7, 42, common::adamw());
    let mut hybrid = case(4, ShardingStrategy::HybridShard);
    hybrid.config.ranks_per_node = Some(2);
    let mut accum = case(2, ShardingStrategy::FullShard);
    accum.accum = 2;
    let mut bf16 = case(2, ShardingStrategy::FullShard);
    bf16.products = HostProducts::Bf16Operands;
    bf16.checkpointing = true;
    let mut exact = 0;
    for c in [
        case(1, ShardingStrategy::FullShard),
        accum,
        case(2, ShardingStrategy::ShardGradOp),
        case(2, ShardingStrategy::NoShard),
        hybrid,
        bf16,
    ] {
        let p = plan(&s, c);
        let m = measured(&s, c);
        println!("{c:?}: {p:?}; measured {m:?}");
        assert_within_plan(&p, m, &format!("{c:?}"));
        exact += usize::from(m.engine == p.engine_peak && m.reserved == p.engine_reserved);
        // Together in one allocator (the kernels' buffers rounded to its blocks): above each.
        assert!(
            p.peak_allocated > p.engine_peak.max(p.activations_peak),
            "{c:?}"
        );
    }
    // Most runs are exact: the host twin kept up with the host there.
    assert!(exact >= 4, "{exact} exact runs");
}

/// Offloaded shards (CPU offload): the device holds the working set only — the plan's shards
/// and optimizer state on it are none — and the host twins' peaks are the plan's.
#[test]
fn the_plan_of_offloaded_shards_is_the_host_twins_count() {
    let s = Setup::new(2, 7, 42, common::adamw());
    for world in [1, 2] {
        let mut c = case(world, ShardingStrategy::FullShard);
        c.config.offload_params = true;
        let p = plan(&s, c);
        let m = measured(&s, c);
        println!("offloaded, world {world}: {p:?}; measured {m:?}");
        assert_eq!(
            (p.sharded_state, p.optimizer_state),
            (0, 0),
            "world {world}"
        );
        assert_within_plan(&p, m, &format!("world {world}"));
        // Below the plan of the same run with the shards on the device.
        let mut resident = c;
        resident.config.offload_params = false;
        let r = plan(&s, resident);
        assert!(
            p.peak_allocated < r.peak_allocated,
            "world {world}: {p:?} {r:?}"
        );
    }
}
